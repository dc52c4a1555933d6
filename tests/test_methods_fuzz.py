"""Property tests: every method on random small shapes, dtypes and task counts.

Each merge must succeed (or raise ValueError exactly in the documented degenerate cases), keep
shape and dtype, stay finite, and satisfy its method's invariant, checked in numpy float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_methods import is_degenerate

from mergekit_loco import get_method

CONFIGS = [
    ("mean", {}),
    ("ta", {}),
    ("ties", {}),
    ("ties", {"density": 0.7}),
    ("dare", {"density": 0.4, "seed": 3}),
    ("breadcrumbs", {"density": 0.6, "gamma": 0.1}),
    ("tsv", {}),
    ("tsv", {"rank_aware": True}),
    ("iso-c", {}),
    ("iso-c", {"spectral": "ns"}),
    ("iso-c", {"rank_aware": True}),
    ("iso-cts", {}),
    ("iso-cts", {"common_fraction": 0.0}),
    ("iso-cts", {"spectral": "ns"}),
    ("iso-cts", {"rank_aware": True}),
]
FUZZ = settings(max_examples=100, deadline=None, derandomize=True)


@st.composite
def merge_inputs(draw) -> list[torch.Tensor]:
    """T in 1..5 deltas of one random 1-D to 3-D shape: gaussian, small integers (ties and exact
    cancellations), sparse, or all-zero, at scales from 1e-3 to 1e3."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    tasks = draw(st.integers(1, 5))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    kind = draw(st.sampled_from(["normal", "integers", "sparse", "zeros"]))
    scale = 10.0 ** draw(st.integers(-3, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "normal":
        values = rng.standard_normal((tasks, *shape))
    elif kind == "integers":
        values = rng.integers(-2, 3, size=(tasks, *shape)).astype(np.float64)
    elif kind == "sparse":
        values = rng.standard_normal((tasks, *shape)) * (rng.random((tasks, *shape)) < 0.3)
    else:
        values = np.zeros((tasks, *shape))
    return [torch.from_numpy(scale * v).to(dtype) for v in values]


def trimmed(values: np.ndarray, density: float) -> np.ndarray:
    n = values.size
    k = n - int(n * density)
    if k == 0:
        return values
    return np.where(np.abs(values) >= np.sort(np.abs(values))[k - 1], values, 0.0)


def check_invariant(name, params, deltas: list[np.ndarray], merged: np.ndarray, rtol: float):
    stacked = np.stack(deltas)
    tasks = len(deltas)
    scale = max(float(np.abs(stacked).max()), 1e-30)
    atol = rtol * scale * tasks
    is_matrix = merged.ndim == 2
    if name == "mean" or (name in ("tsv", "iso-c", "iso-cts") and not is_matrix):
        np.testing.assert_allclose(merged, stacked.mean(axis=0), atol=atol, rtol=0)
        assert np.all(merged >= stacked.min(axis=0) - atol)
        assert np.all(merged <= stacked.max(axis=0) + atol)
    elif name == "ta":
        np.testing.assert_allclose(merged, stacked.sum(axis=0), atol=atol, rtol=0)
    elif name == "ties":
        kept = np.stack([trimmed(d.ravel(), params.get("density", 0.2)) for d in deltas])
        total = kept.sum(axis=0)
        elected = np.sign(total)
        elected[elected == 0] = np.sign(elected.sum())
        # compare signs only where the float sum is clearly non-zero in any precision
        clear = np.abs(total) > rtol * np.abs(kept).sum(axis=0) * 10
        out = merged.ravel()
        assert np.all((out[clear] == 0) | (np.sign(out[clear]) == elected[clear]))
        assert np.all(np.abs(out) <= np.abs(kept).max(axis=0) * (1 + rtol))
    elif name == "dare":
        bound = np.abs(stacked).sum(axis=0) / (tasks * params["density"])
        assert np.all(np.abs(merged) <= bound * (1 + rtol) + atol)
        assert np.all(merged[np.all(stacked == 0, axis=0)] == 0)
    elif name == "breadcrumbs":
        assert np.all(np.abs(merged) <= np.abs(stacked).mean(axis=0) * (1 + rtol) + atol)
        if tasks == 1:
            assert np.count_nonzero(merged) <= max(1, int(params["density"] * merged.size))
    elif name in ("tsv", "iso-cts") and params.get("rank_aware"):
        # partial isometries times kept singular values (each at most its matrix's norm)
        norms = [np.linalg.norm(x, ord=2) for x in (*deltas, stacked.sum(axis=0))]
        assert np.linalg.norm(merged, ord=2) <= max(norms) * (1 + rtol) + atol
    elif name == "tsv":
        rank = int(min(merged.shape) * (1 / tasks))
        kept_s = np.concatenate([np.linalg.svd(d, compute_uv=False)[:rank] for d in deltas])
        expected = np.zeros(min(merged.shape))
        expected[: kept_s.size] = np.sort(kept_s)[::-1]
        spectrum = np.linalg.svd(merged, compute_uv=False)
        np.testing.assert_allclose(spectrum, expected, atol=atol, rtol=0)
    elif name == "iso-c" and params.get("spectral") == "ns":
        summed = stacked.sum(axis=0)
        rms = np.linalg.norm(summed) / np.sqrt(min(summed.shape))
        assert np.linalg.norm(merged, ord=2) <= 1.3 * rms + atol
    elif name == "iso-c":
        summed_s = np.linalg.svd(stacked.sum(axis=0), compute_uv=False)
        spectrum = np.linalg.svd(merged, compute_uv=False)
        if params.get("rank_aware"):
            spectrum = spectrum[spectrum > 10 * atol]
            assert np.all(spectrum <= summed_s[0] + atol)
            np.testing.assert_allclose(spectrum, spectrum.max(initial=0), atol=atol, rtol=0)
        else:
            np.testing.assert_allclose(spectrum, summed_s.mean(), atol=atol, rtol=0)
    elif name == "iso-cts" and params.get("spectral") != "ns":
        spectrum = np.linalg.svd(merged, compute_uv=False)
        np.testing.assert_allclose(spectrum, spectrum[0], atol=atol, rtol=0)


@pytest.mark.parametrize("name, params", CONFIGS)
@FUZZ
@given(deltas=merge_inputs())
def test_method_on_random_inputs(name, params, deltas):
    method = get_method(name, **params)
    shape, dtype = deltas[0].shape, deltas[0].dtype
    if is_degenerate(name, params, shape, len(deltas)):
        with pytest.raises(ValueError, match="'fuzz.w'"):
            method.merge_tensor("fuzz.w", deltas)
        return
    merged = method.merge_tensor("fuzz.w", deltas)
    assert merged.shape == shape and merged.dtype == dtype
    assert torch.isfinite(merged).all()
    rtol = 1e-4 if dtype == torch.float32 else 1e-9
    check_invariant(
        name, params, [d.double().numpy() for d in deltas], merged.double().numpy(), rtol
    )
