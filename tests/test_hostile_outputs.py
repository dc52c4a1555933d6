"""A new run's ``--out`` and a report's folder must be new, empty or ours: ``mloco train`` and
``mloco report`` never write into a folder of the user's (or a model folder inside a run), with
or without ``--force``; ``--force`` deletes a checkpoint round only when it holds only what a
checkpoint holds; ``--resume --force`` is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import stdlib_corpus
from hostile import TRAIN, assert_refused, run_cli, snapshot

from mergekit_loco.io.atomic import OWNER_MARKER


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    files = ["json/decoder.py", "json/encoder.py", "textwrap.py", "string.py"]
    with stdlib_corpus(tmp_path_factory.mktemp("outputs"), files) as folder:
        yield folder


@pytest.fixture(scope="module")
def finished(corpus, stopped, tmp_path_factory) -> Path:
    """The ``stopped`` run resumed to its end: final/, metrics.jsonl, one checkpoint kept."""
    out = tmp_path_factory.mktemp("finished") / "run"
    shutil.copytree(stopped, out, symlinks=True)
    with pytest.raises(SystemExit) as exited:
        from mergekit_loco.cli import main

        main(["train", *TRAIN, f"--data={corpus}", f"--out={out}", "--resume"])
    assert exited.value.code in (0, None)
    assert (out / "final" / "config.json").is_file()
    return out


def train(capsys, corpus, out, *extra):
    return run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={out}", *extra)


@pytest.mark.parametrize("force", [[], ["--force"]])
@pytest.mark.parametrize("where", ["user_folder", "final_of_a_run", "checkpoints_of_a_run"])
def test_a_new_run_never_writes_into_a_folder_that_is_not_a_run_of_ours(
    capsys, tmp_path, corpus, finished, where, force
):
    """Before, the run replaced the user's config.json (or the final model's: it no longer
    loaded) and added metrics.jsonl, checkpoints/ and final/ beside it."""
    run = tmp_path / "r1"
    shutil.copytree(finished, run, symlinks=True)
    user = tmp_path / "usermodel"
    user.mkdir()
    (user / "config.json").write_text('{"my": "hf config"}')
    out, fragments = {
        "user_folder": (user, [f"no {OWNER_MARKER}", "it holds config.json"]),
        "final_of_a_run": (run / "final", ["a final model", "not a training run",
                                           "it holds config.json"]),
        "checkpoints_of_a_run": (run / "checkpoints", [f"no {OWNER_MARKER}", "it holds latest"]),
    }[where]  # fmt: skip
    before = snapshot(tmp_path)
    code, err, _ = train(capsys, corpus, out, *force)
    assert_refused(code, err, f"{out}: --out", *fragments, "refused even with --force")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("out", [".", "/"])
def test_a_run_into_the_current_folder_or_the_root_asks_for_a_name(
    capsys, tmp_path, corpus, monkeypatch, out
):
    """Before, ``--out /`` wrote config.json, metrics.jsonl, checkpoints/ and final/ at the root
    of the filesystem. Even an empty current folder is refused: name the run."""
    monkeypatch.chdir(tmp_path)
    root_before = sorted(p.name for p in Path("/").iterdir())
    for force in ([], ["--force"]):
        code, err, _ = train(capsys, corpus, out, *force)
        assert_refused(code, err, f"{out}: name the output, like --out {Path(out) / 'run'}")
    assert list(tmp_path.iterdir()) == []
    assert sorted(p.name for p in Path("/").iterdir()) == root_before


def test_a_new_run_starts_in_an_empty_folder_and_marks_it(capsys, tmp_path, corpus):
    out = tmp_path / "empty"
    out.mkdir()
    code, err, _ = train(capsys, corpus, out)
    assert code == 0, err
    assert json.loads((out / OWNER_MARKER).read_text())["kind"] == "training run"


@pytest.mark.parametrize("planted", ["file_in_round", "folder_in_round", "latest_folder"])
def test_force_keeps_a_user_file_inside_the_checkpoints(capsys, tmp_path, corpus, stopped, planted):
    """Before, ``--force`` deleted ``checkpoints/round-000001/NOTES.md`` with the round (exit 0),
    while a user's file in final/ was refused."""
    out = tmp_path / "run"
    shutil.copytree(stopped, out, symlinks=True)
    rounds = out / "checkpoints" / "round-000001"
    if planted == "file_in_round":
        (rounds / "NOTES.md").write_text("my notes")
        named = "round-000001/NOTES.md"
    elif planted == "folder_in_round":
        (rounds / "eval").mkdir()
        (rounds / "eval" / "scores.json").write_text("{}")
        named = "round-000001/eval"
    else:
        (out / "checkpoints" / "latest").unlink()
        (out / "checkpoints" / "latest").mkdir()
        (out / "checkpoints" / "latest" / "mine.txt").write_text("mine")
        named = "latest"
    before = snapshot(tmp_path)
    code, err, _ = train(capsys, corpus, out, "--force")
    assert_refused(code, err, str(out / "checkpoints"), "does not hold what a run writes",
                   f"(it holds {named})")  # fmt: skip
    assert snapshot(tmp_path) == before


def test_force_starts_over_in_a_run_stopped_mid_save(capsys, tmp_path, corpus, stopped):
    """What a checkpoint holds (and a crashed save's staging folder) is ours to delete: the
    sweep restarts such a cell with force=True."""
    out = tmp_path / "run"
    shutil.copytree(stopped, out, symlinks=True)
    checkpoints = out / "checkpoints"
    shutil.copytree(checkpoints / "round-000001", checkpoints / ".round-000002.tmp-ab_12")
    (checkpoints / ".latest.x1y2.tmp").write_text("round-000002\n")
    code, err, _ = train(capsys, corpus, out, "--force")
    assert code == 0, err
    assert (out / "final" / "config.json").is_file()
    assert not (checkpoints / ".round-000002.tmp-ab_12").exists()


@pytest.mark.parametrize("given", ["flags", "config_file"])
def test_resume_with_force_is_refused(capsys, tmp_path, corpus, stopped, given):
    """Before, ``--resume --force`` resumed and ignored --force without a word."""
    out = tmp_path / "run"
    shutil.copytree(stopped, out, symlinks=True)
    if given == "flags":
        extra, names = ["--resume", "--force"], "--resume and --force"
    else:
        config = tmp_path / "cfg.toml"
        config.write_text("resume = true\n")
        extra, names = [f"--config={config}", "--force"], f"resume in {config} and --force"
    before = snapshot(tmp_path)
    code, err, _ = train(capsys, corpus, out, *extra)
    assert_refused(code, err, names, "do not go together")
    assert snapshot(tmp_path) == before


def test_a_run_started_with_force_resumes(capsys, tmp_path, corpus, stopped):
    """Its config.json saves ``force: true``: a plain --resume is no --resume --force."""
    out = tmp_path / "run"
    shutil.copytree(stopped, out, symlinks=True)
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**saved, "force": True}))
    code, err, _ = train(capsys, corpus, out, "--resume")
    assert code == 0, err
    assert (out / "final" / "config.json").is_file()


CONFIG = '{"inner_steps": 2, "global_batch": 4, "seq_len": 8, "workers": 2, "preset": "diloco"}'
FINAL = '{"event": "final", "round": 1, "val_loss": 3.5}'


def sweep_folder(folder: Path) -> Path:
    """A sweep folder with one finished cell, as a user copied it (no marker)."""
    cell = folder / "runs" / "x"
    cell.mkdir(parents=True)
    (cell / "config.json").write_text(CONFIG)
    (cell / "metrics.jsonl").write_text(FINAL + "\n")
    return folder


def test_report_keeps_the_files_of_a_folder_it_did_not_write(capsys, tmp_path):
    """Before, the user's results.csv and summary.csv were replaced and PNGs added."""
    project = sweep_folder(tmp_path / "proj")
    (project / "results.csv").write_text("mine\n")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "report", project, "--no-figures")
    refusal = f"{project}: the report folder holds files mergekit_loco did not write"
    line = assert_refused(code, err, refusal, f"(no {OWNER_MARKER}): it holds results.csv",
                          "refused: choose a new")  # fmt: skip
    assert "--force" not in line  # report has no --force
    assert snapshot(tmp_path) == before
    # rendered elsewhere with -o (before: -o was ignored for a sweep): the folder is untouched
    assert run_cli(capsys, "report", project, "-o", tmp_path / "mine", "--no-figures")[0] == 0
    assert {p.name for p in (tmp_path / "mine").iterdir()} >= {"results.csv", OWNER_MARKER}
    assert {k: v for k, v in snapshot(tmp_path).items() if "mine" not in k} == before
    (project / "results.csv").unlink()  # a folder of nothing but runs/ becomes ours
    assert run_cli(capsys, "report", project, "--no-figures")[0] == 0
    assert json.loads((project / OWNER_MARKER).read_text())["kind"] == "compare sweep"
    assert run_cli(capsys, "report", project, "--no-figures")[0] == 0  # and re-renders


def merge_folder(folder: Path, marked: bool = True) -> Path:
    """A merge comparison's folder: evaluations.json of two domains (and our marker)."""
    folder.mkdir(parents=True)

    def losses(a: float, b: float) -> dict:
        return {"a": {"select": a, "test": a}, "b": {"select": b, "test": b}}

    models = [{"label": label, "kind": kind, "method": method, "scale": scale, "losses": loss}
              for label, kind, method, scale, loss in (
                  ("base", "base", None, None, losses(4.0, 5.0)),
                  ("finetune:a", "finetuned", None, None, losses(2.0, 6.0)),
                  ("finetune:b", "finetuned", None, None, losses(5.0, 4.0)),
                  ("ta-1", "merge", "ta", 1.0, losses(3.0, 4.5)))]  # fmt: skip
    (folder / "evaluations.json").write_text(json.dumps({"domains": ["a", "b"], "models": models}))
    if marked:
        (folder / OWNER_MARKER).write_text(
            '{"written_by": "mergekit_loco", "kind": "compare merges"}'
        )
    return folder


@pytest.mark.parametrize("output", ["user_dir", "default_unmarked"])
def test_merge_report_keeps_a_user_merge_summary(capsys, tmp_path, output):
    """Before, ``mloco report A B -o userdir`` (or ``mloco report A`` of a folder without the
    marker) replaced the merge_summary.csv already there."""
    first = merge_folder(tmp_path / "A", marked=output == "user_dir")
    second = merge_folder(tmp_path / "B")
    if output == "user_dir":
        out = tmp_path / "userdir"
        out.mkdir()
        args = [first, second, "-o", out]
    else:
        out, args = first, [first]
    (out / "merge_summary.csv").write_text("mine\n")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "report", *args, "--no-figures")
    assert_refused(code, err, f"{out}: the report folder holds files mergekit_loco did not write",
                   "it holds merge_summary.csv")  # fmt: skip
    assert snapshot(tmp_path) == before
    (out / "merge_summary.csv").unlink()
    code, err, _ = run_cli(capsys, "report", *args, "--no-figures")
    assert code == 0, err
    assert (out / "merge_summary.csv").read_text() != "mine\n" and (out / OWNER_MARKER).is_file()


#: ``mloco compare`` of one tiny cell (it is refused before training, or would take seconds).
COMPARE = ["compare", "--aggregators=diloco", "--workers=2", "--inner-steps=2", "--seeds=0,",
           *[flag for flag in TRAIN if not flag.startswith(("--workers", "--inner-steps",
                                                            "--device", "--quiet"))],
           "--no-baseline", "--no-figures", "--quiet"]  # fmt: skip


@pytest.fixture
def merged_dir(capsys, tmp_path) -> Path:
    """A folder ``mloco merge`` wrote (two tiny fine-tunes of one base)."""
    import torch
    from checkpoint_factory import write_state_dict

    files = []
    for index in range(3):
        state = {"w": torch.full((2, 2), float(index))}
        files.append(write_state_dict(state, tmp_path / f"m{index}.safetensors"))
    out = tmp_path / "merged_dir"
    code, err, _ = run_cli(capsys, "merge", *files[1:], "--base", files[0], "--method", "ta",
                           "-o", out, "--quiet")  # fmt: skip
    assert code == 0, err
    return out


@pytest.mark.parametrize("target", ["run_folder", "merged_dir", "report_folder", "merges"])
def test_compare_never_writes_into_another_commands_output(
    capsys, tmp_path, corpus, stopped, merged_dir, target
):
    """Before, compare -o RUN (or a merge's folder) exited 0 and added results.csv, runs/ and
    summary.csv into it, and the merge folder then refused merge --force. As train --out is
    refused in a sweep, compare -o is refused in anything but a new or empty folder or a
    sweep's; the folder is left as it was."""
    folders = {
        "run_folder": shutil.copytree(stopped, tmp_path / "run", symlinks=True),
        "merged_dir": merged_dir,
        "report_folder": tmp_path / "report",
        "merges": merge_folder(tmp_path / "merges"),
    }
    if target == "report_folder":  # a sweep's report rendered elsewhere
        sweep = sweep_folder(tmp_path / "sweep")
        assert run_cli(capsys, "report", sweep, "-o", folders[target], "--no-figures")[0] == 0
    out = folders[target]
    kind = json.loads((out / OWNER_MARKER).read_text())["kind"]
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, *COMPARE, f"--data={corpus}", "-o", out)
    line = assert_refused(code, err, f"{out}: -o is a {kind} mergekit_loco wrote, not a "
                          "compare sweep", "refused: choose a new")  # fmt: skip
    assert "--force" not in line  # a sweep has no --force (merge mode's)
    assert snapshot(tmp_path) == before
    if target == "merged_dir":  # still replaceable by the merge that wrote it
        files = sorted(tmp_path.glob("m*.safetensors"))
        code, err, _ = run_cli(capsys, "merge", *files[1:], "--base", files[0], "--method",
                               "mean", "-o", out, "--force", "--quiet")  # fmt: skip
        assert code == 0, err


@pytest.mark.parametrize("target", ["run_folder", "merged_dir", "other_sweep", "merges"])
def test_report_never_writes_into_another_commands_output(
    capsys, tmp_path, stopped, merged_dir, target
):
    """Before, report SWEEP -o RUN added results.csv, summary.csv and runs' tables to a run
    folder (or a merge output, or another sweep, whose tables it replaced). report -o takes a
    new or empty folder or one a report wrote; without -o the sweep's own folder."""
    sweep = sweep_folder(tmp_path / "sweep")
    folders = {
        "run_folder": shutil.copytree(stopped, tmp_path / "run", symlinks=True),
        "merged_dir": merged_dir,
        "other_sweep": sweep_folder(tmp_path / "other"),
        "merges": merge_folder(tmp_path / "merges"),
    }
    second = merge_folder(tmp_path / "m2")  # a second fine-tune set, to combine
    out = folders[target]
    if target == "other_sweep":  # a sweep folder of ours, with its own tables
        assert run_cli(capsys, "report", out, "--no-figures")[0] == 0
    kind = json.loads((out / OWNER_MARKER).read_text())["kind"]
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "report", sweep, "-o", out, "--no-figures")
    assert_refused(code, err, f"{out}: the report folder is a {kind} mergekit_loco wrote, not a"
                   " sweep report")  # fmt: skip
    assert snapshot(tmp_path) == before
    # merge reports follow the same rule: combined sets go to a report folder, never into
    # one of the comparisons (the merges target) or another command's output
    code, err, _ = run_cli(capsys, "report", folders["merges"], second, "-o", out, "--no-figures")
    assert_refused(code, err, f"{out}: the report folder is a {kind}", "not a merge report")
    assert snapshot(tmp_path) == before
    for _ in range(2):  # a report folder is rendered again in place, a comparison into itself
        assert run_cli(capsys, "report", sweep, "-o", tmp_path / "sweep-report",
                       "--no-figures")[0] == 0  # fmt: skip
        assert run_cli(capsys, "report", folders["merges"], second, "-o",
                       tmp_path / "merge-report", "--no-figures")[0] == 0  # fmt: skip
        assert run_cli(capsys, "report", folders["merges"], "--no-figures")[0] == 0


def test_a_report_folder_of_the_previous_version_is_rendered_again(capsys, tmp_path):
    """Reports once marked their -o folder as a sweep's ("compare sweep"); such a folder (no
    runs/ inside) is still rendered into, and marked a sweep report from then on."""
    sweep = sweep_folder(tmp_path / "sweep")
    old = tmp_path / "old-report"
    assert run_cli(capsys, "report", sweep, "-o", old, "--no-figures")[0] == 0
    (old / OWNER_MARKER).write_text(json.dumps({"written_by": "mergekit_loco",
                                                "kind": "compare sweep"}))  # fmt: skip
    code, err, _ = run_cli(capsys, "report", sweep, "-o", old, "--no-figures")
    assert code == 0, err
    assert json.loads((old / OWNER_MARKER).read_text())["kind"] == "sweep report"
