"""DiLoCo around any training loop: every ``sync_every`` inner steps, a merge method aggregates the
workers' deltas and a torch optimizer takes the outer step.

```python
with DiLoCo(model, inner, outer, aggregator="iso-c", sync_every=30):
    for batch in loader:  # the user's loop, unchanged
        loss_fn(model, batch).backward(); inner.step(); inner.zero_grad()
```

One outer step, for the trainable parameters theta (frozen ones and ``exclude`` stay as they are):
``tau_i = theta_i - theta`` for the R workers (all ranks of ``process_group``);
``merged = aggregate(tau_1..tau_R)`` (train/aggregate.py: ``aggregate_worker_deltas``);
``theta.grad = -merged`` (the pseudo-gradient); ``outer.step()`` from theta. With
``torch.optim.SGD(lr, momentum, nesterov)`` this is the DiLoCo outer step of the paper.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import numbers
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from mergekit_loco.dist.checks import check_outer_steps_agree, checksum, gather_from_ranks
from mergekit_loco.methods import MergeMethod, get_method
from mergekit_loco.methods.base import check_implemented
from mergekit_loco.task_vector import TaskVector
from mergekit_loco.train.aggregate import CommStats, aggregate_worker_deltas

#: What the outer step may communicate: exact (None), bfloat16, or int8 with per-row scales.
COMPRESSIONS = (None, "bf16", "int8")
#: The keys of :meth:`DiLoCo.state_dict` (``pending`` may be left out: no unfinished turns).
STATE_KEYS = ("global_params", "local_steps", "outer_steps", "pending", "outer")


def is_int(value: Any) -> bool:
    """An integer, not a bool (``True`` is 1 to Python, never a count here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_sync_every(sync_every: Any) -> None:
    """Raise TypeError unless ``sync_every`` is an int, ValueError unless it is >= 1."""
    if not is_int(sync_every):
        raise TypeError(
            f"sync_every must be an int >= 1 (inner steps per outer step), got {sync_every!r}"
        )
    if sync_every < 1:
        raise ValueError(f"sync_every must be >= 1, got {sync_every}")


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """The tensors ``optimizer`` steps: its ``param_groups``', or those of the optimizers it
    wraps in ``optimizers`` (as the training loop's InnerOptimizer does)."""
    if hasattr(optimizer, "param_groups"):
        return [p for group in optimizer.param_groups for p in group["params"]]
    return [p for inner in getattr(optimizer, "optimizers", ()) for p in optimizer_tensors(inner)]


def check_inner_optimizers(model: torch.nn.Module, inner_optimizers: Sequence[Any]) -> None:
    """At least one inner optimizer; each one hookable and stepping only ``model``'s
    parameters. Raises naming the optimizer (its position in ``inner_optimizer``)."""
    if not inner_optimizers:
        raise ValueError(
            "inner_optimizer is empty: pass a torch optimizer over the model's parameters (or "
            "a list of them, one per simulated worker)"
        )
    in_model = {id(p) for p in model.parameters()}
    for worker, optimizer in enumerate(inner_optimizers):
        for hook in ("register_step_pre_hook", "register_step_post_hook"):
            if not callable(getattr(optimizer, hook, None)):
                raise TypeError(
                    f"inner_optimizer {worker} is a {type(optimizer).__name__}, not a torch "
                    f"optimizer (it has no {hook})"
                )
        if any(id(p) not in in_model for p in optimizer_tensors(optimizer)):
            raise ValueError(
                f"inner_optimizer {worker} holds a tensor that is not a parameter of the model "
                "(an optimizer of another model?): build it over model.parameters()"
            )
    first = {id(p) for p in optimizer_tensors(inner_optimizers[0])}
    for worker, optimizer in enumerate(inner_optimizers[1:], start=1):
        if {id(p) for p in optimizer_tensors(optimizer)} != first:
            raise ValueError(
                f"inner_optimizer {worker} steps other parameters than inner_optimizer 0: a list "
                "of optimizers is one per simulated worker, each over the whole model; for one "
                "worker with two optimizers (Muon for matrices, AdamW for the rest), pass one "
                "object that steps both, holds them in .optimizers and has step hooks (as "
                "mergekit_loco.train.workers.InnerOptimizer), or one optimizer with two "
                "param_groups"
            )


def optimizer_objects(optimizer: Any) -> list[Any]:
    """``optimizer`` and the optimizers it wraps in ``optimizers`` (as the training loop's
    InnerOptimizer does), whose step hooks the driver may register."""
    return [optimizer] + [
        wrapped
        for inner in getattr(optimizer, "optimizers", ())
        for wrapped in optimizer_objects(inner)
    ]


def check_outer_is_not_inner(outer_optimizer: Any, inner_optimizers: Sequence[Any]) -> None:
    """The outer optimizer must be an optimizer of its own: one that is (or is wrapped by) an
    inner optimizer would fire the driver's inner-step hooks on every outer step, so a round
    would end one step early. It holds the same parameters (the model's); that is expected."""
    for worker, optimizer in enumerate(inner_optimizers):
        if any(outer_optimizer is wrapped for wrapped in optimizer_objects(optimizer)):
            raise ValueError(
                f"outer_optimizer is inner_optimizer {worker} (or an optimizer inside it): its "
                "outer steps would count as inner steps; pass a separate optimizer over the "
                "same parameters, e.g. torch.optim.SGD(model.parameters(), lr=0.7, "
                "momentum=0.9, nesterov=True)"
            )


def check_compression(compression: str | None) -> None:
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be bf16 or int8, not {compression!r}")


def check_compression_has_ranks(compression: str | None, group: dist.ProcessGroup | None) -> None:
    """Compression acts on what ranks send each other; in a group of one rank (or none) nothing
    is sent, so it would change no number while the byte counts claimed its savings."""
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if compression is not None and world == 1:
        raise ValueError(
            f"compression={compression!r} compresses what ranks send each other, but this process "
            "group has 1 rank: simulated workers send nothing, so it would change no number; run "
            "under torchrun with 2 or more processes (gloo works on one machine), or leave it off"
        )


def resolve_aggregator(
    aggregator: str | MergeMethod, options: Mapping[str, Any] | None = None
) -> MergeMethod:
    """A method object as given (once it has a name and its math:
    :func:`~mergekit_loco.methods.base.check_implemented`), or ``get_method(name, **options)``."""
    if isinstance(aggregator, MergeMethod):
        if options:
            raise ValueError("pass aggregator options to get_method, not with a method object")
        check_implemented(aggregator)
        return aggregator
    return get_method(aggregator, **dict(options or {}))


def check_shapes_fit(
    params: Mapping[str, torch.Tensor], entries: Iterable[tuple[str, str, torch.Tensor]]
) -> None:
    """Each ``(parameter name, label, tensor)`` has its parameter's shape."""
    for name, label, tensor in entries:
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(
                f"DiLoCo state does not fit the model: {label} is {list(tensor.shape)} but "
                f"parameter {name!r} is {list(params[name].shape)}"
            )


StateCopy = list[tuple[dict, dict[Any, dict[str, tuple[Any, Any]]]]]


def copy_optimizer_state(outer: torch.optim.Optimizer, device: torch.device | None) -> StateCopy:
    """A copy of ``outer.state`` (each parameter's buffers, moments, step counts), and of the
    optimizer it wraps (``ZeroRedundancyOptimizer.optim``, whose ``state_dict()`` would be a
    collective): per entry the tensor itself and its copy (on ``device``, None: where it is;
    0-dim tensors such as Adam's step stay where torch keeps them)."""
    holders = [outer.state]
    wrapped = getattr(outer, "optim", None)
    if isinstance(wrapped, torch.optim.Optimizer):
        holders.append(wrapped.state)

    def copied(value: Any) -> tuple[Any, Any]:
        if torch.is_tensor(value):
            where = device if device is not None and value.dim() > 0 else value.device
            return value, value.detach().to(where, copy=True)
        return None, copy.deepcopy(value)

    return [
        (holder, {p: {k: copied(v) for k, v in entry.items()} for p, entry in holder.items()})
        for holder in holders
    ]


def restore_optimizer_state(saved: StateCopy) -> None:
    """Put back :func:`copy_optimizer_state`'s copy: into the very tensors where they are
    still there (their dtype, device and identity kept, as a captured graph needs), state that
    parameters gained since dropped."""
    for holder, entries in saved:
        for param in [p for p in holder if p not in entries]:
            del holder[param]
        for param, entry in entries.items():
            restored = {}
            for key, (original, value) in entry.items():
                if original is None:
                    restored[key] = copy.deepcopy(value)
                else:
                    restored[key] = original.copy_(value)
            holder[param] = restored


@torch.no_grad()
def apply_pseudo_gradient(
    merged: TaskVector,
    params: Mapping[str, torch.Tensor],
    outer: torch.optim.Optimizer,
    previous: Mapping[str, torch.Tensor] | None = None,
    backup_device: torch.device | None = None,
    agree: Callable[[bool], None] | None = None,
) -> None:
    """``p.grad = -merged[name]`` (in p's dtype) for every ``params`` entry, ``outer.step()``,
    gradients cleared. Before any change, raises ValueError naming the tensor if ``merged``
    lacks a parameter, holds another tensor or has another shape, and FloatingPointError if it
    is not finite; after the step, FloatingPointError naming the first parameter it left not
    finite (an overflow of its dtype). A step that fails changes nothing: the parameters go
    back to ``previous`` (their values before the step; None: a copy is taken) and the
    optimizer's state to its copy taken before (on ``backup_device``, if given), so a retry
    ends on the bits of a step that never failed. ``agree`` (several ranks) is called with
    whether this rank's step succeeded and raises if another rank's failed: then this rank's
    step is undone too, and every rank keeps the round."""
    if set(merged) != set(params):
        name = sorted(set(merged) ^ set(params))[0]
        where = "is not a parameter" if name in merged else "is missing from the merged deltas"
        raise ValueError(f"pseudo-gradient: tensor {name!r} {where}; params kept")
    for name, param in params.items():
        if merged[name].shape != param.shape:
            raise ValueError(
                f"pseudo-gradient: tensor {name!r} is {list(merged[name].shape)} but the "
                f"parameter is {list(param.shape)}; params kept"
            )
        if not torch.isfinite(merged[name]).all():
            raise FloatingPointError(f"non-finite pseudo-gradient for {name!r}; params kept")
    state = None
    try:
        try:
            if previous is None:
                previous = {
                    n: p.detach().to(backup_device or p.device, copy=True)
                    for n, p in params.items()
                }
            state = copy_optimizer_state(outer, backup_device)
            for name, param in params.items():
                param.grad = -merged[name].to(device=param.device, dtype=param.dtype)
            outer.step()
            for name, param in params.items():
                if not torch.isfinite(param).all():
                    raise FloatingPointError(
                        f"the outer step left parameter {name!r} not finite (its {param.dtype} "
                        "overflows: a smaller outer lr, or a wider dtype)"
                    )
        except BaseException:  # a copy out of memory included: the others wait in agree
            if agree is not None:  # the other ranks learn of it and undo their steps
                with contextlib.suppress(Exception):
                    agree(False)
            raise
        finally:  # a failed step leaves no pseudo-gradient behind
            outer.zero_grad(set_to_none=True)
        if agree is not None:
            agree(True)
    except BaseException:  # half a step, an overflow, another rank's failure: undone
        if state is not None:  # else the step never began
            for name, param in params.items():
                param.copy_(previous[name])
            restore_optimizer_state(state)
        raise


def setting_text(value: Any) -> str:
    """An outer optimizer setting as every rank that holds the same one writes it: numbers and
    strings by repr, a tensor by its values and dtype (not its device: each rank's own GPU), a
    function or class by its qualified name (not its address); anything else by its type."""
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(setting_text(item) for item in value) + "]"
    if torch.is_tensor(value):
        return f"tensor({value.detach().cpu().tolist()}, {value.dtype})"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return type(value).__qualname__


def first_difference(mine: Any, theirs: Any) -> str:
    """``mine`` vs ``theirs`` where they first differ: an entry of two equally long lists, a
    key of two mappings; else the whole values (strings as they are)."""
    if isinstance(mine, list) and isinstance(theirs, list) and len(mine) == len(theirs):
        return next(first_difference(a, b) for a, b in zip(mine, theirs, strict=True) if a != b)
    if isinstance(mine, dict) and isinstance(theirs, dict) and set(mine) == set(theirs):
        key = next(key for key in mine if mine[key] != theirs[key])
        return f"{key} {mine[key]} vs {theirs[key]}"
    if isinstance(mine, str) and isinstance(theirs, str):
        return f"{mine} vs {theirs}"
    return f"{mine!r} vs {theirs!r}"


def outcome_check(
    group: dist.ProcessGroup | None, round_number: int, params: Mapping[str, torch.Tensor]
) -> Callable[[bool], None] | None:
    """The ``agree`` of :func:`apply_pseudo_gradient` under a process group of 2 or more
    ranks (:func:`~mergekit_loco.dist.checks.check_outer_steps_agree`); None on one rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None
    device = next(iter(params.values())).device
    return functools.partial(
        check_outer_steps_agree, round_number=round_number, group=group, device=device
    )


class DiLoCo:
    """The DiLoCo driver: hooks ``inner_optimizer.step`` and runs the outer step every
    ``sync_every`` inner steps. A context manager: inner steps count only inside
    ``with driver:``; :meth:`sync` ends a round early.

    ``inner_optimizer`` may be a sequence of V optimizers over the same ``model``: V simulated
    workers on this rank that take turns of ``sync_every`` steps each, in order; after each turn
    the model is reset to the global parameters, and after the V-th the V deltas (with every
    other rank's) are aggregated. One optimizer is one worker (the same one twice, or a step of
    one out of its turn, is an error). Workers per outer step:
    ``R = V * world size of process_group`` (no initialised torch.distributed: one rank).

    ``backup_device`` keeps the global parameters (and so the deltas' reference) on another
    device, e.g. "cpu". ``compression`` ("bf16", "int8") encodes what ranks send each other,
    so it needs a process group of 2 or more. The driver never creates nor destroys a process
    group.

    theta_global starts as the model's parameters when the ``with`` block is first entered
    (weights loaded after construction count). Every trainable, non-excluded parameter must be
    in ``outer_optimizer``, an optimizer of its own (not one of the inner optimizers). The
    block is entered once at a time (``with driver:`` inside itself is a RuntimeError).
    Leaving the block mid-round leaves the model on this worker's parameters
    (``global_params`` holds theta_global; :meth:`sync` first to evaluate the global model);
    entering again continues the round. The global parameters and the outer state
    keep the parameters' dtype (no float32 master copy for bf16 models).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inner_optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        outer_optimizer: torch.optim.Optimizer,
        aggregator: str | MergeMethod = "iso-c",
        sync_every: int = 30,
        process_group: dist.ProcessGroup | None = None,
        aggregator_options: Mapping[str, Any] | None = None,
        compression: str | None = None,
        backup_device: torch.device | str | None = None,
        exclude: Iterable[str] = (),
    ):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model: a torch.nn.Module, not {type(model).__name__}")
        if not isinstance(outer_optimizer, torch.optim.Optimizer):
            raise TypeError(
                "outer_optimizer: a torch.optim.Optimizer over the model's parameters (e.g. "
                f"SGD(lr=0.7, momentum=0.9, nesterov=True)), not {type(outer_optimizer).__name__}"
            )
        if isinstance(exclude, str):
            raise TypeError(f"exclude: a list of parameter names ([{exclude!r}]), not one string")
        if not isinstance(exclude, Iterable):
            raise TypeError(f"exclude: a list of parameter names, not {exclude!r}")
        if aggregator_options is not None and not isinstance(aggregator_options, Mapping):
            raise TypeError(
                "aggregator_options: a mapping such as {'density': 0.5}, not "
                f"{aggregator_options!r}"
            )
        check_sync_every(sync_every)
        check_compression(compression)
        if backup_device is not None:
            given = backup_device
            try:
                backup_device = torch.device(backup_device)
                torch.empty(0, device=backup_device)
            except (RuntimeError, TypeError, AssertionError) as error:
                raise ValueError(
                    f'backup_device: {given!r} is not a device ("cpu", "cuda:0") this torch can '
                    f"use: {error}"
                ) from None
        named = dict(model.named_parameters())
        # a tied weight has one name here and more in the model (lm_head.weight beside
        # wte.weight): excluding any of its names excludes the tensor
        canonical = {id(p): name for name, p in named.items()}
        every_name = {
            name: canonical[id(p)] for name, p in model.named_parameters(remove_duplicate=False)
        }
        unknown = sorted(set(exclude) - set(every_name))
        if unknown:
            raise ValueError(f"exclude names {unknown[0]!r}, which is not a parameter of the model")
        excluded = {every_name[name] for name in exclude}
        self.params = {
            name: p for name, p in named.items() if p.requires_grad and name not in excluded
        }
        self.frozen = {  # frozen now: not driven, and checked to stay frozen
            name: p for name, p in named.items() if name not in excluded and name not in self.params
        }
        allowed = {id(p) for n, p in named.items() if n not in excluded}  # frozen: grad None
        held = {id(p) for group in outer_optimizer.param_groups for p in group["params"]}
        if held - allowed:
            raise ValueError(
                "outer_optimizer holds a tensor that is not a parameter of the model or is "
                "excluded (it would step on the inner gradient)"
            )
        for name, param in self.params.items():
            if id(param) not in held:
                raise ValueError(
                    f"trainable parameter {name!r} is not in outer_optimizer: every sync would "
                    "reset it to its starting value; give it to the outer optimizer, or pass it "
                    "in exclude to leave it to the inner optimizer alone"
                )
        self.model = model
        self.inner_optimizers = (
            list(inner_optimizer) if isinstance(inner_optimizer, Sequence) else [inner_optimizer]
        )
        check_inner_optimizers(model, self.inner_optimizers)
        if len({id(o) for o in self.inner_optimizers}) != len(self.inner_optimizers):
            raise ValueError(
                "inner_optimizer lists one optimizer twice: each simulated worker needs its own "
                "(its steps would count for two workers)"
            )
        check_outer_is_not_inner(outer_optimizer, self.inner_optimizers)
        self.outer_optimizer = outer_optimizer
        self.method = resolve_aggregator(aggregator, aggregator_options)
        self.sync_every = sync_every
        self.process_group = process_group
        world = dist.get_world_size(process_group) if dist.is_initialized() else 1
        check_compression_has_ranks(compression, process_group)
        self.method.check_tasks(len(self.inner_optimizers) * world)
        self.method.check_shapes(
            {name: p.shape for name, p in self.params.items()}, len(self.inner_optimizers) * world
        )
        self.compression = compression
        self.backup_device = backup_device
        self.global_params: dict[str, torch.Tensor] = {}
        self.snapshot_global()
        self.local_steps = 0  # inner steps of the current turn
        self.outer_steps = 0
        self.pending: list[TaskVector] = []  # this rank's finished turns of the current round
        self.last_comm_stats: CommStats | None = None
        self.last_outer_seconds = 0.0  # wall time of the last outer step, aggregation included
        self._hooks: list = []
        self._started = False  # an inner step, a sync or a loaded state fixed theta_global
        self._ranks_agree = False  # checked at the first entry, and again after a load

    # -- hooks ------------------------------------------------------------------------------------
    def __enter__(self) -> DiLoCo:
        """Register a pre- and a post-step hook on each inner optimizer. Entering a driver that
        is already entered (a ``with driver:`` inside another) is a RuntimeError: its hooks
        would count every inner step twice, and the outer block's would outlive it."""
        if self._hooks:
            raise RuntimeError(
                f"this DiLoCo driver (aggregator {self.method.name}, sync_every "
                f"{self.sync_every}) is already entered: a `with driver:` block inside another "
                "would count each inner step twice; enter it once"
            )
        if not self._started:  # weights loaded after construction are the starting point
            self.snapshot_global()
        if not self._ranks_agree:
            self.check_ranks_agree()
        try:
            for worker, optimizer in enumerate(self.inner_optimizers):
                pre = functools.partial(self._check_turn, worker)
                self._hooks.append(optimizer.register_step_pre_hook(pre))
                post = functools.partial(self._after_inner_step, worker)
                self._hooks.append(optimizer.register_step_post_hook(post))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        """Remove exactly the hooks :meth:`__enter__` registered."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _check_turn(self, worker: int, optimizer, args, kwargs) -> None:
        """Before an inner step (raises before the step): no outer step may be due (one that
        failed: :meth:`sync` retries it), the trainable parameters must be those the driver
        was built with, and it must be ``worker``'s turn."""
        if len(self.pending) == len(self.inner_optimizers):
            raise RuntimeError(
                f"the outer step of round {self.outer_steps + 1} failed and is still due (its "
                f"{len(self.pending)} worker deltas are kept): call sync() to retry it before "
                "the next inner step (the step was not taken)"
            )
        self.check_trainable()
        if not self._ranks_agree:
            self.check_ranks_agree()
        turn = len(self.pending)
        if worker != turn:
            raise RuntimeError(
                f"inner optimizer {worker} stepped during worker {turn}'s turn: the simulated "
                f"workers take turns in order, {self.sync_every} steps each (the step was not "
                "taken)"
            )

    def settings(self) -> list[tuple[str, Any]]:
        """What every rank's driver must hold alike, as ``(label, value)`` pairs."""
        outer = self.outer_optimizer
        groups = [
            {key: setting_text(value) for key, value in group.items() if key != "params"}
            | {"parameters": len(group["params"])}
            for group in outer.param_groups
        ]
        return [
            ("the workers (inner optimizers)", len(self.inner_optimizers)),
            ("the sync_every values", self.sync_every),
            ("the aggregators", repr(self.method)),
            ("the compressions", self.compression),
            (
                "the driven parameters",
                [(n, list(p.shape), str(p.dtype)) for n, p in self.params.items()],
            ),
            ("the outer optimizers", type(outer).__qualname__),
            ("the outer optimizers' settings", groups),
            ("the outer steps taken", self.outer_steps),
            ("the inner steps into the turn", self.local_steps),
            ("the finished turns of the round", len(self.pending)),
        ]

    def check_ranks_agree(self) -> None:
        """Under a process group of 2 or more ranks, ValueError on every rank, naming the first
        difference, unless every rank's driver was built alike (:meth:`settings`) and holds
        the same global parameters, bit for bit: else the ranks would pair different rounds
        or apply one merged delta to different weights, and drift apart without an error."""
        group = self.process_group
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            self._ranks_agree = True
            return
        weights = [(name, checksum(t)) for name, t in self.global_params.items()]
        everyone = gather_from_ranks((self.settings(), weights), "DiLoCo settings", group)
        (settings, weights) = everyone[0]
        for rank, (theirs, their_weights) in enumerate(everyone[1:], start=1):
            for (label, value), (_, other) in zip(settings, theirs, strict=True):
                if value != other:
                    raise ValueError(
                        f"DiLoCo: {label} differ between rank 0 and rank {rank}: "
                        f"{first_difference(value, other)}: every rank must build its driver "
                        "alike (same aggregator and options, sync_every, workers and outer "
                        "optimizer) and be at the same round"
                    )
            for (name, digest), (_, other) in zip(weights, their_weights, strict=True):
                if digest != other:
                    raise ValueError(
                        f"DiLoCo: the global parameter {name!r} differs between rank 0 and "
                        f"rank {rank}: every rank must start from the same weights (seed the "
                        "init alike, torch.manual_seed before building the model, or load the "
                        "same checkpoint) before the first `with driver:`"
                    )
        self._ranks_agree = True

    def check_trainable(self) -> None:
        """RuntimeError naming a parameter whose ``requires_grad`` changed since the driver was
        built: unfrozen, it would train on each worker and never be merged; frozen, the outer
        step would still move it."""
        changed = [n for n, p in self.frozen.items() if p.requires_grad]
        changed += [n for n, p in self.params.items() if not p.requires_grad]
        if changed:
            now = "trainable" if changed[0] in self.frozen else "frozen"
            raise RuntimeError(
                f"parameter {changed[0]!r} is {now} now, but was not when this DiLoCo driver was "
                "built, which fixed the parameters it merges: build a new driver after "
                "freezing or unfreezing (e.g. at each stage of gradual unfreezing), from "
                "state_dict() at a round's end (the step was not taken)"
            )

    def _after_inner_step(self, worker: int, optimizer, args, kwargs) -> None:
        self._started = True
        self.local_steps += 1
        if self.local_steps == self.sync_every:
            self.end_turn()

    # -- the outer step ---------------------------------------------------------------------------
    @torch.no_grad()
    def local_delta(self) -> TaskVector:
        """``tau = theta_worker - theta_global`` for every driven parameter."""
        return TaskVector(
            {
                name: p.detach() - self.global_params[name].to(p.device)
                for name, p in self.params.items()
            }
        )

    @torch.no_grad()
    def snapshot_global(self) -> None:
        """``theta_global = theta`` (the model's parameters now, in their dtype now: a
        ``model.double()`` after construction counts): the starting point."""
        self.global_params = {
            name: p.detach().to(self.backup_device or p.device, copy=True)
            for name, p in self.params.items()
        }

    @torch.no_grad()
    def restore_global(self) -> None:
        """Load the global parameters into the model."""
        for name, param in self.params.items():
            param.copy_(self.global_params[name])

    def end_turn(self) -> TaskVector | None:
        """Close this worker's turn: keep its delta, reset the model to the global parameters;
        after the last local worker's turn run the outer step (returns its merged delta)."""
        self._started = True
        self.local_steps = 0
        self.pending.append(self.local_delta())
        self.restore_global()
        return self.step_if_due()

    def step_if_due(self) -> TaskVector | None:
        """The outer step once every local worker's turn is done. If it fails, the model is
        left on the global parameters, the outer optimizer's state as it was, and the round's
        deltas stay pending: :meth:`sync` retries it."""
        if len(self.pending) < len(self.inner_optimizers):
            return None
        merged = self.outer_step(self.pending)
        self.pending = []
        return merged

    def sync(self) -> TaskVector | None:
        """End the current turn now and take the outer step (e.g. to flush a short last
        round); returns the merged delta. Does nothing and returns None when no inner step was
        taken since the last outer step. With V simulated workers it is the last worker's turn
        that ends early: before it, RuntimeError, and nothing changes. RuntimeError too before
        the driver was ever entered (``with driver:``), when no inner step can have counted.
        After an outer step that failed (an exception from the aggregation or the step), it
        retries that step on the round's kept deltas."""
        if not self._started and not self._hooks:
            raise RuntimeError(
                "sync() before the driver was entered: take the inner steps inside `with "
                "driver:` (its optimizer hooks count them), then sync"
            )
        self.check_trainable()
        if not self._ranks_agree:
            self.check_ranks_agree()
        if self.local_steps == 0 and len(self.pending) == len(self.inner_optimizers):
            return self.step_if_due()  # an outer step that failed: retried
        if self.local_steps == 0 and not self.pending:
            return None
        if len(self.pending) + 1 < len(self.inner_optimizers):
            raise RuntimeError(
                f"sync() with {len(self.pending)} of the {len(self.inner_optimizers)} local "
                "workers' turns done: only the last worker's turn can end early"
            )
        return self.end_turn()

    @torch.no_grad()
    def outer_step(self, local_deltas: Sequence[TaskVector]) -> TaskVector:
        """Aggregate this rank's ``local_deltas`` with every other rank's and step the outer
        optimizer from the global parameters; the model ends on the new global parameters."""
        started = time.perf_counter()
        merged, self.last_comm_stats = aggregate_worker_deltas(
            self.method,
            local_deltas,
            round_index=self.outer_steps,
            group=self.process_group,
            compression=self.compression,
        )
        self.restore_global()
        apply_pseudo_gradient(
            merged,
            self.params,
            self.outer_optimizer,
            self.global_params,
            self.backup_device,
            outcome_check(self.process_group, self.outer_steps + 1, self.params),
        )
        for name, param in self.params.items():
            self.global_params[name].copy_(param.detach())
        self.outer_steps += 1
        if any(p.device.type == "cuda" for p in self.params.values()):
            torch.cuda.synchronize()
        self.last_outer_seconds = time.perf_counter() - started
        return merged

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Global parameters, counters, unfinished turns and the outer optimizer's state.
        Before theta_global is fixed (the first ``with driver:``), the global parameters are
        the model's now."""
        source = self.global_params if self._started else self.params
        return {
            "global_params": {n: t.detach().clone() for n, t in source.items()},
            "local_steps": self.local_steps,
            "outer_steps": self.outer_steps,
            "pending": [dict(delta.items()) for delta in self.pending],
            "outer": copy.deepcopy(self.outer_optimizer.state_dict()),
        }

    def outer_state_tensors(self, saved: Mapping[str, Any]) -> list[tuple[str, str, torch.Tensor]]:
        """``(name, label, tensor)`` of each per-parameter tensor (not a scalar such as Adam's
        step) of a saved outer optimizer state, by the parameter it will be loaded into."""
        names = {id(p): name for name, p in self.params.items()}
        current = [p for group in self.outer_optimizer.param_groups for p in group["params"]]
        indices = [i for group in saved.get("param_groups", []) for i in group["params"]]
        return [
            (names[id(param)], f"outer {key} of {names[id(param)]!r}", value)
            for param, index in zip(current, indices, strict=False)
            if id(param) in names
            for key, value in saved.get("state", {}).get(index, {}).items()
            if torch.is_tensor(value) and value.dim() > 0
        ]

    def check_tensors(self, label: str, tensors: Any) -> None:
        """``tensors`` maps exactly the driven parameters' names to tensors of their shapes."""
        if not isinstance(tensors, Mapping):
            raise TypeError(
                f"DiLoCo state: {label} must map parameter names to tensors, not a "
                f"{type(tensors).__name__}"
            )
        if set(tensors) != set(self.global_params):
            missing = sorted(set(self.global_params) ^ set(tensors), key=str)[0]
            raise ValueError(
                f"DiLoCo state does not fit the model: {label} tensor {missing!r} differs"
            )
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"DiLoCo state: {label} {name!r} is a {type(tensor).__name__}, not a tensor"
                )

    def check_state(self, state: Any) -> None:
        """Raise, naming the key, unless ``state`` is a :meth:`state_dict` this driver can go
        on from: its keys and types, ``0 <= local_steps < sync_every``, ``outer_steps >= 0``,
        fewer pending turns than inner optimizers, tensors of the parameters' names and
        shapes."""
        if not isinstance(state, Mapping):
            raise TypeError(f"DiLoCo state must be a mapping, not a {type(state).__name__}")
        missing = [key for key in STATE_KEYS if key not in state and key != "pending"]
        if missing:
            raise ValueError(f"DiLoCo state lacks the key {missing[0]!r}")
        unknown = [key for key in state if key not in STATE_KEYS]
        if unknown:
            raise ValueError(f"DiLoCo state has an unknown key {unknown[0]!r}")
        for key in ("local_steps", "outer_steps"):
            if not is_int(state[key]):
                raise TypeError(f"DiLoCo state: {key!r} must be an int, got {state[key]!r}")
        if not 0 <= state["local_steps"] < self.sync_every:
            raise ValueError(
                f"DiLoCo state: 'local_steps' is {state['local_steps']}, outside [0, "
                f"sync_every={self.sync_every}) (saved with a larger sync_every?): the turn "
                "would never end"
            )
        if state["outer_steps"] < 0:
            raise ValueError(f"DiLoCo state: 'outer_steps' is {state['outer_steps']}, below 0")
        pending = state.get("pending", [])
        if not isinstance(pending, list | tuple):
            raise TypeError(
                f"DiLoCo state: 'pending' must be a list of deltas, not a {type(pending).__name__}"
            )
        workers = len(self.inner_optimizers)
        if len(pending) > workers or (len(pending) == workers and state["local_steps"]):
            raise ValueError(
                f"DiLoCo state: 'pending' holds {len(pending)} finished turns, but this driver "
                f"has {workers} inner optimizers (at most {workers - 1} turns wait for the "
                f"outer step; {workers}, with local_steps 0, after an outer step that failed)"
            )
        if not isinstance(state["outer"], Mapping):
            raise TypeError(
                f"DiLoCo state: 'outer' must be an optimizer state_dict, not a "
                f"{type(state['outer']).__name__}"
            )
        self.check_outer_groups(state["outer"])
        saved = state["global_params"]
        self.check_tensors("global_params", saved)
        entries = [(n, f"global {n!r}", saved[n]) for n in saved]
        for turn, delta in enumerate(pending):
            self.check_tensors(f"pending turn {turn}", delta)
            entries += [(n, f"pending turn {turn} {n!r}", t) for n, t in dict(delta).items()]
        entries += self.outer_state_tensors(state["outer"])
        check_shapes_fit(self.global_params, entries)
        for _, label, tensor in entries:
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise ValueError(f"DiLoCo state: {label} holds NaN or Inf")

    def check_outer_groups(self, saved: Mapping[str, Any]) -> None:
        """The saved outer state is one of this driver's outer optimizer: as many parameter
        groups, each of as many tensors, with no setting this optimizer lacks (an Adam state
        has ``betas``, SGD's ``momentum``; one a newer torch added may be missing)."""
        groups = saved.get("param_groups")
        current = self.outer_optimizer.param_groups
        kind = type(self.outer_optimizer).__name__
        if not isinstance(groups, list | tuple) or not all(isinstance(g, Mapping) for g in groups):
            raise TypeError("DiLoCo state: 'outer' has no list of param_groups")
        sizes = [len(g.get("params", ())) for g in groups]
        if sizes != [len(g["params"]) for g in current]:
            raise ValueError(
                f"DiLoCo state: 'outer' has parameter groups of {sizes} tensors, but the outer "
                f"optimizer has {[len(g['params']) for g in current]}"
            )
        for saved_group, group in zip(groups, current, strict=True):
            foreign = sorted(set(saved_group) - set(group), key=str)
            if foreign:
                raise ValueError(
                    f"DiLoCo state: 'outer' was saved by another kind of optimizer than this "
                    f"{kind}: it has the setting {foreign[0]!r}, which a {kind} has not"
                )

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; at a turn boundary the model gets the global parameters
        too (mid-turn, load the model's own state after this). Before any change, raises
        naming the key (:meth:`check_state`) for a state this driver cannot go on from. The
        outer optimizer loads its state as torch does, settings (lr, momentum) included: set
        them after this to change them, as a resumed ``mloco train`` sets its config's."""
        self.check_state(state)
        self.outer_optimizer.load_state_dict(state["outer"])  # first: it may still refuse
        saved = state["global_params"]
        for name, tensor in self.global_params.items():
            tensor.copy_(saved[name])
        self.local_steps = int(state["local_steps"])
        self.outer_steps = int(state["outer_steps"])
        self.pending = [TaskVector(dict(delta)) for delta in state.get("pending", [])]
        self._started = True
        self._ranks_agree = False  # checked again before the next inner or outer step
        if self.local_steps == 0:
            self.restore_global()
