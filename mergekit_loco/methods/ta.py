"""Task arithmetic (Ilharco et al., 2023)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import MergeMethod, sum_of, task_weights, weighted_sum


@dataclass(frozen=True)
class TaskArithmetic(MergeMethod):
    """``merged = sum_t tau_t`` (scale it with ``--scale``, typically 0.3-1.0).

    weights: ``w_t`` per task for ``sum_t w_t tau_t`` (mergekit's per-model ``weight``).
    """

    name = "ta"
    weights: tuple[float, ...] | None = None

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        weights = task_weights(self.name, self.weights, len(deltas))
        return sum_of(deltas) if weights is None else weighted_sum(deltas, weights)
