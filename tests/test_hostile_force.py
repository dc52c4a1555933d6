"""``--force`` replaces only what mloco wrote (or a plain checkpoint): never a user's folder, an
input or a folder holding one, never through a symlink; a failed commit leaves no ``.old-``."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import stdlib_corpus
from hostile import TRAIN, assert_refused, run_cli, snapshot
from safetensors.torch import load_file, save_file

from mergekit_loco.io import atomic
from mergekit_loco.io.atomic import OWNER_MARKER


@pytest.fixture
def inputs(tmp_path) -> tuple[Path, Path]:
    """A base and a fine-tune, single files in ``tmp_path/in``."""
    folder = tmp_path / "in"
    folder.mkdir()
    save_file({"w": torch.zeros(4)}, folder / "base.safetensors")
    save_file({"w": torch.ones(4)}, folder / "ft.safetensors")
    return folder / "base.safetensors", folder / "ft.safetensors"


def merge(capsys, inputs, out, *extra):
    base, model = inputs
    return run_cli(capsys, "merge", model, "--base", base, "-m", "ta", "-o", out, *extra)


@pytest.mark.parametrize("folder", ["a_home_folder", "our_output_with_user_notes"])
def test_force_refuses_a_folder_that_is_not_only_a_checkpoint(capsys, tmp_path, inputs, folder):
    """Neither a user's folder nor an output of ours to which the user added a file (before,
    that file was deleted with the output)."""
    out = tmp_path / "out"
    if folder == "a_home_folder":
        (out / ".ssh").mkdir(parents=True)
        (out / ".ssh" / "id_ed25519").write_text("secret")
        (out / "model.safetensors").write_bytes(b"x")
    else:
        assert merge(capsys, inputs, out)[0] == 0
        (out / "eval_results").mkdir()
        (out / "NOTES.md").write_text("my notes")
    first = {"a_home_folder": ".ssh", "our_output_with_user_notes": "NOTES.md"}[folder]
    before = snapshot(tmp_path)
    code, err, _ = merge(capsys, inputs, out, "--force")
    assert_refused(code, err, str(out), "--force replaces only a checkpoint", f"holds {first}")
    assert snapshot(tmp_path) == before


def test_an_input_given_by_its_index_file_is_its_whole_folder(capsys, tmp_path, inputs):
    """A shard of an index-named input, or any path in its folder, is the input's."""
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"w": torch.zeros(4)}, sharded / "model-00001-of-00001.safetensors")
    index = sharded / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"w": "model-00001-of-00001.safetensors"}}')
    before = snapshot(tmp_path)
    for out in (sharded / "model-00001-of-00001.safetensors", sharded / "merged"):
        code, err, _ = run_cli(capsys, "merge", inputs[1], "--base", index, "-m", "ta", "-o",
                               out, "--force")  # fmt: skip
        assert_refused(code, err, str(out), "would overlap the input", str(sharded))
    assert snapshot(tmp_path) == before


def test_an_output_path_through_a_missing_folder_and_dot_dot(capsys, tmp_path, inputs, monkeypatch):
    """``new/../x`` is ``./x``: written there, no ``new`` left behind, never over an existing
    ``x`` without --force."""
    monkeypatch.chdir(tmp_path)
    assert merge(capsys, inputs, "new/../x.safetensors")[0] == 0
    assert load_file(tmp_path / "x.safetensors")["w"].tolist() == [1.0] * 4
    assert not (tmp_path / "new").exists()
    before = snapshot(tmp_path)
    code, err, _ = merge(capsys, inputs, "other/../x.safetensors")
    assert_refused(code, err, "x.safetensors", "output file exists; add --force")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("where", ["parent_of_input", "the_input", "inside_input_folder"])
def test_output_never_overlaps_an_input(capsys, tmp_path, inputs, where):
    base, _ = inputs
    folder_input = tmp_path / "folder_model"
    folder_input.mkdir()
    save_file({"w": torch.ones(4)}, folder_input / "model.safetensors")
    out = {"parent_of_input": base.parent, "the_input": base,
           "inside_input_folder": folder_input / "merged"}[where]  # fmt: skip
    (base.parent / OWNER_MARKER).write_text("{}")  # even a folder marked as ours
    before = snapshot(tmp_path)
    base_arg = folder_input if where == "inside_input_folder" else base
    code, err, _ = run_cli(
        capsys, "merge", inputs[1], "--base", base_arg, "-m", "ta", "-o", out, "--force"
    )
    assert_refused(code, err, str(out), "would overlap the input")
    assert snapshot(tmp_path) == before


def test_symlinked_output_is_refused_and_its_target_kept(capsys, tmp_path, inputs):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "notes.txt").write_text("keep")
    link = tmp_path / "merged"
    link.symlink_to(target)
    before = snapshot(tmp_path)
    code, err, _ = merge(capsys, inputs, link, "--force")
    assert_refused(code, err, str(link), "symlink")
    assert snapshot(tmp_path) == before and (target / "notes.txt").read_text() == "keep"


def test_force_replaces_its_own_output_and_a_failed_commit_leaves_no_old(
    capsys, tmp_path, inputs, monkeypatch
):
    out = tmp_path / "merged"
    assert merge(capsys, inputs, out)[0] == 0
    assert (out / OWNER_MARKER).is_file()
    first = snapshot(out)
    rename = os.rename

    def failing_rename(source, destination):
        if ".tmp-" in str(source):  # the new output into place: fails
            raise OSError(28, "No space left on device")
        return rename(source, destination)

    monkeypatch.setattr(atomic.os, "rename", failing_rename)
    code, err, _ = merge(capsys, inputs, out, "--force", "--scale", "0.5")
    assert_refused(code, err, str(out), "No space left on device")
    assert snapshot(out) == first
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    monkeypatch.undo()
    assert merge(capsys, inputs, out, "--force", "--scale", "0.5")[0] == 0
    assert torch.equal(load_file(out / "model.safetensors")["w"], torch.full((4,), 0.5))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    files = ["json/decoder.py", "json/encoder.py", "textwrap.py", "string.py"]
    with stdlib_corpus(tmp_path_factory.mktemp("force"), files) as folder:
        yield folder


def test_train_force_refuses_a_run_folder_it_did_not_write(capsys, tmp_path, corpus):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "thesis.tex").write_text("years of work")
    (out / "metrics.jsonl").write_text("{}\n")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={out}", "--force")
    assert_refused(code, err, str(out), f"did not write (no {OWNER_MARKER})", "even with --force")
    assert snapshot(tmp_path) == before


def test_train_force_never_deletes_an_input_or_a_planted_symlink(capsys, tmp_path, corpus):
    out = tmp_path / "run"
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={out}")
    assert code == 0, err
    assert (out / OWNER_MARKER).is_file() and (out / "final" / OWNER_MARKER).is_file()
    before = snapshot(tmp_path)
    args = ["train", *TRAIN, f"--data={corpus}", f"--out={out}", "--force"]
    code, err, _ = run_cli(capsys, *args, f"--init={out / 'final'}")
    assert_refused(code, err, str(out / "final"), "would delete the input")
    assert snapshot(tmp_path) == before

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    shutil.rmtree(out / "checkpoints")
    (out / "checkpoints").symlink_to(elsewhere)
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, *args)
    assert_refused(code, err, str(out / "checkpoints"), "does not hold what a run writes")
    assert snapshot(tmp_path) == before
    (out / "checkpoints").unlink()
    code, err, _ = run_cli(capsys, *args)  # our own run: --force starts over
    assert code == 0, err
    assert (elsewhere / "keep.txt").read_text() == "keep"


def test_train_out_inside_an_input_folder_is_refused(capsys, tmp_path, corpus):
    data = tmp_path / "corpus"
    shutil.copytree(corpus, data)
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={data}", f"--out={data / 'run'}")
    assert_refused(code, err, str(data / "run"), "--out lies inside the input")
    assert snapshot(tmp_path) == before


def test_force_takes_an_empty_folder_but_not_the_current_one(capsys, tmp_path, inputs, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert merge(capsys, inputs, empty, "--force")[0] == 0
    assert load_file(empty / "model.safetensors")["w"].tolist() == [1.0] * 4
    monkeypatch.chdir(empty)
    before = snapshot(tmp_path)
    code, err, _ = merge(capsys, inputs, ".", "--force")
    assert_refused(code, err, ".: name the output, like -o merged")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("extra", [None, "notes.txt"])
def test_force_replaces_a_model_folder_with_named_chat_templates(capsys, tmp_path, inputs, extra):
    """transformers saves a tokenizer's named chat templates in ``additional_chat_templates/``
    (``NAME.jinja``): a model folder, replaced by ``--force`` (and a run's ``final/`` resumed).
    Any other file in that folder keeps it from being replaced."""
    out = tmp_path / "merged"
    out.mkdir()
    save_file({"w": torch.zeros(4)}, out / "model.safetensors")
    (out / "additional_chat_templates").mkdir()
    (out / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    if extra:
        (out / "additional_chat_templates" / extra).write_text("mine")
    code, err, _ = merge(capsys, inputs, out, "--force")
    if extra:
        assert_refused(code, err, str(out), "it holds additional_chat_templates")
        assert (out / "additional_chat_templates" / extra).read_text() == "mine"
    else:
        assert code == 0, err
        assert load_file(out / "model.safetensors")["w"].tolist() == [1.0] * 4
