"""Sweeps: which aggregator for my R and H? And which merge method keeps my fine-tunes?

Aggregator mode: every (aggregator, R, H, seed, outer lr) cell is an ordinary training run in
``OUT/runs/<cell>/`` under the FLOP-matched protocol (every cell sees the same tokens with the same
global batch; each of R workers takes ``global_batch / R`` sequences per inner step), plus the
data-parallel AdamW baseline once per seed. A finished cell is never rerun; an unfinished one
resumes. Merge mode: merge fine-tunes with every method and scale, evaluate every merge on every
fine-tune's domain, choose the scale on one half of the held-out tokens, report on the other.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from mergekit_loco import evaluate, report
from mergekit_loco.io.atomic import write_atomically
from mergekit_loco.merge import merge_checkpoints
from mergekit_loco.methods import get_method
from mergekit_loco.train.checkpoint import latest_checkpoint
from mergekit_loco.train.config import TrainConfig, preset_config
from mergekit_loco.train.loop import train

RUNS = "runs"
CHECKPOINTS = "checkpoints"
DEFAULT_EVAL_SEQ_LEN = 128


# -- planning ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One training run of a sweep: a preset at R workers, H inner steps, one seed and outer lr
    (None: the preset's own)."""

    aggregator: str
    workers: int
    inner_steps: int
    seed: int
    outer_lr: float | None = None

    @property
    def name(self) -> str:
        if self.aggregator == report.BASELINE:
            return f"{self.aggregator}-s{self.seed}"
        lr = "" if self.outer_lr is None else f"-lr{self.outer_lr:g}"
        return f"{self.aggregator}-R{self.workers}-H{self.inner_steps}{lr}-s{self.seed}"


@dataclass(frozen=True)
class OuterLrGrid:
    """Outer lrs to try: ``multipliers`` of each preset's lr, or ``absolute`` values for named
    aggregators (these win over the multipliers). Empty: the preset's lr only."""

    multipliers: tuple[float, ...] = ()
    absolute: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    @classmethod
    def parse(cls, specs: Sequence[str]) -> OuterLrGrid:
        """``["0.5,1,2"]`` -> multipliers; ``["isoloco=1.2,1.8", "diloco=0.7"]`` -> absolute."""
        multipliers: tuple[float, ...] = ()
        absolute: dict[str, tuple[float, ...]] = {}
        for spec in specs:
            name, _, values = spec.rpartition("=")
            try:
                numbers = tuple(float(v) for v in values.split(",") if v.strip())
            except ValueError:
                raise ValueError(
                    f"--outer-lr-grid {spec!r}: expected numbers like 0.5,1,2"
                ) from None
            if not numbers or any(v <= 0 for v in numbers):
                raise ValueError(f"--outer-lr-grid {spec!r}: give positive numbers")
            if name:
                absolute[name.strip()] = numbers
            elif multipliers:
                raise ValueError("--outer-lr-grid: give the multipliers once")
            else:
                multipliers = numbers
        return cls(multipliers, absolute)

    def values(self, aggregator: str, preset_lr: float) -> list[float | None]:
        """The outer lrs for ``aggregator``; the preset's own lr is written None (one cell name
        for it with and without a grid)."""
        if aggregator in self.absolute:
            lrs = self.absolute[aggregator]
        elif self.multipliers:
            lrs = tuple(m * preset_lr for m in self.multipliers)
        else:
            return [None]
        return [None if abs(lr - preset_lr) <= 1e-12 * preset_lr else lr for lr in lrs]


@dataclass(frozen=True)
class Sweep:
    """The cells to run. ``shared`` holds the TrainConfig fields all cells have in common
    (model, tokens, global_batch, seq_len, data, ...): that is what makes them FLOP-matched."""

    aggregators: Sequence[str]
    workers: Sequence[int]
    inner_steps: Sequence[int] = (30,)
    seeds: Sequence[int] = (0,)
    outer_lr_grid: OuterLrGrid = OuterLrGrid()
    baseline: bool = True
    shared: Mapping[str, Any] = field(default_factory=dict)


def plan(sweep: Sweep) -> list[Cell]:
    """Every cell of ``sweep``, baseline first. Checks up front that the grid names swept
    aggregators, that the global batch splits over every R, and that every cell trains on the
    same number of tokens (a budget of whole rounds for every H)."""
    unknown = set(sweep.outer_lr_grid.absolute) - set(sweep.aggregators)
    if unknown:
        raise ValueError(f"--outer-lr-grid names {sorted(unknown)[0]!r}, not in --aggregators")
    if report.BASELINE in sweep.aggregators:
        raise ValueError(f"{report.BASELINE!r} is the baseline; it runs unless --no-baseline")
    cells = []
    if sweep.baseline:
        cells += [Cell(report.BASELINE, 1, sweep.inner_steps[0], seed) for seed in sweep.seeds]
    for aggregator in sweep.aggregators:
        first = Cell(aggregator, sweep.workers[0], sweep.inner_steps[0], sweep.seeds[0])
        preset_lr = cell_config(sweep, first, Path()).outer_lr
        for inner_steps in sweep.inner_steps:
            for workers in sweep.workers:
                for lr in sweep.outer_lr_grid.values(aggregator, preset_lr):
                    cells += [
                        Cell(aggregator, workers, inner_steps, seed, lr) for seed in sweep.seeds
                    ]
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
    if config.chinchilla is not None:
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
    config = preset_config(cell.aggregator, **{**sweep.shared, **cell_fields})
    rounds = config.total_rounds() if config.chinchilla is None else 8
    cadence = {"eval_every": max(1, rounds // 8), "checkpoint_every": max(1, rounds // 4)}
    return replace(config, **{k: v for k, v in cadence.items() if k not in sweep.shared})


# -- running ----------------------------------------------------------------------------------
def run_cell(sweep: Sweep, cell: Cell, run_dir: Path, progress: bool = False) -> str:
    """Train one cell: ``"ran"``, ``"resumed"`` (from its latest checkpoint), ``"failed"`` or
    ``"stopped"`` (by ``stop_after``; it resumes next time).

    A run that cannot finish for numerical reasons (a non-finite loss, e.g. at a too-large outer
    lr, or an SVD of the aggregator that does not converge) is an outcome of the cell, not an
    error of the sweep: it is recorded in ``failed.json`` and the sweep goes on (delete the
    folder to try it again). The checkpoints of a finished cell are deleted (final/ is kept).
    """
    resumable = latest_checkpoint(run_dir) is not None
    if resumable:
        config = cell_config(sweep, cell, run_dir, resume=True)
        check_same_run(config, run_dir)
    else:  # new, or stopped before its first checkpoint: start over
        config = cell_config(sweep, cell, run_dir, force=True)
    try:
        if not train(config, progress=progress).finished:
            return "stopped"  # stop_after: resumes next time
        outcome = "resumed" if resumable else "ran"
    except (FloatingPointError, torch.linalg.LinAlgError) as error:
        failure = {"error": f"{type(error).__name__}: {error}"}
        write_atomically(run_dir / report.FAILED_FILE, json.dumps(failure) + "\n")
        outcome = "failed"
    shutil.rmtree(run_dir / CHECKPOINTS, ignore_errors=True)
    return outcome


def check_same_run(config: TrainConfig, run_dir: Path) -> None:
    """Refuse to reuse a run folder that holds a run of another config."""
    differences = config.differences(json.loads((run_dir / "config.json").read_text()))
    if differences:
        raise ValueError(
            f"{run_dir} holds another run ({'; '.join(differences)}); choose another -o folder"
        )


def _run_cell_alone(sweep: Sweep, cell: Cell, run_dir: Path, threads: int) -> str:
    """:func:`run_cell` in a pool process, with ``threads`` torch threads."""
    torch.set_num_threads(threads)
    return run_cell(sweep, cell, run_dir)


def run_sweep(
    sweep: Sweep,
    out: str | Path,
    jobs: int = 1,
    console: Console | None = None,
    progress: bool = True,
    figures: bool = True,
) -> list[report.SummaryRow]:
    """Run every unfinished cell of ``sweep`` into ``out/runs/`` (``jobs`` at a time, each in
    its own process with ``cpu_count / jobs`` threads), then write the report."""
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    out = Path(out)
    cells = plan(sweep)
    console = console or Console(quiet=True)
    todo = []
    for cell in cells:
        run_dir = out / RUNS / cell.name
        if report.is_finished(run_dir):
            check_same_run(cell_config(sweep, cell, run_dir), run_dir)
        else:
            todo.append(cell)
    console.print(
        f"{len(cells)} cells, {len(cells) - len(todo)} finished before, {len(todo)} to run"
    )
    started = time.perf_counter()

    def done(count: int, cell: Cell, outcome: str) -> None:
        loss = report.load_run(out / RUNS / cell.name).val_loss
        console.print(
            f"[{count}/{len(todo)}] {cell.name}: {outcome}, val loss {report.format_number(loss)}"
            f" ({time.perf_counter() - started:.0f} s into the sweep)"
        )

    if jobs == 1:
        for count, cell in enumerate(todo, start=1):
            done(count, cell, run_cell(sweep, cell, out / RUNS / cell.name, progress))
    else:
        threads = max(1, (os.cpu_count() or 1) // jobs)
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=context) as pool:
            futures = {
                pool.submit(_run_cell_alone, sweep, cell, out / RUNS / cell.name, threads): cell
                for cell in todo
            }
            try:
                for count, future in enumerate(as_completed(futures), start=1):
                    done(count, futures[future], future.result())
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
    return report.report_sweep(out, console=console, figures=figures)


# -- merge mode -------------------------------------------------------------------------------
MERGED = "merged"


def merge_label(method: str, scale: float) -> str:
    return f"{method}-{scale:g}"


def compare_merges(
    base: str | Path,
    finetuned: Sequence[str | Path],
    data: Sequence[str],
    methods: Sequence[str],
    scales: Sequence[float],
    out: str | Path,
    eval_tokens: int = 32768,
    seq_len: int | None = None,
    tokenizer: str | Path | None = None,
    seed: int = 0,
    force: bool = False,
    console: Console | None = None,
    figures: bool = True,
    device: str = "cpu",
) -> list[report.MergeRow]:
    """Merge ``finetuned`` (fine-tune t trained on domain ``data[t]``) with every method and
    scale into ``out/merged/<method>-<scale>/``, evaluate the base, the fine-tunes and every
    merge on every domain's held-out tokens (split in halves: ``select`` chooses each method's
    scale, ``test`` is reported), save ``out/evaluations.json`` and write the report.

    Existing merges are reused unless ``force``. ``seed`` is the data seed the fine-tunes were
    trained with (it decides the held-out documents); ``eval_tokens`` should not exceed their
    ``val_tokens``.
    """
    out = Path(out)
    console = console or Console(quiet=True)
    seq_len = seq_len or DEFAULT_EVAL_SEQ_LEN
    if len(finetuned) != len(data):
        raise ValueError(
            f"--finetuned has {len(finetuned)} models but --data {len(data)} domains; give each "
            "fine-tune's own domain, in the same order"
        )
    if len(finetuned) < 2:
        raise ValueError("--finetuned: merging needs at least two fine-tuned models")
    if len(set(data)) != len(data):
        raise ValueError(f"--data: each fine-tune needs its own domain, got {', '.join(data)}")
    for method in methods:
        get_method(method)
    if not scales or any(scale <= 0 for scale in scales):
        raise ValueError(f"--scales must be positive numbers, got {list(scales)}")
    if eval_tokens < 4 * seq_len:
        raise ValueError(f"--eval-tokens {eval_tokens} is too few for two halves of windows")

    models = {"base": (str(base), "base", None, None)}
    for path, domain in zip(finetuned, data, strict=True):
        models[f"finetune:{domain}"] = (str(path), "finetuned", None, None)
    for method in methods:
        for scale in scales:
            label = merge_label(method, scale)
            target = out / MERGED / label
            if force or not target.exists():
                console.print(f"merging {label}")
                merge_checkpoints(finetuned, base, method, target, scale=scale, force=force,
                                  progress=False)  # fmt: skip
            models[label] = (str(target), "merge", method, scale)

    folder = evaluate.tokenizer_folder(base, tokenizer)
    halves = {}
    for domain in data:
        ids = evaluate.held_out_tokens(domain, folder, eval_tokens, seed)
        middle = ids.numel() // 2
        halves[domain] = {"select": ids[:middle], "test": ids[middle:]}
    records = []
    for label, (path, kind, method, scale) in models.items():
        console.print(f"evaluating {label}")
        model = evaluate.load_model(path, device)
        losses = {
            domain: {
                split: evaluate.loss_on(model, ids, seq_len, device=device)
                for split, ids in splits.items()
            }
            for domain, splits in halves.items()
        }
        records.append({"label": label, "kind": kind, "method": method, "scale": scale,
                        "path": path, "losses": losses})  # fmt: skip
    document = {
        "base": str(base),
        "finetuned": [str(path) for path in finetuned],
        "domains": list(data),
        "seed": seed,
        "eval_tokens": eval_tokens,
        "seq_len": seq_len,
        "models": records,
    }
    write_atomically(out / report.EVALUATIONS, json.dumps(document, indent=2) + "\n")
    return report.report_merges([out], out, console=console, figures=figures)
