"""One round of inner steps: a DiLoCo worker's turn, or a data-parallel round; evaluation.

A DiLoCo worker's turn is H plain inner steps of the compute model; the DiLoCo driver hooked on
the worker's inner optimizer ends the turn on the H-th step (its delta kept, the model reset to
the global parameters) and, after the last local worker, takes the outer step. The turn's
randomness (dropout) comes from :func:`turn_rng`, a function of (seed, round, worker) alone.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

from mergekit_loco.train.config import TrainConfig
from mergekit_loco.train.data import PreparedData, evaluate_loss
from mergekit_loco.train.progress import ProgressDisplay
from mergekit_loco.train.signals import StopSignals
from mergekit_loco.train.workers import InnerOptimizer, Worker, WorkerGroup

EVAL_BATCH = 16


def turn_seed(seed: int, round_index: int, worker_index: int) -> int:
    """``sha256(seed, round, worker) mod 2**63``: the seed of one worker's turn in one round."""
    digest = hashlib.sha256(f"mloco-turn|{seed}|{round_index}|{worker_index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 2**63


@contextlib.contextmanager
def turn_rng(
    seed: int, round_index: int, worker_index: int, device: torch.device
) -> Iterator[None]:
    """Inside: the CPU generator (and ``device``'s, on CUDA) seeded with :func:`turn_seed`, so a
    worker's dropout masks are the same whichever process runs it and whatever ran before
    (nothing to checkpoint); outside, the global RNG is as it was."""
    key = turn_seed(seed, round_index, worker_index)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.default_generator.manual_seed(key)
        for each in cuda:
            with torch.cuda.device(each):
                torch.cuda.manual_seed(key)
        yield


def worker_turn(
    model: torch.nn.Module,
    worker: Worker,
    config: TrainConfig,
    round_index: int,
    display: ProgressDisplay,
    stop: StopSignals,
) -> float:
    """H inner steps of ``worker`` from the global parameters in round ``round_index`` (0-based),
    under :func:`turn_rng`; the mean train loss. The worker's optimizer state visits the device
    only now."""
    device = next(model.parameters()).device
    worker.inner.to(device)
    loss_sum = torch.zeros((), device=device)
    with turn_rng(config.run.seed, round_index, worker.index, device):
        for step in range(config.inner.steps):
            batch = worker.stream.next_batch(config.worker_batch).to(device, non_blocking=True)
            with autocast(device):
                loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            clip_gradients(model, config.inner.grad_clip)
            worker.inner.step()
            loss_sum += loss.detach()
            stop.check()
            display.advance(worker.index, step, loss, config.worker_batch * config.data.seq_len)
    if device.type != "cpu":
        worker.inner.to("cpu")
    return loss_sum.item() / config.inner.steps


def dp_round(
    model: torch.nn.Module,
    optimizer: InnerOptimizer,
    workers: list[Worker],
    config: TrainConfig,
    group: WorkerGroup,
    display: ProgressDisplay,
    stop: StopSignals,
) -> float:
    """H steps of one model on the global batch (every worker's next batch); mean train loss.

    Each process computes the loss of its workers' share of the batch, scaled by that share
    (``len(workers) / R``), so the gradients summed over processes are the global batch's."""
    device = next(model.parameters()).device
    share = len(workers) / config.run.workers
    loss_sum = torch.zeros((), device=device)
    for step in range(config.inner.steps):
        batch = torch.cat([w.stream.next_batch(config.worker_batch) for w in workers]).to(device)
        with autocast(device):
            loss = model(input_ids=batch, labels=batch).loss * share
        loss.backward()
        group.all_reduce_gradients(model)
        clip_gradients(model, config.inner.grad_clip)
        optimizer.step()
        loss_sum += loss.detach()
        stop.check()
        display.advance(0, step, loss / share, batch.numel() / share)
    return group.sum([loss_sum.item()])[0] / config.inner.steps


def evaluate(model: torch.nn.Module, data: PreparedData, config: TrainConfig) -> float:
    """Token-weighted validation NLL of the model (at a round's end: the global parameters)."""
    device = next(model.parameters()).device
    return evaluate_loss(
        model, data.val, config.data.seq_len, EVAL_BATCH, config.data.val_tokens, device
    )


def clip_gradients(model: torch.nn.Module, max_norm: float) -> None:
    if max_norm > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def autocast(device: torch.device):
    """bf16 autocast on CUDA; full float32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
