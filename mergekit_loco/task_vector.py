"""TaskVector: an ordered mapping from tensor name to delta.

A fine-tune's task vector is ``finetuned - base``; a DiLoCo worker's delta is ``worker - global``.
Both are the same object here, and every merge method consumes a list of them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch


def is_mergeable(tensor: torch.Tensor) -> bool:
    """Floating tensors are merged; integer and boolean tensors (buffers, ids) are copied."""
    return tensor.is_floating_point()


def all_finite(tensor: torch.Tensor) -> bool:
    """NaN and Inf propagate into a sum, so a finite sum proves every entry finite (and is
    several times cheaper than ``isfinite``); only an overflowing sum needs the full check.
    8-bit floats (F8_E4M3, F8_E5M2), which torch cannot sum, are checked in float32."""
    if tensor.dtype.itemsize == 1:
        tensor = tensor.float()
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


class TaskVector(Mapping[str, torch.Tensor]):
    """Ordered ``name -> delta`` mapping with vector-space arithmetic.

    ``TaskVector(mapping)`` wraps any name -> tensor mapping (no copy of the data). A delta is
    data, not an autograd graph: each tensor is held detached (``delta.detach()``, the same
    memory), so a task vector of ``model.named_parameters()`` needs no grad and keeps no graph.
    Arithmetic returns new TaskVectors: ``a + b``, ``a - b``, ``c * a``, ``-a`` (``c`` a real
    number, numpy's too, on either side; as for tensors, NaN or Inf gives non-finite deltas,
    which every merge method refuses). Keys and each tensor's shape must
    match exactly (KeyError / ValueError naming the tensor; nothing is broadcast). Raises
    TypeError, naming the key, for a value that is not a tensor.

    Equality is identity, as for ``torch.nn.Module``: ``a == b`` only if ``a is b`` (comparing
    tensors has no single truth value), so task vectors hash, and ``a in [a, b]`` or a dict
    keyed by task vectors work. Compare contents with ``torch.equal`` tensor by tensor.
    """

    __eq__ = object.__eq__
    __hash__ = object.__hash__
    __array_ufunc__ = None  # numpy scalar * task vector: numpy defers to __rmul__

    def __init__(self, deltas: Mapping[str, torch.Tensor]):
        if not isinstance(deltas, Mapping):
            raise TypeError(
                f"TaskVector takes a mapping of tensor name -> delta tensor, not a "
                f"{type(deltas).__name__}"
            )
        for name, delta in deltas.items():
            if not isinstance(delta, torch.Tensor):
                raise TypeError(
                    f"TaskVector: the delta of {name!r} is a {type(delta).__name__}, not a "
                    "torch.Tensor"
                )
        self._deltas: dict[str, torch.Tensor] = {
            name: delta.detach() for name, delta in deltas.items()
        }

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_state_dicts(
        cls,
        finetuned: Mapping[str, torch.Tensor],
        base: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
    ) -> TaskVector:
        """``tau = finetuned - base`` over the floating tensors of ``base``, returned in ``dtype``
        (a floating ``torch.dtype``). The difference is taken in the widest of the two tensors'
        dtypes, ``dtype`` and float32, then rounded once to ``dtype``: a small fine-tuning step
        survives ``dtype=torch.bfloat16``. Raises TypeError for a state dict that is not a
        mapping (a module, ``named_parameters()``), a ``dtype`` that is not a torch.dtype or a
        value that is not a tensor (naming it), ValueError for an integer ``dtype`` or another
        shape, KeyError for a tensor of the base missing from ``finetuned``."""
        for whose, given in (("finetuned", finetuned), ("base", base)):
            if not isinstance(given, Mapping):
                raise TypeError(
                    f"from_state_dicts: {whose} must map tensor names to tensors (a state_dict: "
                    f"model.state_dict()), not a {type(given).__name__}"
                )
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"from_state_dicts: dtype must be a torch.dtype, not {dtype!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"from_state_dicts: dtype must be floating point, not {dtype}")
        missing = [name for name in base if name not in finetuned]
        if missing:
            raise KeyError(
                f"tensor {missing[0]!r} of the base is missing from the fine-tuned model"
            )
        deltas = {}
        for name, base_tensor in base.items():
            for whose, tensor in (("base", base_tensor), ("fine-tuned model", finetuned[name])):
                if not isinstance(tensor, torch.Tensor):
                    raise TypeError(
                        f"from_state_dicts: tensor {name!r} of the {whose} is a "
                        f"{type(tensor).__name__}, not a torch.Tensor"
                    )
            if not is_mergeable(base_tensor):
                continue
            tuned = finetuned[name]
            check_same_shape(name, tuned, base_tensor, "the base's")
            compute = torch.promote_types(tuned.dtype, base_tensor.dtype)
            compute = torch.promote_types(torch.promote_types(compute, dtype), torch.float32)
            deltas[name] = (tuned.to(compute) - base_tensor.to(compute)).to(dtype)
        return cls(deltas)

    @classmethod
    def from_checkpoints(
        cls, finetuned: str | Path, base: str | Path, dtype: torch.dtype = torch.float32
    ) -> TaskVector:
        """Load two checkpoints (file or HF folder) fully and subtract. For big models prefer
        :func:`mergekit_loco.merge_checkpoints`, which streams one tensor at a time."""
        from mergekit_loco.io import open_checkpoint

        with open_checkpoint(finetuned) as tuned_reader, open_checkpoint(base) as base_reader:
            base_sd = {name: base_reader.get(name) for name in base_reader.names()}
            tuned_sd = {name: tuned_reader.get(name) for name in base_sd if name in tuned_reader}
        return cls.from_state_dicts(tuned_sd, base_sd, dtype=dtype)

    # -- mapping protocol -----------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        return self._deltas[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._deltas)

    def __len__(self) -> int:
        return len(self._deltas)

    def __repr__(self) -> str:
        numel = sum(t.numel() for t in self._deltas.values())
        return f"TaskVector({len(self)} tensors, {numel} elements)"

    # -- arithmetic ---------------------------------------------------------------------------
    def _zip(self, other: TaskVector) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        if set(self) != set(other):
            diff = sorted(set(self) ^ set(other))
            raise KeyError(f"task vectors hold different tensors, e.g. {diff[0]!r}")
        for name, delta in self._deltas.items():
            check_same_shape(name, delta, other[name], "the other task vector's")
            yield name, delta, other[name]

    def __add__(self, other: TaskVector) -> TaskVector:
        if not isinstance(other, TaskVector):
            return NotImplemented
        return TaskVector({name: a + b for name, a, b in self._zip(other)})

    def __sub__(self, other: TaskVector) -> TaskVector:
        if not isinstance(other, TaskVector):
            return NotImplemented
        return TaskVector({name: a - b for name, a, b in self._zip(other)})

    def __mul__(self, scalar: float) -> TaskVector:
        if not isinstance(scalar, numbers.Real) or isinstance(scalar, bool):
            return NotImplemented
        return TaskVector({name: delta * scalar for name, delta in self._deltas.items()})

    __rmul__ = __mul__

    def __neg__(self) -> TaskVector:
        return self * -1.0

    def to(self, *args: Any, **kwargs: Any) -> TaskVector:
        """Every delta's ``delta.to(*args, **kwargs)``: as ``torch.Tensor.to``, a dtype, a device
        or both, positional or by keyword (``tau.to("cuda")``, ``tau.to(torch.bfloat16)``,
        ``tau.to(device="cpu", dtype=torch.float64)``)."""
        return TaskVector({n: d.to(*args, **kwargs) for n, d in self._deltas.items()})

    def apply_to(
        self, base: Mapping[str, torch.Tensor], scale: float = 1.0
    ) -> dict[str, torch.Tensor]:
        """``theta = base + scale * tau`` in float32 at least (float64 if the base or the delta is),
        returned in the base's dtype. Base tensors without a delta (integer buffers) are copied
        unchanged. KeyError for a delta whose name the base lacks, ValueError for a delta of
        another shape than its base tensor (both naming the tensor), for a delta to a
        non-floating base tensor (it would be truncated), for a result of finite inputs that is
        not finite in the base's dtype (overflow) or a ``scale`` that is NaN or Inf; TypeError
        for a base that is not a mapping of tensors or a ``scale`` that is not a real number."""
        if not isinstance(base, Mapping):
            raise TypeError(
                f"apply_to: base must map tensor names to tensors (a state_dict), not a "
                f"{type(base).__name__}"
            )
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"apply_to: scale must be a real number, not {scale!r}")
        try:
            finite = math.isfinite(scale)
        except OverflowError:  # an int beyond float's range
            finite = False
        if not finite:
            raise ValueError(f"apply_to: scale {scale!r}: the scalar must be finite")
        unknown = [name for name in self._deltas if name not in base]
        if unknown:
            raise KeyError(f"apply_to: the base has no tensor {unknown[0]!r} (a delta names it)")
        merged = {}
        for name, base_tensor in base.items():
            if not isinstance(base_tensor, torch.Tensor):
                raise TypeError(
                    f"apply_to: the base's {name!r} is a {type(base_tensor).__name__}, not a tensor"
                )
            if name not in self._deltas:
                merged[name] = base_tensor.clone()
                continue
            delta = self._deltas[name]
            check_same_shape(name, delta, base_tensor, "the base's")
            if not base_tensor.is_floating_point():
                raise ValueError(
                    f"apply_to: the base's {name!r} is {base_tensor.dtype}: a delta to it would be "
                    "truncated (integer tensors are never merged; leave it out of the deltas)"
                )
            compute = torch.promote_types(
                torch.promote_types(delta.dtype, base_tensor.dtype), torch.float32
            )
            result = (base_tensor.to(compute) + scale * delta.to(compute)).to(base_tensor.dtype)
            if not all_finite(result) and all_finite(base_tensor) and all_finite(delta):
                raise ValueError(
                    f"apply_to: {name!r}: base + {scale:g} * delta overflows {base_tensor.dtype}"
                )
            merged[name] = result
        return merged


def check_same_shape(name: str, delta: torch.Tensor, other: torch.Tensor, whose: str) -> None:
    """ValueError naming tensor ``name`` unless ``delta`` and ``other`` have one shape."""
    if delta.shape != other.shape:
        raise ValueError(
            f"tensor {name!r}: shape {tuple(delta.shape)} differs from {whose} {tuple(other.shape)}"
        )
