"""``mloco train --model`` with any Hugging Face causal-LM config.json, and ``--init`` with any
such checkpoint: tiny GPT-2, Qwen2 and Mistral configs written here (nothing downloaded)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from conftest import stdlib_corpus
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from mergekit_loco.cli import main

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
