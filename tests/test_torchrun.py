"""A real torchrun (2 processes, gloo) with R = 4 equals the simulated R = 4 run."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import stdlib_corpus
from launches import free_port, run_launch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from mergekit_loco.cli import main
from mergekit_loco.train.config import resolve_config
from mergekit_loco.train.loop import train
from mergekit_loco.train.workers import TorchrunWorkers

CORPUS_FILES = ("textwrap.py", "string.py", "json/decoder.py", "csv.py", "heapq.py", "shlex.py")
FLAGS = {
    "model": "micro", "workers": 4, "inner_steps": 2, "global_batch": 8, "seq_len": 32,
    "tokens": 1536, "vocab_size": 512, "val_tokens": 1024, "device": "cpu",
}  # fmt: skip
#: A tiny GPT-2 with its default dropout (0.1 on the embeddings, attention and residuals).
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64,
        "vocab_size": 512}  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Iterator[str]:
    with stdlib_corpus(tmp_path_factory.mktemp("corpus"), CORPUS_FILES) as corpus:
        yield corpus


def final_params(out: Path) -> dict[str, torch.Tensor]:
    model = LlamaForCausalLM.from_pretrained(out / "final")
    return {name: p.detach() for name, p in model.named_parameters()}


def run_torchrun(out: Path, corpus: str, *extra: str, options: dict = FLAGS) -> None:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        "-m", "mergekit_loco", "train", *flags, f"--data={corpus}", f"--out={out}",
        "--quiet", "--timeout=120", *extra,
    ]  # fmt: skip
    launched = run_launch(command, {**os.environ, "OMP_NUM_THREADS": "1"}, guard_s=400)
    assert launched.returncode == 0, launched.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["diloco", "isoloco"])
def test_torchrun_equals_simulated(corpus, tmp_path, preset):
    """Mean (DiLoCo) and Iso-C (IsoLoCo), both with Nesterov momentum: each rank runs 2 of the
    4 workers and passes only its own deltas to the OuterOptimizer."""
    run_torchrun(tmp_path / "torchrun", corpus, f"--preset={preset}", "--checkpoint-every=1")
    config = resolve_config(None, **FLAGS, preset=preset, data=corpus, out=str(tmp_path / "sim"))
    simulated = train(config, progress=False)
    distributed = final_params(tmp_path / "torchrun")
    for name, param in final_params(tmp_path / "sim").items():
        torch.testing.assert_close(distributed[name], param, rtol=1e-4, atol=1e-6)

    # rank 0 alone wrote the metrics; each rank wrote its own workers' states and RNG
    events = [json.loads(line) for line in (tmp_path / "torchrun" / "metrics.jsonl").open()]
    assert [e["event"] for e in events] == ["round"] * simulated.rounds + ["final"]
    assert events[-1]["val_loss"] == pytest.approx(simulated.val_loss, rel=1e-4)
    # the outer step's collectives (P = 2 ranks, V = 2 workers each): one ring all-reduce of the
    # float32 deltas, 2 (P-1)/P N 4 bytes per rank, against (P-1) V N 4 for gathering them all
    model_bytes = 4 * sum(p.numel() for p in distributed.values())
    assert events[0]["comm_plan"] == "all-reduce"
    assert events[0]["comm_bytes_sent"] == model_bytes
    assert events[0]["comm_bytes_naive"] == 2 * model_bytes
    latest = tmp_path / "torchrun" / "checkpoints" / "round-000003"
    manifest = json.loads((latest / "manifest.json").read_text())["files"]
    assert {f"worker-000{i}.pt" for i in range(4)} | {"rng-rank-0000.pt", "rng-rank-0001.pt"} <= (
        set(manifest)
    )


def test_workers_must_split_evenly_over_processes(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="3 workers cannot be split evenly over 2 processes"):
        TorchrunWorkers(3, torch.device("cpu"), timeout=10)


@pytest.mark.slow
def test_torchrun_with_bf16_compression(corpus, tmp_path):
    """--compression bf16 halves what the outer step sends and stays close to the exact run."""
    run_torchrun(tmp_path / "bf16", corpus, "--preset=isoloco", "--compression=bf16")
    config = resolve_config(None, **FLAGS, preset="isoloco", data=corpus, out=str(tmp_path / "sim"))
    train(config, progress=False)
    compressed = final_params(tmp_path / "bf16")
    exact = final_params(tmp_path / "sim")
    model_bytes = 4 * sum(p.numel() for p in exact.values())
    event = json.loads((tmp_path / "bf16" / "metrics.jsonl").open().readline())
    assert event["comm_bytes_sent"] < 0.55 * model_bytes  # 2-byte payloads (+ a few scalars)
    changed = 0
    for name, param in exact.items():
        changed += not torch.equal(compressed[name], param)
        assert torch.linalg.norm(compressed[name] - param) <= 1e-2 * torch.linalg.norm(param)
    assert changed > 0  # the compression did act


@pytest.mark.slow
def test_a_torchrun_checkpoint_resumes_in_one_process_with_a_note(corpus, tmp_path):
    """Stopped under torchrun (2 processes) after round 2, resumed by plain ``mloco train
    --resume``: the run says the checkpoint had another number of processes, and ends where the
    simulated uninterrupted run ends, to float rounding."""
    out = tmp_path / "run"
    run_torchrun(out, corpus, "--preset=diloco", "--checkpoint-every=1", "--stop-after=2")
    assert not (out / "final").exists()
    resumed = run_launch(
        [sys.executable, "-m", "mergekit_loco", "train", f"--out={out}", "--resume",
         f"--data={corpus}"],
        {**os.environ, "OMP_NUM_THREADS": "1"}, guard_s=400,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "note: the checkpoint was written by 2 process(es) and this run has 1: it continues "
        "correctly, but its sums run in another order"
    ) in resumed.stderr
    config = resolve_config(None, **FLAGS, preset="diloco", data=corpus, out=str(tmp_path / "sim"))
    train(config, progress=False)
    expected = final_params(tmp_path / "sim")
    for name, param in final_params(out).items():
        torch.testing.assert_close(param, expected[name], rtol=1e-4, atol=1e-6)


def gpt2_config(folder: Path, dropout: float | None = None) -> Path:
    """A GPT-2 config file: its default dropout, or ``dropout`` everywhere."""
    path = folder / ("gpt2.json" if dropout is None else f"gpt2-dropout-{dropout}.json")
    rates = {} if dropout is None else dict.fromkeys(("embd_pdrop", "attn_pdrop", "resid_pdrop"),
                                                     dropout)  # fmt: skip
    path.write_text(json.dumps({**GPT2, **rates}))
    return path


def simulated_cli(out: Path, corpus: str, *extra: str, options: dict = FLAGS) -> None:
    """``mloco train`` in this process, as a user types it."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
    with pytest.raises(SystemExit) as exited:
        main(["train", *flags, f"--data={corpus}", f"--out={out}", "--quiet", *extra])
    assert exited.value.code == 0


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["isoloco", "dp"])
def test_dropout_masks_follow_the_worker_not_the_process(corpus, tmp_path, preset):
    """GPT-2 with dropout, R = 4: 2 torchrun processes reach the simulated run's parameters
    (each worker's masks come from (seed, round, worker), in dp from (seed, round, worker,
    step), not from its process's RNG), while the same run without dropout ends elsewhere (the
    dropout did act)."""
    options = {**FLAGS, "model": gpt2_config(tmp_path)}
    run_torchrun(tmp_path / "torchrun", corpus, f"--preset={preset}", options=options)
    simulated_cli(tmp_path / "sim", corpus, f"--preset={preset}", options=options)
    plain_options = {**FLAGS, "model": gpt2_config(tmp_path, dropout=0.0)}
    simulated_cli(tmp_path / "plain", corpus, f"--preset={preset}", options=plain_options)
    distributed, simulated = weights(tmp_path / "torchrun"), weights(tmp_path / "sim")
    plain = weights(tmp_path / "plain")
    assert distributed.keys() == simulated.keys() == plain.keys()
    for name, param in simulated.items():
        torch.testing.assert_close(distributed[name], param, rtol=1e-4, atol=1e-6)
    gap = max((simulated[n] - plain[n]).abs().max().item() for n in simulated)
    assert gap > 1e-3


@pytest.mark.slow
def test_a_resumed_dropout_run_equals_an_uninterrupted_one(corpus, tmp_path):
    """GPT-2 with dropout stopped after round 1 and resumed, in one process (the same bits) and
    under 2 torchrun processes (to float rounding): both end on the uninterrupted run."""
    options = {**FLAGS, "model": gpt2_config(tmp_path)}
    simulated_cli(tmp_path / "whole", corpus, "--preset=diloco", options=options)
    for out in (tmp_path / "resumed", tmp_path / "resumed-torchrun"):
        simulated_cli(out, corpus, "--preset=diloco", "--stop-after=1", options=options)
        assert not (out / "final").exists()
    simulated_cli(tmp_path / "resumed", corpus, "--resume", options={})
    run_torchrun(tmp_path / "resumed-torchrun", corpus, "--resume", options={})
    whole = weights(tmp_path / "whole")
    for name, param in weights(tmp_path / "resumed").items():
        assert torch.equal(param, whole[name]), name
    for name, param in weights(tmp_path / "resumed-torchrun").items():
        torch.testing.assert_close(param, whole[name], rtol=1e-4, atol=1e-6)


def test_a_failed_outer_step_collective_names_the_configured_timeout(monkeypatch):
    """The outer step's collectives name the ``--timeout`` mloco gave ``init_process_group``
    (before: "the one given to init_process_group" while docs/reliability.md showed 20 s)."""
    from mergekit_loco.dist import transport
    from mergekit_loco.dist.transport import CollectiveFailed, CommStats, Transport

    comm = Transport.__new__(Transport)  # no process group: only run()'s failure path is used
    comm.rank, comm.stats, comm.codec = (
        0,
        CommStats(),
        type("C", (), {"device": torch.device("cpu")}),
    )

    def dead_peer():
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(transport, "group_timeout_s", 20.0)
    with pytest.raises(CollectiveFailed, match=r"\(collective timeout: 20 s\)"):
        comm.run("all_reduce", 0, dead_peer)
    transport.note_group_timeout(None)
    with pytest.raises(CollectiveFailed, match="the one given to init_process_group"):
        comm.run("all_reduce", 0, dead_peer)
