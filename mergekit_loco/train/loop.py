"""The training loop: DiLoCo with any merge method as the aggregator, or a data-parallel baseline.

One DiLoCo round: each worker i = 1..R starts from the global parameters theta, takes H inner
steps on its own shard and ends at theta_i; ``tau_i = theta_i - theta``; the OuterOptimizer
merges tau_1..tau_R with the aggregator and updates theta with SGD / Nesterov on the
pseudo-gradient ``g = -merged``. Data-parallel mode ("dp") trains one model on the global
batch (every worker's batch) each step, with no outer step; it is organised in rounds of H steps
only for logging and checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from mergekit_loco.io import open_checkpoint
from mergekit_loco.io.atomic import write_atomically
from mergekit_loco.methods import METHODS
from mergekit_loco.task_vector import TaskVector
from mergekit_loco.train.checkpoint import (
    Checkpoint,
    latest_checkpoint,
    load_checkpoint,
    read_state,
    restore_rng_state,
    rng_state,
    save_checkpoint,
)
from mergekit_loco.train.collectives import modelled_comm_stats
from mergekit_loco.train.config import TrainConfig
from mergekit_loco.train.data import (
    BatchStream,
    DataExhausted,
    PreparedData,
    evaluate_loss,
    load_or_train_tokenizer,
    load_tokenizer,
    prepare_data,
    worker_shard,
)
from mergekit_loco.train.model import (
    build_model,
    count_parameters,
    model_config,
    parameter_checksum,
)
from mergekit_loco.train.outer import OuterOptimizer
from mergekit_loco.train.workers import (
    InnerOptimizer,
    PeerLost,
    Worker,
    WorkerGroup,
    open_worker_group,
)

METRICS = "metrics.jsonl"
CONFIG = "config.json"
FINAL = "final"
EVAL_BATCH = 16
#: A round whose global parameters end more than this many times larger (L2 norm) than they
#: started has diverged: healthy rounds change the norm by under 20 % (every preset, measured).
EXPLOSION_GROWTH = 1000.0
#: Test hook (docs/reliability.md): ``MLOCO_FAULT_AT=RANK:ROUND:TURN:SIGNAL`` makes the process
#: of rank RANK send itself SIGSIGNAL (KILL: dies, STOP: hangs, TERM, INT) before its TURN-th
#: worker turn of round ROUND, or before the outer step for TURN = its workers + 1 (DiLoCo; all
#: counted from 1).
FAULT_ENV = "MLOCO_FAULT_AT"


@dataclass
class TrainResult:
    """What a run produced. ``val_loss`` is None when it stopped early (``stop_after``)."""

    out: Path
    val_loss: float | None
    rounds: int
    checksum: str
    tokens: int
    seconds: float
    finished: bool


class TrainingInterrupted(RuntimeError):
    """SIGINT / SIGTERM stopped the run; the message says which checkpoint resumes it."""


class TrainingDiverged(FloatingPointError):
    """A non-finite train loss or pseudo-gradient, or exploding global parameters; the message
    names the round and the last good checkpoint."""


# -- the loop -------------------------------------------------------------------------------------
def train(config: TrainConfig, progress: bool = True) -> TrainResult:
    """Run (or resume) the training ``config`` describes; see docs/training.md."""
    config.validate()
    started = time.perf_counter()
    out = Path(config.out)
    with open_worker_group(config) as group, StopSignals(enabled=not group.distributed) as stop:
        resume_from = check_output(out, config)
        device, H, R = group.device, config.inner_steps, config.workers
        torch.manual_seed(config.seed)
        tokenizer_path, tokenizer = main_process_first(group, lambda: find_tokenizer(config))
        model = load_model(config, tokenizer).to(device).train()
        config.check_budget(count_parameters(model))
        rounds = config.total_rounds(count_parameters(model))
        diloco = config.mode == "diloco"
        if diloco:  # theta: the global parameters, apart from the compute model
            theta = {n: p.detach().clone() for n, p in model.named_parameters()}
            shared = make_outer_optimizer(config, theta)
        else:  # one model: theta is its parameters
            theta = {n: p.detach() for n, p in model.named_parameters()}
            shared = InnerOptimizer(model, config, rounds * H)
        data = main_process_first(group, lambda: load_data(config, tokenizer_path, rounds))
        workers = [
            Worker(
                index,
                BatchStream(worker_shard(data.train, index, R), config.seq_len),
                InnerOptimizer(model, config, rounds * H) if diloco else None,
            )
            for index in group.worker_ids
        ]

        start_round = 0
        if resume_from is not None:
            start_round = restore(resume_from, group, theta, shared, workers, device)
        check_data_left(workers, config, rounds - start_round)
        group.check_identical(parameter_checksum(theta), "global parameters")
        claim_output(out, config, group)
        metrics = MetricsLog(out / METRICS, group.is_main, keep_until_round=start_round)
        if group.is_main:
            write_atomically(out / CONFIG, json.dumps(config.to_dict(), indent=2) + "\n")

        def checkpoint(completed_rounds: int) -> Path:
            state = Checkpoint(
                round=completed_rounds,
                config=config.to_dict(),
                global_params=theta,
                shared=shared.state_dict(),
                workers={w.index: worker_state(w) for w in workers},
                rng=rng_state(),
            )
            return save_checkpoint(out, state, group, config.keep_checkpoints)

        last_saved = (start_round, resume_from)
        steps_per_round = H * (len(workers) if diloco else 1)
        display = ProgressDisplay(
            progress and not config.quiet and group.is_main, rounds, steps_per_round, start_round
        )
        outer_seconds_total = round_seconds_total = 0.0
        train_loss, completed = None, start_round
        try:
            for round_index in range(start_round, rounds):
                if stop.requested:  # between rounds: the state is that of a completed round
                    if last_saved[0] != round_index:
                        last_saved = (round_index, checkpoint(round_index))
                    raise TrainingInterrupted(f"after round {round_index}")
                round_start = time.perf_counter()
                display.begin_round(round_index)
                norm_before = parameter_norm(theta)
                if diloco:
                    deltas, loss_sum = [], 0.0
                    for turn, worker in enumerate(workers, start=1):
                        fault_if_asked(group.rank, round_index + 1, turn)
                        delta, loss = worker_turn(model, theta, worker, config, display, stop)
                        deltas.append(delta)
                        loss_sum += loss
                    train_loss = group.sum([loss_sum])[0] / R
                    fault_if_asked(group.rank, round_index + 1, len(workers) + 1)
                else:
                    train_loss = dp_round(model, shared, workers, config, group, display, stop)
                if not math.isfinite(train_loss):
                    raise TrainingDiverged(f"round {round_index + 1}: train loss is {train_loss}")
                outer_start = time.perf_counter()
                if diloco:
                    try:
                        shared.step(deltas)
                    except FloatingPointError as error:
                        raise TrainingDiverged(f"round {round_index + 1}: {error}") from None
                    except RuntimeError as error:  # collectives.py: a failed collective,
                        if group.distributed and isinstance(error.__cause__, RuntimeError):
                            raise PeerLost(str(error)) from error  # from the transport's error
                        raise
                    del deltas
                synchronize(device)
                now = time.perf_counter()
                outer_seconds_total += now - outer_start
                round_seconds_total += now - round_start
                check_not_exploded(norm_before, parameter_norm(theta), round_index + 1)
                completed = round_index + 1
                metrics.write(
                    event="round",
                    round=completed,
                    tokens=completed * config.tokens_per_round(),
                    train_loss=train_loss,
                    inner_lr=(workers[0].inner or shared).lr,
                    round_seconds=now - round_start,
                    outer_step_seconds=now - outer_start,
                    tokens_per_second=config.tokens_per_round() / (now - round_start),
                    **communication_metrics(shared if diloco else None, theta, config),
                )
                if config.eval_every and completed % config.eval_every == 0 and completed < rounds:
                    if group.is_main:
                        val_loss = evaluate(model, theta, data, config, device)
                        metrics.write(event="eval", round=completed, val_loss=val_loss)
                stopping = config.stop_after == completed
                if (
                    completed == rounds
                    or stopping
                    or (config.checkpoint_every and completed % config.checkpoint_every == 0)
                ):
                    last_saved = (completed, checkpoint(completed))
                if stopping:
                    break
        except TrainingInterrupted as interrupt:
            raise TrainingInterrupted(resume_message(str(interrupt), last_saved)) from None
        except TrainingDiverged as error:
            raise TrainingDiverged(f"{error}; stopping. {last_good_message(last_saved)}") from None
        except PeerLost as error:
            raise PeerLost(
                f"round {round_index + 1}: {error}. {last_good_message(last_saved)} Restart every "
                "process with --resume to continue from it."
            ) from error
        finally:
            display.close()

        tokens = completed * config.tokens_per_round()
        if completed < rounds:  # stop_after: no final model, resume continues
            seconds = time.perf_counter() - started
            return TrainResult(out, None, completed, parameter_checksum(theta), tokens, seconds,
                               finished=False)  # fmt: skip
        val_loss = None
        if group.is_main:
            val_loss = evaluate(model, theta, data, config, device)
            save_final(out / FINAL, model, tokenizer)
        val_loss = group.broadcast(val_loss)
        checksum = parameter_checksum(theta)
        seconds = time.perf_counter() - started
        metrics.write(event="final", round=rounds, tokens=tokens, val_loss=val_loss,
                      train_loss=train_loss, checksum=checksum, seconds=seconds)  # fmt: skip
        group.barrier()
        result = TrainResult(out, val_loss, rounds, checksum, tokens, seconds, finished=True)
        if progress and not config.quiet and group.is_main:
            print_summary(config, result, round_seconds_total, outer_seconds_total)
        return result


# -- one worker's turn, one data-parallel round ---------------------------------------------------
def worker_turn(
    model: LlamaForCausalLM,
    theta: dict[str, torch.Tensor],
    worker: Worker,
    config: TrainConfig,
    display: ProgressDisplay,
    stop: StopSignals,
) -> tuple[TaskVector, float]:
    """Start from theta, take H inner steps; returns ``tau = theta_i - theta`` (float32) and the
    mean train loss of the H steps. The worker's optimizer state visits the device only now."""
    device = theta[next(iter(theta))].device
    load_params(model, theta)
    worker.inner.to(device)
    loss_sum = torch.zeros((), device=device)
    for step in range(config.inner_steps):
        batch = worker.stream.next_batch(config.worker_batch).to(device, non_blocking=True)
        with autocast(device):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        clip_gradients(model, config.grad_clip)
        worker.inner.step()
        loss_sum += loss.detach()
        stop.check()
        display.advance(worker.index, step, loss, config.worker_batch * config.seq_len)
    if device.type != "cpu":
        worker.inner.to("cpu")
    with torch.no_grad():
        delta = TaskVector({n: p.detach() - theta[n] for n, p in model.named_parameters()})
    return delta, loss_sum.item() / config.inner_steps


def dp_round(
    model: LlamaForCausalLM,
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
    share = len(workers) / config.workers
    loss_sum = torch.zeros((), device=device)
    for step in range(config.inner_steps):
        batch = torch.cat([w.stream.next_batch(config.worker_batch) for w in workers]).to(device)
        with autocast(device):
            loss = model(input_ids=batch, labels=batch).loss * share
        loss.backward()
        group.all_reduce_gradients(model)
        clip_gradients(model, config.grad_clip)
        optimizer.step()
        loss_sum += loss.detach()
        stop.check()
        display.advance(0, step, loss / share, batch.numel() / share)
    return group.sum([loss_sum.item()])[0] / config.inner_steps


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


@torch.no_grad()
def load_params(model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    for name, param in model.named_parameters():
        if param.data_ptr() != params[name].data_ptr():
            param.copy_(params[name])


def evaluate(model, theta, data: PreparedData, config: TrainConfig, device) -> float:
    """Token-weighted validation NLL of the global parameters."""
    load_params(model, theta)
    return evaluate_loss(model, data.val, config.seq_len, EVAL_BATCH, config.val_tokens, device)


# -- setup ----------------------------------------------------------------------------------------
def check_output(out: Path, config: TrainConfig) -> Path | None:
    """The checkpoint to resume from (``resume``), else make sure ``out`` holds no other run
    (unless ``force``). Refuses a resume whose run-defining config differs. Writes nothing."""
    if config.resume:
        checkpoint = latest_checkpoint(out)
        if checkpoint is None:
            raise ValueError(f"nothing to resume: {out / 'checkpoints'} holds no checkpoint")
        changes = config.differences(read_state(checkpoint)["config"])
        if changes and not config.allow_config_change:
            raise ValueError(
                f"{checkpoint} was written with another config ({'; '.join(changes)}); "
                "pass the same options, or --allow-config-change to resume anyway"
            )
        return checkpoint
    previous = previous_run(out)
    if previous and not config.force:
        raise ValueError(
            f"{out} already holds a run ({', '.join(p.name for p in previous)}); pass --resume "
            "to continue it, --force to start over, or choose another --out"
        )
    return None


def previous_run(out: Path) -> list[Path]:
    return [out / name for name in (METRICS, "checkpoints", FINAL) if (out / name).exists()]


def claim_output(out: Path, config: TrainConfig, group: WorkerGroup) -> None:
    """Create ``out``; a fresh run deletes a previous run's files there (``force``). Called once
    every check has passed, so a run that cannot start leaves ``out`` as it found it."""
    if group.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if not config.resume:
            for path in previous_run(out):
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    group.barrier()


def main_process_first(group: WorkerGroup, load):
    """``load()`` on rank 0, then on the others (they find rank 0's cache files)."""
    if group.is_main:
        result = load()
    group.barrier()
    if not group.is_main:
        result = load()
    return result


def find_tokenizer(config: TrainConfig) -> tuple[str | None, PreTrainedTokenizerBase]:
    """``--tokenizer``, else the ``--init`` folder's tokenizer, else a BPE trained on the data."""
    path = config.tokenizer
    if path is None and config.init is not None:
        init = Path(config.init)
        if any((init / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
            path = str(init)
    if path is not None:
        return path, load_tokenizer(path)
    return None, load_or_train_tokenizer(config.data, config.vocab_size)


def load_model(config: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> LlamaForCausalLM:
    """A fresh seeded model of ``config.model``, or the ``config.init`` checkpoint (an HF folder
    with config.json, or weights matching ``config.model``), in float32."""
    vocab = len(tokenizer)
    model_spec = model_config(config.model, vocab, tokenizer.bos_token_id, tokenizer.eos_token_id)
    if config.init is None:
        return build_model(model_spec, config.seed)
    init = Path(config.init)
    if (init / "config.json").is_file():
        model = LlamaForCausalLM.from_pretrained(init, dtype=torch.float32, local_files_only=True)
    else:
        model = build_model(model_spec, config.seed)
        with open_checkpoint(init) as reader:
            weights = {name: reader.get(name) for name in reader.names()}
        result = model.load_state_dict(weights, strict=False)
        problems = [*result.missing_keys, *result.unexpected_keys]
        if problems:
            raise ValueError(
                f"init checkpoint {init} does not fit model {config.model!r}: tensor "
                f"{problems[0]!r} is {'missing' if result.missing_keys else 'unexpected'}"
            )
    if model.config.vocab_size < vocab:
        raise ValueError(
            f"init checkpoint {init} has a vocabulary of {model.config.vocab_size}, smaller than "
            f"the tokenizer's {vocab}"
        )
    return model.to(torch.float32)


def load_data(config: TrainConfig, tokenizer_path: str | None, rounds: int) -> PreparedData:
    """Train tokens for ``rounds`` rounds (R equal shards), ``val_tokens`` held out."""
    train_tokens = rounds * config.tokens_per_round()
    try:
        return prepare_data(
            config.data,
            tokenizer=tokenizer_path,
            max_train_tokens=train_tokens,
            val_tokens=config.val_tokens,
            vocab_size=config.vocab_size,
            seed=config.seed,
        )
    except ValueError as error:
        raise ValueError(
            f"{error} (the run needs {train_tokens:,} training tokens: {rounds} rounds x "
            f"{config.tokens_per_round():,}; lower the token budget or give more data)"
        ) from None


def communication_metrics(
    outer: OuterOptimizer | None, theta: dict[str, torch.Tensor], config: TrainConfig
) -> dict:
    """This rank's bytes and seconds of the round's communication (docs/distributed.md).

    Under torchrun: what the outer step's collectives sent. Simulated: what each worker would
    send as its own rank (P = R). dp: the H gradient all-reduces, ``2 (R-1)/R N`` bytes each.
    """
    if outer is None:
        model_bytes = sum(t.numel() * t.element_size() for t in theta.values())
        ring = 2 * (config.workers - 1) / config.workers * model_bytes
        return {"comm_bytes_sent": int(config.inner_steps * ring), "comm_plan": "all-reduce"}
    stats = outer.last_comm_stats
    if stats is None or stats.plan == "local":
        layout = [(name, tensor.shape, torch.float32) for name, tensor in theta.items()]
        stats = modelled_comm_stats(outer.method, layout, config.workers, config.compression)
    return {
        "comm_bytes_sent": stats.bytes_sent,
        "comm_bytes_naive": stats.bytes_naive,
        "comm_seconds": stats.comm_seconds,
        "spectral_seconds": stats.spectral_seconds,
        "comm_plan": stats.plan,
    }


def make_outer_optimizer(config: TrainConfig, theta: dict[str, torch.Tensor]) -> OuterOptimizer:
    """The OuterOptimizer, after a shape-only dry run of the aggregator on R meta tensors
    (so that e.g. TSV with more workers than a matrix has rows fails before any compute)."""
    options = dict(config.aggregator_options)
    if "seed" in METHODS[config.aggregator].parameter_names():  # DARE's masks follow the run
        options.setdefault("seed", config.seed)
    outer = OuterOptimizer(
        theta,
        config.aggregator,
        lr=config.outer_lr,
        momentum=config.outer_momentum,
        nesterov=config.nesterov,
        compression=config.compression,
        **options,
    )
    shapes = TaskVector({n: torch.empty(t.shape, device="meta") for n, t in theta.items()})
    outer.method.merge([shapes] * config.workers)
    return outer


def worker_state(worker: Worker) -> dict:
    return {
        "data": worker.stream.state_dict(),
        "inner": worker.inner.state_dict() if worker.inner is not None else None,
    }


def restore(path: Path, group: WorkerGroup, theta, shared, workers: list[Worker], device) -> int:
    """Load this process's part of the checkpoint at ``path``; returns its round."""
    saved = load_checkpoint(path, [w.index for w in workers], group.rank)
    if set(saved.global_params) != set(theta):
        raise ValueError(f"checkpoint {path} holds other tensors than the model")
    with torch.no_grad():
        for name, tensor in theta.items():
            tensor.copy_(saved.global_params[name])
    shared.load_state_dict(saved.shared)
    for worker in workers:
        worker.stream.load_state_dict(saved.workers[worker.index]["data"])
        if worker.inner is not None:
            worker.inner.load_state_dict(saved.workers[worker.index]["inner"])
            if device.type != "cpu":
                worker.inner.to("cpu")
    restore_rng_state(saved.rng)
    return saved.round


def save_final(folder: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase) -> None:
    """``folder``: config.json + model.safetensors + tokenizer, written beside and renamed."""
    staging = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    finally:
        hf_logging.enable_progress_bar()
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)


def fault_if_asked(rank: int, round_number: int, turn: int) -> None:
    """Send this process the signal :data:`FAULT_ENV` names for this rank, round and turn."""
    where, _, name = os.environ.get(FAULT_ENV, "").rpartition(":")
    if where == f"{rank}:{round_number}:{turn}":
        os.kill(os.getpid(), signal.Signals[f"SIG{name}"])


def parameter_norm(params: dict[str, torch.Tensor]) -> float:
    """``sqrt(sum_n ||p_n||^2)``, accumulated in float64; inf or nan if any entry is."""
    norms = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in params.values()]
    return torch.linalg.vector_norm(torch.stack(norms)).item()


def check_not_exploded(norm_before: float, norm_after: float, round_number: int) -> None:
    """Raise TrainingDiverged if the round left non-finite parameters or multiplied their norm
    by more than :data:`EXPLOSION_GROWTH` (before any checkpoint of this round is written)."""
    if not math.isfinite(norm_after) or norm_after > EXPLOSION_GROWTH * norm_before:
        raise TrainingDiverged(
            f"round {round_number}: the global parameters exploded (L2 norm {norm_before:.4g} -> "
            f"{norm_after:.4g}, more than {EXPLOSION_GROWTH:g}x in one round); lower --inner-lr "
            "or --outer-lr"
        )


def check_data_left(workers: list[Worker], config: TrainConfig, rounds_left: int) -> None:
    """Every worker's shard must hold the tokens of the rounds still to run (before any step)."""
    needed = rounds_left * config.inner_steps * config.worker_batch * config.seq_len
    for worker in workers:
        if worker.stream.tokens_left < needed:
            raise DataExhausted(
                f"worker {worker.index}'s data shard has {worker.stream.tokens_left:,} tokens left"
                f", the {rounds_left} remaining rounds need {needed:,} (use more data, or resume "
                "with the config the checkpoint was written with)"
            )


def resume_message(what: str, last_saved: tuple[int, Path | None]) -> str:
    round_index, path = last_saved
    if path is None:
        return f"interrupted {what}; no checkpoint was written yet, so --resume is not possible"
    return f"interrupted {what}; --resume continues from {path} (after round {round_index})"


def last_good_message(last_saved: tuple[int, Path | None]) -> str:
    round_index, path = last_saved
    if path is None:
        return "No checkpoint was written before it."
    return f"The last good checkpoint is {path} (after round {round_index})."


# -- metrics, progress, signals -------------------------------------------------------------------
class MetricsLog:
    """``metrics.jsonl``: one JSON object per line, appended and flushed (rank 0 only).

    On resume the lines after the checkpoint's round are dropped, so the log of a resumed run
    reads like that of an uninterrupted one.
    """

    def __init__(self, path: Path, enabled: bool, keep_until_round: int):
        self.path = path
        self.enabled = enabled
        if enabled and path.is_file():
            kept = [
                line
                for line in path.read_text().splitlines()
                if line.strip()
                and json.loads(line).get("event") != "final"
                and json.loads(line).get("round", 0) <= keep_until_round
            ]
            write_atomically(path, "".join(f"{line}\n" for line in kept))

    def write(self, **event) -> None:
        if self.enabled:
            with open(self.path, "a") as stream:
                stream.write(json.dumps(event) + "\n")


class ProgressDisplay:
    """A rich progress bar over inner steps: round, worker, step, tokens/s, loss."""

    def __init__(self, enabled: bool, rounds: int, steps_per_round: int, start_round: int):
        self.progress = None
        self.rounds = rounds
        self.round_index = start_round
        self.tokens = 0
        self.started = time.perf_counter()
        if enabled:
            self.progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
            )
            self.task = self.progress.add_task(
                "", total=rounds * steps_per_round, completed=start_round * steps_per_round,
                status="",
            )  # fmt: skip
            self.progress.start()

    def begin_round(self, round_index: int) -> None:
        self.round_index = round_index

    def advance(self, worker: int, step: int, loss: torch.Tensor, tokens: float) -> None:
        if self.progress is None:
            return
        self.tokens += tokens
        rate = self.tokens / (time.perf_counter() - self.started)
        self.progress.update(
            self.task,
            advance=1,
            description=f"round {self.round_index + 1}/{self.rounds} worker {worker} "
            f"step {step + 1}",
            status=f"{rate:,.0f} tok/s  loss {loss.item():.3f}",
        )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class StopSignals:
    """In a single-process run, SIGINT / SIGTERM ask the loop to stop at the next inner step;
    a second SIGINT kills at once."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.requested = False
        self.previous = {}

    def _handle(self, signum, frame) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def check(self) -> None:
        if self.requested:
            raise TrainingInterrupted("during a round")

    def __enter__(self) -> StopSignals:
        if self.enabled:
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def print_summary(config: TrainConfig, result: TrainResult, round_s: float, outer_s: float):
    table = Table(title=f"{config.preset} on {config.model}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    method = "data-parallel AdamW" if config.mode == "dp" else config.aggregator
    table.add_row("aggregator", method)
    table.add_row("workers x inner steps", f"{config.workers} x {config.inner_steps}")
    table.add_row("rounds", str(result.rounds))
    table.add_row("tokens", f"{result.tokens:,}")
    table.add_row("final val loss", f"{result.val_loss:.4f}")
    table.add_row("time", f"{result.seconds:.1f} s")
    if round_s > 0:
        table.add_row("outer step share", f"{100 * outer_s / round_s:.1f} %")
    table.add_row("params sha256", result.checksum[:16])
    table.add_row("output", str(result.out))
    Console().print(table)
