"""Model Breadcrumbs (Davari & Belilovsky, 2024): drop magnitude outliers and the smallest."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import (
    MergeMethod,
    check_fraction,
    per_task,
    per_task_values,
    task_weights,
)


def keep_magnitude_band(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Zero the top ``gamma`` fraction by magnitude and the smallest, keeping ``density`` of n.

    With n entries sorted by ``|x|`` and ``n_keep = max(1, int(density n))`` (a tensor smaller
    than ``1 / density``, such as a 0-d scale, keeps its largest entry instead of none):
    ``n_top = int(gamma n)`` largest and ``n_bottom = n - n_keep - n_top`` smallest are dropped
    (if ``n_bottom < 0`` the band is moved up: ``n_bottom = 0``, ``n_top = n - n_keep``).
    """
    numel = delta.numel()
    n_keep = min(numel, max(1, int(density * numel)))
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
    :func:`keep_magnitude_band`). weights: ``w_t`` per task, taken as given (unnormalised: for
    two tasks ``(1, 1)`` doubles the default's step; weights summing to 1 give a weighted mean).
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

    def local_term(self, name: str, delta: torch.Tensor, worker_index: int) -> torch.Tensor:
        density = per_task(self.name, "density", self.density, worker_index)
        gamma = per_task(self.name, "gamma", self.gamma, worker_index)
        band = keep_magnitude_band(delta, density, gamma)
        return self.weighted(band, worker_index, owned=True)

    def finish(self, name: str, total: torch.Tensor, workers: int) -> torch.Tensor:
        if task_weights(self.name, self.weights, workers) is None:
            return total.div_(workers)
        return total
