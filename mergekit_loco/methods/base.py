"""The contract every merge method fulfils: math on the deltas of one tensor name at a time."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from mergekit_loco.methods.plan import Plan
from mergekit_loco.task_vector import TaskVector, all_finite


def task_vector_list(values: object, call: str, item: str) -> list[Mapping]:
    """``values`` (a list, or any iterable: read once) as a list; a TypeError naming ``call``
    (``mean.merge``) for one mapping or tensor given alone, an ``item`` that is not a mapping,
    or one that maps a name to anything but a tensor (a numpy array)."""
    if isinstance(values, Mapping | torch.Tensor) or not isinstance(values, Iterable):
        raise TypeError(
            f"{call} takes a list of {item}s ([tau_1, tau_2, ...]), not a {type(values).__name__}"
        )
    values = list(values)
    for index, value in enumerate(values, start=1):
        if not isinstance(value, Mapping):
            raise TypeError(
                f"{call}: {item} {index} is a {type(value).__name__}, not a TaskVector (a "
                "mapping of tensor name -> delta)"
            )
        if not isinstance(value, TaskVector):
            odd = next((n for n, t in value.items() if not isinstance(t, torch.Tensor)), None)
            if odd is not None:
                raise TypeError(
                    f"{call}: {item} {index} maps {odd!r} to a {type(value[odd]).__name__}, "
                    "not a torch.Tensor (torch.from_numpy converts an array)"
                )
    return values


def check_implemented(method: MergeMethod) -> None:
    """Raise ``TypeError`` naming the class unless ``method`` has a ``name`` (a non-empty str:
    messages, summaries and the registry use it) and its math: the sum contract
    (:meth:`~MergeMethod.local_term` and :meth:`~MergeMethod.finish`) or its own
    :meth:`~MergeMethod.merge_tensor`."""
    kind = type(method)
    name = getattr(method, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"{kind.__name__}: a merge method needs a name, a non-empty str (a class attribute: "
            f'name = "my-method"), not {name!r}'
        )
    if method.is_sum() and kind.finish is MergeMethod.finish:
        raise TypeError(f"{name}: declares local_term but not finish (merged = finish(sum))")
    if not method.is_sum() and kind.merge_tensor is MergeMethod.merge_tensor:
        raise TypeError(
            f"{name}: declare local_term and finish (merged = finish(sum_t local_term(tau_t, "
            "t))), or merge_tensor"
        )


def check_deltas(
    method: str, name: str, deltas: Sequence[torch.Tensor], label: str = "delta"
) -> None:
    """The one check of the deltas of tensor ``name`` that every merge runs (``label``: what
    each delta is to the caller, ``delta`` or ``task vector``): ``TypeError`` unless they are a
    list of tensors; ``ValueError`` naming the tensor for none, for two of different shapes
    (nothing is broadcast or flattened), for one that is not floating, or for dtypes without a
    promoted dtype (8-bit floats). Compares types and shapes only."""
    if isinstance(deltas, torch.Tensor) or not isinstance(deltas, Sequence):
        raise TypeError(
            f"{method}: the deltas of tensor {name!r} must be a list of tensors (one per task), "
            f"not a {type(deltas).__name__}"
        )
    if not deltas:
        raise ValueError(f"{method}: no deltas to merge for tensor {name!r}")
    shape = None
    for index, delta in enumerate(deltas, start=1):
        if not isinstance(delta, torch.Tensor):
            raise TypeError(
                f"{method}: {label} {index} of tensor {name!r} is a {type(delta).__name__}, "
                "not a torch.Tensor"
            )
        if shape is None:
            shape = delta.shape
        elif delta.shape != shape:
            raise ValueError(
                f"{method}: tensor {name!r} is {list(delta.shape)} in {label} {index} but "
                f"{list(shape)} in {label} 1"
            )
        if not delta.is_floating_point():
            raise ValueError(
                f"{method}: tensor {name!r} of {label} {index} is {delta.dtype}: only floating "
                "deltas are merged (integer tensors are copied from a base, as "
                "merge_checkpoints does)"
            )
    try:
        promoted_dtype(deltas)
    except RuntimeError:
        dtypes = " and ".join(sorted({str(delta.dtype) for delta in deltas}))
        raise ValueError(
            f"{method}: tensor {name!r} is {dtypes}, which have no common dtype"
        ) from None


def check_finite(method: str, name: str, deltas: Sequence[torch.Tensor]) -> None:
    """``ValueError`` naming tensor ``name`` and the delta that holds NaN or Inf: a merge would
    spread it into every entry it touches (a sum) or fail inside an SVD. Meta tensors (no
    values) pass."""
    for index, delta in enumerate(deltas, start=1):
        if delta.device.type != "meta" and not all_finite(delta):
            raise ValueError(
                f"{method}: delta {index} of tensor {name!r} holds NaN or Inf (a damaged "
                "checkpoint, a diverged worker, or a difference beyond its dtype's range); a "
                "merge of it is not defined"
            )


def checks_deltas(merge_tensor: Callable) -> Callable:
    """``merge_tensor`` behind the one validation point of every method: :func:`check_implemented`,
    :func:`check_deltas`, :meth:`~MergeMethod.check_tasks` and :func:`check_finite`, then the
    deltas in their promoted dtype (:func:`in_one_dtype`) and detached (a delta is data, not an
    autograd graph); the result must be a tensor of the deltas' shape (a method of one's own
    that returns another is named, not written). Costs a type and shape comparison and a sum
    per delta; deltas of one dtype that need no grad pass as given."""
    if getattr(merge_tensor, "checks_deltas", False):
        return merge_tensor

    @functools.wraps(merge_tensor)
    def checked(self: MergeMethod, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        check_implemented(self)
        check_deltas(self.name, name, deltas)
        self.check_tasks(len(deltas))
        check_finite(self.name, name, deltas)
        if any(delta.requires_grad for delta in deltas):
            deltas = [delta.detach() for delta in deltas]
        merged = merge_tensor(self, name, in_one_dtype(deltas))
        if not isinstance(merged, torch.Tensor) or merged.shape != deltas[0].shape:
            what = (
                f"a {list(merged.shape)} tensor"
                if isinstance(merged, torch.Tensor)
                else f"a {type(merged).__name__}"
            )
            raise TypeError(
                f"{self.name}: merge_tensor of tensor {name!r} returned {what}; it must return "
                f"one tensor of the deltas' shape, {list(deltas[0].shape)}"
            )
        return merged

    checked.checks_deltas = True  # type: ignore[attr-defined]
    return checked


@dataclass(frozen=True)
class MergeMethod:
    """A merge method: ``merged = f(tau_1, ..., tau_T)`` per tensor name.

    Subclasses are frozen dataclasses whose fields are the method's parameters. A method whose
    result is a function of one sum, ``merged = finish(sum_t local_term(tau_t, t))``, declares
    :meth:`local_term` and :meth:`finish`; :meth:`merge_tensor` is derived from them, and the
    same two functions run the distributed merge (local sums, one all-reduce, finish). Any
    other method implements :meth:`merge_tensor`, and may declare distributed :meth:`plans`
    (without one it runs on the generic owner plan: each tensor merged on one rank).
    """

    name: ClassVar[str]
    #: whether ``mloco merge`` needs a base (only ``mean`` of full models does not).
    needs_base: ClassVar[bool] = True
    #: a sum method whose :meth:`finish` does spectral work on matrices: distributed, it runs
    #: once per tensor, on the tensor's owner rank, instead of on every rank.
    finish_on_owner: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        """A subclass's own :meth:`merge_tensor` runs behind :func:`checks_deltas`, so every
        method, built in or not, validates its deltas at one point."""
        super().__init_subclass__(**kwargs)
        if "merge_tensor" in vars(cls):
            cls.merge_tensor = checks_deltas(vars(cls)["merge_tensor"])

    # -- the sum contract ---------------------------------------------------------------------
    def local_term(self, name: str, delta: torch.Tensor, worker_index: int) -> torch.Tensor:
        """``h(tau_t, t)`` for worker/task ``t = worker_index`` (global 0-based index)."""
        raise NotImplementedError

    def finish(self, name: str, total: torch.Tensor, workers: int) -> torch.Tensor:
        """``merged = g(sum_t h(tau_t, t), T)``; ``total`` is the method's to reuse in place."""
        raise NotImplementedError

    def term_dtype(self, shape: Sequence[int], dtype: torch.dtype) -> torch.dtype:
        """dtype of :meth:`local_term` for a delta of ``shape`` and ``dtype`` (what travels)."""
        return dtype

    def is_sum(self) -> bool:
        """Whether the method fulfils the sum contract (declares :meth:`local_term`)."""
        return type(self).local_term is not MergeMethod.local_term

    @checks_deltas
    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        """Merge the T deltas of tensor ``name`` into one, in the dtype they promote to.

        Every method's ``merge_tensor`` runs behind :func:`checks_deltas`: ``TypeError`` for a
        method without a name or math (:func:`check_implemented`) or deltas that are not a list
        of tensors, ``ValueError`` naming the tensor for no deltas, deltas of different shapes
        or not floating, per-task options of another length, or a delta holding NaN or Inf
        (:func:`check_finite`); deltas of mixed dtypes are cast to their promoted dtype and
        deltas that require grad are detached.
        """
        terms = (self.local_term(name, widened(delta), index) for index, delta in enumerate(deltas))
        return self.finish(name, sum_of(terms), len(deltas)).to(deltas[0].dtype)

    # -- beyond one sum -----------------------------------------------------------------------
    def plans(self) -> Sequence[Plan]:
        """The method's own distributed plans (see :mod:`mergekit_loco.methods.plan`)."""
        return ()

    def weighted(self, term: torch.Tensor, worker_index: int, owned: bool = False) -> torch.Tensor:
        """``w_t * term`` for task ``worker_index`` of a method with a ``weights`` field (the
        term itself when unweighted); multiplied in place when the caller ``owned`` it."""
        weights = getattr(self, "weights", None)
        if weights is None:
            return term
        weight = per_task(self.name, "weights", weights, worker_index)
        return term.mul_(weight) if owned else term * weight

    def check_shapes(self, shapes: Mapping[str, Sequence[int]], tasks: int) -> None:
        """Raise ``ValueError`` naming the tensor if merging ``tasks`` deltas of these shapes
        must fail on a shape (checked before any compute). Default: every shape works."""

    def check_tasks(self, tasks: int) -> None:
        """Raise ``ValueError`` naming the option unless every option given per task (a tuple:
        ``weights``, a per-task ``density`` or ``gamma``) holds exactly ``tasks`` values."""
        for option in fields(self):
            value = getattr(self, option.name)
            if isinstance(value, tuple | list) and len(value) != tasks:
                raise ValueError(
                    f"{self.name}: {option.name} has {len(value)} values for {tasks} tasks"
                )

    def as_aggregator(self, round_index: int, workers: int) -> MergeMethod:
        """The method as DiLoCo's aggregator of ``workers`` deltas in outer step
        ``round_index`` (0-based). Default: itself."""
        return self

    def merge(self, task_vectors: Iterable[TaskVector]) -> TaskVector:
        """Merge whole task vectors, one tensor name at a time (:meth:`merge_tensor`); deltas of
        one name in different floating dtypes are merged in their promoted dtype (whatever the
        order). ``task_vectors``: a list, or any iterable (read once). Before any compute,
        raises TypeError for anything but mappings, KeyError for a name not in every task
        vector, and ValueError, naming the tensor, for deltas of different shapes or a delta
        that is not floating (integer tensors are never merged): :func:`check_deltas` for
        every name. A delta holding NaN or Inf is refused (ValueError naming it) when its name
        is merged, and so is a merge of finite deltas that is not finite (an overflow of their
        dtype), as :func:`~mergekit_loco.merge.merge_checkpoints` refuses it."""
        check_implemented(self)
        task_vectors = task_vector_list(task_vectors, f"{self.name}.merge", "task vector")
        if not task_vectors:
            raise ValueError(f"{self.name}: no task vectors to merge")
        self.check_tasks(len(task_vectors))
        first = task_vectors[0]
        for index, other in enumerate(task_vectors[1:], start=2):
            if set(other) != set(first):
                missing = sorted(set(first) ^ set(other))[0]
                raise KeyError(f"task vector {index} and task vector 1 differ at {missing!r}")
        for name in first:
            check_deltas(self.name, name, [tv[name] for tv in task_vectors], "task vector")
        merged = {}
        for name in first:
            merged[name] = self.merge_tensor(name, [tv[name] for tv in task_vectors])
            if merged[name].device.type != "meta" and not all_finite(merged[name]):
                raise ValueError(
                    f"{self.name}: tensor {name!r}: the merge of finite deltas overflows "
                    f"{merged[name].dtype}; merge them in float64 (tv.to(torch.float64))"
                )
        return TaskVector(merged)

    @classmethod
    def parameter_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True)
class OfWorkerMean(MergeMethod):
    """``method`` applied to ``tau_t / workers`` on matrices (non-matrices as they are): the
    aggregator convention of the seed paper's Iso-C and Iso-CTS (their spectra are those of the
    workers' mean, not of the sum)."""

    method: MergeMethod
    workers: int

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.method.name

    def scaled(self, delta: torch.Tensor) -> torch.Tensor:
        """``tau / R`` on a matrix, in float32 at least (half precision rounds once, later)."""
        return widened(delta) / self.workers if is_matrix(delta) else delta

    def local_term(self, name: str, delta: torch.Tensor, worker_index: int) -> torch.Tensor:
        return self.method.local_term(name, self.scaled(delta), worker_index)

    def finish(self, name: str, total: torch.Tensor, workers: int) -> torch.Tensor:
        return self.method.finish(name, total, workers)

    def term_dtype(self, shape: Sequence[int], dtype: torch.dtype) -> torch.dtype:
        return self.method.term_dtype(shape, dtype)

    def is_sum(self) -> bool:
        return self.method.is_sum()

    @property
    def finish_on_owner(self) -> bool:  # type: ignore[override]
        return self.method.finish_on_owner

    def check_shapes(self, shapes: Mapping[str, Sequence[int]], tasks: int) -> None:
        self.method.check_shapes(shapes, tasks)

    def check_tasks(self, tasks: int) -> None:
        self.method.check_tasks(tasks)

    def merge_tensor(self, name: str, deltas: Sequence[torch.Tensor]) -> torch.Tensor:
        merged = self.method.merge_tensor(name, [self.scaled(delta) for delta in deltas])
        return merged.to(deltas[0].dtype)

    def plans(self) -> Sequence[Plan]:
        def scaled_run(run):
            def run_on_scaled(comm, local, names):
                scaled = [TaskVector({n: self.scaled(d) for n, d in tv.items()}) for tv in local]
                return run(comm, scaled, names)

            return run_on_scaled

        return [Plan(p.name, scaled_run(p.run), p.cost) for p in self.method.plans()]


def promoted_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype all of ``tensors`` promote to (float32 for bfloat16 with float16), whatever
    their order; RuntimeError where torch has none (8-bit floats)."""
    return functools.reduce(torch.promote_types, sorted({t.dtype for t in tensors}, key=str))


def in_one_dtype(deltas: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """``deltas`` cast to their :func:`promoted_dtype` (float32 and float64 deltas: float64);
    ``deltas`` themselves when they share one dtype."""
    if all(delta.dtype == deltas[0].dtype for delta in deltas):
        return deltas
    dtype = promoted_dtype(deltas)
    return [delta.to(dtype) for delta in deltas]


def widened(delta: torch.Tensor) -> torch.Tensor:
    """``delta`` in float32 at least: a half-precision term (``w_t tau_t``, ``tau_t / R``) is
    computed in float32 and the merge rounds once, at the end."""
    return delta.to(torch.promote_types(delta.dtype, torch.float32))


def sum_of(deltas: Iterable[torch.Tensor]) -> torch.Tensor:
    """``sum_t tau_t``, accumulated in place (one extra tensor, not a T-fold stack) in float32
    at least: half-precision deltas are rounded once, by the caller, not at every addition
    (in bfloat16, ``256 + 1`` is ``256`` again)."""
    remaining = iter(deltas)
    first = next(remaining)
    total = first.to(torch.promote_types(first.dtype, torch.float32), copy=True)
    for delta in remaining:
        total += delta
    return total


def mean_of(deltas: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(1/T) sum_t tau_t`` in the deltas' dtype (summed as :func:`sum_of`)."""
    return sum_of(deltas).div_(len(deltas)).to(deltas[0].dtype)


def is_matrix_shape(shape: Sequence[int]) -> bool:
    """Spectral methods treat 2-D tensors (linear layers, embeddings, lm_head) as matrices; a
    2-D tensor with no entries has no spectrum and is merged as a non-matrix (an empty mean)."""
    return len(shape) == 2 and min(shape) > 0


def is_matrix(delta: torch.Tensor) -> bool:
    """:func:`is_matrix_shape` of ``delta``'s shape."""
    return is_matrix_shape(delta.shape)


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


def per_task(method: str, option: str, value, index: int, tasks: int | None = None) -> float:
    """Task ``index``'s value of a parameter given once or per task (then one per task:
    exactly ``tasks`` where that is known)."""
    if not isinstance(value, tuple | list):
        return value
    if tasks is not None and len(value) != tasks:
        raise ValueError(f"{method}: {option} has {len(value)} values for {tasks} tasks")
    if index >= len(value):
        raise ValueError(f"{method}: {option} has {len(value)} values, none for task {index + 1}")
    return value[index]


def task_weights(method: str, weights, tasks: int) -> tuple[float, ...] | None:
    """The per-task weights checked against the number of tasks (None: unweighted)."""
    if weights is not None and len(weights) != tasks:
        raise ValueError(f"{method}: weights has {len(weights)} values for {tasks} tasks")
    return None if weights is None else tuple(float(weight) for weight in weights)
