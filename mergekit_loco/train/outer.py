"""OuterOptimizer: DiLoCo's outer step on a name -> tensor mapping, for code that forms the
worker deltas itself (the :class:`~mergekit_loco.train.diloco.DiLoCo` driver forms them from a
model). Both run the same two functions: the aggregation and the pseudo-gradient step."""

from __future__ import annotations

import copy
import inspect
import itertools
import math
import numbers
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from mergekit_loco.methods import MergeMethod
from mergekit_loco.methods.base import task_vector_list
from mergekit_loco.methods.registry import check_keyword_typos
from mergekit_loco.task_vector import TaskVector
from mergekit_loco.train.aggregate import CommStats, aggregate_worker_deltas
from mergekit_loco.train.diloco import (
    apply_pseudo_gradient,
    check_compression,
    check_compression_has_ranks,
    outcome_check,
    resolve_aggregator,
)


def check_params(params: Mapping[str, torch.Tensor]) -> None:
    """``params`` maps names to floating tensors (a list of tensors has no names to match
    deltas by; an integer tensor takes no gradient step), at least one, no two sharing memory
    (tied weights under two names would take the step twice)."""
    if not isinstance(params, Mapping):
        raise TypeError(
            "OuterOptimizer params must be a mapping of name -> tensor (e.g. "
            f"dict(model.named_parameters())), not a {type(params).__name__}"
        )
    if not params:
        raise ValueError("OuterOptimizer params is empty: give the tensors to step")
    for name, tensor in params.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"OuterOptimizer params: {name!r} is a {type(tensor).__name__}, not a tensor"
            )
        if not tensor.is_floating_point():
            raise ValueError(
                f"OuterOptimizer params: {name!r} is {tensor.dtype}; only floating tensors take "
                "an outer step (leave integer buffers out of params)"
            )
    check_no_shared_memory(params)


def check_no_shared_memory(params: Mapping[str, torch.Tensor]) -> None:
    """ValueError naming two entries whose bytes overlap (one tensor under two names, as a
    state_dict lists tied embeddings, or overlapping views of one buffer)."""
    spans = sorted(
        (tensor.untyped_storage().data_ptr(), *byte_span(tensor), name)
        for name, tensor in params.items()
        if tensor.numel()
    )
    for (storage, _, end, name), (other, start, _, second) in itertools.pairwise(spans):
        if storage == other and start < end:
            raise ValueError(
                f"OuterOptimizer params: {name!r} and {second!r} share memory (tied weights?), "
                "so the step would be applied to it twice; give each parameter once, e.g. "
                "dict(model.named_parameters())"
            )


def byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` of its storage that ``tensor`` spans (its lowest and highest
    element; a strided view may skip bytes between)."""
    start = tensor.storage_offset()
    shape, strides = tensor.shape, tensor.stride()
    last = start + sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))
    return start * tensor.element_size(), (last + 1) * tensor.element_size()


def check_rate(option: str, value: float, high: float | None) -> None:
    """``value`` is a finite real number, > 0 (``high`` None) or in ``[0, high)``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"OuterOptimizer {option} must be a real number, got {value!r}")
    if high is None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"OuterOptimizer {option} must be finite and > 0, got {value}")
    if high is not None and not (math.isfinite(value) and 0 <= value < high):
        raise ValueError(f"OuterOptimizer {option} must lie in [0, {high:g}), got {value}")


class OuterOptimizer:
    """DiLoCo's outer step with any merge method as the aggregator, then torch SGD.

    For worker deltas ``tau_i = theta_i - theta`` (i = 1..R, over all ranks):
    ``merged = aggregate(tau_1, .., tau_R)`` (Iso-C / Iso-CTS act on ``tau_i / R``);
    pseudo-gradient ``g = -merged``; ``torch.optim.SGD(lr, momentum, nesterov, dampening=0)``:
    ``buf = momentum * buf + g``; ``update = g + momentum * buf`` (Nesterov) or ``buf``;
    ``theta -= lr * update``. Computed in the dtype of ``params``, updated in place.

    Under torch.distributed each rank passes only its own workers' deltas (R =
    ``len(deltas) * world_size``), optionally with ``compression`` "bf16" or "int8" of what
    travels between ranks (refused without 2 or more ranks: nothing would travel);
    ``last_comm_stats`` then holds the cost.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        aggregator: str | MergeMethod = "mean",
        lr: float = 0.7,
        momentum: float = 0.0,
        nesterov: bool = False,
        process_group: dist.ProcessGroup | None = None,
        compression: str | None = None,
        **aggregator_options,
    ):
        keywords = list(inspect.signature(OuterOptimizer).parameters)
        check_keyword_typos(aggregator_options, keywords, "OuterOptimizer")
        check_params(params)
        check_rate("lr", lr, None)
        check_rate("momentum", momentum, 1.0)
        if not isinstance(nesterov, bool):
            raise TypeError(f"OuterOptimizer nesterov must be True or False, got {nesterov!r}")
        if nesterov and momentum == 0:
            raise ValueError("OuterOptimizer nesterov=True needs momentum > 0 (or nesterov=False)")
        check_compression(compression)
        check_compression_has_ranks(compression, process_group)
        self.params = dict(params)
        self.method = resolve_aggregator(aggregator, aggregator_options)
        self.sgd = torch.optim.SGD(
            list(self.params.values()), lr=lr, momentum=momentum, nesterov=nesterov
        )
        self.process_group = process_group
        self.compression = compression
        self.last_comm_stats: CommStats | None = None
        self.steps_taken = 0

    @property
    def momentum_buffers(self) -> dict[str, torch.Tensor]:
        """SGD's momentum buffer of each parameter that has one."""
        return {
            name: self.sgd.state[param]["momentum_buffer"]
            for name, param in self.params.items()
            if self.sgd.state.get(param, {}).get("momentum_buffer") is not None
        }

    @torch.no_grad()
    def step(self, deltas: Iterable[TaskVector]) -> TaskVector:
        """Aggregate ``deltas`` (a list, or any iterable: read once) and update ``params`` in
        place; returns the merged delta. Before any compute, raises TypeError for anything but
        task vectors, ValueError naming the tensor for a delta of another shape than its
        parameter, and FloatingPointError naming it for a delta that is not finite (then
        ``params`` are kept). A step that fails later (an overflow of the parameters' dtype,
        or on another rank) leaves ``params`` and the momentum as they were."""
        deltas = task_vector_list(deltas, "OuterOptimizer.step", "worker delta")
        for index, delta in enumerate(deltas, start=1):
            for name, tensor in delta.items():
                param = self.params.get(name)
                if param is not None and tensor.shape != param.shape:
                    raise ValueError(
                        f"worker delta {index}: tensor {name!r} is {list(tensor.shape)} but the "
                        f"parameter is {list(param.shape)}; params kept"
                    )
        merged, self.last_comm_stats = aggregate_worker_deltas(
            self.method,
            deltas,
            round_index=self.steps_taken,
            group=self.process_group,
            compression=self.compression,
        )
        agree = outcome_check(self.process_group, self.steps_taken + 1, self.params)
        apply_pseudo_gradient(merged, self.params, self.sgd, agree=agree)
        self.steps_taken += 1
        return merged

    def state_dict(self) -> dict:
        """The step count, SGD's state and the parameters' names (in SGD's order)."""
        return {
            "steps_taken": self.steps_taken,
            "sgd": copy.deepcopy(self.sgd.state_dict()),
            "names": list(self.params),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`: the step count and momentum buffers, matched to the
        parameters by name (a state saved without names, by position). The settings stay
        this optimizer's own (lr, momentum, nesterov), where torch would load the saved ones,
        as a resumed ``mloco train`` keeps its config's. Before any change, raises ValueError
        naming the key for a state of another optimizer: other keys or parameter names, a
        negative or non-integer step count, or a momentum buffer that is not its parameter's
        shape or not finite."""
        keys = {"steps_taken", "sgd"}
        if not isinstance(state, Mapping) or not keys <= set(state) <= keys | {"names"}:
            raise ValueError(
                "OuterOptimizer state must hold 'steps_taken' and 'sgd' (and 'names'), nothing else"
            )
        steps = state["steps_taken"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(
                f"OuterOptimizer state: 'steps_taken' must be an int >= 0, got {steps!r}"
            )
        saved = state["sgd"]
        buffers = saved.get("state") if isinstance(saved, Mapping) else None
        if not isinstance(buffers, Mapping):
            raise ValueError("OuterOptimizer state: 'sgd' must be an SGD state_dict")
        names = state.get("names", list(self.params))
        named = isinstance(names, list | tuple) and all(isinstance(n, str) for n in names)
        if not named or sorted(names) != sorted(self.params):
            odd = sorted(set(names if named else ()) ^ set(self.params))
            raise ValueError(
                "OuterOptimizer state: its parameter names are not this optimizer's"
                + (f" ({odd[0]!r} is in one and not the other)" if odd else "")
            )
        params = [(name, self.params[name]) for name in names]
        for index, entry in buffers.items():
            buffer = entry.get("momentum_buffer") if isinstance(entry, Mapping) else None
            fits = isinstance(index, int) and 0 <= index < len(params)
            if not fits or not (buffer is None or isinstance(buffer, torch.Tensor)):
                raise ValueError(
                    f"OuterOptimizer state: 'sgd' holds a state for parameter {index!r}, which "
                    "this optimizer does not have"
                )
            if buffer is not None and buffer.shape != params[index][1].shape:
                name, param = params[index]
                raise ValueError(
                    f"OuterOptimizer state: the momentum of {name!r} is {list(buffer.shape)}, "
                    f"but the parameter is {list(param.shape)}"
                )
            if buffer is not None and not torch.isfinite(buffer).all():
                raise ValueError(
                    f"OuterOptimizer state: the momentum of {params[index][0]!r} holds NaN or Inf"
                )
        own = [{k: v for k, v in group.items() if k != "params"} for group in self.sgd.param_groups]
        position = {name: index for index, name in enumerate(names)}
        groups = [{**own[0], "params": [position[name] for name in self.params]}]
        self.sgd.load_state_dict({"state": dict(buffers), "param_groups": groups})
        for group, settings in zip(self.sgd.param_groups, own, strict=True):
            group.update(settings)
        self.steps_taken = steps
