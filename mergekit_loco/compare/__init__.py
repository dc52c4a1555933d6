"""Comparisons and their reports: which aggregator for my R and H, which merge method.

- :mod:`.sweep`: the aggregator sweep (plan and run FLOP-matched training cells);
  :mod:`.sweep_report` its tables, tuned outer values and orderings.
- :mod:`.merges`: the merge evaluation; :mod:`.merge_report` its scores and tables.
- :mod:`.stats`: spreads, paired differences and t-intervals both reports use;
  :mod:`.runs`: run folders on disk; :mod:`.figures`: the PNGs.

Importing this package loads no torch: ``mloco report`` re-renders without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

from rich.console import Console

from mergekit_loco.io.atomic import LOCK_FILE, marked_kind
from mergekit_loco.io.lock import FolderLock, LocksUnsupported
from mergekit_loco.run_layout import (
    MERGE_REPORT_KIND,
    MERGES_KIND,
    SWEEP_KIND,
    SWEEP_REPORT_KIND,
)


def results_lock(out: Path) -> FolderLock:
    """The lock ``mloco compare -o OUT`` holds on ``out`` while it runs, taken once ``out`` has
    passed its checks (:mod:`mergekit_loco.io.lock`): a second comparison there is refused."""
    return FolderLock(out, "comparing into it", "run the same command again (it keeps what it did)")


def check_unique(option: str, values: Sequence) -> None:
    """Refuse a list option that holds one value twice (``--workers 2,2`` would train one cell
    twice), naming the option and the value."""
    seen = set()
    for value in values:
        if value in seen:
            listed = ",".join(map(str, values))
            raise ValueError(f"{option}: {value} is given twice ({listed}); give each value once")
        seen.add(value)


def render(
    folders: Sequence[str | Path],
    out: str | Path | None = None,
    console: Console | None = None,
    figures: bool = True,
) -> None:
    """Re-render what ``mloco compare`` left in ``folders`` into ``out`` (default: the folder
    itself): one sweep, or one or more merge comparisons (combined as fine-tune sets; then
    ``out`` is required). A folder some mloco process once locked (it holds the lock file) is
    locked while the report writes there: a comparison still running in it is not re-rendered
    under its feet (:class:`~mergekit_loco.io.lock.FolderInUse`, naming its PID)."""
    from mergekit_loco.compare.merge_report import EVALUATIONS, report_merges
    from mergekit_loco.compare.sweep_report import report_sweep

    folders = [Path(folder) for folder in folders]
    merging = all((folder / EVALUATIONS).is_file() for folder in folders)
    if merging and out is None and len(folders) > 1:
        raise ValueError("combining several merge comparisons needs --output")
    if not merging and len(folders) > 1:
        raise ValueError("several folders combine merge comparisons only (with evaluations.json)")
    with report_lock(Path(out) if out is not None else folders[0]):
        if merging:
            report_merges(folders, out or folders[0], console=console, figures=figures)
        else:
            report_sweep(folders[0], console=console, figures=figures, out=out)


#: The folders a report may write into that a comparison may be writing into too.
REPORTED_KINDS = (SWEEP_KIND, MERGES_KIND, SWEEP_REPORT_KIND, MERGE_REPORT_KIND)


def report_lock(out: Path) -> FolderLock | nullcontext:
    """The lock a report takes on ``out``, held: only in a comparison's or a report's folder
    that already holds a lock file, so that a folder the report then refuses (a training run,
    a user's) gains no file and is refused for what it is; not on a filesystem without locks
    (a copied results folder), where no comparison can have run."""
    if marked_kind(out) not in REPORTED_KINDS or not os.path.lexists(out / LOCK_FILE):
        return nullcontext()
    lock = FolderLock(
        out,
        "writing into it",
        "run mloco report again (a comparison writes its own report when it ends); to see the "
        "report meanwhile, give -o a new folder",
    )
    try:
        lock.acquire()
    except LocksUnsupported:
        return nullcontext()
    return lock
