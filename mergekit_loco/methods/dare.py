"""DARE (Yu et al., 2024): drop and rescale, then average (or elect signs, as DARE-TIES)."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.io.files import brief
from mergekit_loco.methods.base import (
    MergeMethod,
    check_fraction,
    per_task,
    per_task_values,
    task_weights,
)
from mergekit_loco.methods.ties import check_zero_sign, sign_consensus_merge

RESCALE_CHOICES = ("density", "l1", "none")
#: mergekit leaves a dropped tensor unscaled when either L1 norm is below this.
L1_EPSILON = 1e-7


def dropped(delta: torch.Tensor, density: float, generator: torch.Generator) -> torch.Tensor:
    """``m * delta``: each entry kept with probability ``density`` (``m`` drawn in float64)."""
    keep = torch.rand(delta.shape, generator=generator, dtype=torch.float64) < density
    return delta * keep.to(delta.device)


def rescale_factor(delta: torch.Tensor, kept: torch.Tensor, density: float, rescale: str) -> float:
    """What the kept entries are multiplied by: ``1/density`` (the DARE paper),
    ``||delta||_1 / ||kept||_1`` (mergekit's ``rescale: true``; 1 when either norm is below
    1e-7; the norms are summed in float32 at least) or 1 (``"none"``)."""
    if rescale == "density":
        return 1 / density
    if rescale == "l1":
        dtype = torch.promote_types(delta.dtype, torch.float32)
        before, after = float(delta.abs().sum(dtype=dtype)), float(kept.abs().sum(dtype=dtype))
        if before >= L1_EPSILON and after >= L1_EPSILON:
            return before / after
    return 1.0


def drop_and_rescale(
    delta: torch.Tensor, density: float, generator: torch.Generator, rescale: str = "density"
) -> torch.Tensor:
    """:func:`dropped`, times :func:`rescale_factor` (divided by ``density``, as DARE's code)."""
    kept = dropped(delta, density, generator)
    if rescale == "density":
        return kept / density
    return kept * rescale_factor(delta, kept, density, rescale)


@dataclass(frozen=True)
class Dare(MergeMethod):
    """``merged = sum_t w_t (m_t * tau_t) / density_t`` with ``m_t ~ Bernoulli(density_t)`` and
    ``w_t = 1/T`` by default (the mean).

    density: keep probability in (0, 1], one for all or one per task, default 0.9 (the seed
    paper's DARE aggregator drops 10%); seed: the masks are a pure function of (seed, tensor
    name, task index), so a streamed merge and an in-memory merge draw the same masks.
    weights: ``w_t`` per task, taken as given (unnormalised: for two tasks ``(1, 1)`` doubles
    the default's step; weights summing to 1 give a weighted mean). rescale: "density"
    (``/ density``), "l1" (mergekit: keep each delta's L1 norm) or "none". consensus=True is
    DARE-TIES: TIES's sign election (zeros by ``zero_sign``, as in
    :class:`~mergekit_loco.methods.ties.Ties`) and weighted disjoint sum of the dropped ``w_t``
    deltas, divided by the agreeing weights if normalize.
    """

    name = "dare"
    density: float | tuple[float, ...] = 0.9
    seed: int = 0
    weights: tuple[float, ...] | None = None
    rescale: str = "density"
    consensus: bool = False
    normalize: bool = False
    zero_sign: str = "majority"

    def __post_init__(self):
        for density in per_task_values(self.density):
            check_fraction(self.name, "density", density, low_open=True, high_open=False)
        if self.rescale not in RESCALE_CHOICES:
            raise ValueError(
                f"{self.name}: rescale must be one of {RESCALE_CHOICES}, not {self.rescale!r}"
            )
        if not 0 <= self.seed < 2**63:
            raise ValueError(
                f"{self.name}: seed must be an integer in [0, 2**63), not {brief(self.seed)}"
            )
        check_zero_sign(self.name, self.zero_sign)
        for option, default in (("normalize", False), ("zero_sign", "majority")):
            if getattr(self, option) != default and not self.consensus:
                raise ValueError(
                    f"{self.name}: {option} belongs to DARE-TIES's sign election and needs "
                    "consensus=True (plain DARE takes its weights as given)"
                )

    def mask_generator(self, name: str, task_index: int) -> torch.Generator:
        """The generator of task ``task_index``'s mask of tensor ``name``, seeded with
        ``seed * 1000003 + crc32(name) + task_index`` modulo 2**64."""
        key = self.seed * 1_000_003 + zlib.crc32(name.encode()) + task_index
        return torch.Generator().manual_seed(key % 2**64)

    def drop(self, name: str, delta: torch.Tensor, task_index: int) -> torch.Tensor:
        """The rescaled ``m_t * tau_t`` with the mask of (seed, ``name``, ``task_index``)."""
        density = per_task(self.name, "density", self.density, task_index)
        generator = self.mask_generator(name, task_index)
        return drop_and_rescale(delta, density, generator, self.rescale)

    def kept_and_factor(
        self, name: str, delta: torch.Tensor, task_index: int
    ) -> tuple[torch.Tensor, float]:
        """``(m_t * tau_t, its rescale factor)``: :meth:`drop` before the rescale."""
        density = per_task(self.name, "density", self.density, task_index)
        kept = dropped(delta, density, self.mask_generator(name, task_index))
        return kept, rescale_factor(delta, kept, density, self.rescale)

    def is_sum(self) -> bool:
        """DARE-TIES (``consensus``) elects signs: not one sum."""
        return not self.consensus

    def local_term(self, name: str, delta: torch.Tensor, worker_index: int) -> torch.Tensor:
        dropped = self.drop(name, delta, worker_index)
        return self.weighted(dropped, worker_index, owned=True)

    def finish(self, name: str, total: torch.Tensor, workers: int) -> torch.Tensor:
        if task_weights(self.name, self.weights, workers) is None:
            return total.div_(workers)
        return total

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        if not self.consensus:
            return super().merge_tensor(name, deltas)
        count = len(deltas)
        weights = task_weights(self.name, self.weights, count) or (1 / count,) * count
        kept, factors = zip(
            *(self.kept_and_factor(name, delta, index) for index, delta in enumerate(deltas)),
            strict=True,
        )
        flat = [delta.reshape(-1) for delta in kept]
        return sign_consensus_merge(
            lambda part: (delta[part] for delta in flat),
            deltas[0], weights, self.normalize, self.zero_sign, factors,
        )  # fmt: skip

    def as_aggregator(self, round_index: int, workers: int) -> Dare:
        """Fresh masks every outer step: seed ``(seed + round_index) mod 2**63``."""
        return dataclasses.replace(self, seed=(self.seed + round_index) % 2**63)
