"""Faults injected into real training runs, and what the user sees and keeps (docs/reliability.md).

Dead and hung torchrun peers, signals, a checkpoint write killed half-way, corrupt checkpoints,
divergence, a data shard that runs short, inconsistent configs and config changes on resume.
Processes are real where the fault is about processes; ``MLOCO_FAULT_AT=RANK:ROUND:TURN:SIGNAL``
(tests/fault_hook.py, run through tests/fault_launcher.py) makes a process signal itself at the
same point of the run every time.
Every run is the micro model, R = 4, H = 2, 8 x 32 tokens a step: 4 rounds of 512 tokens.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path

import hostile
import launches
import pytest
import torch
from conftest import stdlib_corpus
from fault_hook import FAULT_ENV, install
from hostile import snapshot
from launches import GUARD_S, Finished, alive_in_launch, finish, free_port, kill_launch
from safetensors.torch import load_file

from mergekit_loco.cli import main
from mergekit_loco.dist import CollectiveFailed
from mergekit_loco.io.atomic import LOCK_FILE
from mergekit_loco.train import loop, run
from mergekit_loco.train import rounds as turns
from mergekit_loco.train.checkpoint import CheckpointCorrupt, latest_checkpoint
from mergekit_loco.train.config import resolve_config
from mergekit_loco.train.data import DataExhausted
from mergekit_loco.train.diloco import DiLoCo
from mergekit_loco.train.guards import naming_the_last_checkpoint
from mergekit_loco.train.loop import TrainingDiverged, TrainingFailed, TrainingInterrupted, train

CORPUS_FILES = ("textwrap.py", "string.py", "json/decoder.py", "csv.py", "heapq.py", "shlex.py")
TINY = dict(
    model="micro", workers=4, inner_steps=2, global_batch=8, seq_len=32, tokens=2048,
    vocab_size=512, val_tokens=1024, device="cpu",
)  # fmt: skip
TORCHRUN_TIMEOUT_S = 20
HANG_TIMEOUT_S = 10
ONE_LINE_ERROR = re.compile(r"error: [^\n]+\n")
#: ``mloco`` with the fault of MLOCO_FAULT_AT installed
LAUNCHER = str(Path(__file__).with_name("fault_launcher.py"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Iterator[str]:
    """Six stdlib modules (37k tokens), no fault hook armed."""
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(FAULT_ENV, raising=False)
        with stdlib_corpus(tmp_path_factory.mktemp("corpus"), CORPUS_FILES) as corpus:
            yield corpus


def tiny_config(corpus: str, out: Path, **overrides):
    return resolve_config(None, **{**TINY, "data": corpus, "out": str(out), **overrides})


def cli_flags(corpus: str, out: Path) -> list[str]:
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in TINY.items()]
    return [*flags, f"--data={corpus}", f"--out={out}", "--quiet"]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The uninterrupted run every recovered run must reproduce (DiLoCo: mean + Nesterov)."""
    return train(tiny_config(corpus, tmp_path_factory.mktemp("reference")), progress=False)


@pytest.fixture(scope="module")
def stopped_run(corpus, tmp_path_factory) -> Path:
    """The same run stopped after round 2, checkpoints after rounds 1 and 2 (copy before use)."""
    out = tmp_path_factory.mktemp("stopped")
    config = tiny_config(corpus, out, checkpoint_every=1, stop_after=2)
    assert not train(config, progress=False).finished
    return out


def final_params(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def rounds_logged(out: Path) -> list[int]:
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [event["round"] for event in events if event["event"] == "round"]


def final_checksum(out: Path) -> str:
    """The parameter checksum of the run's final line in ``metrics.jsonl``."""
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["checksum"]


def checkpoint_names(out: Path) -> list[str]:
    return sorted(path.name for path in (out / "checkpoints").iterdir())


# -- real processes ------------------------------------------------------------------------------
def launch(command: list[str], fault: str | None = None, **env: str) -> subprocess.Popen:
    """:func:`launches.launch` of ``command`` with ``fault`` as the hook (none by default) and
    ``env`` added to this process's environment."""
    environment = {**os.environ, **env}
    environment.pop(FAULT_ENV, None)
    if fault is not None:
        environment[FAULT_ENV] = fault
    return launches.launch(command, environment)


def run_to_end(
    command: list[str], fault: str | None = None, **env: str
) -> tuple[Finished, list[int]]:
    """Run ``command`` (:func:`launch`) until it exits; then the PIDs of its launch still alive,
    before they are killed."""
    process = launch(command, fault, **env)
    try:
        finished = finish(process)
        return finished, alive_in_launch(finished.launch)
    finally:
        kill_launch(process)


def run_cli(args: list[str], fault: str | None = None) -> Finished:
    return run_to_end([sys.executable, LAUNCHER, "train", *args], fault)[0]


def torchrun_train() -> list[str]:
    """``torchrun --nproc_per_node 2`` of ``mloco train --timeout=TORCHRUN_TIMEOUT_S`` (with the
    fault hook) on a free local port; the train flags follow."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        LAUNCHER, "train", f"--timeout={TORCHRUN_TIMEOUT_S}",
    ]  # fmt: skip


# -- a dead or hung peer -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("dead", [1, 0])
def test_killed_torchrun_worker_fails_the_run_fast_and_resume_matches(
    corpus, tmp_path, reference, dead
):
    """SIGKILL rank 1 (or rank 0, which under torchrun hosts no store: the agent does) before
    its second worker turn of round 3 (checkpoints after rounds 1, 2): torchrun reports the dead
    worker and fails; every process is gone within --timeout of the last checkpoint;
    ``--resume`` under torchrun ends where the uninterrupted run ends."""
    out = tmp_path / "run"
    alive = 1 - dead
    flags = [*cli_flags(corpus, out), "--checkpoint-every=1", "--keep-checkpoints=2"]
    killed, leftovers = run_to_end([*torchrun_train(), *flags], f"{dead}:3:2:KILL")
    assert leftovers == [], f"processes left running: {leftovers}"
    assert killed.returncode != 0
    root_cause = killed.stderr.split("Root Cause", 1)[-1]
    assert re.search(rf"rank\s+: {dead} .*\n\s+exitcode\s+: -9 .*SIGKILL", root_cause), (
        killed.stderr
    )
    assert killed.stderr.count("Traceback") == 1  # torchrun's own ChildFailedError, no worker's
    assert checkpoint_names(out) == ["latest", "round-000001", "round-000002"]
    last_checkpoint = out / "checkpoints" / "round-000002"
    assert killed.ended - last_checkpoint.stat().st_mtime < TORCHRUN_TIMEOUT_S
    # the survivor either said why in one line, or torchrun stopped it first (SIGTERM)
    survivor = re.search(rf"error: round 3: rank {alive} of 2: [\w-]+ failed after ([\d.]+) s;.*",
                         killed.stderr)  # fmt: skip
    if survivor:
        assert float(survivor[1]) < TORCHRUN_TIMEOUT_S
        assert survivor[0].endswith(
            f"The last good checkpoint is {last_checkpoint} (after round 2). Restart every "
            "process with --resume to continue from it."
        )
    else:
        assert re.search(rf"rank\s+: {alive} .*\n\s+exitcode\s+: -15 ", killed.stderr), (
            killed.stderr
        )

    resumed, _ = run_to_end([*torchrun_train(), f"--out={out}", "--resume", "--quiet"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = final_params(reference.out)
    for name, tensor in final_params(out).items():  # torchrun = simulated up to float rounding
        torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-6)
    assert rounds_logged(out) == [1, 2, 3, 4]


def test_a_checkpoint_file_only_one_rank_reads_stops_every_rank(corpus, tmp_path):
    """A torchrun run stopped after round 2, then rank 1's own worker file (worker-0003.pt,
    which rank 0 never reads) damaged: on --resume rank 1 refuses it in one line naming the
    file, rank 0's next collective fails at once (its peer is gone) in one line too, unless
    torchrun stops it first, and every process of the launch ends; nothing is trained."""
    out = tmp_path / "run"
    stopped, _ = run_to_end([*torchrun_train(), *cli_flags(corpus, out), "--checkpoint-every=1",
                             "--stop-after=2"])  # fmt: skip
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    damaged = out / "checkpoints" / "round-000002" / "worker-0003.pt"
    damaged.write_bytes(damaged.read_bytes() + b"garbage")
    resumed, leftovers = run_to_end([*torchrun_train(), f"--out={out}", "--resume", "--quiet"])
    assert leftovers == [], f"processes left running: {leftovers}"
    assert resumed.returncode != 0
    assert (
        f"error: checkpoint file {damaged} is corrupt (sha256 differs from manifest.json); this "
        "is the only checkpoint: start over with --force instead of --resume\n"
    ) in resumed.stderr
    # rank 0 said why in one line, at once (not after --timeout), or torchrun stopped it first
    said = re.search(r"(?m)^error: rank 0 of 2: [\w-]+ failed after ([\d.]+) s; a peer rank "
                     r"likely died", resumed.stderr)  # fmt: skip
    if said:
        assert float(said[1]) < TORCHRUN_TIMEOUT_S / 4
    else:
        assert re.search(r"rank\s+: 0 .*\n\s+exitcode\s+: -15 ", resumed.stderr), resumed.stderr
    assert resumed.stderr.count("Traceback") == 1  # torchrun's own ChildFailedError, no worker's
    assert rounds_logged(out) == [1, 2]


def test_out_of_memory_in_one_torchrun_worker_says_to_restart_every_process(corpus, tmp_path):
    """torch.OutOfMemoryError in rank 1's round 3 under torchrun (checkpoints after rounds 1,
    2): rank 1 exits with one line naming the error, the last good checkpoint and that every
    process restarts with --resume (a torchrun launch is restarted whole, not one rank); no
    worker prints a traceback; every process of the launch ends."""
    out = tmp_path / "run"
    flags = [*cli_flags(corpus, out), "--checkpoint-every=1"]
    failed, leftovers = run_to_end([*torchrun_train(), *flags], "1:3:1:OOM")
    assert leftovers == [], f"processes left running: {leftovers}"
    assert failed.returncode != 0
    assert (
        "error: round 3: OutOfMemoryError: out of memory (injected at rank 1); stopping. The last "
        f"good checkpoint is {out / 'checkpoints' / 'round-000002'} (after round 2). Restart "
        "every process with --resume to continue from it.\n"
    ) in failed.stderr
    assert failed.stderr.count("Traceback") == 1  # torchrun's own ChildFailedError, no worker's


@pytest.mark.slow
def test_sigterm_to_torchrun_ends_every_process_and_the_resume_matches(corpus, tmp_path):
    """SIGTERM to the torchrun agent mid-run (a scheduler's stop; the workers take the signal
    torchrun forwards, as a killed process does): every process ends within seconds, the last
    checkpoint stays good, and --resume under torchrun ends bit for bit where the same launch
    left alone ends, each round logged once."""
    out, rounds = tmp_path / "run", 60  # of the 65 the corpus holds
    tokens = rounds * TINY["global_batch"] * TINY["seq_len"] * TINY["inner_steps"]
    flags = [*cli_flags(corpus, out), f"--tokens={tokens}", "--checkpoint-every=1"]
    process = launch([*torchrun_train(), *flags])
    try:
        deadline = time.monotonic() + GUARD_S
        while not (out / "checkpoints" / "latest").exists() and time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()[1][-3000:]
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        sent = time.time()
        stopped = finish(process)
        leftovers = alive_in_launch(stopped.launch)
    finally:
        kill_launch(process)
    assert leftovers == [], f"processes left running: {leftovers}"
    assert stopped.returncode != 0 and stopped.ended - sent < 10
    assert len(rounds_logged(out)) < rounds, "the run finished before the signal: lengthen it"
    resumed, _ = run_to_end([*torchrun_train(), f"--out={out}", "--resume", "--quiet"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert rounds_logged(out) == list(range(1, rounds + 1))
    straight = tmp_path / "straight"  # the same launch, never stopped
    whole, _ = run_to_end([*torchrun_train(), *cli_flags(corpus, straight), f"--tokens={tokens}"])
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = final_params(straight)
    for name, tensor in final_params(out).items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.slow
def test_hung_peer_ends_the_other_within_the_timeout_in_one_line(corpus, tmp_path):
    """Two processes started as two nodes would be (RANK / WORLD_SIZE, no torchrun agent to
    clean up): rank 1 freezes (SIGSTOP) before the outer step of round 2. Rank 0 waits exactly
    --timeout in the outer step's collective, then exits 1 with one line naming the last good
    checkpoint."""
    out = tmp_path / "run"
    command = [sys.executable, LAUNCHER, "train", *cli_flags(corpus, out),
               "--checkpoint-every=1", f"--timeout={HANG_TIMEOUT_S}"]  # fmt: skip
    nodes = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    processes = [
        launch(command, "1:2:3:STOP", **nodes, RANK=str(rank), LOCAL_RANK=str(rank))
        for rank in (0, 1)
    ]
    try:
        survivor = finish(processes[0])
    finally:
        for process in processes:
            kill_launch(process)
    assert survivor.returncode == 1, survivor.stderr[-3000:]
    assert ONE_LINE_ERROR.fullmatch(survivor.stderr), survivor.stderr
    waited = re.search(r"failed after ([\d.]+) ?s", survivor.stderr)
    assert HANG_TIMEOUT_S - 0.5 < float(waited[1]) < HANG_TIMEOUT_S + 3
    assert survivor.stderr.startswith("error: round 2: rank 0")
    assert survivor.stderr.endswith(
        f"The last good checkpoint is {out / 'checkpoints' / 'round-000001'} (after round 1). "
        "Restart every process with --resume to continue from it.\n"
    )
    assert latest_checkpoint(out).name == "round-000001"


def test_a_peer_that_never_starts_ends_the_other_in_one_line(corpus, tmp_path):
    """One process started as rank 0 of two, rank 1 never launched: joining the process group
    times out after --timeout (the rendezvous's own wait), exit 1 with one line saying so;
    nothing trained."""
    out = tmp_path / "run"
    command = [sys.executable, LAUNCHER, "train", *cli_flags(corpus, out),
               f"--timeout={HANG_TIMEOUT_S}"]  # fmt: skip
    nodes = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    alone, _ = run_to_end(command, **nodes, RANK="0", LOCAL_RANK="0")
    assert alone.returncode == 1, alone.stderr[-3000:]
    assert ONE_LINE_ERROR.fullmatch(alone.stderr), alone.stderr
    waited = re.search(r"^error: rank 0 of 2: joining the process group failed after ([\d.]+) s; "
                       r"a peer rank likely died or hung, or is unreachable \(collective timeout: "
                       rf"{HANG_TIMEOUT_S} s\)\. Cause: ", alone.stderr)  # fmt: skip
    assert waited and HANG_TIMEOUT_S - 0.5 < float(waited[1]) < HANG_TIMEOUT_S + 3, alone.stderr
    assert latest_checkpoint(out) is None


@pytest.mark.parametrize("differs", ["option", "data"])
def test_processes_started_differently_are_refused_before_training(corpus, tmp_path, differs):
    """Two processes started as two nodes would be, one with another --outer-lr (before: both
    trained, each on its own settings, and ended with different parameters, exit 0), or with
    a --data folder whose content differs (before: each trained on its own tokens). Both exit 2
    with one line naming what differs; nothing is written."""
    out = tmp_path / "run"
    other = ["--outer-lr=0.5"]
    if differs == "data":
        changed = tmp_path / "changed"
        shutil.copytree(corpus, changed)
        first = sorted(p for p in changed.rglob("*.py"))[0]
        first.write_text(first.read_text() + "\n# one more line\n")
        other = [f"--data={changed}"]
    nodes = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    processes = [
        launch([sys.executable, LAUNCHER, "train", *cli_flags(corpus, out), "--timeout=60",
                *(other if rank else [])], **nodes, RANK=str(rank), LOCAL_RANK=str(rank))
        for rank in (0, 1)
    ]  # fmt: skip
    try:
        results = [finish(process) for process in processes]
    finally:
        for process in processes:
            kill_launch(process)
    expected = {
        "option": "error: --outer-lr differs between processes (rank 0: 0.7, rank 1: 0.5); "
        "start every process with the same options\n",
        "data": "error: the tokens of --data differ between processes",
    }[differs]
    for result in results:
        assert result.returncode == 2, result.stderr[-3000:]
        assert ONE_LINE_ERROR.fullmatch(result.stderr), result.stderr
        assert result.stderr.startswith(expected)
    assert not out.exists()


# -- signals on a single-process run -------------------------------------------------------------
def test_sigterm_mid_round_exits_130_naming_the_checkpoint_and_resume_is_exact(
    corpus, tmp_path, reference
):
    out = tmp_path / "run"
    stopped = run_cli([*cli_flags(corpus, out), "--checkpoint-every=1"], fault="0:3:2:TERM")
    assert stopped.returncode == 130
    assert stopped.stderr == (
        "error: interrupted during a round; --resume continues from "
        f"{out / 'checkpoints' / 'round-000002'} (after round 2)\n"
    )
    resumed = train(resolve_config(None, out=str(out), resume=True), progress=False)
    assert resumed.checksum == reference.checksum
    assert rounds_logged(out) == [1, 2, 3, 4]


def test_signal_between_rounds_first_checkpoints_the_completed_round(
    corpus, tmp_path, reference, monkeypatch
):
    """SIGTERM right after round 2's outer step, with no periodic checkpoints: the run writes
    round 2's checkpoint before it stops, and resuming from it is exact."""
    real_check = loop.check_not_exploded

    def check_then_sigterm(norm_before: float, norm_after: float, round_number: int) -> None:
        real_check(norm_before, norm_after, round_number)
        if round_number == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(loop, "check_not_exploded", check_then_sigterm)
    config = tiny_config(corpus, tmp_path)
    with pytest.raises(TrainingInterrupted) as stopped:
        train(config, progress=False)
    assert str(stopped.value) == (
        "interrupted after round 2; --resume continues from "
        f"{tmp_path / 'checkpoints' / 'round-000002'} (after round 2)"
    )
    assert checkpoint_names(tmp_path) == ["latest", "round-000002"]
    monkeypatch.setattr(loop, "check_not_exploded", real_check)
    assert train(config.replace(resume=True), progress=False).checksum == (reference.checksum)


@pytest.mark.parametrize(
    "when", ["before the final evaluation", "before the final model was written"]
)
def test_a_signal_after_the_last_round_still_stops_the_run(corpus, tmp_path, reference, monkeypatch,
                                                           when):  # fmt: skip
    """SIGTERM after the last round's outer step, or during the final evaluation: the run stops
    (exit 130 from the CLI) with the last round checkpointed, and --resume writes the final
    model the uninterrupted run wrote. Before: the signal was ignored, exit 0."""
    last = reference.rounds
    real_check, real_evaluate = loop.check_not_exploded, turns.evaluate

    def check_then_sigterm(norm_before: float, norm_after: float, round_number: int) -> None:
        real_check(norm_before, norm_after, round_number)
        if round_number == last and when == "before the final evaluation":
            os.kill(os.getpid(), signal.SIGTERM)

    def sigterm_in_the_final_evaluation(*args, **kwargs):
        if sys._getframe(1).f_code.co_name == "finish" and when != "before the final evaluation":
            os.kill(os.getpid(), signal.SIGTERM)
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(loop, "check_not_exploded", check_then_sigterm)
    monkeypatch.setattr(turns, "evaluate", sigterm_in_the_final_evaluation)
    config = tiny_config(corpus, tmp_path)
    with pytest.raises(TrainingInterrupted) as stopped:
        train(config, progress=False)
    checkpoint = tmp_path / "checkpoints" / f"round-{last:06d}"
    assert str(stopped.value) == (
        f"interrupted after round {last}, {when}; --resume continues from {checkpoint} "
        f"(after round {last})"
    )
    assert not (tmp_path / "final").exists()
    monkeypatch.undo()
    resumed = train(config.replace(resume=True), progress=False)
    assert resumed.finished and resumed.checksum == reference.checksum
    assert resumed.val_loss == reference.val_loss
    assert rounds_logged(tmp_path) == list(range(1, last + 1))


@pytest.mark.parametrize(("fault", "when"), [("INT", "during a round"), ("INT2", "at once")])
def test_ctrl_c_to_mloco_train_exits_130_naming_the_checkpoint_and_resumes_exactly(
    corpus, tmp_path, reference, fault, when
):
    """SIGINT to the ``mloco train`` process during round 2 (CKPT(1) written): it stops at the
    next inner step; a second SIGINT before then stops it at once. Either way exit 130, one
    line naming the checkpoint --resume continues from; that resume ends where the
    uninterrupted run ends."""
    flags = [*cli_flags(corpus, tmp_path), "--checkpoint-every=1"]
    stopped = run_cli(flags, f"0:2:1:{fault}")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert stopped.stderr == (
        f"error: interrupted {when}; --resume continues from "
        f"{tmp_path / 'checkpoints' / 'round-000001'} (after round 1)\n"
    )
    resumed = run_cli([f"--out={tmp_path}", "--resume", "--quiet"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert final_checksum(tmp_path) == reference.checksum
    assert rounds_logged(tmp_path) == [1, 2, 3, 4]


def test_signal_before_any_checkpoint_says_resume_is_impossible(corpus, tmp_path, monkeypatch):
    install("0:1:2:INT", monkeypatch)
    config = tiny_config(corpus, tmp_path)
    with pytest.raises(TrainingInterrupted) as stopped:
        train(config, progress=False)
    assert str(stopped.value) == (
        "interrupted during a round; no checkpoint was written yet, so --resume is not possible: "
        "run the same command without --resume to start over"
    )
    monkeypatch.undo()
    with pytest.raises(ValueError, match="nothing to resume: .* holds no checkpoint.*; run the "
                       "same command without --resume to start over"):  # fmt: skip
        train(config.replace(resume=True), progress=False)
    assert train(config, progress=False).finished  # starting again needs no --force


# -- two processes, one run folder ---------------------------------------------------------------
def process_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc (``T``: stopped, ``Z``: ended), ``gone`` if none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_run_that_finished_while_a_new_one_prepared_is_not_deleted(
    corpus, tmp_path, stopped_run, monkeypatch
):
    """A fresh run (no --force) checks --out, then prepares its data; meanwhile another run
    ends in that folder (here: copied in just before this one takes the lock). Once the lock is
    its own it checks again and is refused (before: it deleted the other run)."""
    out = tmp_path / "run"
    real_claim = run.claim_output

    def finished_meanwhile(*args, **kwargs):
        shutil.copytree(stopped_run, out, dirs_exist_ok=True)
        return real_claim(*args, **kwargs)

    monkeypatch.setattr(run, "claim_output", finished_meanwhile)
    with pytest.raises(ValueError, match=r"already holds a run \(metrics\.jsonl, checkpoints"):
        train(tiny_config(corpus, out), progress=False)
    assert snapshot(out) == snapshot(stopped_run)


def test_a_second_process_is_refused_a_run_folder_in_use(corpus, tmp_path, reference, capsys):
    """A run stopped (SIGSTOP) before round 2 with CKPT(1) written, and a second ``mloco train``
    into its folder, with --resume or --force (before: the resume trained rounds 2-4 beside the
    first, which then logged them again in metrics.jsonl, and one deleted the other's staging
    folder as a crashed save's leftover). The second exits 2 at once naming OUT and the first's
    PID and changes nothing; the first then finishes as if it had been alone."""
    out = tmp_path / "run"
    flags = [*cli_flags(corpus, out), "--checkpoint-every=1"]
    first = launch([sys.executable, LAUNCHER, "train", *flags], fault="0:2:1:STOP")
    try:
        deadline = time.monotonic() + GUARD_S
        while process_state(first.pid) != "T" and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()[1][-3000:]
            time.sleep(0.1)
        before = snapshot(out)
        for second in (["--out", str(out), "--resume", "--quiet"], [*flags, "--force"]):
            capsys.readouterr()
            with pytest.raises(SystemExit) as exited:
                main(["train", *second])
            assert exited.value.code == 2
            assert capsys.readouterr().err == (
                f"error: {out} is in use by another mloco process (PID {first.pid}) training "
                "into it; wait for it to finish or stop it, then run the same command again\n"
            )
        assert snapshot(out) == before
        first.send_signal(signal.SIGCONT)
        finished = finish(first)
    finally:
        kill_launch(first)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert rounds_logged(out) == [1, 2, 3, 4]
    final = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["checksum"] == reference.checksum


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_second_torchrun_launch_into_a_folder_in_use_is_refused_on_every_rank(corpus, tmp_path):
    """A torchrun launch whose rank 0 stopped itself (SIGSTOP) before round 2, CKPT(1) written;
    a second torchrun launch with --resume into the same folder: each of its ranks that gets
    that far (torchrun stops the other once one has exited) prints the same one line naming OUT
    and the PID of the first launch's rank 0 (the lock holder), and no other error; nothing in
    OUT changes."""
    out = tmp_path / "run"
    command = [*torchrun_train(), *cli_flags(corpus, out), "--checkpoint-every=1"]
    command[command.index(f"--timeout={TORCHRUN_TIMEOUT_S}")] = "--timeout=600"  # rank 1 waits
    first = launch(command, fault="0:2:1:STOP")
    try:
        deadline = time.monotonic() + GUARD_S
        holder = None
        while time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()[1][-3000:]
            text = (out / LOCK_FILE).read_text().strip() if (out / LOCK_FILE).exists() else ""
            if text.isdigit() and process_state(int(text)) == "T":
                holder = int(text)
                break
            time.sleep(0.1)
        assert holder is not None, "the first launch's rank 0 never stopped"
        assert os.getsid(holder) != os.getsid(first.pid)  # torchrun's own session for the rank
        assert holder in alive_in_launch(first.launch)  # which the launch's tag still finds
        before = snapshot(out)
        second, leftovers = run_to_end([*torchrun_train(), f"--out={out}", "--resume", "--quiet"])
        assert leftovers == []
        assert second.returncode != 0
        refusal = (
            f"error: {out} is in use by another mloco process (PID {holder}) training into it; "
            "wait for it to finish or stop it, then run the same command again\n"
        )
        # each rank is refused on its own, but once one has exited torchrun stops the other,
        # which may not have printed yet: one or two refusals, and no other error
        errors = re.findall(r"(?m)^error: .*\n", second.stderr)
        assert errors and set(errors) == {refusal}, second.stderr[-3000:]
        assert snapshot(out) == before
    finally:
        kill_launch(first)
    deadline = time.monotonic() + 10  # SIGKILL ends even the stopped rank (before: it lived on)
    while alive_in_launch(first.launch) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive_in_launch(first.launch) == []


# -- checkpoints ---------------------------------------------------------------------------------
KILLED_WHILE_SAVING = """
import os, signal, sys
from pathlib import Path
from mergekit_loco.train import checkpoint
from mergekit_loco.train.config import resolve_config
from mergekit_loco.train.loop import train

def save_half_then_die(tensors, path):  # round 2's global.safetensors: half written, SIGKILL
    checkpoint_save_file(tensors, path)
    if "round-000002" in str(path):
        Path(path).write_bytes(Path(path).read_bytes()[: Path(path).stat().st_size // 2])
        os.kill(os.getpid(), signal.SIGKILL)

checkpoint_save_file, checkpoint.save_file = checkpoint.save_file, save_half_then_die
train(resolve_config(None, **__import__("json").loads(sys.argv[1])), progress=False)
"""


def test_checkpoint_write_killed_half_way_keeps_the_previous_one(corpus, tmp_path, reference):
    config = {**TINY, "data": corpus, "out": str(tmp_path), "checkpoint_every": 1}
    process = launch([sys.executable, "-c", KILLED_WHILE_SAVING, json.dumps(config)])
    try:
        killed = finish(process)
    finally:
        kill_launch(process)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert latest_checkpoint(tmp_path).name == "round-000001"
    (staging,) = (tmp_path / "checkpoints").glob(".round-000002.tmp-*")
    assert not (staging / "manifest.json").exists()
    assert not (tmp_path / "checkpoints" / "round-000002").exists()
    assert (tmp_path / ".mloco-lock").read_text() == f"{process.pid}\n"  # unheld: it died

    resumed = train(resolve_config(None, out=str(tmp_path), resume=True), progress=False)
    assert resumed.checksum == reference.checksum
    assert not staging.exists()  # the next save cleared what the crash left
    assert rounds_logged(tmp_path) == [1, 2, 3, 4]


def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("flip round-000002/state.json", r"checkpoint file {ckpt}/state\.json is corrupt \(sha256 "
         r"differs from manifest\.json\); this is the only checkpoint: start over with --force "
         r"instead of --resume$"),
        ("flip round-000002/worker-0003.pt", r"checkpoint file {ckpt}/worker-0003\.pt is corrupt"),
        ("cut round-000002/manifest.json", r"checkpoint {ckpt}: unreadable manifest\.json \(.+\); "
         r"this is the only checkpoint: start over with --force instead of --resume$"),
        ("empty round-000002/manifest.json", r"checkpoint {ckpt}: unreadable manifest\.json "
         r"\(.+\); this is the only checkpoint"),
        ("delete round-000002/shared.pt", r"checkpoint file {ckpt}/shared\.pt is missing; this is "
         r"the only checkpoint: start over with --force instead of --resume$"),
        ("keep round-000001, flip round-000002/shared.pt", r"checkpoint file {ckpt}/shared\.pt "
         r"is corrupt \(.+\); delete this checkpoint folder to resume from round-000001, the "
         r"one before$"),
    ],
    ids=["state-flipped", "worker-file-flipped", "manifest-cut", "manifest-empty",
         "shared-deleted", "earlier-checkpoint-kept"],
)  # fmt: skip
def test_damaged_checkpoint_is_named_in_one_line_exit_2(stopped_run, tmp_path, capsys, damage,
                                                        message):  # fmt: skip
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    if damage.startswith("keep "):  # as --keep-checkpoints 2 would have: round 1 beside round 2
        kept, damage = damage.removeprefix("keep ").split(", ")
        shutil.copytree(run / "checkpoints" / "round-000002", run / "checkpoints" / kept)
    action, target = damage.split(" ", 1)[0], damage.rsplit(" ", 1)[-1]
    path = run / "checkpoints" / target
    if action == "flip":
        flip_middle_byte(path)
    elif action == "cut":
        path.write_text(path.read_text()[:40])
    elif action == "empty":
        path.write_text("")
    else:
        path.unlink()
    metrics_before = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(SystemExit) as exited:
        main(["train", "--out", str(run), "--resume", "--quiet"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    root = run / "checkpoints"
    expected = message.format(ckpt=re.escape(str(root / "round-000002")), root=re.escape(str(root)))
    assert ONE_LINE_ERROR.fullmatch(error) and re.search(expected, error), error
    assert (run / "metrics.jsonl").read_bytes() == metrics_before


def test_corrupt_checkpoint_python_api_raises_checkpoint_corrupt(stopped_run, tmp_path):
    shutil.copytree(stopped_run, tmp_path / "run")
    flip_middle_byte(tmp_path / "run" / "checkpoints" / "round-000002" / "shared.pt")
    with pytest.raises(CheckpointCorrupt, match=r"round-000002/shared\.pt is corrupt"):
        train(resolve_config(None, out=str(tmp_path / "run"), resume=True), progress=False)


# -- divergence ----------------------------------------------------------------------------------
def scaled_turns(monkeypatch, round_number: int, scale: float) -> None:
    """Multiply every worker delta of round ``round_number`` by ``scale``."""
    real_delta = DiLoCo.local_delta

    def local_delta(driver):
        delta = real_delta(driver)
        return delta * scale if driver.outer_steps + 1 == round_number else delta

    monkeypatch.setattr(DiLoCo, "local_delta", local_delta)


def test_exploding_pseudo_gradient_stops_before_its_round_is_saved(
    corpus, tmp_path, reference, monkeypatch
):
    """Round 3's deltas x 1e6: the run stops at round 3; round 2's checkpoint is current and
    good: resuming from it (without the fault) ends where the uninterrupted run ends."""
    scaled_turns(monkeypatch, round_number=3, scale=1e6)
    config = tiny_config(corpus, tmp_path, checkpoint_every=1)
    with pytest.raises(TrainingDiverged) as diverged:
        train(config, progress=False)
    assert re.fullmatch(
        r"round 3: the global parameters exploded \(L2 norm [\d.]+ -> [\d.e+]+, more than 1000x "
        r"in one round\); lower --inner-lr or --outer-lr; stopping\. The last good checkpoint is "
        rf"{re.escape(str(tmp_path / 'checkpoints' / 'round-000002'))} \(after round 2\)\.",
        str(diverged.value),
    )
    assert latest_checkpoint(tmp_path).name == "round-000002"
    assert rounds_logged(tmp_path) == [1, 2]
    monkeypatch.undo()
    assert train(config.replace(resume=True), progress=False).checksum == (reference.checksum)


def test_non_finite_pseudo_gradient_keeps_the_last_checkpoint(corpus, tmp_path, monkeypatch):
    scaled_turns(monkeypatch, round_number=2, scale=float("inf"))
    with pytest.raises(TrainingDiverged, match=r"^round 2: .*non-finite.*round-000001"):
        train(tiny_config(corpus, tmp_path, checkpoint_every=1), progress=False)
    assert latest_checkpoint(tmp_path).name == "round-000001"


def test_an_svd_that_does_not_converge_stops_as_divergence(corpus, tmp_path, monkeypatch):
    """torch.linalg.LinAlgError in round 2 (an aggregator's SVD; before: a raw traceback from
    ``mloco train``) is TrainingDiverged naming it and CKPT(1): a compare cell still records it
    as failed."""
    real_delta = DiLoCo.local_delta

    def local_delta(driver):
        if driver.outer_steps + 1 == 2:
            raise torch.linalg.LinAlgError("linalg.svd: failed to converge")
        return real_delta(driver)

    monkeypatch.setattr(DiLoCo, "local_delta", local_delta)
    diverged = r"^round 2: LinAlgError: linalg.svd: failed to converge; stopping\. The last good"
    with pytest.raises(TrainingDiverged, match=diverged + r" checkpoint is .*round-000001"):
        train(tiny_config(corpus, tmp_path, checkpoint_every=1), progress=False)


def test_data_parallel_blow_up_stops_in_round_one_with_nothing_saved(corpus, tmp_path):
    """No patch: AdamW at lr 1e6 (data-parallel) multiplies the norm by ~1e12 in one round."""
    with pytest.raises(TrainingDiverged, match=r"^round 1: the global parameters exploded.*"
                       r"No checkpoint was written before it\.$"):  # fmt: skip
        train(tiny_config(corpus, tmp_path, preset="dp", inner_lr=1e6, checkpoint_every=1),
              progress=False)  # fmt: skip
    assert not (tmp_path / "checkpoints").exists()


def test_cli_divergence_exits_1_in_one_line(corpus, tmp_path):
    diverged = run_cli([*cli_flags(corpus, tmp_path), "--inner-lr=1e6", "--checkpoint-every=1"])
    assert diverged.returncode == 1
    assert ONE_LINE_ERROR.fullmatch(diverged.stderr), diverged.stderr
    assert diverged.stderr.startswith("error: round 1: the global parameters exploded")
    assert diverged.stderr.endswith("No checkpoint was written before it.\n")
    with pytest.raises(TrainingDiverged, match=r"^round 1: the global parameters exploded"):
        main(
            ["train", *cli_flags(corpus, tmp_path), "--inner-lr=1e6", "--force", "--debug"]
        )  # traceback


# -- any other failure ---------------------------------------------------------------------------
def failing_turns(monkeypatch, round_number: int, error: Exception) -> None:
    """Raise ``error`` from every worker turn of round ``round_number``."""
    real_turn = turns.worker_turn

    def worker_turn(model, worker, config, round_index, *rest):
        if round_index + 1 == round_number:
            raise error
        return real_turn(model, worker, config, round_index, *rest)

    monkeypatch.setattr(turns, "worker_turn", worker_turn)


def test_out_of_memory_mid_round_names_the_checkpoint_and_resume_is_exact(
    corpus, tmp_path, reference, capsys, monkeypatch
):
    """torch.OutOfMemoryError in round 3 (before: a raw traceback, no word of the checkpoint):
    exit 1, one line naming the error, CKPT(2) and --resume; --debug raises it with the error as
    the cause; the resume the line advises ends where the uninterrupted run ends."""
    out = tmp_path / "run"
    flags = [*cli_flags(corpus, out), "--checkpoint-every=1"]
    failing_turns(monkeypatch, 3, torch.OutOfMemoryError("CUDA out of memory. Tried 2.00 GiB"))
    code, err, _ = hostile.run_cli(capsys, "train", *flags)
    assert code == 1, err
    assert err == (
        "error: round 3: OutOfMemoryError: CUDA out of memory. Tried 2.00 GiB; stopping. The "
        f"last good checkpoint is {out / 'checkpoints' / 'round-000002'} (after round 2). Run "
        "the same command with --resume to continue from it.\n"
    )
    with pytest.raises(TrainingFailed) as raised:
        main(["train", *flags, "--resume", "--debug"])
    assert isinstance(raised.value.__cause__, torch.OutOfMemoryError)
    monkeypatch.undo()
    code, err, _ = hostile.run_cli(capsys, "train", *flags, "--resume")
    assert code == 0, err
    assert final_checksum(out) == reference.checksum
    assert rounds_logged(out) == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("round_number", "last_good"),
    [(3, "The last good checkpoint is {checkpoint} (after round 2)."), (1, "No checkpoint was "
     "written before it.")],
)  # fmt: skip
def test_a_compare_cell_out_of_memory_says_to_rerun_compare(
    corpus, tmp_path, capsys, monkeypatch, round_number, last_good
):
    """torch.OutOfMemoryError in a cell of mloco compare (before: train's advice, "the same
    command with --resume", an option compare does not take): exit 1, one line naming the
    cell, the round, the checkpoint, and that the same compare command goes on; it does, and
    the cell ends with the parameters of a cell that never failed."""
    cell = "diloco-R2-H2-s0"

    def compare(out: Path) -> list[str]:
        return ["compare", "--aggregators", "diloco", "--workers", "2", "--no-baseline",
                "--model", "micro", "--inner-steps", "2", "--global-batch", "8", "--seq-len",
                "32", "--vocab-size", "512", "--val-tokens", "1024", "--tokens", "2048",
                "--data", corpus, "--checkpoint-every", "1", "--seeds", "0,", "--jobs", "1",
                "--no-figures", "--quiet", "-o", str(out)]  # fmt: skip

    out = tmp_path / "cmp"
    failing_turns(monkeypatch, round_number, torch.OutOfMemoryError("CUDA out of memory"))
    code, err, _ = hostile.run_cli(capsys, *compare(out))
    assert code == 1, err
    checkpoint = out / "runs" / cell / "checkpoints" / "round-000002"
    then = "resumes from it" if round_number > 1 else "starts over"
    assert err == (
        f"error: cell {cell}: round {round_number}: OutOfMemoryError: CUDA out of memory; "
        f"stopping. {last_good.format(checkpoint=checkpoint)} Run the same compare command to go "
        f"on: finished cells are kept, this one {then}.\n"
    )
    monkeypatch.undo()
    code, err, _ = hostile.run_cli(capsys, *compare(out))
    assert code == 0, err
    code, err, _ = hostile.run_cli(capsys, *compare(tmp_path / "never-failed"))
    assert code == 0, err
    assert final_checksum(out / "runs" / cell) == final_checksum(
        tmp_path / "never-failed" / "runs" / cell
    )


def test_a_training_failure_survives_the_trip_from_a_cell_process():
    """A compare cell under --jobs 2 fails in its own process, and its TrainingFailed crosses to
    the sweep by pickle: a round trip (here, in one process) keeps the line and the fields."""
    failed = TrainingFailed("cell c: round 3: OSError: disk full", (2, Path("ck")), "Rerun.")
    back = pickle.loads(pickle.dumps(failed))
    assert (
        str(back)
        == str(failed)
        == (
            "cell c: round 3: OSError: disk full; stopping. The last good checkpoint is ck (after "
            "round 2). Rerun."
        )
    )
    assert (back.failure, back.last_saved, back.advice) == (
        failed.failure,
        (2, Path("ck")),
        "Rerun.",
    )


def test_a_full_disk_at_the_first_checkpoint_says_to_start_over(
    corpus, tmp_path, reference, capsys, monkeypatch
):
    """ENOSPC while round 2's checkpoint, the first, is written (before: exit 2 as bad input,
    no advice): exit 1, the one line says there is nothing to resume and how to start over,
    and that command trains the run."""

    def disk_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run, "save_checkpoint", disk_full)
    flags = [*cli_flags(corpus, tmp_path), "--checkpoint-every=2"]
    code, err, _ = hostile.run_cli(capsys, "train", *flags)
    assert code == 1, err
    assert err == (
        "error: after round 2: OSError: [Errno 28] No space left on device; stopping. No "
        "checkpoint was written before it. There is nothing to resume: run the same command "
        "with --force (and without --resume) to start over.\n"
    )
    monkeypatch.undo()
    code, err, _ = hostile.run_cli(capsys, "train", *flags, "--force")
    assert code == 0, err
    assert final_checksum(tmp_path) == reference.checksum


# -- data and config -----------------------------------------------------------------------------
def test_data_shard_that_runs_short_is_refused_before_any_step(corpus, tmp_path, monkeypatch):
    real_slice = run.worker_slice

    def short_third_slice(tokens, worker, workers, bounds):
        shard = real_slice(tokens, worker, workers, bounds)
        return shard[:-40] if worker == 2 else shard

    monkeypatch.setattr(run, "worker_slice", short_third_slice)
    with pytest.raises(DataExhausted, match="worker 2's data shard has 472 tokens left, the 4 "
                       "remaining rounds need 512"):  # fmt: skip
        train(tiny_config(corpus, tmp_path / "run"), progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workers=3"], "a global batch of 8 (--global-batch) is not divisible by 3 workers"),
        (["--workers=16"], "a global batch of 8 (--global-batch) is not divisible by 16 workers"),
        (["--inner-steps=0"], "--inner-steps must be >= 1, got 0"),
        (["--tokens=100"], "token budget 100 is less than one round"),
        (["--timeout=0"], "--timeout must be > 0, got 0.0"),
        (["--aggregator=tsv", "--workers=64", "--global-batch=64", "--tokens=4096"],
         "tsv: tensor"),
        (["--workers=1024", "--global-batch=1024", "--tokens=65536"],
         "65,536 requested (the run needs 65,536 training tokens: 1 rounds x 65,536); lower "
         "--global-batch, --seq-len or --inner-steps (one round needs more than there is) or "
         "--val-tokens, or give more data\n"),
        (["--tokens=4096000"], "(the run needs 4,096,000 training tokens: 8000 rounds x 512); "
         "lower the token budget (--tokens or --chinchilla) or --val-tokens, or give more data\n"),
        (["--val-tokens=100000000"], "fewer than the 100,000,000 validation tokens requested; "
         "lower --val-tokens or give more data\n"),
    ],
    ids=["batch-not-divisible-by-R", "R-above-batch", "H-zero", "budget-below-one-round",
         "timeout-zero", "tsv-R-above-rank", "R-needs-more-data", "budget-needs-more-data",
         "val-tokens-above-data"],
)  # fmt: skip
def test_inconsistent_config_is_one_line_exit_2_before_any_compute(
    corpus, tmp_path, capsys, flags, message
):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exited:
        main(["train", *cli_flags(corpus, out), *flags])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert ONE_LINE_ERROR.fullmatch(error) and message in error, error
    assert not out.exists()


def test_force_keeps_the_previous_run_until_the_new_one_can_start(
    corpus, stopped_run, tmp_path, capsys
):
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    too_many_workers = ["--workers=1024", "--global-batch=1024", "--tokens=65536"]
    with pytest.raises(SystemExit) as exited:
        main(["train", *cli_flags(corpus, run), "--force", *too_many_workers])
    assert exited.value.code == 2 and "65,536 requested" in capsys.readouterr().err
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before
    assert train(tiny_config(corpus, run, force=True), progress=False).finished
    assert checkpoint_names(run) == ["latest", "round-000004"]


def test_resume_with_another_config_is_refused_saying_what_differs(stopped_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    before = {name: (run / name).read_bytes() for name in ("config.json", "metrics.jsonl")}
    refused = run_cli(["--out", str(run), "--resume", "--aggregator=iso-c", "--eval-every=3"])
    assert refused.returncode == 2
    assert refused.stderr == (
        f"error: {run / 'checkpoints' / 'round-000002'} was written with another config "
        "(aggregator: 'mean' -> 'iso-c'); pass the same options, or "
        "--allow-config-change to resume anyway\n"
    )
    assert {name: (run / name).read_bytes() for name in before} == before

    allowed = resolve_config(None, out=str(run), resume=True, aggregator="iso-c",
                             allow_config_change=True)  # fmt: skip
    result = train(allowed, progress=False)
    assert result.finished and rounds_logged(run) == [1, 2, 3, 4]
    assert json.loads((run / "config.json").read_text())["aggregator"] == "iso-c"


def test_resume_without_config_json_says_the_defaults_were_compared(stopped_run, tmp_path):
    """A run folder that lost its config.json: the refusal says why the options differ (before:
    only "written with another config (model: 'micro' -> 'nano'; ...)")."""
    run = tmp_path / "run"
    shutil.copytree(stopped_run, run)
    (run / "config.json").unlink()
    refused = run_cli(["--out", str(run), "--resume"])
    assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1
    checkpoint = run / "checkpoints" / "round-000002"
    assert (
        f"({run / 'config.json'} is missing, so the options not given were the defaults; "
        f'{checkpoint / "state.json"} records the run\'s under "config")' in refused.stderr
    )


@pytest.mark.parametrize(
    ("saved", "logged"),
    [((0, None), False), ((0, None), True), ((2, Path("out/checkpoints/round-000002")), True)],
)
def test_a_failed_collective_advises_resume_only_when_a_checkpoint_exists(saved, logged, tmp_path):
    """Without a checkpoint: start over, with --force once the run folder holds metrics."""
    if logged:
        (tmp_path / "metrics.jsonl").write_text("")
    position = types.SimpleNamespace(round_number=3, last_saved=saved, distributed=True,
                                     out=tmp_path)  # fmt: skip
    with pytest.raises(CollectiveFailed) as raised:
        with naming_the_last_checkpoint(position):
            raise CollectiveFailed("rank 0 of 2: all-reduce failed after 1.0 s")
    if saved[1] is None:
        advice = ("No checkpoint was written before it. Restart every process without --resume "
                  f"(there is nothing to resume{'; with --force' if logged else ''}).")  # fmt: skip
    else:
        advice = (f"The last good checkpoint is {saved[1]} (after round 2). Restart every "
                  "process with --resume to continue from it.")  # fmt: skip
    assert str(raised.value) == f"round 3: rank 0 of 2: all-reduce failed after 1.0 s. {advice}"
