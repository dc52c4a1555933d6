"""Plain averaging (model soup; DiLoCo's aggregator), optionally weighted."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import MergeMethod, task_weights


def weight_sum(method: str, weights: Sequence[float]) -> float:
    """``W = sum_t w_t``, exactly rounded (``math.fsum``); a ``ValueError`` naming ``method``
    where it lies beyond the float range (``1e308 + 1e308``)."""
    try:
        return math.fsum(weights)
    except OverflowError:
        raise ValueError(
            f"{method}: weights {tuple(weights)} sum beyond the largest float; scale them down"
        ) from None


@dataclass(frozen=True)
class Mean(MergeMethod):
    """``merged = (1/T) sum_t tau_t``. With scale 1 this is the uniform model soup.

    weights: ``w_t`` per task for the weighted mean ``sum_t w_t tau_t / sum_t w_t`` (mergekit's
    ``linear``); weights summing to 0, or beyond the float range, are refused before any compute
    (:meth:`check_tasks`).
    """

    name = "mean"
    needs_base = False
    weights: tuple[float, ...] | None = None

    def weight_total(self, tasks: int) -> float:
        """``W = sum_t w_t`` over ``tasks`` tasks (``T`` unweighted); ``ValueError`` where it is
        0 or beyond the float range."""
        weights = task_weights(self.name, self.weights, tasks)
        if weights is None:
            return float(tasks)
        total = weight_sum(self.name, weights)
        if total == 0:
            raise ValueError(f"{self.name}: weights sum to 0")
        return total

    def fractions(self, tasks: int) -> tuple[float, ...]:
        """``w_t / W`` of each of ``tasks`` tasks (``1 / T`` unweighted)."""
        total = self.weight_total(tasks)
        weights = task_weights(self.name, self.weights, tasks) or (1.0,) * tasks
        return tuple(weight / total for weight in weights)

    def check_tasks(self, tasks: int) -> None:
        super().check_tasks(tasks)
        self.weight_total(tasks)

    def local_term(self, name: str, delta: torch.Tensor, worker_index: int) -> torch.Tensor:
        """``tau_t`` unweighted (summed, then divided by ``T``); weighted, ``(w_t / W) tau_t``,
        so that the weights' own size never overflows the delta's dtype (``w = (5e4, 3e4)`` on
        float16 deltas gave inf)."""
        if self.weights is None:
            return delta
        return delta * self.fractions(len(self.weights))[worker_index]

    def finish(self, name: str, total: torch.Tensor, workers: int) -> torch.Tensor:
        return total.div_(float(workers)) if self.weights is None else total
