"""Task arithmetic (Ilharco et al., 2023)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import MergeMethod, task_weights


@dataclass(frozen=True)
class TaskArithmetic(MergeMethod):
    """``merged = sum_t tau_t`` (scale it with ``--scale``, typically 0.3-1.0).

    weights: ``w_t`` per task for ``sum_t w_t tau_t`` (mergekit's per-model ``weight``).
    """

    name = "ta"
    weights: tuple[float, ...] | None = None

    def local_term(self, name: str, delta: torch.Tensor, worker_index: int) -> torch.Tensor:
        return self.weighted(delta, worker_index)

    def finish(self, name: str, total: torch.Tensor, workers: int) -> torch.Tensor:
        task_weights(self.name, self.weights, workers)
        return total
