"""benchmarks/inner_optimizer_bench.py at toy size: its table, and foreach's bits equal the
per-tensor loop's (what keeps a switch to it from changing a run's numbers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "benchmarks" / "inner_optimizer_bench.py"


def test_the_benchmark_prints_each_variant_with_its_bits():
    done = subprocess.run(
        [sys.executable, BENCH, "--model", "micro", "--steps", "2", "--seq-len", "16"],
        capture_output=True, text=True, cwd=BENCH.parent, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {line.rsplit(maxsplit=3)[0]: line.split()[-1] for line in done.stdout.splitlines()[3:]}
    assert rows == {"per-tensor (torch's CPU default)": "yes", "foreach": "yes", "fused": "no"}
