"""The run folder (layout in :mod:`mergekit_loco.run_layout`): refuse to clobber, hold (one
process writes it, :mod:`mergekit_loco.io.lock`), claim, log metrics, write the final model."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from mergekit_loco.io.atomic import (
    OWNER_MARKER,
    OutputRefused,
    check_free_or_ours,
    foreign_entry,
    overlapping_input,
    settled,
    staged_output,
    write_atomically,
)
from mergekit_loco.io.files import UnsafeInputError, parse_json, read_lines, shown
from mergekit_loco.io.lock import FolderLock
from mergekit_loco.run_layout import (
    CHECKPOINTS,
    CONFIG,
    FINAL,
    FINAL_KIND,
    LATEST,
    METRICS,
    RUN_KIND,
    check_resumable,
    clear_previous_run,
    previous_run,
    start_over_advice,
)
from mergekit_loco.train.checkpoint import (
    FILE_NAME,
    MANIFEST,
    ROUND_NAME,
    STAGING_NAME,
    STATE,
    check_not_foreign,
    latest_checkpoint,
    read_state,
    reading,
    round_of,
)
from mergekit_loco.train.config import TrainConfig, float_or_none
from mergekit_loco.train.config_sections import flag_name
from mergekit_loco.train.sources import cache_root, split_sources
from mergekit_loco.train.workers import WorkerGroup


def check_output(out: Path, config: TrainConfig) -> None:
    """Make sure the run may use ``out``: outside its inputs; on ``resume`` a folder, else new,
    empty or a run folder of ours (:func:`check_new_out`) that holds no other run (unless
    ``force``). Writes nothing and reads no checkpoint (that waits for the lock,
    :func:`resume_point`)."""
    check_out_outside_inputs(out, config)
    if config.checkpoint.resume:
        check_resumable(out)
        return
    check_new_out(out)
    previous = previous_run(out)
    if previous and not config.checkpoint.force:
        raise ValueError(
            f"{out} already holds a run ({', '.join(p.name for p in previous)}); pass --resume "
            "to continue it, --force to start over, or choose another --out"
        )
    if previous:  # --force: only what a run writes, never deleting an input
        check_run_replaceable(out, run_inputs(config))


def resume_point(out: Path, config: TrainConfig) -> Path:
    """The checkpoint ``--resume`` continues from, the latest in ``out``, refused if written with
    another run-defining config (unless ``allow_config_change``). Read once the run holds
    ``out``'s lock (:func:`hold_output`): a run still writing there would change it."""
    checkpoint = latest_checkpoint(out)
    if checkpoint is None:
        raise ValueError(
            f"nothing to resume: {out / CHECKPOINTS} holds no checkpoint; {start_over_advice(out)}"
        )
    check_resume_keeps_user_files(out, checkpoint)
    with reading(checkpoint / STATE):  # a damaged config in state.json names the file
        saved = read_state(checkpoint)["config"]
        changes = config.differences(saved)
        saved = TrainConfig.from_dict(saved)
    missing = ""
    if not (out / CONFIG).exists():
        missing = (
            f" ({out / CONFIG} is missing, so the options not given were the defaults; "
            f'{checkpoint / STATE} records the run\'s under "config")'
        )
    check_fixed_on_resume(checkpoint, saved, config, missing)
    if changes and not config.checkpoint.allow_config_change:
        raise ValueError(
            f"{checkpoint} was written with another config ({'; '.join(changes)}){missing}; "
            "pass the same options, or --allow-config-change to resume anyway"
        )
    return checkpoint


def check_resume_keeps_user_files(out: Path, checkpoint: Path) -> None:
    """Refuse (:class:`OutputRefused`, before any work) a resume from ``checkpoint`` that would
    replace what a user put in the run folder: ``final/`` holding anything but a model
    (:func:`~mergekit_loco.io.atomic.foreign_entry`; a resumed run writes ``final/`` anew) or a
    ``round-XXXXXX`` folder after ``checkpoint``'s round that this tool did not write
    (:func:`check_not_foreign`; the resumed run would save that round there)."""
    check_final_is_a_model(out / FINAL)
    root = out / CHECKPOINTS
    if root.is_dir() and not root.is_symlink():
        for entry in sorted(root.iterdir()):
            if ROUND_NAME.fullmatch(entry.name) and round_of(entry) > round_of(checkpoint):
                check_not_foreign(entry)


#: Options a resume cannot change, even with --allow-config-change: the mode and the workers
#: (a checkpoint holds the state of each worker, and a DiLoCo one an outer optimizer), the round
#: size (rounds and token counts are counted in rounds of the run's size), the model (its
#: parameters' shapes are those of every saved tensor) and the inner optimizer (muon keeps other
#: state than adamw).
FIXED_ON_RESUME = (
    "mode", "workers", "global_batch", "seq_len", "inner_steps", "model", "inner_optimizer",
)  # fmt: skip


def check_fixed_on_resume(
    checkpoint: Path, saved: TrainConfig, config: TrainConfig, note: str = ""
) -> None:
    """Refuse, before any checkpoint file but state.json is read, a resume that changes an
    option of :data:`FIXED_ON_RESUME`: ValueError saying what the checkpoint holds (and
    ``note``, why options differ)."""
    theirs, mine = saved.to_dict(), config.to_dict()
    changed = [name for name in FIXED_ON_RESUME if theirs[name] != mine[name]]
    if not changed:
        return
    kind = "DiLoCo" if saved.run.mode == "diloco" else "data-parallel"
    flags = ", ".join(f"{flag_name(name)} {theirs[name]} -> {mine[name]}" for name in changed)
    raise ValueError(
        f"{checkpoint} holds a {kind} run of {saved.run.workers} workers (model "
        f"{saved.model.name}, {saved.inner.optimizer} inner optimizer), rounds of "
        f"{saved.inner.steps} inner steps x global batch {saved.data.global_batch} x seq len "
        f"{saved.data.seq_len} = {saved.tokens_per_round():,} tokens; mode, workers, round size, "
        "model and inner optimizer cannot change on resume, even with --allow-config-change "
        f"({flags}){note}: resume with the run's values, or start a new run in another --out"
    )


def check_new_out(out: Path) -> None:
    """A new run's ``--out``: named (not ``.`` or ``/``), and new, empty or a run folder of ours
    (its marker, :data:`~mergekit_loco.run_layout.RUN_KIND`; not the final model inside one);
    refused with or without ``force``."""
    if settled(out).name in ("", "."):
        raise OutputRefused(
            f"{shown(out)}: name the output, like --out {shown(settled(out) / 'run')}"
        )
    check_free_or_ours(out, "--out", (RUN_KIND,))


def check_run_replaceable(out: Path, inputs: list[str]) -> None:
    """Refuse ``--force`` over the run folder ``out`` (:func:`check_new_out`) unless each file it
    would delete is what a run writes there (:func:`not_written_by_a_run`) and none of them is,
    holds or lies inside an input."""
    for path in previous_run(out):
        source = overlapping_input(path, inputs)
        if source is not None:
            raise OutputRefused(
                f"{shown(path)}: --force would delete the input {shown(source)}; choose another "
                "--out"
            )
        foreign = not_written_by_a_run(path)
        if foreign is not None:
            holds = "" if foreign == path else f" (it holds {shown(foreign.relative_to(path))})"
            raise OutputRefused(
                f"{shown(path)}: does not hold what a run writes there{holds}; --force refused "
                "(remove it yourself or choose another --out)"
            )


def not_written_by_a_run(path: Path) -> Path | None:
    """The first entry of ``path`` (or ``path`` itself) that a run does not write there, None
    when there is none: ``metrics.jsonl`` a regular file, ``final/`` a model (only checkpoint
    files, :func:`~mergekit_loco.io.atomic.foreign_entry`), ``checkpoints/`` only what a save
    writes (:func:`not_a_checkpoint`); no symlink anywhere."""
    if path.is_symlink():
        return path
    if path.name == METRICS:
        return None if path.is_file() else path
    if path.name == FINAL:
        return foreign_entry(path)
    if not path.is_dir():
        return path
    foreign = (not_a_checkpoint(entry) for entry in sorted(path.iterdir()))
    return next((entry for entry in foreign if entry is not None), None)


#: ``checkpoints/latest`` while it is rewritten (:func:`~mergekit_loco.io.atomic.write_atomically`).
POINTER_TEMP = re.compile(rf"\.{LATEST}\.\w+\.tmp")


def not_a_checkpoint(entry: Path) -> Path | None:
    """``entry`` of ``checkpoints/``, or the first file inside it, unless it is what a save
    writes (:mod:`mergekit_loco.train.checkpoint`): the ``latest`` pointer (or its temp file) a
    regular file, a round folder (or a crashed save's staging folder) holding only regular
    checkpoint files (``state.json``, ``global.safetensors``, ``*.pt``, the manifest, the
    marker). None when it is."""
    if entry.is_symlink():
        return entry
    if entry.name == LATEST or POINTER_TEMP.fullmatch(entry.name):
        return None if entry.is_file() else entry
    is_round = ROUND_NAME.fullmatch(entry.name) or STAGING_NAME.fullmatch(entry.name)
    if not (is_round and entry.is_dir()):
        return entry
    for file in sorted(entry.iterdir()):
        named = FILE_NAME.fullmatch(file.name) or file.name in (MANIFEST, OWNER_MARKER)
        if file.is_symlink() or not file.is_file() or not named:
            return file
    return None


def run_inputs(config: TrainConfig) -> list[str]:
    """The paths a run reads: ``--init``, ``--tokenizer`` and every ``--data`` source."""
    return [p for p in (config.model.init, config.data.tokenizer) if p] + split_sources(
        config.data.source
    )


def check_out_outside_inputs(out: Path, config: TrainConfig) -> None:
    """Refuse an ``--out`` or a cache folder (``$MLOCO_CACHE``) that is, or lies inside, an input
    folder: the run would write into its own inputs (a ``metrics.jsonl`` or a token cache in a
    data folder becomes data of the next run)."""
    for what, folder in (("--out", out), ("the cache folder ($MLOCO_CACHE)", cache_root())):
        where = folder.resolve()
        for given in run_inputs(config):
            if not given.strip():  # an empty source: the data loader names it
                continue
            source = Path(given).expanduser()
            if source.is_dir() and where.is_relative_to(source.resolve()):
                raise OutputRefused(
                    f"{shown(folder)}: {what} lies inside the input {shown(source)}; choose a "
                    "folder outside the data, tokenizer and --init folders"
                )


def hold_output(
    lock: FolderLock, group: WorkerGroup, recheck: Callable[[], None] | None = None
) -> None:
    """Rank 0 takes the run folder's lock (once; it creates the folder), the one process of a
    launch that does (rank 0 alone writes ``OUT`` but for its ranks' files in a checkpoint's
    staging folder), then runs ``recheck`` (what another writer may have changed before the
    lock was ours); every rank raises its failure (:class:`~mergekit_loco.io.lock.FolderInUse`,
    a lock file that is a symlink, a filesystem without locks, the recheck's refusal), so a
    second launch stops on each with the same line."""
    failure = None
    if group.is_main:
        try:
            lock.acquire()
            if recheck is not None:
                recheck()
        except (OSError, ValueError) as error:
            failure = error
    failure = group.broadcast(failure)
    if failure is not None:
        raise failure


def claim_output(out: Path, config: TrainConfig, group: WorkerGroup, lock: FolderLock) -> None:
    """Hold ``out``'s lock (:func:`hold_output`; a resumed run took it before reading its
    checkpoint), then let a fresh run delete a previous run's files there (``force``). Called
    once every check has passed, so a run that cannot start leaves ``out`` as it found it. A
    fresh run checks ``out`` again once the lock is its own: a run that finished there while
    this one prepared is refused without ``force``, as it would have been at the start."""
    fresh = not config.checkpoint.resume
    hold_output(lock, group, (lambda: check_output(out, config)) if fresh else None)
    if group.is_main and not config.checkpoint.resume:
        clear_previous_run(out)
    group.barrier()


def check_final_is_a_model(final: Path) -> None:
    """Refuse (:class:`OutputRefused`) a ``final/`` that holds more than a model
    (:func:`~mergekit_loco.io.atomic.foreign_entry`): writing the final model replaces it."""
    foreign = foreign_entry(final) if final.exists() or final.is_symlink() else None
    if foreign is not None:
        holds = "" if foreign == final else f" (it holds {shown(foreign.name)})"
        raise OutputRefused(
            f"{shown(final)}: holds more than the model a run writes there{holds}, and a "
            "resumed run writes final/ anew; move it out of the run folder, then --resume"
        )


def save_final(folder: Path, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> None:
    """``folder``: config.json + model.safetensors + tokenizer, staged beside and renamed in
    (:func:`mergekit_loco.io.atomic.staged_output`; a previous final model is replaced, but
    never a folder holding anything else: :class:`OutputRefused`)."""
    check_final_is_a_model(folder)
    hf_logging.disable_progress_bar()
    try:
        with staged_output(folder, FINAL_KIND, replace=True) as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
    finally:
        hf_logging.enable_progress_bar()


def read_events(path: Path) -> list[tuple[str, dict]]:
    """The non-empty lines of ``metrics.jsonl`` with their JSON objects, streamed; a line that
    is not a JSON object with an integer round, a round event whose train loss is not a finite
    number above 0, or a line longer than ``MAX_EVENT_BYTES`` is an error naming the file and
    line, except the torn write of a killed run (a last line with no line ending that is not
    JSON), which is dropped."""
    events = []
    lines = list(read_lines(path, MAX_METRICS_BYTES, "metrics file", MAX_EVENT_BYTES))
    torn = len(lines) if not ends_a_line(path) else 0
    for number, line in enumerate(lines, start=1):
        where = f"{shown(path)}:{number}"
        if line is None:
            raise ValueError(f"{where}: a line over {MAX_EVENT_BYTES} bytes; a damaged metrics log")
        if not line.strip():
            continue
        try:
            event = parse_json(line, where)
        except UnsafeInputError as error:
            if number == torn:
                continue
            raise ValueError(f"{error}; a damaged metrics log (fix or delete that line)") from None
        if not isinstance(event, dict) or type(event.get("round", 0)) is not int:
            raise ValueError(f"{where}: not a metrics event (a JSON object)")
        if event.get("event") == "round" and "train_loss" in event:
            loss = float_or_none(event["train_loss"])
            if loss is None or not math.isfinite(loss) or loss <= 0:
                shown_loss = json.dumps(event["train_loss"])[:40]
                raise ValueError(
                    f"{where}: train_loss {shown_loss} is not a loss (a finite number above 0); "
                    "a damaged metrics log (fix or delete that line)"
                )
        events.append((line.decode(), event))
    return events


def ends_a_line(path: Path) -> bool:
    """``path`` is empty or its last byte is a line ending."""
    with open(path, "rb") as handle:
        if not handle.seek(0, os.SEEK_END):
            return True
        handle.seek(-1, os.SEEK_END)
        return handle.read(1) in (b"\n", b"\r")


#: Bounds on ``metrics.jsonl`` read on resume (a run writes a few hundred bytes a round).
MAX_METRICS_BYTES = 1 << 28
MAX_EVENT_BYTES = 1 << 16


class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, appended and flushed (rank 0 only).

    On resume the lines after the checkpoint's round are dropped, so the log of a resumed run
    reads like that of an uninterrupted one. A run extended past its end (more ``rounds`` than
    it finished) keeps its old final validation loss as an eval event of that round.
    ``resumed_train_loss``: the train loss logged for the checkpoint's round (the final line of
    a run resumed after its last round repeats it), None when the log does not hold it.
    ``missing_rounds``: the rounds up to the checkpoint's that the log lacks (cut, deleted).
    """

    def __init__(self, path: Path, enabled: bool, keep_until_round: int, rounds: int):
        self.path = path
        self.enabled = enabled
        self.resumed_train_loss: float | None = None
        self.missing_rounds: list[int] = []
        if enabled and not path.is_file():
            self.missing_rounds = list(range(1, keep_until_round + 1))
        if enabled and path.is_file():
            events = read_events(path)
            logged = {e.get("round") for _, e in events if e.get("event") == "round"}
            self.missing_rounds = [r for r in range(1, keep_until_round + 1) if r not in logged]
            evaluated = {e["round"] for _, e in events if e.get("event") == "eval" and "round" in e}
            kept = []
            for line, event in events:
                at = event.get("round", 0)
                if at > keep_until_round:
                    continue
                loss = float_or_none(event.get("train_loss"))  # checked by read_events
                if event.get("event") == "round" and at == keep_until_round and loss is not None:
                    self.resumed_train_loss = loss
                if event.get("event") == "final":
                    if at >= rounds or at in evaluated or "val_loss" not in event:
                        continue
                    line = json.dumps({"event": "eval", "round": at, "val_loss": event["val_loss"]})
                kept.append(line)
            write_atomically(path, "".join(f"{line}\n" for line in kept))

    def write(self, **event) -> None:
        if self.enabled:
            with open(self.path, "a") as stream:
                stream.write(json.dumps(event) + "\n")
