"""Malformed safetensors files and indexes: refused in one line naming the file (exit 2), never
merged, never a traceback; and a fuzz test against the safetensors library's own checks."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hostile import assert_not_read, assert_refused, run_cli, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mergekit_loco.io import CheckpointError, open_checkpoint

F32_4 = {"dtype": "F32", "shape": [4]}


def raw_file(header: str | bytes, data: bytes = b"") -> bytes:
    """``u64 length | header | data``, the header given verbatim."""
    header = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(header)) + header + data


def entries(**tensors) -> str:
    return json.dumps(tensors)


#: name -> (file bytes, a fragment the one-line error must hold besides the file name)
MALFORMED = {
    "overlap": (
        raw_file(
            entries(a={**F32_4, "data_offsets": [0, 16]}, b={**F32_4, "data_offsets": [8, 24]}),
            bytes(24),
        ),
        "overlaps",
    ),
    "gap": (
        raw_file(
            entries(a={**F32_4, "data_offsets": [0, 16]}, b={**F32_4, "data_offsets": [20, 36]}),
            bytes(36),
        ),
        "gap",
    ),
    "trailing_bytes": (
        raw_file(entries(a={**F32_4, "data_offsets": [0, 16]}), bytes(20)),
        "4 bytes after the last tensor",
    ),
    "duplicate_name": (
        raw_file(
            '{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, '
            '"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}',
            bytes(16),
        ),
        "appears twice",
    ),
    "metadata_not_str": (
        raw_file(
            entries(__metadata__={"step": 3}, a={**F32_4, "data_offsets": [0, 16]}), bytes(16)
        ),
        "__metadata__ must map strings to strings",
    ),
    "nan_in_metadata": (
        raw_file(
            '{"__metadata__": {"x": NaN}, "a": {"dtype": "F32", '
            '"shape": [4], "data_offsets": [0, 16]}}',
            bytes(16),
        ),
        "NaN is not JSON",
    ),
    "deep_nesting": (raw_file('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"), "nested too deep"),
    "negative_shape": (
        raw_file(entries(a={"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]})),
        "non-negative integers",
    ),
    "float_shape": (
        raw_file(entries(a={"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]}), bytes(16)),
        "non-negative",
    ),
    "bool_shape": (
        raw_file(entries(a={"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}), bytes(4)),
        "non-negative",
    ),
    "shape_overflow": (
        raw_file(
            entries(a={"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}), bytes(16)
        ),
        "overflows",
    ),
    "shape_overflow_beside_a_zero": (
        raw_file(entries(a={"dtype": "F32", "shape": [2**62, 2**62, 0], "data_offsets": [0, 0]})),
        "overflows",
    ),
    "no_tensors": (raw_file("{}"), "holds no tensors"),
    "offsets_disagree": (
        raw_file(entries(a={"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}), bytes(16)),
        "needs 20",
    ),
    "unknown_dtype": (
        raw_file(entries(a={"dtype": "F7", "shape": [4], "data_offsets": [0, 16]}), bytes(16)),
        "unknown dtype",
    ),
    "extra_key": (
        raw_file(entries(a={**F32_4, "data_offsets": [0, 16], "x": 1}), bytes(16)),
        "exactly the keys",
    ),
    "not_an_object": (raw_file("[1, 2]"), "not an object"),
    "not_utf8": (raw_file(b'{"\xff": 1}'), "not UTF-8"),
    "empty_file": (b"", "header cut"),
    "huge_header_length": (struct.pack("<Q", 2**63) + b"{}", "header length is larger"),
    "header_longer_than_file": (struct.pack("<Q", 5000) + b"{}", "header length is larger"),
}


@pytest.fixture
def good(tmp_path) -> Path:
    path = tmp_path / "inputs" / "good.safetensors"
    path.parent.mkdir()
    save_file({"a": torch.ones(4)}, path)
    return path


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_is_refused_in_one_line(capsys, tmp_path, good, case):
    content, fragment = MALFORMED[case]
    bad = good.parent / "bad.safetensors"
    bad.write_bytes(content)
    before = snapshot(tmp_path)
    out = tmp_path / "out.safetensors"
    code, err, opened = run_cli(capsys, "merge", bad, "--base", good, "-m", "ta", "-o", out)
    line = assert_refused(code, err, str(bad), fragment)
    assert snapshot(tmp_path) == before  # nothing written or deleted
    assert len(line) < 400  # no bytes of the file dumped into the message
    assert_not_read(opened, tmp_path / "elsewhere")


def write_index(folder: Path, weight_map: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("case", ["dotdot", "absolute", "symlink_out", "directory",
                                  "not_a_string", "fifo"])  # fmt: skip
def test_index_shards_must_be_files_inside_the_folder(capsys, tmp_path, good, case):
    """The sentinel outside the folder is a valid checkpoint: reading it would be accepted."""
    sentinel = tmp_path / "outside" / "secret.safetensors"
    sentinel.parent.mkdir()
    save_file({"a": torch.full((4,), 7.0)}, sentinel)
    folder = tmp_path / "ckpt"
    shard = {
        "dotdot": "../outside/secret.safetensors",
        "absolute": str(sentinel),
        "symlink_out": "link.safetensors",
        "directory": "sub",
        "not_a_string": 3,
        "fifo": "pipe.safetensors",
    }[case]
    write_index(folder, {"a": shard})
    if case == "symlink_out":
        (folder / "link.safetensors").symlink_to(sentinel)
    if case == "directory":
        (folder / "sub").mkdir()
    if case == "fifo":
        os.mkfifo(folder / "pipe.safetensors")
    sentinel_atime = sentinel.stat().st_atime_ns
    before = snapshot(tmp_path)
    out = tmp_path / "merged"
    code, err, opened = run_cli(capsys, "merge", folder, "--base", good, "-m", "ta", "-o", out)
    fragment = {"dotdot": "points outside the folder", "absolute": "points outside the folder",
                "symlink_out": "leading outside", "directory": "is a folder",
                "not_a_string": "weight_map maps tensor names to shard file names",
                "fifo": "is a FIFO"}[case]  # fmt: skip
    assert_refused(code, err, str(folder), fragment)
    assert_not_read(opened, sentinel)
    assert sentinel.stat().st_atime_ns == sentinel_atime
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    ("index_text", "fragment"),
    [
        ('{"weight_map": {"a": "s1.safe', "not valid JSON"),
        ('[{"weight_map": {}}]', "bad index: expected a JSON object whose weight_map maps"),
        ('{"metadata": {}}', "bad index: expected a JSON object whose weight_map maps"),
        ('{"weight_map": ["s1.safetensors"]}', "bad index: expected a JSON object"),
        ('{"weight_map": {"a": "s9.safetensors"}}', "points at missing shard s9.safetensors "
         "(for tensor 'a')"),
        ('{"weight_map": {"a": "s1.safetensors", "zz": "s1.safetensors"}}', "tensor 'zz' listed "
         "in model.safetensors.index.json is not in this shard"),
    ],
)  # fmt: skip
def test_a_damaged_index_is_refused_naming_it(capsys, tmp_path, good, index_text, fragment):
    """An index cut short, of the wrong shape, naming a shard that is not there or a tensor
    its shard does not hold: one line naming the file at fault, nothing written."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"a": torch.ones(4)}, folder / "s1.safetensors")
    (folder / "model.safetensors.index.json").write_text(index_text)
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, "merge", folder, "--base", good, "-m", "ta",
                           "-o", tmp_path / "merged")  # fmt: skip
    assert_refused(code, err, str(folder), fragment)
    assert snapshot(tmp_path) == before


def test_an_index_that_omits_a_tensor_its_shard_holds_loses_nothing(capsys, tmp_path):
    """Transformers loads every tensor of a shard, so a map that forgets one still means it:
    the merge keeps it (ta of 2 models: base + both deltas) instead of dropping it."""
    base = tmp_path / "base"
    base.mkdir()
    save_file({"a": torch.ones(4), "b": torch.ones(2)}, base / "model.safetensors")
    folder = tmp_path / "tuned"
    write_index(folder, {"a": "s1.safetensors"})  # "b" is in the shard but not in the map
    save_file({"a": torch.full((4,), 2.0), "b": torch.full((2,), 3.0)}, folder / "s1.safetensors")
    other = tmp_path / "other.safetensors"
    save_file({"a": torch.full((4,), 2.0), "b": torch.full((2,), 3.0)}, other)
    out = tmp_path / "out.safetensors"
    code, _, _ = run_cli(capsys, "merge", folder, other, "--base", base, "-m", "ta", "-o", out)
    assert code == 0
    merged = load_file(out)
    assert torch.equal(merged["b"], torch.full((2,), 5.0))  # 1 + 2 x (3 - 1)
    assert torch.equal(merged["a"], torch.full((4,), 3.0))


def test_a_tensor_in_two_shards_is_refused_naming_both(capsys, tmp_path, good):
    folder = tmp_path / "ckpt"
    write_index(folder, {"a": "s1.safetensors", "b": "s2.safetensors"})
    save_file({"a": torch.ones(4)}, folder / "s1.safetensors")
    save_file({"a": torch.zeros(4), "b": torch.ones(2)}, folder / "s2.safetensors")
    before = snapshot(tmp_path)
    code, err, _ = run_cli(
        capsys, "merge", folder, "--base", good, "-m", "ta", "-o", tmp_path / "out"
    )
    line = assert_refused(code, err, str(folder), "is in two shards")
    assert "s1.safetensors" in line and "s2.safetensors" in line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("special", ["fifo", "/dev/zero", "folder_symlink_out"])
def test_special_files_as_inputs_never_block_or_stream(capsys, tmp_path, good, special):
    if special == "fifo":
        bad = tmp_path / "in.safetensors"
        os.mkfifo(bad)
        fragment = "is a FIFO"
    elif special == "/dev/zero":
        bad, fragment = Path("/dev/zero"), "is a device"
    else:
        (tmp_path / "elsewhere").mkdir()
        save_file({"a": torch.ones(4)}, tmp_path / "elsewhere" / "model.safetensors")
        bad = tmp_path / "folder"
        bad.mkdir()
        (bad / "model.safetensors").symlink_to(tmp_path / "elsewhere" / "model.safetensors")
        fragment = "leading outside"
    code, err, opened = run_cli(
        capsys, "merge", bad, "--base", good, "-m", "ta", "-o", tmp_path / "o.safetensors"
    )
    assert_refused(code, err, str(bad), fragment)
    assert_not_read(opened, tmp_path / "elsewhere")
    assert not (tmp_path / "o.safetensors").exists()


def test_control_characters_in_names_stay_on_one_line(capsys, tmp_path, good):
    bad = tmp_path / "evil\n\x1b[31mname\u202e.safetensors"
    bad.write_bytes(raw_file(entries(a={**F32_4, "data_offsets": [0, 16]}), bytes(20)))
    code, err, _ = run_cli(capsys, "merge", bad, "--base", good, "-m", "ta", "-o", tmp_path / "o")
    line = assert_refused(code, err, "evil\\n\\x1b[31mname\\u202e.safetensors")
    assert "\x1b" not in line and "\u202e" not in line


# -- fuzz: never a traceback, never accept what safetensors refuses -------------------------------
def valid_file() -> bytes:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "v.safetensors"
        tensors = {
            "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "b": torch.arange(3, dtype=torch.float16),
            "i": torch.tensor([1, 2]),
        }
        save_file(tensors, path, metadata={"format": "pt"})
        return path.read_bytes()


VALID = valid_file()
MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(VALID) - 1), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, len(VALID) - 1), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, len(VALID)), st.integers(0, 255)),
    st.tuples(st.just("digit"), st.integers(8, 8 + 200), st.integers(0, 9)),
)


def mutate(raw: bytes, mutations) -> bytes:
    data = bytearray(raw)
    for kind, position, value in mutations:
        position = min(position, len(data))
        if kind == "flip" and position < len(data):
            data[position] ^= value
        elif kind == "cut":
            del data[position:]
        elif kind == "insert":
            data[position:position] = bytes([value])
        elif kind == "digit" and position < len(data) and chr(data[position]).isdigit():
            data[position] = ord(str(value))
    return bytes(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(MUTATION, min_size=1, max_size=4))
def test_fuzzed_headers_never_crash_and_never_accept_what_safetensors_refuses(mutations):
    data = mutate(VALID, mutations)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "f.safetensors"
        path.write_bytes(data)
        try:
            with open_checkpoint(path) as reader:
                ours = {name: reader.get(name) for name in reader.names()}
        except CheckpointError:
            return  # refused with a message: fine (we may be stricter than safetensors)
        with safe_open(path, framework="pt") as theirs:  # raises if safetensors refuses
            assert sorted(theirs.keys()) == sorted(ours)
            for name, tensor in ours.items():
                assert torch.equal(theirs.get_tensor(name).view(torch.uint8),
                                   tensor.view(torch.uint8))  # fmt: skip


def hub_cache_snapshot(root: Path, state: dict[str, torch.Tensor]) -> Path:
    """The Hugging Face hub cache layout: ``snapshots/REV/model.safetensors`` is a relative
    symlink to ``blobs/HASH``."""
    repository = root / "models--org--tiny"
    (repository / "blobs").mkdir(parents=True)
    save_file(state, repository / "blobs" / "0123abcd")
    snapshot_folder = repository / "snapshots" / "rev1"
    snapshot_folder.mkdir(parents=True)
    (snapshot_folder / "model.safetensors").symlink_to("../../blobs/0123abcd")
    return snapshot_folder


def test_hub_cache_snapshots_merge_and_other_links_out_are_still_refused(capsys, tmp_path):
    base = {"a": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    finetuned = {"a": torch.tensor([2.0, 2.0, 5.0, 0.0])}
    base_file = tmp_path / "base.safetensors"
    save_file(base, base_file)
    snapshot_folder = hub_cache_snapshot(tmp_path / "hub", finetuned)
    out = tmp_path / "merged.safetensors"
    code, err, _ = run_cli(capsys, "merge", snapshot_folder, "--base", base_file, "-m", "ta",
                           "--scale", "0.5", "-o", out)  # fmt: skip
    assert code == 0, err
    with safe_open(out, "pt") as merged:  # base + 0.5 * (finetuned - base), by hand
        assert merged.get_tensor("a").tolist() == [1.5, 2.0, 4.0, 2.0]

    sentinel = tmp_path / "outside.safetensors"
    save_file(finetuned, sentinel)
    (snapshot_folder / "model.safetensors").unlink()
    (snapshot_folder / "model.safetensors").symlink_to(sentinel)
    code, err, opened = run_cli(capsys, "merge", snapshot_folder, "--base", base_file, "-m",
                                "ta", "-o", tmp_path / "again.safetensors")  # fmt: skip
    assert_refused(code, err, str(snapshot_folder), "leading outside")
    assert_not_read(opened, sentinel)
