"""What a person watching a run sees: a progress bar over inner steps and a final summary."""

from __future__ import annotations

import time

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from mergekit_loco.console import output_console


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

    def __enter__(self) -> ProgressDisplay:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def print_summary(rows: dict[str, str], title: str) -> None:
    """A two-column table of ``rows`` on the console."""
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows.items():
        table.add_row(key, value)
    output_console().print(table)
