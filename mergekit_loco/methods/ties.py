"""TIES merging (Yadav et al., 2023): trim, elect sign, disjoint mean."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import MergeMethod, check_fraction, sum_of


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
