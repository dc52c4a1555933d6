"""``mloco train``'s loop: DiLoCo with any merge method as the aggregator, or a data-parallel
baseline, on top of the public :class:`~mergekit_loco.train.diloco.DiLoCo` driver.

One DiLoCo round: each worker i = 1..R starts from the global parameters theta and takes H
inner steps on its own shard; the driver, hooked on the inner optimizers, merges the deltas
``tau_i = theta_i - theta`` with the aggregator and steps torch SGD / Nesterov on the
pseudo-gradient ``-merged``. Data-parallel mode ("dp") trains one model on the global batch
each step, in rounds of H steps only for logging and checkpoints. Setup, checkpoints and resume
live in run.py, the failure messages in guards.py, the run folder in run_folder.py.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from mergekit_loco.console import print_line
from mergekit_loco.dist import modelled_comm_stats
from mergekit_loco.io.lock import FolderLock
from mergekit_loco.run_layout import FINAL, LATEST, METRICS
from mergekit_loco.train import rounds as turns
from mergekit_loco.train.checkpoint import pointed_name
from mergekit_loco.train.config import TrainConfig, preset_config
from mergekit_loco.train.guards import (
    TrainingDiverged,
    TrainingFailed,
    check_finite_loss,
    check_finite_val_loss,
    check_not_exploded,
    failing_resumably,
    interrupted_at_once,
    last_good_message,
    naming_the_last_checkpoint,
    parameter_norm,
    resume_message,
)
from mergekit_loco.train.model import parameter_checksum
from mergekit_loco.train.progress import ProgressDisplay, print_summary
from mergekit_loco.train.run import Run, start_run
from mergekit_loco.train.run_folder import save_final
from mergekit_loco.train.signals import StopSignals, TrainingInterrupted
from mergekit_loco.train.workers import open_worker_group

__all__ = ["TrainResult", "TrainingDiverged", "TrainingFailed", "TrainingInterrupted", "train"]


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


def train(config: TrainConfig, progress: bool = True) -> TrainResult:
    """Run (or resume) the training ``config`` describes; see docs/training.md."""
    started = time.perf_counter()
    show = progress and not config.run.quiet
    with (
        open_worker_group(config) as group,
        StopSignals(enabled=not group.distributed) as stop,
        FolderLock(Path(config.run.out), "training into it", "run the same command again") as lock,
    ):
        run = start_run(config, group, lock, started)
        if group.is_main:
            note_resume(run, show)
            note_other_world_size(run)
        last_round = run.rounds
        if stopping_at_once(run):
            last_round = run.start_round  # nothing to train: finish() returns unfinished
        steps_per_round = config.inner.steps * (len(run.workers) if run.driver else 1)
        display = ProgressDisplay(show and group.is_main, run.rounds, steps_per_round,
                                  run.start_round)  # fmt: skip
        driving = run.driver or contextlib.nullcontext()
        with (
            failing_resumably(run),
            interrupted_at_once(run),
            display,
            driving,
            naming_the_last_checkpoint(run),
        ):
            for round_index in range(run.start_round, last_round):
                run.round_number = round_index + 1
                if stop.requested:  # between rounds: the state is that of a completed round
                    run.save_unless_saved(round_index)
                    raise TrainingInterrupted(f"after round {round_index}")
                display.begin_round(round_index)
                norm_before = parameter_norm(run.global_params)
                round_start = time.perf_counter()
                train_loss = run_round(run, display, stop)
                turns.synchronize(group.device)
                round_seconds = time.perf_counter() - round_start
                check_not_exploded(norm_before, parameter_norm(run.global_params),
                                   run.round_number)  # fmt: skip
                run.completed = run.round_number
                log_round(run, train_loss, round_seconds)
                if config.run.stop_after is not None and run.completed >= config.run.stop_after:
                    break
        with failing_resumably(run), interrupted_at_once(run):
            return finish(run, stop, summary=show and group.is_main)


def round_spans(rounds: list[int]) -> str:
    """``round 3``, ``rounds 1-3, 5``: sorted round numbers, runs of consecutive ones joined."""
    spans: list[list[int]] = []
    for number in rounds:
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
    return f"round {text}" if len(rounds) == 1 else f"rounds {text}"


def note_resume(run: Run, show: bool) -> None:
    """Say (``show``) where a resumed run continues from, or that it had already finished; and,
    even when quiet, on stderr, that ``checkpoints/latest`` named a folder no longer there."""
    saved_round, path = run.last_saved
    if not run.config.checkpoint.resume or path is None:
        return
    named = pointed_name(path.parent)
    if named != path.name and run.group.is_main:
        exists = (path.parent / LATEST).exists()
        pointer = f"names {named}, which does not exist" if named else "is missing"
        pointer = "is empty" if not named and exists else pointer
        print_line(f"note: {path.parent / LATEST} {pointer}; resuming from {path.name}, the "
                   "newest checkpoint left")  # fmt: skip
    missing = run.metrics.missing_rounds
    if missing and run.group.is_main:
        print_line(f"note: {run.out / METRICS} lacks {round_spans(missing)} of the {saved_round} "
                   "before the checkpoint (cut or deleted): their losses stay out of the log "
                   "and its curves")  # fmt: skip
    if not show:
        return
    if saved_round >= run.rounds:
        print(f"the run already finished its {run.rounds} rounds ({path}): nothing left to "
              "train; its final model is evaluated and saved again")  # fmt: skip
    else:
        print(f"resuming after round {saved_round} of {run.rounds} ({path})")


def stopping_at_once(run: Run) -> bool:
    """Whether ``--stop-after N`` stops a resumed run before its first round: its checkpoint is
    already at round N or past it (a preemptible job passing the same N again must not run to
    the end). Says so on stderr (main process)."""
    stop_after = run.config.run.stop_after
    if stop_after is None or run.start_round < stop_after or run.start_round >= run.rounds:
        return False
    if run.group.is_main:
        print_line(f"note: --stop-after {stop_after}: the checkpoint is already at round "
                   f"{run.start_round} of {run.rounds}; nothing trained (resume without "
                   "--stop-after, or with a later round, to continue)")  # fmt: skip
    return True


def note_other_world_size(run: Run) -> None:
    """Say on stderr when the run resumed from a checkpoint that another number of processes
    wrote: it continues correctly, but only to float rounding of an uninterrupted run."""
    saved, now = run.resumed_world_size, run.group.world_size
    if saved is not None and saved != now:
        print_line(
            f"note: the checkpoint was written by {saved} process(es) and this run has {now}: "
            "it continues correctly, but its sums run in another order, so it matches an "
            "uninterrupted run only to float rounding (resume with the same number of "
            "processes for the same bits)"
        )


def run_round(run: Run, display: ProgressDisplay, stop: StopSignals) -> float:
    """One round's inner steps (the driver takes the outer step); the mean train loss."""
    config, group, round_index = run.config, run.group, run.round_number - 1
    if run.driver is None:
        loss = turns.dp_round(run.model, run.dp_optimizer, run.workers, config, round_index,
                              group, display, stop)  # fmt: skip
    else:
        loss_sum = sum(turns.worker_turn(run.model, w, config, round_index, display, stop)
                       for w in run.workers)  # fmt: skip
        loss = group.sum([loss_sum])[0] / config.run.workers
    check_finite_loss(loss, run.round_number)
    return loss


def log_round(run: Run, train_loss: float, round_seconds: float) -> None:
    """The round's metrics line, then an eval and a checkpoint when they are due."""
    config, completed = run.config, run.completed
    outer_seconds = run.driver.last_outer_seconds if run.driver else 0.0
    run.seconds["round"] += round_seconds
    run.seconds["outer"] += outer_seconds
    run.train_loss = train_loss
    run.metrics.write(
        event="round",
        round=completed,
        tokens=completed * config.tokens_per_round(),
        train_loss=train_loss,
        inner_lr=(run.workers[0].inner or run.dp_optimizer).lr,
        round_seconds=round_seconds,
        outer_step_seconds=outer_seconds,
        tokens_per_second=config.tokens_per_round() / round_seconds,
        **communication_metrics(run),
    )
    if config.run.eval_every and completed % config.run.eval_every == 0 and completed < run.rounds:
        val_loss = turns.evaluate(run.model, run.data, config) if run.group.is_main else None
        check_finite_val_loss(run.group.broadcast(val_loss), completed)
        run.metrics.write(event="eval", round=completed, val_loss=val_loss)
    every = config.checkpoint.every
    if (
        completed == run.rounds
        or config.run.stop_after == completed
        or (every and completed % every == 0)
    ):
        run.save(completed)


def stop_if_requested(run: Run, stop: StopSignals, when: str) -> None:
    """After the last round, a stop asked for (SIGINT / SIGTERM) still stops the run, exit 130,
    as during it: the last round is checkpointed, and ``--resume`` evaluates and saves the final
    model."""
    if stop.requested:
        run.save_unless_saved(run.rounds)
        raise TrainingInterrupted(resume_message(when, run.last_saved, run.out))


def finish(run: Run, stop: StopSignals, summary: bool) -> TrainResult:
    """Final evaluation and model (after the last round), the final metrics line, the result.
    Its ``seconds`` are the run's wall time over all its invocations."""
    config, group = run.config, run.group
    tokens = run.completed * config.tokens_per_round()
    checksum = parameter_checksum(run.global_params)
    if run.completed < run.rounds:  # stop_after: no final model, resume continues
        return TrainResult(run.out, None, run.completed, checksum, tokens, run.wall_seconds,
                           finished=False)  # fmt: skip
    stop_if_requested(run, stop, f"after round {run.rounds}, before the final evaluation")
    val_loss = turns.evaluate(run.model, run.data, config) if group.is_main else None
    val_loss = group.broadcast(val_loss)
    stop_if_requested(run, stop, f"after round {run.rounds}, before the final model was written")
    try:
        check_finite_val_loss(val_loss, run.rounds)
    except TrainingDiverged as error:
        saved_round, path = run.last_saved
        where = last_good_message(run.last_saved)
        if saved_round == run.rounds:  # saved after the last round: these very parameters
            where = f"The checkpoint {path} holds the parameters that give it; no final model."
        raise TrainingDiverged(f"{error}; stopping. {where}") from None
    if group.is_main:
        save_final(run.out / FINAL, run.model, run.tokenizer)
    seconds = run.wall_seconds
    run.metrics.write(event="final", round=run.rounds, tokens=tokens, val_loss=val_loss,
                      train_loss=run.train_loss, checksum=checksum, seconds=seconds)  # fmt: skip
    group.barrier()
    result = TrainResult(run.out, val_loss, run.rounds, checksum, tokens, seconds, finished=True)
    if summary:
        rounds_s, outer_s = run.seconds["round"], run.seconds["outer"]
        rows = {
            "aggregator": "data-parallel AdamW"
            if config.run.mode == "dp"
            else config.outer.aggregator,
            "workers x inner steps": f"{config.run.workers} x {config.inner.steps}",
            "rounds": str(result.rounds),
            "tokens": f"{result.tokens:,}",
            "final val loss": f"{result.val_loss:.4f}",
            "time": f"{result.seconds:.1f} s",
            **({"outer step share": f"{100 * outer_s / rounds_s:.1f} %"} if rounds_s > 0 else {}),
            "params sha256": result.checksum[:16],
            "output": str(result.out),
            "final model": f"{result.out / FINAL} (AutoModelForCausalLM.from_pretrained)",
        }
        print_summary(rows, title=f"{run_label(config)} on {config.model.name}")
    return result


def run_label(config: TrainConfig) -> str:
    """The preset's name, or ``AGGREGATOR (preset P)`` where the aggregator is not the
    preset's own (``--preset diloco --aggregator ta``)."""
    preset = config.run.preset
    if config.run.mode == "dp" or config.outer.aggregator == preset_config(preset).outer.aggregator:
        return preset
    return f"{config.outer.aggregator} (preset {preset})"


def communication_metrics(run: Run) -> dict:
    """This rank's bytes and seconds of the round's communication (docs/distributed.md).

    Under torchrun: what the outer step's collectives sent. Simulated: what each worker would
    send as its own rank (P = R). dp: the H gradient all-reduces, ``2 (R-1)/R N`` bytes each.
    """
    config = run.config
    if run.driver is None:
        model_bytes = sum(t.numel() * t.element_size() for t in run.global_params.values())
        ring = 2 * (config.run.workers - 1) / config.run.workers * model_bytes
        return {"comm_bytes_sent": int(config.inner.steps * ring), "comm_plan": "all-reduce"}
    stats = run.driver.last_comm_stats
    if stats is None or stats.plan == "local":
        layout = [(name, t.shape, t.dtype) for name, t in run.global_params.items()]
        stats = modelled_comm_stats(
            run.driver.method, layout, config.run.workers, config.outer.compression
        )
    return {
        "comm_bytes_sent": stats.bytes_sent,
        "comm_bytes_naive": stats.bytes_naive,
        "comm_seconds": stats.comm_seconds,
        "spectral_seconds": stats.spectral_seconds,
        "comm_plan": stats.plan,
    }
