"""TSV-M, Task Singular Vectors merging (Gargiulo et al., 2025)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.linalg import (
    consuming_product,
    leading,
    numerical_rank,
    polar_of_blocks,
    rank_aware_polar,
    truncated_svd,
)
from mergekit_loco.methods.base import (
    MergeMethod,
    in_svd_precision,
    is_matrix,
    is_matrix_shape,
    mean_of,
)
from mergekit_loco.methods.plan import (
    Collectives,
    Layout,
    Plan,
    Pricing,
    delivery_bytes,
    stack_sum,
    templates,
)
from mergekit_loco.task_vector import TaskVector

LowRank = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def orthogonalised_sum(factors: list[LowRank], orthogonalise=None) -> torch.Tensor:
    """``polar([U_1 .. U_T]) diag([s_1 .. s_T]) polar([Vh_1; ..; Vh_T])``; empties ``factors``
    (each block is freed once concatenated). ``orthogonalise``: the polar factor (None) or
    :func:`~mergekit_loco.linalg.rank_aware_polar`.

    Concatenating the blocks equals placing them in zero-filled ``m x d`` / ``d x n`` matrices:
    zero columns meet zero singular values.
    """
    lefts, singulars, right_hs = (list(blocks) for blocks in zip(*factors, strict=True))
    factors.clear()
    singular = torch.cat(singulars)
    right_h = polar_of_blocks(right_hs, 0, orthogonalise)
    return consuming_product(polar_of_blocks(lefts, 1, orthogonalise).mul_(singular), right_h)


def nonzero_part(factors: LowRank, shape: torch.Size) -> LowRank:
    """The components of ``(U_r, s_r, Vh_r)`` whose singular value is numerically non-zero
    (:func:`~mergekit_loco.linalg.numerical_rank` of the task's ``shape``)."""
    return leading(factors, numerical_rank(factors[1], shape))


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

    rank_aware=True keeps only each task's numerically non-zero components and the stacks'
    non-zero directions (:func:`~mergekit_loco.linalg.rank_aware_polar`): the same result on
    full-rank tasks, and a unique one where a task has rank below r (a LoRA delta) or tasks
    repeat, which otherwise depends on null-space vectors that LAPACK picks arbitrarily.
    """

    name = "tsv"
    rank_aware: bool = False

    def check_shapes(self, shapes: Mapping[str, Sequence[int]], tasks: int) -> None:
        for name, shape in shapes.items():
            if is_matrix_shape(shape):
                tsv_rank(name, torch.Size(shape), tasks)

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        if not is_matrix(deltas[0]):
            return mean_of(deltas)
        rank = tsv_rank(name, deltas[0].shape, len(deltas))
        # one delta in float32 at a time; only its top-r factors outlive its SVD
        factors = [truncated_svd(delta, rank) for delta in deltas]
        if not self.rank_aware:
            return orthogonalised_sum(factors).to(deltas[0].dtype)
        factors = [nonzero_part(triple, deltas[0].shape) for triple in factors]
        if not any(len(singular) for _, singular, _ in factors):
            return torch.zeros_like(deltas[0])
        return orthogonalised_sum(factors, rank_aware_polar).to(deltas[0].dtype)

    def plans(self) -> Sequence[Plan]:
        """The low-rank plan; with ``rank_aware`` (factors of varying size) the owner plan."""
        return () if self.rank_aware else (Plan("low-rank", self.run_low_rank, low_rank_bytes),)

    def run_low_rank(
        self, comm: Collectives, local: Sequence[TaskVector], names: list[str]
    ) -> list[torch.Tensor]:
        """Each rank sends its workers' top-r factors ``(U_r, s_r, Vh_r)`` (r = int(d/R)) to the
        matrix's owner, which stacks all R and takes the polar factors; non-matrices: the mean
        of a reduce-scatter. The owner shares the result."""
        workers_per_rank = len(local)
        workers = workers_per_rank * comm.world
        owners = comm.owners([local[0][name].shape for name in names])
        parcels = []
        for name in names:
            deltas = [tv[name] for tv in local]
            if not is_matrix(deltas[0]):
                parcels.append([stack_sum(deltas)])
                continue
            rank = tsv_rank(name, deltas[0].shape, workers)
            with comm.spectral():
                factors = [truncated_svd(delta, rank) for delta in in_svd_precision(deltas)]
            parcels.append([tensor for triple in factors for tensor in triple])
        merged = []
        for name, copies in zip(names, comm.to_owners(parcels, owners), strict=True):
            if copies is None:
                merged.append(None)
            elif not is_matrix(local[0][name]):
                merged.append(stack_sum([parcel[0] for parcel in copies]) / workers)
            else:
                factors = [
                    tuple(parcel[3 * v : 3 * v + 3])
                    for parcel in copies
                    for v in range(workers_per_rank)
                ]
                with comm.spectral():
                    merged.append(orthogonalised_sum(factors).to(local[0][name].dtype))
        return comm.from_owners(merged, templates(local, names), owners, balance=True)


def low_rank_bytes(layout: Layout, workers_per_rank: int, world: int, pricing: Pricing) -> float:
    """All ranks together: ``(P-1) V r (m+n+1) b'`` per matrix (b': factor bytes, float32 at
    least), ``(P-1) N b`` per non-matrix, plus delivering the results (``(P-1) N b``, more if
    relayed: :func:`~mergekit_loco.methods.plan.delivery_bytes`)."""
    workers = workers_per_rank * world
    total = 0.0
    for name, shape, dtype in layout:
        if not is_matrix_shape(shape):
            total += (world - 1) * math.prod(shape) * pricing.width(dtype)
            continue
        rows, cols = shape
        factor_width = pricing.width(torch.promote_types(dtype, torch.float32))
        rank = tsv_rank(name, shape, workers)
        total += (world - 1) * workers_per_rank * rank * (rows + cols + 1) * factor_width
    results = [(shape, dtype) for _, shape, dtype in layout]
    owners = pricing.owners([shape for shape, _ in results])
    return total + delivery_bytes(results, owners, world, pricing, balance=True)
