"""The DiLoCo driver under torch.distributed (2 gloo ranks, spawned): ranks that were built
differently or start from different weights are refused at the first ``with driver:``, and an
outer step that fails on one rank is undone on every rank, so all keep the round."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fault_hook import FailsAfterStepping
from torch.distributed.optim import ZeroRedundancyOptimizer

import mergekit_loco as ml
from mergekit_loco.train import diloco


def clip(value: float) -> float:
    """A function an outer optimizer's param group may hold (a custom optimizer's hook)."""
    return value


def build(rank: int, change: str | None = None, seed: int = 0, zero: bool = False):
    """A small MLP, its inner SGD(s) and a Nesterov outer SGD; ``change`` makes rank 1 differ."""
    odd = rank == 1
    torch.manual_seed(seed + (rank if odd and change == "init" else 0))
    hidden = 6 if odd and change == "hidden" else 5
    model = torch.nn.Sequential(
        torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2)
    )
    if odd and change == "dtype":
        model = model.double()
    workers = 2 if odd and change == "workers" else 1
    inners = [torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(workers)]
    lr = 0.5 if odd and change == "outer lr" else 0.7
    if zero:  # each rank steps its shard of the parameters and broadcasts it
        outer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=lr,
                                        momentum=0.9, nesterov=True)  # fmt: skip
    else:
        outer = FailsAfterStepping(model.parameters(), lr=lr, momentum=0.9, nesterov=True)
    if change == "alike":  # the same settings, written with an address and a device
        outer.param_groups[0]["hook"] = clip
        outer.param_groups[0]["lr"] = torch.tensor(lr)
    driver = ml.DiLoCo(
        model,
        inners,
        outer,
        aggregator="iso-c" if odd and change == "aggregator" else "mean",
        sync_every=3 if odd and change == "sync_every" else 2,
    )
    return model, inners, outer, driver


def inner_step(model, inner, rank: int, step: int) -> None:
    generator = torch.Generator().manual_seed(100 * rank + step)
    dtype = next(model.parameters()).dtype
    x = torch.randn(4, 3, generator=generator, dtype=dtype)
    model(x).square().mean().backward()
    inner.step()
    inner.zero_grad()


MISMATCHES = [
    ("sync_every", "the sync_every values differ between rank 0 and rank 1: 2 vs 3"),
    (
        "aggregator",
        r"the aggregators differ between rank 0 and rank 1: Mean\(weights=None\) vs IsoC\(",
    ),
    ("outer lr", "the outer optimizers' settings differ between rank 0 and rank 1: lr 0.7 vs 0.5"),
    ("workers", r"the workers \(inner optimizers\) differ between rank 0 and rank 1: 1 vs 2"),
    (
        "hidden",
        r"parameters differ .*: \('0.weight', \[5, 3\], 'torch.float32'\) vs \('0.weight', \[6",
    ),
    ("dtype", r"parameters differ .*: \('0.weight', \[5, 3\], 'torch.float32'\) vs .*float64'\)"),
    ("init", "the global parameter '0.weight' differs between rank 0 and rank 1"),
]


def refuse_ranks_built_differently(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # fmt: skip
    for change, message in MISMATCHES:
        _, _, _, driver = build(rank, change)
        with pytest.raises(ValueError, match=message), driver:
            pass
        assert not driver._hooks  # refused before any hook was registered
    _, _, _, driver = build(rank, "alike")  # before: refused, "hook <function clip at 0x..."
    with driver:
        assert driver._hooks
    # a state of another round loaded on one rank, inside the block: refused at the next
    # inner step; outside it: at the next `with driver:`
    model, inners, _, driver = build(rank)
    with driver:
        for step in range(3):
            inner_step(model, inners[0], rank, step)
        state = driver.state_dict()
        if rank == 1:
            state["outer_steps"] = 0
        driver.load_state_dict(state)
        message = "the outer steps taken differ between rank 0 and rank 1: 1 vs 0"
        with pytest.raises(ValueError, match=message):
            inner_step(model, inners[0], rank, 3)
    with pytest.raises(ValueError, match=message), driver:
        pass
    dist.destroy_process_group()
    os._exit(0)


def test_ranks_built_differently_are_refused_naming_the_difference(tmp_path):
    """Before: a different outer lr, aggregator (mean vs ta), worker count or init trained on
    without an error and the ranks drifted apart; a different sync_every or aggregator (mean vs
    iso-c) paired other collectives and timed out naming a dead peer; another dtype or shape
    aborted gloo (SIGABRT)."""
    mp.spawn(refuse_ranks_built_differently, args=(str(tmp_path / "store"),), nprocs=2)


def fail_one_ranks_outer_step(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # fmt: skip

    real_copy = diloco.copy_optimizer_state

    def copy_out_of_memory(*args):
        diloco.copy_optimizer_state = real_copy
        raise torch.OutOfMemoryError("out of memory (copying the outer state)")

    def run(failure: str | None, zero: bool = False) -> list[torch.Tensor]:
        model, inners, outer, driver = build(rank, zero=zero)
        with driver:
            for step in range(6):  # three rounds; rank 1's second outer step fails once
                if failure and step == 3:
                    if rank == 1 and failure == "mid-step":
                        outer.armed = True
                    elif rank == 1:  # before the step: the others must not wait for it
                        diloco.copy_optimizer_state = copy_out_of_memory
                    own = "device went away" if failure == "mid-step" else "out of memory"
                    expected = own if rank == 1 else "failed on rank 1; undone"
                    with pytest.raises(RuntimeError, match=expected):
                        inner_step(model, inners[0], rank, step)
                    assert driver.outer_steps == 1
                    assert driver.sync() is not None  # every rank retries
                else:
                    inner_step(model, inners[0], rank, step)
        assert driver.outer_steps == 3
        return [p.detach().clone() for p in model.parameters()]

    plain = run(None)
    # a ZeroRedundancyOptimizer outer step (before: its state_dict(), a collective, was
    # copied before every step and refused) ends where plain SGD does
    for failure, zero in (("mid-step", False), ("copying the state", False), (None, True)):
        for got, expected in zip(run(failure, zero), plain, strict=True):
            assert torch.equal(got, expected), (failure, zero)
    # OuterOptimizer alike: rank 1's step overflows float16, rank 0's does not
    start = 6e4 if rank == 1 else 1.0
    params = {"w": torch.full((2,), start, dtype=torch.float16)}
    outer = ml.OuterOptimizer(params, lr=1.0, momentum=0.5)
    delta = ml.TaskVector({"w": torch.full((2,), 1e4, dtype=torch.float16)})
    expected = "left parameter 'w' not finite" if rank == 1 else "failed on rank 1; undone"
    with pytest.raises((FloatingPointError, RuntimeError), match=expected):
        outer.step([delta])
    assert torch.equal(params["w"], torch.full((2,), start, dtype=torch.float16))
    assert outer.steps_taken == 0 and not outer.momentum_buffers
    dist.destroy_process_group()
    os._exit(0)


def test_an_outer_step_that_fails_on_one_rank_is_undone_on_every_rank(tmp_path):
    """Before: the other rank went on to the next round, so the failed rank's retry paired its
    stale deltas with that round's collectives and the ranks drifted apart."""
    mp.spawn(fail_one_ranks_outer_step, args=(str(tmp_path / "store"),), nprocs=2)
