"""OuterOptimizer: a merge method aggregates the worker deltas, then SGD / Nesterov momentum."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from mergekit_loco.methods import MergeMethod, get_method
from mergekit_loco.task_vector import TaskVector
from mergekit_loco.train.aggregate import CommStats, aggregate_worker_deltas


class OuterOptimizer:
    """DiLoCo's outer step with any merge method as the aggregator.

    For worker deltas ``tau_i = theta_i - theta`` (i = 1..R, over all ranks):
    ``merged = method(tau_1/R, .., tau_R/R)`` if the method acts on the mean (Iso-C, Iso-CTS; the
    1/R applies to matrices, non-matrix tensors are averaged), else ``method(tau_1, .., tau_R)``;
    pseudo-gradient ``g = -merged``;
    ``buf = momentum * buf + g``; ``update = g + momentum * buf`` (Nesterov) or ``buf``;
    ``theta -= lr * update`` (torch SGD semantics, dampening 0). Computed in the dtype of
    ``params``, updated in place.

    Under torch.distributed each rank passes only its own workers' deltas (R =
    ``len(deltas) * world_size``) and the merge runs over collectives
    (:func:`~mergekit_loco.train.collectives.merge_across_ranks`, optionally with ``compression``
    "bf16" or "int8" of what travels); ``last_comm_stats`` then holds its cost.
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
        if lr <= 0:
            raise ValueError(f"outer lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"outer momentum must lie in [0, 1), got {momentum}")
        if nesterov and momentum == 0:
            raise ValueError("Nesterov needs momentum > 0")
        self.params = dict(params)
        if isinstance(aggregator, MergeMethod):
            if aggregator_options:
                raise ValueError("pass aggregator options to get_method, not with a method object")
            self.method = aggregator
        else:
            self.method = get_method(aggregator, **aggregator_options)
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.process_group = process_group
        self.compression = compression
        self.last_comm_stats: CommStats | None = None
        self.steps_taken = 0
        self.momentum_buffers: dict[str, torch.Tensor] = {}

    # -- aggregation --------------------------------------------------------------------------
    def aggregate(self, deltas: Sequence[TaskVector]) -> TaskVector:
        """The merged delta of all workers (this rank's ``deltas`` plus the other ranks')."""
        merged, self.last_comm_stats = aggregate_worker_deltas(
            self.method,
            deltas,
            round_index=self.steps_taken,
            group=self.process_group,
            compression=self.compression,
        )
        return merged

    # -- step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, deltas: Sequence[TaskVector]) -> TaskVector:
        """Aggregate ``deltas`` and update ``params`` in place; returns the merged delta."""
        merged = self.aggregate(deltas)
        for name in merged:
            if not torch.isfinite(merged[name]).all():
                raise FloatingPointError(f"non-finite pseudo-gradient for {name!r}; params kept")
        for name, param in self.params.items():
            if name not in merged:
                continue
            pseudo_gradient = -merged[name].to(param.dtype)
            update = pseudo_gradient
            if self.momentum > 0:
                buf = self.momentum_buffers.get(name)
                if buf is None:
                    buf = self.momentum_buffers[name] = pseudo_gradient.clone()
                else:
                    buf.mul_(self.momentum).add_(pseudo_gradient)
                update = pseudo_gradient.add(buf, alpha=self.momentum) if self.nesterov else buf
            param.sub_(update, alpha=self.lr)
        self.steps_taken += 1
        return merged

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "steps_taken": self.steps_taken,
            "momentum_buffers": {n: b.clone() for n, b in self.momentum_buffers.items()},
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.steps_taken = int(state["steps_taken"])
        self.momentum_buffers = {
            name: buf.to(device=self.params[name].device, dtype=self.params[name].dtype).clone()
            for name, buf in state["momentum_buffers"].items()
        }
