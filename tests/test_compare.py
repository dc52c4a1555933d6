"""Sweeps (planning, FLOP matching, resume) and the merge comparison, end to end at toy size."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import pickle
import re
import shlex
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from hostile import assert_refused, run_cli, snapshot

from mergekit_loco.cli import main
from mergekit_loco.compare import merges, render, results_lock, runs
from mergekit_loco.compare import sweep as sweeping
from mergekit_loco.compare.sweep import Cell, Grid, Sweep, cell_config, plan, trained_tokens
from mergekit_loco.io.atomic import LOCK_FILE
from mergekit_loco.io.lock import FolderInUse
from mergekit_loco.train.config import preset_config
from mergekit_loco.train.guards import TrainingFailed
from mergekit_loco.train.loop import train

TOY = {"model": "micro", "global_batch": 4, "seq_len": 32, "vocab_size": 300, "val_tokens": 1024}


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MLOCO_CACHE", str(tmp_path_factory.getbasetemp() / "mloco-cache"))


@pytest.fixture(autouse=True)
def one_thread():
    """Toy models gain nothing from threads, and lose much to them on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_domain(folder: Path, make_line, documents: int = 24) -> str:
    """A folder of ``documents`` small text files whose lines come from ``make_line(doc, line)``."""
    folder.mkdir(parents=True, exist_ok=True)
    for doc in range(documents):
        lines = [make_line(doc, line) for line in range(30)]
        (folder / f"doc{doc:02d}.txt").write_text("\n".join(lines) + "\n")
    return str(folder)


@pytest.fixture(scope="module")
def domains(tmp_path_factory) -> list[str]:
    """Three distinct toy domains: code-like, prose-like, numbers."""
    root = tmp_path_factory.mktemp("domains")
    words = "the river ran past old stone walls while quiet birds sang of rain".split()
    return [
        write_domain(root / "code", lambda d, i: f"def f{d}_{i}(x):\n    return x * {i % 7} + {d}"),
        write_domain(
            root / "prose", lambda d, i: " ".join(words[(d + i * k) % len(words)] for k in range(9))
        ),
        write_domain(
            root / "numbers", lambda d, i: " ".join(str((d * i * k) % 97) for k in range(12))
        ),
    ]


# -- planning -----------------------------------------------------------------------------------
def test_plan_is_flop_matched():
    sweep = Sweep(
        aggregators=["diloco", "isoloco", "tsv"],
        workers=[1, 2, 4],
        inner_steps=[2, 4],
        seeds=[0, 1],
        shared={**TOY, "tokens": 4 * 4 * 32 * 4},
    )
    cells = plan(sweep)
    assert len(cells) == 2 + 3 * 3 * 2 * 2  # baseline per seed + aggregator x R x H x seed
    assert len({cell.name for cell in cells}) == len(cells)
    configs = [cell_config(sweep, cell, Path("unused")) for cell in cells]
    assert {trained_tokens(c) for c in configs} == {4 * 4 * 32 * 4}
    assert {c.data.global_batch for c in configs} == {4}
    for cell, config in zip(cells, configs, strict=True):
        assert config.run.preset == cell.aggregator and config.run.seed == cell.seed
        assert config.worker_batch * config.run.workers == config.data.global_batch
    baseline = [c for c in configs if c.run.preset == "dp"]
    assert [c.run.mode for c in baseline] == ["dp", "dp"]
    assert {c.run.workers for c in baseline} == {1}


@pytest.mark.parametrize(
    ("count", "total", "elapsed", "jobs", "expected"),
    [
        (4, 134, 2761.0, 2, "2761 s into the sweep; about 24.9 h left at this pace"),  # 89,732.5 s
        (1, 3, 50.0, 1, "50 s into the sweep; about 100 s left at this pace"),
        (2, 5, 1800.0, 1, "1800 s into the sweep; about 45 min left at this pace"),  # 2,700 s
        (1, 2, 59.8, 1, "60 s into the sweep; about 60 s left at this pace"),
        (1, 2, 119.7, 1, "120 s into the sweep; about 2 min left at this pace"),  # not "120 s"
        (1, 2, 7190.0, 1, "7190 s into the sweep; about 2.0 h left at this pace"),  # not 120 min
        (1, 134, 1700.0, 2, "1700 s into the sweep"),  # the first of 2 jobs: no pace yet
        (5, 5, 900.0, 1, "900 s into the sweep"),
    ],
)  # fmt: skip
def test_sweep_pace_by_hand(count, total, elapsed, jobs, expected):
    assert sweeping.sweep_pace(count, total, elapsed, jobs) == expected


def test_plan_refuses_unmatched_budgets_and_bad_splits():
    # 3 rounds of H=2 fit in 3 * 2 * 4 * 32 tokens but only 1 round of H=4 (the rest unused)
    unmatched = Sweep(["diloco"], [1], inner_steps=[2, 4], shared={**TOY, "tokens": 3 * 2 * 4 * 32})
    with pytest.raises(ValueError, match="different token counts.*H=2: 768.*H=4: 512"):
        plan(unmatched)
    with pytest.raises(ValueError, match="not divisible by 3 workers"):
        plan(Sweep(["diloco"], [3], inner_steps=[2], shared={**TOY, "tokens": 2048}))
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        plan(Sweep(["nope"], [1], inner_steps=[2], shared={**TOY, "tokens": 2048}))


def test_outer_lr_grid_multipliers_and_absolute_values():
    grid = Grid.parse(["0.5,1,2", "isoloco=1.2,1.8"])
    # (multiplier or value as given, the lr a cell trains with); the preset's own lr is None
    assert grid.values("diloco", 0.7) == [0.35, None, 1.4]  # the preset's own lr is None
    assert grid.values("isoloco", 1.8) == [1.2, None]
    assert Grid().values("tsv", 0.6) == [None]
    sweep = Sweep(["diloco", "isoloco"], [2], inner_steps=[2], outer_lr_grid=grid,
                  baseline=False, shared={**TOY, "tokens": 1024})  # fmt: skip
    lrs = {(c.aggregator, c.outer_lr) for c in plan(sweep)}
    assert lrs == {("diloco", 0.35), ("diloco", None), ("diloco", 1.4), ("isoloco", 1.2),
                   ("isoloco", None)}  # fmt: skip
    named = [c for c in plan(sweep) if c.outer_lr == 1.4][0]
    assert named.name == "diloco-R2-H2-lr1.4-s0"
    assert cell_config(sweep, named, Path("x")).outer.lr == 1.4
    for bad in (["0,1"], ["a,b"], ["1", "2"]):
        with pytest.raises(ValueError, match="--outer-lr-grid"):
            Grid.parse(bad)
    with pytest.raises(ValueError, match="names 'diloco' twice"):  # not the last one silently
        Grid.parse(["diloco=1,2", "diloco=3"])
    with pytest.raises(ValueError, match="names 'tsv', not in --aggregators"):
        plan(Sweep(["diloco"], [2], outer_lr_grid=Grid.parse(["tsv=1"]), shared=TOY))


def test_outer_momentum_grid_applies_to_presets_with_momentum():
    grid = Grid.parse(["0.8,0.95"], option="--outer-momentum-grid", relative=False)
    assert grid.values("diloco", 0.9) == [0.8, 0.95]
    assert grid.values("tsv", 0.0) == [None]  # no momentum: not swept unless named
    assert Grid.parse(["tsv=0.5"], relative=False).values("tsv", 0.0) == [0.5]
    lr_grid = Grid.parse(["diloco=0.7,1.4"])
    sweep = Sweep(["diloco", "tsv"], [2], inner_steps=[2], seeds=[3, 5],
                  outer_lr_grid=lr_grid, outer_momentum_grid=grid, baseline=False,
                  shared={**TOY, "tokens": 1024})  # fmt: skip
    cells = plan(sweep)
    diloco = {(c.outer_lr, c.outer_momentum) for c in cells if c.aggregator == "diloco"}
    assert diloco == {(None, 0.8), (None, 0.95), (1.4, 0.8), (1.4, 0.95)}
    assert {c.seed for c in cells} == {3, 5} and len(cells) == (4 + 1) * 2
    named = next(c for c in cells if (c.outer_lr, c.outer_momentum, c.seed) == (1.4, 0.95, 5))
    assert named.name == "diloco-R2-H2-lr1.4-m0.95-s5"
    config = cell_config(sweep, named, Path("x"))
    assert (config.outer.lr, config.outer.momentum, config.outer.nesterov) == (1.4, 0.95, True)
    for bad in (["1.2"], ["0,0.5"]):
        with pytest.raises(ValueError, match="--outer-momentum-grid"):
            Grid.parse(bad, option="--outer-momentum-grid", relative=False)
    with pytest.raises(ValueError, match="--seeds: 1 is given twice"):
        plan(Sweep(["diloco"], [2], inner_steps=[2], seeds=[1, 1], shared={**TOY, "tokens": 1024}))


def test_val_seed_fixes_the_validation_documents_across_seeds(domains):
    from mergekit_loco.train.data import prepare_data

    def split(seed, val_seed=None):
        return prepare_data(domains[0], vocab_size=300, max_train_tokens=2000, val_tokens=1500,
                            seed=seed, val_seed=val_seed)  # fmt: skip

    shared = [split(seed, val_seed=9) for seed in (0, 1, 2)]
    assert all(torch.equal(data.val, shared[0].val) for data in shared)
    assert shared[0].val_documents == split(9).val_documents  # the held-out set of seed 9
    # the seed still orders the training documents
    assert not torch.equal(shared[0].train, shared[1].train)
    # each seed's own split is unchanged: val_seed = seed is the default
    for seed in (0, 1):
        own, same = split(seed), split(seed, val_seed=seed)
        assert torch.equal(own.val, same.val) and torch.equal(own.train, same.train)
    assert split(0).val_documents != split(1).val_documents


# -- running and resuming -----------------------------------------------------------------------
def test_stopped_sweep_resumes_and_never_reruns_finished_cells(tmp_path, domains, monkeypatch):
    calls = []

    def counting_train(config, progress=True):
        calls.append((Path(config.run.out).name, config.checkpoint.resume))
        return train(config, progress=False)

    monkeypatch.setattr(sweeping, "train", counting_train)
    shared = {**TOY, "tokens": 4 * 2 * 4 * 32, "data": domains[1]}  # 4 rounds of H = 2
    first = Sweep(["diloco"], [2], inner_steps=[2], shared=shared)
    sweeping.run_sweep(first, tmp_path, figures=False)
    assert calls == [("dp-s0", False), ("diloco-R2-H2-s0", False)]

    # a wider sweep, stopped after one round of its new cell
    calls.clear()
    wider = Sweep(["diloco", "isoloco"], [2], inner_steps=[2], shared=shared)
    stopped = Sweep(wider.aggregators, [2], inner_steps=[2], shared={**shared, "stop_after": 1})
    sweeping.run_sweep(stopped, tmp_path, figures=False)
    assert calls == [("isoloco-R2-H2-s0", False)]
    assert not runs.is_finished(tmp_path / "runs" / "isoloco-R2-H2-s0")

    # a stopped cell is not resumed by a sweep that defines it otherwise (before, a setting the
    # sweep left out was filled in from the cell's own config.json, so no change was seen)
    fixed = Sweep(["isoloco"], [2], inner_steps=[2], baseline=False,
                  shared={**shared, "val_seed": 7, "stop_after": 1})  # fmt: skip
    sweeping.run_sweep(fixed, tmp_path / "fixed", figures=False)
    calls.clear()
    unfixed = Sweep(["isoloco"], [2], inner_steps=[2], baseline=False, shared=shared)
    with pytest.raises(ValueError, match=r"isoloco-R2-H2-s0 holds another run \(val_seed: 7 -> "):
        sweeping.run_sweep(unfixed, tmp_path / "fixed", figures=False)
    assert calls == []

    summary = sweeping.run_sweep(wider, tmp_path, figures=False)
    assert calls == [("isoloco-R2-H2-s0", True)]
    resumed = runs.load_run(tmp_path / "runs" / "isoloco-R2-H2-s0")
    assert resumed.status == "finished"
    assert [t for t, _ in resumed.val_curve] == [1 * 256, 2 * 256, 3 * 256, 4 * 256]
    assert not (tmp_path / "runs" / "isoloco-R2-H2-s0" / "checkpoints").exists()

    # the resumed cell ends where an uninterrupted run ends
    straight = cell_config(wider, Cell("isoloco", 2, 2, 0), tmp_path / "straight")
    assert math.isclose(train(straight, progress=False).val_loss, resumed.val_loss, rel_tol=1e-6)
    assert {row.aggregator for row in summary} == {"dp", "diloco", "isoloco"}

    # a finished cell is never reused for another config
    other = Sweep(["diloco"], [2], inner_steps=[2], shared={**shared, "seq_len": 16})
    with pytest.raises(ValueError, match="holds another run.*seq_len"):
        sweeping.run_sweep(other, tmp_path, figures=False)


def test_a_cells_damaged_only_checkpoint_says_to_delete_the_cell(tmp_path, domains):
    """compare has no --resume nor a --force for cells: the advice names the cell's folder
    (before: "start over with --force instead of --resume", which compare cannot do)."""
    shared = {**TOY, "tokens": 4 * 2 * 4 * 32, "data": domains[1]}  # 4 rounds of H = 2
    sweep = Sweep(["diloco"], [2], inner_steps=[2], baseline=False, shared=shared)
    stopped = Sweep(["diloco"], [2], inner_steps=[2], baseline=False,
                    shared={**shared, "stop_after": 1, "checkpoint_every": 1})  # fmt: skip
    sweeping.run_sweep(stopped, tmp_path, figures=False)
    cell = tmp_path / "runs" / "diloco-R2-H2-s0"
    (cell / "checkpoints" / "round-000001" / "shared.pt").write_bytes(b"torn")
    with pytest.raises(ValueError) as raised:
        sweeping.run_sweep(sweep, tmp_path, figures=False)
    message = str(raised.value)
    assert "shared.pt" in message and f"delete {cell} and run the same compare" in message
    assert "--force" not in message and "--resume" not in message


def test_a_grid_extended_by_the_printed_values_reuses_its_cells(tmp_path, domains, monkeypatch):
    """0.71 x 0.7 is 0.49699999999999994; the cell is named lr0.497, and naming 0.497 to extend
    the grid must neither refuse nor rerun it, nor count it as another setting."""
    calls = []

    def counting_train(config, progress=True):
        calls.append(Path(config.run.out).name)
        return train(config, progress=False)

    monkeypatch.setattr(sweeping, "train", counting_train)
    shared = {**TOY, "tokens": 2 * 2 * 4 * 32, "data": domains[1]}  # 2 rounds of H = 2
    first = Sweep(["diloco"], [2], inner_steps=[2], outer_lr_grid=Grid.parse(["0.71"]),
                  baseline=False, shared=shared)  # fmt: skip
    sweeping.run_sweep(first, tmp_path, figures=False)
    saved = json.loads((tmp_path / "runs" / "diloco-R2-H2-lr0.497-s0" / "config.json").read_text())
    assert saved["outer_lr"] == 0.71 * 0.7 != 0.497

    calls.clear()
    extended = Sweep(["diloco"], [2], inner_steps=[2],
                     outer_lr_grid=Grid.parse(["diloco=0.35,0.497"]),
                     outer_momentum_grid=Grid.parse(["0.8,0.9"], relative=False), baseline=False,
                     shared=shared)  # fmt: skip
    summary = sweeping.run_sweep(extended, tmp_path, figures=False)
    assert sorted(calls) == ["diloco-R2-H2-lr0.35-m0.8-s0", "diloco-R2-H2-lr0.35-s0",
                             "diloco-R2-H2-lr0.497-m0.8-s0"]  # fmt: skip
    (row,) = summary
    assert sorted(setting for setting, _ in row.sweep) == [
        (0.35, 0.8), (0.35, 0.9), (0.497, 0.8), (0.497, 0.9)
    ]  # fmt: skip


def test_failed_cells_are_recorded_not_raised(tmp_path, monkeypatch):
    errors = {"diloco": FloatingPointError("round 1: train loss is nan"),
              "iso-cts": torch.linalg.LinAlgError("linalg.svd: failed to converge")}  # fmt: skip

    def failing_train(config, progress=True):
        Path(config.run.out).mkdir(parents=True)
        (Path(config.run.out) / "config.json").write_text(json.dumps(config.to_dict()))
        raise errors[config.run.preset]

    monkeypatch.setattr(sweeping, "train", failing_train)
    sweep = Sweep(["diloco", "iso-cts"], [2], inner_steps=[2], baseline=False,
                  shared={**TOY, "tokens": 512})  # fmt: skip
    sweeping.run_sweep(sweep, tmp_path, figures=False)
    for name, error in (("diloco", "FloatingPointError"), ("iso-cts", "LinAlgError")):
        run = runs.load_run(tmp_path / "runs" / f"{name}-R2-H2-s0")
        assert run.status == "failed" and run.val_loss == math.inf
        saved = json.loads((tmp_path / "runs" / f"{name}-R2-H2-s0" / "failed.json").read_text())
        assert error in saved["error"]
    calls = []
    monkeypatch.setattr(sweeping, "train", lambda config, progress=True: calls.append(config))
    sweeping.run_sweep(sweep, tmp_path, figures=False)
    assert calls == []  # a failed cell counts as finished

    # other errors are the sweep's: they stop it
    monkeypatch.setattr(sweeping, "train", lambda config, progress=True: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        sweeping.run_sweep(Sweep(["tsv"], [2], inner_steps=[2], baseline=False,
                                shared={**TOY, "tokens": 512}), tmp_path)  # fmt: skip


# -- merge mode -----------------------------------------------------------------------------------
def test_merge_comparison_end_to_end(tmp_path, domains):
    """Pre-train a base on all domains, fine-tune it on each, merge with every method, report."""
    toy = {**TOY, "workers": 1, "inner_steps": 4, "tokens": 10 * 4 * 4 * 32}
    base_config = preset_config("dp", data=",".join(domains), out=str(tmp_path / "base"), **toy)
    base = train(base_config, progress=False)
    finetuned = []
    for index, domain in enumerate(domains):
        config = preset_config("dp", data=domain, init=str(base.out / "final"),
                               out=str(tmp_path / f"ft{index}"), **toy)  # fmt: skip
        finetuned.append(train(config, progress=False).out / "final")

    methods = ["mean", "ta", "ties", "dare", "tsv", "iso-c", "iso-cts"]
    summary = merges.compare_merges(
        base.out / "final", finetuned, domains, methods, [0.5, 1.0], tmp_path / "cmp",
        eval_tokens=1024, seq_len=32,
    )  # fmt: skip
    for method in methods:
        for scale in (0.5, 1):
            assert (tmp_path / "cmp" / "merged" / f"{method}-{scale:g}" / "config.json").is_file()
    document = json.loads((tmp_path / "cmp" / "evaluations.json").read_text())
    losses = {model["label"]: model["losses"] for model in document["models"]}
    for domain in domains:  # each fine-tune learned its own domain
        assert losses[f"finetune:{domain}"][domain]["test"] < losses["base"][domain]["test"]

    # the normalized score and scale choice, recomputed from the saved losses
    def normalized(label: str, split: str) -> float:
        own = [losses[f"finetune:{d}"][d][split] / losses[label][d][split] for d in domains]
        return sum(own) / len(own)

    rows = {row.label: row for row in summary}
    assert set(rows) == {"base", *(f"finetune:{d}" for d in domains), *methods}
    for method in methods:
        best = max((0.5, 1.0), key=lambda s: normalized(f"{method}-{s:g}", "select"))
        assert rows[method].scales == (best,)
        assert math.isclose(rows[method].normalized.mean, normalized(f"{method}-{best:g}", "test"))
    with open(tmp_path / "cmp" / "merge_results.csv") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == (1 + 3 + 7 * 2) * 2
    own = [r for r in table if r["label"] == f"finetune:{domains[0]}" and r["split"] == "test"]
    assert float(own[0][f"normalized_{domains[0]}"]) == 1.0
    assert (tmp_path / "cmp" / "merging.png").stat().st_size > 0

    # merges are reused, not redone; report re-renders without evaluating
    before = (tmp_path / "cmp" / "merged" / "ties-1").stat().st_mtime_ns
    with results_lock(tmp_path / "cmp") as running_there:  # ... and a comparison running there
        running_there.acquire()  # refuses a second (the PID is ours: flock is per open file)
        with pytest.raises(FolderInUse, match=rf"cmp is in use .* \(PID {os.getpid()}\) comp"):
            merges.compare_merges(base.out / "final", finetuned, domains, ["ties"], [1.0],
                                  tmp_path / "cmp", eval_tokens=1024, seq_len=32)  # fmt: skip
        with pytest.raises(FolderInUse, match=rf"\(PID {os.getpid()}\) writing into it"):
            render([tmp_path / "cmp"], figures=False)  # nor a report
    assert (tmp_path / "cmp" / "merged" / "ties-1").stat().st_mtime_ns == before
    render([tmp_path / "cmp"], figures=False)
    assert (tmp_path / "cmp" / "merged" / "ties-1").stat().st_mtime_ns == before
    merges.compare_merges(base.out / "final", finetuned, domains, ["ties"], [1.0],
                          tmp_path / "cmp", eval_tokens=1024, seq_len=32)  # fmt: skip
    assert (tmp_path / "cmp" / "merged" / "ties-1").stat().st_mtime_ns == before
    # ... but a merge of other fine-tunes is never taken for this one's
    other = [finetuned[1], finetuned[0], finetuned[2]]
    rerun = (base.out / "final", other, [domains[1], domains[0], domains[2]], ["ties"], [1.0],
             tmp_path / "cmp")  # fmt: skip
    with pytest.raises(ValueError, match="made from other checkpoints.*--force"):
        merges.compare_merges(*rerun, eval_tokens=1024, seq_len=32)
    assert (tmp_path / "cmp" / "merged" / "ties-1").stat().st_mtime_ns == before
    merges.compare_merges(*rerun, eval_tokens=1024, seq_len=32, force=True)
    assert (tmp_path / "cmp" / "merged" / "ties-1").stat().st_mtime_ns != before


def test_merge_mode_checks_its_inputs(tmp_path):
    with pytest.raises(ValueError, match="2 models but --data 1 domains"):
        merges.compare_merges("b", ["a", "c"], ["x"], ["mean"], [1.0], tmp_path)
    with pytest.raises(ValueError, match="unknown merge method 'avg'"):
        merges.compare_merges("b", ["a", "c"], ["x", "y"], ["avg"], [1.0], tmp_path)
    with pytest.raises(ValueError, match="--scales must be positive"):
        merges.compare_merges("b", ["a", "c"], ["x", "y"], ["ta"], [0.0], tmp_path)
    # before: NaN, inf and 1e39 passed, a folder was made, then "--scale: nan is not finite"
    for scale in (math.nan, math.inf, 1e39):
        with pytest.raises(ValueError, match="--scales must be positive finite numbers"):
            merges.compare_merges("b", ["a", "c"], ["x", "y"], ["ta"], [0.5, scale], tmp_path)
    # before: both merged into ta-0.5, the second over the first, and one was never scored
    with pytest.raises(ValueError, match=re.escape(
        "--scales: 0.5 and 0.5000001 would both name the merge ta-0.5 (scales are named to 6 "
        "significant digits)")):  # fmt: skip
        merges.compare_merges("b", ["a", "c"], ["x", "y"], ["ta"], [0.5, 0.5000001], tmp_path)
    assert list(tmp_path.iterdir()) == []


# -- through the CLI ------------------------------------------------------------------------------
def run_mloco(command: str) -> None:
    """One ``mloco ...`` line through ``mloco``'s entry point; fails on a non-zero exit."""
    from mergekit_loco import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(shlex.split(command)[1:])
    assert exit_info.value.code == 0, command


def test_compare_command_seed_list_shared_inner_settings_and_val_seed(tmp_path, domains):
    """A user's tuning cell: listed seeds, one inner setting for every preset, a fixed
    validation set, a momentum grid, a checkpoint cadence."""
    run_mloco(
        f"mloco compare --aggregators diloco,tsv --workers 2 --inner-steps 2 --seeds 3,5 "
        f"--inner-lr 0.002 --weight-decay 0.05 --val-seed 7 --outer-momentum-grid 0.8 "
        f"--model micro --global-batch 4 --seq-len 32 --vocab-size 300 --val-tokens 1024 "
        f"--tokens 256 --data {domains[1]} --checkpoint-every 5 --no-figures --quiet "
        f"-o {tmp_path / 'out'}"
    )
    names = sorted(p.name for p in (tmp_path / "out" / "runs").iterdir())
    assert names == ["diloco-R2-H2-m0.8-s3", "diloco-R2-H2-m0.8-s5", "dp-s3", "dp-s5",
                     "tsv-R2-H2-s3", "tsv-R2-H2-s5"]  # fmt: skip
    for name in names:
        config = runs.read_run_config(tmp_path / "out" / "runs" / name)
        assert (config["inner_lr"], config["weight_decay"], config["val_seed"]) == (0.002, 0.05, 7)
        assert config["checkpoint_every"] == 5  # not the default cadence (1 for one round)
        assert runs.is_finished(tmp_path / "out" / "runs" / name)


def test_merge_mode_warns_like_eval_when_it_would_score_trained_tokens(tmp_path, domains, capsys):
    """compare --mode merge scores each fine-tune's domain: more --eval-tokens than the
    fine-tunes held out, another --seed, or a domain a fine-tune was not trained on give the
    warnings ``mloco eval`` gives (one function: evaluate.held_out_warnings), one line each;
    the right settings give none (before: silent)."""
    from mergekit_loco import cli

    toy = {**TOY, "workers": 1, "inner_steps": 2, "tokens": 256}

    def trained(out: str, data: str, init: str | None = None) -> str:
        config = preset_config("dp", data=data, init=init, out=str(tmp_path / out), **toy)
        return str(train(config, progress=False).out / "final")

    base = trained("base", ",".join(domains[:2]))
    finetuned = [trained(f"ft{i}", domain, base) for i, domain in enumerate(domains[:2])]

    def compare(data: list[str], *options: str) -> list[str]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["compare", "--mode", "merge", "--base", str(base), "--finetuned",
                      ",".join(finetuned), "--data", ",".join(data), "--methods", "mean",
                      "--scales", "1", "--seq-len", "32", "--no-figures", "--quiet",
                      "-o", str(tmp_path / "cmp"), "--force", *options])  # fmt: skip
        assert exit_info.value.code in (0, None)
        return capsys.readouterr().err.splitlines()

    assert compare(domains[:2], "--eval-tokens", "1024", "--seed", "0") == []
    warnings = compare(domains[:2], "--eval-tokens", "2048", "--seed", "3")
    expected = []
    for path in finetuned:
        config = Path(path).parent / "config.json"
        expected += [
            f"warning: {path}: the run held out 1,024 validation tokens ({config}), so 2,048 "
            "evaluated tokens include tokens it trained on; pass --eval-tokens 1024",
            f"warning: {path}: the run held out its validation tokens with seed 0 ({config}), "
            "so --seed 3 evaluates other documents, some of them trained on; pass --seed 0",
        ]
    assert warnings == expected
    swapped = compare(domains[1::-1], "--eval-tokens", "1024")  # each scored on the other's
    assert len(swapped) == 2 and all("; compare --data " in w for w in swapped), swapped
    assert swapped[0].startswith(f"warning: {finetuned[0]}: the run trained on --data ")
    assert swapped[0].endswith(f"the held-out tokens of {domains[1]} are not its validation set")


def test_compare_command_errors_are_one_line(capsys):
    from mergekit_loco import cli

    for args, message in (
        (["--mode", "both"], "--mode must be one of aggregators, merge, not 'both'"),
        (["--mode", "merge", "--base", "b"], "--mode merge needs --base, --finetuned and --data"),
        (["--workers", "2,x"], "--workers: '2,x' is not a comma-separated list of int"),
        (["--seeds", "0"], "--seeds: '0' is neither a count >= 1 nor a list like 0,1,2"),
        (["--seeds", "1,-2"], "--seeds: '1,-2' needs seeds in [0, 2**63)"),
        (["--seeds", f"{2**63},"], f"--seeds: '{2**63},' needs seeds in [0, 2**63)"),
        (
            ["--seeds", "900"],
            "--seeds 900 would run 900 seeds per cell (a count); for the one "
            "seed 900, write it as a list: --seeds 900,",
        ),
        (["--val-seed", "-3"], "--val-seed must be an integer in [0, 2**63), got -3"),
        # before: named by the config fields (global_batch), which compare has no flags for
        (["--inner-steps", "0"], "--inner-steps must be >= 1, got 0"),
        (
            ["--workers", "2,3"],
            "a global batch of 64 (--global-batch) is not divisible by 3 workers (--workers); "
            "each worker's batch is the global batch / R",
        ),
        (
            ["--global-batch", "8", "--val-tokens", "64"],
            "--val-tokens must be >= --seq-len (128), got 64",
        ),
        (
            ["--outer-momentum-grid", "0.9,1"],
            "--outer-momentum-grid '0.9,1': momentum must lie in (0, 1)",
        ),
        # before: NaN passed, and the error named the config field outer_lr
        (["--outer-lr-grid", "1,nan"], "--outer-lr-grid '1,nan': give positive finite numbers"),
        (["--outer-lr-grid", "inf"], "--outer-lr-grid 'inf': give positive finite numbers"),
        # before: "Python int too large to convert to C int", after -o was made
        (["--jobs", str(2**31)], f"--jobs must be in [1, 1024], got {2**31}"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["compare", "-o", "unused", *args])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert error == f"error: {message}\n"


def test_gpu_scale_out_script_runs_at_toy_size(tmp_path, domains, capsys):
    """benchmarks/compare_gpu.py: the 178M protocol (R = 8, 4 rounds) at micro size on CPU."""
    path = Path(__file__).parents[1] / "benchmarks" / "compare_gpu.py"
    spec = importlib.util.spec_from_file_location("compare_gpu", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "gpu"
    script.main([str(out), "--size", "toy", "--data", domains[1], "--aggregators",
                 "diloco,isoloco"])  # fmt: skip
    names = {"dp-s0", "diloco-R8-H2-s0", "isoloco-R8-H2-s0"}
    assert {p.name for p in (out / "runs").iterdir()} == names
    assert all(runs.is_finished(out / "runs" / name) for name in names)
    for name in names:
        config = runs.read_run_config(out / "runs" / name)
        assert (config["inner_lr"], config["val_seed"], config["tokens"]) == (
            1.38e-3,
            1000,
            4 * 2 * 8 * 32,
        )
    assert (out / "curves.png").is_file() and (out / "loss_vs_workers.png").is_file()
    output = capsys.readouterr().out
    assert "Time per cell" in output and "no GPU" in output


def children_of(pid: int) -> set[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def parallel_sweep_command(tmp_path: Path) -> list[str]:
    """``mloco compare --jobs 2`` of three cells (baseline, diloco, tsv) of 400 rounds each
    (checkpoints every 100), into ``tmp_path / "sweep"``."""
    data = tmp_path / "data"
    data.mkdir()
    words = "the river ran past old stone walls while quiet birds sang of rain".split()
    for doc in range(200):
        text = " ".join(words[(doc * 7 + k * k) % len(words)] + str(k % 13) for k in range(500))
        (data / f"doc{doc:03d}.txt").write_text(text + "\n")
    return ["compare", "--aggregators", "diloco,tsv", "--workers", "2", "--inner-steps", "2",
            "--model", "micro", "--global-batch", "4", "--seq-len", "32", "--vocab-size", "300",
            "--val-tokens", "1024", "--tokens", str(4 * 32 * 2 * 400), "--data", str(data),
            "--jobs", "2", "--no-figures", "-o", str(tmp_path / "sweep")]  # fmt: skip


def start_sweep(args: list[str], out: Path) -> subprocess.Popen:
    """``python -m mergekit_loco ARGS``, returned once a cell has written a checkpoint in
    ``out``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "mergekit_loco", *args]
    sweep = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not list(out.glob("runs/*/checkpoints/round-*")) and time.monotonic() < deadline:
        assert sweep.poll() is None, sweep.stderr.read()
        time.sleep(0.5)
    return sweep


def running(pid: int) -> bool:
    """``pid`` has not ended (a zombie, state Z, has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def outlived(pids: set[int], seconds: float) -> list[int]:
    """Those of ``pids`` still running after ``seconds`` (then killed, so none is left)."""
    deadline = time.monotonic() + seconds
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in pids if running(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    return alive


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_sigterm_to_a_parallel_sweep_stops_its_workers(tmp_path):
    """``kill PID`` of ``mloco compare --jobs 2`` ends its worker processes too (they kept
    training on their own) and says, as Ctrl-C does, that finished cells are kept."""
    sweep = start_sweep(parallel_sweep_command(tmp_path), tmp_path / "sweep")
    workers = children_of(sweep.pid)
    assert workers, "no worker processes"
    sweep.send_signal(signal.SIGTERM)
    _, stderr = sweep.communicate(timeout=120)
    assert sweep.returncode == 130, stderr
    assert "interrupted; finished cells are kept" in stderr
    assert not outlived(workers, 60), "worker processes outlived the sweep"


def cell_processes(sweep: int) -> set[int]:
    """The running processes of the cells of the sweep process ``sweep``."""
    found = set()
    for pid in children_of(sweep):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes() and running(pid):
                found.add(pid)
        except OSError:  # it ended meanwhile
            continue
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_sigterm_to_a_parallel_sweep_after_a_cell_ended_ends_within_seconds(tmp_path):
    """``kill PID`` of ``mloco compare --jobs 2`` once one cell has ended (here it diverged at
    once) while the other trains: the ended cell's process is gone (before, a pool worker
    waited for work, and died holding the pool's call-queue lock, so the busy one blocked on it
    after stopping its cell and the sweep waited its 60 s grace to kill it). It exits 130
    within seconds, keeping the stopped cell's checkpoint."""
    args = parallel_sweep_command(tmp_path)
    args[args.index("--aggregators") + 1] = "diloco"
    args += ["--outer-lr-grid", "diloco=1e6"]  # diverges in round 1: its process ends
    out = tmp_path / "sweep"
    sweep = start_sweep(args, out)
    failed = out / "runs" / "diloco-R2-H2-lr1e+06-s0" / runs.FAILED_FILE
    deadline = time.monotonic() + 120
    while (not failed.exists() or len(cell_processes(sweep.pid)) > 1) and (
        time.monotonic() < deadline
    ):
        assert sweep.poll() is None, sweep.stderr.read()
        time.sleep(0.2)
    cells = cell_processes(sweep.pid)
    assert failed.exists() and len(cells) == 1, "not one ended and one training cell"
    sweep.send_signal(signal.SIGTERM)
    try:
        _, stderr = sweep.communicate(timeout=20)
    finally:
        outlived(cells, 0)
        sweep.kill()
    assert sweep.returncode == 130, stderr
    assert "interrupted; finished cells are kept" in stderr
    assert list((out / "runs" / "dp-s0" / "checkpoints").glob("round-*"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_of_a_killed_parallel_sweep_end_with_it(tmp_path):
    """SIGKILL (or the OOM killer) of ``mloco compare --jobs 2`` while its cells train: its
    worker processes end within seconds (before: each trained its cell to the end in the sweep,
    then waited forever, parent PID 1, racing a rerun). Each cell stops at its next inner step
    and resumes from its last checkpoint."""
    sweep = start_sweep(parallel_sweep_command(tmp_path), tmp_path / "sweep")
    workers = children_of(sweep.pid)
    sweep.kill()
    sweep.wait(timeout=60)  # not its stderr: an orphan would hold that open
    sweep.stderr.close()
    assert len(workers) >= 2, "no worker processes"
    assert not outlived(workers, 10), "worker processes outlived the killed sweep"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_cell_process_killed_in_a_parallel_sweep_is_named(tmp_path):
    """SIGKILL (as the out-of-memory killer sends) of one cell's process in ``mloco compare
    --jobs 2`` (before: ``interrupted; finished cells are kept``, as for Ctrl-C): exit 1 and one
    line naming the cell and the signal, hinting at memory and saying how to resume. The sweep
    stops its other cell and ends with its workers; the killed cell keeps its checkpoint (not
    recorded as failed)."""
    out = tmp_path / "sweep"
    args = [*parallel_sweep_command(tmp_path), "--checkpoint-every", "10"]
    sweep = start_sweep(args, out)
    workers = children_of(sweep.pid)
    run = next(out.glob("runs/*/checkpoints/round-*")).parents[1]  # most rounds still to go
    pid = int((run / LOCK_FILE).read_text())  # the process training it
    assert pid in workers
    os.kill(pid, signal.SIGKILL)
    try:
        _, stderr = sweep.communicate(timeout=120)
    finally:
        sweep.kill()
        alive = outlived(workers, 60)
    assert not alive, "worker processes outlived the sweep"
    assert sweep.returncode == 1, stderr
    assert (
        f"error: the process of cell {run.name} died (killed by SIGKILL, likely by the "
        "out-of-memory killer: try fewer --jobs); the sweep stopped. Finished cells are kept: "
        "run the same command to resume (unfinished cells continue from their last checkpoint)"
    ) in stderr.splitlines()
    assert "Traceback" not in stderr
    assert list((run / "checkpoints").glob("round-*")) and not runs.is_finished(run)


@pytest.mark.parametrize(
    ("exit_codes", "said"),
    [
        ({"tsv": -signal.SIGKILL}, "the process of cell tsv-R2-H2-s0 died (killed by SIGKILL, "
         "likely by the out-of-memory killer: try fewer --jobs); the sweep"),
        ({"tsv": -signal.SIGSEGV, "dp": 3}, "the process of cell tsv-R2-H2-s0 died (killed by "
         f"signal {signal.SIGSEGV.value}: {signal.strsignal(signal.SIGSEGV)}); the process of "
         "cell dp-s0 died (exit code 3); the sweep"),
        ({"dp": None}, "the process of cell dp-s0 died (its exit status could not be read); the"),
    ],
)  # fmt: skip
def test_death_message_says_which_cell_died_how(exit_codes, said):
    """A cell's process that ends without reporting: by signal (SIGKILL: likely out of memory),
    by exit code (``os._exit``), or with a status that could not be read."""
    cells = {"tsv": Cell("tsv", 2, 2, 0), "dp": Cell("dp", 1, 2, 0)}
    message = sweeping.death_message({cells[name]: code for name, code in exit_codes.items()})
    assert message.startswith(said)
    assert message.endswith("run the same command to resume (unfinished cells continue from "
                            "their last checkpoint)")  # fmt: skip


def ended_job(name: str, report: str | BaseException | None, exit_code: int = 0):
    """A cell's process as :func:`sweeping.settle` sees it once it has ended."""
    job = types.SimpleNamespace(cell=Cell(name, 2, 2, 0), report=report,
                                process=types.SimpleNamespace(exitcode=exit_code))  # fmt: skip
    job.outcome = lambda: sweeping.CellProcess.outcome(job)
    return job


@pytest.mark.parametrize("finished_first", [True, False])
@pytest.mark.parametrize(
    ("other", "raised"),
    [
        (ended_job("tsv", None, -signal.SIGKILL), sweeping.CellDied),
        (ended_job("tsv", TrainingFailed("round 3: OSError", (2, None), "rerun")), TrainingFailed),
    ],
)
def test_a_cell_that_ends_beside_a_dead_or_failed_one_is_still_told(other, raised, finished_first):
    """Two cells' processes end in the same wait: one finished, one died (or failed). The
    finished one gets its progress line first, then the sweep stops (before: the death or
    error was raised first and the finished cell went untold), whichever order they end in."""
    finished = ended_job("diloco", "ran")
    told = []
    with pytest.raises(raised):
        ended = [finished, other] if finished_first else [other, finished]
        sweeping.settle(ended, lambda cell, outcome: told.append((cell.name, outcome)))
    assert told == [("diloco-R2-H2-s0", "ran")]


def test_cells_that_all_finish_in_one_wait_are_each_told_once_in_order():
    told = []
    jobs = [ended_job("diloco", "ran"), ended_job("tsv", "resumed")]
    sweeping.settle(jobs, lambda cell, outcome: told.append((cell.name, outcome)))
    assert told == [("diloco-R2-H2-s0", "ran"), ("tsv-R2-H2-s0", "resumed")]


#: ``mloco`` whose diloco cell fails with ``{fault}`` before it trains, in its own process: the
#: file patches run_cell here and, imported by each cell's spawned process (as its main module),
#: there.
FAULTY_CELL = """\
import os, signal, sys

from mergekit_loco.cli import main
from mergekit_loco.compare import sweep
from mergekit_loco.train.guards import TrainingFailed

real_run_cell = sweep.run_cell


def run_cell(planned, cell, run_dir, progress=False):
    if cell.aggregator == "diloco":
        {fault}
    return real_run_cell(planned, cell, run_dir, progress)


sweep.run_cell = run_cell
if __name__ == "__main__":
    main(sys.argv[1:])
"""


def sweep_processes(marker: str) -> set[int]:
    """The running cell processes whose environment holds ``marker``."""
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        pid = int(environ.parent.name)
        try:
            if marker.encode() in environ.read_bytes().split(b"\0") and (
                b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
            ):
                found.add(pid)
        except OSError:  # another user's, or it ended meanwhile
            continue
    return {pid for pid in found if running(pid)}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize(
    ("fault", "code", "line"),
    [
        ("signal.raise_signal(signal.SIGTERM)", 130, "interrupted; finished cells are kept: run "
         "the same command to resume"),
        ("raise TrainingFailed('cell diloco-R2-H2-s0: round 1: OSError: disk full', (0, None), "
         "'Run the same compare command to go on.')", 1, "cell diloco-R2-H2-s0: round 1: "
         "OSError: disk full; stopping. No checkpoint was written before it. Run the same "
         "compare command to go on."),
    ],
    ids=["sigterm-before-training", "error"],
)  # fmt: skip
def test_a_cell_that_fails_in_its_process_stops_a_parallel_sweep(tmp_path, fault, code, line):
    """A cell of ``mloco compare --jobs 2`` that fails in its own process while the baseline
    trains beside it: SIGTERM before training has its handler (tokenizer, data) is the cell's
    interruption (before, a pool worker's SystemExit, which needed the worker to live on); an
    error crosses to the sweep with its type and message (as with --jobs 1). The sweep prints
    that one line, stops the baseline's process and ends with it: none is left."""
    driver = tmp_path / "faulty_compare.py"
    driver.write_text(FAULTY_CELL.replace("{fault}", fault))
    marker = f"MLOCO_TEST_SWEEP={tmp_path}"  # the sweep's processes inherit it
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLOCO_TEST_SWEEP": str(tmp_path)}
    command = [sys.executable, str(driver), *parallel_sweep_command(tmp_path)]
    with open(tmp_path / "stderr.txt", "w") as stderr:  # a file: no pipe to fill or hold open
        sweep = subprocess.Popen(command, env=env, stderr=stderr)
    try:
        sweep.wait(timeout=240)
        left = sweep_processes(marker)  # as the sweep ends
    finally:
        sweep.kill()
    assert not outlived(left, 0), "cell processes outlived the sweep"
    stderr = (tmp_path / "stderr.txt").read_text()
    assert sweep.returncode == code, stderr
    assert f"error: {line}" in stderr.splitlines()
    assert "Traceback" not in stderr
    assert not runs.is_finished(tmp_path / "sweep" / "runs" / "dp-s0")


class TwoPartError(Exception):
    """Pickles, but cannot be unpickled: its ``__init__`` takes two arguments, passes on one."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")


def test_an_error_that_cannot_cross_to_the_sweep_keeps_its_type_name_and_message():
    """A cell's error crosses to the sweep by pickle: one that would not come back whole is
    sent as a RuntimeError naming the cell, its type and message; others are sent as they are
    (type, message and fields)."""
    cell = Cell("tsv", 2, 2, 0)
    sent = pickle.loads(pickle.dumps(sweeping.sendable(TwoPartError("ck", "torn"), cell)))
    assert type(sent) is RuntimeError
    assert str(sent) == "cell tsv-R2-H2-s0: TwoPartError: ck: torn"
    failed = TrainingFailed("cell tsv-R2-H2-s0: round 3: OSError: disk full", (2, None), "Rerun.")
    assert sweeping.sendable(failed, cell) is failed


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_second_compare_into_a_results_folder_in_use_is_refused(tmp_path, capsys):
    """Two ``mloco compare -o DIR`` at once (before: both trained the same cells into DIR,
    each resuming and overwriting the other's checkpoints): the second exits 2 at once naming
    DIR and the first's PID, and changes nothing there."""
    out = tmp_path / "sweep"
    args = parallel_sweep_command(tmp_path)
    sweep = start_sweep(args, out)
    processes = {sweep.pid, *children_of(sweep.pid)}
    try:
        for pid in processes:  # the sweep and its workers, which write into DIR too
            os.kill(pid, signal.SIGSTOP)
        before = snapshot(out)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            main(args)
        assert exited.value.code == 2
        assert capsys.readouterr().err == (
            f"error: {out} is in use by another mloco process (PID {sweep.pid}) comparing into "
            "it; wait for it to finish or stop it, then run the same command again (it keeps "
            "what it did)\n"
        )
        with pytest.raises(SystemExit) as exited:  # nor is a report written into it meanwhile
            main(["report", str(out)])
        assert exited.value.code == 2
        assert f"{out} is in use by another mloco process (PID {sweep.pid}) writing into it; " in (
            capsys.readouterr().err
        )
        assert snapshot(out) == before
    finally:
        for pid in processes:
            os.kill(pid, signal.SIGKILL)
        sweep.communicate(timeout=60)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "2,2"], "--workers: 2 is given twice (2,2)"),
        (["--workers", "1,2,02"], "--workers: 2 is given twice (1,2,2)"),
        (["--aggregators", "diloco,tsv, diloco"], "--aggregators: diloco is given twice"),
        (["--inner-steps", "5,5"], "--inner-steps: 5 is given twice (5,5)"),
        (["--seeds", "0,0"], "--seeds: 0 is given twice (0,0)"),
        (["--outer-lr-grid", "1,2,1.0"], "--outer-lr-grid '1,2,1.0': 1.0 is given twice"),
        (["--outer-momentum-grid", "diloco=0.9,0.9"], "--outer-momentum-grid 'diloco=0.9,0.9'"),
        (["--mode", "merge", "--base", "b", "--finetuned", "x,y", "--data", "p,q",
          "--methods", "ta,ties,ta"], "--methods: ta is given twice (ta,ties,ta)"),
        (["--mode", "merge", "--base", "b", "--finetuned", "x,y", "--data", "p,q",
          "--scales", "0.5,1,1.0"], "--scales: 1.0 is given twice"),
        (["--mode", "merge", "--base", "b", "--finetuned", "x,x", "--data", "p,q"],
         "--finetuned: x is given twice (x,x)"),
    ],
)  # fmt: skip
def test_every_list_option_refuses_a_value_given_twice(capsys, tmp_path, args, message):
    """Before, ``--workers 2,2`` (or a duplicated --aggregators or --inner-steps) planned
    "2 cells ... 2 to run" and trained diloco-R2-H5-s0 twice, while --seeds 0,0 was refused:
    every list option now refuses a repeated value, in one line naming it, before -o exists."""
    from mergekit_loco import cli

    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["compare", "-o", str(out), *args])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {message}") and error.count("\n") == 1, error
    assert error.endswith("; give each value once\n") and not out.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--outer-lr-grid", "0.5,0.5000001"], "--outer-lr-grid: 0.5 and 0.5000001 give "
         "diloco the value 0.35"),  # both cells were diloco-R2-H2-lr0.35-s0
        (["--outer-lr-grid", "1,1.0000000000001"], "--outer-lr-grid: 1.0 and 1.0000000000001 "
         "give diloco the value 0.7"),  # both the preset's own lr: one cell trained twice
        (["--outer-lr-grid", "1,1.0000001"], "--outer-lr-grid: 1.0 and 1.0000001 give diloco "
         "the value 0.7"),  # diloco-R2-H2-s0 and -lr0.7-s0: one setting to the report
        (["--outer-lr-grid", "diloco=0.35,0.3500001"], "--outer-lr-grid: 0.35 and 0.3500001 "
         "give diloco the value 0.35"),
        (["--outer-momentum-grid", "0.8,0.80000001"], "--outer-momentum-grid: 0.8 and "
         "0.80000001 give diloco the value 0.8"),
        (["--outer-momentum-grid", "0.9,0.90000001"], "--outer-momentum-grid: 0.9 and "
         "0.90000001 give diloco the value 0.9"),  # the preset's own momentum and another
    ],
)  # fmt: skip
def test_grid_values_that_cell_names_show_alike_are_refused(capsys, tmp_path, args, message):
    """A cell's name shows its outer lr and momentum to 6 significant digits (as the report
    reads them). Before, --outer-lr-grid 0.5,0.5000001 planned two cells of one name: the
    second found no checkpoint, started over and deleted the first, and results.csv held one
    run. Now grid values that would be one cell are refused in one line, before -o exists."""
    out = tmp_path / "never"
    code, err, _ = run_cli(capsys, *toy_compare(str(tmp_path), out, "--aggregators", "diloco",
                                                "--workers", "2", *args))  # fmt: skip
    assert_refused(code, err, message, "to the 6 significant digits its cell names show")
    assert err.endswith("; give values that differ in those digits\n") and not out.exists()


def test_plan_refuses_a_value_given_twice():
    """The Python API plans the same cells the command does: one list holding a value twice is
    refused, naming the option, as --seeds was."""
    shared = {**TOY, "tokens": 1024}
    for field_name, values, option in (("aggregators", ["tsv", "tsv"], "--aggregators"),
                                       ("workers", [2, 2], "--workers"),
                                       ("inner_steps", [2, 2], "--inner-steps"),
                                       ("seeds", [1, 1], "--seeds")):  # fmt: skip
        fields = {"aggregators": ["diloco"], "workers": [2], "inner_steps": [2], "seeds": [1]}
        sweep = Sweep(**(fields | {field_name: values}), baseline=False, shared=shared)
        with pytest.raises(ValueError, match=f"{option}: {values[0]} is given twice"):
            plan(sweep)


# -- one comparison per folder ----------------------------------------------------------------
def fake_train(config, progress=True):
    """A finished run in no time: the config.json and final event a report reads."""
    out = Path(config.run.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    final = {"event": "final", "round": config.total_rounds(), "val_loss": 3.0}
    (out / "metrics.jsonl").write_text(json.dumps(final) + "\n")
    return types.SimpleNamespace(finished=True)


def toy_compare(data: str, out: Path, *options: str, tokens: int = 512) -> list[str]:
    return ["compare", "--model", "micro", "--tokens", str(tokens), "--global-batch", "4",
            "--seq-len", "32", "--vocab-size", "300", "--val-tokens", "256", "--data", data,
            "--inner-steps", "2", "--no-figures", "--quiet", "-o", str(out), *options]  # fmt: skip


def test_compare_refuses_cells_of_another_budget_in_the_folder(tmp_path, monkeypatch, capsys):
    """The reviewer's case: a second compare at twice the tokens into the same folder added
    1024-token cells beside 512-token ones, paired with the 512-token baseline."""
    monkeypatch.setattr(sweeping, "train", fake_train)
    data = write_domain(tmp_path / "data", lambda d, i: f"x{d} = {i}", documents=3)
    out = tmp_path / "cmp"
    first = toy_compare(data, out, "--aggregators", "diloco,isoloco", "--workers", "1,2",
                        "--seeds", "0,1")  # fmt: skip
    assert run_cli(capsys, *first)[0] == 0
    before = snapshot(tmp_path)
    more = toy_compare(data, out, "--aggregators", "diloco", "--workers", "4", "--seeds", "0,1",
                       "--no-baseline", tokens=1024)  # fmt: skip
    code, err, _ = run_cli(capsys, *more)
    old = "the folder's runs with 512 (e.g. diloco-R1-H2-s0)"
    assert_refused(code, err, "cell diloco-R4-H2-s0 would train with tokens 1024", old, "new -o")
    assert snapshot(tmp_path) == before
    # what legitimately varies: another R, a tuned outer lr and momentum (stage 5's cells)
    tuned = ("--outer-lr-grid", "diloco=0.35", "--outer-momentum-grid", "0.8")
    again = toy_compare(data, out, "--aggregators", "diloco", "--workers", "4", "--seeds", "0,1",
                        *tuned)  # fmt: skip
    code, err, _ = run_cli(capsys, *again)
    assert code == 0, err
    # a second stage at 2x tokens in a folder of its own is its own comparison
    doubled = toy_compare(data, tmp_path / "doubled", "--aggregators", "diloco", "--workers",
                          "2", tokens=1024)  # fmt: skip
    assert run_cli(capsys, *doubled)[0] == 0


def first_toy_sweep(tmp_path, monkeypatch, capsys) -> tuple[str, Path, list]:
    """A finished toy sweep (diloco, R = 2, trained by ``fake_train``) in ``tmp_path/cmp``:
    (its data folder, the folder, the compare arguments)."""
    monkeypatch.setattr(sweeping, "train", fake_train)
    data = write_domain(tmp_path / "data", lambda d, i: f"x{d} = {i}", documents=3)
    out = tmp_path / "cmp"
    args = toy_compare(data, out, "--aggregators", "diloco", "--workers", "2")
    assert run_cli(capsys, *args)[0] == 0
    return data, out, args


def test_compare_refuses_a_folder_whose_data_changed(tmp_path, monkeypatch, capsys):
    data, out, args = first_toy_sweep(tmp_path, monkeypatch, capsys)
    assert json.loads((out / "data.json").read_text())["data"] == data
    # the same texts rewritten (a reinstall, another machine: new file times) still match
    for document in Path(data).iterdir():
        document.write_text(document.read_text())
        os.utime(document, (1, 1))
    assert run_cli(capsys, *args[:-2], "--workers", "4", *args[-2:])[0] == 0
    (Path(data) / "doc01.txt").write_text("y = 1\n")
    code, err, _ = run_cli(capsys, *args[:-2], "--workers", "8", *args[-2:])
    assert_refused(code, err, f"the documents of --data {data} changed since its runs trained",
                   "choose a new -o")  # fmt: skip


def test_a_run_copied_into_a_compare_folder_is_refused(tmp_path, monkeypatch, capsys):
    """A run of another validation set copied over a cell: report and compare both refuse."""
    _, out, args = first_toy_sweep(tmp_path, monkeypatch, capsys)
    cell = out / "runs" / "diloco-R2-H2-s0"
    config = json.loads((cell / "config.json").read_text())
    (cell / "config.json").write_text(json.dumps({**config, "val_tokens": 512}))
    code, err, _ = run_cli(capsys, "report", out, "--no-figures")
    assert_refused(code, err, "its runs are not one comparison, they differ in val_tokens 512 "
                   "(diloco-R2-H2-s0) vs 256 (dp-s0)")  # fmt: skip
    code, err, _ = run_cli(capsys, *args)
    assert_refused(code, err, "its runs are not one comparison", "val_tokens", "choose a new -o")
