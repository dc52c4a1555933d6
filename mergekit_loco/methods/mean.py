"""Plain averaging (model soup; DiLoCo's aggregator)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import MergeMethod, mean_of


@dataclass(frozen=True)
class Mean(MergeMethod):
    """``merged = (1/T) sum_t tau_t``. With scale 1 this is the uniform model soup."""

    name = "mean"
    needs_base = False

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        return mean_of(deltas)
