"""Model presets (Llama) or any Hugging Face causal-LM config, seeded construction and a
bit-exact parameter checksum.

Every preset is a Hugging Face ``LlamaForCausalLM`` with untied embeddings, RMSNorm (eps 1e-5),
RoPE, SwiGLU, no biases and full multi-head attention (``num_key_value_heads == heads``), as in
the reference experiments. Parameters: ``2 * vocab * hidden`` (embeddings + lm_head)
``+ layers * (4 * hidden^2 + 3 * hidden * ffn + 2 * hidden) + hidden``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from mergekit_loco.io.files import read_json, shown
from mergekit_loco.io.hf import NO_REMOTE_CODE, check_hf_folder, refuse_custom_code

if TYPE_CHECKING:
    from mergekit_loco.io.reader import CheckpointReader

_COMMON = {
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "initializer_range": 0.02,
}

MODEL_PRESETS: dict[str, dict] = {
    "micro": {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 256,
        "vocab_size": 4096,
        **_COMMON,
    },
    "nano": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 352,
        "max_position_embeddings": 1024,
        "vocab_size": 4096,
        **_COMMON,
    },
    "178m": {
        "hidden_size": 1024,
        "num_hidden_layers": 9,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 2688,
        "max_position_embeddings": 2048,
        "vocab_size": 32000,
        **_COMMON,
    },
    "512m": {
        "hidden_size": 1536,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "intermediate_size": 5440,
        "max_position_embeddings": 2048,
        "vocab_size": 32000,
        **_COMMON,
    },
}

ATTENTION_IMPLEMENTATION = "sdpa"  # deterministic on CPU and faster there than "eager"
#: The loss transformers computes from ``labels``, said outright: it guesses it from the class
#: name, and for one that does not say it (``GPT2LMHeadModel``) warns ``loss_type=None ...
#: unrecognized`` on every process before using this one.
CAUSAL_LM_LOSS = "ForCausalLM"


def model_config(
    spec: str,
    vocab_size: int,
    bos_id: int | None = None,
    eos_id: int | None = None,
) -> PretrainedConfig:
    """The model config of a preset name or of a JSON file (a Hugging Face config.json or plain
    kwargs, or a folder holding one).

    Presets and files without ``model_type`` (or with "llama") are Llamas: the file's keys
    override the house defaults (untied embeddings, eps 1e-5, no biases). Any other causal-LM
    ``model_type`` transformers knows (gpt2, qwen2, mistral, ...) takes the file's keys over
    transformers' defaults for that model. ``vocab_size``, ``bos_id`` and ``eos_id`` override
    both. Only transformers' own model classes are used (no remote code).
    """
    if spec in MODEL_PRESETS:
        kwargs = dict(MODEL_PRESETS[spec])
    else:
        kwargs = _read_config_file(spec)
    model_type = kwargs.pop("model_type", "llama")
    if vocab_size < 1:
        raise ValueError(f"model {spec!r}: vocab_size must be >= 1, got {vocab_size}")
    kwargs.pop("architectures", None)
    if model_type == "llama":
        kwargs = {**_COMMON, **kwargs}
        kwargs.setdefault("num_key_value_heads", kwargs.get("num_attention_heads"))
    kwargs.update(vocab_size=vocab_size, bos_token_id=bos_id, eos_token_id=eos_id)
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"model {spec!r}: transformers knows no model_type {model_type!r}")
    try:
        config = AutoConfig.for_model(
            model_type, **kwargs, attn_implementation=ATTENTION_IMPLEMENTATION
        )
    except Exception as error:  # transformers validates with its own exception types
        raise ValueError(f"model {spec!r}: invalid {model_type!r} config: {error}") from error
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(
            f"model {spec!r}: model_type {model_type!r} is not a causal language model "
            "(AutoModelForCausalLM cannot build it)"
        )
    return config


def _read_config_file(spec: str) -> dict:
    presets = ", ".join(MODEL_PRESETS)
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model {spec!r}: not a preset ({presets}) nor a JSON file")
    kwargs = read_json(path, "model config")  # a regular file, strict JSON, bounded
    if not isinstance(kwargs, dict):
        raise ValueError(f"model config {str(path)!r} must hold a JSON object (presets: {presets})")
    refuse_custom_code(path, kwargs)
    return kwargs


def build_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """A float32 causal LM of ``config`` initialised from ``seed`` alone, leaving the global RNG
    untouched. The same config and seed give bit-identical parameters on every process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    model.loss_type = CAUSAL_LM_LOSS
    return model.to(torch.float32)


def parameter_checksum(params: Mapping[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every tensor, in sorted name order."""
    digest = hashlib.sha256()
    for name in sorted(params):
        tensor = params[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def count_parameters(model: torch.nn.Module) -> int:
    """Number of scalar parameters (embeddings and lm_head included)."""
    return sum(parameter.numel() for parameter in model.parameters())


#: Bytes a config may build beyond the weights (a causal mask, RoPE frequencies): the weights'
#: own bytes, and at least this.
MIN_UNSAVED_LIMIT = 1 << 28  # 256 MiB


def load_pretrained(
    path: str | Path, what: str = "model", config_folder: str | Path | None = None
) -> PreTrainedModel:
    """The float32 causal LM of a Hugging Face folder or a ``.safetensors`` file with
    ``config.json`` beside it (or in ``config_folder``), read as hostile input
    (:func:`checked_config`) before anything is allocated."""
    from mergekit_loco.io import open_checkpoint

    with open_checkpoint(path) as reader:
        config, tied = checked_config(reader, path, what, config_folder)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(finite_weights(reader, path, what), strict=False)
    if tied:
        model.tie_weights()
    model.loss_type = CAUSAL_LM_LOSS
    return model.to(torch.float32)


def finite_weights(reader: CheckpointReader, path: str | Path, what: str) -> dict:
    """Every tensor ``reader`` reads, each refused if it holds NaN or Inf (a model trained from
    it would fail in its first round, blaming a worker's delta)."""
    from mergekit_loco.task_vector import all_finite

    weights = {}
    for name in reader.names():
        tensor = reader.get(name)
        if tensor.is_floating_point() and not all_finite(tensor):
            raise ValueError(f"{what} {shown(path)}: tensor {name!r} holds NaN or Inf")
        weights[name] = tensor
    return weights


def check_pretrained(path: str | Path, what: str = "model") -> PretrainedConfig:
    """Refuse what :func:`load_pretrained` would refuse, reading headers and config only; the
    checked config."""
    from mergekit_loco.io import open_checkpoint

    with open_checkpoint(path) as reader:
        return checked_config(reader, path, what)[0]


def checked_config(
    reader: CheckpointReader, path: str | Path, what: str, config_folder: str | Path | None = None
) -> tuple[PretrainedConfig, set[str]]:
    """The config of the checkpoint ``reader`` reads and its tied tensor names, checked so that
    it cannot make us allocate much more than the weights hold: it may ask for at most as many
    layers as the weights hold tensors; it is built on the meta device, where its tensor names
    and shapes must be the weights'; and what it builds beyond them (buffers such as a causal
    mask) must fit in ``max(weights' bytes, MIN_UNSAVED_LIMIT)``. A config transformers cannot
    build is one error naming the file. ``config_folder``: where ``config.json`` is (default: the
    folder of the weights)."""
    config_folder = Path(config_folder) if config_folder is not None else reader.config_dir
    config_file = config_folder / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"{what} {shown(path)}: no config.json beside the weights ({shown(config_folder)})"
        )
    folder = check_hf_folder(config_folder, what)
    config = _built(config_file, AutoConfig.from_pretrained, folder, **NO_REMOTE_CODE)
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > len(reader):  # each layer costs time on meta
        raise ValueError(
            f"{shown(config_file)}: num_hidden_layers {layers} is more than the "
            f"{len(reader)} tensors the weights {shown(reader.weights_file)} hold"
        )
    return config, checked_fit(reader, path, what, config, shown(config_file))


def checked_fit(
    reader: CheckpointReader, path: str | Path, what: str, config: PretrainedConfig, source: str
) -> set[str]:
    """The tied tensor names of ``config``'s model, built on the meta device, after checking
    that the weights ``reader`` reads hold its tensors with its shapes, and nothing else, and
    that what it builds beyond them (buffers such as a causal mask) fits in
    ``max(weights' bytes, MIN_UNSAVED_LIMIT)``. ``source`` names where ``config`` comes from."""
    with torch.device("meta"):
        skeleton = _built(source, AutoModelForCausalLM.from_config, config, dtype=torch.float32)
    tied = set(getattr(skeleton, "_tied_weights_keys", None) or ())
    tied = tied if config.tie_word_embeddings else set()
    state = skeleton.state_dict()
    expected = {n: tuple(t.shape) for n, t in state.items() if n not in tied}
    present = set(reader.names())
    for name, shape in expected.items():
        if name not in present:
            raise ValueError(f"{what} {shown(path)}: tensor {name!r} is missing for a "
                             f"{config.model_type} model")  # fmt: skip
        if tuple(reader.shape(name)) != shape:
            raise ValueError(
                f"{what} {shown(path)}: tensor {name!r} is {list(reader.shape(name))} in the "
                f"weights but {list(shape)} by {source}"
            )
        if state[name].is_floating_point() and not reader.dtype(name).is_floating_point:
            raise ValueError(
                f"{what} {shown(path)}: tensor {name!r} is {reader.dtype(name)}, not a "
                "floating-point weight"
            )
    unexpected = sorted(present - set(state))
    if unexpected:
        raise ValueError(f"{what} {shown(path)}: tensor {unexpected[0]!r} is unexpected for "
                         f"a {config.model_type} model")  # fmt: skip
    weight_bytes = sum(reader.entry(name).end - reader.entry(name).begin for name in present)
    _refuse_unsaved_bulk(skeleton, present | tied, weight_bytes, source)
    return tied


def position_limit(config: PretrainedConfig) -> tuple[int, str] | None:
    """``(positions, config key)``: the most tokens a sequence of ``config``'s model may hold
    when it embeds positions with a learned table (GPT-2's ``n_positions``, OPT's
    ``max_position_embeddings``); None for positions computed on the fly (rotary: Llama,
    Qwen2, Mistral run past ``max_position_embeddings``)."""
    key = next((k for k in ("n_positions", "max_position_embeddings")
                if isinstance(getattr(config, k, None), int)), None)  # fmt: skip
    if key is None:
        return None
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tokens = skeleton.get_input_embeddings()
    tables = [m for m in skeleton.modules() if isinstance(m, torch.nn.Embedding)]
    tables = [m for m in tables if m is not tokens]
    return (getattr(config, key), key) if tables else None


def check_seq_len(config: PretrainedConfig, seq_len: int, model: str | Path) -> None:
    """Refuse a ``--seq-len`` longer than ``model``'s :func:`position_limit`: one line naming
    the option and the limit (the forward pass would fail with ``index out of range``)."""
    limit = position_limit(config)
    if limit is not None and seq_len > limit[0]:
        raise ValueError(
            f"--seq-len {seq_len}: model {shown(model)} embeds at most {limit[0]} positions "
            f"({limit[1]} in its config); pass --seq-len {limit[0]} or less"
        )


def checkpoint_vocab(reader: CheckpointReader, spec: str) -> int:
    """The rows of the input embedding of the weights ``reader`` reads, found by the name model
    ``spec`` gives it (1 when they hold no such tensor or one of no rows: the fit check then
    names it)."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model_config(spec, 1))
    embedding = skeleton.get_input_embeddings().weight
    name = next(n for n, p in skeleton.named_parameters() if p is embedding)
    return max(reader.shape(name)[0], 1) if name in reader and reader.shape(name) else 1


def check_weights_fit(reader: CheckpointReader, path: str | Path, spec: str, what: str) -> None:
    """Refuse weights without a config (``--init weights.safetensors``) that model ``spec``
    does not hold, vocabulary rows aside (they are the checkpoint's): one line naming the first
    tensor that does not fit, both shapes, and the ``--model`` presets that fit, if any."""
    config = model_config(spec, checkpoint_vocab(reader, spec))
    try:
        checked_fit(reader, path, what, config, f"--model {spec}")
    except ValueError as error:
        fitting = [name for name in MODEL_PRESETS if name != spec and fits(reader, name)]
        advice = (
            f"it fits --model {' or '.join(fitting)}"
            if fitting
            else "no --model preset fits it: pass --model the config.json of the model it came "
            "from, or put that config.json beside the weights"
        )
        raise ValueError(f"{error}; {advice}") from None


def fits(reader: CheckpointReader, spec: str) -> bool:
    """Whether model ``spec`` holds exactly the weights ``reader`` reads (vocabulary aside)."""
    config = model_config(spec, checkpoint_vocab(reader, spec))
    try:
        checked_fit(reader, reader.path, "model", config, spec)
    except ValueError:
        return False
    return True


Built = TypeVar("Built")


def _built(source: str | Path, build: Callable[..., Built], *args, **kwargs) -> Built:
    """``build(*args, **kwargs)``; whatever transformers raises on a malformed config becomes
    one line naming ``source`` (its config file)."""
    try:
        return build(*args, **kwargs)
    except Exception as error:  # transformers raises all kinds of errors on a malformed config
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ValueError(f"{shown(source)}: not a model transformers can build ({cause})") from None


def _refuse_unsaved_bulk(
    skeleton: torch.nn.Module, provided: set[str], weight_bytes: int, config_file: str
) -> None:
    """Refuse a meta-device model whose parameters and buffers other than the ``provided``
    names (built by the config, never loaded) take more than ``max(weight_bytes,
    MIN_UNSAVED_LIMIT)`` bytes: a ``positions x positions`` mask of a 1 MB checkpoint."""
    unsaved = [
        (name, tensor.numel() * tensor.element_size(), list(tensor.shape))
        for name, tensor in [*skeleton.named_parameters(), *skeleton.named_buffers()]
        if name not in provided
    ]
    limit = max(weight_bytes, MIN_UNSAVED_LIMIT)
    total = sum(size for _, size, _ in unsaved)
    if total > limit:
        name, size, shape = max(unsaved, key=lambda item: item[1])
        raise ValueError(
            f"{config_file}: builds {total:,} bytes of tensors the weights do not hold "
            f"(largest {name!r} {shape}, {size:,} bytes), more than the {limit:,} allowed "
            f"beside {weight_bytes:,} bytes of weights"
        )
