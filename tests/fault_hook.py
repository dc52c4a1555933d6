"""Test-only fault injection (docs/reliability.md), installed by patching, never by a hook in
the trainer: ``MLOCO_FAULT_AT=RANK:ROUND:TURN:SIGNAL`` makes the process of rank RANK send
itself SIGSIGNAL (KILL: dies, STOP: hangs, TERM, INT) before its TURN-th worker turn of round
ROUND, or before the outer step for TURN = its workers + 1 (all counted from 1, fresh runs);
SIGNAL ``OOM`` raises ``torch.OutOfMemoryError`` there instead, ``INT2`` sends SIGINT twice (a
second Ctrl-C before the first has stopped the run).

``python tests/fault_launcher.py train ...`` (also under torchrun) is ``mloco train ...`` with
the fault of ``MLOCO_FAULT_AT`` installed. :class:`FailsAfterStepping` is an outer optimizer
that fails half-way, for the DiLoCo driver's tests.
"""

from __future__ import annotations

import os
import signal

import torch

from mergekit_loco.train import rounds
from mergekit_loco.train.diloco import DiLoCo

FAULT_ENV = "MLOCO_FAULT_AT"


def install(fault: str, monkeypatch=None) -> None:
    """Patch the trainer so that ``fault`` happens (``monkeypatch``: undone after the test)."""
    rank, round_number, turn, name = fault.split(":")
    if int(os.environ.get("RANK", "0")) != int(rank):
        return
    where = (int(round_number), int(turn))

    def send() -> None:
        if name == "OOM":
            raise torch.OutOfMemoryError(f"out of memory (injected at rank {rank})")
        for _ in range(2 if name == "INT2" else 1):
            os.kill(os.getpid(), signal.Signals[f"SIG{name.removesuffix('2')}"])

    real_turn, real_outer_step, seen = rounds.worker_turn, DiLoCo.outer_step, {"round": 0}

    def worker_turn(model, worker, *args, **kwargs):
        first = seen.setdefault("first", worker.index)
        seen["round"] += worker.index == first
        if (seen["round"], worker.index - first + 1) == where:
            send()
        return real_turn(model, worker, *args, **kwargs)

    def outer_step(driver, local_deltas):
        if (driver.outer_steps + 1, len(local_deltas) + 1) == where:
            send()
        return real_outer_step(driver, local_deltas)

    patch = monkeypatch.setattr if monkeypatch is not None else setattr
    patch(rounds, "worker_turn", worker_turn)
    patch(DiLoCo, "outer_step", outer_step)


class FailsAfterStepping(torch.optim.SGD):
    """SGD whose step, once armed, raises after updating everything (a device lost mid-step)."""

    armed = False

    def step(self, closure=None):
        super().step(closure)
        if self.armed:
            self.armed = False
            raise RuntimeError("the device went away mid-step")
