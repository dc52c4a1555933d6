"""Adding a method touches one file: a toy method defined here (plus one registry entry) runs in
a single-process merge, over a 2-rank gloo group and through `mloco merge --option`, against a
float64 formula written here; and `--option KEY=VALUE` parsing and its errors."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoint_factory import load_state_dict, make_family

from mergekit_loco.cli import main
from mergekit_loco.dist import merge_across_ranks, plan_bytes
from mergekit_loco.methods import METHODS, MergeMethod, get_method, parse_options
from mergekit_loco.methods.registry import typed_options
from mergekit_loco.task_vector import TaskVector


@dataclass(frozen=True)
class SignedPowerMean(MergeMethod):
    """``merged = sign(S) (|S| / T)^(1/p)`` with ``S = sum_t sign(tau_t) |tau_t|^p``: a power
    mean. The whole method: one sum contract, no plan, no process code."""

    name = "power-mean"
    power: float = 2.0

    def local_term(self, name: str, delta: torch.Tensor, worker_index: int) -> torch.Tensor:
        return torch.sign(delta) * delta.abs() ** self.power

    def finish(self, name: str, total: torch.Tensor, workers: int) -> torch.Tensor:
        return torch.sign(total) * (total.abs() / workers) ** (1 / self.power)


def reference(deltas: list[np.ndarray], power: float) -> np.ndarray:
    total = sum(np.sign(d) * np.abs(d) ** power for d in deltas)
    return np.sign(total) * (np.abs(total) / len(deltas)) ** (1 / power)


SHAPES = {"w": (6, 4), "b": (5,)}


def worker_deltas(workers: int = 4) -> list[TaskVector]:
    generator = torch.Generator().manual_seed(7)
    return [
        TaskVector(
            {n: torch.randn(s, generator=generator, dtype=torch.float64) for n, s in SHAPES.items()}
        )
        for _ in range(workers)
    ]


@pytest.fixture
def registered(monkeypatch):
    """The one registry line, for the duration of a test."""
    monkeypatch.setitem(METHODS, SignedPowerMean.name, SignedPowerMean)


def test_toy_method_merges_in_one_process(registered):
    deltas = worker_deltas()
    method = get_method("power-mean", power=3.0)
    merged = method.merge(deltas)
    for name in SHAPES:
        expected = reference([d[name].numpy() for d in deltas], 3.0)
        np.testing.assert_allclose(merged[name].numpy(), expected, rtol=1e-12, atol=1e-12)
    assert method.is_sum() and not get_method("tsv").is_sum()


def run_toy_on_two_ranks(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    deltas = worker_deltas()
    method = SignedPowerMean(power=3.0)
    merged, stats = merge_across_ranks(method, deltas[2 * rank : 2 * rank + 2])
    for name in SHAPES:
        expected = reference([d[name].numpy() for d in deltas], 3.0)
        np.testing.assert_allclose(merged[name].numpy(), expected, rtol=1e-10, atol=1e-12)
    # a sum method runs on one all-reduce: 2 (P-1)/P N b per rank, the bytes of mean
    numel = sum(math.prod(shape) for shape in SHAPES.values())
    assert stats.plan == "all-reduce" and stats.bytes_sent == numel * 8
    layout = [(n, torch.Size(s), torch.float64) for n, s in SHAPES.items()]
    assert plan_bytes("all-reduce", method, layout, 2, 2) == 2 * numel * 8
    dist.destroy_process_group()
    os._exit(0)


def test_toy_method_runs_over_two_gloo_ranks(tmp_path):
    mp.spawn(run_toy_on_two_ranks, args=(str(tmp_path / "store"),), nprocs=2)


def test_toy_method_through_the_cli_with_option(registered, tmp_path, capsys):
    base, models = make_family(tmp_path / "family", count=2, layout="file")
    out = tmp_path / "merged.safetensors"
    args = ["merge", *models, "--base", base, "-m", "power-mean", "--option", "power=3", "-o", out]
    with pytest.raises(SystemExit) as exited:
        main([str(arg) for arg in [*args, "--quiet", "--compute-dtype", "float64"]])
    assert exited.value.code == 0, capsys.readouterr().err
    base_state, states = load_state_dict(base), [load_state_dict(m) for m in models]
    for name, tensor in load_state_dict(out).items():
        if not base_state[name].is_floating_point():
            continue
        deltas = [(s[name].double() - base_state[name].double()).numpy() for s in states]
        expected = base_state[name].double().numpy() + reference(deltas, 3.0)
        np.testing.assert_allclose(tensor.double().numpy(), expected, rtol=1e-5, atol=1e-6)


# -- --option KEY=VALUE -------------------------------------------------------------------------
@dataclass(frozen=True)
class Weighted(MergeMethod):
    """Fields of the shapes a method may grow: optional and tuple-valued."""

    name = "weighted"
    weights: tuple[float, ...] | None = None
    limit: int | None = None


def test_optional_and_tuple_fields_parse(monkeypatch):
    monkeypatch.setitem(METHODS, Weighted.name, Weighted)
    assert parse_options("weighted", ["weights=0.5, 2", "limit=none"]) == {
        "weights": (0.5, 2.0),
        "limit": None,
    }
    assert parse_options("weighted", ["limit=3"]) == {"limit": 3}
    with pytest.raises(ValueError, match="'x' is not a finite number"):
        parse_options("weighted", ["weights=1,x"])


def test_options_from_text_or_files_take_the_field_types():
    """What train's --option and config files give (text, JSON text, lists) as merge's types."""
    given = {"density": "0.5,0.25", "normalize": "yes", "trim": "mergekit"}
    expected = {"density": (0.5, 0.25), "normalize": True, "trim": "mergekit"}
    assert typed_options("ties", given) == expected
    assert typed_options("mean", {"weights": "[3, 1]"}) == {"weights": (3, 1)}
    assert typed_options("mean", {"weights": "null"}) == {"weights": None}
    assert typed_options("mean", {"weights": [3, 1]}) == {"weights": (3, 1)}
    assert typed_options("dare", {"seed": 4, "rescale": "none"}) == {"seed": 4, "rescale": "none"}
    assert typed_options("nope", {"x": "1"}) == {"x": "1"}  # get_method names the method
    with pytest.raises(ValueError, match="--option 'weights=1,x': 'x' is not a finite number"):
        typed_options("mean", {"weights": "1,x"})


def test_options_are_parsed_to_the_field_types():
    assert parse_options("dare", ["density=0.5", "seed=3"]) == {"density": 0.5, "seed": 3}
    assert parse_options("iso-c", ["rank-aware=yes", "spectral=ns"]) == {
        "rank_aware": True,
        "spectral": "ns",
    }
    assert parse_options("iso-c", ["rank_aware=0"]) == {"rank_aware": False}
    assert parse_options("mean", []) == {}


@pytest.mark.parametrize(
    "method, pairs, fragments",
    [
        ("ties", ["dens=0.3"], ["--option 'dens=0.3'", "does not take 'dens'", "density"]),
        ("tsv", ["x=1"], ["'tsv' does not take 'x' (rank_aware)"]),
        ("ties", ["density"], ["--option 'density'", "expected KEY=VALUE"]),
        ("dare", ["seed=1.5"], ["--option 'seed=1.5'", "'1.5' is not an integer"]),
        ("iso-c", ["rank_aware=maybe"], ["'maybe' is not true or false"]),
        ("ties", ["density=0.1", "density=0.2"], ["'density' is given twice"]),
        ("nope", [], ["unknown merge method 'nope'"]),
    ],
)
def test_option_errors_name_the_option(method, pairs, fragments):
    with pytest.raises(ValueError) as raised:
        parse_options(method, pairs)
    for fragment in fragments:
        assert fragment in str(raised.value)


@pytest.mark.parametrize(
    "extra, fragments",
    [
        (["--option", "gamma=0.1"], ["--option 'gamma=0.1'", "'ties' does not take 'gamma'"]),
        (["--option", "density=x"], ["'x' is not a finite number"]),
        (["--option", "weights=nan,1"], ["weights must be a tuple of finite numbers", "nan"]),
        (["--density", "0.3", "--option", "density=0.2"], ["'density' is also given as a flag"]),
    ],
)
def test_cli_option_errors_are_one_line(extra, fragments, tmp_path, capsys):
    base, models = make_family(tmp_path / "family", count=2, layout="file")
    args = ["merge", *models, "--base", base, "-m", "ties", "-o", tmp_path / "o", *extra]
    with pytest.raises(SystemExit) as exited:
        main([str(arg) for arg in args])
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.mark.parametrize(
    "name, flag", [("tsv", ["--option", "rank_aware=true"]), ("iso-cts", ["--rank-aware"])]
)
def test_rank_aware_merge_through_the_cli(tmp_path, capsys, name, flag):
    """``mloco merge -m tsv --option rank_aware=true`` (or ``-m iso-cts --rank-aware``) merges
    as the API does (the owner plan's method: no low-rank plan for blocks of varying size)."""
    base, models = make_family(tmp_path / "family", count=2, layout="file")
    out = tmp_path / "merged.safetensors"
    args = ["merge", *models, "--base", base, "-m", name, *flag, "-o", out, "--quiet"]
    with pytest.raises(SystemExit) as exited:
        main([str(arg) for arg in args])
    assert exited.value.code == 0, capsys.readouterr().err
    method = get_method(name, rank_aware=True)
    assert method.plans() == ()
    theta = load_state_dict(base)
    tuned = [load_state_dict(model) for model in models]
    merged = load_state_dict(out)
    for name, tensor in theta.items():
        expected = tensor + method.merge_tensor(name, [t[name] - tensor for t in tuned])
        torch.testing.assert_close(merged[name], expected, rtol=1e-5, atol=1e-6)


def test_option_and_flags_merge_the_same(tmp_path, capsys):
    """``--option density=0.5`` is ``--density 0.5``; flags and options combine."""
    base, models = make_family(tmp_path / "family", count=2, layout="file")
    outputs = []
    for index, extra in enumerate(
        (["--density", "0.5", "--seed", "2"], ["--option", "density=0.5", "--option", "seed=2"])
    ):
        out = tmp_path / f"dare{index}.safetensors"
        args = ["merge", *models, "--base", base, "-m", "dare", "-o", out, "--quiet", *extra]
        with pytest.raises(SystemExit) as exited:
            main([str(arg) for arg in args])
        assert exited.value.code == 0, capsys.readouterr().err
        outputs.append(load_state_dict(out))
    for name, tensor in outputs[0].items():
        assert torch.equal(tensor, outputs[1][name]), name
