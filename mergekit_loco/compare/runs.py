"""Training runs as saved on disk: run folders of a sweep, or the ``results.csv`` of a report.

A sweep ``OUT`` holds one run folder per cell in ``OUT/runs/`` (names from
:mod:`mergekit_loco.run_layout`). A published results folder may hold only the ``results.csv``
that a report wrote from them (one row per run, no curves): :func:`load_runs` reads either.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergekit_loco import run_layout
from mergekit_loco.io.files import (
    MAX_JSON_BYTES,
    UnsafeInputError,
    parse_json,
    read_json,
    read_lines,
    shown,
)

#: the preset of the data-parallel AdamW baseline every sweep is compared with.
BASELINE = "dp"
#: written into a run folder whose run could not finish (see sweep.run_cell), with the error.
FAILED_FILE = "failed.json"
RESULTS_CSV = "results.csv"
RUN_COLUMNS = (
    "name", "aggregator", "workers", "inner_steps", "seed", "outer_lr", "outer_momentum",
    "tokens", "global_batch", "seq_len", "model", "val_loss", "status",
)  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One training run as saved: its config and its final validation loss (None: unfinished;
    inf: failed), with the validation and training loss curves against tokens seen.
    ``outer_lr`` and ``outer_momentum`` are None for the data-parallel baseline, else as a cell
    name prints them (:func:`setting_value`)."""

    name: str
    aggregator: str
    workers: int
    inner_steps: int
    seed: int
    outer_lr: float | None
    tokens: int | None
    global_batch: int | None
    seq_len: int | None
    model: str | None
    val_loss: float | None
    status: str
    outer_momentum: float | None = None
    val_curve: tuple[tuple[int, float], ...] = field(default=(), repr=False)
    train_curve: tuple[tuple[int, float], ...] = field(default=(), repr=False)

    def row(self) -> dict:
        """The ``results.csv`` row; ``inner_steps`` is empty (None) for the baseline, which has
        no inner steps (its config holds the preset's H, unused), as in ``summary.csv``."""
        row = {column: getattr(self, column) for column in RUN_COLUMNS}
        if self.aggregator == BASELINE:
            row["inner_steps"] = None
        return row


def read_run_config(run_dir: Path) -> dict[str, Any]:
    """The run's configuration as one flat dict of TrainConfig field names (the only reader of
    ``config.json`` here: a change of its layout is fixed in this one function)."""
    config = read_json(run_dir / run_layout.CONFIG, "run config")  # regular, strict, bounded
    if not isinstance(config, dict):
        raise ValueError(f"{shown(run_dir / run_layout.CONFIG)}: not a JSON object")
    return config


#: The settings every run of one compare folder shares, the comparison's fixed protocol: the
#: FLOP-matched budget and batch shape, the model, the data and its tokenizer, the validation set
#: and the inner optimizer's shape. A cell varies the preset (its aggregator and outer
#: optimizer), R, H, the seed, the outer lr and momentum, and its eval/checkpoint cadence.
FIXED_SETTINGS = (
    "model", "init", "data", "tokens", "chinchilla", "global_batch", "seq_len", "vocab_size",
    "tokenizer", "val_tokens", "val_seed", "inner_optimizer", "betas", "grad_clip",
    "warmup_fraction",
)  # fmt: skip
#: Fixed among the runs of one preset: presets set their own (dp its own inner lr and weight
#: decay), and ``compare --inner-lr/--weight-decay`` sets them for every preset.
PRESET_SETTINGS = ("inner_lr", "weight_decay")


@dataclass(frozen=True)
class SettingConflict:
    """Two runs of one folder that differ in a fixed setting: ``key``, and (run name, value)
    of the run seen first and of the other."""

    key: str
    first: tuple[str, Any]
    other: tuple[str, Any]

    def values(self) -> str:
        """``tokens 512 (dp-s0) vs 1024 (diloco-R4-H2-s0)``."""
        (name, value), (other_name, other_value) = self.first, self.other
        scope = " (per preset)" if self.key in PRESET_SETTINGS else ""
        return (
            f"{self.key}{scope} {json.dumps(value)} ({name}) vs {json.dumps(other_value)} "
            f"({other_name})"
        )


def setting_conflict(configs: Iterable[tuple[str, Mapping[str, Any]]]) -> SettingConflict | None:
    """The first fixed setting (:data:`FIXED_SETTINGS`, and :data:`PRESET_SETTINGS` among runs
    of one preset) in which ``configs`` ((run name, config dict), in order) differ; None if they
    are one comparison. A key a config lacks reads as None; floats equal to 1e-9 relative."""
    from mergekit_loco.train.config import same_value

    seen: dict[tuple, tuple[str, Any]] = {}
    for name, config in configs:
        preset = config.get("preset") or config.get("aggregator")
        keys = [(key, None) for key in FIXED_SETTINGS]
        keys += [(key, json.dumps(preset)) for key in PRESET_SETTINGS]
        for key, scope in keys:
            value = config.get(key)
            first = seen.setdefault((key, scope), (name, value))
            if not same_value(first[1], value):
                return SettingConflict(key, first, (name, value))
    return None


def run_configs(runs_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """(name, config) of every run folder under ``runs_dir`` (sorted by name)."""
    if not runs_dir.is_dir():
        return []
    folders = sorted(d for d in runs_dir.iterdir() if (d / run_layout.CONFIG).exists())
    return [(folder.name, read_run_config(folder)) for folder in folders]


def number_in(
    mapping: dict, key: str, where: str, minimum: float = -math.inf, strict: bool = False
) -> float:
    """``mapping[key]`` as a finite float of at least ``minimum`` (above it if ``strict``);
    anything else (missing, not a number, NaN or Infinity, an integer past a float's range, too
    small) is a ValueError naming ``where`` (the file and event) and the key."""
    value = mapping.get(key)
    number = math.nan
    if isinstance(value, int | float) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # a 400-digit integer
            number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{where}: {key!r} is {json.dumps(value)[:40]}, not a finite number")
    if number < minimum or (strict and number == minimum):
        bound = "above" if strict else "at least"
        raise ValueError(f"{where}: {key!r} is {number:g}, not {bound} {minimum:g}")
    return number


def loss_in(event: dict, key: str, where: str) -> float:
    """A cross-entropy of ``event`` (:func:`number_in`): finite and above 0."""
    return number_in(event, key, where, 0, strict=True)


#: the keys of an event a report reads, the only ones kept (a long run's file stays small in
#: memory); a line longer than MAX_EVENT_BYTES is no event.
EVENT_KEYS = ("event", "round", "tokens", "train_loss", "val_loss", "round_seconds")
MAX_EVENT_BYTES = 1 << 16


def whole_in(mapping: dict, key: str, where: str, default: int | None, minimum: int = 0) -> int:
    """``mapping[key]`` (``default`` if absent) as an integer of at least ``minimum``; anything
    else (a list, 1.9, true, "abc", -4 workers) is a ValueError naming ``where`` and the key."""
    value = mapping.get(key, default)
    if type(value) is not int or value < minimum:
        raise ValueError(
            f"{where}: {key!r} is {json.dumps(value)[:40]}, not an integer >= {minimum}"
        )
    return value


def read_metrics(run_dir: Path) -> list[dict]:
    """The events of the run's metrics file (at most 100 MB, streamed; a torn last line of a
    killed run is dropped), with the keys a report reads."""
    path = run_dir / run_layout.METRICS
    if not path.exists():
        return []
    events = []
    for line in read_lines(path, MAX_JSON_BYTES, "metrics file", MAX_EVENT_BYTES):
        try:
            event = parse_json(line, str(path)) if line is not None else None
        except UnsafeInputError:
            continue
        if isinstance(event, dict):
            events.append({key: event[key] for key in EVENT_KEYS if key in event})
    return events


def is_finished(run_dir: Path) -> bool:
    """A run is finished when its metrics end with the final event, or when it failed."""
    if (run_dir / FAILED_FILE).exists():
        return True
    events = read_metrics(run_dir)
    return bool(events) and events[-1].get("event") == "final"


def setting_value(value: float | None) -> float | None:
    """An outer value to the 6 significant digits a cell's name shows (``lr0.497``), so that
    runs whose names show one value are one setting: a grid's 0.71 x 0.7 (0.49699999999999994)
    and the 0.497 typed to extend that grid."""
    return None if value is None else float(f"{value:.6g}")


def load_run(run_dir: Path) -> Run:
    """Read one run folder (its config and metrics)."""
    if not (run_dir / run_layout.CONFIG).exists():
        raise FileNotFoundError(
            f"{run_dir / run_layout.CONFIG}: not a training run (no {run_layout.CONFIG})"
        )
    config = read_run_config(run_dir)
    events = read_metrics(run_dir)
    where = shown(run_dir / run_layout.CONFIG)
    tokens_per_round = math.prod(
        whole_in(config, key, where, None) for key in ("inner_steps", "global_batch", "seq_len")
    )
    metrics = shown(run_dir / run_layout.METRICS)
    val_curve, train_curve = [], []
    for event in events:
        kind = event.get("event")
        if kind not in ("round", "eval", "final"):
            continue
        tokens = whole_in(event, "round", f"{metrics}: a {kind} event", None) * tokens_per_round
        if kind == "round" and event.get("train_loss") is not None:
            train_curve.append((tokens, loss_in(event, "train_loss", f"{metrics}: round")))
        elif kind in ("eval", "final") and event.get("val_loss") is not None:
            val_curve.append((tokens, loss_in(event, "val_loss", f"{metrics}: {kind}")))
    final = events[-1] if events and events[-1].get("event") == "final" else None

    def outer_value(key: str) -> float | None:
        if config.get(key) is None:
            return None
        return setting_value(number_in(config, key, where, 0))

    if (run_dir / FAILED_FILE).exists():
        status, val_loss = "failed", math.inf
    elif final is not None:
        status, val_loss = "finished", loss_in(final, "val_loss", f"{metrics}: final event")
    else:
        status, val_loss = "unfinished", None
    if final is not None and "tokens" in final:
        tokens: int | None = whole_in(final, "tokens", f"{metrics}: final event", 0)
    else:
        tokens = None if config.get("tokens") is None else whole_in(config, "tokens", where, 0)
    outer = config.get("mode") != "dp"
    aggregator = config.get("preset") or config.get("aggregator")
    if not isinstance(aggregator, str):
        raise ValueError(f"{where}: 'preset' is {json.dumps(aggregator)[:40]}, not a name")
    return Run(
        name=run_dir.name,
        aggregator=aggregator,
        workers=whole_in(config, "workers", where, 1, minimum=1),
        inner_steps=whole_in(config, "inner_steps", where, 0),
        seed=whole_in(config, "seed", where, 0),
        outer_lr=outer_value("outer_lr") if outer else None,
        outer_momentum=outer_value("outer_momentum") if outer else None,
        tokens=tokens,
        global_batch=config.get("global_batch"),
        seq_len=config.get("seq_len"),
        model=config.get("model"),
        val_loss=val_loss,
        status=status,
        val_curve=tuple(val_curve),
        train_curve=tuple(train_curve),
    )


def load_runs(results_dir: str | Path) -> list[Run]:
    """Every run under ``results_dir/runs/`` sorted by name, or, where there is no such folder,
    the rows of ``results_dir/results.csv`` (without curves)."""
    results_dir = Path(results_dir)
    runs_dir = results_dir / run_layout.SWEEP_RUNS
    if runs_dir.is_dir():
        return [load_run(d) for d in sorted(runs_dir.iterdir()) if (d / run_layout.CONFIG).exists()]
    if (results_dir / RESULTS_CSV).is_file():
        return runs_from_table(results_dir / RESULTS_CSV)
    raise FileNotFoundError(f"{runs_dir}: no runs (is {results_dir} a compare output folder?)")


def runs_from_table(path: Path) -> list[Run]:
    """The runs of a ``results.csv`` written by a report (a missing column reads as empty)."""

    def number(text: str | None, kind: type) -> Any:
        return None if text in (None, "") else kind(text)

    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    return [
        Run(
            name=row["name"],
            aggregator=row["aggregator"],
            workers=int(row["workers"]),
            inner_steps=number(row["inner_steps"], int) or 0,  # empty for the baseline
            seed=int(row["seed"]),
            outer_lr=setting_value(number(row.get("outer_lr"), float)),
            outer_momentum=setting_value(number(row.get("outer_momentum"), float)),
            tokens=number(row.get("tokens"), int),
            global_batch=number(row.get("global_batch"), int),
            seq_len=number(row.get("seq_len"), int),
            model=row.get("model") or None,
            val_loss=number(row.get("val_loss"), float),
            status=row["status"],
        )
        for row in rows
    ]
