"""Merge every rank's worker deltas with any method: the generic plans and the entry points.

Rank p of P holds workers ``[p V, (p+1) V)`` of ``R = P V``. :func:`merge_across_ranks` equals
``method.merge(all R deltas in rank order)`` to float tolerance, and every rank ends with
bit-identical tensors by construction: whatever is not the output of an all-reduce is computed
once, by the rank that owns the tensor, and copied to the others.

Plans (bytes: ``docs/distributed.md``); the method decides which exist, this module only runs
them:

- ``all-reduce``: any method of the sum contract (``local_term`` + ``finish``): local sums of
  the terms, one all-reduce, ``finish`` everywhere; a method whose ``finish`` is spectral
  (``finish_on_owner``: Iso-C) reduce-scatters to the owner, finishes there and all-gathers
  (the bytes of one all-reduce, the SVDs split across ranks).
- the method's own ``plans()`` (TIES: two sums; TSV, Iso-CTS: low-rank factors).
- ``owner``: any method: each tensor's deltas go to its owner, which merges and shares.

``auto`` picks the plan that sends the fewest bytes by the plans' cost models.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from mergekit_loco.dist.checks import check_finite_deltas, check_same_layout, verify_identical
from mergekit_loco.dist.codec import Codec
from mergekit_loco.dist.transport import CommStats, Transport, assign_owners
from mergekit_loco.methods import MergeMethod, get_method
from mergekit_loco.methods.base import task_vector_list, widened
from mergekit_loco.methods.plan import Collectives, Layout, Plan, Pricing, stack_sum, templates
from mergekit_loco.task_vector import TaskVector

#: set to 1 to check the worker layout before and the merged checksums after every call.
DEBUG_SYNC_ENV = "MLOCO_DEBUG_SYNC"


# -- the generic plans ------------------------------------------------------------------------
def sum_plan(method: MergeMethod) -> Plan:
    """``merged = finish(sum over ranks of sum_v local_term(tau_v, global index))``."""

    def run(comm: Collectives, local: Sequence[TaskVector], names: list[str]):
        first = comm.rank * len(local)
        workers = len(local) * comm.world
        dtypes = [local[0][name].dtype for name in names]
        sums = [  # formed in float32 at least, rounded once to the dtype that travels
            stack_sum(
                [method.local_term(name, widened(tv[name]), first + v) for v, tv in enumerate(local)]
            ).to(method.term_dtype(local[0][name].shape, dtype))
            for name, dtype in zip(names, dtypes, strict=True)
        ]
        if not method.finish_on_owner:
            return [
                method.finish(name, total, workers).to(dtype)
                for name, total, dtype in zip(names, comm.all_reduce(sums), dtypes, strict=True)
            ]
        owners = comm.owners([total.shape for total in sums])
        finished = []
        for name, total, dtype in zip(names, comm.reduce_to_owners(sums, owners), dtypes, strict=True):
            if total is None:
                finished.append(None)
                continue
            with comm.spectral():
                finished.append(method.finish(name, total, workers).to(dtype))
        return comm.from_owners(finished, templates(local, names), owners)

    def cost(layout: Layout, workers_per_rank: int, world: int, pricing: Pricing) -> float:
        """``2 (P-1) N b`` (ring all-reduce); owner-finished: ``(P-1) N (b_term + b)``."""
        total = 0.0
        for _, shape, dtype in layout:
            term_width = pricing.width(method.term_dtype(shape, dtype))
            result_width = pricing.width(dtype) if method.finish_on_owner else term_width
            total += math.prod(shape) * (term_width + result_width)
        return (world - 1) * total

    return Plan("all-reduce", run, cost)


def owner_plan(method: MergeMethod) -> Plan:
    """Any method: tensor j's V deltas from every rank go to its owner, which runs
    ``method.merge_tensor`` on all R in global order and shares the result."""

    def run(comm: Collectives, local: Sequence[TaskVector], names: list[str]):
        owners = comm.owners([local[0][name].shape for name in names])
        received = comm.to_owners([[tv[name] for tv in local] for name in names], owners)
        merged = []
        for name, copies in zip(names, received, strict=True):
            if copies is None:
                merged.append(None)
                continue
            with comm.spectral():
                result = method.merge_tensor(name, [delta for parcel in copies for delta in parcel])
            merged.append(result.to(local[0][name].dtype))
        return comm.from_owners(merged, templates(local, names), owners)

    def cost(layout: Layout, workers_per_rank: int, world: int, pricing: Pricing) -> float:
        """``(P-1) (V + 1) N b``: V deltas to the owner, the result back."""
        entries = sum(math.prod(shape) * pricing.width(dtype) for _, shape, dtype in layout)
        return (world - 1) * (workers_per_rank + 1) * entries

    return Plan("owner", run, cost)


def available_plans(method: MergeMethod) -> dict[str, Plan]:
    """The plans that compute ``method`` exactly, by name (``owner`` computes any method)."""
    plans = [sum_plan(method)] if method.is_sum() else []
    plans += [*method.plans(), owner_plan(method)]
    return {plan.name: plan for plan in plans}


def plan_bytes(
    plan: str,
    method: MergeMethod,
    layout: Layout,
    workers_per_rank: int,
    world: int,
    compression: str | None = None,
) -> float:
    """Bytes all P ranks send together in one call of ``plan`` (``gather``:
    :func:`gather_then_merge`, ``(P-1) P V N b`` uncompressed)."""
    if plan == "gather":
        entries = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in layout)
        return (world - 1) * world * workers_per_rank * entries
    pricing = Prices(Codec(compression), world)
    return available_plans(method)[plan].cost(layout, workers_per_rank, world, pricing)


class Prices:
    """:class:`~mergekit_loco.methods.plan.Pricing` without a process group: the codec's widths
    and the owners ``world`` ranks would pick."""

    def __init__(self, codec: Codec, world: int):
        self.codec, self.world, self.compression = codec, world, codec.compression

    def width(self, dtype: torch.dtype) -> float:
        return self.codec.width(dtype)

    def owners(self, shapes) -> list[int]:
        return assign_owners(shapes, self.world)


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
    plans = list(available_plans(method))
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


# -- entry points -----------------------------------------------------------------------------
def merge_across_ranks(
    method: MergeMethod | str,
    local_deltas: Sequence[TaskVector],
    group=None,
    *,
    compression: str | None = None,
    plan: str = "auto",
) -> tuple[TaskVector, CommStats]:
    """``(merged, stats)``: every rank's worker deltas merged, equal to ``method.merge`` of the
    R deltas in rank order; ``stats``: what the call cost this rank.

    Every rank passes the same number V of deltas with the same names, shapes and dtypes.
    compression: None (exact), ``"bf16"`` or ``"int8"`` (per-row scales) for what travels.
    plan: ``"auto"`` (fewest bytes by :func:`plan_bytes`; compressed, not ``owner`` where
    another plan exists) or one of :func:`available_plans`. With ``MLOCO_DEBUG_SYNC=1`` the
    layouts are compared first and the results' checksums after. A worker delta holding NaN or
    Inf on any rank raises ``FloatingPointError`` naming the tensor on every rank, before any
    merge (:func:`~mergekit_loco.dist.checks.check_finite_deltas`: one all-reduce of 4 bytes a
    tensor, counted in ``collectives``, not in ``bytes_sent``). ``method``: a merge method or
    its name (default parameters).
    """
    if isinstance(method, str):
        method = get_method(method)
    if not isinstance(method, MergeMethod):
        raise TypeError(
            f"merge_across_ranks: method must be a MergeMethod or its name, not {method!r}"
        )
    local_deltas = task_vector_list(local_deltas, "merge_across_ranks", "worker delta")
    if not local_deltas:
        raise ValueError(f"{method.name}: no worker deltas on this rank")
    Codec(compression)  # an unknown compression fails here, on every rank
    plans = available_plans(method)
    if plan != "auto" and plan not in plans:
        raise ValueError(f"{method.name}: plan must be 'auto' or one of {list(plans)}, not {plan!r}")
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    method.check_tasks(len(local_deltas) * world)
    flag_seconds = check_finite_deltas(local_deltas, group)  # every rank raises alike
    if world == 1:
        return method.merge(local_deltas), CommStats(plan="local")
    names = list(local_deltas[0])
    for index, other in enumerate(local_deltas[1:], start=2):
        if set(other) != set(names):
            raise KeyError(f"{method.name}: local worker delta {index} holds other tensor names")
    layout = [(name, local_deltas[0][name].shape, local_deltas[0][name].dtype) for name in names]
    workers_per_rank = len(local_deltas)
    # every rank prices the plan, so bad shapes (tsv_rank, split_subspaces) raise everywhere
    if plan == "auto":
        plan = cheapest_plan(method, layout, workers_per_rank, world, compression)
    else:
        plan_bytes(plan, method, layout, workers_per_rank, world, compression)
    naive = plan_bytes("gather", method, layout, workers_per_rank, world)
    stats = CommStats(bytes_naive=int(naive) // world, plan=plan)
    stats.collectives, stats.comm_seconds = 1, flag_seconds  # the finite flags' all-reduce
    device = local_deltas[0][names[0]].device if names else "cpu"
    comm = Transport(group, compression, stats, device)
    debug = os.environ.get(DEBUG_SYNC_ENV, "0") not in ("", "0")
    if debug:
        check_same_layout(comm, layout, workers_per_rank)
    merged = TaskVector(dict(zip(names, plans[plan].run(comm, local_deltas, names), strict=True)))
    if debug:
        verify_identical(merged, group)
    return merged, stats


def gather_then_merge(
    method: MergeMethod, local_deltas: Sequence[TaskVector], group=None
) -> tuple[TaskVector, CommStats]:
    """The naive reference (the seed paper's code): all-gather every worker's full delta, one
    tensor at a time, and merge everything on every rank. Returns ``(merged, stats)``."""
    stats = CommStats(plan="gather")
    device = next(iter(local_deltas[0].values())).device if local_deltas[0] else "cpu"
    comm = Transport(group, None, stats, device)
    merged = {}
    for name in local_deltas[0]:
        local = torch.stack([delta[name] for delta in local_deltas])
        gathered = torch.empty(comm.world * local.numel(), dtype=local.dtype, device=local.device)
        bytes_sent = (comm.world - 1) * local.numel() * local.element_size()
        flat = local.reshape(-1)
        comm.run("all_gather", bytes_sent, dist.all_gather_single, gathered, flat, group=group)
        with comm.spectral():
            merged[name] = method.merge_tensor(name, list(gathered.view(-1, *local.shape[1:])))
    stats.bytes_naive = stats.bytes_sent
    return TaskVector(merged), stats
