"""DiLoCo workers: simulated in one process, or spread over torchrun processes, one interface.

A run has R workers. A :class:`WorkerGroup` is this process's share of them and its line to
the other processes: ``SimulatedWorkers`` runs all R one after another in one process;
``TorchrunWorkers`` gives each of the P processes R/P of them, worker ``rank * R/P + j`` for
local index j, so worker i reads the same shard under both. Every worker keeps its own
:class:`InnerOptimizer` and data stream across rounds.

Memory (simulated): one model object does the compute for every worker. Between turns a
worker's optimizer state lives on the CPU and is moved to the device only for its turn, so the
device holds the model, the global parameters, the R deltas of a round and one optimizer state.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR

from mergekit_loco.device import resolve_device
from mergekit_loco.dist import guarded
from mergekit_loco.dist.transport import note_group_timeout
from mergekit_loco.train.config import TrainConfig
from mergekit_loco.train.data import BatchStream
from mergekit_loco.train.schedule import WarmupCosine


def embedding_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The input and output embeddings and every other ``nn.Embedding`` (positions): Muon suits
    hidden matrices only, these stay with AdamW."""
    found = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    output = getattr(model, "get_output_embeddings", lambda: None)()
    return found + ([output.weight] if output is not None else [])


class InnerOptimizer:
    """One worker's inner optimizer(s) with the warmup-cosine schedule over ``total_steps``.

    ``adamw``: AdamW(betas, weight_decay) on every parameter. ``muon``: torch.optim.Muon on the
    hidden 2-D matrices, not the embeddings nor the output head (lr matched to AdamW's RMS, so
    the same ``inner_lr`` works), and AdamW on the rest. All optimizers act on the shared
    compute model's parameters; each instance keeps its own state.
    """

    def __init__(self, model: torch.nn.Module, config: TrainConfig, total_steps: int):
        params = [p for p in model.parameters() if p.requires_grad]
        adamw_params, muon_params = params, []
        if config.inner.optimizer == "muon":
            embeddings = {id(p) for p in embedding_parameters(model)}
            muon_params = [p for p in params if p.ndim == 2 and id(p) not in embeddings]
            muon_ids = {id(p) for p in muon_params}
            adamw_params = [p for p in adamw_params if id(p) not in muon_ids]
        self.optimizers: list[torch.optim.Optimizer] = []
        if adamw_params:
            self.optimizers.append(
                torch.optim.AdamW(
                    adamw_params,
                    lr=config.inner.lr,
                    betas=config.inner.betas,
                    weight_decay=config.inner.weight_decay,
                )
            )
        if muon_params:
            self.optimizers.append(
                torch.optim.Muon(
                    muon_params,
                    lr=config.inner.lr,
                    weight_decay=config.inner.weight_decay,
                    adjust_lr_fn="match_rms_adamw",
                )
            )
        self.schedulers = [
            LambdaLR(optimizer, WarmupCosine(total_steps, config.inner.warmup_fraction))
            for optimizer in self.optimizers
        ]

    @property
    def lr(self) -> float:
        """The learning rate of the next step."""
        return self.optimizers[0].param_groups[0]["lr"]

    def register_step_pre_hook(self, hook):
        """torch's hook on the first optimizer's step: it runs before any parameter steps."""
        return self.optimizers[0].register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        """torch's hook on the last optimizer's step: it runs once every parameter has stepped
        (how the DiLoCo driver counts inner steps)."""
        return self.optimizers[-1].register_step_post_hook(hook)

    def step(self) -> None:
        """One optimizer step, one schedule step, gradients cleared."""
        for optimizer in self.optimizers:
            optimizer.step()
        for scheduler in self.schedulers:
            scheduler.step()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def to(self, device: torch.device | str) -> None:
        """Move the optimizer state (moments, momentum) to ``device``; step counts stay put."""
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and key != "step":
                        state[key] = value.to(device)

    def state_dict(self) -> dict:
        return {
            "optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
            "schedulers": [scheduler.state_dict() for scheduler in self.schedulers],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``'s moments, step counts and schedule position. The
        hyperparameters stay this optimizer's own (lr, betas, weight decay, the schedule's
        length), where torch would load the saved ones: a run resumed with another config
        trains with it, at lr = its lr x its schedule at the step reached."""
        if len(state["optimizers"]) != len(self.optimizers):
            raise ValueError("the checkpoint's inner optimizers do not match inner_optimizer")
        own_groups = [
            [{key: value for key, value in group.items() if key != "params"}
             for group in optimizer.param_groups]
            for optimizer in self.optimizers
        ]  # fmt: skip
        own_schedules = [
            (list(scheduler.base_lrs), [dict(vars(f)) for f in scheduler.lr_lambdas])
            for scheduler in self.schedulers
        ]
        for optimizer, saved in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        for scheduler, saved in zip(self.schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)
        for optimizer, groups in zip(self.optimizers, own_groups, strict=True):
            for group, own in zip(optimizer.param_groups, groups, strict=True):
                group.update(own)
        for scheduler, (base_lrs, lambdas) in zip(self.schedulers, own_schedules, strict=True):
            scheduler.base_lrs = base_lrs
            for function, own in zip(scheduler.lr_lambdas, lambdas, strict=True):
                vars(function).update(own)
            lrs = [base * f(scheduler.last_epoch)
                   for base, f in zip(base_lrs, scheduler.lr_lambdas, strict=True)]  # fmt: skip
            for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
                group["lr"] = lr
            scheduler._last_lr = lrs


@dataclass
class Worker:
    """Worker ``index`` of R: its data stream and (DiLoCo) its own inner optimizer."""

    index: int
    stream: BatchStream
    inner: InnerOptimizer | None = None


class WorkerGroup:
    """The workers this process runs and the collectives that join it to the others.

    ``worker_ids``: the global indices of this process's workers. Collectives are identities
    for one process.
    """

    rank: int = 0
    world_size: int = 1

    def __init__(self, workers: int, device: torch.device):
        if workers % self.world_size:
            raise ValueError(
                f"{workers} workers cannot be split evenly over {self.world_size} processes "
                "(workers must be a multiple of --nproc_per_node x nodes)"
            )
        self.device = device
        per_process = workers // self.world_size
        self.worker_ids = list(range(self.rank * per_process, (self.rank + 1) * per_process))

    @property
    def is_main(self) -> bool:
        """Rank 0 writes metrics, the final model and the checkpoint's shared files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        pass

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of ``values`` over all processes."""
        return list(values)

    def broadcast(self, value):
        """Rank 0's ``value`` (a picklable object) on every process."""
        return value

    def gather(self, value) -> list:
        """Every process's ``value``, in rank order (on every process)."""
        return [value]

    def all_reduce_gradients(self, model: torch.nn.Module) -> None:
        """Sum the gradients over processes (data-parallel mode)."""

    def check_identical(self, checksum: str, what: str) -> None:
        """Raise ``ValueError`` unless every process holds the same ``checksum`` of ``what``."""

    def close(self) -> None:
        pass

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class SimulatedWorkers(WorkerGroup):
    """All R workers in this process, one after another: the DiLoCo driver gets their R inner
    optimizers and ends a worker's turn every H steps (train/diloco.py), as under torchrun."""


class TorchrunWorkers(WorkerGroup):
    """R/P workers in each of the P processes torchrun started (gloo on CPU, NCCL on GPU).

    Every collective waits at most ``timeout`` seconds; a failure or a timeout (a peer that
    died or hangs) raises :class:`~mergekit_loco.dist.CollectiveFailed`."""

    def __init__(self, workers: int, device: torch.device, timeout: float):
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.timeout = timeout
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        super().__init__(workers, device)
        self.created_process_group = not dist.is_initialized()
        if self.created_process_group:
            self._collective(
                "joining the process group",
                dist.init_process_group,
                backend="nccl" if device.type == "cuda" else "gloo",
                timeout=datetime.timedelta(seconds=timeout),
                device_id=device if device.type == "cuda" else None,
            )
            note_group_timeout(timeout)  # the outer step's collectives name it on failure

    def _collective(self, what: str, call: Callable, *args, **kwargs):
        """``call(*args, **kwargs)`` through :func:`~mergekit_loco.dist.guarded`."""
        who = f"rank {self.rank} of {self.world_size}"
        return guarded(who, what, call, *args, timeout_s=self.timeout, **kwargs)

    def barrier(self) -> None:
        self._collective("barrier", dist.barrier)

    def sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        self._collective("all-reduce", dist.all_reduce, tensor)
        return tensor.tolist()

    def broadcast(self, value):
        box = [value]
        self._collective("broadcast", dist.broadcast_object_list, box, src=0)
        return box[0]

    def gather(self, value) -> list:
        gathered = [None] * self.world_size
        self._collective("all-gather", dist.all_gather_object, gathered, value)
        return gathered

    def all_reduce_gradients(self, model: torch.nn.Module) -> None:
        for param in model.parameters():
            if param.grad is not None:
                self._collective("gradient all-reduce", dist.all_reduce, param.grad)

    def check_identical(self, checksum: str, what: str) -> None:
        digest = torch.tensor(list(bytes.fromhex(checksum)), dtype=torch.uint8, device=self.device)
        gathered = [torch.empty_like(digest) for _ in range(self.world_size)]
        self._collective("all-gather", dist.all_gather, gathered, digest)
        digests = [bytes(t.tolist()).hex() for t in gathered]
        if len(set(digests)) > 1:
            listing = ", ".join(f"rank {r}: {d[:12]}" for r, d in enumerate(digests))
            raise ValueError(
                f"{what} differ between processes ({listing}); every process must be started "
                "with the same options and find the same data, init and resume checkpoints"
            )

    def close(self) -> None:
        """Destroy the process group if this object created it (never one it found)."""
        if self.created_process_group and dist.is_initialized():
            dist.destroy_process_group()
            note_group_timeout(None)


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def open_worker_group(config: TrainConfig) -> WorkerGroup:
    """Torchrun workers when started by torchrun with more than one process, else simulated."""
    device = resolve_device(config.run.device)
    if launched_by_torchrun():
        return TorchrunWorkers(config.run.workers, device, config.run.timeout)
    return SimulatedWorkers(config.run.workers, device)
