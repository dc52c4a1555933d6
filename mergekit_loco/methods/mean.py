"""Plain averaging (model soup; DiLoCo's aggregator)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import MergeMethod


@dataclass(frozen=True)
class Mean(MergeMethod):
    """``merged = (1/T) sum_t tau_t``. With scale 1 this is the uniform model soup."""

    name = "mean"
    needs_base = False

    def local_term(self, name: str, delta: torch.Tensor, worker_index: int) -> torch.Tensor:
        return delta

    def finish(self, name: str, total: torch.Tensor, workers: int) -> torch.Tensor:
        return total.div_(workers)
