"""Tables and figures from saved runs: per-run rows, seed means and spreads, PNG figures.

Everything here reads what the runs left on disk (``runs/<cell>/config.json`` and
``metrics.jsonl``; ``evaluations.json`` of a merge comparison), so ``mloco report`` re-renders a
sweep without training. matplotlib is optional (the ``plot`` extra) and imported only to draw.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from mergekit_loco.io.atomic import write_atomically

#: the preset of the data-parallel AdamW baseline every sweep is compared with.
BASELINE = "dp"
RUN_COLUMNS = (
    "name",
    "aggregator",
    "workers",
    "inner_steps",
    "seed",
    "outer_lr",
    "tokens",
    "global_batch",
    "seq_len",
    "model",
    "val_loss",
    "status",
)


# -- statistics -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spread:
    """``n`` values: mean, sample standard deviation (ddof 1; nan for n = 1), min and max."""

    mean: float
    std: float
    low: float
    high: float
    n: int


def spread(values: Sequence[float]) -> Spread:
    """``mean = sum(x) / n``; ``std = sqrt(sum((x - mean)^2) / (n - 1))``."""
    if not values:
        raise ValueError("spread of no values")
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2 or not all(math.isfinite(v) for v in values):
        std = math.nan
    else:
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return Spread(mean=mean, std=std, low=min(values), high=max(values), n=n)


def paired_difference(a: Mapping[int, float], b: Mapping[int, float]) -> tuple[float, bool | None]:
    """``(delta, significant)`` of two cells' losses by seed: ``d_s = a[s] - b[s]`` over the seeds
    both ran (same seed: same init, data order and validation documents), ``delta = mean(d)``;
    significant when ``|delta| > std(d)`` (ddof 1): a difference larger than its own
    seed-to-seed spread. ``significant`` is None (cannot tell) with fewer than two shared seeds
    or a failed run."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return math.nan, None
    differences = [a[seed] - b[seed] for seed in seeds]
    delta = spread(differences)
    if len(seeds) < 2 or not all(math.isfinite(d) for d in differences):
        return delta.mean, None
    return delta.mean, abs(delta.mean) > delta.std


# -- runs on disk -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """One training run as saved: its config and its final validation loss (None: unfinished;
    inf: failed), with the validation and training loss curves against tokens seen."""

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
    val_curve: tuple[tuple[int, float], ...] = field(default=(), repr=False)
    train_curve: tuple[tuple[int, float], ...] = field(default=(), repr=False)

    def row(self) -> dict:
        return {column: getattr(self, column) for column in RUN_COLUMNS}


#: written into a run folder whose run could not finish (see compare.run_cell), with the error.
FAILED_FILE = "failed.json"


def read_metrics(run_dir: Path) -> list[dict]:
    """The events of ``run_dir/metrics.jsonl`` (a torn last line of a killed run is dropped)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def is_finished(run_dir: Path) -> bool:
    """A run is finished when its metrics end with the final event, or when it failed."""
    if (run_dir / FAILED_FILE).exists():
        return True
    events = read_metrics(run_dir)
    return bool(events) and events[-1].get("event") == "final"


def load_run(run_dir: Path) -> Run:
    """Read one run folder (``config.json`` + ``metrics.jsonl``)."""
    config_path = run_dir / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path}: not a training run (no config.json)")
    config = json.loads(config_path.read_text())
    events = read_metrics(run_dir)
    tokens_per_round = config["inner_steps"] * config["global_batch"] * config["seq_len"]
    val_curve, train_curve = [], []
    for event in events:
        kind, tokens = event.get("event"), event.get("round", 0) * tokens_per_round
        if kind == "round" and event.get("train_loss") is not None:
            train_curve.append((tokens, float(event["train_loss"])))
        elif kind in ("eval", "final") and event.get("val_loss") is not None:
            val_curve.append((tokens, float(event["val_loss"])))
    final = events[-1] if events and events[-1].get("event") == "final" else None
    if (run_dir / FAILED_FILE).exists():
        status, val_loss = "failed", math.inf
    elif final is not None:
        status, val_loss = "finished", float(final["val_loss"])
    else:
        status, val_loss = "unfinished", None
    tokens = (final or {}).get("tokens", config.get("tokens"))
    return Run(
        name=run_dir.name,
        aggregator=config.get("preset") or config.get("aggregator"),
        workers=int(config.get("workers", 1)),
        inner_steps=int(config.get("inner_steps", 0)),
        seed=int(config.get("seed", 0)),
        outer_lr=None if config.get("mode") == "dp" else config.get("outer_lr"),
        tokens=None if tokens is None else int(tokens),
        global_batch=config.get("global_batch"),
        seq_len=config.get("seq_len"),
        model=config.get("model"),
        val_loss=val_loss,
        status=status,
        val_curve=tuple(val_curve),
        train_curve=tuple(train_curve),
    )


def load_runs(results_dir: str | Path) -> list[Run]:
    """Every run under ``results_dir/runs/``, sorted by name."""
    runs_dir = Path(results_dir) / "runs"
    if not runs_dir.is_dir():
        raise FileNotFoundError(f"{runs_dir}: no runs (is {results_dir} a compare output folder?)")
    return [load_run(d) for d in sorted(runs_dir.iterdir()) if (d / "config.json").exists()]


# -- summary ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SummaryRow:
    """One (aggregator, R, H) cell over its seeds, at the outer lr with the lowest mean loss:
    ``losses`` maps seed -> final val loss there; ``sweep`` holds every outer lr tried."""

    aggregator: str
    workers: int
    inner_steps: int
    outer_lr: float | None
    losses: Mapping[int, float]
    sweep: tuple[tuple[float | None, Spread], ...]

    @property
    def loss(self) -> Spread:
        return spread(list(self.losses.values()))

    @property
    def is_baseline(self) -> bool:
        return self.aggregator == BASELINE


def summarize(runs: Iterable[Run]) -> list[SummaryRow]:
    """Group finished runs by (aggregator, R, H, outer lr), keep per (aggregator, R, H) the outer
    lr with the lowest mean over seeds. The baseline is one row (R = 1, H = 0)."""
    cells: dict[tuple, dict[float | None, dict[int, float]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    for run in runs:
        if run.val_loss is None:
            continue
        key = (BASELINE, 1, 0) if run.aggregator == BASELINE else (
            run.aggregator, run.workers, run.inner_steps
        )  # fmt: skip
        cells[key][run.outer_lr][run.seed] = run.val_loss
    rows = []
    for (aggregator, workers, inner_steps), by_lr in cells.items():
        spreads = {lr: spread(list(losses.values())) for lr, losses in by_lr.items()}
        best_lr = min(spreads, key=lambda lr: spreads[lr].mean)
        sweep = tuple(
            sorted(spreads.items(), key=lambda item: -1.0 if item[0] is None else item[0])
        )
        rows.append(SummaryRow(aggregator, workers, inner_steps, best_lr, by_lr[best_lr], sweep))
    return sorted(rows, key=lambda r: (not r.is_baseline, r.inner_steps, r.workers, r.loss.mean))


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


# -- formatting -------------------------------------------------------------------------------
def format_number(value: float | None, digits: int = 4) -> str:
    if value is None or math.isnan(value):
        return "-"
    if math.isinf(value):
        return "failed"
    return f"{value:.{digits}f}"


def format_loss(loss: Spread) -> str:
    """``mean ± std`` (one seed: the value)."""
    if not math.isfinite(loss.mean) or loss.n < 2:
        return format_number(loss.mean)
    return f"{loss.mean:.4f} ± {loss.std:.4f}"


def format_difference(row: SummaryRow, other: SummaryRow | None) -> str:
    """``+0.0123`` (significant), ``+0.0012 n.s.`` (within the spread), ``+0.0012 ?`` (one
    seed: cannot tell); see :func:`paired_difference`."""
    if other is None or row is other:
        return ""
    if not (math.isfinite(row.loss.mean) and math.isfinite(other.loss.mean)):
        return "failed"
    delta, significant = paired_difference(row.losses, other.losses)
    if math.isnan(delta):
        return "-"
    return f"{delta:+.4f}" + {True: "", False: " n.s.", None: " ?"}[significant]


SIGNIFICANCE_NOTE = (
    "± is the std over seeds. Differences are paired by seed; n.s. = smaller than the std of "
    "the per-seed differences; ? = one seed, cannot tell."
)


def summary_table(summary: Sequence[SummaryRow], title: str = "Final validation loss") -> Table:
    """The rich table: one row per (aggregator, R, H) at its best outer lr."""
    baseline = baseline_of(summary)
    table = Table(title=title, caption=SIGNIFICANCE_NOTE)
    for column in ("aggregator", "R", "H", "outer lr", "val loss", "min-max", "seeds"):
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
            format_loss(loss),
            f"{format_number(loss.low)}-{format_number(loss.high)}" if loss.n > 1 else "",
            str(loss.n),
            "best" if row is best else format_difference(row, best),
            format_difference(row, baseline),
        )
    return table


def sweep_table(summary: Sequence[SummaryRow]) -> Table | None:
    """Every outer lr tried, where some cell tried more than one; None otherwise."""
    swept = [row for row in summary if len(row.sweep) > 1]
    if not swept:
        return None
    table = Table(title="Outer-lr sweep (val loss over seeds; * = chosen)")
    for column in ("aggregator", "R", "H", "outer lr", "val loss"):
        table.add_column(column, justify="left" if column == "aggregator" else "right")
    for row in swept:
        for lr, loss in row.sweep:
            mark = " *" if lr == row.outer_lr else ""
            table.add_row(
                row.aggregator,
                str(row.workers),
                str(row.inner_steps),
                format_number(lr, 3),
                format_loss(loss) + mark,
            )
    return table


# -- files ------------------------------------------------------------------------------------
def csv_text(rows: Sequence[dict], columns: Sequence[str]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(
        buffer, fieldnames=list(columns), lineterminator="\n", extrasaction="ignore"
    )
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def json_value(value):
    """JSON has no inf/nan: write them as the strings "inf" / null."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def summary_records(summary: Sequence[SummaryRow]) -> list[dict]:
    records = []
    for row in summary:
        record = {
            "aggregator": row.aggregator,
            "workers": row.workers,
            "inner_steps": row.inner_steps,
            "outer_lr": row.outer_lr,
            **{f"val_loss_{k}": json_value(v) for k, v in asdict(row.loss).items()},
            "outer_lr_sweep": [
                {"outer_lr": lr, **{k: json_value(v) for k, v in asdict(s).items()}}
                for lr, s in row.sweep
            ],
        }
        records.append(record)
    return records


SUMMARY_COLUMNS = (
    "aggregator",
    "workers",
    "inner_steps",
    "outer_lr",
    "val_loss_mean",
    "val_loss_std",
    "val_loss_low",
    "val_loss_high",
    "val_loss_n",
)


def write_sweep_tables(runs: Sequence[Run], summary: Sequence[SummaryRow], out: Path) -> None:
    """``results.csv`` (one row per run), ``summary.csv`` and ``results.json`` (both)."""
    write_atomically(out / "results.csv", csv_text([run.row() for run in runs], RUN_COLUMNS))
    records = summary_records(summary)
    write_atomically(out / "summary.csv", csv_text(records, SUMMARY_COLUMNS) if records else "")
    document = {
        "runs": [{k: json_value(v) for k, v in run.row().items()} for run in runs],
        "summary": records,
    }
    write_atomically(out / "results.json", json.dumps(document, indent=2) + "\n")


# -- figures ----------------------------------------------------------------------------------
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

    chosen = {(row.aggregator, row.workers, row.inner_steps): row.outer_lr for row in summary}

    def cell_runs(row: SummaryRow) -> list[Run]:
        return [
            run
            for run in runs
            if run.aggregator == row.aggregator
            and run.outer_lr == chosen[(row.aggregator, row.workers, row.inner_steps)]
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


# -- whole reports ------------------------------------------------------------------------------
def report_sweep(
    results_dir: str | Path, console: Console | None = None, figures: bool = True
) -> list[SummaryRow]:
    """Re-render a sweep from ``results_dir/runs``: tables (results.csv, summary.csv,
    results.json), the terminal tables, and loss_vs_workers.png + curves.png."""
    out = Path(results_dir)
    runs = load_runs(out)
    if not runs:
        raise FileNotFoundError(f"{out / 'runs'}: no runs yet")
    summary = summarize(runs)
    write_sweep_tables(runs, summary, out)
    if figures and summary:
        plot_loss_vs_workers(summary, out / "loss_vs_workers.png")
        plot_curves(runs, summary, out / "curves.png")
    if console is not None:
        pending = [run.name for run in runs if run.status == "unfinished"]
        if summary:
            console.print(summary_table(summary))
        lr_table = sweep_table(summary)
        if lr_table is not None:
            console.print(lr_table)
        if pending:
            console.print(f"{len(pending)} unfinished run(s): {', '.join(pending)}")
    return summary


# -- merge comparisons --------------------------------------------------------------------------
EVALUATIONS = "evaluations.json"
MERGE_SPLITS = ("select", "test")


@dataclass(frozen=True)
class MergeRow:
    """One model on the test halves, over one or more fine-tune sets: per-domain loss, mean loss
    over domains, normalized score ``mean_d(L_ft_d(d) / L(d))`` (1 = each fine-tune's own loss on
    its domain) and gain kept ``sum_d (L_base(d) - L(d)) / sum_d (L_base(d) - L_ft_d(d))`` (0 =
    the base, 1 = the fine-tunes). Merges at the scale with the best normalized score on the
    select halves (``scales``: the one chosen per fine-tune set)."""

    label: str
    kind: str
    scales: tuple[float, ...]
    domain_loss: Mapping[str, Spread]
    loss: Spread
    normalized_by_set: Mapping[str, float]
    gain_kept: Spread

    @property
    def normalized(self) -> Spread:
        return spread(list(self.normalized_by_set.values()))


#: the reference merge of the report's "vs mean" column: plain averaging (DiLoCo's aggregator).
REFERENCE_MERGE = "mean"


def merge_scores(document: Mapping, losses: Mapping[str, Mapping[str, float]], split: str) -> dict:
    """One model's scores on ``split`` from its ``losses[domain][split]``: per domain the loss,
    the normalized score ``L_ft_d(d) / L(d)`` and the gain ``L_base(d) - L(d)``; averaged, the
    mean loss and normalized score, and the gain kept ``sum_d gain(d) / sum_d (L_base(d) -
    L_ft_d(d))`` (a ratio of sums, so that a domain the fine-tune barely improved does not
    dominate)."""
    base = next(m for m in document["models"] if m["kind"] == "base")["losses"]
    scores: dict = {"loss": {}, "normalized": {}, "gain": {}}
    fine_tuning_gain = 0.0
    for domain in document["domains"]:
        own = next(m for m in document["models"] if m["label"] == f"finetune:{domain}")["losses"]
        loss, tuned, start = losses[domain][split], own[domain][split], base[domain][split]
        scores["loss"][domain] = loss
        scores["normalized"][domain] = tuned / loss
        scores["gain"][domain] = start - loss
        fine_tuning_gain += start - tuned
    for key in ("loss", "normalized"):
        scores[f"mean_{key}"] = math.fsum(scores[key].values()) / len(scores[key])
    kept = math.fsum(scores["gain"].values())
    scores["gain_kept"] = kept / fine_tuning_gain if fine_tuning_gain > 0 else math.nan
    return scores


def merge_records(document: Mapping) -> list[dict]:
    """Every model and split of one comparison with its scores (rows of merge_results.csv)."""
    rows = []
    for model in document["models"]:
        for split in MERGE_SPLITS:
            scores = merge_scores(document, model["losses"], split)
            row = {key: model[key] for key in ("label", "kind", "method", "scale")}
            row["split"] = split
            for domain in document["domains"]:
                row[f"loss_{domain}"] = scores["loss"][domain]
                row[f"normalized_{domain}"] = scores["normalized"][domain]
            row |= {"loss": scores["mean_loss"], "normalized": scores["mean_normalized"],
                    "gain_kept": scores["gain_kept"]}  # fmt: skip
            rows.append(row)
    return rows


def chosen_rows(records: Sequence[dict]) -> list[dict]:
    """Test rows of the base, the fine-tunes, and each method at its best select-half scale."""
    test = [r for r in records if r["split"] == "test"]
    chosen = [r for r in test if r["kind"] != "merge"]
    for method in dict.fromkeys(r["method"] for r in records if r["kind"] == "merge"):
        select = [r for r in records if r["method"] == method and r["split"] == "select"]
        scale = max(select, key=lambda r: r["normalized"])["scale"]
        chosen.append(next(r for r in test if r["method"] == method and r["scale"] == scale))
    return chosen


def summarize_merges(documents: Mapping[str, Mapping]) -> list[MergeRow]:
    """One row per model (merges: per method) over the fine-tune sets ``documents`` (by name)."""
    domains = next(iter(documents.values()))["domains"]
    if any(document["domains"] != domains for document in documents.values()):
        raise ValueError("merge comparisons over different domains cannot be combined")
    grouped: dict[str, dict[str, dict]] = defaultdict(dict)
    for name, document in documents.items():
        for row in chosen_rows(merge_records(document)):
            grouped[row["method"] or row["label"]][name] = row
    summary = []
    for label, by_set in grouped.items():
        rows = list(by_set.values())
        summary.append(
            MergeRow(
                label=label,
                kind=rows[0]["kind"],
                scales=tuple(row["scale"] for row in rows if row["scale"] is not None),
                domain_loss={d: spread([row[f"loss_{d}"] for row in rows]) for d in domains},
                loss=spread([row["loss"] for row in rows]),
                normalized_by_set={name: row["normalized"] for name, row in by_set.items()},
                gain_kept=spread([row["gain_kept"] for row in rows]),
            )
        )
    order = {"base": 0, "finetuned": 1, "merge": 2}
    return sorted(summary, key=lambda r: (order[r.kind], -r.normalized.mean))


def normalized_difference(row: MergeRow, reference: MergeRow | None) -> str:
    """``row - reference`` in normalized score, paired by fine-tune set (see
    :func:`paired_difference`); empty for the reference itself or the non-merges."""
    if reference is None or row is reference or row.kind != "merge":
        return ""
    delta, significant = paired_difference(row.normalized_by_set, reference.normalized_by_set)
    return f"{delta:+.4f}" + {True: "", False: " n.s.", None: " ?"}[significant]


def merge_table(summary: Sequence[MergeRow], domains: Sequence[str], sets: int) -> Table:
    title = "Merged models on the held-out test halves"
    if sets > 1:
        title += f" (mean ± std over {sets} fine-tune sets)"
    table = Table(title=title)
    table.add_column("model")
    table.add_column("scale", justify="right")
    for domain in domains:
        table.add_column(f"loss {domain}", justify="right")
    for column in ("mean loss", "normalized", f"vs {REFERENCE_MERGE}", "gain kept"):
        table.add_column(column, justify="right")
    reference = next((row for row in summary if row.label == REFERENCE_MERGE), None)
    for row in summary:
        table.add_row(
            row.label,
            "/".join(f"{scale:g}" for scale in row.scales) or "-",
            *(format_loss(row.domain_loss[domain]) for domain in domains),
            format_loss(row.loss),
            format_loss(row.normalized),
            normalized_difference(row, reference),
            format_loss(row.gain_kept),
        )
    table.caption = (
        "normalized = mean over domains of (fine-tune's loss on its domain / model's loss); "
        "gain kept = sum of (base - model) / sum of (base - fine-tune) over domains; "
        "1 = as good as the fine-tunes. Scale chosen per method on the select halves. "
        f"vs {REFERENCE_MERGE}: normalized difference paired by fine-tune set; n.s. = within the "
        "std of the per-set differences; ? = one set."
    )
    return table


def merge_summary_records(summary: Sequence[MergeRow]) -> list[dict]:
    records = []
    for row in summary:
        record = {"model": row.label, "kind": row.kind, "scales": "/".join(map(str, row.scales))}
        for domain, loss in row.domain_loss.items():
            record[f"loss_{domain}"] = json_value(loss.mean)
        for key in ("loss", "normalized", "gain_kept"):
            value = getattr(row, key)
            record[f"{key}_mean"] = json_value(value.mean)
            record[f"{key}_std"] = json_value(value.std)
        records.append(record)
    return records


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


def report_merges(
    folders: Sequence[str | Path],
    out: str | Path,
    console: Console | None = None,
    figures: bool = True,
) -> list[MergeRow]:
    """Tables (merge_results.csv: every model, scale and split; merge_summary.csv and
    merge_results.json: the chosen rows) and merging.png from the ``evaluations.json`` of one or
    more merge comparisons (fine-tune sets, e.g. seeds), written to ``out``."""
    documents = {}
    for folder in folders:
        path = Path(folder) / EVALUATIONS
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: not a merge comparison (run mloco compare --mode merge)"
            )
        if Path(folder).name in documents:
            raise ValueError(f"merge folders need distinct names: {Path(folder).name} twice")
        documents[Path(folder).name] = json.loads(path.read_text())
    out = Path(out)
    summary = summarize_merges(documents)
    domains = next(iter(documents.values()))["domains"]
    records = [
        {"set": name, **row}
        for name, document in documents.items()
        for row in merge_records(document)
    ]
    columns = ["set", "label", "kind", "method", "scale", "split"]
    columns += [f"loss_{d}" for d in domains] + [f"normalized_{d}" for d in domains]
    columns += ["loss", "normalized", "gain_kept"]
    write_atomically(out / "merge_results.csv", csv_text(records, columns))
    summary_rows = merge_summary_records(summary)
    write_atomically(out / "merge_summary.csv", csv_text(summary_rows, list(summary_rows[0])))
    document = {
        "sets": list(documents),
        "domains": domains,
        "summary": summary_rows,
        "models": [{key: json_value(value) for key, value in r.items()} for r in records],
    }
    write_atomically(out / "merge_results.json", json.dumps(document, indent=2) + "\n")
    if figures:
        plot_merges(documents, summary, out / "merging.png")
    if console is not None:
        console.print(merge_table(summary, domains, len(documents)))
    return summary


def render(
    folders: Sequence[str | Path],
    out: str | Path | None = None,
    console: Console | None = None,
    figures: bool = True,
) -> None:
    """Re-render what ``mloco compare`` left in ``folders``: one sweep, or one or more merge
    comparisons (combined as fine-tune sets; then ``out`` is required)."""
    folders = [Path(folder) for folder in folders]
    if all((folder / EVALUATIONS).is_file() for folder in folders):
        if out is None and len(folders) > 1:
            raise ValueError("combining several merge comparisons needs --output")
        report_merges(folders, out or folders[0], console=console, figures=figures)
    elif len(folders) == 1:
        report_sweep(folders[0], console=console, figures=figures)
    else:
        raise ValueError("several folders combine merge comparisons only (with evaluations.json)")
