"""The inner learning-rate schedule: linear warmup from ``floor * lr``, then cosine to it."""

from __future__ import annotations

import math


class WarmupCosine:
    """LR multiplier for ``torch.optim.lr_scheduler.LambdaLR`` at inner step ``t`` (0-based).

    With ``S = total_steps``, ``W = int(warmup_fraction * S)`` and ``f = floor``:
    ``t < W``: ``f + (1 - f) t / W`` (linear from ``f`` to 1, as ``LinearLR``);
    ``t >= W``: ``f + (1 - f) (1 + cos(pi (t - W) / (S - W))) / 2`` (cosine from 1 down to
    ``f``, as ``CosineAnnealingLR`` with ``eta_min = f lr``); steps past ``S`` stay at ``f``.

    A class rather than a closure so that ``LambdaLR.state_dict()`` records its parameters.
    """

    def __init__(self, total_steps: int, warmup_fraction: float = 0.1, floor: float = 0.1):
        if total_steps < 1:
            raise ValueError(f"schedule needs at least one step, got total_steps={total_steps}")
        if not 0 <= warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must lie in [0, 1), got {warmup_fraction}")
        if not 0 <= floor <= 1:
            raise ValueError(f"floor must lie in [0, 1], got {floor}")
        self.total_steps = total_steps
        self.warmup_steps = int(warmup_fraction * total_steps)
        self.floor = floor

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.floor + (1 - self.floor) * step / self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        progress = min(step - self.warmup_steps, decay_steps) / decay_steps
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))
