"""Iso-C and Iso-CTS (Marczak et al., 2025): isotropic merging in common and task subspaces."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.linalg import isotropic, newton_schulz, polar_factor, thin_svd
from mergekit_loco.methods.base import (
    MergeMethod,
    check_fraction,
    in_svd_precision,
    is_matrix,
    mean_of,
    sum_of,
)

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
    aggregates_mean = True
    spectral: str = "exact"
    rank_aware: bool = False

    def __post_init__(self):
        check_spectral(self.name, self.spectral)

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        if not is_matrix(deltas[0]):
            return mean_of(deltas)
        summed = sum_of(in_svd_precision(deltas))
        return isotropic(summed, self.spectral, self.rank_aware).to(deltas[0].dtype)


def split_subspaces(name: str, dim: int, tasks: int, common_fraction: float) -> tuple[int, int]:
    """``(k, per_task)``: common size ``k`` and task-specific size per task, as in the reference:
    ``k0 = int(d f)``; ``k = d - round((d - k0) / T) T``; ``per_task = (d - k) / T``."""
    common = int(dim * common_fraction)
    task_specific_total = round((dim - common) / tasks) * tasks
    common = dim - task_specific_total
    if common < 0:
        raise ValueError(
            f"iso-cts: tensor {name!r} with min(m, n) = {dim} cannot hold {tasks} task-specific "
            f"blocks (common subspace size would be {common} < 0); raise common_fraction or use "
            "fewer tasks"
        )
    return common, task_specific_total // tasks


def common_subspace(summed: torch.Tensor, common: int):
    """Top-``k`` thin-SVD factors of ``sum_t tau_t``: ``(U_k, s_k, Vh_k)``."""
    left, singular, right_h = thin_svd(summed)
    return left[:, :common], singular[:common], right_h[:common]


def task_specific_factors(delta: torch.Tensor, common_left: torch.Tensor, per_task: int):
    """Top ``per_task`` SVD factors of ``tau - U_k U_k^T tau`` (tau outside the common space)."""
    residual = delta - common_left @ (common_left.mT @ delta)
    left, singular, right_h = thin_svd(residual)
    return left[:, :per_task], singular[:per_task], right_h[:per_task]


def isotropic_from_factors(factors, spectral: str) -> torch.Tensor:
    """``mean(s) * orth([U_blocks]) orth([Vh_blocks])`` where orth is the polar factor (or its
    Newton-Schulz approximation)."""
    orthogonalise = polar_factor if spectral == "exact" else newton_schulz
    left = orthogonalise(torch.cat([u for u, _, _ in factors], dim=1))
    right_h = orthogonalise(torch.cat([vh for _, _, vh in factors], dim=0))
    singular = torch.cat([s for _, s, _ in factors])
    return singular.mean() * (left @ right_h)


@dataclass(frozen=True)
class IsoCts(MergeMethod):
    """Iso-CTS per matrix: common subspace = top-k SVD of ``sum_t tau_t`` with
    ``k ~ common_fraction * d``; each task adds the top ``(d-k)/T`` directions of its residual
    outside it; the blocks [task-specific..., common] are polar-orthogonalised and all singular
    values replaced by their mean. Non-matrix tensors: mean over tasks.

    common_fraction in [0, 1), default 0.8; spectral="ns" orthogonalises the stacked blocks by
    Newton-Schulz instead of an SVD (the subspace SVDs remain).
    """

    name = "iso-cts"
    aggregates_mean = True
    common_fraction: float = 0.8
    spectral: str = "exact"

    def __post_init__(self):
        check_fraction(self.name, "common_fraction", self.common_fraction, False, True)
        check_spectral(self.name, self.spectral)

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        if not is_matrix(deltas[0]):
            return mean_of(deltas)
        common, per_task = split_subspaces(
            name, min(deltas[0].shape), len(deltas), self.common_fraction
        )
        precise = in_svd_precision(deltas)
        shared = common_subspace(sum_of(precise), common)
        specific = [task_specific_factors(d, shared[0], per_task) for d in precise]
        return isotropic_from_factors([*specific, shared], self.spectral).to(deltas[0].dtype)
