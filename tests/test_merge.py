"""merge_checkpoints: streamed merges checked against float64 formulas and in-memory merges."""

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from checkpoint_factory import load_state_dict, make_family, write_state_dict

from mergekit_loco import MergeMethod, TaskVector, get_method
from mergekit_loco.io import CheckpointError, OutputExistsError
from mergekit_loco.merge import MissingBaseError, merge_checkpoints


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A float32 base and 2 fine-tunes, as sharded HF folders."""
    return make_family(tmp_path_factory.mktemp("sharded"), count=2, layout="sharded")


@pytest.fixture(scope="module")
def bf16_files(tmp_path_factory):
    """A bfloat16 base and 3 fine-tunes, as single .safetensors files."""
    return make_family(
        tmp_path_factory.mktemp("bf16"), count=3, layout="file", dtype=torch.bfloat16
    )


def float64_states(base, models):
    base_state = {n: t.double() for n, t in load_state_dict(base).items()}
    return base_state, [{n: t.double() for n, t in load_state_dict(m).items()} for m in models]


def test_ta_equals_float64_formula_sharded_in_file_out(sharded, tmp_path):
    base, models = sharded
    out = tmp_path / "merged.safetensors"
    summary = merge_checkpoints(models, base, "ta", out, scale=0.7, progress=False)
    base_state, model_states = float64_states(base, models)
    merged = load_state_dict(out)
    assert set(merged) == set(base_state)
    for name, theta in base_state.items():
        expected = theta + 0.7 * sum(state[name] - theta for state in model_states)
        assert merged[name].dtype == torch.float32
        torch.testing.assert_close(merged[name].double(), expected, rtol=0, atol=1e-6)
    assert (summary.tensors_merged, summary.tensors_copied) == (len(base_state), 0)
    assert summary.out == out and summary.method == "ta" and summary.models == 2
    assert summary.seconds > 0 and summary.peak_rss_bytes > 2**20


def test_bf16_base_gives_bf16_output(bf16_files, tmp_path):
    base, models = bf16_files
    out = tmp_path / "merged.safetensors"
    merge_checkpoints(models, base, "ta", out, scale=0.5, progress=False)
    base_state, model_states = float64_states(base, models)
    merged = load_state_dict(out)
    for name, theta in base_state.items():
        expected = (theta + 0.5 * sum(state[name] - theta for state in model_states)).bfloat16()
        assert merged[name].dtype == torch.bfloat16
        # float32 math may round differently from float64 at a bf16 rounding boundary: 1 ulp.
        torch.testing.assert_close(merged[name], expected, rtol=2**-7, atol=1e-6)


def test_dtype_option_overrides_base_dtype(bf16_files, tmp_path):
    base, models = bf16_files
    out = tmp_path / "merged.safetensors"
    merge_checkpoints(models[:2], base, "ta", out, dtype=torch.float32, progress=False)
    base_state, model_states = float64_states(base, models[:2])
    merged = load_state_dict(out)
    for name, theta in base_state.items():
        expected = theta + sum(state[name] - theta for state in model_states)
        assert merged[name].dtype == torch.float32
        torch.testing.assert_close(merged[name].double(), expected, rtol=0, atol=1e-6)


def test_arguments_of_the_wrong_kind_are_type_errors_naming_them(bf16_files, tmp_path):
    """One path for the list of models (before: its characters were read as paths, "/: given
    twice"), and a dtype's name for a torch.dtype (before: an AttributeError)."""
    base, models = bf16_files
    out = tmp_path / "m.safetensors"
    with pytest.raises(TypeError, match=r"models: a list of checkpoints"):
        merge_checkpoints(str(models[0]), base, "ta", out, progress=False)
    for option in ("dtype", "compute_dtype"):
        with pytest.raises(TypeError, match=rf"{option}: a torch.dtype \(torch.bfloat16\)"):
            merge_checkpoints(models[:2], base, "ta", out, progress=False, **{option: "bfloat16"})
    assert not out.exists()


def test_mean_without_base_is_mean_of_models(sharded, tmp_path):
    _, models = sharded
    out = tmp_path / "soup"
    summary = merge_checkpoints(models, None, "mean", out, progress=False)
    states = [{n: t.double() for n, t in load_state_dict(m).items()} for m in models]
    merged = load_state_dict(out)
    for name in states[0]:
        expected = sum(state[name] for state in states) / len(states)
        torch.testing.assert_close(merged[name].double(), expected, rtol=0, atol=1e-6)
    assert summary.tensors_merged == len(states[0])
    assert (out / "config.json").is_file()  # configs come from the first model


def test_float64_checkpoints_are_merged_in_float64(tmp_path):
    """float64 inputs are not rounded through the float32 compute default: --scale 0 gives the
    base bit for bit, and ta equals the float64 formula to float64 rounding."""
    base = {"w": torch.full((3, 2), 1 + 1e-12, dtype=torch.float64)}
    tuned = [{"w": base["w"] + 1e-13 * (i + 1)} for i in range(2)]
    paths = [write_state_dict(t, tmp_path / f"m{i}.safetensors") for i, t in enumerate(tuned)]
    base_path = write_state_dict(base, tmp_path / "base.safetensors")
    for scale in (0.0, 1.0):
        out = tmp_path / f"out{scale}.safetensors"
        merge_checkpoints(paths, base_path, "ta", out, scale=scale, progress=False)
        merged = load_state_dict(out)["w"]
        expected = base["w"] + scale * sum(t["w"] - base["w"] for t in tuned)
        assert merged.dtype == torch.float64
        torch.testing.assert_close(merged, expected, rtol=0, atol=1e-15)
        if scale == 0:
            assert torch.equal(merged, base["w"])


def test_integer_tensors_are_copied_from_base(tmp_path):
    base = {"w": torch.ones(2, 3), "position_ids": torch.arange(5)}
    models = [
        write_state_dict(
            {"w": torch.full((2, 3), 1.0 + i), "position_ids": torch.arange(5) * i},
            tmp_path / f"m{i}.safetensors",
        )
        for i in (1, 2)
    ]
    base_path = write_state_dict(base, tmp_path / "base.safetensors")
    out = tmp_path / "out.safetensors"
    summary = merge_checkpoints(models, base_path, "ta", out, progress=False)
    merged = load_state_dict(out)
    assert torch.equal(merged["position_ids"], torch.arange(5))
    assert torch.equal(merged["w"], torch.full((2, 3), 1.0 + 1.0 + 2.0))
    assert (summary.tensors_merged, summary.tensors_copied) == (1, 1)


@pytest.mark.parametrize("method", ["mean", "ta", "ties", "tsv", "iso-c", "iso-cts"])
def test_a_tensor_without_entries_is_written_empty(tmp_path, method):
    """A zero-size tensor (here a 0-row matrix beside a real one) merges to an empty tensor of
    its shape; the other tensors merge as if it were absent (ta: base + sum of the deltas)."""
    generator = torch.Generator().manual_seed(5)
    base = {"w": torch.randn(6, 4, generator=generator), "empty": torch.zeros(0, 4)}
    tuned = [
        {"w": base["w"] + 0.1 * torch.randn(6, 4, generator=generator), "empty": torch.zeros(0, 4)}
        for _ in range(2)
    ]
    paths = [write_state_dict(t, tmp_path / f"m{i}.safetensors") for i, t in enumerate(tuned)]
    base_path = write_state_dict(base, tmp_path / "base.safetensors")
    out = tmp_path / "out.safetensors"
    merge_checkpoints(paths, base_path, method, out, progress=False)
    merged = load_state_dict(out)
    assert merged["empty"].shape == (0, 4) and merged["w"].isfinite().all()
    if method == "ta":
        expected = sum(t["w"].double() - base["w"].double() for t in tuned) + base["w"].double()
        torch.testing.assert_close(merged["w"].double(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("ties", {"density": 0.3}),
        ("dare", {"density": 0.7, "seed": 3}),
        ("breadcrumbs", {"density": 0.8, "gamma": 0.05}),
        ("tsv", {}),
        ("iso-c", {"spectral": "exact"}),
        ("iso-cts", {"common_fraction": 0.5}),
    ],
)
def test_streamed_merge_equals_in_memory_merge(sharded, tmp_path, method, params):
    """Streaming one tensor at a time gives what the method gives on whole task vectors."""
    base, models = sharded
    out = tmp_path / "merged"
    merge_checkpoints(models, base, method, out, scale=0.8, progress=False, **params)
    task_vectors = [TaskVector.from_checkpoints(model, base) for model in models]
    expected = (
        get_method(method, **params).merge(task_vectors).apply_to(load_state_dict(base), scale=0.8)
    )
    merged = load_state_dict(out)
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-5, atol=1e-6)


def test_method_object_is_accepted_but_not_with_params(sharded, tmp_path):
    base, models = sharded
    method = get_method("ties", density=0.5)
    merge_checkpoints(models, base, method, tmp_path / "a.safetensors", progress=False)
    with pytest.raises(ValueError, match="density"):
        merge_checkpoints(models, base, method, tmp_path / "b.safetensors", density=0.2)
    assert not (tmp_path / "b.safetensors").exists()


class Unnamed(MergeMethod):
    """A custom method without a ``name``: it used to merge, write and commit the output,
    then raise AttributeError reading the name for the summary."""

    def merge_tensor(self, name, deltas):
        return deltas[0]


@dataclass(frozen=True)
class Smallest(MergeMethod):
    """A user's method of its own math: ``merged = min_t tau_t`` (entrywise)."""

    name = "smallest"

    def merge_tensor(self, name, deltas):
        return torch.stack(list(deltas)).amin(dim=0)


@pytest.mark.parametrize("out_name", ["merged.safetensors", "merged"])
def test_a_method_object_without_a_name_is_refused_before_anything_is_written(
    sharded, tmp_path, out_name
):
    base, models = sharded
    with pytest.raises(TypeError, match="Unnamed: a merge method needs a name"):
        merge_checkpoints(models, base, Unnamed(), tmp_path / out_name, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_a_named_user_method_merges_streamed_like_its_formula(sharded, tmp_path):
    base, models = sharded
    out = tmp_path / "merged.safetensors"
    summary = merge_checkpoints(models, base, Smallest(), out, progress=False)
    base_state, model_states = float64_states(base, models)
    merged = load_state_dict(out)
    for name, theta in base_state.items():
        smallest = torch.minimum(*(state[name] - theta for state in model_states))
        torch.testing.assert_close(merged[name].double(), theta + smallest, rtol=0, atol=1e-6)
    assert summary.method == "smallest"


def test_scale_takes_any_real_number(sharded, tmp_path):
    """``scale=np.float32(0.5)`` was refused as "not a finite number"; now it merges the bits
    ``scale=0.5`` does. A bool, a string or a tensor is still refused."""
    base, models = sharded
    merge_checkpoints(models, base, "ta", tmp_path / "a.safetensors", scale=0.5, progress=False)
    merge_checkpoints(
        models, base, "ta", tmp_path / "b.safetensors", scale=np.float32(0.5), progress=False
    )
    first, second = (
        load_state_dict(tmp_path / "a.safetensors"),
        load_state_dict(tmp_path / "b.safetensors"),
    )
    assert all(torch.equal(first[name], second[name]) for name in first)
    for scale in (True, "0.5", torch.tensor(0.5), float("nan")):
        with pytest.raises(ValueError, match="--scale: .* is not a finite number in"):
            merge_checkpoints(models, base, "ta", tmp_path / "c.safetensors", scale=scale)
    assert not (tmp_path / "c.safetensors").exists()


def test_missing_base_explains_and_shows_the_command(sharded, tmp_path):
    _, models = sharded
    with pytest.raises(MissingBaseError) as caught:
        merge_checkpoints(models, None, "ties", tmp_path / "out", density=0.5)
    message = str(caught.value)
    assert "--base" in message and "fine-tuned from" in message and "model - base" in message
    assert f"mloco merge {models[0]} {models[1]} --base BASE --method ties -o" in message
    assert "--method mean" in message


# -- bad inputs: named errors, nothing written ---------------------------------------------------

BASE = {"a.weight": torch.ones(4, 4), "b.bias": torch.zeros(4)}


def broken_model(how: str) -> tuple[dict, str]:
    """A model state dict that does not fit BASE, and a regex the error must match."""
    model = {name: tensor + 0.1 for name, tensor in BASE.items()}
    if how == "missing_key":
        del model["b.bias"]
        return model, r"m\.safetensors: tensor 'b\.bias' of the base .*base\.safetensors.* missing"
    if how == "extra_key":
        model["c.weight"] = torch.ones(2)
        return model, r"m\.safetensors: tensor 'c\.weight' is not in the base"
    if how == "shape":
        model["a.weight"] = torch.ones(4, 5)
        return model, r"m\.safetensors: tensor 'a\.weight' has shape \[4, 5\] but the base"
    if how == "kind":
        model["b.bias"] = torch.zeros(4, dtype=torch.int32)
        return model, r"m\.safetensors: tensor 'b\.bias' is integer .* the base's is float"
    if how == "nan":
        model["b.bias"][2] = float("nan")
        return model, r"m\.safetensors: tensor 'b\.bias' contains NaN"
    if how == "inf":
        model["a.weight"][0, 1] = float("-inf")
        return model, r"m\.safetensors: tensor 'a\.weight' contains Inf"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["missing_key", "extra_key", "shape", "kind", "nan", "inf"])
@pytest.mark.parametrize("out_name", ["out.safetensors", "out"])
def test_bad_inputs_raise_named_errors_and_write_nothing(tmp_path, how, out_name):
    base = write_state_dict(BASE, tmp_path / "base.safetensors")
    good = write_state_dict({n: t - 0.1 for n, t in BASE.items()}, tmp_path / "good.safetensors")
    model, message = broken_model(how)
    broken = write_state_dict(model, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match=message):
        merge_checkpoints([good, broken], base, "ta", tmp_path / out_name, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "base.safetensors",
        "good.safetensors",
        "m.safetensors",
    ]


def test_nan_in_base_is_named(tmp_path):
    base = write_state_dict({"w": torch.tensor([1.0, float("nan")])}, tmp_path / "base.safetensors")
    model = write_state_dict({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    with pytest.raises(CheckpointError, match=r"base\.safetensors: tensor 'w' contains NaN"):
        merge_checkpoints([model], base, "ta", tmp_path / "out.safetensors", progress=False)


def test_overflow_in_output_dtype_is_an_error(tmp_path):
    base = write_state_dict({"w": torch.full((2,), 60000.0)}, tmp_path / "base.safetensors")
    model = write_state_dict({"w": torch.full((2,), 65000.0)}, tmp_path / "m.safetensors")
    out = tmp_path / "out.safetensors"
    with pytest.raises(ValueError, match="'w' is not finite in torch.float16"):
        merge_checkpoints([model], base, "ta", out, scale=2, dtype=torch.float16, progress=False)
    assert not out.exists()


@pytest.mark.parametrize(
    "how",
    ["twice", "link", "folder_and_file", "folder_and_index", "base", "base_via_link",
     "base_folder_as_file"],
)  # fmt: skip
def test_a_checkpoint_given_twice_is_refused_naming_it(tmp_path, how):
    """The same checkpoint twice (by path, through a link, or as a folder and its weights file
    or index) would count twice; the base as a model is a zero task vector: both are refused
    before anything is written."""
    for folder in ("base", "m", "sharded"):
        (tmp_path / folder).mkdir()
    base = write_state_dict(BASE, tmp_path / "base" / "model.safetensors")
    model = write_state_dict(
        {n: t + 1 for n, t in BASE.items()}, tmp_path / "m" / "model.safetensors"
    )
    sharded = tmp_path / "sharded"
    write_state_dict({n: t + 2 for n, t in BASE.items()}, sharded / "model-1.safetensors")
    index = sharded / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {name: "model-1.safetensors" for name in BASE}}))
    link = tmp_path / "link.safetensors"
    link.symlink_to(base if how == "base_via_link" else model)
    models = {"twice": [model, model], "link": [model, link],
              "folder_and_file": [model.parent, model], "folder_and_index": [sharded, index],
              "base": [model, base], "base_via_link": [model, link],
              "base_folder_as_file": [model, base]}[how]  # fmt: skip
    base_given = base.parent if how == "base_folder_as_file" else base
    twice = how in ("twice", "link", "folder_and_file", "folder_and_index")
    fragment = "given twice as a model" if twice else "is the base"
    out = tmp_path / "out.safetensors"
    with pytest.raises(CheckpointError, match=fragment) as raised:
        merge_checkpoints(models, base_given, "ties", out, progress=False)
    assert str(models[1]) in str(raised.value)
    assert not out.exists()


def test_existing_output_refused_and_failed_force_keeps_it(tmp_path):
    base = write_state_dict(BASE, tmp_path / "base.safetensors")
    model, _ = broken_model("nan")
    broken = write_state_dict(model, tmp_path / "m.safetensors")
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"previous merge")
    same = write_state_dict(BASE, tmp_path / "same.safetensors")
    with pytest.raises(OutputExistsError, match="out.safetensors: output file exists"):
        merge_checkpoints([same], base, "ta", out, progress=False)
    with pytest.raises(CheckpointError, match="contains NaN"):
        merge_checkpoints([broken], base, "ta", out, force=True, progress=False)
    assert out.read_bytes() == b"previous merge"
    merge_checkpoints([same], base, "ta", out, force=True, progress=False)
    assert torch.equal(load_state_dict(out)["a.weight"], BASE["a.weight"])


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("iso-c", r"iso-c: the deltas of tensor 'w' overflow torch.float32 .*--compute-dtype "
                  "float64"),
        ("ties", r"ties: delta 1 of tensor 'w' holds NaN or Inf \(a damaged checkpoint, a "
                 r"diverged worker, or a difference beyond its dtype's range\)"),
    ],
)  # fmt: skip
def test_finite_models_whose_differences_overflow_are_named(tmp_path, method, message):
    """3e38 - (-3e38) is beyond float32 (before: iso-c failed inside LAPACK, naming nothing)."""
    base = write_state_dict({"w": torch.full((4, 3), -3e38)}, tmp_path / "base.safetensors")
    models = [
        write_state_dict({"w": torch.full((4, 3), 3e38)}, tmp_path / f"m{i}.safetensors")
        for i in range(2)
    ]
    with pytest.raises(ValueError, match=message):
        merge_checkpoints(models, base, method, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
