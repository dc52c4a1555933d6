"""The report of an aggregator sweep: seed summaries per cell, tuned outer values, tables, files.

Everything is read from what the runs left on disk (:mod:`mergekit_loco.compare.runs`), so
``mloco report`` re-renders a sweep without training.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mergekit_loco import run_layout
from mergekit_loco.compare.runs import (
    BASELINE,
    RESULTS_CSV,
    RUN_COLUMNS,
    Run,
    load_runs,
    run_configs,
    setting_conflict,
)
from mergekit_loco.compare.stats import Spread, format_interval, ordering, paired_interval, spread
from mergekit_loco.compare.tables import csv_text, format_loss, format_number, json_value
from mergekit_loco.io.atomic import (
    check_free_or_ours,
    claim_folder,
    mark_output,
    marked_kind,
    write_atomically,
)
from mergekit_loco.io.files import shown

#: an outer setting: (outer lr, outer momentum); (None, None) for the baseline.
Setting = tuple[float | None, float | None]
TUNED_FILE = "tuned.json"


@dataclass(frozen=True)
class SummaryRow:
    """One (aggregator, R, H) cell over its seeds, at the outer setting with the lowest mean
    loss: ``losses`` maps seed -> final val loss there; ``sweep`` holds every setting tried."""

    aggregator: str
    workers: int
    inner_steps: int
    outer_lr: float | None
    outer_momentum: float | None
    losses: Mapping[int, float]
    sweep: tuple[tuple[Setting, Spread], ...]

    @property
    def loss(self) -> Spread:
        return spread(list(self.losses.values()))

    @property
    def is_baseline(self) -> bool:
        return self.aggregator == BASELINE

    @property
    def grid_edges(self) -> tuple[str, ...]:
        """Where the chosen value is the lowest or highest tried: the grid should be extended
        that way (see :func:`grid_edges`)."""
        return grid_edges(
            [setting for setting, _ in self.sweep], (self.outer_lr, self.outer_momentum)
        )


def grid_edges(settings: Iterable[Setting], chosen: Setting) -> tuple[str, ...]:
    """``("outer lr: highest tried", ...)`` for each coordinate of ``chosen`` that is the
    lowest or highest of two or more values tried (the other coordinate held at its chosen
    value), or the only one tried there where the grid holds others (``"outer lr: the only
    one tried at this momentum"``: an uneven grid left the optimum unbracketed)."""
    edges = []
    settings = list(settings)
    names = ("outer lr", "outer momentum")
    for index, name in enumerate(names):
        values = sorted(
            {
                s[index]
                for s in settings
                if s[1 - index] == chosen[1 - index] and s[index] is not None
            }
        )
        if chosen[index] is None:
            continue
        if len(values) < 2:
            if len({s[index] for s in settings if s[index] is not None}) > 1:
                other = names[1 - index].removeprefix("outer ")
                edges.append(f"{name}: the only one tried at this {other}")
            continue
        if chosen[index] == values[0]:
            edges.append(f"{name}: lowest tried")
        elif chosen[index] == values[-1]:
            edges.append(f"{name}: highest tried")
    return tuple(edges)


def summarize(runs: Iterable[Run]) -> list[SummaryRow]:
    """Group finished runs by (aggregator, R, H, outer lr, momentum) and keep per (aggregator,
    R, H) the setting with the lowest mean over seeds, among the settings with the most finished
    seeds (a setting missing a seed of an unfinished sweep cannot win on fewer runs). The
    baseline is one row (R = 1, H = 0)."""
    cells: dict[tuple, dict[Setting, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for run in runs:
        if run.val_loss is None:
            continue
        key = (
            (BASELINE, 1, 0)
            if run.aggregator == BASELINE
            else (run.aggregator, run.workers, run.inner_steps)
        )
        cells[key][(run.outer_lr, run.outer_momentum)][run.seed] = run.val_loss
    rows = []
    for (aggregator, workers, inner_steps), by_setting in cells.items():
        spreads = {s: spread(list(losses.values())) for s, losses in by_setting.items()}
        complete = sorted(most_seeds(spreads), key=_sort_key)
        best = min(complete, key=lambda s: spreads[s].mean)
        sweep = tuple(sorted(spreads.items(), key=lambda item: _sort_key(item[0])))
        rows.append(SummaryRow(aggregator, workers, inner_steps, *best, by_setting[best], sweep))
    return sorted(rows, key=lambda r: (not r.is_baseline, r.inner_steps, r.workers, r.loss.mean))


def _sort_key(setting: Setting) -> tuple[float, float]:
    return tuple(-1.0 if value is None else value for value in setting)  # type: ignore[return-value]


def tuned_settings(summary: Sequence[SummaryRow]) -> list[dict]:
    """Per (aggregator, H) swept at one or more R: the setting with the lowest mean over those
    R of the seed-mean loss, among the settings finished at every R with the most seeds there
    (as :func:`summarize` chooses per R), with the R used, the grid edges it sits on, the edges
    of each R's own best (a value at an edge means: extend the grid and tune again), and the
    settings left out because some R lacks them or some of their seeds (``incomplete``).
    An R that finished one setting where another R swept several takes part (the settings it
    lacks are incomplete; before, that R was left out unsaid); ties go to the lowest setting.
    Where no setting has the most seeds at every R (a sweep half run on a new seed), nothing
    can be chosen yet: the entry says so (``outer_lr``, ``outer_momentum`` and ``mean_loss``
    None, every setting tried ``incomplete``) rather than leaving the aggregator out."""
    groups: dict[tuple[str, int], list[SummaryRow]] = defaultdict(list)
    for row in summary:
        if not row.is_baseline:
            groups[(row.aggregator, row.inner_steps)].append(row)
    tuned = []
    for (aggregator, steps), rows in sorted(groups.items()):
        if all(len(row.sweep) == 1 for row in rows):
            continue  # one setting at every R: nothing was tuned (a report's sweep)
        by_setting = [dict(row.sweep) for row in rows]
        tried = set.union(*(set(settings) for settings in by_setting))
        shared = set.intersection(*(most_seeds(settings) for settings in by_setting))
        score = {s: sum(settings[s].mean for settings in by_setting) / len(rows) for s in shared}
        best = min(sorted(shared, key=_sort_key), key=score.__getitem__) if shared else None
        tuned.append(
            {
                "aggregator": aggregator,
                "inner_steps": steps,
                "outer_lr": best and best[0],
                "outer_momentum": best and best[1],
                "workers": sorted(row.workers for row in rows),
                "mean_loss": score.get(best),
                "grid_edges": list(grid_edges(shared, best)) if best else [],
                "grid_edges_at_R": {str(r.workers): list(r.grid_edges) for r in rows},
                "best_at_R": {str(r.workers): [r.outer_lr, r.outer_momentum] for r in rows},
                "incomplete": [describe_setting(s) for s in sorted(tried - shared, key=_sort_key)],
            }
        )
    return tuned


def most_seeds(settings: Mapping[Setting, Spread]) -> set[Setting]:
    """The settings finished on the most seeds (the others cannot win on fewer runs)."""
    most = max(spread.n for spread in settings.values())
    return {setting for setting, spread in settings.items() if spread.n == most}


def describe_setting(setting: Setting) -> str:
    """``outer lr 0.35, momentum 0.9`` (None: the preset's value)."""
    lr, momentum = (("preset" if v is None else f"{v:g}") for v in setting)
    return f"outer lr {lr}, momentum {momentum}"


# -- tables -----------------------------------------------------------------------------------
def baseline_of(summary: Sequence[SummaryRow]) -> SummaryRow | None:
    return next((row for row in summary if row.is_baseline), None)


def best_in_group(summary: Sequence[SummaryRow], row: SummaryRow) -> SummaryRow:
    """The row with the lowest mean among the aggregators at ``row``'s R and H."""
    group = [
        r
        for r in summary
        if not r.is_baseline and (r.workers, r.inner_steps) == (row.workers, row.inner_steps)
    ]
    return min(group, key=lambda r: r.loss.mean)


def format_difference(row: SummaryRow, other: SummaryRow | None, digits: int = 4) -> str:
    """``row - other`` paired by seed with its t-interval (see :func:`stats.format_interval`),
    ``(n=2)`` after it where fewer seeds pair up than either cell ran, or ``failed (seeds 0,
    2)``: the seeds on which either cell failed (no difference is formed)."""
    if other is None or row is other:
        return ""
    failed = failed_seeds(row, other)
    if failed:
        return f"failed (seeds {', '.join(map(str, failed))})"
    interval = paired_interval(row.losses, other.losses)
    text = format_interval(interval, digits)
    if 0 < interval.n < max(len(row.losses), len(other.losses)):
        text += f" (n={interval.n})"
    return text


def failed_seeds(row: SummaryRow, other: SummaryRow) -> list[int]:
    """The seeds on which either cell failed, whether or not the other ran them: no paired
    difference is formed (dropping a failed seed would hide the failure)."""
    seeds = sorted(set(row.losses) | set(other.losses))
    return [
        s
        for s in seeds
        if math.isinf(row.losses.get(s, 0.0)) or math.isinf(other.losses.get(s, 0.0))
    ]


SIGNIFICANCE_NOTE = (
    "± is the std over seeds. Differences are paired by seed, with a 95% t-interval; n.s. = "
    "the interval holds 0 (cannot tell); ? = one seed; (n=2) = only 2 seeds pair up."
)


def summary_table(summary: Sequence[SummaryRow], title: str = "Final validation loss") -> Table:
    """The rich table: one row per (aggregator, R, H) at its best outer setting."""
    baseline = baseline_of(summary)
    table = Table(title=title, caption=SIGNIFICANCE_NOTE)
    for column in ("aggregator", "R", "H", "outer lr", "momentum", "val loss", "min-max", "seeds"):
        table.add_column(column, justify="left" if column == "aggregator" else "right")
    table.add_column("vs best at R", justify="right")
    table.add_column(f"vs {BASELINE}", justify="right")
    for row in summary:
        best = None if row.is_baseline else best_in_group(summary, row)
        loss = row.loss
        table.add_row(
            f"[bold]{row.aggregator}[/]" if row is best else row.aggregator,
            "-" if row.is_baseline else str(row.workers),
            "-" if row.is_baseline else str(row.inner_steps),
            format_number(row.outer_lr, 3),
            format_number(row.outer_momentum, 2),
            format_loss(loss),
            f"{format_number(loss.low)}-{format_number(loss.high)}" if loss.n > 1 else "",
            str(loss.n),
            "best" if row is best else format_difference(row, best),
            format_difference(row, baseline),
        )
    return table


def orderings(summary: Sequence[SummaryRow]) -> list[str]:
    """Per (R, H): the aggregators and the baseline by mean loss, ``<`` only where separated."""
    baseline = baseline_of(summary)
    lines = []
    for steps, workers in sorted(
        {(r.inner_steps, r.workers) for r in summary if not r.is_baseline}
    ):
        group = {
            r.aggregator: r.losses
            for r in summary
            if (r.workers, r.inner_steps) == (workers, steps) and not r.is_baseline
        }
        if baseline is not None:
            group[BASELINE] = baseline.losses
        lines.append(f"R={workers} H={steps}: {ordering(group)}")
    return lines


def sweep_table(summary: Sequence[SummaryRow]) -> Table | None:
    """Every outer setting tried, where some cell tried more than one; None otherwise."""
    swept = [row for row in summary if len(row.sweep) > 1]
    if not swept:
        return None
    table = Table(title="Outer-lr sweep (val loss over seeds; * = chosen; ! = at a grid edge)")
    for column in ("aggregator", "R", "H", "outer lr", "momentum", "val loss"):
        table.add_column(column, justify="left" if column == "aggregator" else "right")
    for row in swept:
        for (lr, momentum), loss in row.sweep:
            chosen = (lr, momentum) == (row.outer_lr, row.outer_momentum)
            mark = (" *" + (" !" if row.grid_edges else "")) if chosen else ""
            table.add_row(
                row.aggregator,
                str(row.workers),
                str(row.inner_steps),
                format_number(lr, 3),
                format_number(momentum, 2),
                format_loss(loss) + mark,
            )
    return table


# -- files ------------------------------------------------------------------------------------
SUMMARY_COLUMNS = (
    "aggregator",
    "workers",
    "inner_steps",
    "outer_lr",
    "outer_momentum",
    "val_loss_mean",
    "val_loss_std",
    "val_loss_low",
    "val_loss_high",
    "val_loss_n",
    "grid_edges",
)


def summary_records(summary: Sequence[SummaryRow]) -> list[dict]:
    records = []
    for row in summary:
        record = {
            "aggregator": row.aggregator,
            "workers": row.workers,
            "inner_steps": None if row.is_baseline else row.inner_steps,  # dp: no inner steps
            "outer_lr": row.outer_lr,
            "outer_momentum": row.outer_momentum,
            **{f"val_loss_{k}": json_value(v) for k, v in asdict(row.loss).items()},
            "grid_edges": "; ".join(row.grid_edges),
            "outer_sweep": [
                {
                    "outer_lr": lr,
                    "outer_momentum": momentum,
                    **{k: json_value(v) for k, v in asdict(s).items()},
                }
                for (lr, momentum), s in row.sweep
            ],
        }
        records.append(record)
    return records


def write_sweep_tables(runs: Sequence[Run], summary: Sequence[SummaryRow], out: Path) -> None:
    """``results.csv`` (one row per run), ``summary.csv`` and ``results.json`` (both), and
    ``tuned.json`` where outer values were swept (removed where none are any more: a tuned.json
    left from an earlier report would pass stale values on)."""
    write_atomically(out / RESULTS_CSV, csv_text([run.row() for run in runs], RUN_COLUMNS))
    records = summary_records(summary)
    write_atomically(out / "summary.csv", csv_text(records, SUMMARY_COLUMNS) if records else "")
    document = {
        "runs": [{k: json_value(v) for k, v in run.row().items()} for run in runs],
        "summary": records,
    }
    write_atomically(out / "results.json", json.dumps(document, indent=2) + "\n")
    tuned = tuned_settings(summary)
    if tuned:
        entries = [{key: json_value(value) for key, value in entry.items()} for entry in tuned]
        write_atomically(out / TUNED_FILE, json.dumps(entries, indent=2) + "\n")
    else:
        (out / TUNED_FILE).unlink(missing_ok=True)


def tuned_table(tuned: Sequence[dict]) -> Table:
    table = Table(title="Tuned outer values (lowest mean loss over R; ! = at a grid edge)")
    for column in ("aggregator", "H", "outer lr", "momentum", "over R", "mean loss"):
        table.add_column(column, justify="left" if column == "aggregator" else "right")
    for entry in tuned:
        edge = " ! " + "; ".join(entry["grid_edges"]) if entry["grid_edges"] else ""
        table.add_row(
            entry["aggregator"],
            str(entry["inner_steps"]),
            format_number(entry["outer_lr"], 3),
            format_number(entry["outer_momentum"], 2),
            ",".join(map(str, entry["workers"])),
            format_number(entry["mean_loss"]) + edge,
        )
    return table


def report_sweep(
    results_dir: str | Path,
    console: Console | None = None,
    figures: bool = True,
    out: str | Path | None = None,
) -> list[SummaryRow]:
    """Re-render a sweep from ``results_dir/runs``: tables (results.csv, summary.csv,
    results.json, tuned.json), the terminal tables, and loss_vs_workers.png + curves.png, into
    ``out`` (default ``results_dir``): the sweep folder itself (ours, or holding nothing but
    ``runs/``; then marked as a sweep's), or a new or empty folder, or one such a report wrote
    (:func:`~mergekit_loco.io.atomic.check_free_or_ours`), never another command's output."""
    results = Path(results_dir)
    out = Path(out) if out is not None else results
    if (results / run_layout.CONFIG).is_file() and not (results / run_layout.SWEEP_RUNS).is_dir():
        raise ValueError(
            f"{shown(results)} is a training run (it holds {run_layout.CONFIG}), not a compare "
            "folder: mloco report takes a folder written by mloco compare -o (mloco eval "
            f"{shown(results / run_layout.FINAL)} scores the run's model)"
        )
    if not (results / run_layout.SWEEP_RUNS).is_dir():  # a published results.csv has no curves
        raise FileNotFoundError(f"{results / run_layout.SWEEP_RUNS}: no runs to re-render")
    conflict = setting_conflict(run_configs(results / run_layout.SWEEP_RUNS))
    if conflict is not None:  # e.g. a run copied in, or runs of another budget
        raise ValueError(
            f"{shown(results)}: its runs are not one comparison, they differ in "
            f"{conflict.values()}; a report pairs runs of one protocol: move the differing runs "
            "into a compare folder of their own"
        )
    into_sweep = out.resolve() == results.resolve()
    reads = (run_layout.SWEEP_RUNS,) if into_sweep else ()
    kind = run_layout.SWEEP_KIND if into_sweep else run_layout.SWEEP_REPORT_KIND
    kinds = (kind,)
    if not into_sweep and not (out / run_layout.SWEEP_RUNS).exists():
        kinds += (run_layout.SWEEP_KIND,)  # a report written before reports had their own kind
    check_free_or_ours(out, "the report folder", kinds, reads=reads, has_force=False)
    if marked_kind(out) not in (None, kind):
        mark_output(out, kind)
    runs = load_runs(results)
    if not runs:
        raise FileNotFoundError(f"{results}: no runs yet")
    summary = summarize(runs)
    claim_folder(out, kind, reads=reads)
    write_sweep_tables(runs, summary, out)
    if figures and summary:
        from mergekit_loco.compare import figures as plots

        plots.plot_loss_vs_workers(summary, out / "loss_vs_workers.png")
        plots.plot_curves(runs, summary, out / "curves.png")
    if console is not None:
        pending = [run.name for run in runs if run.status == "unfinished"]
        if summary:
            console.print(summary_table(summary))
            for line in orderings(summary):
                console.print(line, highlight=False)
        lr_table = sweep_table(summary)
        if lr_table is not None:
            console.print(lr_table)
            console.print(
                "The outer values above were chosen on the same runs the tables report, which "
                "flatters each chosen setting a little: report on seeds the tuning did not use "
                "(docs/compare.md).",
                highlight=False,
            )
        tuned = tuned_settings(summary)
        if tuned:
            console.print(tuned_table(tuned))
        for entry in tuned:
            if entry["mean_loss"] is None:
                console.print(
                    f"{entry['aggregator']} H={entry['inner_steps']}: not tuned yet, no setting "
                    "is finished at every R on the same seeds",
                    highlight=False,
                )
            elif entry["incomplete"]:
                console.print(
                    f"{entry['aggregator']} H={entry['inner_steps']}: tuned without "
                    f"{'; '.join(entry['incomplete'])} (not finished at every R on every seed)",
                    highlight=False,
                )
        edges = [
            f"{r.aggregator} R={r.workers} H={r.inner_steps} ({'; '.join(r.grid_edges)})"
            for r in summary
            if r.grid_edges
        ]
        if edges:
            console.print(f"best value at a grid edge, extend the grid: {', '.join(edges)}")
        if pending:
            console.print(f"{len(pending)} unfinished run(s): {', '.join(pending)}")
    return summary
