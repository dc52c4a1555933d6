"""The file names of a training run folder, in one place (writers and readers both import them).

```
OUT/
  config.json          the resolved run configuration
  metrics.jsonl        one JSON event per line: round, eval, final
  checkpoints/         round-XXXXXX/ folders and the `latest` pointer
  final/               the trained model as a Hugging Face folder (after the last round)
```
A sweep (``mloco compare -o DIR``) holds one such folder per cell under ``DIR/runs/``. Every run
folder carries the ownership marker of :mod:`mergekit_loco.io.atomic`; ``--force`` starts over
only in a folder that has it (:func:`check_run_replaceable`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from mergekit_loco.io.atomic import (
    OWNER_MARKER,
    OutputRefused,
    claim_folder,
    foreign_entry,
    is_ours,
    overlapping_input,
    remove_output,
)
from mergekit_loco.io.files import shown

CONFIG = "config.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
FINAL = "final"
SWEEP_RUNS = "runs"
#: Entries of ``checkpoints/``: round folders, staging folders of crashed saves, the pointer.
ROUND_ENTRY = re.compile(r"\.?round-\d+(\.tmp-\w+)?|latest|\.latest\.\w+\.tmp")


def previous_run(out: Path) -> list[Path]:
    """The files of an earlier run in ``out`` (what a fresh run with ``--force`` replaces)."""
    return [out / name for name in (METRICS, CHECKPOINTS, FINAL) if (out / name).is_symlink()
            or (out / name).exists()]  # fmt: skip


def check_run_replaceable(out: Path, inputs: Iterable[str | Path | None]) -> None:
    """Refuse ``--force`` over ``out`` unless this tool wrote it (its marker), each file it would
    delete is what a run writes there, and none of them is, holds or lies inside an input."""
    if not is_ours(out):
        raise OutputRefused(
            f"{shown(out)}: --force starts over only in a run folder mergekit_loco wrote (it has "
            f"no {OWNER_MARKER}); remove the old run yourself or choose another --out"
        )
    for path in previous_run(out):
        source = overlapping_input(path, inputs)
        if source is not None:
            raise OutputRefused(
                f"{shown(path)}: --force would delete the input {shown(source)}; choose another "
                "--out"
            )
        if not looks_written_by_a_run(path):
            raise OutputRefused(
                f"{shown(path)}: does not hold what a run writes there; --force refused (remove "
                "it yourself or choose another --out)"
            )


def looks_written_by_a_run(path: Path) -> bool:
    """``metrics.jsonl`` a regular file, ``checkpoints/`` only round folders and the pointer,
    ``final/`` a model this tool wrote or a plain checkpoint; no symlink anywhere on top."""
    if path.is_symlink():
        return False
    if path.name == METRICS:
        return path.is_file()
    if path.name == FINAL:
        return foreign_entry(path) is None
    return path.is_dir() and all(
        not entry.is_symlink() and ROUND_ENTRY.fullmatch(entry.name) is not None
        for entry in path.iterdir()
    )


def clear_previous_run(out: Path) -> None:
    """Delete what :func:`check_run_replaceable` allowed; mark ``out`` as ours if it is new or
    empty (a folder holding the user's other files is used, never marked)."""
    out.mkdir(parents=True, exist_ok=True)
    for path in previous_run(out):
        remove_output(path)
    if not is_ours(out):
        claim_folder(out, "training run")
