"""Iso-CTS (Marczak et al., 2025): isotropic merging in common and task-specific subspaces."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from mergekit_loco.linalg import (
    consuming_product,
    frobenius_norm,
    leading,
    newton_schulz,
    polar_of_blocks,
    qr_layout,
    rank_aware_polar,
    thin_svd,
    truncated_svd,
)
from mergekit_loco.methods.base import (
    MergeMethod,
    OfWorkerMean,
    check_fraction,
    in_svd_precision,
    is_matrix,
    is_matrix_shape,
    mean_of,
)
from mergekit_loco.methods.iso import check_spectral
from mergekit_loco.methods.isometry import compact, compact_length, expand
from mergekit_loco.methods.plan import (
    Collectives,
    Layout,
    Plan,
    Pricing,
    delivery_bytes,
    stack_sum,
)
from mergekit_loco.task_vector import TaskVector

LowRank = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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


def common_subspace(summed: torch.Tensor, common: int, overwrite: bool = False) -> LowRank:
    """Top-``k`` thin-SVD factors of ``sum_t tau_t``: ``(U_k, s_k, Vh_k)``; ``overwrite``: the
    factorisation may use ``summed``'s memory (see :func:`~mergekit_loco.linalg.qr_layout`)."""
    return truncated_svd(summed, common, overwrite)


def task_specific_factors(
    delta: torch.Tensor, basis: torch.Tensor, per_task: int, complement: bool = False
) -> LowRank:
    """Top ``per_task`` SVD factors of ``tau - U_k U_k^T tau`` (tau outside the common space).

    ``basis`` is ``U_k``, or with ``complement`` an orthonormal basis ``U_c`` of the rest of
    R^m (m <= n: ``U = [U_k, U_c]`` is square), and then the residual is ``U_c U_c^T tau``.
    """
    coefficients = basis.mT @ delta
    if delta.shape[0] >= delta.shape[1]:  # column-major, for the QR to overwrite (qr_layout)
        projected = (coefficients.mT @ basis.mT).mT
    else:
        projected = basis @ coefficients
    residual = projected if complement else torch.sub(delta, projected, out=projected)
    return truncated_svd(residual, per_task, overwrite=True)


def noise_floor(deltas: Sequence[torch.Tensor], dtype: torch.dtype) -> float:
    """``max(m, n) eps sum_t ||tau_t||_F`` (eps of ``dtype``): numpy's matrix_rank tolerance at
    the scale of the tasks, which bounds ``s_max(M)`` and every ``||tau_t||``. A projection
    residual ``tau_t - U U^T tau_t`` that should vanish is rounding at that scale, not at
    ``tau_t``'s (measured: up to 2e-5 ``||tau_t||_F`` in float32 beside a task 1000x larger)."""
    scale = sum(float(frobenius_norm(delta.to(dtype))) for delta in deltas)
    return max(deltas[0].shape) * torch.finfo(dtype).eps * scale


def above(factors: LowRank, tolerance: float) -> LowRank:
    """The components of SVD factors whose singular value exceeds ``tolerance``."""
    return leading(factors, int((factors[1] > tolerance).sum()))


def orthogonal_blocks(factors: list[LowRank], spectral: str, rank_aware: bool = False):
    """``(mean(s), orth([U_blocks]) orth([Vh_blocks]))`` where orth is the polar factor (or its
    Newton-Schulz approximation; with ``rank_aware`` and exact,
    :func:`~mergekit_loco.linalg.rank_aware_polar`); the merged matrix is their product.
    Empties ``factors`` (each block is freed once concatenated)."""
    orthogonalise = None  # None: the polar factor
    if spectral == "ns":
        orthogonalise = newton_schulz
    elif rank_aware:
        orthogonalise = rank_aware_polar
    lefts, singulars, right_hs = (list(blocks) for blocks in zip(*factors, strict=True))
    factors.clear()
    right_h = polar_of_blocks(right_hs, 0, orthogonalise)
    return torch.cat(singulars).mean(), consuming_product(
        polar_of_blocks(lefts, 1, orthogonalise), right_h
    )


@dataclass(frozen=True)
class IsoCts(MergeMethod):
    """Iso-CTS per matrix: common subspace = top-k SVD of ``sum_t tau_t`` with
    ``k ~ common_fraction * d``; each task adds the top ``(d-k)/T`` directions of its residual
    outside it; the blocks [task-specific..., common] are polar-orthogonalised and all singular
    values replaced by their mean. Non-matrix tensors: mean over tasks.

    common_fraction in [0, 1), default 0.8; spectral="ns" orthogonalises the stacked blocks by
    Newton-Schulz instead of an SVD (the subspace SVDs remain): an approximation whose singular
    values are not flat and not at ``mean(s)`` (docs/methods.md, iso-cts).

    rank_aware=True keeps only the components above :func:`noise_floor` (of the common space
    and of each task's residual), orthogonalises the stacks over their non-zero directions
    (:func:`~mergekit_loco.linalg.rank_aware_polar`) and scales by the mean of the kept
    singular values: the same result on full-rank tasks, and a unique one where the sum or a
    residual has fewer non-zero components than its block (LoRA deltas, repeated tasks).
    """

    name = "iso-cts"
    common_fraction: float = 0.8
    spectral: str = "exact"
    rank_aware: bool = False

    def __post_init__(self):
        check_fraction(self.name, "common_fraction", self.common_fraction, False, True)
        check_spectral(self.name, self.spectral)

    def check_shapes(self, shapes: Mapping[str, Sequence[int]], tasks: int) -> None:
        for name, shape in shapes.items():
            if is_matrix_shape(shape):
                split_subspaces(name, min(shape), tasks, self.common_fraction)

    def parts(self, name: str, deltas: Sequence[torch.Tensor]):
        """``(mean(s), orthogonal)`` of matrix ``name`` (float32 at least); merged = product."""
        common, per_task = split_subspaces(
            name, min(deltas[0].shape), len(deltas), self.common_fraction
        )
        compute = torch.promote_types(deltas[0].dtype, torch.float32)
        summed = qr_layout(deltas[0], compute)
        for delta in deltas[1:]:
            summed += delta
        shared = common_subspace(summed, common, overwrite=True)
        del summed
        if self.rank_aware:
            tolerance = noise_floor(deltas, compute)
            shared = above(shared, tolerance)
        # one delta in float32 at a time; only its top factors outlive its residual's SVD
        blocks = [task_specific_factors(delta.to(compute), shared[0], per_task) for delta in deltas]
        if self.rank_aware:
            blocks = [above(block, tolerance) for block in blocks]
        blocks.append(shared)
        del shared
        if not any(len(singular) for _, singular, _ in blocks):
            return torch.zeros((), dtype=compute), torch.zeros(deltas[0].shape, dtype=compute)
        return orthogonal_blocks(blocks, self.spectral, self.rank_aware)

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        if not is_matrix(deltas[0]):
            return mean_of(deltas)
        scale, orthogonal = self.parts(name, deltas)
        return orthogonal.mul_(scale).to(deltas[0].dtype)

    def as_aggregator(self, round_index: int, workers: int) -> MergeMethod:
        """DiLoCo: Iso-CTS of ``tau_t / R`` on matrices, as the seed paper."""
        return OfWorkerMean(self, workers)

    def plans(self) -> Sequence[Plan]:
        """The low-rank plan; with ``rank_aware`` (blocks of varying size) the owner plan."""
        if self.rank_aware:
            return ()
        return (Plan("low-rank", self.run_low_rank, self.low_rank_bytes),)

    # -- the low-rank plan --------------------------------------------------------------------
    def matrix_route(self, name: str, shape, dtype, workers_per_rank, world, pricing) -> str:
        """How matrix ``name`` reaches its owner, whichever sends fewer bytes: ``"deltas"`` (the
        V deltas themselves; uncompressed only) or ``"factors"`` (the rank's sum, then the
        common basis back, then the V task factors); non-matrices: ``"sum"``."""
        if not is_matrix_shape(shape):
            return "sum"
        rows, cols = shape
        common, per_task = split_subspaces(
            name, min(shape), workers_per_rank * world, self.common_fraction
        )
        svd_width = pricing.width(torch.promote_types(dtype, torch.float32))
        deltas = workers_per_rank * rows * cols * pricing.width(dtype)
        factors = rows * cols + rows * basis_columns(shape, common)[0]
        factors += workers_per_rank * per_task * (rows + cols + 1)
        # compressed, raw deltas would be perturbed before the SVDs' truncations: factors only
        exact = pricing.compression is None
        return "deltas" if exact and deltas <= factors * svd_width else "factors"

    def delivery(self, shape, dtype, pricing) -> tuple[tuple[int, ...], torch.dtype]:
        """What the owner sends of a merged matrix: ``(shape, dtype)`` of the matrix, or of its
        compact Householder form (exact spectral, uncompressed, when that is fewer bytes)."""
        svd_dtype = torch.promote_types(dtype, torch.float32)
        length = compact_length(shape)
        if (
            self.spectral == "exact"
            and pricing.compression is None
            and length * pricing.width(svd_dtype) < math.prod(shape) * pricing.width(dtype)
        ):
            return (length,), svd_dtype
        return tuple(shape), dtype

    def run_low_rank(
        self, comm: Collectives, local: Sequence[TaskVector], names: list[str]
    ) -> list[torch.Tensor]:
        """Round 1: each matrix's owner gets this rank's V deltas or their sum (whichever is
        cheaper, :meth:`matrix_route`); non-matrices: the sum. Factor route: the owner's SVD of
        the sum; ``U_k`` (or, if narrower, its complement) goes to every rank; each rank sends
        its workers' task factors outside the common space to the owner. The owner
        orthogonalises and shares the result (compact when :meth:`delivery` says so)."""
        per_rank, world = len(local), comm.world
        workers = per_rank * world
        shapes = [local[0][name].shape for name in names]
        dtypes = [local[0][name].dtype for name in names]
        owners = comm.owners(shapes)
        routes = [
            self.matrix_route(n, s, d, per_rank, world, comm)
            for n, s, d in zip(names, shapes, dtypes, strict=True)
        ]
        sizes = {
            j: split_subspaces(names[j], min(shapes[j]), workers, self.common_fraction)
            for j, route in enumerate(routes)
            if route == "factors"
        }
        parcels = []
        for name, route in zip(names, routes, strict=True):
            deltas = [tv[name] for tv in local]
            if route == "factors":
                deltas = [stack_sum(in_svd_precision(deltas))]
            parcels.append(deltas if route == "deltas" else [stack_sum(deltas)])
        merged: list = [None] * len(names)
        shared: dict[int, LowRank] = {}
        bases: dict[int, torch.Tensor] = {}
        first = comm.to_owners(parcels, owners)
        with comm.spectral():
            for j, copies in enumerate(first):
                if copies is None:
                    continue
                if routes[j] == "sum":
                    merged[j] = stack_sum([parcel[0] for parcel in copies]) / workers
                elif routes[j] == "deltas":
                    merged[j] = self.parts(names[j], [d for parcel in copies for d in parcel])
                else:
                    left, singular, right_h = thin_svd(stack_sum([p[0] for p in copies]))
                    common = sizes[j][0]
                    shared[j] = left[:, :common], singular[:common], right_h[:common]
                    complement = basis_columns(shapes[j], common)[1]
                    bases[j] = left[:, common:] if complement else left[:, :common]
        svd_dtypes = [torch.promote_types(dtype, torch.float32) for dtype in dtypes]
        received_bases = comm.from_owners(
            [bases.get(j) for j in sizes],
            [
                ((shapes[j][0], basis_columns(shapes[j], sizes[j][0])[0]), svd_dtypes[j])
                for j in sizes
            ],
            [owners[j] for j in sizes],
        )
        parcels = []
        with comm.spectral():
            for j, basis in zip(sizes, received_bases, strict=True):
                if comm.compression is not None:  # a decoded basis is not orthonormal
                    basis = orthonormal_columns(basis)
                complement = basis_columns(shapes[j], sizes[j][0])[1]
                precise = in_svd_precision([tv[names[j]] for tv in local])
                parcels.append(
                    [
                        tensor
                        for delta in precise
                        for tensor in task_specific_factors(delta, basis, sizes[j][1], complement)
                    ]
                )
        received = comm.to_owners(parcels, [owners[j] for j in sizes])
        deliveries = [
            self.delivery(s, d, comm) if r != "sum" else (s, d)
            for r, s, d in zip(routes, shapes, dtypes, strict=True)
        ]
        with comm.spectral():
            for j, copies in zip(sizes, received, strict=True):
                if copies is not None:
                    specific = [
                        tuple(p[3 * v : 3 * v + 3]) for p in copies for v in range(per_rank)
                    ]
                    merged[j] = orthogonal_blocks([*specific, shared[j]], self.spectral)
            for j, part in enumerate(merged):
                if part is not None and routes[j] != "sum":
                    scale, orthogonal = part
                    packed = deliveries[j][0] != tuple(shapes[j])
                    merged[j] = compact(scale, orthogonal) if packed else scale * orthogonal
        arrived = comm.from_owners(merged, deliveries, owners, balance=True)
        return [
            expand(got, tuple(shape)).to(dtype) if delivery[0] != tuple(shape) else got
            for got, shape, dtype, delivery in zip(arrived, shapes, dtypes, deliveries, strict=True)
        ]

    def low_rank_bytes(
        self, layout: Layout, workers_per_rank: int, world: int, pricing: Pricing
    ) -> float:
        """All ranks together, ``(P-1)`` times, per matrix the cheaper route: ``V m n b`` or
        ``(m n + m c + V p (m+n+1)) b'`` (c: the basis width); per non-matrix ``N b``; plus
        delivering the results (:meth:`delivery`, relayed if that balances the ranks)."""
        workers = workers_per_rank * world
        total = 0.0
        for name, shape, dtype in layout:
            route = self.matrix_route(name, shape, dtype, workers_per_rank, world, pricing)
            if route != "factors":
                copies = workers_per_rank if route == "deltas" else 1
                total += copies * math.prod(shape) * pricing.width(dtype)
                continue
            rows, cols = shape
            common, per_task = split_subspaces(name, min(shape), workers, self.common_fraction)
            entries = rows * cols + rows * basis_columns(shape, common)[0]
            entries += workers_per_rank * per_task * (rows + cols + 1)
            total += entries * pricing.width(torch.promote_types(dtype, torch.float32))
        deliveries = [
            self.delivery(shape, dtype, pricing)
            if is_matrix_shape(shape)
            else (tuple(shape), dtype)
            for _, shape, dtype in layout
        ]
        owners = pricing.owners([shape for _, shape, _ in layout])
        return (world - 1) * total + delivery_bytes(deliveries, owners, world, pricing, True)


def basis_columns(shape, common: int) -> tuple[int, bool]:
    """``(columns, complement)`` of the common basis the owner shares: ``U_k`` (k columns), or
    for ``m <= n`` (U square) with ``m - k < k`` its complement ``U[:, k:]``."""
    rows, cols = shape
    if rows <= cols and rows - common < common:
        return rows - common, True
    return common, False


def orthonormal_columns(matrix: torch.Tensor) -> torch.Tensor:
    """Q of ``matrix = Q R`` with ``diag(R) >= 0``: the nearby orthonormal basis, same signs."""
    q, r = torch.linalg.qr(matrix)
    return q * torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(q.dtype)
