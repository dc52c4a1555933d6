"""``mloco report`` on a results folder from someone else: a FIFO or damaged file is named in
one line (exit 2), never read forever, and the folder is left as it was."""

from __future__ import annotations

import errno
import json
import math
import os
import statistics
from types import SimpleNamespace

import pytest
from hostile import assert_refused, run_cli, snapshot

from mergekit_loco.compare import results_lock, runs
from mergekit_loco.compare.stats import spread
from mergekit_loco.io import lock
from mergekit_loco.io.atomic import LOCK_FILE, mark_output
from mergekit_loco.io.lock import FolderLock
from mergekit_loco.run_layout import RUN_KIND, SWEEP_KIND


@pytest.mark.parametrize(("config", "fragment"), [
    ("fifo", "is a FIFO, not a run config"),
    ("[1", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
])  # fmt: skip
def test_report_names_a_damaged_run_file(capsys, tmp_path, config, fragment):
    run = tmp_path / "results" / "runs" / "a"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"event": "final", "round": 1}\n')
    if config == "fifo":
        os.mkfifo(run / "config.json")
    else:
        (run / "config.json").write_text(config)
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "report", tmp_path / "results")
    assert_refused(code, err, str(run / "config.json"), fragment)
    assert snapshot(tmp_path) == before


CONFIG = '{"inner_steps": 2, "global_batch": 4, "seq_len": 8, "workers": 2, "preset": "diloco"}'
FINAL = '{"event": "final", "round": 1, "val_loss": 3.5}'


def changed(**entries) -> str:
    """CONFIG with ``entries`` replaced or added."""
    return json.dumps({**json.loads(CONFIG), **entries})


@pytest.mark.parametrize(("config", "metrics", "fragment"), [
    (CONFIG, '{"event": "final", "round": 1}', "final event: 'val_loss' is null, not a finite"),
    (CONFIG, '{"event": "final", "round": 1, "val_loss": "low"}', "'val_loss' is \"low\""),
    (CONFIG, '{"event": "eval", "round": [1], "val_loss": 3}', "a eval event: 'round' is [1]"),
    ('{"inner_steps": "2", "global_batch": 4, "seq_len": 8}', '{"event": "final", "round": 1}',
     "config.json: 'inner_steps' is \"2\", not an integer >= 0"),
    (changed(workers=[1, 2]), FINAL, "'workers' is [1, 2], not an integer >= 1"),
    (changed(workers=1.9), FINAL, "'workers' is 1.9, not an integer >= 1"),
    (changed(workers=-4), FINAL, "'workers' is -4, not an integer >= 1"),
    (changed(preset=["diloco"]), FINAL, "'preset' is [\"diloco\"], not a name"),
    (changed(seed="abc"), FINAL, "'seed' is \"abc\", not an integer >= 0"),
    (CONFIG, FINAL[:-1] + ', "tokens": [1]}', "final event: 'tokens' is [1], not an integer >= 0"),
    # impossible or non-finite numbers (before: a loss of -5 or 0 was averaged and ranked best,
    # 1e999 read as inf was "failed" in the table and "finished" in results.csv, a 330-digit
    # loss or an inf round gave a bare "int too large to convert to float")
    (CONFIG, FINAL.replace("3.5", "-5"), "metrics.jsonl: final: 'val_loss' is -5, not above 0"),
    (CONFIG, FINAL.replace("3.5", "0"), "metrics.jsonl: final: 'val_loss' is 0, not above 0"),
    (CONFIG, FINAL.replace("3.5", "1e999"), "final: 'val_loss' is Infinity, not a finite number"),
    (CONFIG, FINAL.replace("3.5", "9" * 330), "final: 'val_loss' is 99999"),
    (CONFIG, FINAL.replace('"round": 1', '"round": 1e999'), "'round' is Infinity, not an integer"),
    (CONFIG, '{"event": "round", "round": 1, "train_loss": -1}\n' + FINAL,
     "round: 'train_loss' is -1, not above 0"),
    (CONFIG.replace('"inner_steps": 2', '"inner_steps": 1e999'), FINAL,
     "'inner_steps' is Infinity, not an integer >= 0"),
    (changed(outer_lr=-0.7), FINAL, "config.json: 'outer_lr' is -0.7, not at least 0"),
    (changed(outer_momentum=0.9).replace("0.9", "1e999"), FINAL,
     "'outer_momentum' is Infinity, not a finite number"),
])  # fmt: skip
def test_report_names_a_missing_or_mistyped_entry(capsys, tmp_path, config, metrics, fragment):
    run = tmp_path / "results" / "runs" / "a"
    run.mkdir(parents=True)
    (run / "config.json").write_text(config)
    (run / "metrics.jsonl").write_text(metrics + "\n")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "report", tmp_path / "results")
    assert_refused(code, err, fragment)
    assert snapshot(tmp_path) == before


def test_a_huge_or_unbroken_metrics_file_is_bounded(capsys, tmp_path):
    """A sparse 200 MB metrics file is refused by its size before any byte is read; a 3 MB line
    without a newline is read past, never held, and the events around it still count."""
    run = tmp_path / "results" / "runs" / "a"
    run.mkdir(parents=True)
    (run / "config.json").write_text(CONFIG)
    with open(run / "metrics.jsonl", "wb") as handle:
        handle.truncate(200_000_000)
    code, err, _ = run_cli(capsys, "report", tmp_path / "results")
    assert_refused(code, err, str(run / "metrics.jsonl"), "more than a metrics file may hold")
    eval_event = '{"event": "eval", "round": 1, "val_loss": 4.0}'
    (run / "metrics.jsonl").write_text(eval_event + "\n" + "x" * 3_000_000 + "\n" + FINAL + "\n")
    assert runs.load_run(run).val_curve == ((64, 4.0), (64, 3.5))


def test_losses_near_the_float_maximum_have_a_spread():
    """A damaged file's 1e300 (before: ``OverflowError (34, 'Numerical result out of range')``):
    mean and sample sd as statistics.stdev computes them exactly."""
    values = [1e300, 1.0, -2e300]
    result = spread(values)
    assert math.isclose(result.mean, statistics.fmean(values), rel_tol=1e-12)
    assert math.isclose(result.std, statistics.stdev(values), rel_tol=1e-12)


def test_a_spread_of_a_numpy_array_or_a_generator_is_the_spread_of_its_values():
    """Before: ``The truth value of an array with more than one element is ambiguous``."""
    import numpy as np

    values = [3.0, 1.0, 2.5]
    expected = spread(values)
    assert spread(np.array(values)) == expected == spread(value for value in values)
    assert expected.std == statistics.stdev(values)


def evaluations(**changes) -> dict:
    """A well-formed evaluations.json of one domain (base, its fine-tune, one merge), changed."""
    losses = {"code": {"select": 4.0, "test": 4.1}}
    models = [
        {"label": "base", "kind": "base", "method": None, "scale": None, "losses": losses},
        {"label": "finetune:code", "kind": "finetuned", "method": None, "scale": None,
         "losses": {"code": {"select": 3.0, "test": 3.1}}},
        {"label": "ta@1", "kind": "merge", "method": "ta", "scale": 1.0, "losses": losses},
    ]  # fmt: skip
    return {"domains": ["code"], "models": models, **changes}


@pytest.mark.parametrize("omitted", [(), ("method", "scale")])
def test_a_well_formed_evaluations_file_reports(capsys, tmp_path, omitted):
    """Also where the base and fine-tune entries leave out their null method and scale."""
    document = evaluations()
    for model in document["models"][:2]:
        for key in omitted:
            del model[key]
    folder = tmp_path / "merge"
    folder.mkdir()
    (folder / "evaluations.json").write_text(json.dumps(document))
    code, err, _ = run_cli(capsys, "report", folder, "--no-figures")
    assert code == 0, err
    rows = json.loads((folder / "merge_results.json").read_text())["summary"]
    assert [row["model"] for row in rows] == ["base", "finetune:code", "ta"]


MODELS = evaluations()["models"]


@pytest.mark.parametrize(("document", "fragment"), [
    ({}, "'domains' must be a non-empty list of names"),
    (evaluations(domains=[]), "'domains' must be a non-empty list of names"),
    (evaluations(models=MODELS[1:]), "'models' must hold exactly one base"),
    (evaluations(models=[MODELS[0], MODELS[2]]), "no model 'finetune:code'"),
    (evaluations(models=[*MODELS[:2], {**MODELS[2], "scale": "big"}]), "a merge needs a 'method'"),
    (evaluations(models=[{**MODELS[0], "losses": {"code": {"select": 0, "test": 1}}}, *MODELS[1:]]),
     "models[0]: the select loss on 'code' must be a positive number"),
    (evaluations(models=[{**MODELS[0], "losses": {"code": {"select": None}}}, *MODELS[1:]]),
     "must be a positive number"),
    (evaluations(models=[{**MODELS[0], "losses": {"code": {}, "prose": {}}}, *MODELS[1:]]),
     "'losses' must hold exactly the domains ['code']"),
    (evaluations(models=[{"kind": "base"}, *MODELS[1:]]), "models[0] needs a 'label' string"),
    (evaluations(models=[MODELS[0], {**MODELS[1], "scale": "big"}, MODELS[2]]),
     "models[1]: a finetuned model has no 'method' or 'scale' (null)"),
    (evaluations(models=[{**MODELS[0], "method": ["x"]}, *MODELS[1:]]),
     "models[0]: a base model has no 'method' or 'scale'"),
    (evaluations(models=[*MODELS[:2], {**MODELS[2], "method": ""}]), "a merge needs a 'method'"),
    (evaluations(models=[*MODELS[:2], {**MODELS[2], "method": "finetune:code"}]),
     "models[2]: method 'finetune:code' is the label of a model that is not a merge"),
    (evaluations(models=[*MODELS, {**MODELS[2], "label": "ta@1b"}]),
     "models[3]: a second merge of method 'ta' at scale 1 (the first is models[2])"),
    (evaluations(models=[*MODELS, {**MODELS[2], "scale": 0.5}]),
     "models[3]: label 'ta@1' is models[2]'s too"),
])  # fmt: skip
def test_a_damaged_evaluations_file_is_named(capsys, tmp_path, document, fragment):
    """Before: StopIteration, ZeroDivisionError, TypeError, ``error: domains`` or ``error:
    method``; a fine-tune's scale "big" wrote three tables before ``error: Unknown format code
    'g'``; a merge named after the fine-tune replaced its row. Nothing is written."""
    folder = tmp_path / "merge"
    folder.mkdir()
    (folder / "evaluations.json").write_text(json.dumps(document))
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "report", folder)
    assert_refused(code, err, str(folder / "evaluations.json"), fragment)
    assert snapshot(tmp_path) == before


def test_report_of_a_training_run_says_it_takes_a_compare_folder(capsys, tmp_path):
    """Before: ``RUN/runs: no runs to re-render``; and report's refusals spoke of a --force it
    does not have (``tests/test_hostile_outputs.py``)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(CONFIG)
    (run / "metrics.jsonl").write_text(FINAL + "\n")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "report", run, "--no-figures")
    line = assert_refused(code, err, f"{run} is a training run (it holds config.json), not a "
                          "compare folder: mloco report takes a folder written by mloco "
                          f"compare -o (mloco eval {run / 'final'} scores")  # fmt: skip
    assert "--force" not in line
    assert snapshot(tmp_path) == before


def test_a_report_into_a_folder_in_use_is_refused_and_one_elsewhere_is_not(capsys, tmp_path):
    """``mloco report DIR`` while a comparison holds DIR's lock (before: it re-rendered the
    sweep under the comparison's feet): exit 2 naming the holder's PID, DIR unchanged; with
    ``-o NEW`` it reads DIR and writes NEW, and DIR is still unchanged."""
    results = tmp_path / "results"
    run = results / "runs" / "diloco-R2-H2-s0"
    run.mkdir(parents=True)
    (run / "config.json").write_text(CONFIG)
    (run / "metrics.jsonl").write_text(FINAL + "\n")
    mark_output(results, SWEEP_KIND)  # as mloco compare marks its folder before any cell
    with results_lock(results) as comparing:
        comparing.acquire()
        before = snapshot(tmp_path)
        code, err, _ = run_cli(capsys, "report", results)
        assert_refused(
            code,
            err,
            f"{results} is in use by another mloco process (PID {os.getpid()}) writing into it",
            "to see the report meanwhile, give -o a new folder",
        )
        assert snapshot(tmp_path) == before
        code, err, _ = run_cli(capsys, "report", results, "-o", tmp_path / "new", "--no-figures")
        assert code == 0, err
        assert "diloco-R2-H2-s0" in (tmp_path / "new" / "results.csv").read_text()
        after = snapshot(tmp_path)
        assert {
            name: entry for name, entry in after.items() if name.split("/")[0] != "new"
        } == before
    code, err, _ = run_cli(capsys, "report", results, "--no-figures")  # its lock released
    assert code == 0, err
    assert (results / "results.csv").is_file()


def test_a_report_is_refused_for_what_the_folder_is_and_needs_no_lock_support(
    capsys, tmp_path, monkeypatch
):
    """``mloco report RUN`` while the run trains (its lock held) is refused as a training run,
    not as a folder in use; a results folder copied, lock file and all, onto a filesystem that
    refuses locks re-renders in place (no comparison can run there)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(CONFIG)
    mark_output(run, RUN_KIND)
    with FolderLock(run, "training into it", "run it again") as training:
        training.acquire()
        code, err, _ = run_cli(capsys, "report", run)
    assert_refused(code, err, f"{run} is a training run (it holds config.json)")

    results = tmp_path / "results"
    (results / "runs" / "a").mkdir(parents=True)
    (results / "runs" / "a" / "config.json").write_text(CONFIG)
    (results / "runs" / "a" / "metrics.jsonl").write_text(FINAL + "\n")
    mark_output(results, SWEEP_KIND)
    (results / LOCK_FILE).write_text("1234\n")

    def flock(descriptor: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    fcntl = pytest.importorskip("fcntl")
    monkeypatch.setattr(lock, "fcntl", SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX,
                                                       LOCK_NB=fcntl.LOCK_NB))  # fmt: skip
    code, err, _ = run_cli(capsys, "report", results, "--no-figures")
    assert code == 0, err
    assert "a" in (results / "results.csv").read_text()
