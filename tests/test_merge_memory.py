"""The streaming bound, measured: a merge holds about (T + 2) x the largest tensor, prefetching
included, on a checkpoint whose largest tensors dominate everything else."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

LARGEST = 6_000_000  # float32 entries: 24 MB, against a Python + torch floor of ~250 MB
CHILD = """
import json, sys
from mergekit_loco.merge import merge_checkpoints, peak_rss_bytes
spec = json.loads(sys.argv[1])
floor = peak_rss_bytes()
merge_checkpoints(spec["models"], spec["base"], spec["method"], spec["out"], progress=False)
print(json.dumps({"floor": floor, "peak": peak_rss_bytes()}))
"""


def write_family(root, models: int) -> tuple[str, list[str]]:
    """Two adjacent largest tensors (so a careless prefetch would hold both) and small ones."""
    generator = torch.Generator().manual_seed(0)
    shapes = {"a.big": (LARGEST,), "b.big": (2000, LARGEST // 2000), "c.small": (300, 300)}
    base = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    paths = []
    for index in range(models + 1):
        state = {
            n: t + 0.01 * index * torch.randn(t.shape, generator=generator) for n, t in base.items()
        }
        paths.append(str(root / f"m{index}.safetensors"))
        save_file(state, paths[-1])
    return paths[0], paths[1:]


@pytest.mark.parametrize("method", ["mean", "ta"])
def test_peak_memory_stays_within_t_plus_2_largest_tensors(tmp_path, method):
    base, models = write_family(tmp_path, models=3)
    spec = {
        "models": models,
        "base": base,
        "method": method,
        "out": str(tmp_path / "out.safetensors"),
    }
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(spec)], capture_output=True, text=True, check=True
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    largest_bytes = LARGEST * 4
    held = (measured["peak"] - measured["floor"]) / largest_bytes
    # T + 2 = 5 copies of the largest tensor (base, 3 deltas, result); prefetching the other big
    # tensor during this one would add 4 more.
    assert held <= len(models) + 2 + 0.7, f"held {held:.2f} x the largest tensor"
