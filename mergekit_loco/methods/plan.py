"""What a method's own distributed plan is handed and what it declares; no process here.

A method whose result is a function of one sum needs no plan (the sum contract of
:class:`~mergekit_loco.methods.base.MergeMethod` runs it everywhere). A method that needs more
(TIES: two sums; TSV, Iso-CTS: low-rank factors) returns :class:`Plan` objects from
``MergeMethod.plans()``. A plan runs on every rank with this rank's V worker deltas and a
:class:`Collectives` object (the transport); it must return the same tensors on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from mergekit_loco.task_vector import TaskVector

#: ``(name, shape, dtype)`` of each tensor of a worker delta, in the order every rank sees.
Layout = list[tuple[str, torch.Size, torch.dtype]]


class Widths(Protocol):
    """What travels costs: ``width(dtype)`` bytes per entry of a payload of that dtype (the codec
    applied); ``compression`` None, "bf16" or "int8"."""

    compression: str | None

    def width(self, dtype: torch.dtype) -> float:
        """Bytes per entry of a ``dtype`` payload as it travels."""
        ...


class Collectives(Widths, Protocol):
    """The transport a plan uses: every call is a collective (all ranks call it, same order).

    ``rank`` of ``world``; sums are always formed in full precision (compression applies to
    what travels).
    """

    rank: int
    world: int

    def owners(self, shapes: Sequence[Sequence[int]]) -> list[int]:
        """Owner rank of each tensor (by spectral cost; the same on every rank)."""
        ...

    def all_reduce(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``sum over ranks`` of each tensor, bit-identical on every rank."""
        ...

    def to_owners(
        self, parcels: Sequence[Sequence[torch.Tensor]], owners: Sequence[int]
    ) -> list[list[list[torch.Tensor]] | None]:
        """Parcel j goes to rank ``owners[j]``, which gets every rank's parcel j in rank order
        (its own included); None on other ranks. Parcel shapes are the same on every rank."""
        ...

    def reduce_to_owners(
        self, tensors: Sequence[torch.Tensor], owners: Sequence[int]
    ) -> list[torch.Tensor | None]:
        """``sum over ranks`` of tensor j on rank ``owners[j]`` only (a reduce-scatter)."""
        ...

    def from_owners(
        self,
        owned: Sequence[torch.Tensor | None],
        templates: Sequence[tuple[torch.Size, torch.dtype]],
        owners: Sequence[int],
    ) -> list[torch.Tensor]:
        """Every rank gets tensor j (``templates[j]``) from rank ``owners[j]`` (an all-gather);
        the owner keeps the copy that travelled, so all ranks hold the same bits."""
        ...

    def spectral(self) -> AbstractContextManager:
        """A timer for spectral work (SVD, polar, Newton-Schulz) in the call's stats."""
        ...


@dataclass(frozen=True)
class Plan:
    """A named way to run a method over ranks.

    run(comm, local, names): this rank's V deltas (workers ``comm.rank * V ..``) -> the merged
    tensors of ``names``, equal to ``merge_tensor`` on all R deltas in rank order.
    cost(layout, V, P, widths): bytes all P ranks send together in one call, by the model of
    docs/distributed.md (it must equal what ``run`` sends, uncompressed).
    """

    name: str
    run: Callable[[Collectives, Sequence[TaskVector], list[str]], list[torch.Tensor]]
    cost: Callable[[Layout, int, int, Widths], float]


def templates(local: Sequence[TaskVector], names) -> list[tuple[torch.Size, torch.dtype]]:
    """``(shape, dtype)`` of each named tensor: what ``from_owners`` delivers."""
    return [(local[0][name].shape, local[0][name].dtype) for name in names]


def stack_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_t x_t`` of this rank's terms (one tensor each)."""
    return torch.stack(list(tensors)).sum(dim=0)
