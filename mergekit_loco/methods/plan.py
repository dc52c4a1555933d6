"""What a method's own distributed plan is handed and what it declares; no process here.

A method whose result is a function of one sum needs no plan (the sum contract of
:class:`~mergekit_loco.methods.base.MergeMethod` runs it everywhere). A method that needs more
(TIES: two sums; TSV, Iso-CTS: low-rank factors) returns :class:`Plan` objects from
``MergeMethod.plans()``. A plan runs on every rank with this rank's V worker deltas and a
:class:`Collectives` object (the transport); it must return the same tensors on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from mergekit_loco.task_vector import TaskVector

#: ``(name, shape, dtype)`` of each tensor of a worker delta, in the order every rank sees.
Layout = list[tuple[str, torch.Size, torch.dtype]]


class Pricing(Protocol):
    """What a plan's cost model may ask: ``width(dtype)`` bytes per entry of a payload of that
    dtype (the codec applied), ``compression`` (None, "bf16" or "int8"), and ``owners``."""

    compression: str | None

    def width(self, dtype: torch.dtype) -> float:
        """Bytes per entry of a ``dtype`` payload as it travels."""
        ...

    def owners(self, shapes: Sequence[Sequence[int]]) -> list[int]:
        """Owner rank of each tensor (by spectral cost; the same on every rank)."""
        ...


class Collectives(Pricing, Protocol):
    """The transport a plan uses: every call is a collective (all ranks call it, same order).

    ``rank`` of ``world``; sums are always formed in full precision (compression applies to
    what travels).
    """

    rank: int
    world: int

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
        balance: bool = False,
    ) -> list[torch.Tensor]:
        """Every rank gets tensor j (``templates[j]``) from rank ``owners[j]`` (an all-gather);
        the owner keeps the copy that travelled, so all ranks hold the same bits. ``balance``:
        relay the payloads (:func:`relayed`) when that lowers the most any rank sends."""
        ...

    def spectral(self) -> AbstractContextManager:
        """A timer for spectral work (SVD, polar, Newton-Schulz) in the call's stats."""
        ...


@dataclass(frozen=True)
class Plan:
    """A named way to run a method over ranks.

    run(comm, local, names): this rank's V deltas (workers ``comm.rank * V ..``) -> the merged
    tensors of ``names``, equal to ``merge_tensor`` on all R deltas in rank order.
    cost(layout, V, P, pricing): bytes all P ranks send together in one call, by the model of
    docs/distributed.md (it must equal what ``run`` sends, uncompressed).
    """

    name: str
    run: Callable[[Collectives, Sequence[TaskVector], list[str]], list[torch.Tensor]]
    cost: Callable[[Layout, int, int, Pricing], float]


def templates(local: Sequence[TaskVector], names) -> list[tuple[torch.Size, torch.dtype]]:
    """``(shape, dtype)`` of each named tensor: what ``from_owners`` delivers."""
    return [(local[0][name].shape, local[0][name].dtype) for name in names]


def stack_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_t x_t`` of this rank's terms (one tensor each)."""
    return torch.stack(list(tensors)).sum(dim=0)


def piece(length: int, index: int, world: int) -> int:
    """Entries of piece ``index`` when ``length`` entries are split in ``world`` near-equal
    pieces (``torch.tensor_split``: the first ``length % world`` pieces one larger)."""
    return length // world + (1 if index < length % world else 0)


def relayed(lengths: Sequence[int], world: int) -> bool:
    """Whether payloads of ``lengths[q]`` entries, owned by rank q and wanted by every rank,
    travel by relay: owner q sends piece i of its payload to rank i, then every rank sends the
    pieces it holds to all others. Direct, rank q sends ``(P-1) L_q``; relayed,
    ``L_q - piece_q(L_q) + (P-1) sum_o piece_q(L_o)``: relay when that lowers the largest."""
    direct = (world - 1) * max(lengths)
    relay = max(
        length - piece(length, q, world) + (world - 1) * sum(piece(n, q, world) for n in lengths)
        for q, length in enumerate(lengths)
    )
    return relay < direct


def delivery_bytes(
    items: Sequence[tuple[Sequence[int], torch.dtype]],
    owners: Sequence[int],
    world: int,
    pricing: Pricing,
    balance: bool = False,
) -> float:
    """Bytes all ranks send together for ``from_owners`` of ``items`` ((shape, dtype) each, item
    j owned by ``owners[j]``): ``(P-1) sum L_o`` per dtype, plus, relayed, the pieces the owners
    hand out, ``sum_o (L_o - piece_o(L_o))``."""
    total = 0.0
    for dtype in dict.fromkeys(dtype for _, dtype in items):
        lengths = [0] * world
        for (shape, item_dtype), owner in zip(items, owners, strict=True):
            if item_dtype == dtype:
                lengths[owner] += math.prod(shape)
        entries = (world - 1) * sum(lengths)
        if balance and relayed(lengths, world):
            entries += sum(length - piece(length, q, world) for q, length in enumerate(lengths))
        total += entries * pricing.width(dtype)
    return total
