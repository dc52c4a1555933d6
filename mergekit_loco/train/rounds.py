"""One round of inner steps: a DiLoCo worker's turn, or a data-parallel round; evaluation.

A DiLoCo worker's turn is H plain inner steps of the compute model; the DiLoCo driver hooked on
the worker's inner optimizer ends the turn on the H-th step (its delta kept, the model reset to
the global parameters) and, after the last local worker, takes the outer step.
"""

from __future__ import annotations

import contextlib

import torch

from mergekit_loco.train.config import TrainConfig
from mergekit_loco.train.data import PreparedData, evaluate_loss
from mergekit_loco.train.progress import ProgressDisplay
from mergekit_loco.train.signals import StopSignals
from mergekit_loco.train.workers import InnerOptimizer, Worker, WorkerGroup

EVAL_BATCH = 16


def worker_turn(
    model: torch.nn.Module,
    worker: Worker,
    config: TrainConfig,
    display: ProgressDisplay,
    stop: StopSignals,
) -> float:
    """H inner steps of ``worker`` from the global parameters; the mean train loss. The
    worker's optimizer state visits the device only now."""
    device = next(model.parameters()).device
    worker.inner.to(device)
    loss_sum = torch.zeros((), device=device)
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
