"""How a merge method runs over torch.distributed (placeholder: gather everything, merge)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from mergekit_loco.methods import MergeMethod
from mergekit_loco.task_vector import TaskVector


def gather_then_merge(
    method: MergeMethod, local_deltas: Sequence[TaskVector], group=None
) -> TaskVector:
    """The naive reference: all-gather every worker's full delta, merge on every rank."""
    world = dist.get_world_size(group)
    merged = {}
    for name in local_deltas[0]:
        local = torch.stack([delta[name] for delta in local_deltas])
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local.contiguous(), group=group)
        merged[name] = method.merge_tensor(name, [t for block in gathered for t in block])
    return TaskVector(merged)


def merge_across_ranks(
    method: MergeMethod, local_deltas: Sequence[TaskVector], group=None
) -> TaskVector:
    """Merge all ranks' worker deltas; equals ``method.merge`` of the concatenated list."""
    return gather_then_merge(method, local_deltas, group)
