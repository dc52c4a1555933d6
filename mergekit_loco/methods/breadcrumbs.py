"""Model Breadcrumbs (Davari & Belilovsky, 2024): drop magnitude outliers and the smallest."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import (
    MergeMethod,
    check_fraction,
    per_task,
    per_task_values,
    task_weights,
    weighted_sum,
)


def keep_magnitude_band(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Zero the top ``gamma`` fraction by magnitude and the smallest, keeping ``density`` of n.

    With n entries sorted by ``|x|``: ``n_top = int(gamma n)`` largest and
    ``n_bottom = n - int(density n) - n_top`` smallest are dropped (if ``n_bottom < 0`` the band
    is moved up: ``n_bottom = 0``, ``n_top = n - int(density n)``).
    """
    numel = delta.numel()
    n_keep = int(density * numel)
    n_top = int(gamma * numel)
    n_bottom = numel - n_keep - n_top
    if n_bottom < 0:
        n_bottom, n_top = 0, numel - n_keep
    order = delta.abs().flatten().argsort(stable=True)
    mask = torch.zeros(numel, dtype=torch.bool, device=delta.device)
    mask[order[n_bottom : numel - n_top]] = True
    return delta * mask.view(delta.shape)


@dataclass(frozen=True)
class Breadcrumbs(MergeMethod):
    """``merged = sum_t w_t band(tau_t)`` with ``w_t = 1/T`` by default (the mean): drop the
    ``gamma`` largest-magnitude entries (outliers) and the smallest, keeping a ``density``
    fraction of each tensor.

    density in (0, 1], default 0.9; gamma in [0, 1), default 0.01 (each one for all tasks or
    one per task); density + gamma <= 1 is not required (the band is clipped, see
    :func:`keep_magnitude_band`). weights: ``w_t`` per task.
    """

    name = "breadcrumbs"
    density: float | tuple[float, ...] = 0.9
    gamma: float | tuple[float, ...] = 0.01
    weights: tuple[float, ...] | None = None

    def __post_init__(self):
        for density in per_task_values(self.density):
            check_fraction(self.name, "density", density, low_open=True, high_open=False)
        for gamma in per_task_values(self.gamma):
            check_fraction(self.name, "gamma", gamma, low_open=False, high_open=True)

    def is_plain_mean(self) -> bool:
        """Whether this is the unweighted mean of one band for all tasks (a sum method)."""
        return self.weights is None and all(
            len(per_task_values(value)) == 1 for value in (self.density, self.gamma)
        )

    def band(self, delta: torch.Tensor, index: int, tasks: int) -> torch.Tensor:
        density = per_task(self.name, "density", self.density, index, tasks)
        gamma = per_task(self.name, "gamma", self.gamma, index, tasks)
        return keep_magnitude_band(delta, density, gamma)

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        count = len(deltas)
        bands = [self.band(delta, index, count) for index, delta in enumerate(deltas)]
        return weighted_sum(bands, task_weights(self.name, self.weights, count))
