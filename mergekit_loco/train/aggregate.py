"""The one entry point from training code to a merge method: aggregate the workers' deltas.

``aggregate_worker_deltas`` is the contract between the DiLoCo driver and the methods'
communication plans. What a method does as an aggregator (Iso-C acting on the workers' mean,
fresh DARE masks each round) is the method's own :meth:`~MergeMethod.as_aggregator`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from mergekit_loco.dist import CommStats, guarded, merge_across_ranks
from mergekit_loco.methods import MergeMethod
from mergekit_loco.task_vector import TaskVector

__all__ = ["CommStats", "aggregate_worker_deltas"]


def _world_size(group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def check_finite_deltas(local_deltas: Sequence[Mapping[str, torch.Tensor]], group=None) -> float:
    """Raise ``FloatingPointError`` naming the first tensor (in the first delta's order) that
    holds NaN or Inf in a worker delta of any rank of ``group``, before any aggregation: a
    method would fail on it (an SVD) or spread it into the pseudo-gradient. With several ranks
    one all-reduce (MAX) of a flag per tensor makes every rank raise alike; returns the seconds
    spent in it (a control message of 4 bytes per tensor, like the layout checks not counted in
    ``CommStats.bytes_sent``)."""
    names = list(local_deltas[0])
    if not names:
        return 0.0
    device = local_deltas[0][names[0]].device
    flags = [
        torch.stack([torch.isfinite(d[name]).all() for d in local_deltas if name in d])
        .all()
        .logical_not()
        .to(device)
        for name in names
    ]
    non_finite = torch.stack(flags).to(torch.int32)
    seconds = 0.0
    if _world_size(group) > 1:
        who = f"rank {dist.get_rank(group)}"
        label = "outer step collective all_reduce (non-finite flags)"
        started = time.perf_counter()
        guarded(who, label, dist.all_reduce, non_finite, dist.ReduceOp.MAX, group)
        seconds = time.perf_counter() - started
    flagged = non_finite.tolist()
    if any(flagged):
        name = names[flagged.index(1)]
        raise FloatingPointError(
            f"non-finite pseudo-gradient for {name!r} (a worker delta holds NaN or Inf); "
            "params kept"
        )
    return seconds


def aggregate_worker_deltas(
    method: MergeMethod,
    local_deltas: Sequence[TaskVector],
    *,
    round_index: int = 0,
    group: dist.ProcessGroup | None = None,
    compression: str | None = None,
) -> tuple[TaskVector, CommStats]:
    """``(merged, stats)``: the aggregate of all ``R = len(local_deltas) * world`` worker deltas
    ``tau_i = theta_i - theta`` (this rank's plus every other rank's of ``group``), and what the
    call cost this rank. ``round_index`` (0-based outer step) seeds per-round randomness.
    Raises ``FloatingPointError`` naming the tensor, on every rank, before aggregating a worker
    delta that is not finite (:func:`check_finite_deltas`)."""
    if not local_deltas:
        raise ValueError("outer step needs at least one worker delta on every rank")
    flag_seconds = check_finite_deltas(local_deltas, group)
    aggregator = method.as_aggregator(round_index, len(local_deltas) * _world_size(group))
    merged, stats = merge_across_ranks(
        aggregator, local_deltas, group=group, compression=compression
    )
    if _world_size(group) > 1:
        stats.collectives += 1
        stats.comm_seconds += flag_seconds
    return merged, stats
