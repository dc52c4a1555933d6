"""``mloco report`` on a results folder from someone else: a FIFO or damaged file is named in
one line (exit 2), never read forever, and the folder is left as it was."""

from __future__ import annotations

import os

import pytest
from hostile import assert_refused, run_cli, snapshot


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


@pytest.mark.parametrize(("config", "metrics", "fragment"), [
    (CONFIG, '{"event": "final", "round": 1}', "final event: 'val_loss' is null, not a number"),
    (CONFIG, '{"event": "final", "round": 1, "val_loss": "low"}', "'val_loss' is \"low\""),
    (CONFIG, '{"event": "eval", "round": [1], "val_loss": 3}', "a eval event: 'round' is [1]"),
    ('{"inner_steps": "2", "global_batch": 4, "seq_len": 8}', '{"event": "final", "round": 1}',
     "config.json: 'inner_steps' is \"2\", not a number"),
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
