"""Plain averaging (model soup; DiLoCo's aggregator), optionally weighted."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import MergeMethod, task_weights


@dataclass(frozen=True)
class Mean(MergeMethod):
    """``merged = (1/T) sum_t tau_t``. With scale 1 this is the uniform model soup.

    weights: ``w_t`` per task for the weighted mean ``sum_t w_t tau_t / sum_t w_t`` (mergekit's
    ``linear``).
    """

    name = "mean"
    needs_base = False
    weights: tuple[float, ...] | None = None

    def local_term(self, name: str, delta: torch.Tensor, worker_index: int) -> torch.Tensor:
        return self.weighted(delta, worker_index)

    def finish(self, name: str, total: torch.Tensor, workers: int) -> torch.Tensor:
        weights = task_weights(self.name, self.weights, workers)
        if weights is None:
            return total.div_(workers)
        if math.fsum(weights) == 0:
            raise ValueError(f"{self.name}: weights sum to 0")
        return total.div_(math.fsum(weights))
