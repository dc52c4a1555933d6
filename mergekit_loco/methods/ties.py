"""TIES merging (Yadav et al., 2023): trim, elect sign, disjoint mean."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import MergeMethod, check_fraction, sum_of
from mergekit_loco.methods.plan import Collectives, Layout, Plan, Pricing
from mergekit_loco.task_vector import TaskVector


def trim_threshold(delta: torch.Tensor, density: float) -> torch.Tensor | None:
    """The k-th smallest ``|x|`` with ``k = n - int(n * density)``; None when all is kept."""
    numel = delta.numel()
    k = numel - int(numel * density)
    if k == 0:
        return None
    return delta.abs().flatten().kthvalue(k).values


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


@dataclass(frozen=True)
class Ties(MergeMethod):
    """``merged = sum_t a_t / max(#{t: a_t != 0}, 1)`` per tensor, where ``a_t`` are the entries
    of ``trim(tau_t, density)`` whose sign agrees with ``elect_sign``.

    density: fraction of each task vector's entries kept, in (0, 1]; default 0.2.
    """

    name = "ties"
    density: float = 0.2

    def __post_init__(self):
        check_fraction(self.name, "density", self.density, low_open=True, high_open=False)

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        # Thresholds first, trimmed tensors rebuilt on the fly: no T trimmed copies are held.
        thresholds = [trim_threshold(delta, self.density) for delta in deltas]

        def trimmed():
            return (keep_above(d, t) for d, t in zip(deltas, thresholds, strict=True))

        elected = elect_sign(sum_of(trimmed()))
        return divide_by_count(*agreeing_sum_and_count(trimmed(), elected))

    def plans(self) -> Sequence[Plan]:
        return (Plan("all-reduce", self.run_two_sums, two_sums_bytes),)

    def run_two_sums(
        self, comm: Collectives, local: Sequence[TaskVector], names: list[str]
    ) -> list[torch.Tensor]:
        """Round 1: all-reduce ``sum_t trim(tau_t)`` and elect signs from it; round 2:
        all-reduce the agreeing entries' sum and count; ``merged = sum / max(count, 1)``."""
        trimmed = [
            torch.stack([keep_top_magnitude(tv[name], self.density) for tv in local])
            for name in names
        ]
        sums = comm.all_reduce([block.sum(dim=0) for block in trimmed])
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
            divide_by_count(total, count.long())
            for total, count in zip(totals, counts, strict=True)
        ]


def count_dtype_for(workers: int) -> torch.dtype:
    """The agreeing counts travel as uint8 while they fit (R <= 255), else int32."""
    return torch.uint8 if workers <= 255 else torch.int32


def two_sums_bytes(layout: Layout, workers_per_rank: int, world: int, pricing: Pricing) -> float:
    """Two ring all-reduces: ``2 (P-1) N (2 b + c)`` over all ranks (c: count bytes)."""
    count_bytes = count_dtype_for(workers_per_rank * world).itemsize
    entries = sum(
        math.prod(shape) * (2 * pricing.width(dtype) + count_bytes) for _, shape, dtype in layout
    )
    return 2 * (world - 1) * entries
