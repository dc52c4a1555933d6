"""The paper's claims, checked on a sweep folder: paired differences per R (see aggregators.md).

    python docs/results/aggregator_claims.py RESULTS [--rule t|sd]

RESULTS is a ``mloco compare`` folder (its ``runs/``) or a published folder holding only its
``results.csv``. ``--rule t`` (default) gives each difference its 95% t-interval and orders
aggregators only where intervals separate; ``--rule sd`` is the rule of the first, untuned
tables (a difference counts when larger than the sd of its per-seed differences).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from rich.console import Console
from rich.table import Table

from mergekit_loco.compare.runs import BASELINE, load_runs
from mergekit_loco.compare.stats import paired_difference
from mergekit_loco.compare.sweep_report import (
    SummaryRow,
    format_difference,
    orderings,
    summarize,
)

#: (claim, a, b), read on ``a - b`` per R. "beats": the claim holds where the interval lies
#: below 0, fails where it lies above 0, cannot be told where it holds 0. "vs": a two-sided
#: comparison, stated as the ordering the interval shows. Claim 3 ("stays close") is an
#: equivalence claim, fixed before the data: it holds where the whole interval lies within
#: +-0.05 nats (the protocol's flatness tolerance), fails where it excludes 0 by more, and
#: cannot be told otherwise; "n.s." alone is not evidence of closeness.
CLAIMS = [
    ("1. Iso-C beats averaging without momentum", "isoc-sgd", "diloco-sgd"),
    ("1. ... and momentum-DiLoCo without momentum", "isoc-sgd", "diloco"),
    ("2. IsoLoCo beats DiLoCo", "isoloco", "diloco"),
    ("3. NS stays close to exact Iso-C", "isoloco-ns", "isoloco"),
    ("4. TIES vs DiLoCo", "ties", "diloco"),
    ("4. TSV vs DiLoCo", "tsv", "diloco"),
    ("4. Iso-CTS vs DiLoCo", "iso-cts", "diloco"),
    ("4. Iso-CTS vs Iso-C (no momentum)", "iso-cts", "isoc-sgd"),
    ("DiLoCo vs data-parallel AdamW", "diloco", BASELINE),
    ("IsoLoCo vs data-parallel AdamW", "isoloco", BASELINE),
]


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
    for claim, a, b in CLAIMS:
        cells = []
        for steps, workers in settings:
            left, right = rows.get(key(a, workers, steps)), rows.get(key(b, workers, steps))
            cells.append("-" if left is None or right is None else
                         difference(left, right, rule, digits))  # fmt: skip
        table.append([claim, f"{a} - {b}", *cells])
    return settings, table


def main(results: str, rule: str = "t") -> None:
    summary = summarize(load_runs(results))
    rows = {(row.aggregator, row.workers, row.inner_steps): row for row in summary}
    settings, claims = claim_rows(rows, rule)
    title = "loss(a) - loss(b), paired by seed (negative: a is better)"
    table = Table(title=title + (", 95% t-interval" if rule == "t" else ""))
    table.add_column("claim")
    table.add_column("a - b")
    for steps, workers in settings:
        table.add_column(f"R={workers} H={steps}", justify="right")
    for row in claims:
        table.add_row(*row)
    Console(width=240).print(table)
    if rule == "t":
        print("\n".join(orderings(summary)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results")
    parser.add_argument("--rule", choices=("t", "sd"), default="t")
    arguments = parser.parse_args()
    main(arguments.results, arguments.rule)
