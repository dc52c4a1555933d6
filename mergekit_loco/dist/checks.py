"""Checks across ranks: finite worker deltas before a merge and every rank's outer step taken
after it (always); same worker layout before it and same bits after (debug); objects gathered
from every rank (the DiLoCo driver compares its settings so)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mergekit_loco.dist import transport
from mergekit_loco.dist.transport import CommStats, Transport, guarded
from mergekit_loco.methods.plan import Layout


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
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
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


def gather_from_ranks(value: Any, what: str, group=None) -> list:
    """Every rank's ``value`` (a picklable object), in rank order; one guarded all-gather."""
    everyone = [None] * dist.get_world_size(group)
    who = f"rank {dist.get_rank(group)}"
    guarded(who, f"all_gather_object ({what})", dist.all_gather_object, everyone, value,
            group=group, timeout_s=transport.group_timeout_s)  # fmt: skip
    return everyone


def check_outer_steps_agree(
    ok: bool, round_number: int, group=None, device: torch.device | str = "cpu"
) -> None:
    """Whether every rank of ``group`` took outer step ``round_number`` (1-based): one
    all-reduce (MAX) of a failure flag per rank and the round numbers. RuntimeError on every
    rank whose step was ``ok`` if another rank's failed (each then undoes its own step, so all
    keep the round), and on every rank if the ranks are at different rounds."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flags = torch.zeros(world + 2, dtype=torch.int64, device=device)
    flags[rank] = 0 if ok else 1
    flags[world], flags[world + 1] = round_number, -round_number
    label = "outer step collective all_reduce (step outcomes)"
    guarded(f"rank {rank}", label, dist.all_reduce, flags, dist.ReduceOp.MAX, group,
            timeout_s=transport.group_timeout_s)  # fmt: skip
    outcome = flags.tolist()
    highest, lowest = outcome[world], -outcome[world + 1]
    if highest != lowest:
        raise RuntimeError(
            f"rank {rank}: the ranks are at different outer steps ({lowest} to {highest}): a "
            "rank skipped or retried one alone; restart every rank from the same state"
        )
    failed = [r for r in range(world) if outcome[r]]
    if ok and failed:
        raise RuntimeError(
            f"rank {rank}: the outer step of round {round_number} failed on rank "
            f"{failed[0]}; undone here too, so every rank keeps the round (sync() on every "
            "rank retries it)"
        )


def checksum(tensor: torch.Tensor) -> str:
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    digest = hashlib.blake2b(raw.tobytes(), digest_size=8).hexdigest()
    return f"{tuple(tensor.shape)}:{tensor.dtype}:{digest}"


def verify_identical(tensors: Mapping[str, torch.Tensor], group=None) -> None:
    """Raise RuntimeError unless every rank holds bit-identical ``tensors`` (same names, shapes,
    dtypes and bytes), by all-gathering one checksum per tensor."""
    comm = Transport(group, None, CommStats())
    mine = [(name, checksum(tensor)) for name, tensor in tensors.items()]
    for other_rank, theirs in enumerate(comm.all_gather_objects(mine)):
        if theirs == mine:
            continue
        differing = [a[0] for a, b in zip(mine, theirs, strict=False) if a != b] or [
            "the tensor names"
        ]
        raise RuntimeError(
            f"rank {comm.rank}: {differing[0]!r} differs from rank {other_rank}'s (checksum "
            "mismatch); the ranks' parameters have diverged"
        )


def check_same_layout(comm: Transport, layout: Layout, workers_per_rank: int) -> None:
    described = (
        workers_per_rank,
        [(name, tuple(shape), str(dtype)) for name, shape, dtype in layout],
    )
    for other_rank, theirs in enumerate(comm.all_gather_objects(described)):
        if theirs != described:
            raise ValueError(
                f"rank {comm.rank}: rank {other_rank} holds other worker deltas (count, names, "
                f"shapes or dtypes): {theirs[0]} workers vs {workers_per_rank} here"
            )
