"""Resuming into a hostile run folder: a ``checkpoints/`` symlinked elsewhere, user folders that
merely look like checkpoints, a tampered ``state.json`` round, a cache inside the data. The run
refuses with one line and exit 2, or deletes only what it wrote; the user's files survive."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import stdlib_corpus
from hostile import TRAIN, assert_refused, run_cli, snapshot
from safetensors.torch import load_file

from mergekit_loco.io.atomic import OWNER_MARKER, OutputRefused, mark_output
from mergekit_loco.train.checkpoint import Checkpoint, save_checkpoint
from mergekit_loco.train.model import MODEL_PRESETS
from mergekit_loco.train.workers import SimulatedWorkers


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    files = ["json/decoder.py", "json/encoder.py", "textwrap.py", "string.py"]
    with stdlib_corpus(tmp_path_factory.mktemp("resume"), files) as folder:
        yield folder


def user_folder(parent: Path, name: str) -> Path:
    """A folder of the user's, with a file in it."""
    (parent / name).mkdir(parents=True)
    (parent / name / "notes.txt").write_text("mine\n")
    return parent / name / "notes.txt"


def test_resume_refuses_a_symlinked_checkpoints_folder(capsys, tmp_path, corpus, stopped):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    elsewhere = tmp_path / "elsewhere"
    kept = [user_folder(elsewhere, "round-0-my-thesis"), user_folder(elsewhere, "backup.tmp-2024")]
    for entry in (run / "checkpoints").iterdir():
        shutil.move(entry, elsewhere / entry.name)
    (run / "checkpoints").rmdir()
    (run / "checkpoints").symlink_to("../elsewhere")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}", "--resume")
    assert_refused(code, err, str(run / "checkpoints"), "is a symlink or leads outside")
    assert all(file.read_text() == "mine\n" for file in kept)
    assert snapshot(tmp_path) == before


def test_save_refuses_a_symlinked_checkpoints_folder(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    kept = user_folder(elsewhere, "round-000001")
    mark_output(kept.parent, "checkpoint")  # even a folder that looks like ours is left alone
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(elsewhere)
    state = Checkpoint(round=3, config={}, global_params={"w": torch.ones(2)}, shared=None,
                       workers={0: {"data": {"position": 0}}})  # fmt: skip
    before = snapshot(elsewhere)
    with pytest.raises(OutputRefused, match="checkpoints: the checkpoints folder is a symlink"):
        save_checkpoint(tmp_path / "run", state, SimulatedWorkers(1, torch.device("cpu")), keep=0)
    assert snapshot(elsewhere) == before


def test_resume_deletes_only_checkpoint_folders_it_wrote(capsys, tmp_path, corpus, stopped):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    root = run / "checkpoints"
    kept = [
        user_folder(root, "round-000000x"),  # a name mloco never writes
        user_folder(root, "round-000000"),  # mloco's name, but no ownership marker
        user_folder(root, ".round-000001.tmp-user"),  # a staging name, no marker
        user_folder(root, "backup.tmp-2024"),
    ]
    crashed = root / ".round-000005.tmp-abc123"  # a crashed save of ours: cleaned up
    crashed.mkdir()
    mark_output(crashed, "checkpoint")
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}",
                           "--resume", "--keep-checkpoints=1")  # fmt: skip
    assert code in (0, None), err
    assert all(file.read_text() == "mine\n" for file in kept)
    assert not (root / OWNER_MARKER).exists()
    assert not crashed.exists()
    assert not (root / "round-000001").exists()  # pruned: ours, and older than the kept one
    assert (root / "round-000002" / OWNER_MARKER).is_file()


def tamper_round(run: Path, round_value: int, folder: str = "round-000001", **changes) -> Path:
    """Write ``round_value`` (and ``changes``) into state.json, rehash the manifest, rename the
    folder to ``folder`` and point ``latest`` at it, as a careful attacker would."""
    checkpoint = run / "checkpoints" / "round-000001"
    state = json.loads((checkpoint / "state.json").read_text())
    state |= {"round": round_value, **changes}
    (checkpoint / "state.json").write_text(json.dumps(state))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    digest = hashlib.sha256((checkpoint / "state.json").read_bytes()).hexdigest()
    manifest["files"]["state.json"] = digest
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    checkpoint.rename(run / "checkpoints" / folder)
    (run / "checkpoints" / "latest").write_text(folder + "\n")
    return run / "checkpoints" / folder / "state.json"


@pytest.mark.parametrize(("round_value", "folder", "fragment"), [
    (0, "round-000001", 'has no "round" (a positive integer)'),
    (7, "round-000001", "says round 7, not that of its folder round-000001"),
    (10**20, "round-000001", "not that of its folder round-000001"),
    (7, "round-000007", "says round 7, beyond this run's 2 rounds"),
])  # fmt: skip
def test_resume_refuses_a_round_outside_the_run(capsys, tmp_path, corpus, stopped, round_value,
                                                folder, fragment):  # fmt: skip
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    state = tamper_round(run, round_value, folder)
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}", "--resume")
    assert_refused(code, err, str(state), fragment)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("seconds", [-1, "12", True, None, 1e309, 10**400])
def test_resume_refuses_a_state_whose_seconds_are_not_seconds(capsys, tmp_path, corpus, stopped,
                                                              seconds):  # fmt: skip
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    state = tamper_round(run, 1, seconds=seconds)
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}", "--resume")
    fragment = 'has a "seconds" that is not a number of seconds'
    if seconds == 1e309:  # json writes Infinity, which the strict reader refuses first
        fragment = "Infinity"
    assert_refused(code, err, str(state), fragment)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("inside", [".", ".cache"])
def test_a_cache_folder_inside_the_data_is_refused(capsys, tmp_path, corpus, monkeypatch, inside):
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    cache = (data / inside).resolve()
    monkeypatch.setenv("MLOCO_CACHE", str(cache))
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={data}", f"--out={tmp_path / 'run'}")
    assert_refused(code, err, str(cache), "the cache folder ($MLOCO_CACHE) lies inside the input",
                   str(data))  # fmt: skip
    assert snapshot(tmp_path) == before


def test_resume_refuses_data_that_changed_since_the_checkpoint(capsys, tmp_path, corpus):
    """The run's checkpoint records a digest of its documents and tokenizer: the same --data
    path holding edited files is refused, the unchanged data resumes."""
    data = tmp_path / "data"
    shutil.copytree(corpus, data)
    run = tmp_path / "run"
    args = ["train", *TRAIN, f"--data={data}", f"--out={run}", "--checkpoint-every=1"]
    code, err, _ = run_cli(capsys, *args, "--stop-after=1")
    assert code in (0, None), err
    state = json.loads((run / "checkpoints" / "round-000001" / "state.json").read_text())
    assert len(state["data"]) == 64
    edited = sorted(data.rglob("*.py"))[0]
    original, times = edited.read_text(), edited.stat()
    edited.write_text(original + "\n# one more line\n")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "train", f"--out={run}", "--resume")
    assert_refused(code, err, "round-000001", "trained on other data than --data", str(data))
    assert snapshot(tmp_path) == before
    edited.write_text(original)  # the data as it was, times included: the run resumes
    os.utime(edited, ns=(times.st_atime_ns, times.st_mtime_ns))
    code, err, _ = run_cli(capsys, "train", f"--out={run}", "--resume")
    assert code in (0, None), err
    assert (run / "final" / "model.safetensors").is_file()


def windows_read(monkeypatch) -> list[torch.Tensor]:
    """Record every ``[batch, seq_len]`` window a worker's stream hands out, row by row."""
    from mergekit_loco.train.data import BatchStream

    read: list[torch.Tensor] = []
    real = BatchStream.next_batch

    def recording(self, batch_size):
        batch = real(self, batch_size)
        read.extend(batch.clone())
        return batch

    monkeypatch.setattr(BatchStream, "next_batch", recording)
    return read


def test_extending_the_budget_trains_each_token_once(capsys, tmp_path, corpus, monkeypatch):
    """512 tokens stopped after round 1, extended to 1,024 and stopped after round 3, extended
    to 1,536: the windows the workers read, over the three invocations, are each window of the
    1,536-token training stream exactly once (counted against the stream itself, not the
    slicing code)."""
    from mergekit_loco.train.config import resolve_config
    from mergekit_loco.train.run import find_tokenizer, load_data

    run = tmp_path / "run"
    read = windows_read(monkeypatch)
    steps = [["--stop-after=1"], ["--resume", "--tokens=1024", "--allow-config-change",
             "--stop-after=3"], ["--resume", "--tokens=1536", "--allow-config-change"]]  # fmt: skip
    for extra in steps:
        code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}", *extra)
        assert code in (0, None), err
    state = json.loads((run / "checkpoints" / "round-000006" / "state.json").read_text())
    assert state["data_bounds"] == [512, 1024, 1536]
    flags = dict(model="micro", workers=2, inner_steps=2, global_batch=4, seq_len=32,
                 vocab_size=300, val_tokens=256, data=corpus, out=str(run))  # fmt: skip
    config = resolve_config(None, tokens=1536, **flags)
    stream = load_data(config, find_tokenizer(config), config.total_rounds()).train
    windows = [tuple(w.tolist()) for w in stream.reshape(-1, 32)]
    assert len(read) == len(windows) == 48
    assert sorted(tuple(w.tolist()) for w in read) == sorted(windows)  # a multiset: once each


@pytest.mark.parametrize(("change", "fragment"), [
    ("--workers=1", "--workers 2 -> 1"),
    ("--workers=4", "--workers 2 -> 4"),
    ("--preset=dp", "--mode diloco -> dp"),
    ("--global-batch=8", "--global-batch 4 -> 8"),
    ("--seq-len=16", "--seq-len 32 -> 16"),
    ("--inner-steps=1", "--inner-steps 2 -> 1"),
    ("--model=nano", "--model micro -> nano"),
    ("--inner-optimizer=muon", "--inner-optimizer adamw -> muon"),
])  # fmt: skip
def test_resume_refuses_what_the_checkpoint_cannot_hold(capsys, tmp_path, corpus, stopped,
                                                        change, fragment):  # fmt: skip
    """Mode, workers, round size, model and inner optimizer cannot change on resume, even with
    --allow-config-change: refused naming what the checkpoint holds and the option, not as a
    damaged checkpoint, before any file but state.json is read."""
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    before = snapshot(tmp_path)
    code, err, opened = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}",
                                "--resume", "--allow-config-change", change)  # fmt: skip
    assert_refused(code, err, "holds a DiLoCo run of 2 workers (model micro, adamw inner "
                   "optimizer)", "cannot change on resume", fragment)  # fmt: skip
    assert "--force" not in err and "damaged" not in err
    assert not [p for p in opened if p.endswith((".pt", ".safetensors"))]
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("preset", ["diloco", "dp"])
def test_resume_refuses_a_model_that_changed_under_the_same_option(capsys, tmp_path, corpus,
                                                                   preset):  # fmt: skip
    """A run of ``--model FILE`` whose FILE was edited before the resume (an MLP of 96 where
    the checkpoint's is 64; before: "does not hold what this run needs ... start over with
    --force"), and a dp run resumed with ``--inner-optimizer muon``: refused naming the model
    options, the option, nothing written; the run resumes once FILE is restored."""
    model_file = tmp_path / "model.json"
    micro = json.dumps(MODEL_PRESETS["micro"])
    model_file.write_text(micro)
    run = tmp_path / "run"
    flags = [*TRAIN, f"--model={model_file}", f"--data={corpus}", f"--out={run}",
             f"--preset={preset}"]  # fmt: skip
    code, err, _ = run_cli(capsys, "train", *flags, "--checkpoint-every=1", "--stop-after=1")
    assert code in (0, None), err
    before = snapshot(run)
    code, err, opened = run_cli(capsys, "train", *flags, "--resume", "--allow-config-change",
                                "--inner-optimizer=muon")  # fmt: skip
    assert_refused(code, err, "cannot change on resume", "--inner-optimizer adamw -> muon")
    assert not [p for p in opened if p.endswith((".pt", ".safetensors"))]
    model_file.write_text(json.dumps({**MODEL_PRESETS["micro"], "intermediate_size": 96}))
    code, err, _ = run_cli(capsys, "train", *flags, "--resume")
    assert_refused(code, err, "holds another model than this run builds (6 of 21 tensors differ; "
                   "model.layers.0.mlp.gate_proj.weight: [64, 32] there, [96, 32] here)",
                   "(--model and its config.json, --init, the vocabulary: --tokenizer, "
                   "--vocab-size) cannot change on resume")  # fmt: skip
    assert "--force" not in err and "damaged" not in err
    assert snapshot(run) == before
    model_file.write_text(micro)
    code, err, _ = run_cli(capsys, "train", *flags, "--resume")
    assert code in (0, None), err
    assert (run / "final" / "model.safetensors").is_file()


def test_resume_refuses_a_smaller_budget(capsys, tmp_path, corpus, stopped):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}",
                           "--resume", "--allow-config-change", "--tokens=256")  # fmt: skip
    assert_refused(code, err, "budget is 512 training tokens", "gives 256", "--stop-after")


@pytest.mark.parametrize("stop_after", [1, 0])
def test_resume_with_a_stop_after_already_reached_trains_nothing(capsys, tmp_path, corpus,
                                                                 stopped, stop_after):  # fmt: skip
    """A preemptible job passing the same ``--stop-after 1`` to a resume of a run stopped at
    round 1 stops at once with a note (before: it trained to the end)."""
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    metrics = (run / "metrics.jsonl").read_bytes()
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}",
                           "--resume", f"--stop-after={stop_after}")  # fmt: skip
    if stop_after == 0:  # not a round count: refused by the option's bounds
        assert code == 2
        return
    assert code in (0, None), err
    assert "note: --stop-after 1: the checkpoint is already at round 1 of 2; nothing trained" in err
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "round-000001"]
    assert not (run / "final").exists()


def test_resume_into_a_folder_that_is_not_a_run_writes_nothing(capsys, tmp_path, corpus):
    """``--resume --out F`` where F holds the user's files only: exit 2 with nothing written
    (before: F/.mloco-lock was left) and advice that works (before: "run the same command
    without --resume", which F's foreign files then refused)."""
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "x.py").write_text("print('mine')\n")
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={folder}",
                           "--resume")  # fmt: skip
    assert_refused(code, err, "nothing to resume", "is not a run folder", "another --out")
    assert sorted(p.name for p in folder.iterdir()) == ["x.py"]
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={tmp_path / 'e'}",
                           "--resume")  # fmt: skip
    assert_refused(code, err, "does not exist: nothing to resume")
    (tmp_path / "e").mkdir()
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={tmp_path / 'e'}",
                           "--resume")  # fmt: skip
    assert_refused(code, err, "nothing to resume", "without --resume to start over")
    assert not list((tmp_path / "e").iterdir())


def test_resume_into_a_final_model_folder_names_the_run(capsys, tmp_path, corpus, stopped):
    """``--resume --out RUN/final`` (before: ``RUN/final/config.json: unknown option
    'architectures'``): it is a model, and the run is its parent."""
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}", "--resume")
    assert code in (0, None), err  # finishes: final/ is written
    before = snapshot(run / "final")
    code, err, _ = run_cli(capsys, "train", "--resume", f"--out={run / 'final'}")
    assert_refused(code, err, f"{run / 'final'} is a model folder", f"--resume --out {run}")
    hf = tmp_path / "hf"
    shutil.copytree(run / "final", hf)
    (hf / ".mloco-output.json").unlink()
    code, err, _ = run_cli(capsys, "train", "--resume", f"--out={hf}")
    assert_refused(code, err, f"{hf} is a model folder", "continues a run folder")
    assert snapshot(run / "final") == before and "architectures" not in err
    assert not (run / "final" / ".mloco-lock").exists()


def test_resume_never_replaces_what_a_user_put_in_final(capsys, tmp_path, corpus, stopped):
    """``--force`` refuses a ``final/`` holding a user's file; ``--resume``, which writes
    ``final/`` anew, refuses it too, before any work."""
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    (run / "final").mkdir()
    (run / "final" / "NOTES.md").write_text("eval results, keep\n")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}", "--resume")
    assert_refused(code, err, str(run / "final"), "it holds NOTES.md", "then --resume")
    assert snapshot(tmp_path) == before


def test_resume_never_replaces_a_round_folder_it_did_not_write(capsys, tmp_path, corpus, stopped):
    """A user's ``round-000002`` (no ownership marker) where the resumed run would save round 2:
    refused before any work, naming it (before: replaced, then pruned)."""
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    notes = user_folder(run / "checkpoints", "round-000002")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}", "--resume")
    assert_refused(code, err, str(run / "checkpoints" / "round-000002"), "not written by mloco")
    assert snapshot(tmp_path) == before and notes.read_text() == "mine\n"
    with pytest.raises(OutputRefused, match="round-000002: exists and was not written"):
        state = Checkpoint(round=2, config={}, global_params={"w": torch.ones(2)}, shared=None,
                           workers={0: {"data": {"position": 0}}})  # fmt: skip
        save_checkpoint(run, state, SimulatedWorkers(1, torch.device("cpu")))
    assert notes.read_text() == "mine\n"


def test_an_empty_latest_pointer_resumes_from_the_newest_checkpoint(capsys, tmp_path, corpus,
                                                                     stopped):  # fmt: skip
    """A crash can leave ``checkpoints/latest`` empty: the run resumes from the newest
    checkpoint it wrote, says so, and ends where a resume through the pointer ends."""
    finals = []
    for pointer in (None, ""):
        run = tmp_path / f"run-{len(finals)}"
        shutil.copytree(stopped, run)
        if pointer is not None:
            (run / "checkpoints" / "latest").write_text(pointer)
        code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}",
                               "--resume")  # fmt: skip
        assert code in (0, None), err
        finals.append(load_file(run / "final" / "model.safetensors"))
    assert "latest is empty; resuming from round-000001" in err
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][name], finals[1][name]) for name in finals[0])


def test_data_and_run_folders_whose_names_are_not_utf8_train_and_resume(
    capsys, tmp_path, corpus, monkeypatch
):
    """Names of raw bytes (Latin-1 from another machine): a --data folder and a file in it
    (before: `error: 'utf-8' codec can't encode characters ...`, naming no file) train, and the
    run's own config.json and state.json, which hold the escaped names, are read back by a
    resume. A run folder of such a name is refused up front: the tokenizers library cannot
    save under it (before: refused only after the last round)."""
    data = Path(os.fsdecode(bytes(tmp_path) + b"/donn\xe9es"))
    shutil.copytree(corpus, data)
    source = next(p for p in sorted(data.rglob("*")) if p.is_file())
    shutil.copy(source, os.fsdecode(bytes(data) + b"/caf\xe9.py"))
    for out in (os.fsdecode(bytes(tmp_path) + b"/r\xe9sum\xe9"), "run"):  # ./run inside donn\xe9es/
        monkeypatch.chdir(data if out == "run" else tmp_path)
        code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={data}", f"--out={out}")
        assert_refused(code, err, "--out", "the path is not UTF-8")
        assert not Path(out).exists()
    run = tmp_path / "run"
    for flags in (["--checkpoint-every=1", "--stop-after=1"], ["--resume"]):
        code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={data}", f"--out={run}", *flags)
        assert code in (0, None), err
    assert (run / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('"timeout": 1e999', "timeout in {saved} must be a finite number"),
        ('"eval_every": -1', "eval_every in {saved} must be >= 0"),
    ],
)
def test_a_refused_value_of_the_saved_config_is_named_there(
    capsys, tmp_path, corpus, stopped, entry, message
):
    """A stopped run's ``config.json`` edited by hand, then ``--resume`` without that flag
    (before: ``--timeout must be a finite number``, naming a flag that was never given)."""
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    saved = run / "config.json"
    key = entry.split('"')[1]
    config = json.loads(saved.read_text())
    text = json.dumps({k: v for k, v in config.items() if k != key})
    saved.write_text(text[:-1] + f", {entry}}}")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "train", f"--out={run}", "--resume", f"--data={corpus}")
    assert_refused(code, err, message.format(saved=saved))
    assert snapshot(tmp_path) == before


def test_resume_into_another_of_our_folders_says_what_it_is(capsys, tmp_path, corpus):
    """``--resume --out`` a compare sweep's folder (before: "it holds files mergekit_loco did
    not write", of a folder mloco wrote)."""
    folder = tmp_path / "sweep"
    folder.mkdir()
    mark_output(folder, "compare sweep")
    (folder / "summary.csv").write_text("aggregator\n")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={folder}",
                           "--resume")  # fmt: skip
    assert_refused(code, err, f"{folder} is not a run folder (it is a compare sweep folder): "
                   "start a run with another --out")  # fmt: skip
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("damage", ["cut", "deleted"])
def test_a_resume_names_the_rounds_its_metrics_log_lacks(capsys, tmp_path, corpus, stopped, damage):
    """``metrics.jsonl`` cut short or deleted before ``--resume``: the run resumes (the log is
    not needed to train) and says which rounds' lines are lost. Before: not a word."""
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    metrics = run / "metrics.jsonl"
    if damage == "cut":
        lines = [line for line in metrics.read_text().splitlines(keepends=True)
                 if json.loads(line).get("event") != "round"]  # fmt: skip
        metrics.write_text("".join(lines))
    else:
        metrics.unlink()
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}", "--resume")
    assert code == 0, err
    assert err == (
        f"note: {metrics} lacks round 1 of the 1 before the checkpoint (cut or deleted): their "
        "losses stay out of the log and its curves\n"
    )
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["round"] for e in logged if e["event"] == "round"] == [2]


def test_round_spans_join_consecutive_rounds():
    from mergekit_loco.train.loop import round_spans

    assert round_spans([3]) == "round 3"
    assert round_spans([1, 2, 3, 5, 7, 8]) == "rounds 1-3, 5, 7-8"
