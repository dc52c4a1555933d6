"""Merging LoRA adapters from their factors: deltas ``tau_t = B_t A_t`` of rank <= r.

The sum of T such deltas is ``L R`` with ``L = [B_1 .. B_T]`` (m x Tr) and ``R = [A_1; ..; A_T]``
(Tr x n), so it has rank <= Tr and its thin SVD needs no dense m x n delta: with
``L = Q_L R_L`` and ``R^T = Q_R R_R`` (QR), ``L R = Q_L (R_L R_R^T) Q_R^T`` and the SVD of the
small core ``R_L R_R^T = U_c S V_c^T`` gives ``U = Q_L U_c``, ``V = Q_R V_c``.

``ta`` and ``mean`` can also be written as one LoRA adapter (:func:`merge_to_lora`).

Methods computed from the factors: ``mean`` and ``ta`` (``L R`` with the weights folded into L)
and rank-aware exact ``iso-c`` (``mean(s) U V^T`` over the non-zero singular values, which is
determined by the deltas; without ``rank_aware`` Iso-C spreads mean(s) over arbitrary null-space
directions, so it runs on dense deltas). Every other method gets dense deltas ``B_t A_t``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from mergekit_loco.io import CheckpointError, open_checkpoint
from mergekit_loco.io.atomic import is_file_output
from mergekit_loco.io.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    KEY_PREFIX,
    LoraAdapter,
    is_lora_adapter,
    write_lora_adapter,
)
from mergekit_loco.linalg import numerical_rank, thin_svd
from mergekit_loco.merge_checks import check_distinct, checked_scale
from mergekit_loco.methods import MergeMethod
from mergekit_loco.methods.base import is_matrix_shape, task_weights
from mergekit_loco.methods.iso import IsoC
from mergekit_loco.methods.mean import Mean
from mergekit_loco.methods.ta import TaskArithmetic

#: Fields of an input adapter's config that select the modules it adapts: the first input's would
#: apply to every merged module under --lora-output (its exclude_modules dropped another's delta).
SELECTING_FIELDS = ("exclude_modules", "target_parameters", "layers_pattern")


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
    if isinstance(method, Mean):
        weights = method.fractions(count)  # w_t / W
    else:
        weights = (
            task_weights(method.name, getattr(method, "weights", None), count) or (1.0,) * count
        )
    stacked = stacked_factors(items, weights, dtype, device)
    if stacked is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    left, right = stacked
    if not isinstance(method, IsoC):
        return left @ right
    if not is_matrix_shape(shape):
        return (left @ right) / count  # Iso-C takes the mean of non-matrix tensors
    precise = torch.promote_types(dtype, torch.float32)
    u, singular, vh = low_rank_svd(left.to(precise), right.to(precise))
    if not bool(singular.isfinite().all()):  # finite factors, a product past ``precise``
        raise ValueError(
            f"{method.name}: the deltas of tensor {name!r} overflow {precise} (an adapter's B A "
            "is larger than it holds); try --compute-dtype float64"
        )
    rank = numerical_rank(singular, shape)
    if rank == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return (singular[:rank].mean() * (u[:, :rank] @ vh[:rank])).to(dtype)


def product_is_finite(left: torch.Tensor, right: torch.Tensor) -> bool:
    """Whether ``left @ right`` (m x r @ r x n) is finite in ``left``'s dtype. The m x n product
    is formed only when the bound ``|(L R)_ij| <= |L_i| |R_:j|`` (Cauchy-Schwarz, over rows of L
    and columns of R) does not rule out overflow."""
    row_norms = torch.linalg.vector_norm(left.double(), dim=1)
    column_norms = torch.linalg.vector_norm(right.double(), dim=0)
    bound = row_norms.max() * column_norms.max()
    return bool(bound <= torch.finfo(left.dtype).max) or bool((left @ right).isfinite().all())


def rank_pattern(ranks: dict[str, int], rank: int) -> dict[str, int]:
    """The ``rank_pattern`` that gives each module its rank in ``ranks`` where the default is
    ``rank``, under PEFT's rule (the first key, a regular expression, that matches the module's
    name or a dotted suffix of it: :class:`~mergekit_loco.io.lora.ModulePattern`): the modules
    of another rank, and every module whose name ends in ``.`` + one of those (else that key
    would apply to it), longest first (so each module meets its own key first), each key
    spelled to match its own name only (:func:`literal_key`)."""
    other = {module for module, value in ranks.items() if value != rank}
    keys = other | {module for module in ranks if any(module.endswith(f".{k}") for k in other)}
    ordered = sorted(keys, key=lambda key: (-len(key), key))
    return {literal_key(module, ranks): ranks[module] for module in ordered}


def literal_key(module: str, modules: Iterable[str]) -> str:
    """``module`` as a pattern key that PEFT applies to ``module`` and to the ``modules``
    whose name ends in ``.module``, and to no other of them: the name itself where its
    regular-expression reading does that (each ``.`` matches any character, so ``a.b`` would
    also match a module ``a_b``), else the name with its special characters escaped."""
    exact = {name for name in modules if name == module or name.endswith(f".{module}")}
    try:
        read = re.compile(rf"(.*\.)?({module})$")
    except re.error:
        return re.escape(module)
    if {name for name in modules if read.match(name)} == exact:
        return module
    return re.escape(module)


def check_same_shapes(adapters: Sequence[LoraAdapter]) -> None:
    """Adapters that adapt one tensor give deltas of one shape (B rows, A columns); raises
    :class:`CheckpointError` naming both adapters."""
    first: dict[str, LoraAdapter] = {}
    for adapter in adapters:
        for name in adapter.targets():
            other = first.setdefault(name, adapter)
            if other.delta_shape(name) != adapter.delta_shape(name):
                raise CheckpointError(
                    f"{adapter.path}: {name!r}: its delta has shape "
                    f"{list(adapter.delta_shape(name))} but {other.path} gives "
                    f"{list(other.delta_shape(name))}"
                )


def merge_to_lora(
    adapter_paths: Sequence[str | Path],
    method: MergeMethod,
    out: str | Path,
    scale: float = 1.0,
    base: str | Path | None = None,
    force: bool = False,
    dtype: torch.dtype = torch.float32,
    compute_dtype: torch.dtype = torch.float32,
) -> Path:
    """``ta`` or ``mean`` of LoRA adapters written as one LoRA adapter folder ``out``, exactly.

    ``scale * sum_t c_t B_t A_t = B' A'`` with ``B' = [scale c_1 B_1 .. scale c_T B_T]`` and
    ``A' = [A_1; ..; A_T]`` per module, where ``c_t = w_t * scaling_t`` (``w_t`` = the method's
    weights; for ``mean`` divided by their sum). The adapter's rank per module is the sum of the
    ranks that adapt it (``r`` the most common, others in ``rank_pattern``) and ``lora_alpha``
    equals it, so its scaling is 1. ``base``, if given, is checked against every adapter.
    The factors are scaled in ``compute_dtype`` and written in ``dtype``.
    Each adapter counts once; a module's deltas must share their shape and the merged delta
    must be finite in ``dtype`` (else :class:`CheckpointError`, nothing written); ``out`` is a
    folder, never a name ending in ``.safetensors``.
    """
    if not isinstance(method, Mean | TaskArithmetic):
        raise ValueError(
            f"--lora-output: only ta and mean of adapters are low-rank, not {method.name}"
        )
    if is_file_output(Path(out)):
        raise ValueError(
            f"-o {out}: --lora-output writes an adapter folder ({ADAPTER_CONFIG} and "
            f"{ADAPTER_WEIGHTS}), not a .safetensors file; give a folder name"
        )
    for option, value in (("--dtype", dtype), ("--compute-dtype", compute_dtype)):
        if not value.is_floating_point:
            raise ValueError(f"{option}: {value} is not a floating-point dtype")
    scale = checked_scale(scale, compute_dtype)
    method.check_tasks(len(adapter_paths))
    check_distinct([Path(path) for path in adapter_paths], Path(base) if base is not None else None)
    with ExitStack() as stack:
        adapters = []
        for path in adapter_paths:
            if not is_lora_adapter(path):
                raise CheckpointError(
                    f"{path}: --lora-output needs LoRA adapters (no {ADAPTER_CONFIG})"
                )
            adapters.append(stack.enter_context(LoraAdapter(path)))
        if base is not None:
            base_reader = stack.enter_context(open_checkpoint(base))
            for adapter in adapters:
                adapter.check_against(base_reader)
        check_same_shapes(adapters)
        count = len(adapters)
        if isinstance(method, Mean):
            weights = method.fractions(count)  # w_t / W
        else:
            weights = task_weights(method.name, method.weights, count) or (1.0,) * count
        tensors, ranks = {}, {}
        names = list(dict.fromkeys(name for adapter in adapters for name in adapter.targets()))
        for name in names:
            used = [(a, w) for a, w in zip(adapters, weights, strict=True) if name in a]
            factors = [(a.factors(name, compute_dtype), w) for a, w in used]
            module = name.removesuffix(".weight")
            key = f"{KEY_PREFIX}{module}"
            lora_b = torch.cat([b * (scale * w) for (b, _), w in factors], 1).to(dtype)
            lora_a = torch.cat([a for (_, a), _ in factors], 0).to(dtype)
            if not product_is_finite(lora_b, lora_a):
                raise CheckpointError(
                    f"--lora-output: the merged delta of {name!r} is not finite in "
                    f"{str(dtype).removeprefix('torch.')} (overflow? lower --scale or the weights)"
                )
            tensors[f"{key}.lora_B.weight"], tensors[f"{key}.lora_A.weight"] = lora_b, lora_a
            ranks[module] = lora_a.shape[0]
        rank = Counter(ranks.values()).most_common(1)[0][0]
        pattern = rank_pattern(ranks, rank)
        first = {k: v for k, v in adapters[0].config.items() if k not in SELECTING_FIELDS}
        config = first | {
            "r": rank,
            "lora_alpha": rank,
            "use_rslora": False,
            "rank_pattern": pattern,
            "alpha_pattern": dict(pattern),
            "target_modules": sorted(ranks),  # full names: PEFT matches them exactly
        }
        return write_lora_adapter(out, tensors, config, force, [*adapter_paths, base])
