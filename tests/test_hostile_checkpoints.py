"""Damaged run folders and caches: a checkpoint whose manifest was rewritten to match its damage,
refused pickles, a NaN "last good" checkpoint, pointers and manifests leading outside, a cut
token cache (rebuilt), 8-bit float merges and out-of-range options: one line, exit 2."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import stdlib_corpus
from hostile import TRAIN, assert_not_read, assert_refused, run_cli, snapshot
from safetensors.torch import load_file, save_file

from mergekit_loco.train.checkpoint import Checkpoint, NotFinite, save_checkpoint
from mergekit_loco.train.workers import SimulatedWorkers

CKPT = Path("checkpoints") / "round-000001"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    files = ["json/decoder.py", "json/encoder.py", "textwrap.py", "string.py"]
    with stdlib_corpus(tmp_path_factory.mktemp("ckpt"), files) as folder:
        yield folder


class Evil:
    """A pickle that would create a file when loaded (weights_only must refuse it)."""

    def __init__(self, sentinel: str):
        self.sentinel = sentinel

    def __reduce__(self):
        return (Path.write_text, (Path(self.sentinel), "ran"))


def rewrite_manifest(folder: Path) -> None:
    """Recompute every sha256 in the manifest, as an attacker (or a careless tool) would."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))


def damage(run: Path, case: str, sentinel: Path) -> tuple[Path, str]:
    """Damage ``run``'s checkpoint; returns the file the message must name and a fragment."""
    folder = run / CKPT
    if case == "global_garbage":
        (folder / "global.safetensors").write_bytes(b"\x10" + bytes(40))
        return folder / "global.safetensors", "header"
    if case == "global_nan":
        params = load_file(folder / "global.safetensors")
        first = next(iter(params))
        params[first].view(-1)[0] = float("nan")
        save_file(params, folder / "global.safetensors")
        return folder / "global.safetensors", "holds NaN or Inf; not a good checkpoint"
    if case == "evil_pickle":
        with open(folder / "shared.pt", "wb") as handle:
            pickle.dump(Evil(str(sentinel)), handle)
        return folder / "shared.pt", "cannot be loaded"
    if case == "shared_missing_key":
        torch.save({"momentum_buffers": {}}, folder / "shared.pt")
        return folder / "shared.pt", "missing entry"
    if case == "worker_not_a_state":
        torch.save([1, 2, 3], folder / "worker-0000.pt")
        return folder / "worker-0000.pt", "does not hold what this run needs"
    if case == "state_no_round":
        state = json.loads((folder / "state.json").read_text())
        del state["round"]
        (folder / "state.json").write_text(json.dumps(state))
        return folder / "state.json", 'has no "round"'
    if case == "state_not_json":
        (folder / "state.json").write_text('{"round": 1, "round": 2}')
        return folder / "state.json", "appears twice"
    if case in STATE_DAMAGE:
        change, fragment = STATE_DAMAGE[case]
        state = json.loads((folder / "state.json").read_text())
        (folder / "state.json").write_text(json.dumps(change(state)))
        return folder / "state.json", fragment
    if case == "manifest_names_outside":
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["files"]["../../../secret"] = "0" * 64
        (folder / "manifest.json").write_text(json.dumps(manifest))
        return folder, "../../../secret"
    raise AssertionError(case)


#: Damage to one field of state.json (rehashed into the manifest): change -> what the error says.
STATE_DAMAGE = {
    "state_a_list": (lambda s: [s], "is not a JSON object"),
    "state_round_zero": (lambda s: s | {"round": 0}, 'has no "round" (a positive integer)'),
    "state_round_text": (lambda s: s | {"round": "1"}, 'has no "round" (a positive integer)'),
    "state_world_zero": (lambda s: s | {"world_size": 0}, 'has no "world_size"'),
    "state_world_bool": (lambda s: s | {"world_size": True}, 'has no "world_size"'),
    "state_config_list": (lambda s: s | {"config": []}, 'has no "config" (a JSON object)'),
    "state_data_short": (lambda s: s | {"data": "ab12"}, 'has a "data" that is not a sha256'),
    "state_seconds_negative": (lambda s: s | {"seconds": -1}, 'has a "seconds" that is not'),
    "state_seconds_huge": (lambda s: s | {"seconds": 10**400}, 'has a "seconds" that is not'),
    "state_bounds_falling": (lambda s: s | {"data_bounds": [512, 256]}, "not a rising list"),
    "state_bounds_empty": (lambda s: s | {"data_bounds": []}, "not a rising list"),
}


@pytest.mark.parametrize("case", ["global_garbage", "global_nan", "evil_pickle",
                                  "shared_missing_key", "worker_not_a_state", "state_no_round",
                                  "state_not_json", "manifest_names_outside",
                                  *STATE_DAMAGE])  # fmt: skip
def test_resume_from_a_damaged_checkpoint_names_the_file(capsys, tmp_path, corpus, stopped, case):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    sentinel = tmp_path / "pickle_ran.txt"
    named, fragment = damage(run, case, sentinel)
    if case != "manifest_names_outside":
        rewrite_manifest(run / CKPT)
    before = snapshot(tmp_path)
    code, err, opened = run_cli(
        capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}", "--resume"
    )
    assert_refused(code, err, str(named), fragment)
    assert not sentinel.exists()
    assert_not_read(opened, tmp_path / "secret")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("pointer", ["../../outside", "/etc", "round-000001/../../x", "\x00"])
def test_latest_pointer_must_name_a_checkpoint_of_the_run(capsys, tmp_path, corpus, stopped,
                                                          pointer):  # fmt: skip
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    (run / "checkpoints" / "latest").write_text(pointer + "\n")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}", "--resume")
    line = assert_refused(code, err, str(run / "checkpoints" / "latest"), "does not name")
    assert pointer.strip() not in line.split("latest", 1)[1]  # the file's bytes are not echoed
    assert snapshot(tmp_path) == before


def test_non_finite_parameters_are_never_saved_as_a_checkpoint(tmp_path):
    group = SimulatedWorkers(1, torch.device("cpu"))
    state = Checkpoint(round=3, config={}, global_params={"w": torch.tensor([1.0, float("inf")])},
                       shared=None, workers={0: {"data": {"position": 0}}})  # fmt: skip
    with pytest.raises(NotFinite, match="round 3: global parameter 'w' holds NaN or Inf"):
        save_checkpoint(tmp_path, state, group)
    assert list(tmp_path.iterdir()) == []


def test_a_cut_token_cache_is_rebuilt(capsys, tmp_path, corpus, monkeypatch):
    monkeypatch.setenv("MLOCO_CACHE", str(tmp_path / "cache"))
    args = ["train", *TRAIN, f"--data={corpus}"]
    assert run_cli(capsys, *args, f"--out={tmp_path / 'a'}")[0] == 0
    (cache,) = (tmp_path / "cache" / "tokens").glob("*.pt")
    whole = cache.read_bytes()
    cache.write_bytes(whole[: len(whole) // 2])
    code, err, _ = run_cli(capsys, *args, f"--out={tmp_path / 'b'}")
    assert code == 0, err
    assert cache.read_bytes() == whole  # healed: the same tokens, written again
    assert torch.equal(
        load_file(tmp_path / "a" / "final" / "model.safetensors")["lm_head.weight"],
        load_file(tmp_path / "b" / "final" / "model.safetensors")["lm_head.weight"],
    )


def test_a_token_changed_in_the_cache_is_caught_and_rebuilt(capsys, tmp_path, corpus,
                                                           monkeypatch):  # fmt: skip
    """A token id changed on disk, still a valid id in a file torch loads without a word (it
    checks no checksum of the data), and a cache written before caches held their digest.
    Before: trained on as it was, fresh and on --resume."""
    monkeypatch.setenv("MLOCO_CACHE", str(tmp_path / "cache"))
    args = ["train", *TRAIN, f"--data={corpus}"]
    assert run_cli(capsys, *args, f"--out={tmp_path / 'a'}")[0] == 0
    (cache,) = (tmp_path / "cache" / "tokens").glob("*.pt")
    whole = cache.read_bytes()
    for damage in ("a token changed", "no digest"):
        cached = torch.load(cache, weights_only=True)
        if damage == "a token changed":
            cached["train"][10] = (cached["train"][10] + 1) % 64
        else:
            del cached["digest"]
        torch.save(cached, cache)
        out = tmp_path / damage.replace(" ", "-")
        code, err, _ = run_cli(capsys, *args, f"--out={out}")
        assert code == 0, err
        assert cache.read_bytes() == whole  # healed: the same tokens, written again
        assert torch.equal(
            load_file(tmp_path / "a" / "final" / "model.safetensors")["lm_head.weight"],
            load_file(out / "final" / "model.safetensors")["lm_head.weight"],
        )


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_8_bit_float_inputs_merge_in_float32_and_keep_their_dtype(capsys, tmp_path, dtype):
    base = torch.tensor([0.5, 1.0, -2.0, 4.0]).to(dtype)
    tunes = [
        torch.tensor([1.0, 1.5, -2.0, 3.0]).to(dtype),
        torch.tensor([0.0, 2.0, -1.0, 4.0]).to(dtype),
    ]
    save_file({"w": base}, tmp_path / "base.safetensors")
    for index, tune in enumerate(tunes):
        save_file({"w": tune}, tmp_path / f"ft{index}.safetensors")
    out = tmp_path / "out.safetensors"
    code, err, _ = run_cli(capsys, "merge", tmp_path / "ft0.safetensors",
                           tmp_path / "ft1.safetensors", "--base", tmp_path / "base.safetensors",
                           "-m", "ta", "-o", out)  # fmt: skip
    assert code == 0, err
    expected = base.double() + sum(t.double() - base.double() for t in tunes)  # by hand, float64
    merged = load_file(out)["w"]
    assert merged.dtype == dtype
    assert torch.equal(merged, expected.float().to(dtype))


@pytest.mark.parametrize(("option", "fragment"), [
    (["--scale", "1e39"], "--scale"), (["--seed", str(10**23)], "--seed"),
    (["--seed", "1e23"], "--seed"), (["--shard-size", "0.1B"], "--shard-size"),
    (["--option", f"seed={10**26}"], "seed must be an integer in [0, 2**63)"),
    (["--device", "meta"], "mloco runs on cpu or cuda, not meta"),
    (["--device", "mps"], "mloco runs on cpu or cuda, not mps"),
])  # fmt: skip
def test_out_of_range_options_are_one_line(capsys, tmp_path, option, fragment):
    save_file({"w": torch.ones(2)}, tmp_path / "base.safetensors")
    save_file({"w": torch.zeros(2)}, tmp_path / "ft.safetensors")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "merge", tmp_path / "ft.safetensors", "--base",
                           tmp_path / "base.safetensors", "-m", "dare", "-o", tmp_path / "o",
                           *option)  # fmt: skip
    assert_refused(code, err, fragment)
    assert snapshot(tmp_path) == before


def test_resume_drops_the_torn_last_line_of_a_killed_run(capsys, tmp_path, corpus, stopped):
    """A run killed while appending to metrics.jsonl leaves a last line with no line ending
    that is not JSON: resume drops it (before, it refused the run as damaged) and the log
    reads like an uninterrupted run's."""
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    kept = (run / "metrics.jsonl").read_text()
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"event": "round", "round": 2, "train_lo')
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}", "--resume")
    assert code in (0, None), err
    lines = (run / "metrics.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]  # every line is JSON again
    assert "\n".join(lines).startswith(kept.rstrip("\n"))
    assert [e["round"] for e in events if e.get("event") == "round"] == [1, 2]
    assert events[-1]["event"] == "final"


@pytest.mark.parametrize(("file", "content", "fragment"), [
    ("metrics.jsonl", '{"event": "round", "round": 1}\n[1, 2\n', "metrics.jsonl:2: not valid JSON"),
    ("metrics.jsonl", '{"event": "round", "round": "one"}\n', "not a metrics event"),
    # a damaged train loss of the checkpoint's round (before: the final line said null)
    ("metrics.jsonl", '{"event": "round", "round": 1, "train_loss": "abc"}\n',
     'metrics.jsonl:1: train_loss "abc" is not a loss (a finite number above 0)'),
    ("metrics.jsonl", '{"event": "round", "round": 1, "train_loss": 1e999}\n',
     "metrics.jsonl:1: train_loss Infinity is not a loss"),
    ("metrics.jsonl", '{"event": "round", "round": 1, "train_loss": true}\n',
     "metrics.jsonl:1: train_loss true is not a loss"),
    ("metrics.jsonl", "x" * 70_000 + "\n", "metrics.jsonl:1: a line over 65536 bytes"),
    ("metrics.jsonl", "sparse", "more than a metrics file may hold"),
    ("config.json", "[]", "not a JSON object"),
    ("config.json", "fifo", "is a FIFO"),
])  # fmt: skip
def test_resume_with_a_damaged_run_file_names_it(capsys, tmp_path, corpus, stopped, file, content,
                                                 fragment):  # fmt: skip
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    (run / file).unlink()
    if content == "fifo":
        os.mkfifo(run / file)
    elif content == "sparse":  # 300 MB on paper, nothing on disk: refused by its size alone
        with open(run / file, "wb") as handle:
            handle.truncate(300_000_000)
    else:
        (run / file).write_text(content)
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={run}", "--resume")
    assert_refused(code, err, str(run / file), fragment)
    assert snapshot(tmp_path) == before
