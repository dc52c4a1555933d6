"""SIGINT / SIGTERM in a single-process run: stop at the next inner step, resumably."""

from __future__ import annotations

import signal
import threading


class TrainingInterrupted(RuntimeError):
    """SIGINT / SIGTERM stopped the run; the message says which checkpoint resumes it."""


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
