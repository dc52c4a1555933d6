"""The one entry point from training code to a merge method: aggregate the workers' deltas.

``aggregate_worker_deltas`` is the contract between the DiLoCo driver and the methods'
communication plans. What a method does as an aggregator (Iso-C acting on the workers' mean,
fresh DARE masks each round) is the method's own :meth:`~MergeMethod.as_aggregator`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from mergekit_loco.dist import CommStats, merge_across_ranks
from mergekit_loco.methods import MergeMethod
from mergekit_loco.task_vector import TaskVector

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
    call cost this rank. ``round_index`` (0-based outer step) seeds per-round randomness.
    Raises ``FloatingPointError`` naming the tensor, on every rank, before aggregating a worker
    delta that is not finite (:func:`~mergekit_loco.dist.checks.check_finite_deltas`, run by
    :func:`~mergekit_loco.dist.merge_across_ranks`)."""
    if not local_deltas:
        raise ValueError("outer step needs at least one worker delta on every rank")
    aggregator = method.as_aggregator(round_index, len(local_deltas) * _world_size(group))
    return merge_across_ranks(aggregator, local_deltas, group=group, compression=compression)
