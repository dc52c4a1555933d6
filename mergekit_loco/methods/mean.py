"""Plain averaging (model soup; DiLoCo's aggregator)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import MergeMethod, mean_of, task_weights, weighted_sum


@dataclass(frozen=True)
class Mean(MergeMethod):
    """``merged = (1/T) sum_t tau_t``. With scale 1 this is the uniform model soup.

    weights: ``w_t`` per task for the weighted mean ``sum_t w_t tau_t / sum_t w_t`` (mergekit's
    ``linear``).
    """

    name = "mean"
    needs_base = False
    weights: tuple[float, ...] | None = None

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        weights = task_weights(self.name, self.weights, len(deltas))
        if weights is None:
            return mean_of(deltas)
        total = math.fsum(weights)
        if total == 0:
            raise ValueError(f"{self.name}: weights sum to 0")
        return weighted_sum(deltas, weights).div_(total)
