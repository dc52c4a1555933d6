"""Helpers of the hostile-input tests: run the CLI in-process, record every file it opens, and
snapshot folders to prove nothing was written or deleted."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from mergekit_loco.cli import main
from mergekit_loco.io.atomic import LOCK_FILE

#: ``mloco train`` flags of a tiny run (micro model, 2 workers, 2 rounds of 256 tokens).
TRAIN = [
    "--model=micro", "--workers=2", "--inner-steps=2", "--global-batch=4", "--seq-len=32",
    "--tokens=512", "--vocab-size=300", "--val-tokens=256", "--device=cpu", "--quiet",
]  # fmt: skip

_opened: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # once per process; inert while no recording is running


@contextlib.contextmanager
def recorded_opens() -> Iterator[list[str]]:
    """Every path passed to ``open``/``os.open`` inside the block (absolute paths)."""
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


def run_cli(capsys, *args) -> tuple[int, str, list[str]]:
    """``mloco ARGS`` through the entry point, in-process: (exit code, stderr, opened paths)."""
    capsys.readouterr()  # drop what the test's own setup printed
    with recorded_opens() as opened, pytest.raises(SystemExit) as exited:
        main([str(arg) for arg in args])
    return exited.value.code, capsys.readouterr().err, [os.path.abspath(p) for p in opened]


def assert_refused(code: int, stderr: str, *fragments: str) -> str:
    """Exit 2, one ``error:`` line (no traceback) holding every fragment; returns the line."""
    assert code == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def assert_not_read(opened: list[str], *paths: Path) -> None:
    """None of ``paths`` (nor anything under them) was opened."""
    for path in paths:
        real = os.path.realpath(path)
        hits = [p for p in opened if os.path.realpath(p) == real or p.startswith(str(path) + "/")]
        assert not hits, f"read {hits}"


def snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under ``folder`` (symlinks not followed) -> (kind, size, mtime_ns), but a
    lock file: each process that takes a folder's lock writes its PID there, a refused one too
    (:mod:`mergekit_loco.io.lock`)."""
    entries = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + [file for file in files if file != LOCK_FILE]:
            path = Path(root, name)
            info = path.lstat()
            entries[str(path.relative_to(folder))] = (info.st_mode >> 12, info.st_size,
                                                     info.st_mtime_ns)  # fmt: skip
    return entries
