"""The contract every merge method fulfils: math on the deltas of one tensor name at a time."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from mergekit_loco.task_vector import TaskVector


@dataclass(frozen=True)
class MergeMethod:
    """A merge method: ``merged = f(tau_1, ..., tau_T)`` per tensor name.

    Subclasses are frozen dataclasses whose fields are the method's parameters, and implement
    :meth:`merge_tensor`. The same object merges checkpoints and aggregates DiLoCo deltas.
    """

    name: ClassVar[str]
    #: whether ``mloco merge`` needs a base (only ``mean`` of full models does not).
    needs_base: ClassVar[bool] = True
    #: as a DiLoCo aggregator, apply the method to ``tau_i / R`` (Iso-C, Iso-CTS) rather than to
    #: the raw worker deltas; this is the convention of the seed paper's reference code.
    aggregates_mean: ClassVar[bool] = False

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        """Merge the T deltas of tensor ``name`` (equal shapes) into one."""
        raise NotImplementedError

    def merge(self, task_vectors: Sequence[TaskVector]) -> TaskVector:
        """Merge whole task vectors, one tensor name at a time."""
        if not task_vectors:
            raise ValueError(f"{self.name}: no task vectors to merge")
        first = task_vectors[0]
        for index, other in enumerate(task_vectors[1:], start=2):
            if set(other) != set(first):
                missing = sorted(set(first) ^ set(other))[0]
                raise KeyError(f"task vector {index} and task vector 1 differ at {missing!r}")
        return TaskVector(
            {name: self.merge_tensor(name, [tv[name] for tv in task_vectors]) for name in first}
        )

    @classmethod
    def parameter_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def sum_of(deltas: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum_t tau_t``, accumulated in place (one extra tensor, not a T-fold stack)."""
    remaining = iter(deltas)
    total = next(remaining).clone()
    for delta in remaining:
        total += delta
    return total


def mean_of(deltas: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(1/T) sum_t tau_t``."""
    return sum_of(deltas).div_(len(deltas))


def is_matrix(delta: torch.Tensor) -> bool:
    """Spectral methods treat 2-D tensors (linear layers, embeddings, lm_head) as matrices."""
    return delta.ndim == 2


def in_svd_precision(deltas: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The deltas in float32 at least (there is no half-precision SVD); cast results back."""
    compute = torch.promote_types(deltas[0].dtype, torch.float32)
    return [delta.to(compute) for delta in deltas]


def check_fraction(method: str, option: str, value: float, low_open: bool, high_open: bool):
    """Raise ``ValueError`` unless ``value`` lies in the interval (low, high) with given ends."""
    low_ok = value > 0 if low_open else value >= 0
    high_ok = value < 1 if high_open else value <= 1
    if not (low_ok and high_ok):
        interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
        raise ValueError(f"{method}: {option} must lie in {interval}, got {value}")


def per_task_values(value: float | tuple[float, ...]) -> tuple[float, ...]:
    """A parameter given once for all tasks or once per task, as a tuple of its values."""
    return tuple(value) if isinstance(value, tuple | list) else (value,)


def per_task(method: str, option: str, value, index: int, tasks: int) -> float:
    """Task ``index``'s value of a parameter given once or per task (then exactly ``tasks``)."""
    if not isinstance(value, tuple | list):
        return value
    if len(value) != tasks:
        raise ValueError(f"{method}: {option} has {len(value)} values for {tasks} tasks")
    return value[index]


def task_weights(method: str, weights, tasks: int) -> tuple[float, ...] | None:
    """The per-task weights checked against the number of tasks (None: unweighted)."""
    if weights is not None and len(weights) != tasks:
        raise ValueError(f"{method}: weights has {len(weights)} values for {tasks} tasks")
    return None if weights is None else tuple(float(weight) for weight in weights)


def weighted_sum(deltas: Sequence[torch.Tensor], weights: Sequence[float] | None):
    """``sum_t w_t tau_t`` (a new tensor); without weights the mean ``(1/T) sum_t tau_t``."""
    if weights is None:
        return mean_of(deltas)
    total = deltas[0] * weights[0]
    for delta, weight in zip(deltas[1:], weights[1:], strict=True):
        total.add_(delta, alpha=weight)
    return total
