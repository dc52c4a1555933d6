"""The one entry point from training code to a merge method: aggregate the workers' deltas.

``aggregate_worker_deltas`` is the contract between the DiLoCo driver and the methods'
communication plans; everything a method needs to act as an aggregator (acting on the workers'
mean, fresh DARE masks each round) is decided here or by the method, never by the caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch.distributed as dist

from mergekit_loco.methods import MergeMethod
from mergekit_loco.methods.base import is_matrix
from mergekit_loco.task_vector import TaskVector
from mergekit_loco.train.collectives import CommStats, last_comm_stats, merge_across_ranks

__all__ = ["CommStats", "aggregate_worker_deltas"]


def _world_size(group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


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
    call cost this rank. ``round_index`` (0-based outer step) seeds per-round randomness."""
    if not local_deltas:
        raise ValueError("outer step needs at least one worker delta on every rank")
    total_workers = len(local_deltas) * _world_size(group)
    if method.aggregates_mean:
        local_deltas = [
            TaskVector({n: d / total_workers if is_matrix(d) else d for n, d in delta.items()})
            for delta in local_deltas
        ]
    if "seed" in method.parameter_names():
        method = dataclasses.replace(method, seed=method.seed + round_index)
    merged = merge_across_ranks(method, local_deltas, group=group, compression=compression)
    return merged, last_comm_stats()
