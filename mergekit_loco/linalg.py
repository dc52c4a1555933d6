"""The spectral toolbox shared by TSV-M, Iso-C and Iso-CTS.

Every function takes and returns plain tensors (a matrix is ``m x n``, ``d = min(m, n)``).
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.linalg import get_lapack_funcs

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


def frobenius_norm(matrix: torch.Tensor) -> torch.Tensor:
    """``||M||_F`` in ``matrix``'s dtype, also where the sum of squares overflows it (float32
    entries from about 1e19): there it is ``p ||M / p||_F`` with ``p = max |m_ij|``."""
    norm = torch.linalg.matrix_norm(matrix)
    if torch.isfinite(norm):
        return norm
    peak = matrix.abs().amax()
    return peak * torch.linalg.matrix_norm(matrix / peak)


def newton_schulz(matrix: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """Approximate ``U V^T`` of ``matrix`` by a quintic Newton-Schulz iteration (no SVD).

    ``X_0 = M / (||M||_F + 1e-7)`` (Muon's and the IsoLoCo authors' guard: NS(0) = 0);
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` (X kept wide). Every singular value of
    at least 0.0015 ||M||_F lands in [0.68, 1.20], as in Muon (smaller ones grow by at most
    a^5 ~ 485); it runs in float32 at least. The guard makes ``NS(c M) = NS(M)`` hold only to
    a relative ~1e-7 / ||c M||_F: negligible unless ``||M||_F`` is near 1e-7 or below.
    """
    a, b, c = NS_COEFFICIENTS
    compute = torch.promote_types(matrix.dtype, torch.float32)
    x = matrix.to(compute)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.mT
    x = x / (frobenius_norm(x) + 1e-7)
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
    return frobenius_norm(matrix) / min(matrix.shape) ** 0.5


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


def householder_qr(
    matrix: torch.Tensor, overwrite: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``matrix = Q R`` for ``m >= n``: ``(Q: m x n, R: n x n upper triangular)``, float32 at
    least.

    On CPU, LAPACK's geqrf and orgqr run in one column-major buffer, so Q is the only m x n
    memory this needs: a copy of ``matrix``, or with ``overwrite`` the matrix's own memory when
    it is column-major (``matrix.mT`` contiguous) in the compute dtype (its values are lost).
    Q is returned column-major. Other devices: ``torch.linalg.qr``.
    """
    compute = torch.promote_types(matrix.dtype, torch.float32)
    if matrix.device.type != "cpu":
        return torch.linalg.qr(matrix.to(compute))
    rows, cols = matrix.shape
    owned = overwrite and matrix.dtype == compute and matrix.mT.is_contiguous()
    columns = matrix.mT if owned else torch.empty((cols, rows), dtype=compute).copy_(matrix.mT)
    array = columns.detach().numpy().T  # Fortran order, sharing the memory
    geqrf, orgqr = get_lapack_funcs(("geqrf", "orgqr"), (array,))
    workspace = max(1, 64 * cols)
    factored, tau, _, info = geqrf(array, lwork=workspace, overwrite_a=True)
    if info == 0:
        triangular = torch.from_numpy(np.triu(factored[:cols]))
        orthonormal, _, info = orgqr(factored, tau, lwork=workspace, overwrite_a=True)
    if info != 0:
        raise torch.linalg.LinAlgError(f"LAPACK QR of a {rows} x {cols} matrix: info = {info}")
    return torch.from_numpy(orthonormal), triangular


def qr_layout(matrix: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A copy of ``matrix`` in ``dtype`` laid out as :func:`householder_qr` overwrites it:
    column-major if ``m >= n``, row-major otherwise (the QR then runs on the transpose)."""
    rows, cols = matrix.shape
    if rows >= cols:
        return torch.empty((cols, rows), dtype=dtype, device=matrix.device).copy_(matrix.mT).mT
    return torch.empty((rows, cols), dtype=dtype, device=matrix.device).copy_(matrix)


def truncated_svd(
    matrix: torch.Tensor, rank: int, overwrite: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``rank`` factors of :func:`thin_svd`: ``(U_r: m x r, s_r: r, Vh_r: r x n)``, owned
    (no view keeps the full ``U`` alive), float32 at least.

    A tall matrix (``m >= 2 n``) is factored as ``M = Q R`` (:func:`householder_qr`),
    ``R = U' s Vh``, ``U_r = Q U'_r``: beside the input this holds one m x n buffer (none with
    ``overwrite``, see there) instead of the full ``U``, a copy and the divide-and-conquer
    workspace (about 3 x the input). A wide one is factored through its transpose.
    """
    rows, cols = matrix.shape
    if rows < QR_FIRST_ASPECT * cols:
        if cols >= QR_FIRST_ASPECT * rows:
            left, singular, right_h = truncated_svd(matrix.mT, rank, overwrite)
            return right_h.mT.contiguous(), singular, left.mT.contiguous()
        left, singular, right_h = thin_svd(matrix)
        return left[:, :rank].clone(), singular[:rank].clone(), right_h[:rank].clone()
    orthonormal, triangular = householder_qr(matrix, overwrite)
    left, singular, right_h = thin_svd(triangular)
    return orthonormal @ left[:, :rank], singular[:rank].clone(), right_h[:rank].clone()


def lean_polar_factor(matrix: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """:func:`polar_factor` of ``matrix`` holding less beside it: a tall matrix ``M = Q R`` has
    ``polar(M) = Q polar(R)``, formed in Q's memory (:func:`householder_qr`; with
    ``overwrite``, ``matrix``'s own) a block of rows at a time, so about 1 x the input at the
    peak instead of about 4 x; a wide one goes through its transpose."""
    rows, cols = matrix.shape
    if rows < QR_FIRST_ASPECT * cols:
        if cols >= QR_FIRST_ASPECT * rows:
            return lean_polar_factor(matrix.mT, overwrite).mT
        return polar_factor(matrix)
    orthonormal, triangular = householder_qr(matrix, overwrite)
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


def leading(factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor], count: int):
    """The first ``count`` components ``(U[:, :count], s[:count], Vh[:count])`` of SVD factors."""
    left, singular, right_h = factors
    return left[:, :count], singular[:count], right_h[:count]


def rank_aware_polar(matrix: torch.Tensor) -> torch.Tensor:
    """``U_r Vh_r`` of ``matrix = U diag(s) Vh``, keeping the :func:`numerical_rank` ``r``
    directions: the partial isometry on the matrix's column and row spaces (its polar factor
    when it has full rank), which, unlike the polar factor of a rank-deficient matrix, is
    unique."""
    left, singular, right_h = thin_svd(matrix)
    rank = numerical_rank(singular, matrix.shape)
    return left[:, :rank] @ right_h[:rank]


def polar_of_blocks(blocks: list[torch.Tensor], dim: int, orthogonalise=None):
    """``orthogonalise(cat(blocks, dim))`` (default: :func:`lean_polar_factor`, working in the
    concatenation's memory), emptying ``blocks`` before the factorisation so that each block is
    freed once concatenated."""
    if orthogonalise is None:  # the tall orientation column-major, for the QR to overwrite
        shape = list(blocks[0].shape)
        shape[dim] = sum(block.shape[dim] for block in blocks)
        if shape[0] >= shape[1]:
            stacked = torch.cat([block.mT for block in blocks], dim=1 - dim).mT
        else:
            stacked = torch.cat(blocks, dim=dim)
        blocks.clear()
        return lean_polar_factor(stacked, overwrite=True)
    stacked = torch.cat(blocks, dim=dim)
    blocks.clear()
    return orthogonalise(stacked)
