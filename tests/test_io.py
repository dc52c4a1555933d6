"""Checkpoint I/O: the lazy reader on files and HF folders, and the sharded atomic writer."""

import errno
import json
import os
import resource
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_factory import load_state_dict, save_model, tiny_llama, write_state_dict
from safetensors.torch import load_file

from mergekit_loco.io import (
    CheckpointError,
    CheckpointWriter,
    OutputExistsError,
    open_checkpoint,
)
from mergekit_loco.io import files as files_module
from mergekit_loco.io import reader as reader_module
from mergekit_loco.io import writer as writer_module
from mergekit_loco.io.atomic import OWNER_MARKER, OutputRefused, raise_on_signal

MIXED = {
    "odd_bf16": torch.arange(3, dtype=torch.bfloat16),  # 6 bytes: would misalign what follows
    "ids": torch.tensor([[1, -2], [3, 4]], dtype=torch.int64),
    "weight": torch.linspace(-1, 1, 12).reshape(3, 4),
    "flags": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5, dtype=torch.float64),
    "empty": torch.zeros(0, 4),
}


def leftovers(folder: Path) -> list[str]:
    """Hidden temp siblings the writer may leave behind."""
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def assert_same(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name], tensor), name


# -- reader -----------------------------------------------------------------------------------


def test_reader_single_file_reads_header_and_tensors(tmp_path):
    file = write_state_dict(MIXED, tmp_path / "mixed.safetensors")
    with open_checkpoint(file) as reader:
        assert set(reader.names()) == set(MIXED)
        assert "ids" in reader and "nope" not in reader
        assert reader.shape("weight") == (3, 4) and reader.dtype("odd_bf16") == torch.bfloat16
        assert reader.config_dir == tmp_path and reader.path == file
        assert_same({name: reader.get(name) for name in reader.names()}, MIXED)
        with pytest.raises(CheckpointError, match="nope"):
            reader.get("nope")


def test_reader_names_follow_file_order(tmp_path):
    """names() lists tensors in the order of the file's header (safetensors writes bigger
    elements first, then by name)."""
    file = write_state_dict(MIXED, tmp_path / "mixed.safetensors")
    (header_length,) = struct.unpack("<Q", file.read_bytes()[:8])
    header = json.loads(file.read_bytes()[8 : 8 + header_length])
    with open_checkpoint(file) as reader:
        assert reader.names() == [name for name in header if name != "__metadata__"]


@pytest.mark.parametrize("layout", ["folder", "sharded"])
def test_reader_hf_folders(tmp_path, layout):
    model = tiny_llama()
    folder = save_model(model, tmp_path / "model", layout)
    if layout == "sharded":
        assert (folder / "model.safetensors.index.json").is_file()
    with open_checkpoint(folder) as reader:
        assert reader.config_dir == folder
        assert_same({name: reader.get(name) for name in reader.names()}, model.state_dict())


def test_reader_accepts_the_index_file_itself(tmp_path):
    folder = save_model(tiny_llama(), tmp_path / "model", "sharded")
    with open_checkpoint(folder / "model.safetensors.index.json") as reader:
        assert set(reader.names()) == set(load_state_dict(folder))


def corrupt(tmp_path: Path, how: str) -> tuple[Path, str]:
    """A broken checkpoint and a regex its error message must match (file and tensor named)."""
    file = write_state_dict(
        {"a.weight": torch.ones(4, 4), "b.bias": torch.ones(4)}, tmp_path / "m.safetensors"
    )
    raw = file.read_bytes()
    (header_length,) = struct.unpack("<Q", raw[:8])
    if how == "missing":
        return tmp_path / "absent.safetensors", "absent.safetensors: no such file"
    if how == "empty_folder":
        (tmp_path / "folder").mkdir()
        return tmp_path / "folder", "folder: no model.safetensors"
    if how == "tiny":
        file.write_bytes(raw[:5])
        return file, "m.safetensors: header cut"
    if how == "header_cut":
        file.write_bytes(raw[: 8 + header_length // 2])
        return file, "m.safetensors: header cut"
    if how == "bad_json":
        file.write_bytes(raw[:8] + b"{" * header_length + raw[8 + header_length :])
        return file, "m.safetensors: bad JSON header"
    if how == "data_cut":
        file.write_bytes(raw[:-3])
        return file, r"m.safetensors: data cut: tensor '(a.weight|b.bias)'"
    if how == "bad_offsets":
        header = raw[8 : 8 + header_length].replace(b"[4,4]", b"[4,5]")
        file.write_bytes(raw[:8] + header + raw[8 + header_length :])
        return file, "m.safetensors: corrupt header: tensor 'a.weight'"
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    ["missing", "empty_folder", "tiny", "header_cut", "bad_json", "data_cut", "bad_offsets"],
)
def test_reader_errors_name_file_and_tensor(tmp_path, how):
    path, message = corrupt(tmp_path, how)
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(path)


def test_reader_index_pointing_at_missing_shard(tmp_path):
    folder = save_model(tiny_llama(), tmp_path / "model", "sharded")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    shard = weight_map["lm_head.weight"]
    (folder / shard).unlink()
    with pytest.raises(CheckpointError, match=f"missing shard {shard} .*for tensor"):
        open_checkpoint(folder)


def test_reader_detects_truncation_after_opening(tmp_path):
    """A file cut after its header was checked still gives a named error, not garbage."""
    file = write_state_dict({"w": torch.ones(64)}, tmp_path / "m.safetensors")
    with open_checkpoint(file) as reader:
        os.truncate(file, file.stat().st_size - 8)
        with pytest.raises(CheckpointError, match=r"m.safetensors: changed since its header.*cut"):
            reader.get("w")


# -- writer -----------------------------------------------------------------------------------


def test_writer_single_file_round_trip_with_alignment(tmp_path):
    """safetensors' own loader accepts the file (it checks offsets); values are bit-exact."""
    out = tmp_path / "out.safetensors"
    with CheckpointWriter(out) as writer:
        for name, tensor in MIXED.items():
            writer.write(name, tensor)
    assert_same(load_file(out), MIXED)
    (header_length,) = struct.unpack("<Q", out.read_bytes()[:8])
    header = json.loads(out.read_bytes()[8 : 8 + header_length])
    assert header["__metadata__"] == {"format": "pt"} and header_length % 8 == 0
    for name, entry in header.items():
        if name != "__metadata__":
            assert entry["data_offsets"][0] % MIXED[name].dtype.itemsize == 0, name
    assert leftovers(tmp_path) == []


def test_writer_shards_folder_with_index_and_configs(tmp_path):
    state = {f"layer{i}.weight": torch.full((10, 10), float(i)) for i in range(5)}  # 400 B each
    config_dir = tmp_path / "base"
    config_dir.mkdir()
    (config_dir / "config.json").write_text('{"model_type": "llama"}')
    (config_dir / "tokenizer.json").write_text("{}")
    (config_dir / "unrelated.txt").write_text("not copied")
    out = tmp_path / "merged"
    with CheckpointWriter(out, max_shard_bytes=900, config_dir=config_dir) as writer:
        for name, tensor in state.items():
            writer.write(name, tensor)
    names = sorted(p.name for p in out.iterdir())
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert names == sorted(
        [*shards, "model.safetensors.index.json", "config.json", "tokenizer.json", OWNER_MARKER]
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {
        "layer0.weight": shards[0],
        "layer1.weight": shards[0],
        "layer2.weight": shards[1],
        "layer3.weight": shards[1],
        "layer4.weight": shards[2],
    }
    assert index["metadata"]["total_size"] == 5 * 400  # tensor bytes, as transformers counts
    assert_same(load_state_dict(out), state)
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)  # not mkdtemp's private mode


def test_writer_one_shard_is_model_safetensors(tmp_path):
    with CheckpointWriter(tmp_path / "merged") as writer:
        writer.write("w", torch.ones(3))
    names = sorted(p.name for p in (tmp_path / "merged").iterdir())
    assert names == [OWNER_MARKER, "model.safetensors"]


def test_writer_refuses_existing_output_before_any_work(tmp_path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"precious")
    with pytest.raises(OutputExistsError, match="out.safetensors: output file exists.*--force"):
        CheckpointWriter(out)
    assert out.read_bytes() == b"precious"


def test_writer_force_replaces_an_output_it_wrote_but_no_file_a_user_added(tmp_path):
    out = tmp_path / "merged"
    with CheckpointWriter(out, max_shard_bytes=8) as writer:
        writer.write("a", torch.ones(2))
        writer.write("b", torch.ones(2))
    with CheckpointWriter(out, force=True) as writer:  # shards and index give way to one file
        writer.write("w", torch.ones(3))
    assert sorted(p.name for p in out.iterdir()) == [OWNER_MARKER, "model.safetensors"]
    assert leftovers(tmp_path) == []
    (out / "stale.txt").write_text("the user's")
    with pytest.raises(
        OutputRefused,
        match=r"merged: the output folder exists and is not a checkpoint.*stale.*--force replaces",
    ):
        CheckpointWriter(out, force=True)
    assert (out / "stale.txt").read_text() == "the user's"


@pytest.mark.parametrize("force", [False, True])
def test_writer_exception_mid_write_leaves_nothing(tmp_path, force):
    out = tmp_path / "sub" / "merged"
    if force:
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(b"previous output")
    with pytest.raises(RuntimeError, match="boom"):
        with CheckpointWriter(out, max_shard_bytes=16, force=force) as writer:
            writer.write("a", torch.ones(8))
            writer.write("b", torch.ones(8))  # a shard was finished: real files in the temp
            raise RuntimeError("boom")
    if force:
        assert (out / "model.safetensors").read_bytes() == b"previous output"
        assert leftovers(out.parent) == []
    else:
        assert not (tmp_path / "sub").exists()  # created parent removed too


def test_writer_full_disk_is_a_named_error_and_leaves_nothing(tmp_path, monkeypatch):
    def full_disk(self, name, tensor):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writer_module.ShardBuilder, "add", full_disk)
    out = tmp_path / "merged"
    with pytest.raises(CheckpointError, match="cannot write tensor 'w' to .*merged: No space left"):
        with CheckpointWriter(out) as writer:
            writer.write("w", torch.ones(3))
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_duplicate_names(tmp_path):
    with pytest.raises(CheckpointError, match="'w' written twice"):
        with CheckpointWriter(tmp_path / "o.safetensors") as writer:
            writer.write("w", torch.ones(3))
            writer.write("w", torch.ones(3))
    assert list(tmp_path.iterdir()) == []


def test_writer_restores_signal_handlers(tmp_path):
    import signal

    before = signal.getsignal(signal.SIGTERM)
    with CheckpointWriter(tmp_path / "o.safetensors") as writer:
        assert signal.getsignal(signal.SIGTERM) is raise_on_signal
        writer.write("w", torch.ones(3))
    assert signal.getsignal(signal.SIGTERM) is before


def write_one_tensor_shards(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A model folder with one shard per tensor and its ``model.safetensors.index.json``."""
    folder.mkdir()
    weight_map = {}
    for number, (name, tensor) in enumerate(tensors.items(), start=1):
        shard = f"model-{number:05d}-of-{len(tensors):05d}.safetensors"
        write_state_dict({name: tensor}, folder / shard)
        weight_map[name] = shard
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def test_a_reader_keeps_few_shards_open_and_reopens_a_closed_one_checked(tmp_path):
    """Reading every tensor of a 40-shard folder leaves at most MAX_OPEN_SHARDS files open
    (before: all 40, until closed), and a shard closed since is read again, still checked
    against the file version its header came from."""
    tensors = {f"t{k}": torch.full((3,), float(k)) for k in range(40)}
    folder = write_one_tensor_shards(tmp_path / "model", tensors)
    fds = Path("/proc/self/fd")
    before = len(list(fds.iterdir()))
    with open_checkpoint(folder) as reader:
        for name, tensor in tensors.items():
            assert torch.equal(reader.get(name), tensor)
        assert len(list(fds.iterdir())) - before <= reader_module.MAX_OPEN_SHARDS
        assert torch.equal(reader.get("t0"), tensors["t0"])  # closed, then opened again
        for name in list(tensors)[1 : 1 + reader_module.MAX_OPEN_SHARDS]:
            reader.get(name)  # t0's shard is closed again
        write_state_dict({"t0": torch.zeros(5)}, folder / "model-00001-of-00040.safetensors")
        with pytest.raises(CheckpointError, match="model-00001-of-00040.safetensors: changed"):
            reader.get("t0")
    assert len(list(fds.iterdir())) == before


def test_a_merge_of_many_shards_runs_within_a_low_open_file_limit(tmp_path):
    """``mloco merge`` of two models onto a base, 60 one-tensor shards each, under a limit of
    100 open files (before: each reader kept every shard it had read open, 180 in all, and the
    merge failed with ``m1/model-000NN-of-00060.safetensors: cannot read (Too many open
    files)``, blaming an input, and left its staging folder behind)."""
    names = [f"t{k}" for k in range(60)]
    states = {
        role: {name: torch.full((2,), float(k) * (i + 1)) for k, name in enumerate(names)}
        for i, role in enumerate(("base", "m1", "m2"))
    }
    folders = {
        role: write_one_tensor_shards(tmp_path / role, state) for role, state in states.items()
    }
    limit = (100, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    done = subprocess.run(
        [sys.executable, "-m", "mergekit_loco", "merge", str(folders["m1"]), str(folders["m2"]),
         "--base", str(folders["base"]), "-m", "ta", "--scale", "1",
         "-o", str(tmp_path / "out"), "-q"],
        capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    merged = load_file(tmp_path / "out" / "model.safetensors")
    for name in names:  # task arithmetic, scale 1: base + (m1 - base) + (m2 - base)
        expected = states["m1"][name] + states["m2"][name] - states["base"][name]
        assert torch.equal(merged[name], expected), name
    assert leftovers(tmp_path) == []


def test_shown_escapes_a_bounded_prefix_and_counts_the_rest():
    """A message never escapes (or holds) more than SHOWN_CHARS characters of a value (before:
    all of a 20 MB tensor name was escaped, seconds and 200 MB, and then cut to 200)."""
    limit = files_module.SHOWN_CHARS
    assert files_module.shown("a\nb") == "a\\nb"
    assert files_module.shown("x" * limit) == "x" * limit
    text = files_module.shown("\n" * 1_000_000)
    assert text == "\\n" * limit + "... (1,000,000 characters)"
