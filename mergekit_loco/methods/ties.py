"""TIES merging (Yadav et al., 2023): trim, elect sign, disjoint mean."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mergekit_loco.methods.base import (
    MergeMethod,
    check_fraction,
    per_task,
    per_task_values,
    task_weights,
)
from mergekit_loco.methods.plan import Collectives, Layout, Plan, Pricing
from mergekit_loco.task_vector import TaskVector

#: Tensors up to this many entries get a plain ``kthvalue``; larger ones the bracketed search.
DIRECT_SELECTION_NUMEL = 1 << 16
#: Entries sampled to bracket the k-th magnitude, and the bracket's half-width in standard
#: deviations of the sample rank (a miss only costs a fallback to a full ``kthvalue``).
SAMPLE_SIZE = 1 << 14
BRACKET_SIGMAS = 5.0
#: Entries per slice in the elementwise passes on CPU (slices stay in cache; on other devices
#: a whole tensor is one slice).
CPU_SLICE_NUMEL = 1 << 17


def slices(numel: int, device: torch.device) -> list[slice]:
    """``[0, numel)`` cut into cache-sized slices (one slice off the CPU)."""
    step = CPU_SLICE_NUMEL if device.type == "cpu" else max(numel, 1)
    return [slice(start, min(start + step, numel)) for start in range(0, numel, step)] or [
        slice(0, 0)
    ]


def bracket_ranks(k: int, numel: int) -> tuple[int, int]:
    """Ranks in a sorted sample of ``SAMPLE_SIZE`` that bracket the k-th of ``numel`` values:
    ``k s / n`` +- ``BRACKET_SIGMAS`` binomial standard deviations (+1)."""
    fraction = k / numel
    center = fraction * SAMPLE_SIZE
    spread = BRACKET_SIGMAS * math.sqrt(SAMPLE_SIZE * fraction * (1 - fraction)) + 1
    return math.floor(center - spread), math.ceil(center + spread)


def kth_on_cpu(flat: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`kth_smallest_magnitude` with numpy's comparisons and selection (several times
    faster than torch's boolean kernels on CPU). Half-precision slices are widened to float32,
    which preserves every value and their order."""
    numel = flat.numel()

    def magnitudes(values: torch.Tensor) -> np.ndarray:
        if values.dtype not in (torch.float32, torch.float64):
            values = values.float()
        return np.abs(values.numpy())

    picks = torch.from_numpy(np.random.default_rng(numel).integers(0, numel, SAMPLE_SIZE))
    sample = np.sort(magnitudes(flat[picks]))
    low_rank, high_rank = bracket_ranks(k, numel)
    low = sample[low_rank] if low_rank >= 0 else -np.inf
    high = sample[high_rank] if high_rank < SAMPLE_SIZE else np.inf
    below, inside = 0, []
    for part in slices(numel, flat.device):
        magnitude = magnitudes(flat[part])
        below += int(np.count_nonzero(magnitude < low))
        inside.append(magnitude[(magnitude >= low) & (magnitude <= high)])
    candidates = np.concatenate(inside)
    rank = k - below
    if not 0 < rank <= candidates.size:
        return flat.abs().kthvalue(k).values
    kth = np.partition(candidates, rank - 1)[rank - 1]
    return torch.tensor(kth).to(flat.dtype)


def kth_on_device(flat: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`kth_smallest_magnitude` with torch operations (the path for GPUs)."""
    numel = flat.numel()
    generator = torch.Generator(device=flat.device).manual_seed(numel)
    picks = torch.randint(numel, (SAMPLE_SIZE,), generator=generator, device=flat.device)
    sample = flat[picks].abs().sort().values
    low_rank, high_rank = bracket_ranks(k, numel)
    magnitude = flat.abs()
    in_bracket = torch.ones_like(magnitude, dtype=torch.bool)
    below = 0
    if low_rank >= 0:
        is_below = magnitude < sample[low_rank]
        below = int(is_below.sum())
        in_bracket &= ~is_below
    if high_rank < SAMPLE_SIZE:
        in_bracket &= magnitude <= sample[high_rank]
    candidates = magnitude[in_bracket]
    rank = k - below
    if not 0 < rank <= candidates.numel():
        return magnitude.kthvalue(k).values
    return candidates.kthvalue(rank).values


def kth_smallest_magnitude(delta: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th smallest ``|x|`` (1-based) of ``delta``: exactly ``|delta|.kthvalue(k)``.

    Large tensors avoid a full selection over n: the k-th value is bracketed by two order
    statistics ``[low, high]`` of a random sample (rank ``k s / n`` +- 5 sigma), the entries
    below ``low`` are counted, and only the few entries inside the bracket are selected from:
    ``kth = select(inside, k - #{|x| < low})``. Every step compares values of ``delta``, so the
    result is the value a full ``kthvalue`` returns; if the sample missed (the count puts the
    k-th value outside the bracket) it falls back to the full selection.
    """
    flat = delta.detach().reshape(-1)
    if flat.numel() <= DIRECT_SELECTION_NUMEL:
        return flat.abs().kthvalue(k).values
    if flat.device.type == "cpu":
        return kth_on_cpu(flat, k)
    return kth_on_device(flat, k)


def trim_threshold(delta: torch.Tensor, density: float) -> torch.Tensor | None:
    """The k-th smallest ``|x|`` with ``k = n - int(n * density)``; None when all is kept.

    Exact (the value ``kthvalue`` returns) without a full selection over n: see
    :func:`kth_smallest_magnitude`.
    """
    numel = delta.numel()
    k = numel - int(numel * density)
    if k == 0:
        return None
    return kth_smallest_magnitude(delta, k)


def top_k_threshold(delta: torch.Tensor, density: float) -> torch.Tensor | None:
    """mergekit's trim: the k-th largest ``|x|`` with ``k = max(1, int(n * density))`` (keeping
    ``|x| >= threshold`` keeps k entries, plus any tied with the k-th); None when all is kept.
    The reference rule (:func:`trim_threshold`) keeps ``int(n * density) + 1``."""
    numel = delta.numel()
    if density >= 1 or numel == 0:
        return None
    return kth_smallest_magnitude(delta, numel - max(1, int(numel * density)) + 1)


TRIM_RULES = {"reference": trim_threshold, "mergekit": top_k_threshold}


def keep_above(delta: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor:
    """``x`` where ``|x| >= threshold`` (ties at the threshold are all kept, as in the reference
    code), else 0."""
    if threshold is None:
        return delta.clone()
    return torch.where(delta.abs() >= threshold, delta, 0)


def keep_top_magnitude(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Zero all but the top ``density`` fraction of ``delta`` by magnitude (see
    :func:`trim_threshold`)."""
    return keep_above(delta, trim_threshold(delta, density))


#: Where ``sum_t w_t trim_t`` is exactly 0: "majority" (the TIES code) takes the sign of the
#: sum of the tensor's elected signs (-1 when that is 0 too), "positive" (mergekit) takes +1.
ZERO_SIGNS = ("majority", "positive")


def check_zero_sign(method: str, zero_sign: str) -> None:
    if zero_sign not in ZERO_SIGNS:
        raise ValueError(f"{method}: zero_sign must be one of {ZERO_SIGNS}, not {zero_sign!r}")


def elect_sign(trimmed_sum: torch.Tensor) -> torch.Tensor:
    """``sign(sum_t trimmed_t)``; zeros take the sign of the sum of the elected signs."""
    elected = torch.sign(trimmed_sum)
    majority = torch.sign(elected.sum())
    return torch.where(elected == 0, majority, elected)


def agreeing_sum_and_count(trimmed: Iterable[torch.Tensor], elected: torch.Tensor):
    """``(sum_t a_t, #{t: a_t != 0})`` with ``a_t`` = the entries of ``trimmed_t`` whose sign
    agrees with ``elected`` (both are sums over t, so they add up across groups of tasks).
    Accumulated task by task; the count is int32."""
    total = torch.zeros_like(elected)
    count = torch.zeros_like(elected, dtype=torch.int32)
    for task in trimmed:
        agrees = torch.where(elected > 0, task > 0, task < 0)  # implies task != 0
        total += torch.where(agrees, task, 0)
        count += agrees
    return total, count


def divide_by_count(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``total / max(count, 1)``: the disjoint mean from the agreeing sum and count."""
    return total / count.clamp(min=1)


def trim_slice(part: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor:
    """:func:`keep_above` in float arithmetic only (several times faster on CPU than a boolean
    mask and ``where``): ``drop = sign(relu(threshold - |x|))`` is 1 exactly when
    ``|x| < threshold`` (a difference of floats is 0 only for equal floats), and
    ``x - x * drop`` is ``x`` or 0. Returns ``part`` itself when nothing is trimmed."""
    if threshold is None:
        return part
    drop = part.abs().neg_().add_(threshold).relu_().sign_()
    return part - drop.mul_(part)


def disjoint_mean_slice(
    tasks: Iterable[torch.Tensor],
    task_sum: torch.Tensor,
    zero_direction: float,
    weights: Sequence[float] | None,
    normalize: bool,
    coefficients: Sequence[float] | None = None,
):
    """The (weighted) disjoint mean of one slice, in float arithmetic only.

    ``u_t = c_t s_t`` (``tasks`` yields the ``s_t``; ``c_t``: ``coefficients``, else
    ``weights``; ``sign(task_sum) = sign(sum_t u_t)``); the elected direction is
    ``e = sign(task_sum)`` (``zero_direction`` where it is 0); ``|a_t| = relu(e u_t)`` is the
    agreeing part and ``merged = e sum_t |a_t| / D`` with ``D = sum_{t: a_t != 0} w_t`` (1
    where that is 0; ``D = 1`` without ``normalize``). Unweighted this is the same floats as
    :func:`agreeing_sum_and_count` and :func:`divide_by_count`: the agreeing entries share one
    sign, so summing magnitudes and negating is exact.
    """
    coefficients = weights if coefficients is None else coefficients
    direction = torch.sign(task_sum)
    direction.add_(direction.abs().neg_().add_(1).mul_(zero_direction))
    total = torch.zeros_like(direction)
    divisor = torch.zeros_like(direction)
    for index, task in enumerate(tasks):
        weight = 1.0 if weights is None else weights[index]
        agreeing = (
            (task * direction).relu_()
            if coefficients is None
            else task.mul(coefficients[index] * direction).relu_()
        )
        total.add_(agreeing)
        divisor.add_(agreeing.sign_(), alpha=weight)
    total.mul_(direction)
    if not normalize:
        return total
    return total.div_(divisor.add_(divisor.abs().sign().neg_().add_(1)))


def sign_consensus_merge(
    task_slices: Callable[[slice], Iterable[torch.Tensor]],
    like: torch.Tensor,
    weights: Sequence[float] | None = None,
    normalize: bool = True,
    zero_sign: str = "majority",
    factors: Sequence[float] | None = None,
) -> torch.Tensor:
    """TIES's elect-and-combine step on T sparsified tasks ``s_t``, given slice by slice
    (``task_slices(part)`` yields ``s_t.reshape(-1)[part]`` for every t): ``u_t = c_t s_t``
    with ``c_t = w_t f_t`` (``factors`` f_t: DARE's rescale; 1 by default), signs elected on
    ``sum_t u_t`` (zeros by ``zero_sign``, see :data:`ZERO_SIGNS`), then the weighted disjoint
    mean of the agreeing ``u_t`` (see :func:`disjoint_mean_slice`). Where every ``c_t`` is one
    ``c``, the election sums ``sign(c) s_t``: the sign is the same, and a sum that is 0 stays
    exactly 0 (``c = 1/3`` rounds, and ``(1 - 3 + 2) / 3`` would come out as ``+-1e-17``).

    Two passes over cache-sized slices: the first stores ``sum_t u_t`` in the output and
    counts the elected signs, the second overwrites it with the result; beyond the output only
    slice-sized temporaries exist. Sums are formed in float32 at least (a bfloat16 sum can
    round to 0 and elect the wrong sign); the result is cast back to ``like``'s dtype.
    """
    merged = torch.empty_like(like.reshape(-1), dtype=summing_dtype(like.dtype))
    coefficients = weights
    if factors is not None:
        coefficients = [weight * factor for weight, factor in zip(weights, factors, strict=True)]
    largest = torch.finfo(merged.dtype).max
    if coefficients is not None and not all(abs(c) <= largest for c in coefficients):
        what = "weights" if factors is None else "weights times rescale factors"
        raise ValueError(
            f"{what} {tuple(coefficients)} go beyond {merged.dtype}, in which the sign election "
            "sums; scale them down (with normalize, only their ratios count)"
        )
    election = coefficients
    if coefficients is not None and len(set(coefficients)) == 1:
        election = [math.copysign(1.0, coefficients[0])] * len(coefficients)
    parts = slices(merged.numel(), merged.device)
    sign_balance = 0.0
    for part in parts:
        total = merged[part]
        total.zero_()
        for index, task in enumerate(task_slices(part)):
            total.add_(task, alpha=1.0 if election is None else election[index])
        sign_balance += float(torch.sign(total).sum(dtype=torch.float64))
    zero_direction = 1.0 if sign_balance > 0 or zero_sign == "positive" else -1.0
    for part in parts:
        merged[part] = disjoint_mean_slice(
            task_slices(part), merged[part], zero_direction, weights, normalize, coefficients
        )
    return merged.view(like.shape).to(like.dtype)


def summing_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype TIES sums ``dtype`` deltas in: float32 at least."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class Ties(MergeMethod):
    """``merged = sum_t w_t a_t / sum_{t: a_t != 0} w_t`` per tensor, where ``a_t`` are the
    entries of ``trim(tau_t, density_t)`` whose sign agrees with the sign elected on
    ``sum_t w_t trim_t``.

    density: fraction of each task vector's entries kept, in (0, 1], one for all or one per
    task; default 0.2. weights: ``w_t``, one per task (default 1 each: the disjoint mean).
    normalize=False drops the division (mergekit's ``normalize: false``). trim: "reference"
    (the TIES code: keep ``|x| >=`` the ``(n - int(n density))``-th smallest, which is
    ``int(n density) + 1`` entries) or "mergekit" (``max(1, int(n density))`` entries; both
    keep every entry tied with the last one kept, where mergekit's argsort keeps exactly k and
    breaks ties arbitrarily).
    zero_sign: the sign an entry whose sum is exactly 0 takes, "majority" (the TIES code) or
    "positive" (mergekit), see :data:`ZERO_SIGNS`.
    """

    name = "ties"
    density: float | tuple[float, ...] = 0.2
    weights: tuple[float, ...] | None = None
    normalize: bool = True
    trim: str = "reference"
    zero_sign: str = "majority"

    def __post_init__(self):
        for density in per_task_values(self.density):
            check_fraction(self.name, "density", density, low_open=True, high_open=False)
        if self.trim not in TRIM_RULES:
            raise ValueError(
                f"{self.name}: trim must be one of {tuple(TRIM_RULES)}, not {self.trim!r}"
            )
        check_zero_sign(self.name, self.zero_sign)

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        count = len(deltas)
        weights = task_weights(self.name, self.weights, count)
        threshold_of = TRIM_RULES[self.trim]
        thresholds = [
            threshold_of(delta, per_task(self.name, "density", self.density, index, count))
            for index, delta in enumerate(deltas)
        ]
        flat = [delta.reshape(-1) for delta in deltas]

        def trimmed(part: slice):
            return (trim_slice(d[part], t) for d, t in zip(flat, thresholds, strict=True))

        return sign_consensus_merge(trimmed, deltas[0], weights, self.normalize, self.zero_sign)

    def plans(self) -> Sequence[Plan]:
        """Two all-reduces for plain TIES (unweighted, one density, the reference trim and
        zero sign, normalized); any other setting runs on the generic owner plan."""
        plain = (
            self.weights is None
            and self.normalize
            and self.trim == "reference"
            and self.zero_sign == "majority"
            and not isinstance(self.density, tuple)
        )
        return (Plan("all-reduce", self.run_two_sums, two_sums_bytes),) if plain else ()

    def run_two_sums(
        self, comm: Collectives, local: Sequence[TaskVector], names: list[str]
    ) -> list[torch.Tensor]:
        """Round 1: all-reduce ``sum_t trim(tau_t)`` and elect signs from it; round 2:
        all-reduce the agreeing entries' sum and count; ``merged = sum / max(count, 1)``. The
        sums are formed, and travel, in float32 at least (:func:`summing_dtype`)."""
        trimmed = [
            torch.stack([keep_top_magnitude(tv[name], self.density) for tv in local])
            for name in names
        ]
        sums = comm.all_reduce(
            [block.sum(dim=0, dtype=summing_dtype(block.dtype)) for block in trimmed]
        )
        partial = [
            agreeing_sum_and_count(block, elect_sign(total))
            for block, total in zip(trimmed, sums, strict=True)
        ]
        count_dtype = count_dtype_for(len(local) * comm.world)
        reduced = comm.all_reduce(
            [total for total, _ in partial] + [count.to(count_dtype) for _, count in partial]
        )
        totals, counts = reduced[: len(names)], reduced[len(names) :]
        return [
            divide_by_count(total, count.long()).to(block.dtype)
            for total, count, block in zip(totals, counts, trimmed, strict=True)
        ]


def count_dtype_for(workers: int) -> torch.dtype:
    """The agreeing counts travel as uint8 while they fit (R <= 255), else int32."""
    return torch.uint8 if workers <= 255 else torch.int32


def two_sums_bytes(layout: Layout, workers_per_rank: int, world: int, pricing: Pricing) -> float:
    """Two ring all-reduces: ``2 (P-1) N (2 b' + c)`` over all ranks (b': bytes of the sums,
    float32 at least; c: count bytes)."""
    count_bytes = count_dtype_for(workers_per_rank * world).itemsize
    entries = sum(
        math.prod(shape) * (2 * pricing.width(summing_dtype(dtype)) + count_bytes)
        for _, shape, dtype in layout
    )
    return 2 * (world - 1) * entries
