"""Merge methods against independent float64 reimplementations of the reference code.

Each ``reference_*`` function below follows the literal steps of the authors' code (explicit
loops, zero-filled d-column blocks for TSV-M and Iso-CTS) in numpy float64, so the library is
checked against a second, independent computation rather than against itself.
"""

from __future__ import annotations

import re
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from mergekit_loco import MergeMethod, TaskVector, get_method, list_methods
from mergekit_loco.methods.iso_cts import split_subspaces
from mergekit_loco.methods.tsv import tsv_rank

DOCS = Path(__file__).resolve().parents[1] / "docs" / "methods.md"
MATRIX_SHAPES = [(11, 7), (6, 10), (8, 8)]
TASK_COUNTS = [1, 2, 3, 5]
SPECTRAL = ["tsv", "iso-c", "iso-cts"]


def random_deltas(shape, tasks, seed=0, dtype=torch.float64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(tuple(shape), generator=generator, dtype=dtype) for _ in range(tasks)]


def as_numpy(deltas) -> list[np.ndarray]:
    return [delta.double().numpy() for delta in deltas]


def assert_matches(result: torch.Tensor, expected: np.ndarray, tolerance: float = 1e-10):
    """Entrywise agreement within ``tolerance`` times the largest expected magnitude (>= 1)."""
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(result.double().numpy(), expected, rtol=0, atol=tolerance * scale)


# -- independent float64 references ---------------------------------------------------------------
def reference_mean(deltas):
    return sum(deltas) / len(deltas)


def reference_sum(deltas):
    return sum(deltas)


def reference_trim(values: np.ndarray, density: float) -> np.ndarray:
    """ties-merging topk_values_mask: threshold = k-th smallest |x|, k = n - int(n * density)."""
    n = values.size
    k = n - int(n * density)
    if k == 0:
        return values.copy()
    threshold = np.sort(np.abs(values))[k - 1]
    return np.where(np.abs(values) >= threshold, values, 0.0)


def reference_ties(deltas, density=0.2):
    shape = deltas[0].shape
    trimmed = [reference_trim(delta.ravel(), density) for delta in deltas]
    elected = np.sign(sum(trimmed))
    majority = np.sign(elected.sum())
    elected[elected == 0] = majority
    merged = np.zeros(elected.size)
    for i in range(elected.size):
        if elected[i] > 0:
            kept = [t[i] for t in trimmed if t[i] > 0]
        else:
            kept = [t[i] for t in trimmed if t[i] < 0]
        merged[i] = sum(kept) / max(sum(1 for v in kept if v != 0), 1)
    return merged.reshape(shape)


def reference_band(values: np.ndarray, density: float, gamma: float) -> np.ndarray:
    """Breadcrumbs: sort by |x| (stable), drop n_bottom smallest and n_top largest."""
    n = values.size
    n_keep = min(n, max(1, int(density * n)))
    n_top = int(gamma * n)
    n_bottom = n - n_keep - n_top
    if n_bottom < 0:
        n_bottom, n_top = 0, n - n_keep
    order = sorted(range(n), key=lambda i: (abs(values[i]), i))
    kept = np.zeros(n)
    for i in order[n_bottom : n - n_top]:
        kept[i] = values[i]
    return kept


def reference_breadcrumbs(deltas, density=0.9, gamma=0.01):
    shape = deltas[0].shape
    return reference_mean([reference_band(d.ravel(), density, gamma) for d in deltas]).reshape(
        shape
    )


def reference_polar(matrix: np.ndarray) -> np.ndarray:
    left, _, right_h = np.linalg.svd(matrix, full_matrices=False)
    return left @ right_h


def reference_tsv(deltas):
    """TSVM_utils.compute_and_sum_svd_mem_reduction: zero-filled m x d / d / d x n blocks."""
    if deltas[0].ndim != 2:
        return reference_mean(deltas)
    m, n = deltas[0].shape
    d, tasks = min(m, n), len(deltas)
    rank = int(d * (1 / tasks))
    sum_u, sum_s, sum_v = np.zeros((m, d)), np.zeros(d), np.zeros((d, n))
    for i, delta in enumerate(deltas):
        u, s, v = np.linalg.svd(delta, full_matrices=False)
        sum_u[:, i * rank : (i + 1) * rank] = u[:, :rank]
        sum_s[i * rank : (i + 1) * rank] = s[:rank]
        sum_v[i * rank : (i + 1) * rank, :] = v[:rank, :]
    return reference_polar(sum_u) @ np.diag(sum_s) @ reference_polar(sum_v)


def reference_iso_c(deltas):
    if deltas[0].ndim != 2:
        return reference_mean(deltas)
    u, s, v = np.linalg.svd(sum(deltas), full_matrices=False)
    return u @ np.diag(np.full_like(s, s.mean())) @ v


def reference_newton_schulz(matrix: np.ndarray) -> np.ndarray:
    """Quintic Newton-Schulz, 5 steps, acting on the singular values of M / ||M||_F."""
    u, s, v = np.linalg.svd(matrix, full_matrices=False)
    x = s / (np.linalg.norm(matrix) + 1e-7)
    for _ in range(5):
        x = 3.4445 * x - 4.7750 * x**3 + 2.0315 * x**5
    return u @ np.diag(x) @ v


def reference_iso_c_ns(deltas):
    if deltas[0].ndim != 2:
        return reference_mean(deltas)
    summed = sum(deltas)
    rms = np.linalg.norm(summed) / np.sqrt(min(summed.shape))
    return rms * reference_newton_schulz(summed)


def reference_split(d: int, tasks: int, common_fraction: float) -> tuple[int, int]:
    common = int(d * common_fraction)
    task_specific_total = round((d - common) / tasks) * tasks
    common = d - task_specific_total
    return common, int((d - common) / tasks)


def reference_iso_cts(deltas, common_fraction=0.8):
    """iso-merging iso_cts: task blocks first, common block after, polar, mean of all d s."""
    if deltas[0].ndim != 2:
        return reference_mean(deltas)
    m, n = deltas[0].shape
    d, tasks = min(m, n), len(deltas)
    common, per_task = reference_split(d, tasks, common_fraction)
    u, s, v = np.linalg.svd(sum(deltas), full_matrices=False)
    common_u, common_s, common_v = u[:, :common], s[:common], v[:common, :]
    combined_u, combined_s, combined_v = np.zeros((m, d)), np.zeros(d), np.zeros((d, n))
    for i, delta in enumerate(deltas):
        residual = delta - common_u @ common_u.T @ delta
        u_ts, s_ts, v_ts = np.linalg.svd(residual, full_matrices=False)
        combined_u[:, i * per_task : (i + 1) * per_task] = u_ts[:, :per_task]
        combined_s[i * per_task : (i + 1) * per_task] = s_ts[:per_task]
        combined_v[i * per_task : (i + 1) * per_task, :] = v_ts[:per_task, :]
    start = tasks * per_task
    combined_u[:, start : start + common] = common_u
    combined_s[start : start + common] = common_s
    combined_v[start : start + common, :] = common_v
    isotropic_s = np.full(d, combined_s.mean())
    return reference_polar(combined_u) @ np.diag(isotropic_s) @ reference_polar(combined_v)


REFERENCES = {
    ("mean", ()): reference_mean,
    ("ta", ()): reference_sum,
    ("ties", ()): reference_ties,
    ("ties", (("density", 0.5),)): lambda ds: reference_ties(ds, 0.5),
    ("breadcrumbs", ()): reference_breadcrumbs,
    ("breadcrumbs", (("density", 0.5), ("gamma", 0.1))): lambda ds: reference_breadcrumbs(
        ds, 0.5, 0.1
    ),
    ("tsv", ()): reference_tsv,
    ("iso-c", ()): reference_iso_c,
    ("iso-c", (("spectral", "ns"),)): reference_iso_c_ns,
    ("iso-cts", ()): reference_iso_cts,
    ("iso-cts", (("common_fraction", 0.5),)): lambda ds: reference_iso_cts(ds, 0.5),
    ("iso-cts", (("common_fraction", 0.0),)): lambda ds: reference_iso_cts(ds, 0.0),
}
REFERENCE_IDS = [f"{name}{dict(params) or ''}" for name, params in REFERENCES]


def is_degenerate(name: str, params: dict, shape, tasks: int) -> bool:
    """The documented degenerate cases: TSV with no component per task, Iso-CTS with k < 0."""
    if len(shape) != 2:
        return False
    d = min(shape)
    if name == "tsv":
        return int(d * (1 / tasks)) == 0
    if name == "iso-cts":
        return reference_split(d, tasks, params.get("common_fraction", 0.8))[0] < 0
    return False


# -- every method against its reference -----------------------------------------------------------
@pytest.mark.parametrize("key", list(REFERENCES), ids=REFERENCE_IDS)
@pytest.mark.parametrize("tasks", TASK_COUNTS)
@pytest.mark.parametrize("shape", MATRIX_SHAPES, ids=["tall", "wide", "square"])
def test_matrix_merge_matches_reference(key, tasks, shape):
    name, params = key[0], dict(key[1])
    deltas = random_deltas(shape, tasks, seed=tasks * 10 + shape[0])
    if is_degenerate(name, params, shape, tasks):
        pytest.skip("degenerate case, covered by the ValueError tests")
    result = get_method(name, **params).merge_tensor("layer.weight", deltas)
    assert result.shape == shape and result.dtype == torch.float64
    tolerance = 1e-8 if params.get("spectral") == "ns" else 1e-10
    assert_matches(result, REFERENCES[key](as_numpy(deltas)), tolerance)


@pytest.mark.parametrize("key", list(REFERENCES), ids=REFERENCE_IDS)
@pytest.mark.parametrize("shape", [(17,), (4, 3, 2), ()], ids=["vector", "3d", "scalar"])
def test_non_matrix_merge_matches_reference(key, shape):
    name, params = key[0], dict(key[1])
    deltas = random_deltas(shape, 3, seed=len(shape))
    result = get_method(name, **params).merge_tensor("norm.weight", deltas)
    assert result.shape == shape
    assert_matches(result, REFERENCES[key](as_numpy(deltas)))


@pytest.mark.parametrize("key", list(REFERENCES), ids=REFERENCE_IDS)
def test_float32_merge_matches_float64_reference(key):
    name, params = key[0], dict(key[1])
    deltas = random_deltas((12, 9), 3, seed=5, dtype=torch.float32)
    result = get_method(name, **params).merge_tensor("layer.weight", deltas)
    assert result.dtype == torch.float32
    assert_matches(result, REFERENCES[key](as_numpy(deltas)), tolerance=2e-5)


RANK_AWARE = (("rank_aware", True),)


@pytest.mark.parametrize(
    "key",
    [*REFERENCES, ("iso-c", RANK_AWARE), ("iso-cts", RANK_AWARE)],
    ids=[*REFERENCE_IDS, "iso-c-rank-aware", "iso-cts-rank-aware"],
)
def test_float32_deltas_whose_squares_overflow_merge_as_in_float64(key):
    """Entries of 1e19: their squares (1e38) sum past float32's 3.4e38, the merge does not.
    Rank-aware methods on full-rank tasks give the plain method's result."""
    name, params = key[0], dict(key[1])
    deltas = [delta * 1e19 for delta in random_deltas((12, 9), 3, seed=6, dtype=torch.float32)]
    result = get_method(name, **params).merge_tensor("layer.weight", deltas)
    plain = (name, tuple(item for item in key[1] if item[0] != "rank_aware"))
    assert_matches(result, REFERENCES[plain](as_numpy(deltas)), tolerance=2e-5)


# -- hand-worked cases ---------------------------------------------------------------------------
def merge_lists(name: str, rows: list[list[float]], **params) -> list[float]:
    deltas = [torch.tensor(row, dtype=torch.float64) for row in rows]
    return get_method(name, **params).merge_tensor("v", deltas).tolist()


def test_ties_keeps_every_entry_tied_at_the_threshold():
    # k = 4 - int(4 * 0.5) = 2: threshold = 2nd smallest |x| = 2, so 4, -3 and 2 survive
    # (the reference keeps int(n * density) + 1 entries when magnitudes are distinct)
    assert merge_lists("ties", [[4.0, -3.0, 2.0, 1.0]], density=0.5) == [4.0, -3.0, 2.0, 0.0]
    # k = 4 - int(1.0) = 3: threshold = 1, and all three entries tied at 1 are kept
    assert merge_lists("ties", [[1.0, -1.0, 1.0, 3.0]], density=0.25) == [1.0, -1.0, 1.0, 3.0]


def test_ties_trim_elect_and_disjoint_mean_by_hand():
    rows = [
        [5.0, -1.0, 0.5, 3.0, -2.0],  # threshold 2 (3rd smallest): [5, 0, 0, 3, -2]
        [-4.0, 2.0, 2.0, -1.0, 0.1],  # threshold 2, two ties kept: [-4, 2, 2, 0, 0]
        [1.0, -3.0, 0.2, -0.3, -6.0],  # threshold 1: [1, -3, 0, 0, -6]
    ]
    # sums [2, -1, 2, 3, -8] elect [+, -, +, +, -]; disjoint means: (5+1)/2, -3, 2, 3, (-2-6)/2
    assert merge_lists("ties", rows, density=0.4) == [3.0, -3.0, 2.0, 3.0, -4.0]


def test_ties_zero_elected_sign_takes_the_majority_sign():
    # sums [0, 2, 2]: the zero takes sign(0 + 1 + 1) = +, so entry 0 keeps the positive 2
    assert merge_lists("ties", [[2.0, 1.0, -1.0], [-2.0, 1.0, 3.0]], density=1.0) == [2, 1, 3]
    # sums [0, -2, 0]: majority sign(-1) = -
    assert merge_lists("ties", [[2.0, 1.0, -1.0], [-2.0, -3.0, 1.0]], density=1.0) == [-2, -3, -1]


def test_ties_zero_majority_leaves_sign_zero_and_keeps_negatives():
    # sums [0, 2, -4]: elected [0, +, -], majority sign(0) = 0 stays; elected 0 selects x < 0
    assert merge_lists("ties", [[2.0, 1.0, -1.0], [-2.0, 1.0, -3.0]], density=1.0) == [-2, 1, -2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("name", "params"),
    [("ties", {"density": 1.0}), ("dare", {"density": 1.0, "consensus": True, "normalize": True})],
)
def test_sign_election_sums_half_precision_deltas_in_float32(name, params, dtype):
    # entry 0: -256 + 2^-7 + 256 = +2^-7, so the elected sign is + and the disjoint mean is
    # (2^-7 + 256) / 2 = 128.0039, 128 in either dtype. Summed in the deltas' dtype, -256 + 2^-7
    # rounds to -256, the total to 0, which takes the majority sign (-, from entry 1): -256.
    rows = [[-256.0, -1.0], [2.0**-7, -1.0], [256.0, -1.0]]  # exact in both dtypes
    deltas = [torch.tensor(row, dtype=dtype) for row in rows]
    merged = get_method(name, **params).merge_tensor("v", deltas)
    assert merged.dtype == dtype and merged.tolist() == [128.0, -1.0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("name", "params", "shape"),
    [
        ("mean", {}, (4,)),
        ("mean", {}, (2, 2)),
        ("ta", {}, (4,)),
        ("breadcrumbs", {"density": 1.0, "gamma": 0.0}, (4,)),
        ("dare", {"density": 1.0}, (4,)),
        ("tsv", {}, (4,)),
        ("iso-c", {}, (4,)),
        ("iso-cts", {}, (4,)),
    ],
)
def test_sums_of_half_precision_deltas_are_rounded_once(name, params, shape, dtype):
    """Sixteen deltas ``[256, 1, ..., 1]``: the mean is 271/16 = 16.9375, 17 in either dtype
    (the sum 271, 272 for task arithmetic); added in place in bfloat16, 256 + 1 rounds back to
    256 every time (mean 16). fp16: two deltas of 40000 (finite) average to 40000, not the inf
    of a half-precision sum of 80000. The expected values are the float64 sums, rounded once."""
    if dtype == torch.bfloat16:
        values = [256.0] + [1.0] * 15
    else:
        values = [40000.0, 40000.0]
    deltas = [torch.full(shape, value, dtype=dtype) for value in values]
    exact = torch.tensor(values, dtype=torch.float64).sum()
    expected = exact if name == "ta" else exact / len(values)
    merged = get_method(name, **params).merge_tensor("b", deltas)
    assert merged.dtype == dtype
    assert torch.equal(merged, torch.full(shape, expected.item(), dtype=torch.float64).to(dtype))


@pytest.mark.parametrize("name", ["mean", "ta", "ties", "tsv", "iso-c", "iso-cts"])
def test_task_vectors_of_mixed_dtypes_merge_in_their_promoted_dtype(name):
    """A float32 and a float64 task vector, in either order: the float64 merge of the two
    (before: the first one's dtype, so the two orders gave different results)."""
    generator = torch.Generator().manual_seed(3)
    single = torch.randn(6, 4, generator=generator).float()
    double = torch.randn(6, 4, generator=generator, dtype=torch.float64)
    method = get_method(name)
    for pair in ([single, double], [double, single]):
        merged = method.merge([TaskVector({"w": delta}) for delta in pair])["w"]
        widened = method.merge([TaskVector({"w": delta.double()}) for delta in pair])["w"]
        assert merged.dtype == torch.float64 and torch.equal(merged, widened)
    one_way, other_way = (method.merge([TaskVector({"w": d}) for d in pair])["w"]
                          for pair in ([single, double], [double, single]))  # fmt: skip
    torch.testing.assert_close(one_way, other_way, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["mean", "tsv", "iso-c", "dare"])
def test_merge_refuses_integer_deltas_and_a_lone_task_vector(name):
    method = get_method(name)
    ints = [TaskVector({"w": torch.ones(3, 2, dtype=torch.int64)}) for _ in range(2)]
    with pytest.raises(ValueError, match=r"tensor 'w' of task vector 1 is torch.int64"):
        method.merge(ints)
    with pytest.raises(TypeError, match=r"\.merge takes a list of task vectors"):
        method.merge(TaskVector({"w": torch.ones(3, 2)}))


def test_dare_aggregator_seed_wraps_at_the_top_of_its_range():
    """The largest seed, 2**63 - 1, as a DiLoCo aggregator: round r draws the masks of seed
    ``(2**63 - 1 + r) mod 2**63`` (before: round 1 raised 'seed must be in [0, 2**63)')."""
    top = get_method("dare", seed=2**63 - 1)
    assert top.as_aggregator(0, 2).seed == 2**63 - 1
    assert top.as_aggregator(1, 2) == get_method("dare", seed=0)
    assert top.as_aggregator(5, 2) == get_method("dare", seed=4)


def test_mergekit_trim_keeps_every_entry_tied_with_the_last_kept():
    """``trim="mergekit"`` keeps ``max(1, int(n density))`` entries plus ties with the last
    kept, as the docstring states: ``[1, 1, 1, 1]`` at density 0.5 keeps all four, beside
    ``[4, 3, 2, 1]``, which keeps 2."""
    ties = get_method("ties", density=0.5, trim="mergekit")
    tied = torch.ones(4)
    assert torch.equal(ties.merge_tensor("w", [tied]), tied)
    ordered = torch.tensor([4.0, 3.0, 2.0, 1.0])
    assert ties.merge_tensor("w", [ordered]).tolist() == [4.0, 3.0, 0.0, 0.0]


def test_dare_masks_of_a_large_seed_are_its_formula_modulo_2_64():
    """A seed above 2**64 / 1000003 (before: an overflow in manual_seed) draws the mask of
    ``(seed * 1000003 + crc32(name) + task) mod 2**64``, written out here."""
    seed, delta = 10**15, torch.arange(1.0, 41.0)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(b"w") + 1) % 2**64)
    kept = torch.rand(40, generator=generator, dtype=torch.float64) < 0.5
    expected = torch.where(kept, delta / 0.5, 0.0)
    assert torch.equal(get_method("dare", density=0.5, seed=seed).drop("w", delta, 1), expected)


def test_ties_all_zero_tensor_stays_zero():
    assert merge_lists("ties", [[0.0, 0.0], [0.0, 0.0]]) == [0.0, 0.0]


def test_breadcrumbs_band_by_hand():
    # n = 10, keep int(0.5 * 10) = 5, drop int(0.1 * 10) = 1 largest and 4 smallest
    row = [0.1, -0.2, 0.3, -0.4, 0.5, -0.6, 0.7, -0.8, 0.9, -10.0]
    expected = [0.0, 0.0, 0.0, 0.0, 0.5, -0.6, 0.7, -0.8, 0.9, 0.0]
    assert merge_lists("breadcrumbs", [row], density=0.5, gamma=0.1) == expected
    # n_keep = 9, n_top = 1, n_bottom = 0: only the outlier goes
    assert merge_lists("breadcrumbs", [row], density=0.95, gamma=0.1) == row[:-1] + [0.0]
    # density + gamma > 1 (n_top = 2 would leave n_bottom = -1): the band is clipped to
    # n_top = n - n_keep = 1, so the result is the same
    assert merge_lists("breadcrumbs", [row], density=0.95, gamma=0.2) == row[:-1] + [0.0]


def test_breadcrumbs_keeps_the_largest_entry_of_a_tensor_smaller_than_one_over_density():
    # int(0.9 * 1) = 0 would drop a 0-d scale entirely: the mean of 2 and 4 is 3, not 0
    scalars = [torch.tensor(2.0, dtype=torch.float64), torch.tensor(4.0, dtype=torch.float64)]
    assert get_method("breadcrumbs").merge_tensor("logit_scale", scalars).item() == 3.0
    # n = 5, density 0.1: keep 1 (the largest, as TIES does), gamma 0.05 drops int(0.25) = 0
    row = [0.5, -3.0, 1.0, 0.25, 2.0]
    expected = [0.0, -3.0, 0.0, 0.0, 0.0]
    assert merge_lists("breadcrumbs", [row], density=0.1, gamma=0.05) == expected
    # n = 5, density 0.1, gamma 0.2: the outlier -3 goes, the band keeps the next, 2.0
    assert merge_lists("breadcrumbs", [row], density=0.1, gamma=0.2) == [0, 0, 0, 0, 2.0]


def test_breadcrumbs_keeps_exactly_int_density_n_entries_even_with_ties():
    row = [1.0] * 7 + [2.0] * 5
    result = merge_lists("breadcrumbs", [row], density=0.5, gamma=0.25)
    assert sum(1 for v in result if v != 0) == 6


def test_iso_c_diagonal_two_by_two():
    expected = [[2.0, 0.0], [0.0, 2.0]]
    diag = torch.diag(torch.tensor([3.0, 1.0], dtype=torch.float64))
    np.testing.assert_allclose(get_method("iso-c").merge_tensor("w", [diag]), expected)
    split = [torch.diag(torch.tensor(v, dtype=torch.float64)) for v in ([2.0, 0.0], [1.0, 1.0])]
    np.testing.assert_allclose(get_method("iso-c").merge_tensor("w", split), expected)


@pytest.mark.parametrize("shape", [(3, 5), (5, 3)])
def test_tsv_of_orthogonal_rank_one_tasks_is_their_sum(shape):
    # d = 3, T = 2: one component per task; orthogonal U and V blocks need no correction
    first = torch.zeros(shape, dtype=torch.float64)
    second = torch.zeros(shape, dtype=torch.float64)
    first[0, 0] = 3.0
    second[1, 2] = -2.0
    result = get_method("tsv").merge_tensor("w", [first, second])
    torch.testing.assert_close(result, first + second)


def test_tsv_two_by_two_keeps_each_task_top_component():
    first = torch.diag(torch.tensor([3.0, 1.0], dtype=torch.float64))
    second = torch.diag(torch.tensor([0.5, 2.0], dtype=torch.float64))
    result = get_method("tsv").merge_tensor("w", [first, second])
    torch.testing.assert_close(result, torch.diag(torch.tensor([3.0, 2.0], dtype=torch.float64)))


def test_iso_cts_by_hand():
    # d = 2, T = 2, f = 0: k = 0, one direction per task: s = [3, 2] -> 2.5 * I
    first = torch.diag(torch.tensor([3.0, 1.0], dtype=torch.float64))
    second = torch.diag(torch.tensor([0.5, 2.0], dtype=torch.float64))
    result = get_method("iso-cts", common_fraction=0.0).merge_tensor("w", [first, second])
    torch.testing.assert_close(result, 2.5 * torch.eye(2, dtype=torch.float64))
    # d = 3, T = 2, f = 0.5: k = 1 (e1, s = 6 from the sum diag(6, 1, 3)); residuals diag(0, 1, 0)
    # and diag(0, 0, 3) give e2 (s = 1) and e3 (s = 3); mean of [1, 3, 6] = 10/3
    first = torch.diag(torch.tensor([4.0, 1.0, 0.0], dtype=torch.float64))
    second = torch.diag(torch.tensor([2.0, 0.0, 3.0], dtype=torch.float64))
    result = get_method("iso-cts", common_fraction=0.5).merge_tensor("w", [first, second])
    torch.testing.assert_close(result, 10 / 3 * torch.eye(3, dtype=torch.float64))


@pytest.mark.parametrize(
    "d, tasks, fraction, common, per_task",
    [
        (9, 2, 0.0, 1, 4),  # (9 - 0) / 2 = 4.5 rounds to even 4 (round-half-up would give k < 0)
        (5, 2, 0.0, 1, 2),  # 2.5 -> 2
        (13, 2, 0.2, 1, 6),  # k0 = int(2.6) = 2; 11 / 2 = 5.5 -> 6
        (1, 2, 0.0, 1, 0),  # 0.5 -> 0: no task-specific space
        (10, 4, 0.5, 6, 1),  # k0 = 5; 1.25 -> 1
        (9, 4, 0.3, 1, 2),  # k0 = int(2.7) = 2; 1.75 -> 2
        (100, 3, 0.29, 28, 24),  # 100 * 0.29 = 28.999999999999996 -> k0 = 28; 72 / 3 = 24
        (16, 8, 0.8, 16, 0),  # k0 = 12; 0.5 -> 0: everything is common (= Iso-C)
        (16, 3, 0.8, 13, 1),  # k0 = 12; 1.33 -> 1
        (6, 3, 0.0, 0, 2),  # no common space at all
        (768, 8, 0.8, 616, 19),  # k0 = 614; 154 / 8 = 19.25 -> 19
    ],
)
def test_iso_cts_subspace_sizes(d, tasks, fraction, common, per_task):
    assert split_subspaces("w", d, tasks, fraction) == (common, per_task)


@pytest.mark.parametrize(
    "d, tasks, fraction",
    [
        (3, 2, 0.0),  # 3 / 2 = 1.5 rounds to 2: two blocks of 2 > 3 dimensions, k = -1
        (7, 4, 0.2),  # k0 = int(1.4) = 1; 6 / 4 = 1.5 rounds to 2: 8 > 7, k = -1
        (11, 2, 0.0),  # 5.5 rounds to 6: 12 > 11
    ],
)
def test_iso_cts_negative_common_size_raises(d, tasks, fraction):
    deltas = random_deltas((d, d + 2), tasks)
    method = get_method("iso-cts", common_fraction=fraction)
    with pytest.raises(ValueError, match=r"iso-cts: tensor 'blocks\.0\.w'.*common_fraction"):
        method.merge_tensor("blocks.0.w", deltas)


def test_tsv_rank_uses_the_reference_float_rounding():
    assert tsv_rank("w", torch.Size([8, 9]), 3) == 2
    assert tsv_rank("w", torch.Size([98, 120]), 49) == 1  # int(98 * (1 / 49)) = int(1.99...)
    assert tsv_rank("w", torch.Size([100, 120]), 49) == 2
    with pytest.raises(ValueError, match="'w'"):
        tsv_rank("w", torch.Size([49, 120]), 49)  # int(49 * (1 / 49)) = 0


# -- invariants ----------------------------------------------------------------------------------
PERMUTATION_INVARIANT = [
    ("mean", {}),
    ("ta", {}),
    ("ties", {}),
    ("breadcrumbs", {"density": 0.6, "gamma": 0.05}),
    ("tsv", {}),
    ("iso-c", {}),
    ("iso-c", {"spectral": "ns"}),
    ("iso-cts", {}),
    ("iso-cts", {"common_fraction": 0.3}),
    ("iso-cts", {"spectral": "ns"}),
]


@pytest.mark.parametrize("name, params", PERMUTATION_INVARIANT)
@pytest.mark.parametrize("shape", [(10, 7), (7, 10)])
def test_task_order_does_not_matter(name, params, shape):
    deltas = random_deltas(shape, 3, seed=21)
    method = get_method(name, **params)
    reference = method.merge_tensor("w", deltas)
    for order in ([2, 0, 1], [1, 2, 0], [2, 1, 0]):
        torch.testing.assert_close(
            method.merge_tensor("w", [deltas[i] for i in order]), reference, rtol=0, atol=1e-10
        )


HOMOGENEOUS = [*PERMUTATION_INVARIANT, ("dare", {"density": 0.7})]


@pytest.mark.parametrize("name, params", HOMOGENEOUS)
@pytest.mark.parametrize("scale", [0.01, 7.0])
def test_positive_homogeneity(name, params, scale):
    deltas = random_deltas((9, 6), 3, seed=22)
    method = get_method(name, **params)
    scaled = method.merge_tensor("w", [scale * delta for delta in deltas])
    expected = scale * method.merge_tensor("w", deltas)
    # Newton-Schulz normalises by ||M||_F + 1e-7, which breaks exactness by ~1e-7 / ||M||_F
    tolerance = 1e-5 if params.get("spectral") == "ns" else 1e-12
    atol = tolerance * float(expected.abs().max())
    torch.testing.assert_close(scaled, expected, rtol=tolerance, atol=atol)


@pytest.mark.parametrize("shape", [(9, 6), (6, 9)])
def test_single_task(shape):
    (delta,) = random_deltas(shape, 1, seed=23)
    for name in ("mean", "ta", "tsv"):
        torch.testing.assert_close(get_method(name).merge_tensor("w", [delta]), delta)
    iso_c = get_method("iso-c").merge_tensor("w", [delta])
    assert_matches(iso_c, reference_iso_c([delta.numpy()]))
    # with one task the residual holds exactly the tail of the spectrum, so Iso-CTS = Iso-C
    for fraction in (0.0, 0.5, 0.8):
        iso_cts = get_method("iso-cts", common_fraction=fraction).merge_tensor("w", [delta])
        torch.testing.assert_close(iso_cts, iso_c, rtol=0, atol=1e-10)
    ties = get_method("ties", density=0.3).merge_tensor("w", [delta])
    assert_matches(ties, reference_trim(delta.numpy().ravel(), 0.3).reshape(shape))


@pytest.mark.parametrize("shape", MATRIX_SHAPES)
def test_iso_c_singular_values_all_equal_the_mean_of_the_sum(shape):
    deltas = random_deltas(shape, 4, seed=24)
    singular = np.linalg.svd(sum(as_numpy(deltas)), compute_uv=False)
    merged = get_method("iso-c").merge_tensor("w", deltas)
    np.testing.assert_allclose(
        np.linalg.svd(merged.numpy(), compute_uv=False), singular.mean(), rtol=1e-10
    )


@pytest.mark.parametrize("shape", MATRIX_SHAPES)
def test_tsv_singular_values_are_the_kept_task_singular_values(shape):
    deltas = random_deltas(shape, 3, seed=25)
    rank = min(shape) // 3
    kept = np.concatenate([np.linalg.svd(d, compute_uv=False)[:rank] for d in as_numpy(deltas)])
    merged = get_method("tsv").merge_tensor("w", deltas)
    spectrum = np.linalg.svd(merged.numpy(), compute_uv=False)
    np.testing.assert_allclose(spectrum[: kept.size], np.sort(kept)[::-1], rtol=1e-10)
    np.testing.assert_allclose(spectrum[kept.size :], 0.0, atol=1e-10)


def test_ns_scale_is_at_least_the_exact_scale():
    deltas = random_deltas((12, 8), 3, seed=26)
    summed = sum(as_numpy(deltas))
    singular = np.linalg.svd(summed, compute_uv=False)
    rms = np.linalg.norm(summed) / np.sqrt(8)
    assert rms > singular.mean()  # a random sum has a non-flat spectrum
    exact = get_method("iso-c").merge_tensor("w", deltas).numpy()
    fast = get_method("iso-c", spectral="ns").merge_tensor("w", deltas).numpy()
    # same singular vectors: the NS result is U diag(rms * p(s)) V^T, so it aligns with U V^T
    cosine = np.sum(exact * fast) / (np.linalg.norm(exact) * np.linalg.norm(fast))
    assert cosine > 0.95


def test_ns_on_a_flat_spectrum_is_isotropic_at_the_mean_scale():
    orthonormal, _ = np.linalg.qr(np.random.default_rng(27).standard_normal((10, 6)))
    flat = torch.from_numpy(1.5 * orthonormal)
    fast = get_method("iso-c", spectral="ns").merge_tensor("w", [flat])
    spectrum = np.linalg.svd(fast.numpy(), compute_uv=False)
    np.testing.assert_allclose(spectrum, spectrum[0], rtol=1e-10)  # rms = mean = 1.5 ...
    assert 0.6 * 1.5 < spectrum[0] < 1.3 * 1.5  # ... times NS's value for 1/sqrt(6)
    torch.testing.assert_close(get_method("iso-c").merge_tensor("w", [flat]), flat)


def test_rank_aware_iso_c_stays_in_the_column_space_of_the_sum():
    rng = np.random.default_rng(28)
    shared_columns = rng.standard_normal((7, 2))
    deltas = [torch.from_numpy(shared_columns @ rng.standard_normal((2, 5))) for _ in range(3)]
    summed = sum(as_numpy(deltas))
    u, s, v = np.linalg.svd(summed, full_matrices=False)
    outside = np.eye(7) - u[:, :2] @ u[:, :2].T
    aware = get_method("iso-c", rank_aware=True).merge_tensor("w", deltas).numpy()
    np.testing.assert_allclose(aware, s[:2].mean() * u[:, :2] @ v[:2], atol=1e-12)
    np.testing.assert_allclose(outside @ aware, 0.0, atol=1e-12)
    # exact Iso-C spreads mean(s) (over all 5 values, 3 of them ~0) onto 3 null-space directions
    exact = get_method("iso-c").merge_tensor("w", deltas).numpy()
    np.testing.assert_allclose(np.linalg.svd(exact, compute_uv=False), s.mean(), rtol=1e-10)
    assert np.linalg.norm(outside @ exact) == pytest.approx(s.mean() * np.sqrt(3), rel=1e-8)


def test_iso_c_aggregator_of_the_mean_equals_iso_c_of_the_sum_over_r():
    workers = random_deltas((8, 6), 4, seed=29)
    iso_c = get_method("iso-c")
    of_mean = iso_c.merge_tensor("w", [delta / 4 for delta in workers])
    assert_matches(of_mean, reference_iso_c([sum(as_numpy(workers)) / 4]))
    torch.testing.assert_close(of_mean, iso_c.merge_tensor("w", workers) / 4)
    # as DiLoCo's aggregator, Iso-C and Iso-CTS act on tau / R (matrices only); the others as-is
    aggregator = iso_c.as_aggregator(round_index=0, workers=4)
    torch.testing.assert_close(aggregator.merge_tensor("w", workers), of_mean)
    bias = [delta[0] for delta in workers]  # a non-matrix: the plain mean, not divided again
    torch.testing.assert_close(aggregator.merge_tensor("b", bias), sum(bias) / 4)
    cts = get_method("iso-cts").as_aggregator(0, 4)
    expected = get_method("iso-cts").merge_tensor("w", [delta / 4 for delta in workers])
    torch.testing.assert_close(cts.merge_tensor("w", workers), expected)
    for name in ("mean", "ta", "ties", "tsv", "breadcrumbs"):
        assert get_method(name).as_aggregator(3, 4) == get_method(name)
    assert get_method("dare", seed=5).as_aggregator(3, 4) == get_method("dare", seed=8)


# -- DARE ----------------------------------------------------------------------------------------
def test_dare_is_seeded_per_seed_and_tensor_name():
    deltas = random_deltas((20, 10), 2, seed=30)
    first = get_method("dare", seed=1).merge_tensor("w", deltas)
    assert torch.equal(first, get_method("dare", seed=1).merge_tensor("w", deltas))
    assert not torch.equal(first, get_method("dare", seed=2).merge_tensor("w", deltas))
    assert not torch.equal(first, get_method("dare", seed=1).merge_tensor("v", deltas))


def test_dare_whole_task_vectors_draw_the_same_masks_as_single_tensors():
    generator = torch.Generator().manual_seed(31)
    vectors = [
        TaskVector(
            {"a": torch.randn(5, 4, generator=generator), "b": torch.randn(6, generator=generator)}
        )
        for _ in range(3)
    ]
    method = get_method("dare", density=0.5, seed=3)
    merged = method.merge(vectors)
    for name in ("a", "b"):
        assert torch.equal(merged[name], method.merge_tensor(name, [tv[name] for tv in vectors]))


def test_dare_with_density_one_is_the_mean():
    deltas = random_deltas((6, 5), 3, seed=32)
    assert_matches(
        get_method("dare", density=1.0).merge_tensor("w", deltas), reference_mean(as_numpy(deltas))
    )


def test_dare_masks_are_independent_bernoulli_across_tasks():
    # two identical tasks of ones: each entry is (m1 + m2) / (2 p) with m ~ Bernoulli(p)
    density, numel = 0.3, 40_000
    ones = torch.ones(numel, dtype=torch.float64)
    merged = get_method("dare", density=density).merge_tensor("w", [ones, ones])
    counts = [
        int(torch.isclose(merged, torch.tensor(value, dtype=torch.float64)).sum())
        for value in (0.0, 0.5 / density, 1.0 / density)
    ]
    assert sum(counts) == numel
    for count, p in zip(
        counts, [(1 - density) ** 2, 2 * density * (1 - density), density**2], strict=True
    ):
        assert abs(count - p * numel) < 5 * np.sqrt(numel * p * (1 - p))


def exact_consensus(kept, coefficients, normalize, divisor_weights):
    """TIES's election and disjoint mean in exact rationals: ``u_t = c_t kept_t``; an entry
    whose sum is 0 takes the majority sign of the non-zero sums (-1 on a tie)."""
    from fractions import Fraction

    c = [Fraction(x) for x in coefficients]
    rows = [[Fraction(float(v)) for v in task.tolist()] for task in kept]
    sums = [sum(ct * row[i] for ct, row in zip(c, rows, strict=True)) for i in range(len(rows[0]))]
    balance = sum((s > 0) - (s < 0) for s in sums)
    majority = 1 if balance > 0 else -1
    merged = []
    for i, total in enumerate(sums):
        sign = (total > 0) - (total < 0) or majority
        agreeing = [(ct * row[i], w) for ct, row, w in zip(c, rows, divisor_weights, strict=True)]
        agreeing = [(u, w) for u, w in agreeing if u * sign > 0]
        value = sum(u for u, _ in agreeing)
        divisor = sum(Fraction(w) for _, w in agreeing) if normalize else 1
        merged.append(float(value / (divisor or 1)))
    return merged


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize(
    ("name", "params", "weights"),
    [
        ("ties", {"density": 1.0}, (1 / 3, 1 / 3, 1 / 3)),
        ("ties", {"density": 1.0}, (-0.1, -0.1, -0.1)),
        ("dare", {"density": 1.0, "consensus": True}, None),
        ("dare", {"density": 0.6, "consensus": True}, None),
        ("dare", {"density": 0.6, "consensus": True}, (0.7, 0.7, 0.7)),
    ],
)
def test_a_common_weight_rounds_nothing_into_the_sign_election(name, params, weights, normalize):
    """Integer deltas whose kept entries often sum to exactly 0 (``1 + 2 - 3``): such an entry
    takes the majority sign, whatever common weight or DARE rescale multiplies the tasks
    (before: ``1/3``, TIES's weights or DARE-TIES's default ``w_t = 1/T``, and ``/ 0.6`` made
    the sum ``+-1 ulp``, which elected its own sign). Checked against exact rationals."""
    generator = torch.Generator().manual_seed(40)
    deltas = [torch.randint(-3, 4, (600,), generator=generator).float() for _ in range(3)]
    method = get_method(name, **params, weights=weights, normalize=normalize)
    merged = method.merge_tensor("w", deltas)
    weights = weights or (1 / 3,) * 3
    if name == "dare":
        density = params["density"]
        kept = [(method.drop("w", delta, t) != 0) * delta for t, delta in enumerate(deltas)]
        coefficients = [weight / density for weight in weights]
    else:
        kept, coefficients = deltas, weights
    expected = exact_consensus(kept, coefficients, normalize, weights)
    assert sum(sum(task[i] for task in kept) == 0 for i in range(600)) > 50  # cancelling sums
    np.testing.assert_allclose(merged.double().numpy(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weighted_and_scaled_half_precision_terms_are_rounded_once(dtype):
    """``w_t tau_t`` and DiLoCo's ``tau_t / R`` are formed in float32 (before: in the deltas'
    dtype, each rounded before the sum: a weighted mean of three identical deltas moved 21 of
    256 entries by one bf16 step). Expected: the float64 result, rounded once."""
    x = (torch.arange(1, 257, dtype=torch.float64) / 64 + 1).to(dtype)
    a = torch.tensor([1.0078125], dtype=dtype)
    assert torch.equal(get_method("mean", weights=(1.0, 1.0, 1.0)).merge_tensor("w", [x] * 3), x)
    assert torch.equal(get_method("ta", weights=(3.0, -2.0)).merge_tensor("w", [a, a]), a)
    dare = get_method("dare", density=1.0, weights=(0.3, 0.3, 0.4)).merge_tensor("w", [x] * 3)
    assert torch.equal(dare, x)
    matrix = random_deltas((16, 16), 1, seed=41)[0].to(dtype)
    u, s, vh = np.linalg.svd(matrix.double().numpy())  # Iso-C of the workers' mean, tau
    expected = torch.from_numpy(s.mean() * u @ vh).to(dtype)
    aggregated = get_method("iso-c").as_aggregator(0, 3).merge_tensor("w", [matrix] * 3)
    assert aggregated.dtype == dtype
    assert (aggregated.double() - expected.double()).abs().max() <= (
        expected.double().abs().max() * torch.finfo(dtype).eps
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dare_l1_rescale_sums_half_precision_norms_in_float32(dtype):
    """float16 deltas whose L1 norm, 1e5, passes float16's 65504 (before: NaN and Inf)."""
    delta = torch.full((1000, 1000), 0.1, dtype=dtype)
    method = get_method("dare", density=0.5, rescale="l1")
    merged = method.merge_tensor("w", [delta])
    kept = method.drop("w", delta, 0) != 0
    factor = delta.double().abs().sum() / (delta.double() * kept).abs().sum()
    expected = (delta.double() * kept * factor).to(dtype)
    torch.testing.assert_close(merged, expected, rtol=torch.finfo(dtype).eps, atol=0)


def test_dare_is_unbiased_over_seeds():
    density, seeds = 0.5, 200
    (delta,) = random_deltas((500,), 1, seed=33)
    average = (
        sum(
            get_method("dare", density=density, seed=s).merge_tensor("w", [delta])
            for s in range(seeds)
        )
        / seeds
    )
    # E[m / p] = 1 and Var[m / p] = (1 - p) / p per draw: z-scores of the seed average
    z = (average - delta) / (delta.abs() * np.sqrt((1 - density) / density / seeds))
    assert z.abs().max() < 5.5
    assert abs(z.mean()) < 5 / np.sqrt(delta.numel())


# -- dtype, validation and the registry ------------------------------------------------------------
@pytest.mark.parametrize("name", list_methods())
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_output_keeps_input_dtype(name, dtype):
    for shape in ((6, 4), (5,)):
        deltas = random_deltas(shape, 2, seed=34, dtype=torch.float32)
        result = get_method(name).merge_tensor("w", [delta.to(dtype) for delta in deltas])
        assert result.dtype == dtype and result.shape == shape


@pytest.mark.parametrize("name", list_methods())
def test_tensors_without_entries_merge_to_empty_tensors(name):
    """A 2-D tensor with a zero dimension has no spectrum: every method returns the empty
    tensor of its shape (the spectral methods treat it as a non-matrix), and check_shapes,
    which the trainer calls before round one, accepts it."""
    method = get_method(name)
    shapes = [(0,), (0, 4), (4, 0), (0, 0), (3, 0, 2)]
    method.check_shapes({f"w{index}": shape for index, shape in enumerate(shapes)}, 3)
    for shape in shapes:
        result = method.merge_tensor("w", random_deltas(shape, 3))
        assert result.shape == shape and result.dtype == torch.float64


def test_list_methods_names_all_eight():
    assert sorted(list_methods()) == sorted(
        ["mean", "ta", "ties", "dare", "breadcrumbs", "tsv", "iso-c", "iso-cts"]
    )


def test_tsv_with_fewer_dimensions_than_tasks_raises_naming_the_tensor():
    deltas = random_deltas((3, 8), 4)
    with pytest.raises(ValueError, match=r"tsv: tensor 'layers\.3\.mlp\.w'.*4 tasks"):
        get_method("tsv").merge_tensor("layers.3.mlp.w", deltas)
    # vectors are averaged, whatever T
    vectors = random_deltas((3,), 4)
    assert_matches(get_method("tsv").merge_tensor("b", vectors), reference_mean(as_numpy(vectors)))


@pytest.mark.parametrize(
    "name, params, option",
    [
        ("ties", {"density": 0.0}, "density"),
        ("ties", {"density": 1.5}, "density"),
        ("ties", {"density": -0.2}, "density"),
        ("dare", {"density": 0.0}, "density"),
        ("dare", {"density": 1.01}, "density"),
        ("breadcrumbs", {"density": 0.0}, "density"),
        ("breadcrumbs", {"gamma": 1.0}, "gamma"),
        ("breadcrumbs", {"gamma": -0.1}, "gamma"),
        ("iso-cts", {"common_fraction": 1.0}, "common_fraction"),
        ("iso-cts", {"common_fraction": -0.1}, "common_fraction"),
        ("iso-c", {"spectral": "svd"}, "spectral"),
        ("iso-cts", {"spectral": "fast"}, "spectral"),
    ],
)
def test_out_of_range_parameters_raise_naming_the_option(name, params, option):
    with pytest.raises(ValueError, match=f"{name}: {option}"):
        get_method(name, **params)


@pytest.mark.parametrize(
    "name, params",
    [
        ("ties", {"density": 1.0}),
        ("dare", {"density": 1.0}),
        ("breadcrumbs", {"density": 1.0, "gamma": 0.0}),
        ("iso-cts", {"common_fraction": 0.0}),
    ],
)
def test_interval_ends_that_are_allowed(name, params):
    assert get_method(name, **params).merge_tensor("w", random_deltas((4, 4), 2)).shape == (4, 4)


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("dare", {"density": (0.5, 0.6, 0.7)}, "dare: density has 3 values for 2 tasks"),
        ("dare", {"density": (0.5, 0.6, 0.7), "consensus": True}, "density has 3 values"),
        ("breadcrumbs", {"gamma": (0.01, 0.02, 0.03)}, "breadcrumbs: gamma has 3 values"),
        ("breadcrumbs", {"density": (0.9,)}, "breadcrumbs: density has 1 values for 2 tasks"),
        ("mean", {"weights": (1.0, 2.0, 3.0)}, "mean: weights has 3 values for 2 tasks"),
        ("dare", {"weights": (1.0,)}, "dare: weights has 1 values for 2 tasks"),
        ("ties", {"density": (0.5, 0.6, 0.7)}, "ties: density has 3 values for 2 tasks"),
    ],
)
def test_per_task_options_must_hold_one_value_per_task(name, params, message):
    """Extra per-task values were ignored (and too few named "index 2 of the tasks"): refused,
    through merge_tensor, merge and the DiLoCo driver, before any compute."""
    from mergekit_loco.train.diloco import DiLoCo

    method = get_method(name, **params)
    deltas = random_deltas((3, 3), 2)
    with pytest.raises(ValueError, match=re.escape(message)):
        method.merge_tensor("w", deltas)
    with pytest.raises(ValueError, match=re.escape(message)):
        method.merge([TaskVector({"w": delta}) for delta in deltas])
    model = torch.nn.Linear(3, 3)
    inner = [torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(2)]
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    with pytest.raises(ValueError, match=re.escape(message)):
        DiLoCo(model, inner, outer, aggregator=method, sync_every=2)


@pytest.mark.parametrize(
    "params, option",
    [({"normalize": True}, "normalize"), ({"zero_sign": "positive"}, "zero_sign")],
)
def test_dare_options_of_its_sign_election_need_consensus(params, option):
    """``normalize`` and ``zero_sign`` act only in DARE-TIES: without consensus they used to be
    ignored in silence."""
    with pytest.raises(ValueError, match=f"dare: {option} belongs to DARE-TIES"):
        get_method("dare", **params)
    assert get_method("dare", consensus=True, **params).merge_tensor(
        "w", random_deltas((3, 3), 2)
    ).shape == (3, 3)


def test_zero_sign_by_hand():
    """Sums [0, 0, -2, -2]: the tensor's majority is -, so "majority" (the TIES code) keeps the
    negative entries where the sum is 0 and "positive" (mergekit) the positive ones; density 1,
    one agreeing entry each, so the disjoint mean is that entry."""
    one = torch.tensor([3.0, -5.0, -1.0, -1.0])
    two = torch.tensor([-3.0, 5.0, -1.0, -1.0])
    for method in ("ties", "dare"):
        options = {"density": 1.0} | ({"consensus": True, "normalize": True}
                                     if method == "dare" else {})  # fmt: skip
        majority = get_method(method, **options).merge_tensor("w", [one, two])
        positive = get_method(method, zero_sign="positive", **options).merge_tensor("w", [one, two])
        assert majority.tolist() == [-3.0, -5.0, -1.0, -1.0], method
        assert positive.tolist() == [3.0, 5.0, -1.0, -1.0], method
    with pytest.raises(ValueError, match="ties: zero_sign must be one of"):
        get_method("ties", zero_sign="up")


def low_rank(shape, rank, generator) -> torch.Tensor:
    left = torch.randn(shape[0], rank, generator=generator, dtype=torch.float64)
    return left @ torch.randn(rank, shape[1], generator=generator, dtype=torch.float64)


def rotation_moves(a: torch.Tensor, b: torch.Tensor, generator: torch.Generator):
    """``moved(method)``: ``||merge(P a Q, P b Q) - P merge(a, b) Q|| / ||merge(a, b)||`` for
    random orthogonal P, Q (0 for a spectral method determined by its inputs)."""
    size = a.shape[0]
    p, _ = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
    q, _ = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))

    def moved(method) -> float:
        merged = method.merge_tensor("w", [a, b])
        rotated = method.merge_tensor("w", [p @ a @ q, p @ b @ q])
        return float((rotated - p @ merged @ q).norm() / merged.norm())

    return moved


def test_rank_aware_tsv_is_unique_on_rank_deficient_tasks():
    """Two rank-2 16 x 16 deltas (r = 8 components kept per task): plain TSV's result moves with
    the null-space vectors LAPACK picks (a rotation P . Q of the inputs does not rotate the
    output); rank-aware TSV is rotation-equivariant, keeps rank 4, equals plain TSV on full-rank
    tasks, gives tau's top 6 components for [tau, tau] (12 x 12, r = 6), and the sum of tasks
    with orthogonal column and row spaces."""
    generator = torch.Generator().manual_seed(3)
    a, b = low_rank((16, 16), 2, generator), low_rank((16, 16), 2, generator)
    moved = rotation_moves(a, b, generator)
    assert moved(get_method("tsv")) > 0.1
    aware = get_method("tsv", rank_aware=True)
    assert moved(aware) < 1e-12
    assert torch.linalg.matrix_rank(aware.merge_tensor("w", [a, b])) == 4

    full = random_deltas((10, 8), 3)
    assert_matches(aware.merge_tensor("w", full), get_method("tsv").merge_tensor("w", full).numpy())

    tau = random_deltas((12, 12), 1, seed=5)[0]
    u, s, vh = np.linalg.svd(tau.numpy())
    assert_matches(aware.merge_tensor("w", [tau, tau]), u[:, :6] @ np.diag(s[:6]) @ vh[:6])

    one, two = torch.zeros(8, 8, dtype=torch.float64), torch.zeros(8, 8, dtype=torch.float64)
    one[:2, :2] = torch.tensor([[3.0, 1.0], [0.5, -2.0]])
    two[4:6, 5:7] = torch.tensor([[1.0, -4.0], [2.0, 0.25]])
    assert_matches(aware.merge_tensor("w", [one, two]), (one + two).numpy())
    zeros = [torch.zeros(4, 4), torch.zeros(4, 4)]
    assert torch.equal(aware.merge_tensor("w", zeros), torch.zeros(4, 4))


def reference_partial_isometry(matrix: np.ndarray) -> np.ndarray:
    """``U_r V_r^T`` over the ``np.linalg.matrix_rank`` non-zero directions of ``matrix``."""
    left, _, right_h = np.linalg.svd(matrix, full_matrices=False)
    rank = np.linalg.matrix_rank(matrix)
    return left[:, :rank] @ right_h[:rank]


def reference_rank_aware_iso_cts(deltas, common_fraction=0.8, eps=np.finfo(np.float64).eps):
    """Iso-CTS over the components above ``max(m, n) eps sum_t ||tau_t||_F`` (docs/methods.md;
    eps of the compute dtype): stacks replaced by their partial isometries, scale = the mean of
    the kept values."""
    m, n = deltas[0].shape
    common, per_task = reference_split(min(m, n), len(deltas), common_fraction)
    tolerance = max(m, n) * eps * sum(np.linalg.norm(x) for x in deltas)
    u, s, v = np.linalg.svd(sum(deltas), full_matrices=False)
    kept = int(np.sum(s[:common] > tolerance))
    common_u, common_s, common_v = u[:, :kept], s[:kept], v[:kept]
    lefts, values, rights = [], [], []
    for delta in deltas:
        u_ts, s_ts, v_ts = np.linalg.svd(delta - common_u @ common_u.T @ delta)
        count = int(np.sum(s_ts[:per_task] > tolerance))
        lefts.append(u_ts[:, :count]), values.append(s_ts[:count]), rights.append(v_ts[:count])
    lefts.append(common_u), values.append(common_s), rights.append(common_v)
    left, right = reference_partial_isometry(np.hstack(lefts)), np.vstack(rights)
    return np.concatenate(values).mean() * left @ reference_partial_isometry(right)


def test_rank_aware_iso_cts_is_unique_on_rank_deficient_tasks():
    """Rank-2 16 x 16 tasks (common space k = 12, 2 components per task): plain Iso-CTS moves
    with LAPACK's null-space vectors, rank-aware Iso-CTS is rotation-equivariant (exact and
    Newton-Schulz), matches a float64 reference and is rank-aware Iso-C of the sum (rank 4,
    inside the common space); ``[tau, tau]`` of a rank-2 tau gives
    ``mean(2 s_1, 2 s_2) (u_1 v_1^T + u_2 v_2^T)``; full-rank tasks give plain Iso-CTS."""
    generator = torch.Generator().manual_seed(4)
    a, b = low_rank((16, 16), 2, generator), low_rank((16, 16), 2, generator)
    moved = rotation_moves(a, b, generator)
    assert moved(get_method("iso-cts")) > 0.1
    assert moved(get_method("iso-cts", spectral="ns")) > 0.1
    aware = get_method("iso-cts", rank_aware=True)
    assert moved(aware) < 1e-12
    assert moved(get_method("iso-cts", spectral="ns", rank_aware=True)) < 1e-10
    assert_matches(aware.merge_tensor("w", [a, b]), reference_rank_aware_iso_cts(as_numpy([a, b])))
    u, s, vh = np.linalg.svd((a + b).numpy())  # rank 4 < k: Iso-C of the sum over 4 directions
    assert_matches(aware.merge_tensor("w", [a, b]), s[:4].mean() * (u[:, :4] @ vh[:4]))

    u, s, vh = np.linalg.svd(a.numpy())
    expected = (s[0] + s[1]) * (u[:, :2] @ vh[:2])  # mean(2 s_1, 2 s_2) = s_1 + s_2
    assert_matches(aware.merge_tensor("w", [a, a]), expected)

    full = random_deltas((10, 8), 3)
    plain = get_method("iso-cts").merge_tensor("w", full).numpy()
    assert_matches(aware.merge_tensor("w", full), plain)
    assert_matches(aware.merge_tensor("w", full), reference_rank_aware_iso_cts(as_numpy(full)))
    twice = random_deltas((12, 12), 1, seed=6) * 2  # identical full-rank task blocks
    assert_matches(aware.merge_tensor("w", twice), reference_rank_aware_iso_cts(as_numpy(twice)))
    zeros = [torch.zeros(6, 6), torch.zeros(6, 6)]
    assert torch.equal(aware.merge_tensor("w", zeros), torch.zeros(6, 6))


def test_rank_aware_iso_cts_drops_rounding_at_the_tasks_scale():
    """float32: a small task inside a large task's column space leaves a residual of rounding
    at the large task's scale (far above its own eps); rank-aware Iso-CTS drops it and agrees
    with the float64 reference (at float32's eps) on the same inputs; plain Iso-CTS does not."""
    generator = torch.Generator().manual_seed(8)
    big = 1000 * low_rank((24, 20), 2, generator)
    small = big @ torch.randn(20, 20, generator=generator, dtype=torch.float64) * 1e-6
    other = low_rank((24, 20), 2, generator)
    deltas = [x.float() for x in (big, small, other)]
    expected = reference_rank_aware_iso_cts(as_numpy(deltas), eps=np.finfo(np.float32).eps)
    merged = get_method("iso-cts", rank_aware=True).merge_tensor("w", deltas)
    assert_matches(merged, expected, 1e-4)
    plain = get_method("iso-cts").merge_tensor("w", deltas).double().numpy()
    assert np.abs(plain - expected).max() > 0.1 * np.abs(expected).max()


def test_get_method_rejects_unknown_names_and_parameters():
    with pytest.raises(ValueError, match=r"unknown merge method 'slerp'.*iso-cts"):
        get_method("slerp")
    with pytest.raises(ValueError, match=r"'ties' does not take 'gamma'.*density"):
        get_method("ties", gamma=0.1)
    with pytest.raises(ValueError, match=r"'mean' does not take 'density'.*weights"):
        get_method("mean", density=0.5)
    with pytest.raises(ValueError, match=r"iso-c: rank_aware applies to spectral='exact' only"):
        get_method("iso-c", spectral="ns", rank_aware=True)


def test_merge_of_task_vectors_goes_name_by_name():
    generator = torch.Generator().manual_seed(35)
    vectors = [
        TaskVector(
            {"w": torch.randn(4, 3, generator=generator), "b": torch.randn(3, generator=generator)}
        )
        for _ in range(2)
    ]
    merged = get_method("iso-c").merge(vectors)
    assert isinstance(merged, TaskVector) and list(merged) == ["w", "b"]
    assert_matches(merged["w"], reference_iso_c([tv["w"].double().numpy() for tv in vectors]), 1e-6)
    assert_matches(merged["b"], reference_mean([tv["b"].double().numpy() for tv in vectors]), 1e-6)
    with pytest.raises(ValueError, match="no task vectors"):
        get_method("mean").merge([])
    with pytest.raises(KeyError, match="'b'"):
        get_method("mean").merge([vectors[0], TaskVector({"w": vectors[1]["w"]})])


# -- the one check every merge_tensor runs ---------------------------------------------------------
@dataclass(frozen=True)
class Median(MergeMethod):
    """A user's method that brings only its math: ``merged = median_t tau_t`` (the lower one)."""

    name = "median"

    def merge_tensor(self, name, deltas):
        return torch.stack(list(deltas)).median(dim=0).values


def method_named(name: str) -> MergeMethod:
    return Median() if name == "median" else get_method(name)


EVERY_METHOD = [*list_methods(), "median"]


@pytest.mark.parametrize("name", EVERY_METHOD)
@pytest.mark.parametrize(
    "shapes",
    [((4, 3), (3, 4)), ((4, 3), (12,)), ((4, 3), (1, 3)), ((4, 3), (3,)), ((2,), ())],
    ids=["transposed", "same-numel", "broadcastable", "row", "scalar"],
)
def test_merge_tensor_refuses_deltas_of_different_shapes(name, shapes):
    """TIES flattened a [12] beside a [4, 3], mean broadcast a [1, 3], others raised torch's
    errors: every method, a user's too, now names the tensor and both shapes."""
    method = method_named(name)
    first, second = (torch.ones(shape) for shape in shapes)
    message = f"{name}: tensor 'w' is {list(shapes[1])} in delta 2 but {list(shapes[0])} in delta 1"
    with pytest.raises(ValueError, match=re.escape(message)):
        method.merge_tensor("w", [first, second])


@pytest.mark.parametrize("name", EVERY_METHOD)
def test_merge_tensor_needs_a_list_of_deltas(name):
    method = method_named(name)
    with pytest.raises(ValueError, match=f"{name}: no deltas to merge for tensor 'w'"):
        method.merge_tensor("w", [])
    deltas = random_deltas((3, 2), 2)
    for not_a_list in (torch.stack(deltas), (delta for delta in deltas)):
        with pytest.raises(TypeError, match="the deltas of tensor 'w' must be a list of tensors"):
            method.merge_tensor("w", not_a_list)
    with pytest.raises(TypeError, match="delta 2 of tensor 'w' is a list, not a torch.Tensor"):
        method.merge_tensor("w", [deltas[0], deltas[1].tolist()])
    with pytest.raises(ValueError, match="tensor 'w' of delta 1 is torch.int64: only floating"):
        method.merge_tensor("w", [torch.ones(3, 2, dtype=torch.long)] * 2)


@pytest.mark.parametrize("name", EVERY_METHOD)
def test_merge_tensor_promotes_mixed_dtypes_whatever_the_order(name):
    """Before, the first delta's dtype was the output's (bfloat16 or float64 by the order),
    where merge() promoted: now both are the merge of the deltas cast to float64."""
    method = method_named(name)
    low, high = random_deltas((6, 4), 2, seed=4)
    low = low.to(torch.bfloat16)
    for deltas in ([low, high], [high, low]):
        merged = method.merge_tensor("w", deltas)
        expected = method.merge_tensor("w", [delta.double() for delta in deltas])
        assert merged.dtype == torch.float64
        assert torch.equal(merged, expected)
        in_task_vectors = method.merge([TaskVector({"w": delta}) for delta in deltas])["w"]
        assert torch.equal(in_task_vectors, expected)
    by_hand = (low.double() + high) / 2  # mean of a bfloat16 and a float64 delta, in float64
    assert torch.equal(get_method("mean").merge_tensor("w", [low, high]), by_hand)


@pytest.mark.parametrize("name", EVERY_METHOD)
def test_deltas_that_require_grad_merge_as_data(name):
    """Iso-CTS raised (``sub(..., out=...)`` under autograd) and TIES warned: the deltas are
    detached first, and the result is the merge of the same values without grad."""
    method = method_named(name)
    plain = random_deltas((6, 4), 3, seed=5)
    with_grad = [delta.clone().requires_grad_() for delta in plain]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merged = method.merge_tensor("w", with_grad)
    assert not merged.requires_grad and merged.grad_fn is None
    assert torch.equal(merged, method.merge_tensor("w", plain))


@pytest.mark.parametrize(
    ("name", "options", "unweighted", "ones", "twos"),
    [
        ("mean", {}, [2, 0, 2, 0.5], [2, 0, 2, 0.5], [2, 0, 2, 0.5]),
        ("ta", {}, [4, 0, 4, 1], [4, 0, 4, 1], [8, 0, 8, 2]),
        ("dare", {"density": 1.0}, [2, 0, 2, 0.5], [4, 0, 4, 1], [8, 0, 8, 2]),
        ("breadcrumbs", {"density": 1.0, "gamma": 0.0}, [2, 0, 2, 0.5], [4, 0, 4, 1], [8, 0, 8, 2]),
        ("ties", {"density": 1.0}, [2, 2, 2, 0.5], [2, 2, 2, 0.5], [2, 2, 2, 0.5]),
        ("ties", {"density": 1.0, "normalize": False}, [4, 2, 4, 1], [4, 2, 4, 1], [8, 4, 8, 2]),
    ],
)
def test_weights_are_normalised_by_mean_and_ties_only(name, options, unweighted, ones, twos):
    """docs/methods.md's weights, by hand for tau_1 = [1, -2, 3, 0.5], tau_2 = [3, 2, 1, 0.5]
    with nothing dropped: dare and breadcrumbs default to the mean, and weights (1, 1) double
    it (``sum_t w_t ...``); mean and ties divide by the (agreeing) weights. TIES's entry 2
    sums to 0 and takes the majority sign +, where only tau_2 agrees."""
    deltas = [
        torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=torch.float64),
        torch.tensor([3.0, 2.0, 1.0, 0.5], dtype=torch.float64),
    ]
    for weights, expected in ((None, unweighted), ((1.0, 1.0), ones), ((2.0, 2.0), twos)):
        method = get_method(name, weights=weights, **options)
        assert method.merge_tensor("w", deltas).tolist() == expected, weights


def test_get_method_takes_numpy_numbers_as_python_ones():
    ties = get_method("ties", density=np.float32(0.5), weights=(np.float64(1.0), 2))
    assert ties == get_method("ties", density=0.5, weights=(1.0, 2))
    assert type(ties.density) is float and type(ties.weights[0]) is float
    dare = get_method("dare", seed=np.int64(2**62))
    assert type(dare.seed) is int and dare == get_method("dare", seed=2**62)
    deltas = random_deltas((5, 3), 2)
    assert torch.equal(
        dare.merge_tensor("w", deltas), get_method("dare", seed=2**62).merge_tensor("w", deltas)
    )
    for bad in (np.float64("nan"), np.bool_(True), True):
        with pytest.raises(ValueError, match="method 'ties': density must be a finite number"):
            get_method("ties", density=bad)


@pytest.mark.parametrize("name", [["mean"], None, 3])
def test_get_method_names_the_str_it_expects(name):
    with pytest.raises(TypeError, match="get_method: the method name must be a str, one of mean"):
        get_method(name)


def test_merge_takes_any_iterable_of_task_vectors_once():
    vectors = [TaskVector({"w": delta}) for delta in random_deltas((4, 3), 3)]
    expected = get_method("iso-c").merge(vectors)["w"]
    assert torch.equal(get_method("iso-c").merge(tv for tv in vectors)["w"], expected)
    assert torch.equal(get_method("iso-c").merge(tuple(vectors))["w"], expected)
    with pytest.raises(TypeError, match="task vector 2 is a NoneType, not a TaskVector"):
        get_method("mean").merge(iter([vectors[0], None]))


# -- the docs ------------------------------------------------------------------------------------
def test_every_python_example_in_the_methods_doc_runs():
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    assert blocks, "docs/methods.md has no python example"
    for block in blocks:
        exec(compile(block, str(DOCS), "exec", dont_inherit=True), {"__name__": "docs_example"})
