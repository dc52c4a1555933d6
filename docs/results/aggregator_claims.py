"""The paper's claims, checked on a sweep folder: paired differences per R (see aggregators.md).

    python docs/results/aggregator_claims.py RESULTS [--rule t|sd] [--markdown] [--seeds 0,1,2]

RESULTS is a ``mloco compare`` folder (its ``runs/``) or a published folder holding only its
``results.csv``. ``--rule t`` (default) gives each difference its 95% t-interval and orders
aggregators only where intervals separate; ``--rule sd`` is the rule of the first, untuned
tables (a difference counts when larger than the sd of its per-seed differences). With ``t``
a verdict table follows: per claim and R, holds / fails / cannot tell by the rules of
:data:`CLAIMS`, fixed before the tuned runs, and which differences survive Holm's correction
for the number of intervals.

A report holds each aggregator's one (tuned) outer setting per R: a folder with several is
refused rather than letting the reported seeds pick among them; ``--seeds`` refuses runs of
any other seed (the tuning seed must never enter a reported interval).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from mergekit_loco.compare.runs import BASELINE, load_runs
from mergekit_loco.compare.stats import PairedInterval, paired_difference, paired_interval
from mergekit_loco.compare.sweep_report import (
    SummaryRow,
    describe_setting,
    failed_seeds,
    format_difference,
    orderings,
    summarize,
)

#: (claim, a, b, kind), read on ``a - b`` per R, fixed before the tuned runs:
#: "beats" (a's loss is lower): holds where the interval lies below 0, fails where it lies
#: above 0, cannot be told where it holds 0. "close" (claim 3, an equivalence claim): holds
#: where the whole interval lies within +-CLOSE nats, fails where it lies wholly outside,
#: cannot be told otherwise ("n.s." alone is no evidence of closeness). "vs": two-sided, the
#: better of the two where the interval excludes 0.
CLAIMS = [
    ("1. Iso-C beats averaging without momentum", "isoc-sgd", "diloco-sgd", "beats"),
    ("1. ... and momentum-DiLoCo without momentum", "isoc-sgd", "diloco", "beats"),
    ("2. IsoLoCo beats DiLoCo", "isoloco", "diloco", "beats"),
    ("3. NS stays close to exact Iso-C", "isoloco-ns", "isoloco", "close"),
    ("4. TIES vs DiLoCo", "ties", "diloco", "vs"),
    ("4. TSV vs DiLoCo", "tsv", "diloco", "vs"),
    ("4. Iso-CTS vs DiLoCo", "iso-cts", "diloco", "vs"),
    ("4. Iso-CTS vs Iso-C (no momentum)", "iso-cts", "isoc-sgd", "vs"),
    ("DiLoCo vs data-parallel AdamW", "diloco", BASELINE, "vs"),
    ("IsoLoCo vs data-parallel AdamW", "isoloco", BASELINE, "vs"),
]
#: The equivalence margin of "close", in nats: the protocol's flatness tolerance.
CLOSE = 0.05


def key(aggregator: str, workers: int, steps: int) -> tuple[str, int, int]:
    """Summary rows are keyed by (aggregator, R, H); the baseline's by (dp, 1, 0)."""
    return (BASELINE, 1, 0) if aggregator == BASELINE else (aggregator, workers, steps)


def difference(left: SummaryRow, right: SummaryRow, rule: str, digits: int) -> str:
    """``left - right`` paired by seed, marked by ``rule`` (a failed run: the seeds it failed
    on, as in ``mloco report``)."""
    if rule == "t":
        return format_difference(left, right, digits)
    delta, significant = paired_difference(left.losses, right.losses)
    return f"{delta:+.{digits}f}" + {True: "", False: " n.s.", None: " ?"}[significant]


def claim_rows(
    rows: Mapping[tuple, SummaryRow], rule: str = "t", digits: int = 4
) -> tuple[list[tuple[int, int]], list[list[str]]]:
    """The (H, R) settings, and per claim ``[claim, "a - b", cell per setting]``."""
    settings = sorted({(r.inner_steps, r.workers) for r in rows.values() if not r.is_baseline})
    table = []
    for claim, a, b, _kind in CLAIMS:
        cells = []
        for steps, workers in settings:
            left, right = rows.get(key(a, workers, steps)), rows.get(key(b, workers, steps))
            cells.append("-" if left is None or right is None else
                         difference(left, right, rule, digits))  # fmt: skip
        table.append([claim, f"{a} - {b}", *cells])
    return settings, table


def verdict(interval: PairedInterval, kind: str, a: str, b: str) -> str:
    """The claim's reading of one interval of ``a - b`` (see :data:`CLAIMS`). Seeds that all
    differ by exactly the same amount give a zero-width interval: no evidence, but a sign that
    two cells are one run or share their seeds' randomness, so it is named, not read."""
    if interval.constant:
        return "cannot tell (every seed differs by the same amount: check the runs)"
    if interval.separated is None:
        return "cannot tell (no interval)"
    if kind == "close":
        if -CLOSE < interval.low and interval.high < CLOSE:
            return "holds"
        if interval.low >= CLOSE or interval.high <= -CLOSE:
            return "fails"
        return "cannot tell"
    if not interval.separated:
        return "cannot tell"
    better = a if interval.high < 0 else b
    if kind == "beats":
        return "holds" if better == a else "fails"
    return f"{better} better"


def p_value(interval: PairedInterval) -> float:
    """Two-sided paired t-test of ``mean(d) = 0``: ``2 P(T_{n-1} > |mean| / (sd / sqrt n))``
    (0 when every difference is the same nonzero number)."""
    from scipy.stats import t as student_t

    if interval.constant:
        return 0.0 if interval.mean != 0 else 1.0
    statistic = abs(interval.mean) / (interval.std / math.sqrt(interval.n))
    return float(2 * student_t.sf(statistic, interval.n - 1))


def holm(p_values: Mapping[Any, float], level: float = 0.05) -> set:
    """The keys whose hypotheses Holm's step-down rejects at family-wise ``level``: sorted
    ascending, the k-th smallest (k = 0..m-1) is rejected while ``p <= level / (m - k)``."""
    rejected = set()
    ordered = sorted(p_values.items(), key=lambda item: item[1])
    for k, (key_, p) in enumerate(ordered):
        if p > level / (len(ordered) - k):
            break
        rejected.add(key_)
    return rejected


def verdicts(rows: Mapping[tuple, SummaryRow]) -> list[dict]:
    """Per claim and (H, R): the verdict, the interval's n, and whether a difference (kinds
    "beats" and "vs") survives Holm's correction over every such interval of the table (40
    intervals at 95% would separate about 2 times by chance alone)."""
    settings = sorted({(r.inner_steps, r.workers) for r in rows.values() if not r.is_baseline})
    found = []
    for claim, a, b, kind in CLAIMS:
        for steps, workers in settings:
            left, right = rows.get(key(a, workers, steps)), rows.get(key(b, workers, steps))
            if left is None or right is None:
                continue
            if failed_seeds(left, right):
                shared = len(set(left.losses) & set(right.losses))
                found.append({"claim": claim, "R": workers, "H": steps, "n": shared,
                              "verdict": "cannot tell (a run failed)", "p": None})  # fmt: skip
                continue
            interval = paired_interval(left.losses, right.losses)
            tested = kind != "close" and interval.separated is not None
            found.append({"claim": claim, "R": workers, "H": steps, "n": interval.n,
                          "verdict": verdict(interval, kind, a, b),
                          "p": p_value(interval) if tested else None})  # fmt: skip
    survivors = holm({i: f["p"] for i, f in enumerate(found) if f["p"] is not None})
    for index, entry in enumerate(found):
        entry["holm"] = None if entry["p"] is None else index in survivors
    return found


def verdict_rows(
    rows: Mapping[tuple, SummaryRow], settings: list[tuple[int, int]]
) -> list[list[str]]:
    """Per claim ``[claim, cell per setting]``: ``holds (n=3, Holm)`` and the like."""
    found = verdicts(rows)
    table = []
    for claim, *_ in CLAIMS:
        by_setting = {(f["H"], f["R"]): f for f in found if f["claim"] == claim}
        cells = []
        for setting in settings:
            entry = by_setting.get(setting)
            if entry is None:
                cells.append("-")
                continue
            mark = ", Holm" if entry["holm"] else ""
            cells.append(f"{entry['verdict']} (n={entry['n']}{mark})")
        table.append([claim, *cells])
    return table


def loss_rows(summary: list[SummaryRow], settings: list[tuple[int, int]]) -> list[list[str]]:
    """Per aggregator ``[name, "mean ± sd (n)" per setting]`` at its chosen outer setting, by
    the mean over settings (best first); the baseline last, in the first column."""
    if not settings:  # only baseline cells finished so far
        return []
    by_name: dict[str, dict[tuple[int, int], SummaryRow]] = {}
    for row in summary:
        setting = settings[0] if row.is_baseline else (row.inner_steps, row.workers)
        by_name.setdefault(row.aggregator, {})[setting] = row

    def cell(row: SummaryRow | None) -> str:
        if row is None:
            return "-"
        failed = sorted(seed for seed, value in row.losses.items() if math.isinf(value))
        if failed:
            return f"failed (seeds {', '.join(map(str, failed))})"
        loss = row.loss
        spread = f" ± {loss.std:.3f}" if loss.n > 1 and math.isfinite(loss.std) else ""
        return f"{loss.mean:.3f}{spread} (n={loss.n})"

    def order(name: str) -> tuple[bool, float]:
        means = [r.loss.mean for r in by_name[name].values()]
        return (name == BASELINE, sum(means) / len(means))

    return [[name, *(cell(by_name[name].get(s)) for s in settings)]
            for name in sorted(by_name, key=order)]  # fmt: skip


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def report_problems(runs: list, summary: list[SummaryRow], seeds: list[int] | None) -> list[str]:
    """Why ``runs`` are not a report: a cell with several outer settings (the reported seeds
    would choose among them), runs of seeds other than ``seeds``."""
    problems = [
        f"{row.aggregator} at R={row.workers} H={row.inner_steps} has {len(row.sweep)} outer "
        f"settings ({'; '.join(describe_setting(setting) for setting, _ in row.sweep)})"
        for row in summary
        if len(row.sweep) > 1
    ]
    if seeds is not None:
        other = sorted({run.seed for run in runs} - set(seeds))
        if other:
            problems.append(f"runs of seed(s) {', '.join(map(str, other))}, not in --seeds")
    return problems


def main(results: str, rule: str = "t", markdown: bool = False, seeds: str | None = None) -> None:
    runs = load_runs(results)
    summary = summarize(runs)
    chosen = [int(seed) for seed in seeds.split(",")] if seeds else None
    problems = report_problems(runs, summary, chosen)
    if problems:
        sys.exit(f"error: {results} is not a report of one setting per aggregator and the "
                 f"reported seeds: {'; '.join(problems)}")  # fmt: skip
    rows = {(row.aggregator, row.workers, row.inner_steps): row for row in summary}
    settings, claims = claim_rows(rows, rule)
    columns = [f"R={workers} H={steps}" for steps, workers in settings]
    title = "loss(a) - loss(b), paired by seed (negative: a is better)"
    title += ", 95% t-interval" if rule == "t" else ""
    verdict_title = (
        f"Verdicts (close: within +-{CLOSE} nats; Holm: the difference survives Holm's "
        f"correction over the {sum(f['p'] is not None for f in verdicts(rows))} tested intervals)"
    )
    tables = [(title, ["claim", "a - b", *columns], claims)]
    if markdown:
        losses = "Final validation loss, mean ± sd over seeds (n seeds; dp: any R)"
        tables.insert(0, (losses, ["aggregator", *columns], loss_rows(summary, settings)))
    if rule == "t":
        tables.append((verdict_title, ["claim", *columns], verdict_rows(rows, settings)))
    if markdown:
        print("\n\n".join(f"{name}:\n\n{markdown_table(header, body)}"
                           for name, header, body in tables))  # fmt: skip
        return
    console = Console(width=240)
    for index, (name, header, body) in enumerate(tables):
        table = Table(title=name)
        for column in header:
            table.add_column(column, justify="left" if column in ("claim", "a - b") else "right")
        for row in body:
            table.add_row(*row)
        console.print(table)
        if index == 0 and rule == "t":
            print("\n".join(orderings(summary)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--rule", choices=("t", "sd"), default="t")
    parser.add_argument("--markdown", action="store_true", help="markdown tables (for docs)")
    parser.add_argument("--seeds", help="the reported seeds, e.g. 0,1,2 (others are refused)")
    arguments = parser.parse_args()
    main(arguments.results, arguments.rule, arguments.markdown, arguments.seeds)
