"""Debug checks across ranks: same worker layout before a merge, same bits after."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from mergekit_loco.dist.transport import CommStats, Transport
from mergekit_loco.methods.plan import Layout


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
