"""Iso-C (Marczak et al., 2025): isotropic merging in the common subspace (the sum's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.linalg import isotropic
from mergekit_loco.methods.base import MergeMethod, OfWorkerMean, is_matrix, is_matrix_shape

SPECTRAL_CHOICES = ("exact", "ns")


def check_spectral(method: str, spectral: str) -> None:
    if spectral not in SPECTRAL_CHOICES:
        raise ValueError(f"{method}: spectral must be one of {SPECTRAL_CHOICES}, not {spectral!r}")


@dataclass(frozen=True)
class IsoC(MergeMethod):
    """Iso-C per matrix: ``M = sum_t tau_t = U diag(s) V^T``; ``merged = mean(s) U V^T``.

    spectral="ns" replaces the SVD by Newton-Schulz and mean(s) by ``rms(s) = ||M||_F/sqrt(d)``
    (>= mean(s), equal only for a flat spectrum). rank_aware=True keeps only the numerically
    non-zero singular directions (exact Iso-C otherwise spreads mean(s) over arbitrary
    null-space directions of a rank-deficient M). Non-matrix tensors: mean over tasks.
    """

    name = "iso-c"
    finish_on_owner = True
    spectral: str = "exact"
    rank_aware: bool = False

    def __post_init__(self):
        check_spectral(self.name, self.spectral)
        if self.rank_aware and self.spectral == "ns":
            raise ValueError(
                "iso-c: rank_aware applies to spectral='exact' only (Newton-Schulz already stays "
                "in the column and row spaces of the sum)"
            )

    def local_term(self, name: str, delta: torch.Tensor, worker_index: int) -> torch.Tensor:
        """Matrices are summed in float32 at least (there is no half-precision SVD)."""
        return delta.to(self.term_dtype(delta.shape, delta.dtype))

    def term_dtype(self, shape: Sequence[int], dtype: torch.dtype) -> torch.dtype:
        return torch.promote_types(dtype, torch.float32) if is_matrix_shape(shape) else dtype

    def finish(self, name: str, total: torch.Tensor, workers: int) -> torch.Tensor:
        if not is_matrix(total):
            return total.div_(workers)
        return isotropic(total, self.spectral, self.rank_aware)

    def as_aggregator(self, round_index: int, workers: int) -> MergeMethod:
        """DiLoCo: Iso-C of the workers' mean (``tau_t / R`` on matrices), as the seed paper."""
        return OfWorkerMean(self, workers)
