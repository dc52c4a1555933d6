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


#: The dropout modules of torch: a model holding one of p > 0 draws random numbers.
DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
            torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)  # fmt: skip


def turn_seed(seed: int, *key: int) -> int:
    """``sha256(seed, key...) mod 2**63``: the seed of one worker's turn, ``key`` = (round,
    worker) in DiLoCo, (round, worker, step) in dp."""
    text = "|".join(str(part) for part in ("mloco-turn", seed, *key))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % 2**63


@contextlib.contextmanager
def turn_rng(device: torch.device, seed: int, *key: int) -> Iterator[None]:
    """Inside: the CPU generator (and ``device``'s, on CUDA) seeded with :func:`turn_seed`, so a
    worker's dropout masks are the same whichever process runs it and whatever ran before
    (nothing to checkpoint); outside, the global RNG is as it was."""
    turn = turn_seed(seed, *key)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        torch.default_generator.manual_seed(turn)
        for each in cuda:
            with torch.cuda.device(each):
                torch.cuda.manual_seed(turn)
        yield


def draws_randomness(model: torch.nn.Module) -> bool:
    """Whether a training forward pass of ``model`` draws random numbers: a torch dropout module
    of p > 0, or a config ``attention_dropout`` above 0 (Llama-like models hand that rate to the
    attention kernel, with no module)."""
    rate = getattr(getattr(model, "config", None), "attention_dropout", 0.0)
    if isinstance(rate, int | float) and rate > 0:
        return True
    return any(isinstance(m, DROPOUTS) and m.p > 0 for m in model.modules())


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
    with turn_rng(device, config.run.seed, round_index, worker.index):
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
    round_index: int,
    group: WorkerGroup,
    display: ProgressDisplay,
    stop: StopSignals,
) -> float:
    """H steps of one model on the global batch (every worker's next batch); mean train loss.

    Each process computes the loss of its workers' share of the batch, scaled by that share
    (``len(workers) / R``), so the gradients summed over processes are the global batch's. A
    model that :func:`draws_randomness` (dropout) takes one forward pass per worker instead,
    ``loss_w / R`` under :func:`turn_rng` of (round, worker, step), so its masks do not depend
    on the number of processes; any other model one pass over the share."""
    device = next(model.parameters()).device
    share = len(workers) / config.run.workers
    per_worker = draws_randomness(model)
    loss_sum = torch.zeros((), device=device)
    for step in range(config.inner.steps):
        batches = [w.stream.next_batch(config.worker_batch).to(device) for w in workers]
        if per_worker:
            loss = torch.zeros((), device=device)
            for worker, batch in zip(workers, batches, strict=True):
                with turn_rng(device, config.run.seed, round_index, worker.index, step):
                    with autocast(device):
                        worker_loss = model(input_ids=batch, labels=batch).loss
                    (worker_loss / config.run.workers).backward()
                loss += worker_loss.detach() / config.run.workers
        else:
            batch = torch.cat(batches)
            with autocast(device):
                loss = model(input_ids=batch, labels=batch).loss * share
            loss.backward()
        group.all_reduce_gradients(model)
        clip_gradients(model, config.inner.grad_clip)
        optimizer.step()
        loss_sum += loss.detach()
        stop.check()
        tokens = sum(batch.numel() for batch in batches)
        display.advance(0, step, loss / share, tokens / share)
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
