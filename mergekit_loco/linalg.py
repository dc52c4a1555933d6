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


#: ``truncated_svd`` and ``lean_polar_factor`` factor a matrix at least this many times taller
#: than wide (or wider than tall) through a QR first, as LAPACK's own SVD does for such shapes.
QR_FIRST_ASPECT = 2


def truncated_svd(
    matrix: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``rank`` factors of :func:`thin_svd`: ``(U_r: m x r, s_r: r, Vh_r: r x n)``, owned
    (no view keeps the full ``U`` alive), float32 at least.

    A tall matrix (``m >= 2 n``) is factored as ``M = Q R`` (Householder), ``R = U' s Vh``,
    ``U_r = Q U'_r``: beside the input this holds Q and LAPACK's copy (about 1.6 x the input)
    instead of the full ``U``, a copy and the divide-and-conquer workspace (about 3 x). A wide
    one is factored through its transpose.
    """
    rows, cols = matrix.shape
    if rows < QR_FIRST_ASPECT * cols:
        if cols >= QR_FIRST_ASPECT * rows:
            left, singular, right_h = truncated_svd(matrix.mT, rank)
            return right_h.mT.contiguous(), singular, left.mT.contiguous()
        left, singular, right_h = thin_svd(matrix)
        return left[:, :rank].clone(), singular[:rank].clone(), right_h[:rank].clone()
    compute = torch.promote_types(matrix.dtype, torch.float32)
    orthonormal, triangular = torch.linalg.qr(matrix.to(compute))
    left, singular, right_h = thin_svd(triangular)
    return orthonormal @ left[:, :rank], singular[:rank].clone(), right_h[:rank].clone()


def lean_polar_factor(matrix: torch.Tensor) -> torch.Tensor:
    """:func:`polar_factor` of ``matrix`` holding less beside it: a tall matrix ``M = Q R`` has
    ``polar(M) = Q polar(R)``, formed in Q's memory a block of rows at a time (about 1.6 x the
    input at the peak instead of about 4 x); a wide one goes through its transpose."""
    rows, cols = matrix.shape
    if rows < QR_FIRST_ASPECT * cols:
        if cols >= QR_FIRST_ASPECT * rows:
            return lean_polar_factor(matrix.mT).mT
        return polar_factor(matrix)
    compute = torch.promote_types(matrix.dtype, torch.float32)
    orthonormal, triangular = torch.linalg.qr(matrix.to(compute))
    return times_in_place(orthonormal, polar_factor(triangular)).to(matrix.dtype)


def times_in_place(matrix: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
    """``matrix @ square`` (``square``: n x n) written into ``matrix``, a block of rows at a
    time, so the product needs no second m x n buffer; returns ``matrix``."""
    block = max(1, (1 << 22) // matrix.shape[1])  # 4M entries per product
    for start in range(0, matrix.shape[0], block):
        rows_block = matrix[start : start + block]
        rows_block.copy_(rows_block @ square)
    return matrix


def consuming_product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left @ right``, written into ``left`` (which the caller gives up) when ``right`` is
    square: :func:`times_in_place`; otherwise a new tensor."""
    if right.shape[0] == right.shape[1]:
        return times_in_place(left, right)
    return left @ right
