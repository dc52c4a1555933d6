"""The aggregator sweep: which aggregator for my R and H?

Every (aggregator, R, H, seed, outer lr, outer momentum) cell is an ordinary training run in
``OUT/runs/<cell>/`` under the FLOP-matched protocol (every cell sees the same tokens with the
same global batch; each of R workers takes ``global_batch / R`` sequences per inner step), plus
the data-parallel AdamW baseline once per seed. A finished cell is never rerun; an unfinished
one resumes. The report is :mod:`mergekit_loco.compare.sweep_report`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from mergekit_loco import run_layout
from mergekit_loco.compare import check_unique, results_lock
from mergekit_loco.compare.runs import (
    BASELINE,
    FAILED_FILE,
    is_finished,
    load_run,
    read_run_config,
    run_configs,
    setting_conflict,
    setting_value,
)
from mergekit_loco.compare.sweep_report import SummaryRow, report_sweep
from mergekit_loco.compare.tables import format_number
from mergekit_loco.io.atomic import check_results_folder, claim_folder, write_atomically
from mergekit_loco.io.files import read_json, shown
from mergekit_loco.train.checkpoint import (
    ONLY_CHECKPOINT_ADVICE,
    CheckpointCorrupt,
    latest_checkpoint,
)
from mergekit_loco.train.config import TrainConfig, preset_config
from mergekit_loco.train.guards import TrainingFailed
from mergekit_loco.train.loop import train
from mergekit_loco.train.model import check_seq_len, model_config
from mergekit_loco.train.run_folder import run_inputs
from mergekit_loco.train.signals import TrainingInterrupted
from mergekit_loco.train.sources import BUILTIN_SOURCES

#: The most cells trained at once (one process each).
MAX_JOBS = 1024


# -- planning ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One training run of a sweep: a preset at R workers, H inner steps, one seed, outer lr and
    momentum (None: the preset's own)."""

    aggregator: str
    workers: int
    inner_steps: int
    seed: int
    outer_lr: float | None = None
    outer_momentum: float | None = None

    @property
    def name(self) -> str:
        if self.aggregator == BASELINE:
            return f"{self.aggregator}-s{self.seed}"
        lr = "" if self.outer_lr is None else f"-lr{self.outer_lr:g}"
        momentum = "" if self.outer_momentum is None else f"-m{self.outer_momentum:g}"
        return f"{self.aggregator}-R{self.workers}-H{self.inner_steps}{lr}{momentum}-s{self.seed}"


@dataclass(frozen=True)
class Grid:
    """Values of one outer hyperparameter to try. ``relative`` (outer lr): ``default`` holds
    multipliers of each preset's value; otherwise (outer momentum) the values themselves, for
    the presets that have momentum. ``named`` holds absolute values for named aggregators (these
    win). Empty: the preset's own value only."""

    default: tuple[float, ...] = ()
    named: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    relative: bool = True
    option: str = "--outer-lr-grid"

    @classmethod
    def parse(
        cls, specs: Sequence[str], option: str = "--outer-lr-grid", relative: bool = True
    ) -> Grid:
        """``["0.5,1,2"]`` -> default; ``["isoloco=1.2,1.8", "diloco=0.7"]`` -> named."""
        default: tuple[float, ...] = ()
        named: dict[str, tuple[float, ...]] = {}
        example = "0.5,1,2" if relative else "0.8,0.9"
        for spec in specs:
            name, _, values = spec.rpartition("=")
            try:
                numbers = tuple(float(v) for v in values.split(",") if v.strip())
            except ValueError:
                raise ValueError(f"{option} {spec!r}: expected numbers like {example}") from None
            if not numbers or not all(0 < v < math.inf for v in numbers):  # NaN fails too
                raise ValueError(f"{option} {spec!r}: give positive finite numbers")
            if not relative and any(v >= 1 for v in numbers):
                raise ValueError(f"{option} {spec!r}: momentum must lie in (0, 1)")
            check_unique(f"{option} {spec!r}", numbers)
            if name.strip() in named:
                raise ValueError(
                    f"{option} names {name.strip()!r} twice; give its values once, like "
                    f"{name.strip()}={example}"
                )
            if name:
                named[name.strip()] = numbers
            elif default:
                raise ValueError(f"{option}: give the values for every aggregator once")
            else:
                default = numbers
        return cls(default, named, relative, option)

    def values(self, aggregator: str, preset_value: float) -> list[float | None]:
        """The values for ``aggregator``: a relative default multiplies ``preset_value``; the
        preset's own is written None (one cell name for it with and without a grid). An
        absolute grid skips presets without momentum (0) unless it names them.

        Refuses two values that agree to the 6 significant digits a cell's name shows
        (``lr0.35``) and the report reads (:func:`~mergekit_loco.compare.runs.setting_value`):
        the sweep would take their cells for one (a second cell of one name starts over in the
        first's folder)."""
        if aggregator in self.named:
            given, scale = self.named[aggregator], 1.0
        elif self.default and self.relative:
            given, scale = self.default, preset_value
        elif self.default and preset_value > 0:
            given, scale = self.default, 1.0
        else:
            return [None]
        tolerance = 1e-12 * abs(preset_value)
        values: list[float | None] = []
        shown: dict[float, float] = {}
        for value in given:
            trained = value * scale
            digits = setting_value(trained)
            if digits in shown:
                raise ValueError(
                    f"{self.option}: {shown[digits]} and {value} give {aggregator} the value "
                    f"{digits:g} to the 6 significant digits its cell names show, so the sweep "
                    "would take their cells for one; give values that differ in those digits"
                )
            shown[digits] = value
            values.append(None if abs(trained - preset_value) <= tolerance else trained)
        return values


@dataclass(frozen=True)
class Sweep:
    """The cells to run. ``shared`` holds the TrainConfig fields all cells have in common
    (model, tokens, global_batch, seq_len, data, and e.g. inner_lr, weight_decay, val_seed,
    which then override every preset's): that is what makes them FLOP-matched."""

    aggregators: Sequence[str]
    workers: Sequence[int]
    inner_steps: Sequence[int] = (30,)
    seeds: Sequence[int] = (0,)
    outer_lr_grid: Grid = Grid()
    outer_momentum_grid: Grid = Grid(relative=False, option="--outer-momentum-grid")
    baseline: bool = True
    shared: Mapping[str, Any] = field(default_factory=dict)


def plan(sweep: Sweep) -> list[Cell]:
    """Every cell of ``sweep``, baseline first. Checks up front that the grids name swept
    aggregators, that no two cells share a name (a list option or grid holding one value
    twice, or grid values a name shows alike: :meth:`Grid.values`), that the global batch
    splits over every R, and that every cell trains on the same number of tokens (a budget of
    whole rounds for every H)."""
    for grid in (sweep.outer_lr_grid, sweep.outer_momentum_grid):
        unknown = set(grid.named) - set(sweep.aggregators)
        if unknown:
            raise ValueError(f"{grid.option} names {sorted(unknown)[0]!r}, not in --aggregators")
    if BASELINE in sweep.aggregators:
        raise ValueError(f"{BASELINE!r} is the baseline; it runs unless --no-baseline")
    check_unique("--aggregators", sweep.aggregators)
    check_unique("--workers", sweep.workers)
    check_unique("--inner-steps", sweep.inner_steps)
    check_unique("--seeds", sweep.seeds)
    cells = []
    if sweep.baseline:
        cells += [Cell(BASELINE, 1, sweep.inner_steps[0], seed) for seed in sweep.seeds]
    for aggregator in sweep.aggregators:
        first = Cell(aggregator, sweep.workers[0], sweep.inner_steps[0], sweep.seeds[0])
        preset = cell_config(sweep, first, Path())
        lrs = sweep.outer_lr_grid.values(aggregator, preset.outer.lr)
        momenta = sweep.outer_momentum_grid.values(aggregator, preset.outer.momentum)
        for inner_steps in sweep.inner_steps:
            for workers in sweep.workers:
                for lr in lrs:
                    for momentum in momenta:
                        cells += [Cell(aggregator, workers, inner_steps, seed, lr, momentum)
                                  for seed in sweep.seeds]  # fmt: skip
    configs = {cell.inner_steps: cell_config(sweep, cell, Path()) for cell in cells}
    budgets = {steps: trained_tokens(config) for steps, config in configs.items()}
    if len(set(budgets.values())) > 1:
        raise ValueError(
            "cells would train on different token counts ("
            + ", ".join(f"H={h}: {t:,}" for h, t in sorted(budgets.items()))
            + "); choose --tokens as a multiple of every round size H x global batch x seq len ("
            + ", ".join(f"{c.tokens_per_round():,}" for c in configs.values())
            + ")"
        )
    return cells


def trained_tokens(config: TrainConfig) -> int | None:
    """Tokens a run trains on: whole rounds of the budget (None for a per-parameter budget)."""
    if config.data.chinchilla is not None:
        return None
    return config.total_rounds() * config.tokens_per_round()


def cell_config(sweep: Sweep, cell: Cell, run_dir: Path, **runtime) -> TrainConfig:
    """The validated training config of ``cell``: its preset, the shared fields, R, H, seed, lr.
    Unless ``shared`` says otherwise, a cell evaluates about 8 times and checkpoints about 4
    times over its rounds (so a stopped sweep resumes mid-cell)."""
    cell_fields = {"seed": cell.seed, "out": str(run_dir), **runtime}
    cell_fields |= {"workers": cell.workers, "inner_steps": cell.inner_steps}
    if cell.outer_lr is not None:
        cell_fields["outer_lr"] = cell.outer_lr
    if cell.outer_momentum is not None:
        cell_fields["outer_momentum"] = cell.outer_momentum
    config = preset_config(cell.aggregator, **{**sweep.shared, **cell_fields})
    rounds = config.total_rounds() if config.data.chinchilla is None else 8
    cadence = {"eval_every": max(1, rounds // 8), "checkpoint_every": max(1, rounds // 4)}
    return config.replace(**{k: v for k, v in cadence.items() if k not in sweep.shared})


# -- running ----------------------------------------------------------------------------------
def run_cell(sweep: Sweep, cell: Cell, run_dir: Path, progress: bool = False) -> str:
    """Train one cell: ``"ran"``, ``"resumed"`` (from its latest checkpoint), ``"failed"`` or
    ``"stopped"`` (by ``stop_after``; it resumes next time).

    A run that cannot finish for numerical reasons (a non-finite loss, e.g. at a too-large outer
    lr, or an SVD of the aggregator that does not converge) is an outcome of the cell, not an
    error of the sweep: it is recorded in ``failed.json`` and the sweep goes on (delete the
    folder to try it again). The checkpoints of a finished cell are deleted (final/ is kept).
    A damaged only checkpoint is an error whose advice is compare's: delete the cell's folder;
    so is any other failure (:class:`TrainingFailed`: out of memory, a full disk): rerun the
    compare command, which resumes the cell from its last checkpoint (compare has no --resume).
    """
    resumable = latest_checkpoint(run_dir) is not None
    if resumable:  # checked as the sweep defines it, not as the saved config.json fills it in
        config = cell_config(sweep, cell, run_dir)
        check_same_run(config, run_dir)
        config = config.replace(resume=True)
    else:  # new, or stopped before its first checkpoint: start over
        config = cell_config(sweep, cell, run_dir, force=True)
    try:
        if not train(config, progress=progress).finished:
            return "stopped"  # stop_after: resumes next time
        outcome = "resumed" if resumable else "ran"
    except CheckpointCorrupt as error:
        advice = (
            f"this is the cell's only checkpoint: delete {run_dir} and run the same compare "
            "command again to train the cell from the start"
        )
        raise CheckpointCorrupt(str(error).replace(ONLY_CHECKPOINT_ADVICE, advice)) from None
    except TrainingFailed as error:
        then = "resumes from it" if error.last_saved[1] is not None else "starts over"
        raise TrainingFailed(
            f"cell {cell.name}: {error.failure}",
            error.last_saved,
            f"Run the same compare command to go on: finished cells are kept, this one {then}.",
        ) from error.__cause__
    except (FloatingPointError, torch.linalg.LinAlgError) as error:
        failure = {"error": f"{type(error).__name__}: {error}"}
        write_atomically(run_dir / FAILED_FILE, json.dumps(failure) + "\n")
        outcome = "failed"
    shutil.rmtree(run_dir / run_layout.CHECKPOINTS, ignore_errors=True)
    return outcome


def check_same_run(config: TrainConfig, run_dir: Path) -> None:
    """Refuse to reuse a run folder that holds a run of another config."""
    differences = config.differences(read_run_config(run_dir))
    if differences:
        raise ValueError(
            f"{run_dir} holds another run ({'; '.join(differences)}); choose another -o folder"
        )


def cell_process(
    sweep: Sweep, cell: Cell, run_dir: Path, threads: int, parent: int, report: Connection
) -> None:
    """The body of a cell's own process (:class:`CellProcess`): :func:`die_with_parent`,
    ``threads`` torch threads, :func:`run_cell`, then its outcome, or the error it raised (with
    this process's traceback as a note, which ``--debug`` shows), sent to the sweep process
    ``parent`` through ``report``. A SIGTERM outside training's own handler (tokenizer, data,
    cleanup) is the cell's :class:`TrainingInterrupted`, as one inside it is."""

    def stopped(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once is enough: the cell reports, ends
        raise TrainingInterrupted(f"{cell.name}: stopped before it trained")

    try:
        die_with_parent(parent)
        signal.signal(signal.SIGTERM, stopped)
        torch.set_num_threads(threads)
        result: str | BaseException = run_cell(sweep, cell, run_dir)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cell has ended: report, then exit
    except BaseException as error:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nor may a SIGTERM cut the report short
        result = sendable(error, cell)
        result.add_note(f"in the process of cell {cell.name}: {traceback.format_exc()}")
    with contextlib.suppress(BrokenPipeError):  # the sweep died: no one is left to tell
        report.send(result)


def sendable(error: BaseException, cell: Cell) -> BaseException:
    """``error`` if pickle carries it to the sweep whole (same type and message), else a
    RuntimeError naming ``cell``, its type and message (an exception whose ``__init__`` takes
    other arguments than it passes on, say, cannot be unpickled)."""
    try:
        back = pickle.loads(pickle.dumps(error))
    except Exception:  # whatever pickling or unpickling it raises
        back = None
    if type(back) is type(error) and str(back) == str(error):
        return error
    return RuntimeError(f"cell {cell.name}: {type(error).__name__}: {error}")


class CellDied(RuntimeError):
    """A cell's process ended without reporting (killed, e.g. by the out-of-memory killer, or
    crashed); the sweep stopped its other cells, which resume, as the dead one does (it is not
    a failed cell)."""


def run_sweep(
    sweep: Sweep,
    out: str | Path,
    jobs: int = 1,
    console: Console | None = None,
    progress: bool = True,
    figures: bool = True,
) -> list[SummaryRow]:
    """Run every unfinished cell of ``sweep`` into ``out/runs/`` (:func:`run_cells`), then
    write the report; ``out`` is locked meanwhile (a second sweep there is refused)."""
    if not 1 <= jobs <= MAX_JOBS:
        raise ValueError(f"--jobs must be in [1, {MAX_JOBS}], got {jobs}")
    runs_dir = Path(out) / run_layout.SWEEP_RUNS
    cells = plan(sweep)
    configs = [cell_config(sweep, cell, runs_dir / cell.name) for cell in cells]
    inputs = {path for config in configs for path in run_inputs(config)}
    models = {(c.model.name, c.data.vocab_size, c.data.seq_len) for c in configs}
    for name, vocab_size, seq_len in models:  # a cell would fail only once it has started
        check_seq_len(model_config(name, vocab_size), seq_len, name)
    check_results_folder(
        Path(out),
        run_layout.SWEEP_KIND,
        inputs - set(BUILTIN_SOURCES),
        (run_layout.SWEEP_RUNS,),
        has_force=False,  # --force is merge mode's
    )
    record = data_record(configs[0])  # a --data that cannot be read creates no folder
    with results_lock(Path(out)) as lock:
        lock.acquire()
        claim_folder(Path(out), run_layout.SWEEP_KIND)
        check_one_comparison(Path(out), cells, configs, record)
        console = console or Console(quiet=True)
        run_cells(sweep, cells, runs_dir, jobs, console, progress)
        return report_sweep(out, console=console, figures=figures)


#: The sweep folder's record of the data its runs trained on (:func:`check_same_data`).
DATA_FILE = "data.json"
NEW_FOLDER_ADVICE = "the runs of one compare folder share its fixed settings; choose a new -o"


def check_one_comparison(
    out: Path, cells: Sequence[Cell], configs: Sequence[TrainConfig], record: dict
) -> None:
    """Refuse to add cells to ``out`` whose fixed settings
    (:data:`~mergekit_loco.compare.runs.FIXED_SETTINGS`) differ from those of the runs it holds
    (a cell of another budget, data or validation set would be paired with them as if
    comparable), or to run in a folder whose runs already differ; then :func:`check_same_data`
    with the sweep's data ``record`` (:func:`data_record`)."""
    runs_dir = out / run_layout.SWEEP_RUNS
    held = run_configs(runs_dir)
    conflict = setting_conflict(held)
    if conflict is not None:
        raise ValueError(
            f"{shown(out)}: its runs are not one comparison, they differ in {conflict.values()}"
            f"; move the differing runs out of {shown(runs_dir)}, or {NEW_FOLDER_ADVICE} folder"
        )
    names = {name for name, _ in held}
    planned = [(c.name, config.to_dict()) for c, config in zip(cells, configs, strict=True)
               if c.name not in names]  # fmt: skip
    conflict = setting_conflict(held + planned)
    if conflict is not None:
        (old_name, old), (new_name, new) = conflict.first, conflict.other
        raise ValueError(
            f"{shown(out)}: cell {new_name} would train with {conflict.key} {json.dumps(new)}, "
            f"the folder's runs with {json.dumps(old)} (e.g. {old_name}); {NEW_FOLDER_ADVICE} "
            "folder for this comparison"
        )
    check_same_data(out, record, has_runs=bool(held))


def data_record(config: TrainConfig) -> dict:
    """What ``out/data.json`` records of the data a sweep trains on: the spec and the sha256 of
    its documents' names and texts
    (:func:`~mergekit_loco.train.documents.content_fingerprint`). Reads the data: a spec that
    names nothing readable raises here."""
    from mergekit_loco.train.documents import content_fingerprint
    from mergekit_loco.train.sources import load_documents

    documents = content_fingerprint(load_documents(config.data.source))
    return {"data": config.data.source, "documents": documents}


def check_same_data(out: Path, record: dict, has_runs: bool) -> None:
    """Refuse to add runs to ``out`` once the documents of its data spec changed (a file edited,
    added or removed): ``record`` (:func:`data_record`) no longer matches ``out/data.json``,
    written by the first sweep there (a folder moved to another machine, or data reinstalled
    unchanged, still matches). A folder from before the record gets one (what its runs read
    cannot be told any more)."""
    path = out / DATA_FILE
    saved = read_json(path, "sweep data record") if path.is_file() else None
    if saved == record:
        return
    if has_runs and isinstance(saved, dict) and saved.get("documents") != record["documents"]:
        raise ValueError(
            f"{shown(out)}: the documents of --data {record['data']} changed since its runs "
            f"trained ({shown(path)} holds their fingerprint); {NEW_FOLDER_ADVICE} folder"
        )
    write_atomically(path, json.dumps(record, indent=2) + "\n")


def run_cells(
    sweep: Sweep, cells: list[Cell], runs_dir: Path, jobs: int, console: Console, progress: bool
) -> None:
    """Run every unfinished cell into ``runs_dir`` (a finished one must be of this sweep):
    ``jobs`` at a time, each in a process of its own (:class:`CellProcess`) with ``cpu_count /
    jobs`` threads, started in order as others end; each cell's training holds its own run
    folder's lock. A cell's error is raised here, once the other cells are stopped
    (:func:`stop_cells`), as is a stop of the sweep (SIGTERM: :func:`stopped_by_sigterm`). A cell
    whose process dies without reporting (killed, e.g. out of memory, or crashed) stops the
    sweep, as a stop does (:class:`CellDied`): it is not a failed cell, and at the same ``jobs``
    the next one would likely die too."""
    todo = []
    for cell in cells:
        run_dir = runs_dir / cell.name
        if is_finished(run_dir):
            check_same_run(cell_config(sweep, cell, run_dir), run_dir)
        else:
            todo.append(cell)
    console.print(
        f"{len(cells)} cells, {len(cells) - len(todo)} finished before, {len(todo)} to run"
    )
    started, count = time.perf_counter(), 0

    def done(cell: Cell, outcome: str) -> None:
        nonlocal count
        count += 1
        loss = load_run(runs_dir / cell.name).val_loss
        elapsed = time.perf_counter() - started
        console.print(
            f"[{count}/{len(todo)}] {cell.name}: {outcome}, val loss {format_number(loss)}"
            f" ({sweep_pace(count, len(todo), elapsed, jobs)})"
        )

    if jobs == 1:
        for cell in todo:
            done(cell, run_cell(sweep, cell, runs_dir / cell.name, progress))
        return
    threads = max(1, (os.cpu_count() or 1) // jobs)
    waiting, running = list(reversed(todo)), []
    with stopped_by_sigterm():
        try:
            while waiting or running:
                while waiting and len(running) < jobs:  # first in, first started
                    cell = waiting.pop()
                    running.append(CellProcess(sweep, cell, runs_dir / cell.name, threads))
                ended = wait_for_cells(running)
                for job in ended:
                    running.remove(job)
                settle(ended, done)
        except BaseException:
            stop_cells(running)
            raise


def settle(ended: Sequence[CellProcess], done: Callable[[Cell, str], None]) -> None:
    """Tell ``done`` of every cell in ``ended`` that finished, then raise for the others: a
    :class:`CellDied` naming each cell whose process died without reporting, else the first
    error a cell reported. (Before: a cell that finished in the same wait as one that died or
    failed went untold.)"""
    for job in ended:
        if isinstance(job.report, str):
            done(job.cell, job.report)
    dead = {job.cell: job.process.exitcode for job in ended if job.report is None}
    if dead:
        raise CellDied(death_message(dead))
    for job in ended:
        job.outcome()  # raises the error the cell reported


class CellProcess:
    """A cell training in its own spawned process (:func:`cell_process`), and what that process
    reported: the cell's outcome or error; None until then, or if it ended without reporting."""

    def __init__(self, sweep: Sweep, cell: Cell, run_dir: Path, threads: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.cell = cell
        self.report: str | BaseException | None = None
        self.reader, writer = context.Pipe(duplex=False)
        self.process = context.Process(
            target=cell_process,
            args=(sweep, cell, run_dir, threads, os.getpid(), writer),
            name=f"mloco cell {cell.name}",
        )
        self.process.start()
        writer.close()  # the cell's process holds the other copy: the pipe ends with it

    def receive(self) -> None:
        """Take the report, if one came (call once the pipe or the process is ready)."""
        if self.reader.closed:
            return
        if self.reader.poll():
            with contextlib.suppress(EOFError):  # the process ended without reporting
                self.report = self.reader.recv()
        self.reader.close()

    def outcome(self) -> str:
        """The cell's outcome (:func:`run_cell`); raises the error the cell raised."""
        if isinstance(self.report, BaseException):
            raise self.report
        return self.report


def wait_for_cells(running: Sequence[CellProcess]) -> list[CellProcess]:
    """Wait until some of the ``running`` cells' processes end, and return those, joined (their
    exit codes are then known). Reports are read as they come: one larger than the pipe holds
    would keep its process from ending until read."""
    while True:
        readers = [job.reader for job in running if not job.reader.closed]
        ready = multiprocessing.connection.wait(readers + [job.process.sentinel for job in running])
        for job in running:
            if job.reader in ready or job.process.sentinel in ready:
                job.receive()
        ended = [job for job in running if job.process.sentinel in ready]
        for job in ended:
            job.process.join()
        if ended:
            return ended


def death_message(exit_codes: Mapping[Cell, int | None]) -> str:
    """What to tell of cells whose process died, by exit code (negative: the signal; None: not
    known): which, how, the likely cause (SIGKILL: the out-of-memory killer), and how to
    resume."""
    deaths = []
    for cell, code in exit_codes.items():
        if code is None:
            how = "its exit status could not be read"
        elif code == -signal.SIGKILL:
            how = "killed by SIGKILL, likely by the out-of-memory killer: try fewer --jobs"
        elif code < 0:
            how = f"killed by signal {-code}: {signal.strsignal(-code)}"
        else:
            how = f"exit code {code}"
        deaths.append(f"the process of cell {cell.name} died ({how})")
    return (
        f"{'; '.join(deaths)}; the sweep stopped. Finished cells are kept: run the same command "
        "to resume (unfinished cells continue from their last checkpoint)"
    )


def sweep_pace(count: int, total: int, elapsed: float, jobs: int = 1) -> str:
    """``N s into the sweep``, and while cells remain, the time left if the other ``total -
    count`` cells take what the first ``count`` took on average: ``elapsed / count`` each
    (shown once ``jobs`` cells have ended: the first ones to end ran beside the others)."""
    pace = f"{elapsed:.0f} s into the sweep"
    if count >= total or count < jobs:
        return pace
    left = elapsed / count * (total - count)
    if round(left) < 120:
        shown = f"{left:.0f} s"
    elif round(left / 60) < 120:
        shown = f"{left / 60:.0f} min"
    else:
        shown = f"{left / 3600:.1f} h"
    return f"{pace}; about {shown} left at this pace"


#: prctl's option that names the signal a process gets when its parent dies (linux/prctl.h).
PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """In a cell's process: Linux sends it SIGTERM when the sweep process ``parent`` dies, even
    by SIGKILL or the OOM killer (an orphan would train its cell on in the sweep's folders,
    racing a rerun). SIGTERM, as :func:`stop_cells` sends, not SIGKILL: the cell stops at its
    next inner step, a checkpoint being written is completed, and the process ends
    (:func:`cell_process`). Ends at once too if the sweep died before the request was made.
    The signal follows the thread that started the process: :func:`run_cells`' thread, which
    outlives the cells."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
        if os.getppid() != parent:
            signal.raise_signal(signal.SIGTERM)


def stop_cells(running: Sequence[CellProcess], grace_seconds: float = 60.0) -> None:
    """SIGTERM to every running cell's process: its cell stops at the next inner step, keeping
    its last checkpoint, and the process ends (:func:`cell_process`); one still alive after
    ``grace_seconds`` is killed. No report is awaited (closed, a pipe cannot hold a process
    up). No cell's process outlives the sweep (a rerun would race it in the same folders)."""
    for job in running:
        job.reader.close()
        job.process.terminate()
    deadline = time.monotonic() + grace_seconds
    for job in running:
        job.process.join(max(0.0, deadline - time.monotonic()))
        if job.process.is_alive():
            job.process.kill()


@contextlib.contextmanager
def stopped_by_sigterm():
    """SIGTERM raises KeyboardInterrupt here, as Ctrl-C does (main thread only), so a sweep
    that is terminated stops its cells' processes instead of dying without them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
