"""DARE (Yu et al., 2024): drop and rescale, then average (or elect signs, as DARE-TIES)."""

from __future__ import annotations

import zlib
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
from mergekit_loco.methods.ties import sign_consensus_merge

RESCALE_CHOICES = ("density", "l1", "none")
#: mergekit leaves a dropped tensor unscaled when either L1 norm is below this.
L1_EPSILON = 1e-7


def drop_and_rescale(
    delta: torch.Tensor, density: float, generator: torch.Generator, rescale: str = "density"
):
    """Keep each entry with probability ``density``; rescale the kept ones by ``1/density``
    (the DARE paper), by ``||delta||_1 / ||kept||_1`` (mergekit's ``rescale: true``; no
    rescaling when either norm is below 1e-7) or not at all (``"none"``)."""
    keep = torch.rand(delta.shape, generator=generator, dtype=torch.float64) < density
    kept = delta * keep.to(delta.device)
    if rescale == "density":
        return kept / density
    if rescale == "l1":
        before, after = delta.abs().sum(), kept.abs().sum()
        if before >= L1_EPSILON and after >= L1_EPSILON:
            return kept * (before / after)
    return kept


@dataclass(frozen=True)
class Dare(MergeMethod):
    """``merged = sum_t w_t (m_t * tau_t) / density_t`` with ``m_t ~ Bernoulli(density_t)`` and
    ``w_t = 1/T`` by default (the mean).

    density: keep probability in (0, 1], one for all or one per task, default 0.9 (the seed
    paper's DARE aggregator drops 10%); seed: the masks are a pure function of (seed, tensor
    name, task index), so a streamed merge and an in-memory merge draw the same masks.
    weights: ``w_t`` per task. rescale: "density" (``/ density``), "l1" (mergekit: keep each
    delta's L1 norm) or "none". consensus=True is DARE-TIES: TIES's sign election and weighted
    disjoint sum of the dropped ``w_t`` deltas, divided by the agreeing weights if normalize.
    """

    name = "dare"
    density: float | tuple[float, ...] = 0.9
    seed: int = 0
    weights: tuple[float, ...] | None = None
    rescale: str = "density"
    consensus: bool = False
    normalize: bool = False

    def __post_init__(self):
        for density in per_task_values(self.density):
            check_fraction(self.name, "density", density, low_open=True, high_open=False)
        if self.rescale not in RESCALE_CHOICES:
            raise ValueError(
                f"{self.name}: rescale must be one of {RESCALE_CHOICES}, not {self.rescale!r}"
            )

    def is_plain_mean(self) -> bool:
        """Whether this is the unweighted mean of ``drop(tau_t) / density`` (a sum method)."""
        return (
            self.weights is None
            and self.rescale == "density"
            and not self.consensus
            and len(per_task_values(self.density)) == 1
        )

    def drop(self, name: str, delta: torch.Tensor, task_index: int, tasks: int = 1):
        """The rescaled ``m_t * tau_t`` with the mask of (seed, ``name``, ``task_index``)."""
        generator = torch.Generator()
        generator.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()) + task_index)
        density = per_task(self.name, "density", self.density, task_index, tasks)
        return drop_and_rescale(delta, density, generator, self.rescale)

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        count = len(deltas)
        dropped = [self.drop(name, delta, index, count) for index, delta in enumerate(deltas)]
        weights = task_weights(self.name, self.weights, count)
        if self.consensus:
            flat = [delta.reshape(-1) for delta in dropped]
            uniform = weights or (1 / count,) * count
            return sign_consensus_merge(
                lambda part: (delta[part] for delta in flat), deltas[0], uniform, self.normalize
            )
        return weighted_sum(dropped, weights)
