"""``mloco train --model`` with any Hugging Face causal-LM config.json, and ``--init`` with any
such checkpoint: tiny GPT-2, Qwen2 and Mistral configs written here (nothing downloaded)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import stdlib_corpus
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedTokenizerFast,
    Qwen2Tokenizer,
)

from mergekit_loco.cli import main
from mergekit_loco.train import data as data_module
from mergekit_loco.train.tokenizer import batch_encoder, load_or_train_tokenizer, load_tokenizer

TINY_FLAGS = [
    "--workers", "2", "--inner-steps", "2", "--global-batch", "4", "--seq-len", "32",
    "--tokens", "768", "--vocab-size", "512", "--val-tokens", "1024", "--device", "cpu",
    "--quiet",
]  # fmt: skip
CONFIGS = {
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64},
    "qwen2": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2},
    "mistral": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": None},
}  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Iterator[str]:
    with stdlib_corpus(tmp_path_factory.mktemp("corpus"), ("textwrap.py", "string.py")) as path:
        yield path


def train_cli(*args: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["train", *TINY_FLAGS, *args])
    assert exited.value.code in (0, None)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_train_any_causal_lm_config(corpus, tmp_path, model_type):
    """IsoLoCo on the model's matrices; the final folder is that architecture and the global
    parameters of the last checkpoint are its weights."""
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps({"model_type": model_type, **CONFIGS[model_type]}))
    out = tmp_path / "run"
    train_cli("--model", str(config_file), "--preset", "isoloco", "--data", corpus,
              "--out", str(out))  # fmt: skip
    saved = json.loads((out / "final" / "config.json").read_text())
    assert saved["model_type"] == model_type and saved["vocab_size"] == 512
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    final = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < final["val_loss"] < 10
    checkpoint = load_file(out / "checkpoints" / "round-000003" / "global.safetensors")
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), checkpoint[name]), name


def test_init_from_a_gpt2_checkpoint(corpus, tmp_path):
    """``--init`` a GPT-2 folder (weights + config.json): the run starts from its weights."""
    torch.manual_seed(0)
    start = GPT2LMHeadModel(GPT2Config(vocab_size=600, **CONFIGS["gpt2"]))
    start.save_pretrained(tmp_path / "gpt2")
    out = tmp_path / "tuned"
    train_cli("--init", str(tmp_path / "gpt2"), "--preset", "dp", "--data", corpus,
              "--out", str(out), "--stop-after", "1", "--checkpoint-every", "1")  # fmt: skip
    (checkpoint,) = (out / "checkpoints").glob("round-*")
    tuned = load_file(checkpoint / "global.safetensors")
    assert set(tuned) == {name for name, _ in start.named_parameters()}
    moved = tuned["transformer.h.0.mlp.c_fc.weight"] - start.transformer.h[0].mlp.c_fc.weight
    assert 0 < moved.abs().max() < 0.1  # one round of small AdamW steps from the init


def test_a_gpt2_run_prints_no_loss_type_warning(corpus, tmp_path):
    """``GPT2LMHeadModel``'s class name does not tell transformers which loss ``labels`` ask
    for; the models mloco builds say it, so no ``loss_type=None ... unrecognized`` warning
    (before: one per process)."""
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps({"model_type": "gpt2", **CONFIGS["gpt2"]}))
    command = [sys.executable, "-m", "mergekit_loco", "train", *TINY_FLAGS, "--model",
               str(config_file), "--data", corpus, "--out", str(tmp_path / "run")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "loss_type" not in done.stderr, done.stderr


#: Text a tokenizer's pre-tokenizer and normalizer treat differently: runs of spaces, tabs,
#: blank lines, CRLF, accents composed and decomposed, CJK, emoji.
TRICKY_TEXT = (
    "def f(x):\n        return  x  +  1\n\t\tif x:\t\tpass\r\n\n\n   \n"
    "café cafe\u0301 naïve 中文字符 😀👍🏽 ÅΩ≈ç √ x²\u00a0y  end   "
)
#: Model types whose config.json makes transformers pick its own tokenizer class for some
#: (qwen2: Qwen2Tokenizer, whatever tokenizer_config.json names) and not for others.
TOKENIZER_MODEL_TYPES = {
    **CONFIGS,
    "llama": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2},
    "phi3": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": None},
}  # fmt: skip


def moved_copies(folder: Path, tmp_path: Path) -> list[str]:
    """Two "fine-tunes" of a model folder: copies whose weights are moved by +0.01 and -0.02."""
    finetunes = []
    for shift in (0.01, -0.02):
        finetune = tmp_path / f"ft{shift}"
        shutil.copytree(folder, finetune)
        weights = load_file(folder / "model.safetensors")
        save_file({name: w + shift for name, w in weights.items()}, finetune / "model.safetensors")
        finetunes.append(str(finetune))
    return finetunes


@pytest.mark.parametrize("model_type", sorted(TOKENIZER_MODEL_TYPES))
def test_final_and_merged_tokenizers_reload_to_the_training_tokenizer(
    corpus, tmp_path, monkeypatch, capsys, model_type
):
    """final/'s tokenizer, read back by ``AutoTokenizer.from_pretrained`` (transformers picks
    the class from config.json's model_type) and by our loader, and a merge's, give the ids
    the run's data were encoded with; so ``mloco eval`` of final/ is the run's final val_loss
    (before: a qwen2 run reloaded as Qwen2Tokenizer, 5.8131 against 5.7917). Its merges are
    the BPE's learned on that split (Qwen2's for qwen2, GPT-2's byte-level for the others)."""
    monkeypatch.setenv("MLOCO_CACHE", str(tmp_path / "cache"))  # the data are encoded afresh
    encoders = []

    def spy(tokenizer):
        encoders.append(encode := batch_encoder(tokenizer))
        return encode

    monkeypatch.setattr(data_module, "batch_encoder", spy)
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps({"model_type": model_type,
                                       **TOKENIZER_MODEL_TYPES[model_type]}))  # fmt: skip
    out = tmp_path / "run"
    train_cli("--model", str(config_file), "--preset", "isoloco", "--data", corpus,
              "--out", str(out))  # fmt: skip
    assert encoders, "the run encoded no data"
    expected = encoders[0]([TRICKY_TEXT])[0]
    final = out / "final"
    finetunes = moved_copies(final, tmp_path)
    merged = tmp_path / "merged"
    with pytest.raises(SystemExit) as exited:
        main(["merge", *finetunes, "--base", str(final), "--method", "mean", "-o", str(merged),
              "--quiet"])  # fmt: skip
    assert exited.value.code in (0, None)
    for folder in (final, merged):
        reloaded = AutoTokenizer.from_pretrained(folder)
        assert reloaded(TRICKY_TEXT, add_special_tokens=False)["input_ids"] == expected
        ours = load_tokenizer(folder)
        assert ours(TRICKY_TEXT, add_special_tokens=False)["input_ids"] == expected
    merges = json.loads((final / "tokenizer.json").read_text())["model"]["merges"]
    split_like = Qwen2Tokenizer() if model_type == "qwen2" else None  # transformers' own split
    bpe = load_or_train_tokenizer(corpus, 512, split_like=split_like)
    assert merges == json.loads(bpe.backend_tokenizer.to_str())["model"]["merges"]
    run_loss = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["eval", str(final), "--data", corpus, "--tokens", "1024", "--seq-len", "32",
              "--json"])  # fmt: skip
    assert exited.value.code in (0, None)
    (result,) = json.loads(capsys.readouterr().out)
    assert result["loss"] == pytest.approx(run_loss, rel=1e-5)


def cli_error(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    return exited.value.code, capsys.readouterr().err


def test_seq_len_beyond_learned_positions_is_one_line_before_anything_is_written(
    corpus, tmp_path, capsys
):
    """GPT-2 embeds positions with a table of n_positions rows: train, eval and compare (merge
    and aggregators modes) refuse a longer --seq-len up front, naming the limit (before:
    ``IndexError: index out of range``, train's mid-round 1 after writing config.json).
    Rotary positions (qwen2) have no limit."""
    config_file = tmp_path / "gpt2.json"
    config_file.write_text(json.dumps({"model_type": "gpt2", **CONFIGS["gpt2"]}))
    limit = CONFIGS["gpt2"]["n_positions"]
    flags = [f for f in TINY_FLAGS if f not in ("--seq-len", "32", "--tokens", "768")]
    out = tmp_path / "run"
    code, err = cli_error(capsys, "train", *flags, "--seq-len", str(2 * limit), "--tokens", "4096",
                          "--model",
                          str(config_file), "--data", corpus, "--out", str(out))  # fmt: skip
    expected = f"error: --seq-len {2 * limit}: model {config_file} embeds at most {limit} "
    assert code == 2 and err.startswith(expected) and err.count("\n") == 1, err
    assert f"(n_positions in its config); pass --seq-len {limit} or less" in err
    assert not out.exists()
    train_cli("--model", str(config_file), "--data", corpus, "--out", str(out))
    final = out / "final"
    code, err = cli_error(capsys, "eval", str(final), "--data", corpus, "--seq-len", "65",
                          "--tokens", "1024")  # fmt: skip
    assert code == 2 and err.startswith(f"error: --seq-len 65: model {final} embeds at most 64 ")
    assert err.count("\n") == 1, err
    finetunes = moved_copies(final, tmp_path)
    other = tmp_path / "other"
    shutil.copytree(corpus, other)
    results = tmp_path / "merge-compare"
    code, err = cli_error(capsys, "compare", "--mode", "merge", "--base", str(final),
                          "--finetuned", ",".join(finetunes), "--data", f"{corpus},{other}",
                          "--seq-len", "128", "--eval-tokens", "1024",
                          "-o", str(results))  # fmt: skip
    assert code == 2 and err.startswith(f"error: --seq-len 128: model {final} embeds at most 64 ")
    assert err.count("\n") == 1 and not results.exists(), err
    code, err = cli_error(capsys, "compare", "--aggregators", "diloco", "--workers", "2",
                          "--inner-steps", "2", "--model", str(config_file), "--global-batch", "4",
                          "--seq-len", str(2 * limit), "--vocab-size", "512", "--val-tokens",
                          "1024", "--tokens", "4096", "--data", corpus, "--no-figures", "--quiet",
                          "-o", str(results))  # fmt: skip
    assert code == 2 and err.startswith(expected), err
    assert err.count("\n") == 1 and not results.exists(), err
    # rotary positions run past max_position_embeddings: no limit, the run and eval work
    rotary = tmp_path / "qwen2.json"
    rotary.write_text(json.dumps({"model_type": "qwen2", **CONFIGS["qwen2"],
                                  "max_position_embeddings": 16}))  # fmt: skip
    train_cli("--model", str(rotary), "--data", corpus, "--out", str(tmp_path / "rotary"))
    code, err = cli_error(capsys, "eval", str(tmp_path / "rotary" / "final"), "--data", corpus,
                          "--seq-len", "32", "--tokens", "1024")  # fmt: skip
    assert code in (0, None) and err == "", err


def test_a_tokenizer_its_model_type_would_reload_lossily_is_refused(corpus, tmp_path, capsys):
    """A Metaspace BPE (Llama-2 style) that a qwen2 folder would reload as Qwen2Tokenizer, which
    drops its spaces: the run stops before --out exists, one line naming both; a Llama run takes
    it as it is."""
    documents = [path.read_text() for path in sorted(Path(corpus).iterdir())]
    backend = Tokenizer(models.BPE(byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    special = ["<|endoftext|>", *(f"<0x{byte:02X}>" for byte in range(256))]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=special, show_progress=False)
    backend.train_from_iterator(documents, trainer=trainer)
    folder = tmp_path / "metaspace"
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(
        folder
    )
    config_file = tmp_path / "qwen2.json"
    config_file.write_text(json.dumps({"model_type": "qwen2", **CONFIGS["qwen2"]}))
    out = tmp_path / "run"
    code, err = cli_error(capsys, "train", *TINY_FLAGS, "--model", str(config_file), "--tokenizer",
                          str(folder), "--data", corpus, "--out", str(out))  # fmt: skip
    assert code == 2 and err.count("\n") == 1 and not out.exists(), err
    assert err.startswith(f"error: tokenizer {folder}: a qwen2 model's folder reloads it as "
                          "Qwen2Tokenizer, which reads 'def f(x)")  # fmt: skip
    assert err.endswith("pass --tokenizer one made for qwen2, or --model another model_type\n")
    train_cli("--model", "micro", "--tokenizer", str(folder), "--data", corpus, "--out", str(out))
    assert (out / "final" / "model.safetensors").is_file()
