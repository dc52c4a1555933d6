"""Transport: bucketed, encoded, accounted collectives with a timeout guard, and owner ranks.

Nothing here knows a merge method. A :class:`Transport` is what a method's distributed plan is
handed (see :class:`mergekit_loco.methods.plan.Collectives`): ``all_reduce``, ``to_owners``,
``reduce_to_owners``, ``from_owners``, ``owners`` and a ``spectral()`` timer. Every collective
goes through :func:`guarded`, and its bytes are added to the call's :class:`CommStats`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mergekit_loco.dist.codec import Codec, by_dtype, flatten, unflatten
from mergekit_loco.methods.plan import piece, relayed


@dataclass
class CommStats:
    """What one :func:`merge_across_ranks` call cost this rank.

    bytes_sent: bytes this rank sent, by the model of docs/distributed.md (ring all-reduce of
    B bytes: ``2 (P-1) B / P``; all-to-all: the bytes addressed to other ranks; all-gather of B
    bytes per rank: ``(P-1) B``). bytes_naive: what :func:`gather_then_merge` sends from this rank,
    ``(P-1) V N`` bytes. comm_seconds: wall time inside collectives (waiting for slower ranks
    included). spectral_seconds: wall time in SVD / polar / Newton-Schulz (the whole per-tensor
    merge under the ``owner`` plan). collectives: calls issued. Control messages (layout
    checks, :func:`merge_across_ranks`' non-finite flags: 4 bytes a tensor) count in
    ``collectives`` and ``comm_seconds``, not in ``bytes_sent``.
    """

    bytes_sent: int = 0
    bytes_naive: int = 0
    comm_seconds: float = 0.0
    spectral_seconds: float = 0.0
    plan: str = ""
    collectives: int = 0


#: Seconds this process gave ``init_process_group`` when mloco created the group (``mloco train``
#: under torchrun, :func:`note_group_timeout`); the outer step's collectives name it when they
#: fail. None: a group the caller created, whose timeout torch does not expose.
group_timeout_s: float | None = None


def note_group_timeout(seconds: float | None) -> None:
    """Record the timeout of the process group this process created (None once destroyed)."""
    global group_timeout_s
    group_timeout_s = seconds


class Transport:
    """This rank's view of ``group``: bucketed, encoded, accounted, guarded collectives."""

    def __init__(self, group, compression: str | None, stats: CommStats, device="cpu"):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.codec = Codec(compression, device)
        self.compression = self.codec.compression
        self.stats = stats

    def _clock(self) -> float:
        """Wall time, after the device's queued work (CUDA collectives and kernels are async)."""
        if self.codec.device.type == "cuda":
            torch.cuda.synchronize(self.codec.device)
        return time.perf_counter()

    def run(self, op: str, bytes_sent: int, collective: Callable, *args, **kwargs) -> None:
        """:func:`guarded` ``collective(*args, **kwargs)``, timed and counted in the stats."""
        start = self._clock()
        try:
            guarded(f"rank {self.rank}", f"outer step collective {op}", collective, *args,
                    timeout_s=group_timeout_s, **kwargs)  # fmt: skip
        finally:
            self.stats.comm_seconds += self._clock() - start
        self.stats.bytes_sent += bytes_sent
        self.stats.collectives += 1

    def width(self, dtype: torch.dtype) -> float:
        """Bytes per entry of a ``dtype`` payload as it travels (the codec applied)."""
        return self.codec.width(dtype)

    def owners(self, shapes: Sequence[Sequence[int]]) -> list[int]:
        """The owner rank of each tensor of these shapes (:func:`assign_owners`)."""
        return assign_owners(shapes, self.world)

    def all_gather_objects(self, value) -> list:
        """Every rank's ``value`` (pickled; not counted in ``bytes_sent``)."""
        everyone = [None] * self.world
        self.run("all_gather_object", 0, dist.all_gather_object, everyone, value, group=self.group)
        return everyone

    @contextmanager
    def spectral(self):
        start = self._clock()
        try:
            yield
        finally:
            self.stats.spectral_seconds += self._clock() - start

    def _all_to_all(self, op, segments, recv_numels, dtype) -> list[torch.Tensor]:
        """Segment q goes to rank q (this rank's own segment is empty)."""
        send = torch.cat(segments)
        received = torch.empty(sum(recv_numels), dtype=dtype, device=send.device)
        send_numels = [segment.numel() for segment in segments]
        bytes_sent = send.numel() * send.element_size()
        all_to_all = dist.all_to_all_single
        self.run(op, bytes_sent, all_to_all, received, send, recv_numels, send_numels, self.group)
        return list(received.split(recv_numels))

    def all_reduce(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``sum over ranks`` of each tensor, bit-identical on every rank. Uncompressed: one ring
        all-reduce per dtype; compressed: each tensor cut in P equal pieces, piece q summed on
        rank q (a reduce-scatter), then all-gathered; the codec encodes every piece on its own,
        so no int8 row spans two tensors (a small tensor never takes a large one's scale)."""
        summed: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
        for dtype, indices in by_dtype([tensor.dtype for tensor in tensors]):
            flat = flatten([tensors[i] for i in indices], dtype, self.codec.device)
            if self.codec.payload_dtype(dtype) == dtype:
                nbytes = flat.numel() * flat.element_size()
                ring_bytes = 2 * (self.world - 1) * nbytes // self.world
                self.run("all_reduce", ring_bytes, dist.all_reduce, flat, group=self.group)
            else:
                numels = [tensors[i].numel() for i in indices]
                pieces = [p for t in flat.split(numels) for p in t.tensor_split(self.world)]
                owners = list(range(self.world)) * len(indices)
                reduced = self.reduce_to_owners(pieces, owners)
                flat = torch.cat(
                    self.from_owners(reduced, [(p.shape, dtype) for p in pieces], owners)
                )
            for index, tensor in zip(
                indices, unflatten(flat, [tensors[i].shape for i in indices]), strict=True
            ):
                summed[index] = tensor
        return summed

    def to_owners(
        self, parcels: Sequence[Sequence[torch.Tensor]], owners: Sequence[int]
    ) -> list[list[list[torch.Tensor]] | None]:
        """Parcel j (some tensors) goes to rank ``owners[j]``, which gets every rank's parcel j in
        rank order; None elsewhere. Parcels have the same shapes on every rank."""
        items = [tensor for parcel in parcels for tensor in parcel]
        item_owners = [owner for parcel, owner in zip(parcels, owners, strict=True) for _ in parcel]
        copies: list[list[torch.Tensor] | None] = [None] * len(items)
        for dtype, indices in by_dtype([item.dtype for item in items]):
            per_rank = [[i for i in indices if item_owners[i] == q] for q in range(self.world)]
            mine = per_rank[self.rank]
            mine_shapes = [items[i].shape for i in mine]
            segments = [
                self.codec.pack([items[i] for i in per_rank[q] if q != self.rank], dtype)
                for q in range(self.world)
            ]
            recv_numel = self.codec.packed_numel(mine_shapes, dtype)
            recv_numels = [0 if q == self.rank else recv_numel for q in range(self.world)]
            pieces = self._all_to_all("to_owners", segments, recv_numels, segments[self.rank].dtype)
            for i in mine:
                copies[i] = []
            for q, piece in enumerate(pieces):
                if q == self.rank:
                    unpacked = [items[i] for i in mine]
                else:
                    unpacked = self.codec.unpack(piece, mine_shapes, dtype)
                for i, tensor in zip(mine, unpacked, strict=True):
                    copies[i].append(tensor)
        received: list[list[list[torch.Tensor]] | None] = []
        start = 0
        for parcel, owner in zip(parcels, owners, strict=True):
            stop = start + len(parcel)
            if owner == self.rank:
                received.append(
                    [[copies[i][q] for i in range(start, stop)] for q in range(self.world)]
                )
            else:
                received.append(None)
            start = stop
        return received

    def reduce_to_owners(self, tensors, owners) -> list[torch.Tensor | None]:
        """``sum over ranks`` of tensor j, on rank ``owners[j]`` only (a reduce-scatter)."""
        received = self.to_owners([[tensor] for tensor in tensors], owners)
        return [
            None if copies is None else torch.stack([parcel[0] for parcel in copies]).sum(dim=0)
            for copies in received
        ]

    def from_owners(
        self,
        owned: Sequence[torch.Tensor | None],
        templates: Sequence[tuple[torch.Size, torch.dtype]],
        owners: Sequence[int],
        balance: bool = False,
    ) -> list[torch.Tensor]:
        """Every rank gets tensor j (shape, dtype = ``templates[j]``) from rank ``owners[j]``,
        which passes it in ``owned[j]`` (an all-gather). The owner keeps the copy that travelled
        (encoded, decoded), so every rank holds the same bits. ``balance``: relay the payloads
        (:func:`~mergekit_loco.methods.plan.relayed`) when that lowers the most a rank sends."""
        shared: list[torch.Tensor] = [None] * len(templates)  # type: ignore[list-item]
        for dtype, indices in by_dtype([dtype for _, dtype in templates]):
            per_rank = [[i for i in indices if owners[i] == q] for q in range(self.world)]
            shapes = [[templates[i][0] for i in group] for group in per_rank]
            payload = self.codec.pack([owned[i] for i in per_rank[self.rank]], dtype)
            lengths = [self.codec.packed_numel(shapes[q], dtype) for q in range(self.world)]
            if balance and relayed(lengths, self.world):
                payloads = self._relay(payload, lengths)
            else:
                payloads = self._direct(payload, lengths)
            for q, shape_group in enumerate(shapes):
                unpacked = self.codec.unpack(payloads[q], shape_group, dtype)
                for i, tensor in zip(per_rank[q], unpacked, strict=True):
                    shared[i] = tensor
        return shared

    def _direct(self, payload: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Owner q's payload (``lengths[q]`` entries) from q to every rank."""
        segments = [payload[:0] if q == self.rank else payload for q in range(self.world)]
        recv = [0 if q == self.rank else lengths[q] for q in range(self.world)]
        received = self._all_to_all("from_owners", segments, recv, payload.dtype)
        return [payload if q == self.rank else received[q] for q in range(self.world)]

    def _relay(self, payload: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
        """The same by relay: piece i of each owner's payload to rank i, then every rank's
        pieces to all the others (per rank about ``(P-1)/P`` of all payloads, not ``(P-1)``
        times its own)."""
        world, rank = self.world, self.rank
        pieces = list(payload.tensor_split(world))
        segments = [payload[:0] if q == rank else pieces[q] for q in range(world)]
        recv = [0 if q == rank else piece(lengths[q], rank, world) for q in range(world)]
        received = self._all_to_all("from_owners", segments, recv, payload.dtype)
        held = [pieces[rank] if q == rank else received[q] for q in range(world)]
        bundle = torch.cat(held)
        recv = [0 if q == rank else sum(piece(n, q, world) for n in lengths) for q in range(world)]
        segments = [bundle[:0] if q == rank else bundle for q in range(world)]
        bundles = self._all_to_all("from_owners", segments, recv, payload.dtype)
        by_holder = [
            held if q == rank else list(bundles[q].split([piece(n, q, world) for n in lengths]))
            for q in range(world)
        ]
        return [torch.cat([by_holder[q][o] for q in range(world)]) for o in range(world)]


def spectral_cost(shape: Sequence[int]) -> int:
    """Work of one tensor's merge: ``m n min(m, n)`` for a matrix (an SVD), else its size."""
    if len(shape) == 2:
        return shape[0] * shape[1] * min(shape)
    return math.prod(shape)


def assign_owners(shapes: Sequence[Sequence[int]], world: int) -> list[int]:
    """Owner rank of each tensor: largest :func:`spectral_cost` first, each to the least loaded
    rank (lowest rank on ties). A pure function of the shapes: every rank agrees."""
    loads = [0] * world
    owners = [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: -spectral_cost(shapes[i])):
        owner = min(range(world), key=lambda q: (loads[q], q))
        owners[index] = owner
        loads[owner] += spectral_cost(shapes[index])
    return owners


class CollectiveFailed(RuntimeError):
    """A collective failed or timed out: a peer process died, hung or is unreachable. The
    message names this process, the collective and how long it waited."""


def guarded(
    who: str, op: str, collective: Callable, *args, timeout_s: float | None = None, **kwargs
):
    """``collective(*args, **kwargs)``; a failure (a dead or hung peer, the process group's
    timeout) becomes :class:`CollectiveFailed` naming ``who`` (this process), ``op`` and the
    wait. The one wrapper every collective of the package goes through."""
    start = time.perf_counter()
    try:
        return collective(*args, **kwargs)
    except RuntimeError as error:
        waited = time.perf_counter() - start
        text = str(error).strip()
        cause = text.splitlines()[0] if text else type(error).__name__
        limit = (
            f"{timeout_s:g} s" if timeout_s is not None else "the one given to init_process_group"
        )
        raise CollectiveFailed(
            f"{who}: {op} failed after {waited:.1f} s; a peer rank likely died or hung, or is "
            f"unreachable (collective timeout: {limit}). Cause: {cause}"
        ) from error
