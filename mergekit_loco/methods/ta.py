"""Task arithmetic (Ilharco et al., 2023)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import MergeMethod


@dataclass(frozen=True)
class TaskArithmetic(MergeMethod):
    """``merged = sum_t tau_t`` (scale it with ``--scale``, typically 0.3-1.0)."""

    name = "ta"

    def local_term(self, name: str, delta: torch.Tensor, worker_index: int) -> torch.Tensor:
        return delta

    def finish(self, name: str, total: torch.Tensor, workers: int) -> torch.Tensor:
        return total
