"""`--device cuda` merges give the CPU's results (runs only where a CUDA device exists)."""

from __future__ import annotations

import pytest
import torch
from checkpoint_factory import load_state_dict, make_family

from mergekit_loco.merge import merge_checkpoints

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("method", "params"),
    [("ta", {}), ("ties", {"density": 0.3}), ("iso-c", {}), ("tsv", {}), ("dare", {"seed": 1})],
)
def test_cuda_merge_equals_cpu_merge(tmp_path, method, params):
    base, models = make_family(tmp_path / "family", count=3)
    results = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{device}.safetensors"
        merge_checkpoints(models, base, method, out, device=device, progress=False, **params)
        results[device] = load_state_dict(out)
    for name, on_cpu in results["cpu"].items():
        # elementwise methods agree exactly; SVD-based ones to float32 rounding
        torch.testing.assert_close(results["cuda"][name], on_cpu, rtol=1e-5, atol=1e-6)
