"""Merging LoRA adapters from their factors: deltas ``tau_t = B_t A_t`` of rank <= r.

The sum of T such deltas is ``L R`` with ``L = [B_1 .. B_T]`` (m x Tr) and ``R = [A_1; ..; A_T]``
(Tr x n), so it has rank <= Tr and its thin SVD needs no dense m x n delta: with
``L = Q_L R_L`` and ``R^T = Q_R R_R`` (QR), ``L R = Q_L (R_L R_R^T) Q_R^T`` and the SVD of the
small core ``R_L R_R^T = U_c S V_c^T`` gives ``U = Q_L U_c``, ``V = Q_R V_c``.

Methods computed from the factors: ``mean`` and ``ta`` (``L R`` with the weights folded into L)
and rank-aware exact ``iso-c`` (``mean(s) U V^T`` over the non-zero singular values, which is
determined by the deltas; without ``rank_aware`` Iso-C spreads mean(s) over arbitrary null-space
directions, so it runs on dense deltas). Every other method gets dense deltas ``B_t A_t``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.linalg import numerical_rank, thin_svd
from mergekit_loco.methods import MergeMethod
from mergekit_loco.methods.base import task_weights
from mergekit_loco.methods.iso import IsoC
from mergekit_loco.methods.mean import Mean
from mergekit_loco.methods.ta import TaskArithmetic


@dataclass
class LowRankDelta:
    """One adapter's delta of one tensor, ``left @ right``; both None where it adapts nothing."""

    left: torch.Tensor | None = None
    right: torch.Tensor | None = None

    def dense(self, like: torch.Tensor) -> torch.Tensor:
        """The m x n delta in ``like``'s dtype and device (zeros where nothing is adapted)."""
        if self.left is None:
            return torch.zeros_like(like)
        return self.left.to(like) @ self.right.to(like)


def from_factors(method: MergeMethod) -> bool:
    """Whether ``method`` is computed from the stacked factors (see the module docs)."""
    if isinstance(method, Mean | TaskArithmetic):
        return True
    return isinstance(method, IsoC) and method.rank_aware and method.spectral == "exact"


def stacked_factors(
    items: Sequence[LowRankDelta], weights: Sequence[float], dtype, device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(L, R)`` with ``L = [w_t B_t]`` and ``R = [A_t]`` over the adapters that adapt the
    tensor; None if none does."""
    used = [
        (item, weight) for item, weight in zip(items, weights, strict=True) if item.left is not None
    ]
    if not used:
        return None
    left = torch.cat([item.left.to(device, dtype) * weight for item, weight in used], dim=1)
    right = torch.cat([item.right.to(device, dtype) for item, _ in used], dim=0)
    return left, right


def low_rank_svd(left: torch.Tensor, right: torch.Tensor):
    """Thin SVD ``(U, s, V^T)`` of ``left @ right`` from QR factors and a small core SVD."""
    q_left, r_left = torch.linalg.qr(left)
    q_right, r_right = torch.linalg.qr(right.mT)
    core_u, singular, core_vh = thin_svd(r_left @ r_right.mT)
    return q_left @ core_u, singular, core_vh @ q_right.mT


def merge_from_factors(
    method: MergeMethod,
    name: str,
    items: Sequence[LowRankDelta],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """``method`` on the deltas ``B_t A_t`` of one tensor, from the factors (see
    :func:`from_factors`); the result is m x n in ``dtype``."""
    count = len(items)
    weights = task_weights(method.name, getattr(method, "weights", None), count) or (1.0,) * count
    if isinstance(method, Mean):
        total = math.fsum(weights)
        weights = tuple(weight / total for weight in weights)
    stacked = stacked_factors(items, weights, dtype, device)
    if stacked is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    left, right = stacked
    if not isinstance(method, IsoC):
        return left @ right
    if len(shape) != 2:
        return (left @ right) / count  # Iso-C takes the mean of non-matrix tensors
    precise = torch.promote_types(dtype, torch.float32)
    u, singular, vh = low_rank_svd(left.to(precise), right.to(precise))
    rank = numerical_rank(singular, shape)
    if rank == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return (singular[:rank].mean() * (u[:, :rank] @ vh[:rank])).to(dtype)
