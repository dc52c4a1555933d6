"""The file names of a training run folder, in one place (writers and readers both import them).

```
OUT/
  config.json          the resolved run configuration
  metrics.jsonl        one JSON event per line: round, eval, final
  checkpoints/         round-XXXXXX/ folders and the `latest` pointer
  final/               the trained model as a Hugging Face folder (after the last round)
  .mloco-lock          held by the process training into OUT (mergekit_loco.io.lock)
```
A sweep (``mloco compare -o DIR``) holds one such folder per cell under ``DIR/runs/``. Every run
folder carries the ownership marker of :mod:`mergekit_loco.io.atomic` (kind :data:`RUN_KIND`); a
new run starts only in a new or empty folder or one of them, and ``--force`` deletes only what a
run writes there (:func:`mergekit_loco.train.run_folder.check_output`). Every command's output
folder is marked with its own kind, and a command writes only into a new or empty folder or one
marked with its kind (:func:`mergekit_loco.io.atomic.check_free_or_ours`): never a run into a
sweep, a sweep into a run or a merged model, a report into either.
"""

from __future__ import annotations

import os
from pathlib import Path

from mergekit_loco.io.atomic import (
    OutputRefused,
    check_free_or_ours,
    claim_folder,
    marked_kind,
    remove_output,
    settled,
)
from mergekit_loco.io.files import read_json, shown

CONFIG = "config.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
FINAL = "final"
SWEEP_RUNS = "runs"
#: The ``kind`` in a run folder's ownership marker.
RUN_KIND = "training run"
#: The ``kind`` in a run's ``final/`` model folder's ownership marker.
FINAL_KIND = "final model"
#: The ``kind`` in the marker of a sweep folder (``mloco compare -o``, and ``mloco report`` of
#: it into itself) and of a merge comparison's folder (``mloco compare --mode merge -o``).
SWEEP_KIND = "compare sweep"
MERGES_KIND = "compare merges"
#: The ``kind`` in the marker of a report written elsewhere (``mloco report ... -o OUT``).
SWEEP_REPORT_KIND = "sweep report"
MERGE_REPORT_KIND = "merge report"
#: The folder, in the current one, where runs go by default (``--out runs/train``): the one
#: missing parent folder of an output that a command creates (:func:`check_output_parent`).
RUNS = "runs"


def check_output_parent(output: Path, option: str) -> None:
    """Refuse an output path (``-o``, ``--out``) whose parent folder does not exist, unless it
    is ``./runs``: a command creates the output itself, never a tree of folders a typo made."""
    parent = settled(output).parent
    if parent.is_dir() or parent.absolute() == Path.cwd() / RUNS:
        return
    what = "is not a folder" if parent.exists() else "does not exist"
    tilde = ""
    if output.parts and output.parts[0].startswith("~"):  # --out=~/x: no shell expands it
        tilde = f"; ~ is not expanded after {option}=, write {option} ~/... or $HOME/..."
    raise OutputRefused(
        f"{shown(output)}: the folder {shown(parent)} {what}; create it first or correct "
        f"{option} (a command creates its output, and ./{RUNS}, but no other folder){tilde}"
    )


def check_run_folder_name(out: Path, option: str) -> None:
    """Refuse a training run's or comparison's folder (``--out``, compare's ``-o``) whose
    absolute path is not UTF-8 (raw bytes from another machine's encoding, in the name or a
    folder above it): the run's final tokenizer (the tokenizers library takes only UTF-8 paths)
    or the comparison's tables could not be written there, after all the training."""
    try:
        os.path.abspath(out).encode("utf-8")  # as written: a run's paths become absolute
    except UnicodeEncodeError:
        raise OutputRefused(
            f"{option} {shown(out)}: the path is not UTF-8 (a run's tokenizer and a "
            "comparison's tables are written only under UTF-8 paths); choose another name"
        ) from None


def previous_run(out: Path) -> list[Path]:
    """The files of an earlier run in ``out`` (what a fresh run with ``--force`` replaces)."""
    return [out / name for name in (METRICS, CHECKPOINTS, FINAL) if (out / name).is_symlink()
            or (out / name).exists()]  # fmt: skip


def check_resumable(out: Path) -> None:
    """Refuse ``--resume`` into an ``--out`` that is no folder, a model folder
    (:func:`check_not_a_model`), or a folder without ``checkpoints/``: there is nothing to
    resume. Reads no checkpoint and writes nothing (the lock is taken after)."""
    if not out.is_dir():
        what = "is not a folder" if out.exists() else "does not exist"
        raise ValueError(f"{out} {what}: nothing to resume (drop --resume to start a run)")
    check_not_a_model(out)
    if not ((out / CHECKPOINTS).exists() or (out / CHECKPOINTS).is_symlink()):
        raise ValueError(
            f"nothing to resume: {shown(out)} holds no checkpoint (no {CHECKPOINTS} folder); "
            f"{start_over_advice(out)}"
        )


def check_not_a_model(out: Path) -> None:
    """Refuse ``--resume --out`` a model folder (a run's ``final/``, or any Hugging Face folder:
    a ``config.json`` naming ``architectures`` or a ``model_type``) before its config.json is
    read as a run's; the message names the run folder when the parent is one."""
    model = marked_kind(out) == FINAL_KIND
    if not model and (out / CONFIG).is_file() and not (out / CONFIG).is_symlink():
        try:
            saved = read_json(out / CONFIG, "config")
        except ValueError:  # UnsafeInputError too: not a readable model config
            saved = None
        model = isinstance(saved, dict) and ("architectures" in saved or "model_type" in saved)
    if not model:
        return
    parent = settled(out).parent
    where = (
        f"the run is its parent: --resume --out {shown(parent)}"
        if marked_kind(parent) == RUN_KIND or (parent / CHECKPOINTS).is_dir()
        else "--resume continues a run folder (the --out of mloco train)"
    )
    raise ValueError(f"{shown(out)} is a model folder (config.json of a model), not a run; {where}")


def start_over_advice(out: Path) -> str:
    """How to start the run in ``out`` over, advice that works: the same command, with
    ``--force`` once ``out`` holds what a run writes (:func:`previous_run`); another ``--out``
    when ``out`` holds files a run may not write into."""
    if previous_run(out):
        return "run the same command with --force (and without --resume) to start over"
    try:
        check_free_or_ours(out, "--out", (RUN_KIND,))
    except OutputRefused:
        kind = marked_kind(out)  # another of our folders: a sweep, a report, a merge
        holds = f"is a {kind} folder" if kind else "holds files mergekit_loco did not write"
        return f"{shown(out)} is not a run folder (it {holds}): start a run with another --out"
    return "run the same command without --resume to start over"


def clear_previous_run(out: Path) -> None:
    """Delete what :func:`mergekit_loco.train.run_folder.check_output` allowed; mark ``out`` as
    ours if it is new or empty."""
    claim_folder(out, RUN_KIND)
    for path in previous_run(out):
        remove_output(path)
