"""benchmarks/merge_bench.py measures each merge's own peak memory, not its parent's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux rusage semantics")
def test_peak_rss_is_the_commands_own_after_the_parent_touched_a_lot(monkeypatch):
    """A child forked straight from a process that touched 512 MiB reports >= 512 MiB on Linux;
    run_measured's wrapper reports what ``python -c pass`` itself used (tens of MB)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from merge_bench import run_measured

    touched = torch.ones(128 * 2**20)  # 512 MiB, resident
    seconds, peak, stdout = run_measured([sys.executable, "-c", "print('hi')"])
    assert stdout == "hi\n" and seconds > 0
    assert peak < 100 * 2**20 < touched.numel() * touched.element_size()
    with pytest.raises(RuntimeError, match="failed"):
        run_measured([sys.executable, "-c", "raise SystemExit(3)"])
