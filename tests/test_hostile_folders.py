"""Hostile model folders and paths: an ambiguous folder, an empty path, a file replaced while it
is read, a header safetensors refuses, a tensor too big to allocate, shards shared between two
models. Each is driven through the CLI as a user would, and checked to lose nothing."""

from __future__ import annotations

import itertools
import json
import os
import struct
import subprocess
import time

import pytest
import torch
from hostile import assert_not_read, assert_refused, run_cli, snapshot
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mergekit_loco.io import CheckpointError, open_checkpoint, writer
from mergekit_loco.io.atomic import hidden_stem, process_tag
from mergekit_loco.io.reader import MAX_SHARD_NAMES


def write_index(folder, weight_map: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.fixture
def models(tmp_path):
    """base (a = 1), two fine-tunes (a = 2, a = 4) as single files in inputs/."""
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    for name, value in (("base", 1.0), ("ft1", 2.0), ("ft2", 4.0)):
        save_file({"a": torch.full((4,), value)}, inputs / f"{name}.safetensors")
    return inputs


def test_a_folder_with_both_a_single_file_and_an_index_is_refused_as_ambiguous(
    capsys, tmp_path, models
):
    folder = tmp_path / "tuned"
    write_index(folder, {"a": "model-00001-of-00001.safetensors"})
    save_file({"a": torch.full((4,), 100.0)}, folder / "model-00001-of-00001.safetensors")
    save_file({"a": torch.full((4,), 3.0)}, folder / "model.safetensors")  # what HF loads
    before = snapshot(tmp_path)
    ft1, base = models / "ft1.safetensors", models / "base.safetensors"
    code, err, _ = run_cli(capsys, "merge", folder, ft1, "--base", base, "-m", "ta", "-o",
                           tmp_path / "out")  # fmt: skip
    assert_refused(code, err, str(folder), "both model.safetensors and model.safetensors.index",
                   "ambiguous", str(folder / "model.safetensors"))  # fmt: skip
    assert snapshot(tmp_path) == before
    # naming the one meant merges it: ta = 1 + (3 - 1) + (2 - 1)
    out = tmp_path / "out.safetensors"
    code, err, _ = run_cli(capsys, "merge", folder / "model.safetensors", ft1, "--base", base,
                           "-m", "ta", "-o", out)  # fmt: skip
    assert code == 0, err
    assert load_file(out)["a"].tolist() == [4.0] * 4


@pytest.mark.parametrize("where", ["model", "base", "output", "config_model", "config_base"])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(
    capsys, tmp_path, models, monkeypatch, where
):
    """``--base "$BASE"`` with BASE unset: Path("") is ".", and a model.safetensors there would
    silently become the base."""
    monkeypatch.chdir(tmp_path)
    save_file({"a": torch.full((4,), 9.0)}, tmp_path / "model.safetensors")
    ft1, ft2, base = (str(models / f"{n}.safetensors") for n in ("ft1", "ft2", "base"))
    args = {
        "model": ["merge", ft1, "", "--base", base, "-m", "ta", "-o", "out"],
        "base": ["merge", ft1, ft2, "--base", "", "-m", "ta", "-o", "out"],
        "output": ["merge", ft1, ft2, "--base", base, "-m", "ta", "-o", ""],
    }
    config = tmp_path / "merge.yaml"
    if where == "config_model":
        config.write_text(f"merge_method: task_arithmetic\nbase_model: {base}\n"
                          f"models:\n  - model: {ft1}\n  - model: ''\n")  # fmt: skip
    elif where == "config_base":
        config.write_text(f"merge_method: task_arithmetic\nbase_model: ''\n"
                          f"models:\n  - model: {ft1}\n  - model: {ft2}\n")  # fmt: skip
    before = snapshot(tmp_path)
    code, err, _ = run_cli(capsys, *args.get(where, ["merge", "--config", config, "-o", "out"]))
    fragment = {"model": "'MODELS'", "base": "'--base'", "output": "'--output'"}
    expected = {"config_model": "models[2]", "config_base": "base_model"}
    assert_refused(code, err, "empty path", fragment.get(where) or expected[where])
    assert snapshot(tmp_path) == before


def test_a_file_replaced_after_its_header_was_read_is_refused(tmp_path):
    """The offsets of the old header must never be applied to another file's bytes."""
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(4)}, path)
    with open_checkpoint(path) as reader:  # headers are read now, data when asked for
        replacement = tmp_path / "new.safetensors"
        save_file({"b": torch.full((2,), 7.0), "a": torch.full((6,), 5.0)}, replacement)
        os.replace(replacement, path)  # what a download or a training run's save does
        with pytest.raises(CheckpointError, match=r"m\.safetensors: changed since its header"):
            reader.get("a")
    with open_checkpoint(path) as reader:  # opened again, the new file reads as it is
        assert reader.get("b").tolist() == [7.0, 7.0]
        os.replace(tmp_path / "m.safetensors", tmp_path / "moved.safetensors")
        assert reader.get("a").tolist() == [5.0] * 6  # the open file is the one its header read


def test_a_file_rewritten_in_place_between_tensors_is_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(4)}, path)
    with open_checkpoint(path) as reader:
        reader.get("a")  # the file is open now
        stamp = path.stat()
        with open(path, "r+b") as handle:  # same size, new bytes
            handle.seek(-4, os.SEEK_END)
            handle.write(struct.pack("<f", 3.0))
        os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000))
        with pytest.raises(CheckpointError, match="changed since its header"):
            reader.get("b")


def raw_file(header: str, data: bytes = b"") -> bytes:
    encoded = header.encode()
    return struct.pack("<Q", len(encoded)) + encoded + data


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        ('{"w\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "lone surrogate"),
        (
            '{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
            '"__metadata__": {"note": "\\udc00"}}',
            "lone surrogate",
        ),  # fmt: skip
        ('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [-0, 4]}}', "data_offsets"),
        ('{"w": {"dtype": "F32", "shape": [-0], "data_offsets": [0, 0]}}', "shape"),
    ],
)
def test_headers_safetensors_refuses_are_refused_too(capsys, tmp_path, models, header, fragment):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(raw_file(header, bytes(4 if '"shape": [1]' in header else 0)))
    with pytest.raises(Exception):  # noqa: B017 - the reference refuses it, whatever its type
        with safe_open(path, framework="pt") as theirs:
            theirs.keys()
    code, err, _ = run_cli(capsys, "merge", path, "--base", models / "base.safetensors", "-m",
                           "ta", "-o", tmp_path / "out")  # fmt: skip
    assert_refused(code, err, str(path), fragment)
    assert not (tmp_path / "out").exists()


def test_a_surrogate_pair_escape_is_text_and_loads(tmp_path):
    path = tmp_path / "emoji.safetensors"
    path.write_bytes(raw_file('{"w\\ud83d\\ude00": {"dtype": "F32", "shape": [1], '
                              '"data_offsets": [0, 4]}}', struct.pack("<f", 2.5)))  # fmt: skip
    with open_checkpoint(path) as reader, safe_open(path, framework="pt") as theirs:
        assert reader.names() == list(theirs.keys()) == ["w\N{GRINNING FACE}"]
        assert reader.get("w\N{GRINNING FACE}").tolist() == [2.5]


def test_a_tensor_too_big_to_allocate_is_named(capsys, tmp_path, models, monkeypatch):
    """A header may declare a tensor the machine cannot hold (a sparse file of 1 TB costs no
    disk): the allocator's RuntimeError becomes one line naming the file, tensor and size."""
    path = tmp_path / "huge.safetensors"
    save_file({"a": torch.full((4,), 2.0, dtype=torch.float64)}, path)  # 32 bytes, base's 16
    real_empty = torch.empty

    def refusing_empty(*args, **kwargs):
        if args and args[0] == 32 and kwargs.get("dtype") == torch.uint8:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", refusing_empty)
    code, err, _ = run_cli(capsys, "merge", path, "--base", models / "base.safetensors", "-m",
                           "ta", "-o", tmp_path / "out.safetensors")  # fmt: skip
    assert_refused(code, err, str(path), "tensor 'a' needs 32 bytes", "more memory")


def test_an_index_naming_one_shard_two_ways_reads_it_once(capsys, tmp_path, models):
    folder = tmp_path / "tuned"
    write_index(folder, {"a": "s1.safetensors", "b": "./s1.safetensors"})
    save_file({"a": torch.full((4,), 3.0), "b": torch.full((2,), 5.0)}, folder / "s1.safetensors")
    base = tmp_path / "base.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(2)}, base)
    out = tmp_path / "out.safetensors"
    code, err, _ = run_cli(capsys, "merge", folder, "--base", base, "-m", "ta", "-o", out)
    assert code == 0, err
    assert load_file(out)["b"].tolist() == [5.0, 5.0]


def spellings_of(name: str, count: int) -> list[str]:
    """``count`` distinct spellings of one file: ``./name``, ``.//name``, ``././name``..."""
    prefixes = (
        "".join(parts)
        for size in itertools.count(1)
        for parts in itertools.product(("./", ".//"), repeat=size)
    )
    return [prefix + name for prefix in itertools.islice(prefixes, count)]


def test_an_index_naming_too_many_shards_is_refused_at_once(capsys, tmp_path):
    """Before, one shard under 20000 spellings (``./s``, ``.//s``...) took 30 s to refuse (each
    spelling scanned the whole map); now the count is checked before any shard is looked at,
    and MAX_SHARD_NAMES spellings of one file still merge, the file read once."""
    names = [f"t{i}" for i in range(MAX_SHARD_NAMES)]
    folder = tmp_path / "tuned"
    folder.mkdir()
    save_file({name: torch.tensor([3.0]) for name in names}, folder / "s.safetensors")
    base = tmp_path / "base.safetensors"
    save_file({name: torch.tensor([1.0]) for name in names}, base)
    out = tmp_path / "out.safetensors"
    spellings = spellings_of("s.safetensors", MAX_SHARD_NAMES + 1)
    write_index(folder, dict(zip([*names, "extra"], spellings, strict=True)))
    started = time.monotonic()
    code, err, opened = run_cli(capsys, "merge", folder, "--base", base, "-m", "ta", "-o", out)
    assert_refused(code, err, "model.safetensors.index.json: bad index: its weight_map names "
                   f"{MAX_SHARD_NAMES + 1} shard files, more than {MAX_SHARD_NAMES}")  # fmt: skip
    assert_not_read(opened, folder / "s.safetensors")
    assert time.monotonic() - started < 5
    write_index(folder, dict(zip(names, spellings[:-1], strict=True)))
    code, err, _ = run_cli(capsys, "merge", folder, "--base", base, "-m", "ta", "-o", out, "-q")
    assert code == 0, err
    assert set(load_file(out)) == set(names)
    assert all(value.tolist() == [3.0] for value in load_file(out).values())


@pytest.mark.parametrize("file_name", ["config.json", "tokenizer.json"])
def test_an_oversized_config_file_of_the_base_is_refused_before_merging(
    capsys, tmp_path, models, file_name
):
    """Before, a sparse 400 MB config.json in the base folder was read whole (peak memory up
    by twice its size) and copied into the output. A config or tokenizer file over 100 MB is
    refused naming it, before any tensor is merged; one of exactly 100 MB is copied."""
    base = tmp_path / "base"
    base.mkdir()
    save_file({"a": torch.ones(4)}, base / "model.safetensors")
    limit = writer.MAX_CONFIG_FILE_BYTES
    with open(base / file_name, "wb") as handle:
        handle.truncate(limit + 1)
    out = tmp_path / "merged"
    before = snapshot(tmp_path)
    args = ["merge", models / "ft1.safetensors", "--base", base, "-m", "ta", "-o", out]
    code, err, _ = run_cli(capsys, *args)
    assert_refused(code, err, f"{base / file_name}: {limit + 1} bytes, more than a config or "
                   "tokenizer file may hold")  # fmt: skip
    assert snapshot(tmp_path) == before
    os.truncate(base / file_name, limit)
    code, err, _ = run_cli(capsys, *args, "-q")
    assert code == 0, err
    assert (out / file_name).stat().st_size == limit


def hub_snapshots(root, shards: dict[str, dict[str, dict[str, torch.Tensor]]]):
    """A hub-cache repository whose revisions are sharded folders of symlinks into blobs/; a
    shard equal across revisions is one blob (as the hub stores it)."""
    repository = root / "models--org--tiny"
    blobs = repository / "blobs"
    blobs.mkdir(parents=True)
    folders = {}
    for revision, files in shards.items():
        folder = repository / "snapshots" / revision
        weight_map = {}
        for shard, state in files.items():
            blob = blobs / "".join(f"{n}{int(t.sum())}" for n, t in sorted(state.items()))
            if not blob.exists():
                save_file(state, blob)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / shard).symlink_to(os.path.relpath(blob, folder))
            weight_map |= dict.fromkeys(state, shard)
        write_index(folder, weight_map)
        folders[revision] = folder
    return folders


def test_two_revisions_sharing_a_frozen_shard_are_two_models(capsys, tmp_path):
    """The hub cache (or a dedup tool's hard links) keeps one file for a shard two models share;
    they are still two models, and a base sharing a shard is still the base of both."""
    frozen = {"emb": torch.ones(3)}
    folders = hub_snapshots(tmp_path / "hub", {
        "base": {"s1.safetensors": frozen, "s2.safetensors": {"w": torch.full((2,), 1.0)}},
        "rev1": {"s1.safetensors": frozen, "s2.safetensors": {"w": torch.full((2,), 3.0)}},
        "rev2": {"s1.safetensors": frozen, "s2.safetensors": {"w": torch.full((2,), 5.0)}},
    })  # fmt: skip
    out = tmp_path / "out.safetensors"
    code, err, _ = run_cli(capsys, "merge", folders["rev1"], folders["rev2"], "--base",
                           folders["base"], "-m", "ta", "-o", out)  # fmt: skip
    assert code == 0, err
    merged = load_file(out)  # 1 + (3 - 1) + (5 - 1)
    assert merged["w"].tolist() == [7.0, 7.0] and merged["emb"].tolist() == [1.0] * 3
    # the same model by two paths is still refused: a folder and its index file
    code, err, _ = run_cli(capsys, "merge", folders["rev1"],
                           folders["rev1"] / "model.safetensors.index.json", "--base",
                           folders["base"], "-m", "ta", "-o", tmp_path / "again")  # fmt: skip
    assert_refused(code, err, "given twice as a model")


def test_a_yaml_keeps_a_model_that_shares_a_shard_with_its_base(capsys, tmp_path):
    """mergekit lists the base among the models, and mloco drops it there; a fine-tune that
    merely shares a frozen shard with the base must not be dropped with it."""
    frozen = {"emb": torch.ones(3)}
    folders = hub_snapshots(tmp_path / "hub", {
        "base": {"s1.safetensors": frozen, "s2.safetensors": {"w": torch.full((2,), 1.0)}},
        "rev1": {"s1.safetensors": frozen, "s2.safetensors": {"w": torch.full((2,), 3.0)}},
    })  # fmt: skip
    config = tmp_path / "merge.yaml"
    config.write_text(f"merge_method: task_arithmetic\nbase_model: {folders['base']}\nmodels:\n"
                      f"  - model: {folders['base']}\n  - model: {folders['rev1']}\n"
                      "parameters:\n  weight: 0.5\n")  # fmt: skip
    out = tmp_path / "out.safetensors"
    code, err, _ = run_cli(capsys, "merge", "--config", config, "-o", out)
    assert code == 0, err
    assert load_file(out)["w"].tolist() == [2.0, 2.0]  # 1 + 0.5 (3 - 1)


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_an_existing_output_that_is_no_checkpoint_is_never_offered_force(
    capsys, tmp_path, models, kind
):
    out = tmp_path / "notes"
    if kind == "file":
        out.write_text("the user's notes")
    else:
        out.mkdir()
        (out / "todo.txt").write_text("the user's")
    before = snapshot(tmp_path)
    ft1, base = models / "ft1.safetensors", models / "base.safetensors"
    for force in ([], ["--force"]):
        code, err, _ = run_cli(capsys, "merge", ft1, "--base", base, "-m", "ta", "-o", out, *force)
        line = assert_refused(code, err, str(out), "is not a checkpoint", "remove it yourself")
        assert "add --force" not in line
    assert snapshot(tmp_path) == before


def test_a_long_output_name_is_written_replaced_and_its_leftovers_cleared(capsys, tmp_path, models):
    """A legal 240-byte name leaves no room for ``.NAME.tmp-HOST-PID-XXXX`` (255 bytes at most):
    the hidden names beside it shorten the name with a hash, so it writes, replaces and cleans
    up like any other."""
    out = tmp_path / ("é" * 114 + ".safetensors")  # 240 bytes
    ft1, base = models / "ft1.safetensors", models / "base.safetensors"
    for force in ([], ["--force"]):
        code, err, _ = run_cli(capsys, "merge", ft1, "--base", base, "-m", "ta", "-o", out, *force)
        assert code == 0, err
    assert load_file(out)["a"].tolist() == [2.0] * 4
    ended = subprocess.Popen(["true"])  # a writer of this host that has ended
    ended.wait()
    host = process_tag().rsplit("-", 1)[0]
    (tmp_path / f".{hidden_stem(out)}.tmp-{host}-{ended.pid}-x").mkdir()
    code, err, _ = run_cli(capsys, "merge", ft1, "--base", base, "-m", "ta", "-o", out, "--force")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["inputs", out.name])


def test_a_folder_holding_a_model_and_adapter_weights_is_one_checkpoint(capsys, tmp_path, models):
    """A folder read as the base (its model.safetensors) given again as its model.safetensors
    is refused, though the folder also holds adapter weights."""
    folder = tmp_path / "tuned"
    folder.mkdir()
    save_file({"a": torch.full((4,), 2.0)}, folder / "model.safetensors")
    save_file({"x": torch.ones(1, 2)}, folder / "adapter_model.safetensors")
    code, err, _ = run_cli(capsys, "merge", folder / "model.safetensors", "--base", folder, "-m",
                           "ta", "-o", tmp_path / "out")  # fmt: skip
    assert_refused(code, err, "is the base")


def test_the_python_api_takes_any_iterable_of_models(tmp_path, models):
    from mergekit_loco.merge import merge_checkpoints

    out = tmp_path / "out.safetensors"
    paths = (models / f"ft{i}.safetensors" for i in (1, 2))  # a generator, read once
    merge_checkpoints(paths, models / "base.safetensors", "ta", out, progress=False)
    assert load_file(out)["a"].tolist() == [5.0] * 4  # 1 + (2 - 1) + (4 - 1)


def pairwise_same(first, second) -> bool:
    """same_checkpoint's rule, written out pair by pair (as it was computed before)."""
    from mergekit_loco.merge_checks import identity, is_weights_file, weight_files

    if first == second or (identity(first) is not None and identity(first) == identity(second)):
        return True
    ours, theirs = weight_files(first), weight_files(second)
    return bool(ours and theirs) and (
        ours == theirs
        or (is_weights_file(first) and ours <= theirs)
        or (is_weights_file(second) and theirs <= ours)
    )


def test_checkpoints_find_the_first_path_the_pairwise_rule_calls_the_same(tmp_path):
    """Every ordered choice of two or three paths among files, links, sharded folders, their
    index files, shards, a folder sharing one shard and missing paths: the first earlier path
    Checkpoints.find reports is the first the pairwise rule matches."""
    import itertools

    from mergekit_loco.merge_checks import Checkpoints, Fingerprint

    save_file({"a": torch.ones(4)}, tmp_path / "one.safetensors")
    (tmp_path / "link.safetensors").symlink_to(tmp_path / "one.safetensors")
    for name, shards in (("sharded", ("s1", "s2")), ("sharing", ("s1", "s3"))):
        folder = tmp_path / name
        write_index(folder, {shard: f"{shard}.safetensors" for shard in shards})
        for shard in shards:
            target = folder / f"{shard}.safetensors"
            if shard == "s1" and name == "sharing":
                os.link(tmp_path / "sharded" / "s1.safetensors", target)  # one shard, two folders
            else:
                save_file({shard: torch.ones(2)}, target)
    paths = [
        tmp_path / "one.safetensors", tmp_path / "link.safetensors", tmp_path / "sharded",
        tmp_path / "sharded" / "model.safetensors.index.json",
        tmp_path / "sharded" / "s1.safetensors", tmp_path / "sharded" / "s2.safetensors",
        tmp_path / "sharing", tmp_path / "missing.safetensors", tmp_path / "sharded/",
    ]  # fmt: skip
    checked = 0
    for size in (2, 3):
        for chosen in itertools.permutations(paths, size):
            *earlier, path = chosen
            seen = Checkpoints()
            for other in earlier:
                seen.add(Fingerprint.of(other))
            expected = next((other for other in earlier if pairwise_same(path, other)), None)
            assert seen.find(Fingerprint.of(path)) == expected, chosen
            checked += 1
    assert checked == 9 * 8 + 9 * 8 * 7


def test_a_merge_config_of_many_models_is_checked_in_linear_time(capsys, tmp_path, models):
    """Before, 3000 models took 89 s (each pair looked at on disk) before the first was found
    missing; each path is now looked at once."""
    text = "merge_method: ta\nbase_model: base.safetensors\nmodels:\n"
    text += "".join(f"  - m{index}.safetensors\n" for index in range(3000))
    config = models / "many.yml"
    config.write_text(text)
    started = time.monotonic()
    code, err, _ = run_cli(capsys, "merge", "--config", config, "-o", tmp_path / "out")
    assert time.monotonic() - started < 20
    assert_refused(code, err, "m0.safetensors")


def test_a_lora_folder_is_its_adapter_as_a_model_and_its_model_file_as_the_base(tmp_path):
    """A LoRA adapter folder that also holds the model it adapts: given as a model it is read as
    its adapter, so its model.safetensors as the base is another checkpoint; given as the base
    it is read as its model.safetensors."""
    from mergekit_loco.merge_checks import same_checkpoint

    folder = tmp_path / "a1"
    folder.mkdir()
    save_file({"a": torch.ones(4)}, folder / "model.safetensors")
    save_file({"x": torch.ones(1, 2)}, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text("{}")
    assert not same_checkpoint(folder, folder / "model.safetensors", second_is_base=True)
    assert same_checkpoint(folder, folder / "adapter_model.safetensors")
    assert same_checkpoint(folder / "model.safetensors", folder, second_is_base=True)
