"""The spectral toolbox shared by TSV-M, Iso-C and Iso-CTS.

Every function takes and returns plain tensors (a matrix is ``m x n``, ``d = min(m, n)``).
"""

from __future__ import annotations

import torch

# Quintic Newton-Schulz coefficients (a, b, c) of Muon: p(x) = a x + b x^3 + c x^5.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def thin_svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``matrix = U diag(s) Vh`` with U: m x d, s: d (descending), Vh: d x n.

    Computed (and returned) in float32 at least: there is no half-precision SVD kernel. If the
    float32 SVD fails to converge, it is retried in float64.
    """
    compute = torch.promote_types(matrix.dtype, torch.float32)
    try:
        return torch.linalg.svd(matrix.to(compute), full_matrices=False)
    except torch.linalg.LinAlgError:  # LAPACK's float32 divide-and-conquer can fail to converge
        if compute == torch.float64:
            raise
        factors = torch.linalg.svd(matrix.to(torch.float64), full_matrices=False)
        return tuple(factor.to(compute) for factor in factors)


def polar_factor(matrix: torch.Tensor) -> torch.Tensor:
    """Orthogonal polar factor ``P Q^T`` of ``matrix = P diag(s) Q^T`` (same shape as input).

    It is the nearest matrix with orthonormal columns (or rows) in Frobenius norm.
    """
    left, _, right_h = thin_svd(matrix)
    return (left @ right_h).to(matrix.dtype)


def newton_schulz(matrix: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """Approximate ``U V^T`` of ``matrix`` by a quintic Newton-Schulz iteration (no SVD).

    ``X_0 = M / ||M||_F``; ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` (X kept wide).
    The iteration maps every singular value into roughly [0.7, 1.2], as in Muon; it runs in
    float32 at least.
    """
    a, b, c = NS_COEFFICIENTS
    compute = torch.promote_types(matrix.dtype, torch.float32)
    x = matrix.to(compute)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if transposed:
        x = x.mT
    return x.to(matrix.dtype)


def rms_singular_value(matrix: torch.Tensor) -> torch.Tensor:
    """``rms(s) = sqrt(mean(s^2)) = ||M||_F / sqrt(min(m, n))``.

    rms(s) >= mean(s), with equality iff the spectrum is flat; needs no SVD.
    """
    return torch.linalg.matrix_norm(matrix) / min(matrix.shape) ** 0.5


def isotropic(matrix: torch.Tensor, spectral: str = "exact", rank_aware: bool = False):
    """Flatten the spectrum of ``matrix``.

    - ``exact``: ``mean(s) * U V^T`` from a thin SVD. With ``rank_aware`` only the numerically
      non-zero singular directions are kept and averaged: ``mean(s[:r]) * U_r V_r^T``.
    - ``ns``: ``rms(s) * NS(M)``, i.e. ``||M||_F / sqrt(d)`` times the Newton-Schulz
      orthogonalisation.
    """
    if spectral == "ns":
        return rms_singular_value(matrix) * newton_schulz(matrix)
    if spectral != "exact":
        raise ValueError(f"spectral must be 'exact' or 'ns', not {spectral!r}")
    left, singular, right_h = thin_svd(matrix)
    if rank_aware:
        rank = numerical_rank(singular, matrix.shape)
        left, singular, right_h = left[:, :rank], singular[:rank], right_h[:rank]
        if rank == 0:
            return torch.zeros_like(matrix)
    return (singular.mean() * (left @ right_h)).to(matrix.dtype)


def numerical_rank(singular: torch.Tensor, shape: torch.Size | tuple[int, int]) -> int:
    """Number of singular values above ``max(m, n) * eps * s_max`` (numpy's matrix_rank rule)."""
    if singular.numel() == 0 or singular[0] == 0:
        return 0
    tolerance = max(shape) * torch.finfo(singular.dtype).eps * singular[0]
    return int((singular > tolerance).sum())
