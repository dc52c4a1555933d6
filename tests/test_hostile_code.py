"""Folders that ask transformers to run their own Python (``auto_map``) are refused in one line,
never prompted for and never imported: ``train --tokenizer``, ``train --init``, ``eval``."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_factory import save_model, tiny_llama
from conftest import stdlib_corpus
from hostile import TRAIN, assert_not_read, assert_refused, run_cli, snapshot
from safetensors.torch import load_file, save_file

from mergekit_loco.train.tokenizer import train_tokenizer

EVIL = "import pathlib; pathlib.Path({sentinel!r}).write_text('ran')\n"


def plant_code(folder: Path, config_name: str, sentinel: Path) -> None:
    """Add ``auto_map`` to ``folder/config_name`` and the module it names, which would write
    ``sentinel`` if imported."""
    config = json.loads((folder / config_name).read_text())
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", None],
                          "AutoConfig": "evil.EvilConfig",
                          "AutoModelForCausalLM": "evil.EvilModel"}  # fmt: skip
    (folder / config_name).write_text(json.dumps(config))
    (folder / "evil.py").write_text(EVIL.format(sentinel=str(sentinel)))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    files = ["json/decoder.py", "json/encoder.py", "textwrap.py", "string.py"]
    with stdlib_corpus(tmp_path_factory.mktemp("code"), files) as folder:
        yield folder


def evil_model(tmp_path: Path, sentinel: Path) -> Path:
    folder = save_model(tiny_llama(), tmp_path / "evil_model", "folder")
    tokenizer = train_tokenizer([["def f(x):\n    return x + 1\n" * 50]], vocab_size=300)
    tokenizer.save_pretrained(folder)
    plant_code(folder, "config.json", sentinel)
    return folder


@pytest.mark.parametrize("where", ["train_tokenizer", "train_init", "eval"])
def test_auto_map_folders_are_refused_and_no_code_runs(capsys, tmp_path, corpus, where):
    sentinel = tmp_path / "code_ran.txt"
    folder = evil_model(tmp_path, sentinel)
    out = tmp_path / "run"
    if where == "train_tokenizer":
        folder = tmp_path / "evil_tokenizer"
        train_tokenizer([["def f(x):\n    return x\n" * 50]], vocab_size=300).save_pretrained(
            folder
        )
        plant_code(folder, "tokenizer_config.json", sentinel)
        args = ["train", *TRAIN, f"--data={corpus}", f"--out={out}", f"--tokenizer={folder}"]
        bad = folder / "tokenizer_config.json"
    elif where == "train_init":
        args = ["train", *TRAIN, f"--data={corpus}", f"--out={out}", f"--init={folder}"]
        bad = folder / "config.json"
    else:
        args = ["eval", folder, f"--data={corpus}", "--tokens=256", "--seq-len=32"]
        bad = folder / "config.json"
    before = snapshot(tmp_path)
    code, err, opened = run_cli(capsys, *args)
    assert_refused(code, err, str(bad), "auto_map", "refused")
    assert not sentinel.exists()
    assert_not_read(opened, folder / "evil.py")
    assert snapshot(tmp_path) == before  # no run folder, no output


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"hidden_size": 262144, "intermediate_size": 262144, "head_dim": 262144,
          "num_attention_heads": 1, "num_key_value_heads": 1}, "in the weights but"),
        ({"hidden_size": 64, "head_dim": 16}, "in the weights but [512, 64] by"),
        ({"num_hidden_layers": 3}, "'model.layers.2."),
        ({"num_hidden_layers": 1}, "'model.layers.1."),
        ({"hidden_size": -32}, "not a model transformers can build"),
        ({"num_hidden_layers": "2"}, "not a model transformers can build"),
    ],
)  # fmt: skip
def test_a_model_config_that_does_not_describe_its_weights_is_one_line(
    capsys, tmp_path, change, fragment
):
    """eval and --init build the config on the meta device and compare it with the weights
    first: a config asking for 275 GB of parameters is refused at once, not allocated."""
    folder = tmp_path / "model"
    shutil.copytree(Path(__file__).parents[1] / "examples" / "tiny" / "base", folder)
    config = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(config))
    code, err, _ = run_cli(capsys, "eval", folder, "--data", "pydoc", "--tokens", "512")
    assert_refused(code, err, fragment)


@pytest.mark.parametrize("damage", ["nan", "int64"])
@pytest.mark.parametrize("command", ["train_init", "eval"])
def test_weights_holding_nan_or_an_integer_tensor_are_refused_by_name(
    capsys, tmp_path, corpus, damage, command
):
    """A model folder whose embedding holds one NaN, or is stored as int64 zeros. Before:
    ``train --init`` trained a round and then blamed a worker (``non-finite pseudo-gradient
    ... a worker delta holds NaN``, exit 1), or cast the integers to float and trained (exit
    0). Now both commands exit 2 naming the file and tensor; an integer tensor is refused from
    the header, before anything is written."""
    folder = save_model(tiny_llama(), tmp_path / "model", "folder")
    train_tokenizer([["def f(x):\n    return x + 1\n" * 50]], vocab_size=300).save_pretrained(
        folder
    )
    (weights,) = folder.glob("*.safetensors")
    state, name = load_file(weights), "model.embed_tokens.weight"
    if damage == "nan":
        state[name][3, 1] = math.nan
        fragment = f"{folder}: tensor '{name}' holds NaN or Inf"
    else:
        state[name] = torch.zeros(state[name].shape, dtype=torch.int64)
        fragment = f"{folder}: tensor '{name}' is torch.int64, not a floating-point weight"
    save_file(state, weights)
    if command == "train_init":
        args = [
            "train",
            *TRAIN,
            f"--data={corpus}",
            f"--out={tmp_path / 'run'}",
            f"--init={folder}",
        ]
    else:
        args = ["eval", folder, f"--data={corpus}", "--tokens=256", "--seq-len=32"]
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, *args)
    assert_refused(code, err, fragment)
    assert "pseudo-gradient" not in err
    if damage == "int64":
        assert snapshot(tmp_path) == before
