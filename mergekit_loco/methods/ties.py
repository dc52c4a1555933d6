"""TIES merging (Yadav et al., 2023): trim, elect sign, disjoint mean."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import MergeMethod, check_fraction, sum_of


def keep_top_magnitude(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Zero all but the top ``density`` fraction of ``delta`` by magnitude.

    Threshold = k-th smallest ``|x|`` with ``k = n - int(n * density)``; keep ``|x| >= threshold``
    (ties at the threshold are all kept, as in the reference code).
    """
    numel = delta.numel()
    k = numel - int(numel * density)
    if k == 0:
        return delta.clone()
    magnitude = delta.abs()
    threshold = magnitude.flatten().kthvalue(k).values
    return delta * (magnitude >= threshold)


def elect_sign(trimmed: torch.Tensor) -> torch.Tensor:
    """``sign(sum_t trimmed_t)``; zeros take the sign of the sum of the elected signs."""
    elected = torch.sign(trimmed.sum(dim=0))
    majority = torch.sign(elected.sum())
    return torch.where(elected == 0, majority, elected)


def agreeing_sum_and_count(trimmed: torch.Tensor, elected: torch.Tensor):
    """``(sum_t a_t, #{t: a_t != 0})`` with ``a_t`` = the entries of ``trimmed_t`` whose sign
    agrees with ``elected`` (both are sums over t, so they add up across groups of tasks)."""
    agrees = torch.where(elected > 0, trimmed > 0, trimmed < 0)
    selected = trimmed * agrees
    return selected.sum(dim=0), (selected != 0).sum(dim=0)


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
        # Task by task rather than on a T-fold stack: peak memory ~ (2T + 3) tensors.
        trimmed = [keep_top_magnitude(d, self.density) for d in deltas]
        elected = elect_sign(sum_of(trimmed).unsqueeze(0))
        agreeing_total = torch.zeros_like(trimmed[0])
        agreeing_count = torch.zeros_like(trimmed[0], dtype=torch.long)
        for task_trimmed in trimmed:
            total, count = agreeing_sum_and_count(task_trimmed.unsqueeze(0), elected)
            agreeing_total += total
            agreeing_count += count
        return divide_by_count(agreeing_total, agreeing_count)
