"""TSV-M, Task Singular Vectors merging (Gargiulo et al., 2025)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.linalg import polar_factor, thin_svd
from mergekit_loco.methods.base import MergeMethod, in_svd_precision, is_matrix, mean_of

LowRank = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def truncated_factors(delta: torch.Tensor, rank: int) -> LowRank:
    """Top-``rank`` thin-SVD factors ``(U_r: m x r, s_r: r, Vh_r: r x n)`` of ``delta``."""
    left, singular, right_h = thin_svd(delta)
    return left[:, :rank], singular[:rank], right_h[:rank]


def orthogonalised_sum(factors: Sequence[LowRank]) -> torch.Tensor:
    """``polar([U_1 .. U_T]) diag([s_1 .. s_T]) polar([Vh_1; ..; Vh_T])``.

    Concatenating the blocks equals placing them in zero-filled ``m x d`` / ``d x n`` matrices:
    zero columns meet zero singular values.
    """
    left = polar_factor(torch.cat([u for u, _, _ in factors], dim=1))
    right_h = polar_factor(torch.cat([vh for _, _, vh in factors], dim=0))
    singular = torch.cat([s for _, s, _ in factors])
    return (left * singular) @ right_h


def tsv_rank(name: str, shape: torch.Size, tasks: int) -> int:
    """Components kept per task: ``r = int(min(m, n) * (1 / T))``; an error if that is 0.

    The product with ``1 / T`` (not ``min(m, n) // T``) is the reference's float rounding: it
    is one less for some multiples of T (e.g. ``int(98 * (1 / 49)) = 1``).
    """
    rank = int(min(shape) * (1 / tasks))
    if rank == 0:
        raise ValueError(
            f"tsv: tensor {name!r} of shape {tuple(shape)} leaves no singular component for "
            f"each of {tasks} tasks (min(m, n) = {min(shape)}); use fewer tasks or another method"
        )
    return rank


@dataclass(frozen=True)
class Tsv(MergeMethod):
    """TSV-M per matrix: keep the top ``r = int(d * (1/T))`` SVD components of each tau_t, stack
    them, replace the stacked U and V^T by their polar factors:
    ``merged = U_perp diag(s) V^T_perp``. Non-matrix tensors: mean over tasks.
    """

    name = "tsv"

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        if not is_matrix(deltas[0]):
            return mean_of(deltas)
        rank = tsv_rank(name, deltas[0].shape, len(deltas))
        factors = [truncated_factors(d, rank) for d in in_svd_precision(deltas)]
        return orthogonalised_sum(factors).to(deltas[0].dtype)
