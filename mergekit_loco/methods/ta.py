"""Task arithmetic (Ilharco et al., 2023)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import MergeMethod, sum_of


@dataclass(frozen=True)
class TaskArithmetic(MergeMethod):
    """``merged = sum_t tau_t`` (scale it with ``--scale``, typically 0.3-1.0)."""

    name = "ta"

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        return sum_of(deltas)
