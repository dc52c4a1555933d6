"""``mloco eval`` of strangers' models and tokenizers: a hostile one is one ``error: <file>:
<fault>`` line, never a traceback, a hang, a huge allocation or a silently wrong result."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkpoint_factory import save_model, tiny_llama
from conftest import stdlib_corpus
from hostile import assert_refused, run_cli
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from mergekit_loco.cli import main
from mergekit_loco.train.model import load_pretrained
from mergekit_loco.train.tokenizer import train_tokenizer

EVAL = ["--tokens=256", "--seq-len=32"]
#: CPU seconds a refused hostile config may take (it took minutes, or 10 GB, before).
QUICK = 5.0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Iterator[str]:
    with stdlib_corpus(tmp_path_factory.mktemp("eval"), ["textwrap.py", "string.py"]) as folder:
        yield folder


@pytest.fixture(scope="module")
def tokenizer(corpus) -> PreTrainedTokenizerFast:
    return train_tokenizer([[(Path(corpus) / "textwrap.py").read_text()]], vocab_size=300)


def model_folder(
    path: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast | None = None
) -> Path:
    """``model`` saved as a Hugging Face folder, with ``tokenizer`` beside it if given."""
    save_model(model, path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


def hostile_folder(path: Path, config: dict, weights: dict[str, torch.Tensor] | None) -> Path:
    """``config`` as config.json beside ``weights`` (default: zeros of the shapes it asks for)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text("{}")  # never reached: the model is refused first
    if weights is None:
        built = AutoConfig.for_model(**config)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(built)
        weights = {name: torch.zeros(t.shape) for name, t in skeleton.state_dict().items()}
    save_file(weights, path / "model.safetensors")
    return path


def eval_output(capsys, folder: Path, corpus: str, *args: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of ``mloco eval folder --data corpus ARGS``."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["eval", str(folder), f"--data={corpus}", *EVAL, *args])
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


def timed_eval(capsys, folder: Path, corpus: str) -> tuple[int, str]:
    """Exit code and stderr of ``mloco eval folder``, asserting it took under QUICK CPU seconds."""
    start = time.process_time()
    code, err, _ = run_cli(capsys, "eval", folder, f"--data={corpus}", *EVAL)
    assert time.process_time() - start < QUICK
    return code, err


def test_a_config_with_more_layers_than_the_weights_hold_tensors_is_refused_first(
    capsys, tmp_path, corpus
):
    """3,000,000 layers beside 4 bytes of weights: refused before the meta skeleton is built
    (building it ran > 90 s at 4.5 GB)."""
    config = {"model_type": "llama", "vocab_size": 8, "hidden_size": 4, "num_attention_heads": 1,
              "intermediate_size": 4, "num_hidden_layers": 3_000_000}  # fmt: skip
    folder = hostile_folder(tmp_path / "deep", config, {"x": torch.zeros(1)})
    code, err = timed_eval(capsys, folder, corpus)
    weights = folder / "model.safetensors"
    assert_refused(code, err, f"error: {folder / 'config.json'}: num_hidden_layers 3000000 is "
                   f"more than the 1 tensors the weights {weights} hold")  # fmt: skip


@pytest.mark.parametrize(
    ("config", "buffer"),
    [
        ({"model_type": "gpt_neo", "vocab_size": 8, "hidden_size": 4, "num_layers": 1,
          "num_heads": 1, "attention_types": [[["global"], 1]], "intermediate_size": 4},
         "transformer.h.0.attn.attention.bias"),
        ({"model_type": "gpt_bigcode", "vocab_size": 8, "n_embd": 4, "n_layer": 1, "n_head": 1,
          "n_inner": 4}, "transformer.bias"),
    ],
)  # fmt: skip
def test_buffers_the_weights_do_not_hold_are_bounded_by_the_weights(
    capsys, tmp_path, corpus, config, buffer
):
    """100,000 positions beside 1.6 MB of weights: a 10 GB positions x positions causal mask,
    built by the config and never loaded, is refused (naming it and its bytes) before it is
    allocated; 2,048 positions (a 4 MB mask, within the floor) still load."""
    positions = (
        "n_positions" if config["model_type"] == "gpt_bigcode" else "max_position_embeddings"
    )
    folder = hostile_folder(tmp_path / "wide", config | {positions: 100_000}, None)
    code, err = timed_eval(capsys, folder, corpus)
    assert_refused(code, err, f"error: {folder / 'config.json'}: builds 10,000,000,000 bytes of "
                   f"tensors the weights do not hold (largest {buffer!r} ")  # fmt: skip
    usual = hostile_folder(tmp_path / "usual", config | {positions: 2048}, None)
    assert load_pretrained(usual).config.model_type == config["model_type"]


def test_an_overflowing_perplexity_is_inf_and_the_loss_is_printed(
    capsys, tmp_path, corpus, tokenizer, monkeypatch
):
    """A loss above 709.78 (lm_head x 1e4): exp overflows; perplexity is inf in the table and
    null in strict JSON, the loss is the result (it was ``error: math range error``)."""
    model = tiny_llama(vocab_size=len(tokenizer))
    model.lm_head.weight.data *= 1e4
    folder = model_folder(tmp_path / "loud", model, tokenizer)
    code, out, err = eval_output(capsys, folder, corpus, "--json")
    assert code == 0, err

    def refuse(constant: str) -> None:
        raise AssertionError(f"invalid JSON constant {constant}")

    [record] = json.loads(out, parse_constant=refuse)
    assert record["loss"] > 709.79 and record["perplexity"] is None
    monkeypatch.setenv("COLUMNS", "400")
    code, out, _ = eval_output(capsys, folder, corpus)
    assert code == 0 and f"{record['loss']:.4f} (inf)" in out


@pytest.mark.parametrize("fault", ["nan_weight", "negative_rope_theta"])
def test_a_non_finite_loss_is_an_error_naming_the_model(capsys, tmp_path, corpus, tokenizer, fault):
    """NaN weights, or ``rope_theta: -1`` (NaN rotations): no result passed off as a loss (it
    printed ``"loss": NaN``, invalid JSON, and exit 0). NaN weights are refused as they are
    read, naming the tensor; finite weights whose logits are not finite, by the loss."""
    if fault == "nan_weight":
        model = tiny_llama(vocab_size=len(tokenizer))
        model.model.norm.weight.data[0] = math.nan
    else:
        model = tiny_llama(vocab_size=len(tokenizer), rope_theta=-1.0)
    folder = model_folder(tmp_path / fault, model, tokenizer)
    code, out, err = eval_output(capsys, folder, corpus, "--json")
    if fault == "nan_weight":
        assert_refused(code, err, f"error: model {folder}: tensor 'model.norm.weight' holds NaN")
    else:
        assert_refused(code, err, f"error: {folder}: loss nan on {corpus}: the model's logits "
                       "are not finite")  # fmt: skip
    assert out == ""


def test_tokenizer_ids_beyond_the_model_vocab_name_both(capsys, tmp_path, corpus, tokenizer):
    """A 300-token tokenizer for a model of vocab_size 8 (it was ``IndexError: index out of
    range in self``)."""
    folder = model_folder(tmp_path / "small", tiny_llama(vocab_size=8))
    tokenizer_folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(tokenizer_folder)
    code, err, _ = run_cli(capsys, "eval", folder, f"--data={corpus}", *EVAL,
                           f"--tokenizer={tokenizer_folder}")  # fmt: skip
    line = assert_refused(code, err, f"error: {tokenizer_folder}: the tokenizer's ids reach ",
                          f"beyond the vocab_size 8 of model {folder}")  # fmt: skip
    assert int(line.split("reach ")[1].split(",")[0]) >= 8


@pytest.mark.parametrize(
    ("content", "cause"),
    [
        ("{}", "KeyError: 'added_tokens'"),
        ('{"model": {"type": "BPE", "vocab": 5, "merges": 7}}', "KeyError: 'added_tokens'"),
        ('{"added_tokens": 5}', "TypeError: "),
        ("[]", "TypeError: "),
    ],
)
def test_a_tokenizer_json_of_the_wrong_structure_names_the_file(
    capsys, tmp_path, corpus, tokenizer, content, cause
):
    """Valid JSON that is no tokenizer (it was ``error: added_tokens``)."""
    folder = model_folder(tmp_path / "model", tiny_llama(vocab_size=len(tokenizer)))
    (folder / "tokenizer.json").write_text(content)
    code, err, _ = run_cli(capsys, "eval", folder, f"--data={corpus}", *EVAL)
    assert_refused(code, err, f"error: {folder / 'tokenizer.json'}: not a tokenizer "
                   f"transformers can read ({cause}")  # fmt: skip


def test_a_training_checkpoint_folder_points_to_its_parameters(capsys, tmp_path, corpus):
    """``eval RUN/checkpoints/round-K`` (before: "found rng-rank-0000.pt: convert it to
    safetensors first" though the folder holds global.safetensors)."""
    checkpoint = tmp_path / "run" / "checkpoints" / "round-000002"
    checkpoint.mkdir(parents=True)
    save_file({"w": torch.zeros(2)}, checkpoint / "global.safetensors")
    torch.save({}, checkpoint / "rng-rank-0000.pt")
    code, err, _ = run_cli(capsys, "eval", checkpoint, f"--data={corpus}", *EVAL)
    assert_refused(code, err, "a training checkpoint", str(checkpoint / "global.safetensors"),
                   f"--tokenizer {tmp_path / 'run' / 'final'}")  # fmt: skip
    assert "convert it to safetensors" not in err


def test_a_lora_adapter_folder_says_to_merge_it_into_its_base_first(capsys, tmp_path, corpus):
    """``eval ADAPTER`` (before: "no model.safetensors or model.safetensors.index.json in this
    folder", no word of what the folder is, though merge reads it), and the adapter given as
    ``merge --base``: both say what it is and the command that makes a whole model of it;
    that command runs, with no "nothing is merged" warning, and gives base + the adapter's
    delta, computed here by hand."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    lora_a, lora_b = torch.full((2, 3), 0.5), torch.full((4, 2), 0.25)
    save_file({"base_model.model.w.lora_A.weight": lora_a,
               "base_model.model.w.lora_B.weight": lora_b},
              adapter / "adapter_model.safetensors")  # fmt: skip
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2, "lora_alpha": 4}')
    base = tmp_path / "base.safetensors"
    save_file({"w.weight": torch.ones(4, 3)}, base)
    advice = f"merge it into that base first: mloco merge {adapter} --base BASE -m ta -o OUT"
    code, err, _ = run_cli(capsys, "eval", adapter, f"--data={corpus}", *EVAL)
    assert_refused(code, err, f"{adapter}: no model.safetensors", "a PEFT LoRA adapter", advice)
    code, err, _ = run_cli(capsys, "merge", base, "--base", adapter, "-m", "ta",
                           "-o", tmp_path / "never.safetensors")  # fmt: skip
    assert_refused(code, err, f"{adapter}: no model.safetensors", "a PEFT LoRA adapter", advice)
    out = tmp_path / "whole.safetensors"
    code, err, _ = run_cli(capsys, "merge", adapter, "--base", base, "-m", "ta", "-o", out, "-q")
    assert code == 0 and err == "", err
    expected = torch.ones(4, 3) + 4 / 2 * lora_b @ lora_a  # scaling = lora_alpha / r
    assert torch.equal(load_file(out)["w.weight"], expected)


def test_eval_of_no_dataset_is_one_error_before_any_warning(capsys, tmp_path, tokenizer):
    """``--data ""`` (before: two garbled warnings about "the held-out tokens of  ", then the
    error) and a tokenizer folder with no tokenizer file (before: transformers' advice to
    install sentencepiece or tiktoken)."""
    folder = model_folder(tmp_path / "model", tiny_llama(vocab_size=len(tokenizer)), tokenizer)
    (tmp_path / "config.json").write_text(json.dumps({"data": "stdlib", "val_tokens": 256}))
    code, err, _ = run_cli(capsys, "eval", folder, "--data=", *EVAL)
    assert assert_refused(code, err) == ("error: give at least one model and one dataset (--data)")
    for tokens in ("0", "-5"):  # before: "need val_tokens >= 0 and max_train_tokens >= 1"
        code, err, _ = run_cli(capsys, "eval", folder, "--data=stdlib", "--tokens", tokens)
        assert assert_refused(code, err) == f"error: --tokens must be >= 1, got {tokens}"
    for seed in (-1, 2**63):  # before: evaluated a split no training run of train holds out
        code, err, _ = run_cli(capsys, "eval", folder, "--data=stdlib", f"--seed={seed}")
        assert assert_refused(code, err) == f"error: --seed: {seed} is not an integer in [0, 2**63)"
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    (empty / "README.md").write_text("notes\n")
    code, err, _ = run_cli(capsys, "eval", folder, "--data=stdlib", "--tokenizer", empty, *EVAL)
    assert_refused(code, err, f"tokenizer {str(empty)!r} holds no tokenizer file (one of "
                   "tokenizer.json, tokenizer_config.json")  # fmt: skip
