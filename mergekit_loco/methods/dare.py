"""DARE (Yu et al., 2024): drop and rescale, then average."""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass

import torch

from mergekit_loco.methods.base import MergeMethod, check_fraction


def drop_and_rescale(delta: torch.Tensor, density: float, generator: torch.Generator):
    """Keep each entry with probability ``density`` and divide the kept ones by ``density``."""
    keep = torch.rand(delta.shape, generator=generator, dtype=torch.float64) < density
    return delta * keep.to(delta.device) / density


@dataclass(frozen=True)
class Dare(MergeMethod):
    """``merged = (1/T) sum_t (m_t * tau_t) / density`` with ``m_t ~ Bernoulli(density)``.

    density: keep probability in (0, 1], default 0.9 (the seed paper's DARE aggregator drops
    10%); seed: the masks are a pure function of (seed, tensor name, task index), so a streamed
    merge and an in-memory merge draw the same masks.
    """

    name = "dare"
    density: float = 0.9
    seed: int = 0

    def __post_init__(self):
        check_fraction(self.name, "density", self.density, low_open=True, high_open=False)

    def drop(self, name: str, delta: torch.Tensor, task_index: int) -> torch.Tensor:
        """``m_t * tau_t / density`` with the mask of (seed, ``name``, ``task_index``)."""
        generator = torch.Generator()
        generator.manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()) + task_index)
        return drop_and_rescale(delta, self.density, generator)

    def local_term(self, name: str, delta: torch.Tensor, worker_index: int) -> torch.Tensor:
        return self.drop(name, delta, worker_index)

    def finish(self, name: str, total: torch.Tensor, workers: int) -> torch.Tensor:
        return total.div_(workers)

    def as_aggregator(self, round_index: int, workers: int) -> Dare:
        """Fresh masks every outer step: seed ``seed + round_index``."""
        return dataclasses.replace(self, seed=self.seed + round_index)
