"""TIES's trim threshold (sampled bracket + exact selection) against a full sort in numpy, and
the sliced TIES merge against a vectorised float64 reference, on adversarial inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergekit_loco.methods import get_method
from mergekit_loco.methods import ties as ties_module
from mergekit_loco.methods.ties import kth_on_device, trim_threshold

#: Above ties.DIRECT_SELECTION_NUMEL, so the bracketed search runs.
LARGE = 150_000
DENSITIES = [0.2, 0.5, 0.9, 1e-5, 0.99999]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def adversarial_inputs() -> dict[str, torch.Tensor]:
    g = generator(0)
    normal = torch.randn(LARGE, generator=g)
    sparse = torch.zeros(LARGE)
    sparse[torch.randint(LARGE, (300,), generator=g)] = torch.randn(300, generator=g)
    spread = torch.randn(LARGE, generator=g) * 10 ** torch.randint(-30, 30, (LARGE,), generator=g)
    huge = torch.randn(LARGE, generator=g).sign() * torch.finfo(torch.float32).max
    huge[: LARGE // 2] = torch.randn(LARGE // 2, generator=g)
    denormal = (
        torch.randint(0, 5, (LARGE,), generator=g) * torch.finfo(torch.float32).smallest_normal / 8
    )
    return {
        "normal": normal,
        "integers (ties everywhere)": torch.randint(-3, 4, (LARGE,), generator=g).float(),
        "all zeros": torch.zeros(LARGE),
        "all equal, mixed signs": torch.where(normal > 0, 0.5, -0.5),
        "99.8% zeros": sparse,
        "magnitudes 1e-30..1e30": spread,
        "float32 max and normal": huge,
        "denormals and zeros": denormal,
        "sorted ascending": normal.abs().sort().values,
        "matrix": torch.randn(400, 500, generator=g),
        "bfloat16": torch.randn(LARGE, generator=g).bfloat16(),
        "float16": torch.randn(LARGE, generator=g).half(),
        "float64": torch.randn(LARGE, generator=g, dtype=torch.float64),
        "tiny 1": torch.tensor([-2.0]),
        "tiny 2 tied": torch.tensor([3.0, -3.0]),
        "tiny 3": torch.tensor([0.0, -1.0, 0.5]),
    }


def numpy_threshold(delta: torch.Tensor, density: float):
    """The rule by a full sort: k = n - int(n density), threshold = sorted(|x|)[k - 1]."""
    magnitudes = np.sort(np.abs(delta.double().numpy().ravel()))
    k = magnitudes.size - int(magnitudes.size * density)
    return None if k == 0 else magnitudes[k - 1]


@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("case", list(adversarial_inputs()))
def test_threshold_is_the_kth_magnitude_exactly(case, density):
    delta = adversarial_inputs()[case]
    expected = numpy_threshold(delta, density)
    threshold = trim_threshold(delta, density)
    if expected is None:
        assert threshold is None
        return
    assert threshold.dtype == delta.dtype and threshold.ndim == 0
    assert float(threshold) == expected  # widening to float64 is exact for every dtype here
    k = delta.numel() - int(delta.numel() * density)
    assert torch.equal(threshold, delta.abs().flatten().kthvalue(k).values)


@pytest.mark.parametrize("case", ["normal", "integers (ties everywhere)", "bfloat16", "float64"])
def test_device_path_gives_the_same_value(case):
    """The torch path (what runs on a GPU), exercised on CPU tensors."""
    delta = adversarial_inputs()[case]
    for density in DENSITIES[:4]:
        k = delta.numel() - int(delta.numel() * density)
        assert float(kth_on_device(delta, k)) == numpy_threshold(delta, density)


@pytest.mark.parametrize("bracket", [(0, 1), (16_000, 16_383), (-5, -1), (8_000, 8_000)])
def test_a_missed_bracket_falls_back_to_the_exact_value(bracket, monkeypatch):
    """Brackets far from the k-th value (as an unlucky sample would give) change nothing."""
    monkeypatch.setattr(ties_module, "bracket_ranks", lambda k, numel: bracket)
    delta = adversarial_inputs()["normal"]
    for density in (0.2, 0.9):
        expected = numpy_threshold(delta, density)
        assert float(trim_threshold(delta, density)) == expected
        k = delta.numel() - int(delta.numel() * density)
        assert float(kth_on_device(delta, k)) == expected


def reference_ties(deltas: list[np.ndarray], density: float) -> np.ndarray:
    """TIES in float64, vectorised: trim by the sorted threshold, elect, disjoint mean."""
    trimmed = []
    for delta in deltas:
        threshold = numpy_threshold(torch.from_numpy(delta), density)
        trimmed.append(
            delta if threshold is None else np.where(np.abs(delta) >= threshold, delta, 0)
        )
    stacked = np.stack(trimmed)
    elected = np.sign(stacked.sum(axis=0))
    elected[elected == 0] = np.sign(elected.sum())
    agrees = np.where(elected > 0, stacked > 0, stacked < 0)
    return np.where(agrees, stacked, 0).sum(axis=0) / np.maximum(agrees.sum(axis=0), 1)


@pytest.mark.parametrize("case", ["normal", "integers (ties everywhere)", "99.8% zeros", "matrix"])
@pytest.mark.parametrize("density", [0.2, 0.7, 1.0])
def test_sliced_ties_matches_the_float64_reference(case, density):
    base = adversarial_inputs()[case].double()
    g = generator(1)
    deltas = [
        base + torch.randn(base.shape, generator=g, dtype=torch.float64) * (t - 1) for t in range(3)
    ]
    merged = get_method("ties", density=density).merge_tensor("w", deltas)
    expected = reference_ties([d.numpy() for d in deltas], density)
    np.testing.assert_allclose(merged.numpy(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_threshold_and_ties_equal_cpu():
    g = generator(2)
    deltas = [torch.randn(300, 700, generator=g) for _ in range(3)]
    for density in (0.2, 0.9):
        cpu = trim_threshold(deltas[0], density)
        assert torch.equal(trim_threshold(deltas[0].cuda(), density).cpu(), cpu)
    method = get_method("ties", density=0.3)
    on_cpu = method.merge_tensor("w", deltas)
    on_cuda = method.merge_tensor("w", [d.cuda() for d in deltas]).cpu()
    torch.testing.assert_close(on_cuda, on_cpu, rtol=0, atol=0)
