"""A partial isometry in about ``m n - d^2 / 2`` numbers: its Householder (compact QR) form.

An ``m x n`` matrix ``W`` with orthonormal columns (m >= n; else take ``W^T``) is ``W = Q R``
with ``Q`` the product of n Householder reflections and ``R`` diagonal with entries +-1 (up to
rounding). The reflections are stored below the diagonal of an ``m x n`` matrix (the strictly
lower part, ``m n - n (n + 1) / 2`` entries) plus n scalars ``tau``; with the n signs that is
``m n - n (n - 3) / 2`` numbers instead of ``m n``. Rebuilding is backward stable (the rebuilt
``Q`` is orthogonal to working precision), so the round trip changes ``W`` by rounding only.
"""

from __future__ import annotations

import torch


def compact_length(shape: tuple[int, int]) -> int:
    """Entries of :func:`compact` for an ``m x n`` partial isometry (plus 1 for a scale)."""
    tall, wide = max(shape), min(shape)
    return tall * wide - wide * (wide + 1) // 2 + 2 * wide + 1


def compact(scale: torch.Tensor, isometry: torch.Tensor) -> torch.Tensor:
    """``scale * isometry`` (a scalar times orthonormal columns or rows) as one flat tensor:
    ``[strictly-lower reflectors | tau | signs of R | scale]``."""
    tall = isometry if isometry.shape[0] >= isometry.shape[1] else isometry.mT
    reflectors, tau = torch.geqrf(tall)
    rows, cols = tall.shape
    below = torch.ones(rows, cols, dtype=torch.bool, device=tall.device).tril(-1)
    signs = torch.sign(reflectors.diagonal())
    parts = [reflectors[below], tau, signs, scale.reshape(1).to(tall.dtype)]
    return torch.cat(parts)


def expand(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The ``m x n`` matrix of :func:`compact`."""
    rows, cols = max(shape), min(shape)
    below = torch.ones(rows, cols, dtype=torch.bool, device=packed.device).tril(-1)
    count = int(below.sum())
    reflectors = torch.zeros(rows, cols, dtype=packed.dtype, device=packed.device)
    reflectors[below] = packed[:count]
    tau = packed[count : count + cols]
    signs = packed[count + cols : count + 2 * cols]
    scale = packed[count + 2 * cols]
    tall = torch.linalg.householder_product(reflectors, tau) * (signs * scale)
    return tall if shape[0] >= shape[1] else tall.mT
