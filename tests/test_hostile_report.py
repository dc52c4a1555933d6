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
