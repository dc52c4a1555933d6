"""The report figures (PNG): loss against R and loss curves of a sweep, merge scores.

matplotlib is optional (the ``plot`` extra) and imported only to draw.
"""

from __future__ import annotations

import io
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

from mergekit_loco.compare.merge_report import MergeRow, merge_records
from mergekit_loco.compare.runs import BASELINE, Run
from mergekit_loco.compare.sweep_report import SummaryRow, baseline_of
from mergekit_loco.io.atomic import write_atomically


def pyplot():
    """matplotlib.pyplot on the Agg backend, or a clear message if the extra is missing."""
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            "figures need matplotlib: pip install 'mergekit_loco[plot]' (or --no-figures)"
        ) from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path: Path) -> None:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    write_atomically(path, buffer.getvalue())


def aggregator_colors(plt, summary: Sequence[SummaryRow]) -> dict[str, str]:
    """One colour per aggregator (alphabetical, so every figure agrees); the baseline black."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = sorted({row.aggregator for row in summary if not row.is_baseline})
    return {name: cycle[index % len(cycle)] for index, name in enumerate(names)} | {
        BASELINE: "black"
    }


def plot_loss_vs_workers(summary: Sequence[SummaryRow], path: Path) -> None:
    """Final validation loss against R per aggregator (error bars: std over seeds), one panel per
    H, with the data-parallel baseline as a horizontal line (band: its min-max over seeds)."""
    plt = pyplot()
    rows = [row for row in summary if not row.is_baseline and math.isfinite(row.loss.mean)]
    inner_steps = sorted({row.inner_steps for row in rows}) or [0]
    figure, axes = plt.subplots(
        1, len(inner_steps), figsize=(6 * len(inner_steps), 4.5), squeeze=False
    )
    baseline = baseline_of(summary)
    colors = aggregator_colors(plt, summary)
    for axis, steps in zip(axes[0], inner_steps, strict=True):
        aggregators = sorted({row.aggregator for row in rows if row.inner_steps == steps})
        for aggregator in aggregators:
            points = sorted(
                (r for r in rows if r.aggregator == aggregator and r.inner_steps == steps),
                key=lambda r: r.workers,
            )
            errors = [0.0 if math.isnan(r.loss.std) else r.loss.std for r in points]
            axis.errorbar(
                [r.workers for r in points],
                [r.loss.mean for r in points],
                yerr=errors,
                marker="o",
                capsize=3,
                color=colors[aggregator],
                label=aggregator,
            )
        if baseline is not None and math.isfinite(baseline.loss.mean):
            axis.axhline(baseline.loss.mean, color="black", linestyle="--", label="dp (AdamW)")
            if baseline.loss.n > 1:
                axis.axhspan(baseline.loss.low, baseline.loss.high, color="black", alpha=0.08)
        axis.set_xscale("log", base=2)
        ticks = sorted({row.workers for row in rows if row.inner_steps == steps})
        axis.set_xticks(ticks, [str(tick) for tick in ticks])
        axis.minorticks_off()
        axis.set_xlabel("workers R")
        axis.set_ylabel("final validation loss")
        axis.set_title(f"H = {steps} inner steps")
        axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    save_figure(figure, path)
    plt.close(figure)


def _mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, float]]:
    """Average curves over seeds at the token counts they all share."""
    shared = set.intersection(*(set(dict(curve)) for curve in curves)) if curves else set()
    return [(t, math.fsum(dict(c)[t] for c in curves) / len(curves)) for t in sorted(shared)]


def plot_curves(runs: Sequence[Run], summary: Sequence[SummaryRow], path: Path) -> None:
    """Validation (solid) and training (faint) loss against tokens, seed means at each cell's
    chosen outer lr; one panel per (R, H), the baseline drawn in every panel."""
    plt = pyplot()
    from matplotlib.ticker import EngFormatter

    chosen = {
        (row.aggregator, row.workers, row.inner_steps): (row.outer_lr, row.outer_momentum)
        for row in summary
    }

    def cell_runs(row: SummaryRow) -> list[Run]:
        return [
            run
            for run in runs
            if run.aggregator == row.aggregator
            and (run.outer_lr, run.outer_momentum)
            == chosen[(row.aggregator, row.workers, row.inner_steps)]
            and (
                row.is_baseline or (run.workers, run.inner_steps) == (row.workers, row.inner_steps)
            )
        ]

    panels = sorted({(r.inner_steps, r.workers) for r in summary if not r.is_baseline})
    baseline = baseline_of(summary)
    columns = min(len(panels), 4) or 1
    lines = -(-max(len(panels), 1) // columns)
    figure, axes = plt.subplots(
        lines, columns, figsize=(4.5 * columns, 3.5 * lines), squeeze=False, sharey=True
    )
    for axis in axes.flat[len(panels) :]:
        axis.set_visible(False)
    colors = aggregator_colors(plt, summary)
    for axis, (steps, workers) in zip(axes.flat, panels, strict=False):
        rows = [r for r in summary if (r.workers, r.inner_steps) == (workers, steps)]
        if baseline is not None:
            rows.append(baseline)
        for row in sorted(rows, key=lambda r: r.aggregator):
            group = cell_runs(row)
            color = colors[row.aggregator]
            val = _mean_curve([run.val_curve for run in group if run.val_curve])
            train = _mean_curve([run.train_curve for run in group if run.train_curve])
            if train:
                axis.plot(*zip(*train, strict=True), color=color, alpha=0.25, linewidth=0.8)
            if val:
                axis.plot(*zip(*val, strict=True), color=color, marker=".", label=row.aggregator)
        axis.set_title(f"R = {workers}, H = {steps}")
        axis.set_xlabel("tokens")
        axis.xaxis.set_major_formatter(EngFormatter())
        axis.grid(alpha=0.3)
    for axis in axes[:, 0]:
        axis.set_ylabel("loss (solid: val, faint: train)")
    axes.flat[min(len(panels), columns) - 1].legend(
        fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1)
    )
    save_figure(figure, path)
    plt.close(figure)


def plot_merges(documents: Mapping[str, Mapping], summary: Sequence[MergeRow], path: Path) -> None:
    """Left: normalized score per method at its chosen scale (bars: mean over fine-tune sets,
    dots: each set; dashed: the base; dotted: 1 = the fine-tunes). Right: select-half
    normalized score against scale per method (mean over sets)."""
    plt = pyplot()
    figure, (bars, curves) = plt.subplots(1, 2, figsize=(12, 4.5))
    merges = [row for row in summary if row.kind == "merge"]
    labels = [r.label for r in merges]
    bars.bar(labels, [r.normalized.mean for r in merges], color="tab:blue", alpha=0.8)
    for label, row in zip(labels, merges, strict=True):
        values = list(row.normalized_by_set.values())
        bars.plot([label] * len(values), values, "o", color="black", markersize=3)
    base = next((row for row in summary if row.kind == "base"), None)
    if base is not None:
        bars.axhline(base.normalized.mean, color="black", linestyle="--", label="base")
    bars.axhline(1.0, color="gray", linestyle=":", label="fine-tunes")
    low = min([r.normalized.low for r in merges] + [base.normalized.low if base else 1.0])
    bars.set_ylim(low - 0.02, 1.01)
    bars.set_ylabel("normalized score (test halves)")
    bars.set_title("Merge methods at their chosen scale")
    bars.tick_params(axis="x", rotation=30)
    bars.legend(fontsize=8)
    records = [r for document in documents.values() for r in merge_records(document)]
    for method in dict.fromkeys(r["method"] for r in records if r["kind"] == "merge"):
        by_scale: dict[float, list[float]] = defaultdict(list)
        for r in records:
            if r["method"] == method and r["split"] == "select":
                by_scale[r["scale"]].append(r["normalized"])
        scales = sorted(by_scale)
        curves.plot(scales, [math.fsum(by_scale[s]) / len(by_scale[s]) for s in scales],
                    marker="o", label=method)  # fmt: skip
    curves.set_xlabel("scale")
    curves.set_ylabel("normalized score (select halves)")
    curves.set_title("Scale selection")
    curves.grid(alpha=0.3)
    curves.legend(fontsize=8)
    save_figure(figure, path)
    plt.close(figure)
