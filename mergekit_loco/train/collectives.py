"""How each merge method runs over torch.distributed with the least communication its math allows.

Rank p of P holds workers ``[p V, (p+1) V)`` of ``R = P V``. :func:`merge_across_ranks` equals
``method.merge(all R deltas in rank order)`` to float tolerance, and every rank ends with
bit-identical tensors by construction: whatever is not the output of an all-reduce is computed
once, by the rank that owns the tensor, and copied to the others.

Plans (bytes per round of each: ``docs/distributed.md``):

- ``all-reduce``: methods that are a function of one sum, ``f(sum_t h_t(tau_t))``: mean, ta, dare,
  breadcrumbs (one all-reduce) and iso-c (reduce-scatter to the owner, isotropic step there,
  all-gather: the bytes of one all-reduce); TIES in two all-reduces (elect signs from the sum,
  then the agreeing sum and count).
- ``low-rank``: TSV-M and Iso-CTS send truncated SVD factors to the owner, not matrices.
- ``owner``: any method: each tensor's deltas go to its owner, which merges and shares.

``auto`` picks the plan that sends the fewest bytes (:func:`plan_bytes`). Tensors are dealt to
owner ranks by spectral cost ``m n min(m, n)`` (:func:`assign_owners`), which splits the SVD,
polar and Newton-Schulz work. Payloads travel in one flat buffer per dtype and collective.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mergekit_loco.methods import MergeMethod
from mergekit_loco.methods.base import in_svd_precision, is_matrix
from mergekit_loco.methods.breadcrumbs import Breadcrumbs, keep_magnitude_band
from mergekit_loco.methods.dare import Dare
from mergekit_loco.methods.iso import (
    IsoC,
    IsoCts,
    common_subspace,
    isotropic_from_factors,
    split_subspaces,
    task_specific_factors,
)
from mergekit_loco.methods.mean import Mean
from mergekit_loco.methods.ta import TaskArithmetic
from mergekit_loco.methods.ties import (
    Ties,
    agreeing_sum_and_count,
    divide_by_count,
    elect_sign,
    keep_top_magnitude,
)
from mergekit_loco.methods.tsv import Tsv, orthogonalised_sum, truncated_factors, tsv_rank
from mergekit_loco.task_vector import TaskVector

COMPRESSIONS = ("bf16", "int8")
#: int8 compression: one float32 absmax scale per row of this many entries of a tensor.
INT8_ROW = 256
#: set to 1 to check the worker layout before and the merged checksums after every call.
DEBUG_SYNC_ENV = "MLOCO_DEBUG_SYNC"

Layout = list[tuple[str, torch.Size, torch.dtype]]


# -- accounting ---------------------------------------------------------------------------------
@dataclass
class CommStats:
    """What one :func:`merge_across_ranks` call cost this rank.

    bytes_sent: bytes this rank sent, by the model of docs/distributed.md (ring all-reduce of
    B bytes: ``2 (P-1) B / P``; all-to-all: the bytes addressed to other ranks; all-gather of B
    bytes per rank: ``(P-1) B``). bytes_naive: what :func:`gather_then_merge` sends from this rank,
    ``(P-1) V N`` bytes. comm_seconds: wall time inside collectives (waiting for slower ranks
    included). spectral_seconds: wall time in SVD / polar / Newton-Schulz (the whole per-tensor
    merge under the ``owner`` plan). collectives: calls issued.
    """

    bytes_sent: int = 0
    bytes_naive: int = 0
    comm_seconds: float = 0.0
    spectral_seconds: float = 0.0
    plan: str = ""
    collectives: int = 0


_last_stats: CommStats | None = None


def last_comm_stats() -> CommStats | None:
    """The :class:`CommStats` of the latest merge on this process (None before the first)."""
    return _last_stats


# -- what travels -------------------------------------------------------------------------------
class Codec:
    """Payload encoding: the tensor itself, bf16, or int8 with one absmax scale per row of
    :data:`INT8_ROW` entries (``x ~ scale * q``, ``scale = max|x| / 127``, q in [-127, 127]).
    Non-floating tensors always travel as they are."""

    def __init__(self, compression: str | None, device: torch.device | str = "cpu"):
        if compression is not None and compression not in COMPRESSIONS:
            raise ValueError(
                f"compression must be None or one of {COMPRESSIONS}, not {compression!r}"
            )
        self.compression = compression
        self.device = torch.device(device)

    def _applies(self, dtype: torch.dtype) -> bool:
        if self.compression == "bf16":
            return dtype.is_floating_point and dtype.itemsize > 2
        return self.compression == "int8" and dtype.is_floating_point

    def payload_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if not self._applies(dtype):
            return dtype
        return torch.bfloat16 if self.compression == "bf16" else torch.uint8

    def packed_numel(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> int:
        """Entries of :meth:`pack`'s buffer for tensors of these shapes."""
        numels = [math.prod(shape) for shape in shapes]
        if self._applies(dtype) and self.compression == "int8":
            return sum(numels) + 4 * sum(-(-numel // INT8_ROW) for numel in numels)
        return sum(numels)

    def bytes_per_element(self, dtype: torch.dtype) -> float:
        """Payload bytes per entry (int8: exact up to each tensor's last row)."""
        if self._applies(dtype) and self.compression == "int8":
            return 1 + 4 / INT8_ROW
        return self.payload_dtype(dtype).itemsize

    def pack(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """One new flat buffer holding ``tensors`` (all of ``dtype``), encoded. int8 rows never
        span two tensors, so each tensor has its own scales: ``[q_1 .. q_k | scales_1 ..]``."""
        if not self._applies(dtype) or self.compression == "bf16":
            return _flatten(tensors, self.payload_dtype(dtype), self.device)
        encoded = [_int8_encode(tensor) for tensor in tensors]
        quantized = _flatten([q for q, _ in encoded], torch.int8, self.device)
        scales = _flatten([scale for _, scale in encoded], torch.float32, self.device)
        return torch.cat([quantized.view(torch.uint8), scales.view(torch.uint8)])

    def unpack(
        self, payload: torch.Tensor, shapes: Sequence[Sequence[int]], dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """The tensors of :meth:`pack`, decoded to ``dtype``."""
        if not self._applies(dtype):
            return _unflatten(payload, shapes)
        if self.compression == "bf16":
            return _unflatten(payload.to(dtype), shapes)
        numels = [math.prod(shape) for shape in shapes]
        quantized = payload[: sum(numels)].view(torch.int8).split(numels)
        scales = payload[sum(numels) :].clone().view(torch.float32)
        scales = scales.split([-(-numel // INT8_ROW) for numel in numels])
        return [
            _int8_decode(q, scale, shape, dtype)
            for q, scale, shape in zip(quantized, scales, shapes, strict=True)
        ]


def _int8_encode(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: rows of :data:`INT8_ROW` entries, ``scale = max|row| / 127`` (float32),
    ``q = round(x / scale)`` in [-127, 127]."""
    flat = tensor.reshape(-1)
    rows = torch.nn.functional.pad(flat, (0, -flat.numel() % INT8_ROW)).view(-1, INT8_ROW)
    tiny = torch.finfo(torch.float32).tiny
    scale = (rows.abs().amax(dim=1) / 127).to(torch.float32).clamp(min=tiny)
    quantized = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized.view(-1)[: flat.numel()], scale


def _int8_decode(quantized, scale, shape, dtype: torch.dtype) -> torch.Tensor:
    padding = -quantized.numel() % INT8_ROW
    rows = torch.nn.functional.pad(quantized.to(torch.float32), (0, padding)).view(-1, INT8_ROW)
    return (rows * scale[:, None]).view(-1)[: quantized.numel()].to(dtype).view(shape)


def _flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
    """One new flat buffer (never a view of an input)."""
    if not tensors:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([tensor.reshape(-1).to(dtype) for tensor in tensors])


def _unflatten(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    sizes = [math.prod(shape) for shape in shapes]
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes, strict=True)]


def _by_dtype(dtypes: Sequence[torch.dtype]) -> Iterator[tuple[torch.dtype, list[int]]]:
    """Indices grouped by dtype, groups in order of first appearance (the same on every rank)."""
    groups: dict[torch.dtype, list[int]] = {}
    for index, dtype in enumerate(dtypes):
        groups.setdefault(dtype, []).append(index)
    yield from groups.items()


# -- the collectives every plan is built from ---------------------------------------------------
class _Ranks:
    """This rank's view of the group: bucketed, encoded, accounted, timeout-wrapped collectives."""

    def __init__(self, group, compression: str | None, stats: CommStats, device="cpu"):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.codec = Codec(compression, device)
        self.stats = stats

    def _clock(self) -> float:
        """Wall time, after the device's queued work (CUDA collectives and kernels are async)."""
        if self.codec.device.type == "cuda":
            torch.cuda.synchronize(self.codec.device)
        return time.perf_counter()

    def run(self, op: str, bytes_sent: int, collective: Callable, *args, **kwargs) -> None:
        """Call ``collective(*args, **kwargs)``; a failure (a dead or hung peer, the process
        group's timeout) becomes a RuntimeError naming this rank, the step and the wait."""
        start = self._clock()
        try:
            collective(*args, **kwargs)
        except RuntimeError as error:
            waited = time.perf_counter() - start
            text = str(error).strip()
            cause = text.splitlines()[0] if text else type(error).__name__
            raise RuntimeError(
                f"rank {self.rank}: outer step collective {op} timed out or failed after "
                f"{waited:.1f}s — a peer rank likely died or hung (the timeout is the one given "
                f"to init_process_group); cause: {cause}"
            ) from error
        finally:
            self.stats.comm_seconds += self._clock() - start
        self.stats.bytes_sent += bytes_sent
        self.stats.collectives += 1

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
        all-reduce per dtype; compressed: reduce-scatter of P equal slices, then all-gather."""
        summed: list[torch.Tensor] = [None] * len(tensors)  # type: ignore[list-item]
        for dtype, indices in _by_dtype([tensor.dtype for tensor in tensors]):
            flat = _flatten([tensors[i] for i in indices], dtype, self.codec.device)
            if self.codec.payload_dtype(dtype) == dtype:
                nbytes = flat.numel() * flat.element_size()
                ring_bytes = 2 * (self.world - 1) * nbytes // self.world
                self.run("all_reduce", ring_bytes, dist.all_reduce, flat, group=self.group)
            else:
                slices = list(flat.tensor_split(self.world))
                owners = list(range(self.world))
                reduced = self.reduce_to_owners(slices, owners)
                flat = torch.cat(
                    self.from_owners(reduced, [(s.shape, dtype) for s in slices], owners)
                )
            for index, tensor in zip(
                indices, _unflatten(flat, [tensors[i].shape for i in indices]), strict=True
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
        for dtype, indices in _by_dtype([item.dtype for item in items]):
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
    ) -> list[torch.Tensor]:
        """Every rank gets tensor j (shape, dtype = ``templates[j]``) from rank ``owners[j]``,
        which passes it in ``owned[j]`` (an all-gather). The owner keeps the copy that travelled
        (encoded, decoded), so every rank holds the same bits."""
        shared: list[torch.Tensor] = [None] * len(templates)  # type: ignore[list-item]
        for dtype, indices in _by_dtype([dtype for _, dtype in templates]):
            per_rank = [[i for i in indices if owners[i] == q] for q in range(self.world)]
            shapes = [[templates[i][0] for i in group] for group in per_rank]
            payload = self.codec.pack([owned[i] for i in per_rank[self.rank]], dtype)
            empty = payload[:0]
            segments = [empty if q == self.rank else payload for q in range(self.world)]
            recv_numels = [
                0 if q == self.rank else self.codec.packed_numel(shapes[q], dtype)
                for q in range(self.world)
            ]
            pieces = self._all_to_all("from_owners", segments, recv_numels, payload.dtype)
            for q, piece in enumerate(pieces):
                unpacked = self.codec.unpack(payload if q == self.rank else piece, shapes[q], dtype)
                for i, tensor in zip(per_rank[q], unpacked, strict=True):
                    shared[i] = tensor
        return shared


# -- sharding -----------------------------------------------------------------------------------
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


# -- plans --------------------------------------------------------------------------------------
_SUM_METHODS = (Mean, TaskArithmetic, Dare, Breadcrumbs, IsoC)


def available_plans(method: MergeMethod) -> tuple[str, ...]:
    """The plans that compute ``method`` exactly (``owner`` computes any method)."""
    if (
        getattr(method, "weights", None) is not None
        or not getattr(method, "is_plain_mean", lambda: True)()
    ):
        return ("owner",)  # per-task weights, densities or DARE variants: merged on one rank
    if (
        type(method) in (*_SUM_METHODS, Ties)
        and getattr(method, "trim", "reference") == "reference"
        and getattr(method, "normalize", True)
    ):
        return ("all-reduce", "owner")
    if type(method) in (Tsv, IsoCts):
        return ("low-rank", "owner")
    return ("owner",)


def _count_dtype(workers: int) -> torch.dtype:
    return torch.uint8 if workers <= 255 else torch.int32


def _svd_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def plan_bytes(
    plan: str,
    method: MergeMethod,
    layout: Layout,
    workers_per_rank: int,
    world: int,
    compression: str | None = None,
) -> float:
    """Bytes all P ranks send together in one call (``gather``: :func:`gather_then_merge`).

    Per tensor of N entries, B bytes each (compressed: payload bytes; sums and factors of the
    spectral methods in float32 at least: B'), V = workers per rank, all times ``(P - 1)``:
    all-reduce ``2 N B`` (Iso-C matrices ``N (B' + B)``); TIES ``2 N (2 B + C)`` (C: count
    bytes); owner ``(V + 1) N B``; low-rank TSV ``V r (m + n + 1) B' + m n B``, Iso-CTS
    ``(m n + m k + V p (m + n + 1)) B' + m n B``, their non-matrices ``2 N B``; gather
    ``P V N B``.
    """
    codec = Codec(compression)
    workers = workers_per_rank * world
    total = 0.0
    for name, shape, dtype in layout:
        numel = math.prod(shape)
        width = codec.bytes_per_element(dtype)
        spectral = len(shape) == 2 and type(method) in (Tsv, IsoC, IsoCts)
        svd_width = codec.bytes_per_element(_svd_dtype(dtype))  # sums and factors: float32+
        if plan == "gather":
            total += world * workers_per_rank * numel * dtype.itemsize
        elif plan == "owner":
            total += (workers_per_rank + 1) * numel * width
        elif plan == "all-reduce" and type(method) is Ties:
            total += 2 * numel * (2 * width + _count_dtype(workers).itemsize)
        elif not spectral:
            total += 2 * numel * width
        elif type(method) is IsoC:
            total += numel * (svd_width + width)
        elif type(method) is Tsv:
            rows, cols = shape
            rank = tsv_rank(name, shape, workers)
            total += workers_per_rank * rank * (rows + cols + 1) * svd_width + numel * width
        else:
            rows, cols = shape
            common, per_task = split_subspaces(name, min(shape), workers, method.common_fraction)
            sent = numel + rows * common + workers_per_rank * per_task * (rows + cols + 1)
            total += sent * svd_width + numel * width
    return (world - 1) * total


def _local_term(method: MergeMethod, name: str, delta: torch.Tensor, worker: int) -> torch.Tensor:
    """``h_t(tau_t)`` of a method that is ``f(sum_t h_t(tau_t))``; ``worker`` = global index t."""
    if type(method) is Dare:
        return method.drop(name, delta, worker)
    if type(method) is Breadcrumbs:
        return keep_magnitude_band(delta, method.density, method.gamma)
    return delta


def _sum_plan(ranks: _Ranks, method, local: Sequence[TaskVector], names) -> list[torch.Tensor]:
    workers_per_rank = len(local)
    workers = workers_per_rank * ranks.world
    first = ranks.rank * workers_per_rank
    sums = []
    for name in names:
        terms = [_local_term(method, name, tv[name], first + v) for v, tv in enumerate(local)]
        if type(method) is IsoC and is_matrix(terms[0]):
            terms = in_svd_precision(terms)
        sums.append(torch.stack(terms).sum(dim=0))
    if type(method) is not IsoC:
        summed = ranks.all_reduce(sums)
        if type(method) is TaskArithmetic:
            return summed
        return [total / workers for total in summed]
    # Iso-C sees the deltas only through their sum: reduce-scatter, isotropic step on the owner,
    # all-gather (the bytes of one all-reduce, the SVDs split across ranks).
    owners = assign_owners([total.shape for total in sums], ranks.world)
    reduced = ranks.reduce_to_owners(sums, owners)
    merged = []
    for name, total in zip(names, reduced, strict=True):
        if total is None:
            merged.append(None)
        elif is_matrix(total):
            with ranks.spectral():
                merged.append(method.merge_tensor(name, [total]).to(local[0][name].dtype))
        else:
            merged.append(total / workers)
    return ranks.from_owners(merged, _templates(local, names), owners)


def _ties_plan(ranks: _Ranks, method: Ties, local, names) -> list[torch.Tensor]:
    """Round 1: all-reduce ``sum_t trim(tau_t)`` and elect signs from it; round 2: all-reduce the
    agreeing entries' sum and count; ``merged = sum / max(count, 1)``."""
    workers = len(local) * ranks.world
    trimmed = [
        torch.stack([keep_top_magnitude(tv[name], method.density) for tv in local])
        for name in names
    ]
    sums = ranks.all_reduce([block.sum(dim=0) for block in trimmed])
    partial = [
        agreeing_sum_and_count(block, elect_sign(total))
        for block, total in zip(trimmed, sums, strict=True)
    ]
    count_dtype = _count_dtype(workers)
    reduced = ranks.all_reduce(
        [total for total, _ in partial] + [count.to(count_dtype) for _, count in partial]
    )
    totals, counts = reduced[: len(names)], reduced[len(names) :]
    return [
        divide_by_count(total, count.long()) for total, count in zip(totals, counts, strict=True)
    ]


def _tsv_plan(ranks: _Ranks, method: Tsv, local, names) -> list[torch.Tensor]:
    """Each rank sends its workers' top-r factors ``(U_r, s_r, Vh_r)`` (r = int(d/R)) to the
    matrix's owner, which stacks all R and takes the polar factors; non-matrices: the mean."""
    workers_per_rank, world = len(local), ranks.world
    workers = workers_per_rank * world
    owners = assign_owners([local[0][name].shape for name in names], world)
    parcels = []
    for name in names:
        deltas = [tv[name] for tv in local]
        if not is_matrix(deltas[0]):
            parcels.append([torch.stack(deltas).sum(dim=0)])
            continue
        rank = tsv_rank(name, deltas[0].shape, workers)
        with ranks.spectral():
            factors = [truncated_factors(delta, rank) for delta in in_svd_precision(deltas)]
        parcels.append([tensor for triple in factors for tensor in triple])
    received = ranks.to_owners(parcels, owners)
    merged = []
    for name, copies in zip(names, received, strict=True):
        if copies is None:
            merged.append(None)
        elif not is_matrix(local[0][name]):
            merged.append(torch.stack([parcel[0] for parcel in copies]).sum(dim=0) / workers)
        else:
            factors = [
                tuple(parcel[3 * v : 3 * v + 3])
                for parcel in copies
                for v in range(workers_per_rank)
            ]
            with ranks.spectral():
                merged.append(orthogonalised_sum(factors).to(local[0][name].dtype))
    return ranks.from_owners(merged, _templates(local, names), owners)


def _iso_cts_plan(ranks: _Ranks, method: IsoCts, local, names) -> list[torch.Tensor]:
    """Reduce-scatter ``sum_t tau_t``; the owner takes its top-k SVD and shares ``U_k``; each rank
    sends its workers' top task-specific factors outside ``U_k`` to the owner, which
    orthogonalises ``[task blocks..., common block]``; non-matrices: the mean."""
    workers_per_rank, world = len(local), ranks.world
    workers = workers_per_rank * world
    owners = assign_owners([local[0][name].shape for name in names], world)
    matrices = [j for j, name in enumerate(names) if is_matrix(local[0][name])]
    subspaces = {
        j: split_subspaces(names[j], min(local[0][names[j]].shape), workers, method.common_fraction)
        for j in matrices
    }
    deltas = []
    for j, name in enumerate(names):
        own = [tv[name] for tv in local]
        deltas.append(in_svd_precision(own) if j in subspaces else own)
    sums = ranks.reduce_to_owners([torch.stack(own).sum(dim=0) for own in deltas], owners)
    merged: list[torch.Tensor | None] = [None] * len(names)
    shared = {}
    with ranks.spectral():
        for j, total in enumerate(sums):
            if total is not None and j in subspaces:
                shared[j] = common_subspace(total, subspaces[j][0])
            elif total is not None:
                merged[j] = total / workers
    common_left = ranks.from_owners(
        [shared[j][0] if j in shared else None for j in matrices],
        [((local[0][names[j]].shape[0], subspaces[j][0]), deltas[j][0].dtype) for j in matrices],
        [owners[j] for j in matrices],
    )
    if ranks.codec.compression is not None:
        # a decoded basis is not orthonormal: re-orthonormalise it (on every rank, owner
        # included), or common directions leak into the task-specific ones
        with ranks.spectral():
            common_left = [_orthonormal_columns(left) for left in common_left]
    common = dict(zip(matrices, common_left, strict=True))
    parcels = []
    with ranks.spectral():
        for j in matrices:
            factors = [
                task_specific_factors(delta, common[j], subspaces[j][1]) for delta in deltas[j]
            ]
            parcels.append([tensor for triple in factors for tensor in triple])
    received = ranks.to_owners(parcels, [owners[j] for j in matrices])
    for j, copies in zip(matrices, received, strict=True):
        if copies is None:
            continue
        specific = [
            tuple(parcel[3 * v : 3 * v + 3]) for parcel in copies for v in range(workers_per_rank)
        ]
        _, singular, right_h = shared[j]
        with ranks.spectral():
            blocks = [*specific, (common[j], singular, right_h)]
            orthogonal = isotropic_from_factors(blocks, method.spectral)
        merged[j] = orthogonal.to(local[0][names[j]].dtype)
    return ranks.from_owners(merged, _templates(local, names), owners)


def _orthonormal_columns(matrix: torch.Tensor) -> torch.Tensor:
    """Q of ``matrix = Q R`` with ``diag(R) >= 0``: the nearby orthonormal basis, same signs."""
    q, r = torch.linalg.qr(matrix)
    return q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(q.dtype)


def _owner_plan(ranks: _Ranks, method: MergeMethod, local, names) -> list[torch.Tensor]:
    """Any method: tensor j's V deltas from every rank go to its owner, which runs
    ``method.merge_tensor`` on all R in global order and shares the result."""
    owners = assign_owners([local[0][name].shape for name in names], ranks.world)
    received = ranks.to_owners([[tv[name] for tv in local] for name in names], owners)
    merged = []
    for name, copies in zip(names, received, strict=True):
        if copies is None:
            merged.append(None)
            continue
        with ranks.spectral():
            result = method.merge_tensor(name, [delta for parcel in copies for delta in parcel])
        merged.append(result.to(local[0][name].dtype))
    return ranks.from_owners(merged, _templates(local, names), owners)


def _templates(local: Sequence[TaskVector], names) -> list[tuple[torch.Size, torch.dtype]]:
    return [(local[0][name].shape, local[0][name].dtype) for name in names]


def _run_plan(plan: str, ranks: _Ranks, method, local, names) -> list[torch.Tensor]:
    if plan == "owner":
        return _owner_plan(ranks, method, local, names)
    if plan == "low-rank":
        plan_function = _tsv_plan if type(method) is Tsv else _iso_cts_plan
        return plan_function(ranks, method, local, names)
    if type(method) is Ties:
        return _ties_plan(ranks, method, local, names)
    return _sum_plan(ranks, method, local, names)


# -- entry points -------------------------------------------------------------------------------
def cheapest_plan(
    method: MergeMethod,
    layout: Layout,
    workers_per_rank: int,
    world: int,
    compression: str | None = None,
) -> str:
    """The plan of :func:`available_plans` that sends the fewest bytes by :func:`plan_bytes`.

    Compressed, the owner plan would perturb the deltas before a method's discrete steps
    (TIES's threshold, TSV's truncation), so then it is only the fallback.
    """
    plans = available_plans(method)
    costs = {p: plan_bytes(p, method, layout, workers_per_rank, world, compression) for p in plans}
    candidates = [p for p in plans if p != "owner" or compression is None] or ["owner"]
    return min(candidates, key=costs.__getitem__)


def modelled_comm_stats(
    method: MergeMethod, layout: Layout, workers: int, compression: str | None = None
) -> CommStats:
    """Per-worker bytes if each of ``workers`` simulated workers were its own rank (P = R,
    V = 1): what a single-process run reports, so its metrics compare with a torchrun run's."""
    if workers == 1:
        return CommStats(plan="local")
    plan = cheapest_plan(method, layout, 1, workers, compression)
    sent = plan_bytes(plan, method, layout, 1, workers, compression)
    naive = plan_bytes("gather", method, layout, 1, workers)
    return CommStats(bytes_sent=int(sent) // workers, bytes_naive=int(naive) // workers, plan=plan)


def merge_across_ranks(
    method: MergeMethod,
    local_deltas: Sequence[TaskVector],
    group=None,
    *,
    compression: str | None = None,
    plan: str = "auto",
) -> TaskVector:
    """Merge every rank's worker deltas; equals ``method.merge`` of the R deltas in rank order.

    Every rank passes the same number V of deltas with the same names, shapes and dtypes.
    compression: None (exact), ``"bf16"`` or ``"int8"`` (per-row scales) for what travels.
    plan: ``"auto"`` (fewest bytes by :func:`plan_bytes`; compressed, not ``owner`` where
    another plan exists) or one of :func:`available_plans`.
    The call's :class:`CommStats` are then :func:`last_comm_stats`. With
    ``MLOCO_DEBUG_SYNC=1`` the layouts are compared first and the results' checksums after.
    """
    global _last_stats
    if not local_deltas:
        raise ValueError(f"{method.name}: no worker deltas on this rank")
    codec = Codec(compression)
    plans = available_plans(method)
    if plan != "auto" and plan not in plans:
        raise ValueError(f"{method.name}: plan must be 'auto' or one of {plans}, not {plan!r}")
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        merged = method.merge(local_deltas)
        _last_stats = CommStats(plan="local")
        return merged
    names = list(local_deltas[0])
    for index, other in enumerate(local_deltas[1:], start=2):
        if set(other) != set(names):
            raise KeyError(f"{method.name}: local worker delta {index} holds other tensor names")
    layout = [(name, local_deltas[0][name].shape, local_deltas[0][name].dtype) for name in names]
    workers_per_rank = len(local_deltas)
    # every rank prices every plan, so bad shapes (tsv_rank, split_subspaces) raise everywhere
    if plan == "auto":
        plan = cheapest_plan(method, layout, workers_per_rank, world, compression)
    else:
        plan_bytes(plan, method, layout, workers_per_rank, world, compression)
    naive = plan_bytes("gather", method, layout, workers_per_rank, world)
    stats = CommStats(bytes_naive=int(naive) // world, plan=plan)
    device = local_deltas[0][names[0]].device if names else "cpu"
    ranks = _Ranks(group, codec.compression, stats, device)
    debug = os.environ.get(DEBUG_SYNC_ENV, "0") not in ("", "0")
    if debug:
        _check_same_layout(ranks, layout, workers_per_rank)
    merged = TaskVector(
        dict(zip(names, _run_plan(plan, ranks, method, local_deltas, names), strict=True))
    )
    if debug:
        verify_identical(merged, group)
    _last_stats = stats
    return merged


def gather_then_merge(
    method: MergeMethod, local_deltas: Sequence[TaskVector], group=None
) -> TaskVector:
    """The naive reference (the seed paper's code): all-gather every worker's full delta, one
    tensor at a time, and merge everything on every rank. Records :func:`last_comm_stats`."""
    global _last_stats
    stats = CommStats(plan="gather")
    device = next(iter(local_deltas[0].values())).device if local_deltas[0] else "cpu"
    ranks = _Ranks(group, None, stats, device)
    merged = {}
    for name in local_deltas[0]:
        local = torch.stack([delta[name] for delta in local_deltas])
        gathered = torch.empty(ranks.world * local.numel(), dtype=local.dtype, device=local.device)
        bytes_sent = (ranks.world - 1) * local.numel() * local.element_size()
        flat = local.reshape(-1)
        ranks.run("all_gather", bytes_sent, dist.all_gather_single, gathered, flat, group=group)
        with ranks.spectral():
            all_deltas = list(gathered.view(-1, *local.shape[1:]))
            merged[name] = method.merge_tensor(name, all_deltas)
    stats.bytes_naive = stats.bytes_sent
    _last_stats = stats
    return TaskVector(merged)


# -- debug checks -------------------------------------------------------------------------------
def _checksum(tensor: torch.Tensor) -> str:
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    digest = hashlib.blake2b(raw.tobytes(), digest_size=8).hexdigest()
    return f"{tuple(tensor.shape)}:{tensor.dtype}:{digest}"


def _all_gather_objects(ranks: _Ranks, value) -> list:
    everyone = [None] * ranks.world
    ranks.run("all_gather_object", 0, dist.all_gather_object, everyone, value, group=ranks.group)
    return everyone


def verify_identical(tensors: Mapping[str, torch.Tensor], group=None) -> None:
    """Raise RuntimeError unless every rank holds bit-identical ``tensors`` (same names, shapes,
    dtypes and bytes), by all-gathering one checksum per tensor."""
    ranks = _Ranks(group, None, CommStats())
    mine = [(name, _checksum(tensor)) for name, tensor in tensors.items()]
    for other_rank, theirs in enumerate(_all_gather_objects(ranks, mine)):
        if theirs == mine:
            continue
        differing = [a[0] for a, b in zip(mine, theirs, strict=False) if a != b] or [
            "the tensor names"
        ]
        raise RuntimeError(
            f"rank {ranks.rank}: {differing[0]!r} differs from rank {other_rank}'s (checksum "
            "mismatch); the ranks' parameters have diverged"
        )


def _check_same_layout(ranks: _Ranks, layout: Layout, workers_per_rank: int) -> None:
    described = (
        workers_per_rank,
        [(name, tuple(shape), str(dtype)) for name, shape, dtype in layout],
    )
    for other_rank, theirs in enumerate(_all_gather_objects(ranks, described)):
        if theirs != described:
            raise ValueError(
                f"rank {ranks.rank}: rank {other_rank} holds other worker deltas (count, names, "
                f"shapes or dtypes): {theirs[0]} workers vs {workers_per_rank} here"
            )
