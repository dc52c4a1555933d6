"""OuterOptimizer against float64 references written here (numpy), one per aggregator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mergekit_loco.task_vector import TaskVector
from mergekit_loco.train.outer import OuterOptimizer

WORKERS = 3
SHAPES = {"wide": (6, 10), "tall": (12, 9), "norm": (7,)}


def random_deltas(seed: int = 0, workers: int = WORKERS) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {name: rng.standard_normal(shape) for name, shape in SHAPES.items()} for _ in range(workers)
    ]


def as_task_vectors(deltas: list[dict[str, np.ndarray]]) -> list[TaskVector]:
    return [
        TaskVector({n: torch.from_numpy(d.copy()) for n, d in delta.items()}) for delta in deltas
    ]


def zero_params() -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape, dtype=torch.float64) for name, shape in SHAPES.items()}


# -- references (numpy, float64) -------------------------------------------------------------------
def polar(matrix: np.ndarray) -> np.ndarray:
    left, _, right_t = np.linalg.svd(matrix, full_matrices=False)
    return left @ right_t


def ref_mean(taus):
    return np.mean(taus, axis=0)


def ref_ta(taus):
    return np.sum(taus, axis=0)


def ref_ties(taus, density):
    trimmed = []
    for tau in taus:
        flat = np.abs(tau).ravel()
        drop = flat.size - int(flat.size * density)
        threshold = np.sort(flat)[drop - 1] if drop > 0 else -np.inf
        trimmed.append(np.where(np.abs(tau) >= threshold, tau, 0.0))
    trimmed = np.array(trimmed)
    sign = np.sign(trimmed.sum(axis=0))
    sign[sign == 0] = np.sign(sign.sum())
    agree = np.where(sign > 0, trimmed > 0, trimmed < 0)
    count = np.maximum(agree.sum(axis=0), 1)
    return (trimmed * agree).sum(axis=0) / count


def ref_breadcrumbs(taus, density, gamma):
    kept = []
    for tau in taus:
        n = tau.size
        top, bottom = int(gamma * n), n - int(density * n) - int(gamma * n)
        if bottom < 0:
            bottom, top = 0, n - int(density * n)
        order = np.argsort(np.abs(tau).ravel(), kind="stable")
        mask = np.zeros(n, dtype=bool)
        mask[order[bottom : n - top]] = True
        kept.append(tau * mask.reshape(tau.shape))
    return np.mean(kept, axis=0)


def ref_tsv(taus):
    if taus[0].ndim != 2:
        return np.mean(taus, axis=0)
    rank = min(taus[0].shape) // len(taus)
    lefts, singulars, rights = [], [], []
    for tau in taus:
        left, singular, right_t = np.linalg.svd(tau, full_matrices=False)
        (
            lefts.append(left[:, :rank]),
            singulars.append(singular[:rank]),
            rights.append(right_t[:rank]),
        )
    return polar(np.hstack(lefts)) @ np.diag(np.concatenate(singulars)) @ polar(np.vstack(rights))


def ref_newton_schulz(matrix, steps=5):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrix.T if matrix.shape[0] > matrix.shape[1] else matrix
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if matrix.shape[0] > matrix.shape[1] else x


def ref_iso_c(taus, spectral="exact"):
    averaged = np.mean(taus, axis=0)
    if averaged.ndim != 2:
        return averaged
    if spectral == "ns":
        rms = np.linalg.norm(averaged) / np.sqrt(min(averaged.shape))
        return rms * ref_newton_schulz(averaged)
    left, singular, right_t = np.linalg.svd(averaged, full_matrices=False)
    return singular.mean() * left @ right_t


def ref_iso_cts(taus, common_fraction=0.8):
    """Iso-CTS on tau_i / R: common space from SVD of sum_i tau_i / R = mean, task residuals."""
    scaled = [tau / len(taus) for tau in taus]
    if scaled[0].ndim != 2:
        return np.mean(taus, axis=0)
    dim, tasks = min(scaled[0].shape), len(scaled)
    common = dim - round((dim - int(dim * common_fraction)) / tasks) * tasks
    per_task = (dim - common) // tasks
    left, singular, right_t = np.linalg.svd(np.sum(scaled, axis=0), full_matrices=False)
    blocks = []
    for tau in scaled:
        residual = tau - left[:, :common] @ (left[:, :common].T @ tau)
        u, s, vt = np.linalg.svd(residual, full_matrices=False)
        blocks.append((u[:, :per_task], s[:per_task], vt[:per_task]))
    blocks.append((left[:, :common], singular[:common], right_t[:common]))
    lefts = polar(np.hstack([u for u, _, _ in blocks]))
    rights = polar(np.vstack([vt for _, _, vt in blocks]))
    return np.concatenate([s for _, s, _ in blocks]).mean() * lefts @ rights


CASES = [
    ("mean", {}, ref_mean),
    ("ta", {}, ref_ta),
    ("ties", {"density": 0.9}, lambda t: ref_ties(t, 0.9)),
    ("ties", {"density": 0.3}, lambda t: ref_ties(t, 0.3)),
    ("breadcrumbs", {"density": 0.8, "gamma": 0.1}, lambda t: ref_breadcrumbs(t, 0.8, 0.1)),
    ("tsv", {}, ref_tsv),
    ("iso-c", {}, ref_iso_c),
    ("iso-c", {"spectral": "ns"}, lambda t: ref_iso_c(t, "ns")),
    ("iso-cts", {}, ref_iso_cts),
]


@pytest.mark.parametrize(("aggregator", "options", "reference"), CASES)
def test_outer_step_matches_reference(aggregator, options, reference):
    """No momentum: theta_new = theta - lr * (-merged) = theta + lr * merged, per tensor."""
    deltas = random_deltas(seed=1)
    params = zero_params()
    start = {n: p.clone() for n, p in params.items()}
    outer = OuterOptimizer(params, aggregator, lr=0.7, momentum=0.0, **options)
    outer.step(as_task_vectors(deltas))
    for name in SHAPES:
        expected = start[name].numpy() + 0.7 * reference([d[name] for d in deltas])
        assert params[name].dtype == torch.float64
        np.testing.assert_allclose(params[name].numpy(), expected, rtol=1e-9, atol=1e-11)


def test_iso_c_update_is_isotropic():
    """Invariant: every singular value of the Iso-C step equals the mean of the mean's."""
    deltas = random_deltas(seed=2)
    params = zero_params()
    OuterOptimizer(params, "iso-c", lr=1.0).step(as_task_vectors(deltas))
    singular = np.linalg.svd(params["tall"].numpy(), compute_uv=False)
    mean_singular = np.linalg.svd(np.mean([d["tall"] for d in deltas], 0), compute_uv=False).mean()
    np.testing.assert_allclose(singular, mean_singular, rtol=1e-10)


def test_dare_masks_are_bernoulli_and_fresh_each_round():
    """merged * R * p must equal sum_t m_t tau_t with m_t in {0, 1}: recover the masks."""
    rng = np.random.default_rng(3)
    tau_small, tau_big = 1 + rng.random((20, 20)), 10 + 10 * rng.random((20, 20))
    density = 0.5

    def masks_of_one_round(outer, params):
        before = params["w"].clone()
        outer.step(as_task_vectors([{"w": tau_small}, {"w": tau_big}]))
        scaled = (params["w"] - before).numpy() * 2 * density
        options = {
            (0, 0): np.zeros_like(tau_small), (1, 0): tau_small,
            (0, 1): tau_big, (1, 1): tau_small + tau_big,
        }  # fmt: skip
        masks = np.zeros((2, *tau_small.shape))
        matched = np.zeros(tau_small.shape, dtype=bool)
        for (keep_small, keep_big), value in options.items():
            hit = np.isclose(scaled, value, rtol=1e-12, atol=1e-12)
            masks[0][hit], masks[1][hit] = keep_small, keep_big
            matched |= hit
        assert matched.all(), "an entry is not (m1 tau1 + m2 tau2) / (R p)"
        return masks

    params = {"w": torch.zeros(20, 20, dtype=torch.float64)}
    outer = OuterOptimizer(params, "dare", lr=1.0, density=density, seed=5)
    first, second = masks_of_one_round(outer, params), masks_of_one_round(outer, params)
    assert 0.35 < first.mean() < 0.65 and 0.35 < second.mean() < 0.65
    assert (first != second).any(), "DARE must draw new masks every round"

    # density 1 keeps everything: plain mean
    params = {"w": torch.zeros(20, 20, dtype=torch.float64)}
    OuterOptimizer(params, "dare", lr=1.0, density=1.0).step(
        as_task_vectors([{"w": tau_small}, {"w": tau_big}])
    )
    np.testing.assert_allclose(params["w"].numpy(), (tau_small + tau_big) / 2, rtol=1e-12)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("aggregator", ["mean", "iso-c"])
def test_momentum_matches_torch_sgd(aggregator, nesterov):
    """Four rounds against torch.optim.SGD fed the pseudo-gradient -merged as .grad."""
    lr, momentum = 0.7, 0.9
    params = zero_params()
    outer = OuterOptimizer(params, aggregator, lr=lr, momentum=momentum, nesterov=nesterov)
    reference_params = {n: torch.nn.Parameter(p.clone()) for n, p in params.items()}
    sgd = torch.optim.SGD(
        reference_params.values(), lr=lr, momentum=momentum, nesterov=nesterov, dampening=0
    )
    reference = ref_iso_c if aggregator == "iso-c" else ref_mean
    for round_index in range(4):
        deltas = random_deltas(seed=10 + round_index)
        outer.step(as_task_vectors(deltas))
        for name, param in reference_params.items():
            param.grad = torch.from_numpy(-reference([d[name] for d in deltas]))
        sgd.step()
        for name in SHAPES:
            torch.testing.assert_close(
                params[name], reference_params[name].detach(), rtol=1e-10, atol=1e-12
            )
    assert all(buf.dtype == torch.float64 for buf in outer.momentum_buffers.values())


@pytest.mark.parametrize(("aggregator", "options"), [("mean", {}), ("dare", {"density": 0.7})])
def test_state_dict_round_trip_mid_run(aggregator, options):
    """Save after 2 of 4 rounds, load into a fresh optimizer: the last 2 rounds agree exactly."""
    deltas = [as_task_vectors(random_deltas(seed=20 + r)) for r in range(4)]
    params = zero_params()
    outer = OuterOptimizer(params, aggregator, lr=0.5, momentum=0.8, nesterov=True, **options)
    for round_deltas in deltas[:2]:
        outer.step(round_deltas)
    resumed_params = {n: p.clone() for n, p in params.items()}
    resumed = OuterOptimizer(
        resumed_params, aggregator, lr=0.5, momentum=0.8, nesterov=True, **options
    )
    resumed.load_state_dict(outer.state_dict())
    for round_deltas in deltas[2:]:
        outer.step(round_deltas)
        resumed.step(round_deltas)
    for name in SHAPES:
        assert torch.equal(params[name], resumed_params[name])


def test_a_loaded_state_keeps_this_optimizers_own_settings():
    """Only the momentum buffers and step count load: a state saved with lr 0.7 (or edited
    to lr -5, momentum 1.5, which the constructor refuses) leaves lr 0.1, momentum 0.5,
    plain momentum in force. One step from the loaded buffer b (delta d, g = -d):
    buf = 0.5 b + g; theta -= 0.1 buf."""
    saver = OuterOptimizer({"w": torch.zeros(2, dtype=torch.float64)}, lr=0.7, momentum=0.9,
                           nesterov=True)  # fmt: skip
    saver.step([TaskVector({"w": torch.tensor([1.0, -2.0], dtype=torch.float64)})])
    state = saver.state_dict()
    buffer = state["sgd"]["state"][0]["momentum_buffer"].clone()  # = g = [-1, 2]
    state["sgd"]["param_groups"][0].update(lr=-5.0, momentum=1.5)
    params = {"w": torch.zeros(2, dtype=torch.float64)}
    outer = OuterOptimizer(params, lr=0.1, momentum=0.5, nesterov=False)
    outer.load_state_dict(state)
    group = outer.sgd.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.1, 0.5, False)
    assert outer.steps_taken == 1
    delta = torch.tensor([0.5, 0.25], dtype=torch.float64)
    outer.step([TaskVector({"w": delta})])
    expected_buffer = 0.5 * buffer - delta
    torch.testing.assert_close(outer.momentum_buffers["w"], expected_buffer, rtol=0, atol=1e-15)
    torch.testing.assert_close(params["w"], -0.1 * expected_buffer, rtol=0, atol=1e-15)


def test_non_finite_pseudo_gradient_raises():
    params = {"w": torch.zeros(3, 3, dtype=torch.float64)}
    bad = TaskVector({"w": torch.full((3, 3), float("nan"), dtype=torch.float64)})
    with pytest.raises(FloatingPointError, match="'w'"):
        OuterOptimizer(params, "mean", lr=1.0).step([bad])


@pytest.mark.parametrize(
    ("aggregator", "bad"),
    [("iso-c", float("nan")), ("iso-cts", float("inf")), ("tsv", float("nan")),
     ("ties", -float("inf")), ("mean", float("nan"))],
)  # fmt: skip
def test_a_non_finite_worker_delta_is_refused_before_aggregating(aggregator, bad):
    """Iso-C with a NaN and Iso-CTS with an Inf raised torch's SVD ``_LinAlgError``: the deltas
    are checked before any method runs, with the documented error naming the tensor; the
    parameters, the step count and the momentum are kept, and the next finite step is the
    first one."""
    params = zero_params()
    outer = OuterOptimizer(params, aggregator, lr=0.5, momentum=0.9)
    deltas = as_task_vectors(random_deltas())
    deltas[1]["tall"][2, 3] = bad
    with pytest.raises(FloatingPointError, match=r"^non-finite pseudo-gradient for 'tall' .*; "
                       "params kept$"):  # fmt: skip
        outer.step(deltas)
    assert all(not p.any() and p.grad is None for p in params.values())
    assert outer.steps_taken == 0 and not outer.momentum_buffers
    finite = as_task_vectors(random_deltas(seed=1))
    outer.step(finite)
    fresh = zero_params()
    OuterOptimizer(fresh, aggregator, lr=0.5, momentum=0.9).step(finite)
    assert all(torch.equal(params[name], fresh[name]) for name in SHAPES)


def refuse_a_non_finite_delta_on_one_rank(rank: int, store: str) -> None:
    """Rank 1's delta holds a NaN: both ranks raise the same FloatingPointError (rank 0 does
    not wait in a collective for a rank that failed), parameters kept."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # fmt: skip
    params = zero_params()
    outer = OuterOptimizer(params, "iso-c", lr=0.5)
    local = as_task_vectors(random_deltas(seed=rank, workers=1))
    if rank == 1:
        local[0]["wide"][0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite pseudo-gradient for 'wide'"):
        outer.step(local)
    assert all(not p.any() for p in params.values()) and outer.steps_taken == 0
    dist.destroy_process_group()
    os._exit(0)


def test_a_non_finite_delta_on_one_rank_stops_every_rank_alike(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(refuse_a_non_finite_delta_on_one_rank, args=(str(tmp_path / "store"),), nprocs=2)


@pytest.mark.parametrize(
    ("delta", "message"),
    [
        ({"W": torch.ones(2, 2)}, "tensor 'W' is not a parameter"),
        ({"w": torch.ones(2, 2), "extra": torch.ones(1)}, "tensor 'extra' is not a parameter"),
        ({}, "tensor 'w' is missing from the merged deltas"),
        ({"w": torch.ones(1, 2)}, r"tensor 'w' is \[1, 2\] but the parameter is \[2, 2\]"),
    ],
)
def test_deltas_that_do_not_fit_the_params_are_refused_and_change_nothing(delta, message):
    """A misspelt, missing, extra or wrong-shaped tensor is an error naming it, never a
    silently skipped parameter or a torch broadcasting error."""
    params = {"w": torch.zeros(2, 2)}
    outer = OuterOptimizer(params, "mean", lr=1.0, momentum=0.9)
    with pytest.raises(ValueError, match=message):
        outer.step([TaskVector(delta)])
    assert torch.equal(params["w"], torch.zeros(2, 2)) and not outer.momentum_buffers
