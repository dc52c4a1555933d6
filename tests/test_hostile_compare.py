"""``mloco compare -o DIR`` writes only into a folder that is new, empty or its own: never over
a user's files (``--force`` or not), never into or around an input, never through a symlink, and
a refused command leaves no folder behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import stdlib_corpus
from hostile import assert_refused, run_cli, snapshot

from mergekit_loco.io.atomic import OWNER_MARKER
from mergekit_loco.train.config import preset_config
from mergekit_loco.train.loop import train

SWEEP = [
    "compare", "--aggregators=diloco", "--workers=2", "--inner-steps=2", "--seeds=1",
    "--tokens=512", "--global-batch=4", "--seq-len=32", "--vocab-size=300", "--val-tokens=256",
    "--model=micro", "--no-baseline", "--no-figures", "-q",
]  # fmt: skip
CELL = "diloco-R2-H2-s0"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    files = ["json/decoder.py", "json/encoder.py", "textwrap.py", "string.py"]
    with stdlib_corpus(tmp_path_factory.mktemp("compare"), files) as folder:
        yield Path(folder)


@pytest.fixture(scope="module")
def models(corpus) -> dict[str, Path]:
    """A micro base (with its tokenizer) and two copies standing in for fine-tunes, plus a
    second domain: enough for merge mode to reach its output checks."""
    root = corpus.parent
    config = preset_config("dp", data=str(corpus), out=str(root / "base"), model="micro",
                           workers=1, inner_steps=2, global_batch=4, seq_len=32, tokens=512,
                           vocab_size=300, val_tokens=256)  # fmt: skip
    base = train(config, progress=False).out / "final"
    for name in ("ft1", "ft2"):
        shutil.copytree(base, root / name)
    other = root / "corpus2"
    other.mkdir(exist_ok=True)
    for name in ("textwrap.py", "string.py"):
        shutil.copy(corpus / name, other / name)
    return {"root": root, "base": base, "ft1": root / "ft1", "ft2": root / "ft2", "data2": other}


def merge_args(models, out, *extra) -> list:
    return ["compare", "--mode=merge", "--base", models["base"], "--finetuned",
            f"{models['ft1']},{models['ft2']}", "--data", f"{models['root'] / 'corpus'},"
            f"{models['data2']}", "--methods=ta", "--scales=1", "--eval-tokens=256",
            "--seq-len=32", "--no-figures", "-q", "-o", out, *extra]  # fmt: skip


def test_sweep_refuses_a_folder_holding_user_files(capsys, tmp_path, corpus):
    """(``--force`` is merge mode's, refused in a sweep:
    :func:`test_an_option_of_the_other_mode_is_refused`.)"""
    out = tmp_path / "ud"
    out.mkdir()
    (out / "results.csv").write_text("precious\n")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, *SWEEP, "--data", corpus, "-o", out)
    assert_refused(code, err, str(out), f"no {OWNER_MARKER}")
    assert snapshot(tmp_path) == before


def test_sweep_checks_its_data_before_creating_the_folder(capsys, tmp_path, corpus):
    """(before: an unreadable --data left a new -o holding only the lock and our marker.)"""
    out = tmp_path / "new"
    empty = tmp_path / "empty"
    empty.mkdir()
    for data, fragment in ((tmp_path / "missing", "no such file or folder"), (empty, "empty")):
        code, err, _ = run_cli(capsys, *SWEEP, "--data", data, "-o", out)
        assert_refused(code, err, str(data), fragment)
        assert not out.exists()


def test_sweep_output_may_not_overlap_the_data(capsys, corpus):
    before = snapshot(corpus)
    code, err, _ = run_cli(capsys, *SWEEP, "--data", corpus, "-o", corpus)
    assert_refused(code, err, str(corpus), "would overlap the input")
    assert snapshot(corpus) == before


def test_sweep_refuses_a_symlinked_cell_and_resumes_in_its_own_folder(capsys, tmp_path, corpus):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("keep")
    out = tmp_path / "sweep"
    (out / "runs").mkdir(parents=True)
    (out / OWNER_MARKER).write_text('{"written_by": "mergekit_loco", "kind": "compare sweep"}')
    (out / "runs" / CELL).symlink_to(victim)
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, *SWEEP, "--data", corpus, "-o", out)
    assert_refused(code, err, str(out / "runs" / CELL), "symlink")
    assert snapshot(tmp_path) == before

    (out / "runs" / CELL).unlink()
    assert run_cli(capsys, *SWEEP, "--data", corpus, "-o", out)[0] == 0
    finished = snapshot(out / "runs")
    assert run_cli(capsys, *SWEEP, "--data", corpus, "-o", out)[0] == 0  # resumed: nothing rerun
    assert snapshot(out / "runs") == finished
    assert (out / "results.csv").read_text().startswith("name,")


@pytest.mark.parametrize("force", [False, True])
def test_merge_mode_refuses_a_folder_holding_user_files(capsys, models, tmp_path, force):
    out = tmp_path / "ud"
    (out / "merged" / "ta-1").mkdir(parents=True)
    for name in ("merge_results.csv", "evaluations.json", "merged/ta-1/mywork.txt"):
        (out / name).write_text("precious\n")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, *merge_args(models, out, *(["--force"] if force else [])))
    assert_refused(code, err, str(out), f"no {OWNER_MARKER}")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("where", ["data", "parent_of_base", "base"])
def test_merge_mode_output_may_not_overlap_an_input(capsys, models, where):
    out = {"data": models["data2"], "parent_of_base": models["base"].parent,
           "base": models["base"]}[where]  # fmt: skip
    before = snapshot(out)
    code, err, _ = run_cli(capsys, *merge_args(models, out, "--force"))
    assert_refused(code, err, str(out), "would overlap the input")
    assert snapshot(out) == before


def test_merge_mode_checks_inputs_before_creating_the_folder(capsys, models, tmp_path):
    out = tmp_path / "new"
    args = merge_args(models, out)
    args[args.index(models["base"])] = tmp_path / "missing"
    code, err, _ = run_cli(capsys, *args)
    assert_refused(code, err, str(tmp_path / "missing"), "--base")
    assert not out.exists()


def test_merge_mode_checks_that_every_model_loads_before_merging(capsys, models, tmp_path):
    """A fine-tune whose config.json does not describe its weights (before: -o, merges.json and
    every merge were written, then the evaluation failed)."""
    broken = tmp_path / "ft-broken"
    shutil.copytree(models["ft2"], broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    out = tmp_path / "new"
    args = merge_args(models, out)
    args[args.index(f"{models['ft1']},{models['ft2']}")] = f"{models['ft1']},{broken}"
    code, err, _ = run_cli(capsys, *args)
    assert_refused(code, err, f"--finetuned {broken}: tensor", "is missing for a llama model")
    assert not out.exists()


def test_merge_mode_refuses_a_symlink_under_merged(capsys, models, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("keep")
    out = tmp_path / "cmp"
    (out / "merged").mkdir(parents=True)
    (out / OWNER_MARKER).write_text('{"written_by": "mergekit_loco", "kind": "compare merges"}')
    (out / "merged" / "ta-1").symlink_to(victim)
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, *merge_args(models, out, "--force"))
    assert_refused(code, err, str(out / "merged" / "ta-1"), "symlink")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("option", ["--aggregators", "--workers", "--inner-steps", "--seeds"])
def test_a_list_option_holding_no_values_is_named(capsys, tmp_path, corpus, option):
    """Before: ``--aggregators ,`` ran only the baseline, ``--workers ,`` an IndexError."""
    args = [arg for arg in SWEEP if not arg.startswith(option)]
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, *args, f"{option}=,", "--data", corpus, "-o", tmp_path / "o")
    assert_refused(code, err, f"{option}: ',' holds no values")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(("args", "fragment"), [
    (["--seed", "5"], "--seed is an option of --mode merge, not of --mode aggregators; drop it "
     "(the cells' seeds are --seeds"),
    (["--tokenizer", "/nonexist"], "--tokenizer is an option of --mode merge"),
    (["--force"], "--force is an option of --mode merge"),
    (["--methods", "ties"], "--methods is an option of --mode merge"),
    (["--mode", "merge", "--aggregators", "foo"], "--aggregators is an option of --mode "
     "aggregators, not of --mode merge; drop it"),
    (["--mode", "merge", "--workers", "4"], "--workers is an option of --mode aggregators"),
    (["--mode", "merge", "--tokens", "7"], "--tokens is an option of --mode aggregators"),
    (["--mode", "merge", "--inner-lr", "5"], "--inner-lr is an option of --mode aggregators"),
    (["--mode", "merge", "--jobs", "3"], "--jobs is an option of --mode aggregators"),
    (["--mode", "merge", "--no-baseline"], "--baseline/--no-baseline is an option of --mode agg"),
])  # fmt: skip
def test_an_option_of_the_other_mode_is_refused(capsys, tmp_path, args, fragment):
    """Before: exit 0, the option ignored (``--seed 5`` trained seed 0, ``--tokenizer`` a
    fresh tokenizer; ``--mode merge --jobs 3`` merged one at a time)."""
    merge = ["compare", "--base", "b", "--finetuned", "f1,f2", "--data", "d1,d2"]
    code, err, _ = run_cli(capsys, *(merge if "merge" in args else SWEEP), *args,
                           "-o", tmp_path / "out")  # fmt: skip
    assert_refused(code, err, fragment)
    assert not (tmp_path / "out").exists()
