"""The paper's claims, checked on a sweep folder: paired differences per R (see aggregators.md).

python docs/results/aggregator_claims.py RESULTS
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from mergekit_loco.report import BASELINE, load_runs, paired_difference, summarize

#: (claim, a, b): the claim holds where a's loss is lower than b's (delta < 0), beyond the spread.
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


def main(results: str) -> None:
    rows = {
        (row.aggregator, row.workers, row.inner_steps): row for row in summarize(load_runs(results))
    }
    settings = sorted({(r.inner_steps, r.workers) for r in rows.values() if not r.is_baseline})
    table = Table(title="loss(a) - loss(b), paired by seed (negative: a is better)")
    table.add_column("claim")
    table.add_column("a - b")
    for steps, workers in settings:
        table.add_column(f"R={workers} H={steps}", justify="right")
    for claim, a, b in CLAIMS:
        cells = []
        for steps, workers in settings:
            left, right = rows.get(key(a, workers, steps)), rows.get(key(b, workers, steps))
            if left is None or right is None:
                cells.append("-")
                continue
            delta, significant = paired_difference(left.losses, right.losses)
            mark = {True: "", False: " n.s.", None: " ?"}[significant]
            cells.append(f"{delta:+.4f}{mark}")
        table.add_row(claim, f"{a} - {b}", *cells)
    Console(width=160).print(table)
    for steps, workers in settings:
        ranked = sorted(
            (r for r in rows.values() if (r.workers, r.inner_steps) == (workers, steps)),
            key=lambda r: r.loss.mean,
        )
        print(f"R={workers} H={steps}: " + " < ".join(r.aggregator for r in ranked))


if __name__ == "__main__":
    main(sys.argv[1])
