"""What stops a run on purpose, and the one-line messages that name the last good checkpoint.

Divergence (a non-finite train loss or pseudo-gradient, exploding global parameters), a data
shard too short for the rounds left, a lost torchrun peer, a signal, and any other failure
while training (out of memory, a full disk, a bug) (docs/reliability.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch

from mergekit_loco.dist import CollectiveFailed
from mergekit_loco.run_layout import previous_run, start_over_advice
from mergekit_loco.train.config import TrainConfig
from mergekit_loco.train.data import DataExhausted
from mergekit_loco.train.signals import TrainingInterrupted
from mergekit_loco.train.workers import Worker

#: A round whose global parameters end more than this many times larger (L2 norm) than they
#: started has diverged: healthy rounds change the norm by under 20 % (every preset, measured).
EXPLOSION_GROWTH = 1000.0


class TrainingDiverged(FloatingPointError):
    """A non-finite train loss or pseudo-gradient, or exploding global parameters; the message
    names the round and the last good checkpoint."""


class TrainingFailed(RuntimeError):
    """Any other failure while training (out of memory, a full disk, a bug): ``failure`` says
    what failed where (``round K: <type>: <message>``), ``last_saved`` is the newest
    ``(round, checkpoint)`` (checkpoint None: none yet), ``advice`` how to go on; the message is
    ``FAILURE; stopping. <the last checkpoint> ADVICE``. ``__cause__`` is the failure itself."""

    def __init__(self, failure: str, last_saved: tuple[int, Path | None], advice: str) -> None:
        super().__init__(failure, last_saved, advice)  # args: how it pickles across processes
        self.failure, self.last_saved, self.advice = failure, last_saved, advice

    def __str__(self) -> str:
        return f"{self.failure}; stopping. {last_good_message(self.last_saved)} {self.advice}"


class RunPosition(Protocol):
    round_number: int  # the round running now (1-based)
    completed: int  # rounds completed (== round_number once the round ran)
    last_saved: tuple[int, Path | None]  # (round, checkpoint) of the newest checkpoint
    distributed: bool
    out: Path  # the run folder


@contextmanager
def interrupted_at_once(run: RunPosition) -> Iterator[None]:
    """A second Ctrl-C (the first stops at the next inner step), or SIGINT to a torchrun
    process, stops at once: say which checkpoint ``--resume`` continues from."""
    try:
        yield
    except KeyboardInterrupt:
        raise TrainingInterrupted(resume_message("at once", run.last_saved, run.out)) from None


@contextmanager
def naming_the_last_checkpoint(run: RunPosition) -> Iterator[None]:
    """Re-raise a run's failure with the round it happened in and the checkpoint to resume
    from: divergence as TrainingDiverged, a failed collective as CollectiveFailed."""
    try:
        yield
    except TrainingInterrupted as interrupt:
        message = resume_message(str(interrupt), run.last_saved, run.out)
        raise TrainingInterrupted(message) from None
    except TrainingDiverged as error:
        raise TrainingDiverged(f"{error}; stopping. {last_good_message(run.last_saved)}") from None
    except FloatingPointError as error:  # the outer step's non-finite pseudo-gradient
        raise TrainingDiverged(
            f"round {run.round_number}: {error}; stopping. {last_good_message(run.last_saved)}"
        ) from None
    except torch.linalg.LinAlgError as error:  # an aggregator's SVD that did not converge
        raise TrainingDiverged(
            f"round {run.round_number}: LinAlgError: {error}; stopping. "
            f"{last_good_message(run.last_saved)}"
        ) from error
    except RuntimeError as error:  # a collective failed, or a peer died or hung
        if isinstance(error, CollectiveFailed) or (
            run.distributed and isinstance(error.__cause__, RuntimeError)
        ):
            raise CollectiveFailed(
                f"round {run.round_number}: {error}. {last_good_message(run.last_saved)} "
                f"{restart_advice(run)}"
            ) from error
        raise


@contextmanager
def failing_resumably(run: RunPosition) -> Iterator[None]:
    """Re-raise any failure not stopped on purpose (out of memory, a full disk, a bug) as
    :class:`TrainingFailed`: ``round K: <type>: <message>; stopping.``, the last checkpoint and
    how to resume from it; the failure is its ``__cause__``."""
    try:
        yield
    except (TrainingInterrupted, TrainingDiverged, CollectiveFailed, DataExhausted):
        raise  # stopped on purpose, with its own advice
    except Exception as error:
        where = (
            f"round {run.round_number}"
            if run.completed < run.round_number
            else f"after round {run.completed}"
        )
        message = " ".join(str(error).split())
        raise TrainingFailed(
            f"{where}: {type(error).__name__}{': ' + message if message else ''}",
            run.last_saved,
            restart_advice(run),
        ) from error


def check_finite_loss(train_loss: float, round_number: int) -> None:
    if not math.isfinite(train_loss):
        raise TrainingDiverged(f"round {round_number}: train loss is {train_loss}")


def check_finite_val_loss(val_loss: float, round_number: int) -> None:
    """A validation loss that is not a number stops the run (its metrics line could not be
    read back, so the run would look unfinished rather than failed)."""
    if not math.isfinite(val_loss):
        raise TrainingDiverged(f"round {round_number}: validation loss is {val_loss}")


def parameter_norm(params: Mapping[str, torch.Tensor]) -> float:
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
    needed = rounds_left * config.inner.steps * config.worker_batch * config.data.seq_len
    for worker in workers:
        if worker.stream.tokens_left < needed:
            raise DataExhausted(
                f"worker {worker.index}'s data shard has {worker.stream.tokens_left:,} tokens left"
                f", the {rounds_left} remaining rounds need {needed:,} (use more data, or resume "
                "with the config the checkpoint was written with)"
            )


def resume_message(what: str, last_saved: tuple[int, Path | None], out: Path) -> str:
    round_index, path = last_saved
    if path is None:
        return (
            f"interrupted {what}; no checkpoint was written yet, so --resume is not possible: "
            f"{start_over_advice(out)}"
        )
    return f"interrupted {what}; --resume continues from {path} (after round {round_index})"


def restart_advice(run: RunPosition) -> str:
    """How to go on after a failure: ``--resume`` from the last checkpoint, or start over."""
    saved = run.last_saved[1] is not None
    if run.distributed:
        if saved:
            return "Restart every process with --resume to continue from it."
        force = "; with --force" if previous_run(run.out) else ""
        return f"Restart every process without --resume (there is nothing to resume{force})."
    if saved:
        return "Run the same command with --resume to continue from it."
    return f"There is nothing to resume: {start_over_advice(run.out)}."


def last_good_message(last_saved: tuple[int, Path | None]) -> str:
    round_index, path = last_saved
    if path is None:
        return "No checkpoint was written before it."
    return f"The last good checkpoint is {path} (after round {round_index})."
