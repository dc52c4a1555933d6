"""A real torchrun (2 processes, gloo) with R = 4 equals the simulated R = 4 run."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import stdlib_corpus
from transformers import LlamaForCausalLM

from mergekit_loco.train.config import resolve_config
from mergekit_loco.train.loop import train
from mergekit_loco.train.workers import TorchrunWorkers

CORPUS_FILES = ("textwrap.py", "string.py", "json/decoder.py", "csv.py", "heapq.py", "shlex.py")
FLAGS = {
    "model": "micro", "workers": 4, "inner_steps": 2, "global_batch": 8, "seq_len": 32,
    "tokens": 1536, "vocab_size": 512, "val_tokens": 1024, "device": "cpu",
}  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Iterator[str]:
    with stdlib_corpus(tmp_path_factory.mktemp("corpus"), CORPUS_FILES) as corpus:
        yield corpus


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def final_params(out: Path) -> dict[str, torch.Tensor]:
    model = LlamaForCausalLM.from_pretrained(out / "final")
    return {name: p.detach() for name, p in model.named_parameters()}


def run_torchrun(out: Path, corpus: str, *extra: str) -> None:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FLAGS.items()]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        "-m", "mergekit_loco", "train", *flags, f"--data={corpus}", f"--out={out}",
        "--quiet", "--timeout=120", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launched = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
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
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    resumed = subprocess.run(
        [sys.executable, "-m", "mergekit_loco", "train", f"--out={out}", "--resume",
         f"--data={corpus}"],
        env=env, capture_output=True, text=True, timeout=400,
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
