"""PEFT LoRA adapters as task vectors through `mloco merge`, against dense float64 deltas.

Adapters are written in PEFT's on-disk format (as ``peft`` 0.21's ``save_pretrained`` writes it
for a Llama: ``base_model.model.<module>.lora_A.weight`` (r x in), ``...lora_B.weight``
(out x r) and ``adapter_config.json``), since peft is not a dependency.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from checkpoint_factory import load_state_dict, save_model, tiny_llama, write_state_dict
from test_cli_merge import assert_one_line_error, run_main, temp_leftovers
from test_ties_threshold import reference_ties

from mergekit_loco.low_rank import LowRankDelta, low_rank_svd

TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")


def write_adapter(folder, base_state, rank, alpha, seed, rslora=False, **config):
    """A LoRA adapter of the tiny Llama's q/v/down projections with random A and B."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for target in TARGETS:
            out, inp = base_state[f"model.layers.{layer}.{target}.weight"].shape
            key = f"base_model.model.model.layers.{layer}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=generator) * 0.1
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.1
    folder.mkdir()
    write_state_dict(tensors, folder / "adapter_model.safetensors")
    settings = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "use_rslora": rslora,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "target_modules": ["q_proj", "v_proj", "down_proj"],
    } | config
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = save_model(tiny_llama(0), root / "base")
    state = load_state_dict(base)
    folders = [
        write_adapter(root / "a1", state, rank=2, alpha=4, seed=1),
        write_adapter(root / "a2", state, rank=3, alpha=6, seed=2, rslora=True),
        write_adapter(root / "a3", state, rank=2, alpha=2, seed=3),
    ]
    return base, folders


def dense_deltas(folder, base_state) -> dict[str, np.ndarray]:
    """``scaling * B @ A`` per base tensor in float64 (zeros where not adapted)."""
    config = json.loads((folder / "adapter_config.json").read_text())
    rank, alpha = config["r"], config["lora_alpha"]
    scaling = alpha / math.sqrt(rank) if config["use_rslora"] else alpha / rank
    factors = {
        n: t.double().numpy()
        for n, t in load_state_dict(folder / "adapter_model.safetensors").items()
    }
    deltas = {name: np.zeros(t.shape) for name, t in base_state.items()}
    for key in factors:
        if key.endswith("lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            lora_b = factors[key.replace("lora_A", "lora_B")]
            deltas[f"{module}.weight"] = scaling * lora_b @ factors[key]
    return deltas


def float64_inputs(base, folders):
    base_state = {n: t.double().numpy() for n, t in load_state_dict(base).items()}
    return base_state, [dense_deltas(folder, base_state) for folder in folders]


def rank_aware_iso_c(summed: np.ndarray) -> np.ndarray:
    left, singular, right = np.linalg.svd(summed, full_matrices=False)
    rank = np.linalg.matrix_rank(summed)
    if rank == 0:
        return np.zeros_like(summed)
    return singular[:rank].mean() * left[:, :rank] @ right[:rank]


def merged_state(capsys, *args) -> dict[str, np.ndarray]:
    out = args[-1]
    code, _, err = run_main(capsys, "merge", *args[:-1], "-o", out, "--quiet")
    assert code == 0, err
    return {n: t.double().numpy() for n, t in load_state_dict(out).items()}


def no_dense_deltas(monkeypatch):
    def refuse(self, like):
        raise AssertionError("a dense m x n delta was built")

    monkeypatch.setattr(LowRankDelta, "dense", refuse)


def test_iso_c_from_the_factors_equals_the_dense_computation(
    adapters, tmp_path, capsys, monkeypatch
):
    base, folders = adapters
    no_dense_deltas(monkeypatch)
    merged = merged_state(
        capsys,
        *folders,
        "--base",
        base,
        "--method",
        "iso-c",
        "--rank-aware",
        "--compute-dtype",
        "float64",
        tmp_path / "out.safetensors",
    )
    base_state, deltas = float64_inputs(base, folders)
    for name, theta in base_state.items():
        summed = sum(delta[name] for delta in deltas)
        expected = rank_aware_iso_c(summed) if summed.ndim == 2 else summed / 3
        # float64 math, written in the base's float32: within one float32 ulp
        np.testing.assert_allclose(merged[name], theta + expected, rtol=2**-23, atol=1e-9)


@pytest.mark.parametrize("method", ["ta", "mean"])
def test_sums_of_adapters(adapters, tmp_path, capsys, monkeypatch, method):
    base, folders = adapters
    no_dense_deltas(monkeypatch)
    merged = merged_state(
        capsys,
        *folders,
        "--base",
        base,
        "--method",
        method,
        "--scale",
        "0.5",
        tmp_path / "out.safetensors",
    )
    base_state, deltas = float64_inputs(base, folders)
    divisor = 3 if method == "mean" else 1
    for name, theta in base_state.items():
        expected = theta + 0.5 * sum(delta[name] for delta in deltas) / divisor
        np.testing.assert_allclose(merged[name], expected, rtol=0, atol=1e-6)


def test_other_methods_get_dense_deltas(adapters, tmp_path, capsys):
    base, folders = adapters
    merged = merged_state(
        capsys,
        *folders[:2],
        "--base",
        base,
        "--method",
        "ties",
        "--density",
        "0.5",
        "--compute-dtype",
        "float64",
        tmp_path / "out.safetensors",
    )
    base_state, deltas = float64_inputs(base, folders[:2])
    for name, theta in base_state.items():
        expected = reference_ties([delta[name] for delta in deltas], 0.5)
        # float64 math, written in the base's float32: within one float32 ulp
        np.testing.assert_allclose(merged[name], theta + expected, rtol=2**-23, atol=1e-9)


def test_low_rank_svd_matches_numpy():
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(40, 6, generator=generator, dtype=torch.float64)
    right = torch.randn(6, 30, generator=generator, dtype=torch.float64)
    u, singular, vh = low_rank_svd(left, right)
    dense = (left @ right).numpy()
    np.testing.assert_allclose(singular.numpy(), np.linalg.svd(dense, compute_uv=False)[:6])
    np.testing.assert_allclose((u * singular @ vh).numpy(), dense, atol=1e-12)
    np.testing.assert_allclose((u.mT @ u).numpy(), np.eye(6), atol=1e-12)


@pytest.mark.parametrize(
    ("config", "fragments"),
    [
        ({"use_dora": True}, ["'use_dora' is true", "DoRA"]),
        ({"bias": "all"}, ["'bias' is \"all\""]),
        ({"modules_to_save": ["lm_head"]}, ["modules_to_save"]),
        ({"alora_invocation_tokens": [5, 6]}, ["'alora_invocation_tokens'", "invocation"]),
        ({"layer_replication": [[0, 1], [0, 2]]}, ["'layer_replication'", "copies"]),
    ],
)
def test_unsupported_adapter_options_are_named(adapters, tmp_path, capsys, config, fragments):
    base, _ = adapters
    folder = write_adapter(tmp_path / "bad", load_state_dict(base), 2, 4, 5, **config)
    code, _, err = run_main(
        capsys, "merge", folder, "--base", base, "--method", "ta", "-o", tmp_path / "out"
    )
    assert code == 2
    assert_one_line_error(err, "adapter_config.json", *fragments)


@pytest.mark.parametrize(
    ("config", "fragments"),
    [
        ({"lora_alpha": "8"}, ["lora_alpha must be a positive finite number", '"8"']),
        ({"lora_alpha": None}, ["lora_alpha must be a positive finite number"]),
        ({"lora_alpha": [4]}, ["lora_alpha must be a positive finite number"]),
        ({"r": True}, ["r must be a positive integer below 2**31, not true"]),
        ({"r": 0}, ["r must be a positive integer below 2**31, not 0"]),
        ({"r": 10**400, "use_rslora": True}, ["r must be a positive integer below 2**31"]),
        ({"r": 3}, ["factors of rank 2, but adapter_config.json gives rank 3"]),
        ({"rank_pattern": {"q_proj": 0}}, ["rank_pattern['q_proj'] must be a positive integer"]),
        ({"rank_pattern": [1, 2]}, ["'rank_pattern' must be an object of module names"]),
        ({"alpha_pattern": {"q_proj": "big"}}, ["alpha_pattern['q_proj'] must be a positive"]),
        (
            {"alpha_pattern": {"q_proj(": 8}},
            ['adapter_config.json: alpha_pattern key "q_proj(" is not a regular expression'],
        ),
        (
            {"rank_pattern": {"q" * 1001: 2}},
            ["adapter_config.json: rank_pattern key", "has 1001 characters, more than 1000"],
        ),
        ({"use_rslora": "yes"}, ["'use_rslora' must be true or false"]),
    ],
)
def test_adapter_settings_of_the_wrong_type_or_rank_are_one_line(
    adapters, tmp_path, capsys, config, fragments
):
    """Each bad value gets one line naming the config file and the setting, exit 2, for the
    merge and for --lora-output alike, never a traceback and never a silent wrong scaling."""
    base, _ = adapters
    folder = write_adapter(tmp_path / "bad", load_state_dict(base), 2, 4, 5, **config)
    for extra in ([], ["--lora-output"]):
        out = tmp_path / f"out{len(extra)}"
        code, _, err = run_main(
            capsys, "merge", folder, "--base", base, "--method", "ta", "-o", out, *extra
        )
        assert code == 2
        assert_one_line_error(err, *fragments)
        assert not out.exists()


def test_an_adapter_config_that_is_not_an_object_is_one_line(adapters, tmp_path, capsys):
    base, _ = adapters
    folder = write_adapter(tmp_path / "bad", load_state_dict(base), 2, 4, 5)
    (folder / "adapter_config.json").write_text("[1, 2]")
    code, _, err = run_main(
        capsys, "merge", folder, "--base", base, "-m", "ta", "-o", tmp_path / "o"
    )
    assert code == 2
    assert_one_line_error(err, "adapter_config.json", "must hold a JSON object")


def test_adapter_without_base_and_foreign_modules_are_errors(adapters, tmp_path, capsys):
    base, folders = adapters
    code, _, err = run_main(capsys, "merge", folders[0], "--method", "mean", "-o", tmp_path / "o")
    assert code == 2
    assert_one_line_error(err, str(folders[0]), "LoRA adapter", "--base")
    other = save_model(tiny_llama(0, hidden_size=8, intermediate_size=16), tmp_path / "other")
    capsys.readouterr()  # transformers may draw a progress bar while saving
    code, _, err = run_main(
        capsys, "merge", folders[0], "--base", other, "--method", "ta", "-o", tmp_path / "o"
    )
    assert code == 2
    assert_one_line_error(err, str(folders[0]), "does not give the base's shape")


def test_a_yaml_lambda_without_base_model_scales_adapters(adapters, tmp_path, capsys):
    """Adapters are deltas: a ``--config`` YAML with ``lambda`` and no ``base_model`` merged with
    ``--lora-output`` writes ``lambda * sum_t delta_t`` (as ``--scale`` does on the command
    line); only a merge into full weights needs a base to scale."""
    base, folders = adapters
    config = tmp_path / "adapters.yml"
    models = "".join(f"  - model: {folder}\n" for folder in folders)
    config.write_text(f"merge_method: ta\nmodels:\n{models}parameters: {{lambda: 0.5}}\n")
    out = tmp_path / "scaled-adapter"
    code, _, err = run_main(capsys, "merge", "--config", config, "--lora-output", "-o", out)
    assert code == 0, err
    base_state, deltas = float64_inputs(base, folders)
    written = dense_deltas(out, base_state)
    for name in base_state:
        expected = 0.5 * sum(delta[name] for delta in deltas)
        np.testing.assert_allclose(written[name], expected, rtol=0, atol=1e-7)


def test_a_linear_yaml_of_adapters_keeps_its_base_model(adapters, tmp_path, capsys):
    """mergekit's ``linear`` averages whole models, so its base_model is dropped; an adapter is
    a delta of that base, so with adapters listed the base stays: ``sum_t w_t theta_t`` with
    ``theta_t = base + delta_t`` (before: ``ad1 is a LoRA adapter: give --base``, which a config
    file cannot take). Without base_model the error says what to add to the file."""
    base, folders = adapters
    config = tmp_path / "linear.yml"
    models = "".join(f"  - model: {folder}\n    parameters: {{weight: {weight}}}\n"
                     for folder, weight in zip(folders[:2], (1, 3), strict=True))  # fmt: skip
    config.write_text(f"merge_method: linear\nbase_model: {base}\nmodels:\n{models}")
    out = tmp_path / "linear.safetensors"
    code, _, err = run_main(capsys, "merge", "--config", config, "-o", out, "-q")
    assert code in (0, None), err
    base_state, deltas = float64_inputs(base, folders[:2])
    merged = load_state_dict(out)
    for name, tensor in base_state.items():
        expected = 0.25 * (tensor + deltas[0][name]) + 0.75 * (tensor + deltas[1][name])
        np.testing.assert_allclose(merged[name].double().numpy(), expected, rtol=0, atol=1e-6)
    without = tmp_path / "no-base.yml"
    without.write_text(f"merge_method: linear\nmodels:\n{models}")
    code, _, err = run_main(capsys, "merge", "--config", without, "-o", tmp_path / "x", "-q")
    assert code == 2
    assert_one_line_error(err, f"{without}: {folders[0]} is a LoRA adapter (a delta): add "
                          f"'base_model: BASE' to {without}, BASE the model it adapts")  # fmt: skip


@pytest.mark.parametrize("method", ["ta", "mean"])
def test_lora_output_is_exactly_the_merged_delta(adapters, tmp_path, capsys, method):
    base, folders = adapters
    out = tmp_path / "merged-adapter"
    code, _, err = run_main(
        capsys,
        "merge",
        *folders,
        "--base",
        base,
        "--method",
        method,
        "--scale",
        "0.5",
        "--lora-output",
        "-o",
        out,
        "--quiet",
    )
    assert code == 0, err
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (7, 7, False)
    assert config["rank_pattern"] == {} and config["peft_type"] == "LORA"
    assert set(config["target_modules"]) == {  # full names (before: "q_proj", which PEFT
        f"model.layers.{layer}.{target}" for layer in range(2) for target in TARGETS
    }  # would also match elsewhere, and "0" for a module inside an nn.Sequential)
    base_state, deltas = float64_inputs(base, folders)
    written = dense_deltas(out, base_state)
    divisor = 3 if method == "mean" else 1
    for name in base_state:
        expected = 0.5 * sum(delta[name] for delta in deltas) / divisor
        np.testing.assert_allclose(written[name], expected, rtol=0, atol=1e-7)
    code, _, err = run_main(capsys, "merge", *folders, "--method", "ta", "--lora-output", "-o", out)
    assert code == 2
    assert_one_line_error(err, str(out), "exists", "--force")


def test_lora_output_drops_the_first_inputs_module_selection(adapters, tmp_path, capsys):
    """The first adapter excludes a module the second adapts (before: its exclude_modules was
    copied into the merged config, and PEFT dropped the second's delta there)."""
    base, folders = adapters
    excluding = write_adapter(
        tmp_path / "excluding", load_state_dict(base), 2, 4, 7,
        exclude_modules=["model.layers.0.self_attn.q_proj"],
    )  # fmt: skip
    out = tmp_path / "merged-adapter"
    code, _, err = run_main(
        capsys, "merge", excluding, folders[1], "--base", base, "-m", "ta", "--lora-output",
        "-o", out, "--quiet",
    )  # fmt: skip
    assert code == 0, err
    config = json.loads((out / "adapter_config.json").read_text())
    assert "exclude_modules" not in config
    assert "model.layers.0.self_attn.q_proj" in config["target_modules"]


def test_lora_output_of_other_methods_is_an_error(adapters, tmp_path, capsys):
    base, folders = adapters
    code, _, err = run_main(
        capsys, "merge", *folders, "--method", "iso-c", "--lora-output", "-o", tmp_path / "o"
    )
    assert code == 2
    assert_one_line_error(err, "--lora-output", "only ta and mean", "iso-c")


# Hostile adapters: each is refused in one line naming the file and tensor, nothing written.

LORA_A = "base_model.model.a.lora_A.weight"
LORA_B = "base_model.model.a.lora_B.weight"
#: factors of a delta of the tiny base's ``a.weight`` (4 x 3), rank 2
FACTORS = {LORA_A: torch.ones(2, 3), LORA_B: torch.ones(4, 2)}


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    """A base file with float ``a.weight`` (4 x 3) and integer ``counts.weight`` (4 x 3)."""
    file = tmp_path_factory.mktemp("tiny") / "base.safetensors"
    state = {"a.weight": torch.zeros(4, 3), "counts.weight": torch.zeros(4, 3, dtype=torch.int64)}
    return write_state_dict(state, file)


def write_factors(folder, tensors, **config):
    """An adapter folder holding ``tensors`` as given, with r 2 and lora_alpha 4 by default."""
    folder.mkdir()
    write_state_dict(tensors, folder / "adapter_model.safetensors")
    settings = {"peft_type": "LORA", "r": 2, "lora_alpha": 4} | config
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return folder


def assert_refused(capsys, out, args, *fragments) -> None:
    """``mloco merge ARGS -o OUT`` exits 2 with one error line holding ``fragments`` and leaves
    nothing at OUT (nor a staging leftover beside it)."""
    code, _, err = run_main(capsys, "merge", *args, "-o", out, "--quiet")
    assert code == 2, err
    assert_one_line_error(err, *fragments)
    assert not out.exists() and not temp_leftovers(out.parent)


def assert_refused_by_both(capsys, tmp_path, models, base, *fragments) -> None:
    """The dense merge onto ``base`` and ``--lora-output`` (with and without ``base``) refuse."""
    dense = [*models, "--base", base, "-m", "ta"]
    assert_refused(capsys, tmp_path / "dense.safetensors", dense, *fragments)
    for extra in ([], ["--base", base]):
        lora = [*models, "-m", "ta", "--lora-output", *extra]
        assert_refused(capsys, tmp_path / "adapter", lora, *fragments)


@pytest.mark.parametrize(
    ("tensors", "config", "key", "fragments"),
    [
        ({LORA_A: torch.ones(6), LORA_B: torch.ones(4, 2)}, {}, LORA_A, ["must be a non-empty"]),
        ({**FACTORS, LORA_A: torch.ones(2, 3, 1)}, {}, LORA_A, ["floating-point matrix"]),
        ({**FACTORS, LORA_B: torch.tensor(1.0)}, {}, LORA_B, ["shape []", "matrix"]),
        ({**FACTORS, LORA_A: torch.ones(0, 3)}, {}, LORA_A, ["shape [0, 3]", "matrix"]),
        ({**FACTORS, LORA_A: torch.ones(2, 3, dtype=torch.int64)}, {}, LORA_A, ["torch.int64"]),
        ({**FACTORS, LORA_A: torch.ones(3, 3)}, {}, "'a.weight'", ["factors' ranks differ"]),
        ({**FACTORS, LORA_A: torch.full((2, 3), math.nan)}, {}, LORA_A, ["contains NaN"]),
        ({**FACTORS, LORA_B: torch.full((4, 2), -math.inf)}, {}, LORA_B, ["contains Inf"]),
        (FACTORS, {"lora_alpha": 1e308}, LORA_B, ["times its scaling 5e+307 overflows"]),
        ({**FACTORS, "a.lora_A.weight": torch.ones(2, 3)}, {}, LORA_A, ["'a.lora_A.weight'"]),
        ({}, {}, "holds no LoRA factors", []),
    ],
    ids=["1-d", "3-d", "0-d", "empty", "int", "ranks", "nan", "inf", "alpha", "two-names", "none"],
)
def test_bad_factors_are_refused_naming_the_file_and_tensor(
    tiny_base, tmp_path, capsys, tensors, config, key, fragments
):
    """Factors that are not finite floating-point matrices of one rank, a module's factor under
    two names (``base_model.model.a`` and ``a``) and an adapter without factors are refused by
    the dense merge and by --lora-output alike, never merged in part or written."""
    folder = write_factors(tmp_path / "bad", tensors, **config)
    file = str(folder / "adapter_model.safetensors")
    assert_refused_by_both(capsys, tmp_path, [folder], tiny_base, file, key, *fragments)


@pytest.mark.parametrize("file_name", ["adapter_config.json", "adapter_model.safetensors"])
def test_adapter_files_linked_from_outside_are_refused(tiny_base, tmp_path, capsys, file_name):
    folder = write_factors(tmp_path / "linked", FACTORS)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (folder / file_name).rename(elsewhere / file_name)
    (folder / file_name).symlink_to(elsewhere / file_name)
    fragments = [str(folder / file_name), "symlink leading outside", str(folder)]
    assert_refused_by_both(capsys, tmp_path, [folder], tiny_base, *fragments)


def test_an_adapter_of_an_integer_base_tensor_is_refused(tiny_base, tmp_path, capsys):
    """Integer tensors are copied from the base, so their LoRA delta would be dropped."""
    tensors = {key.replace(".a.", ".counts."): factor for key, factor in FACTORS.items()}
    folder = write_factors(tmp_path / "ints", tensors)
    fragments = [str(tiny_base), "'counts.weight' is torch.int64", str(folder), "floating-point"]
    dense = [folder, "--base", tiny_base, "-m", "ta"]
    assert_refused(capsys, tmp_path / "dense.safetensors", dense, *fragments)
    lora = [folder, "--base", tiny_base, "-m", "ta", "--lora-output"]
    assert_refused(capsys, tmp_path / "adapter", lora, *fragments)


def test_lora_output_refuses_a_repeated_adapter(tmp_path, capsys):
    folder = write_factors(tmp_path / "once", FACTORS)
    args = [folder, folder, "-m", "ta", "--lora-output"]
    assert_refused(capsys, tmp_path / "adapter", args, str(folder), "given twice")
    (tmp_path / "alias").symlink_to(folder)
    args = [folder, tmp_path / "alias", "-m", "ta", "--lora-output"]
    assert_refused(capsys, tmp_path / "adapter", args, "alias", "given twice", f"(as {folder})")


@pytest.mark.parametrize(
    ("factor", "fragments"),
    [
        ({LORA_A: torch.ones(2, 5)}, ["delta has shape [4, 5]", "gives [4, 3]"]),
        ({LORA_B: torch.ones(5, 2)}, ["delta has shape [5, 3]", "gives [4, 3]"]),
    ],
    ids=["A", "B"],
)
def test_lora_output_refuses_adapters_of_different_shapes(tmp_path, capsys, factor, fragments):
    first = write_factors(tmp_path / "first", FACTORS)
    other = write_factors(tmp_path / "other", FACTORS | factor)
    args = [first, other, "-m", "ta", "--lora-output"]
    fragments = [str(other), "'a.weight'", *fragments, str(first)]
    assert_refused(capsys, tmp_path / "adapter", args, *fragments)


@pytest.mark.parametrize(
    ("scale", "fragments"),
    [
        ("nan", ["--scale", "nan is not a finite number"]),
        ("inf", ["--scale", "inf is not a finite number"]),
        ("1e38", ["merged delta of 'a.weight' is not finite in float32"]),  # 2e38 * 2 overflows
    ],
    ids=["nan", "inf", "overflow"],
)
def test_lora_output_refuses_a_non_finite_result(tmp_path, capsys, scale, fragments):
    folder = write_factors(tmp_path / "ok", FACTORS)
    args = [folder, "-m", "ta", "--scale", scale, "--lora-output"]
    assert_refused(capsys, tmp_path / "adapter", args, *fragments)


@pytest.mark.parametrize("method", [["-m", "iso-c", "--rank-aware"], ["-m", "iso-c"], ["-m", "ta"]])
def test_an_adapter_whose_delta_overflows_is_refused_by_every_path(
    tiny_base, tmp_path, capsys, method
):
    """Finite factors of 1e20 whose delta B A (entries 2e40 x the scaling 2) is past float32.
    Before, rank-aware Iso-C (from the factors) merged it as a delta of rank 0, exit 0 with the
    base written unchanged: its core SVD's singular values were Inf, which no rank counts; the
    dense paths refused it."""
    big = {LORA_A: torch.full((2, 3), 1e20), LORA_B: torch.full((4, 2), 1e20)}
    folder = write_factors(tmp_path / "big", big)
    args = [folder, "--base", tiny_base, *method]
    assert_refused(capsys, tmp_path / "merged.safetensors", args, "'a.weight'")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_lora_output_writes_the_dtype_asked(adapters, tmp_path, capsys, dtype):
    """Before, ``--lora-output --dtype bfloat16`` wrote float32 factors (and --compute-dtype was
    ignored too). The factors ``B' = [scale scaling_t B_t]``, ``A' = [A_t]`` are formed in the
    compute dtype and written in --dtype; a --config file's out_dtype counts the same."""
    base, folders = adapters
    out = tmp_path / "adapter"
    code, _, err = run_main(capsys, "merge", *folders[:2], "--base", base, "-m", "ta",
                            "--scale", "0.5", "--lora-output", "--dtype", dtype,
                            "--compute-dtype", "float64", "-o", out, "-q")  # fmt: skip
    assert code in (0, None), err
    written = load_state_dict(out / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    factors = [load_state_dict(folder / "adapter_model.safetensors") for folder in folders[:2]]
    scalings = [4 / 2, 6 / math.sqrt(3)]  # a1: alpha 4, r 2; a2: alpha 6, r 3, rslora
    expected_b = torch.cat([0.5 * s * f[f"{key}.lora_B.weight"].double()
                            for s, f in zip(scalings, factors, strict=True)], 1)  # fmt: skip
    expected_a = torch.cat([f[f"{key}.lora_A.weight"].double() for f in factors], 0)
    assert {t.dtype for t in written.values()} == {getattr(torch, dtype)}
    assert torch.equal(written[f"{key}.lora_B.weight"], expected_b.to(getattr(torch, dtype)))
    assert torch.equal(written[f"{key}.lora_A.weight"], expected_a.to(getattr(torch, dtype)))
    config = tmp_path / "ta.yml"
    config.write_text(f"merge_method: ta\nbase_model: {base}\nmodels:\n"
                      + "".join(f"  - model: {folder}\n" for folder in folders[:2])
                      + f"out_dtype: {dtype}\n")  # fmt: skip
    code, _, err = run_main(capsys, "merge", "--config", config, "--lora-output",
                            "-o", tmp_path / "from-config", "-q")  # fmt: skip
    assert code in (0, None), err
    written = load_state_dict(tmp_path / "from-config" / "adapter_model.safetensors")
    assert {t.dtype for t in written.values()} == {getattr(torch, dtype)}


@pytest.mark.parametrize(
    ("extra", "out", "fragments"),
    [
        ([], "adapter.safetensors", ["-o", "adapter.safetensors", "writes an adapter folder"]),
        ([], ".safetensors", ["'.safetensors' alone names no output (it would be a hidden"]),
        (["--shard-size", "1GB"], "adapter", ["--shard-size cannot be given with --lora-output"]),
        (["--shard-size", "5GB"], "adapter", ["--shard-size cannot be given with --lora-output"]),
        (["--device", "cpu"], "adapter", ["--device cannot be given with --lora-output"]),
    ],
    ids=["file", "dot-file", "shard_size", "default_shard_size", "device"],
)
def test_lora_output_refuses_options_it_cannot_honour(tmp_path, capsys, extra, out, fragments):
    """Before, ``-o lo.safetensors`` made a folder named lo.safetensors, ``-o .safetensors`` a
    hidden folder, and --shard-size and --device were silently ignored: each is refused by
    name, nothing written."""
    folder = write_factors(tmp_path / "ok", FACTORS)
    args = [folder, "-m", "ta", "--lora-output", *extra]
    assert_refused(capsys, tmp_path / out, args, *fragments)


def test_lora_output_default_is_a_folder(tiny_base, tmp_path, capsys, monkeypatch):
    """Without -o, a .safetensors base made the default output ``merged-ta.safetensors``: an
    adapter is a folder, ``merged-ta``."""
    folder = write_factors(tmp_path / "ok", FACTORS)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, "merge", folder, "--base", tiny_base, "-m", "ta",
                              "--lora-output")  # fmt: skip
    assert code in (0, None), err
    assert "wrote the merged LoRA adapter to merged-ta (no -o given)" in out
    assert (tmp_path / "merged-ta" / "adapter_config.json").is_file()


# PEFT's rule for rank_pattern / alpha_pattern keys, weights of a mean, float64 adapters.


def test_rank_and_alpha_patterns_match_as_peft_matches_them(adapters, tmp_path, capsys):
    """PEFT takes a module's r and lora_alpha from the first key ``k`` (in the file's order) with
    ``re.match(rf"(.*\\.)?({k})$", module)``: a regular expression for the whole name or a dotted
    suffix of it. Before, keys were compared literally, so the regex rank_pattern below was
    ignored (rank 3, refused against factors of rank 2) and the regex alpha_pattern keys too."""
    base, _ = adapters
    folder = write_adapter(
        tmp_path / "patterned", load_state_dict(base), rank=2, alpha=4, seed=7, r=3,
        rank_pattern={r"layers\.\d\.(self_attn|mlp)\.[a-z_]+": 2},
        alpha_pattern={r"model\.layers\.1\..*": 8, r".*v_proj": 32, "down_proj": 1},
    )  # fmt: skip
    alphas = {  # by hand: the first key that applies, else lora_alpha 4
        "model.layers.0.self_attn.q_proj": 4,
        "model.layers.0.self_attn.v_proj": 32,
        "model.layers.0.mlp.down_proj": 1,
        **{f"model.layers.1.{target}": 8 for target in TARGETS},
    }
    merged = merged_state(capsys, folder, "--base", base, "--method", "ta", "--compute-dtype",
                          "float64", tmp_path / "out.safetensors")  # fmt: skip
    factors = {
        n: t.double() for n, t in load_state_dict(folder / "adapter_model.safetensors").items()
    }
    for module, alpha in alphas.items():
        key = f"base_model.model.{module}"
        delta = alpha / 2 * factors[f"{key}.lora_B.weight"] @ factors[f"{key}.lora_A.weight"]
        theta = load_state_dict(base)[f"{module}.weight"].double()
        np.testing.assert_allclose(
            merged[f"{module}.weight"], (theta + delta).numpy(), rtol=2**-23, atol=1e-9
        )


def peft_rank(config: dict, module: str) -> int:
    """PEFT's rank of ``module``: the first rank_pattern key matching as PEFT matches it."""
    for key, rank in config["rank_pattern"].items():
        if re.match(rf"(.*\.)?({key})$", module):
            return rank
    return config["r"]


def test_lora_output_rank_pattern_gives_each_module_its_rank(tmp_path, capsys):
    """The merged adapter's rank_pattern must give each module its rank under PEFT's rule: the
    key ``a`` (rank 4) also applies to module ``b.a`` (rank 2, the default), so ``b.a`` is
    listed too, before ``a``."""
    base = write_state_dict({name: torch.zeros(4, 3) for name in ("a.weight", "b.a.weight",
                             "c.weight")}, tmp_path / "base.safetensors")  # fmt: skip
    generator = torch.Generator().manual_seed(3)

    def factors(*modules):
        return {
            f"base_model.model.{module}.lora_{factor}.weight": torch.randn(
                shape, generator=generator
            )
            for module in modules
            for factor, shape in (("A", (2, 3)), ("B", (4, 2)))
        }

    first = write_factors(tmp_path / "first", factors("a", "b.a", "c"))
    second = write_factors(tmp_path / "second", factors("a"))
    out = tmp_path / "merged-adapter"
    code, _, err = run_main(capsys, "merge", first, second, "-m", "ta", "--lora-output",
                            "--compute-dtype", "float64", "-o", out)  # fmt: skip
    assert code in (0, None), err
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 2 and list(config["rank_pattern"].items()) == [("b.a", 2), ("a", 4)]
    written = load_state_dict(out / "adapter_model.safetensors")
    for module in ("a", "b.a", "c"):
        rank = written[f"base_model.model.{module}.lora_A.weight"].shape[0]
        assert peft_rank(config, module) == rank
    merged = merged_state(capsys, out, "--base", base, "-m", "ta", "--compute-dtype", "float64",
                          tmp_path / "back.safetensors")  # fmt: skip
    inputs = [load_state_dict(folder / "adapter_model.safetensors") for folder in (first, second)]
    for module in ("a", "b.a", "c"):
        key = f"base_model.model.{module}"
        expected = sum(
            2.0 * state[f"{key}.lora_B.weight"].double() @ state[f"{key}.lora_A.weight"].double()
            for state in inputs
            if f"{key}.lora_A.weight" in state
        )
        np.testing.assert_allclose(merged[f"{module}.weight"], expected.numpy(), rtol=2**-23,
                                   atol=1e-6)  # fmt: skip


def test_lora_output_rank_pattern_keys_match_their_own_module_only(tmp_path, capsys):
    """A key is a regular expression: ``x.a.b`` (rank 4) would also match module ``x.a_b``
    (rank 2, the default), whose factors would then disagree with its config on reading back
    (before: the merged adapter could not be read). Such a key is escaped; keys that match
    only their own modules stay plain names."""
    modules = {"x.a.b": 4, "x.a_b": 2, "q.proj": 4, "c": 2}
    generator = torch.Generator().manual_seed(5)
    tensors = {}
    for module, rank in modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(
            rank, 3, generator=generator
        )
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(
            4, rank, generator=generator
        )
    pattern = {r"x\.a\.b": 4, "q.proj": 4}  # scaling 1 everywhere
    first = write_factors(tmp_path / "first", tensors, r=2, lora_alpha=2, rank_pattern=pattern,
                          alpha_pattern=pattern)  # fmt: skip
    out = tmp_path / "merged-adapter"
    code, _, err = run_main(capsys, "merge", first, "-m", "ta", "--lora-output",
                            "--compute-dtype", "float64", "-o", out)  # fmt: skip
    assert code in (0, None), err
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["rank_pattern"] == pattern
    written = load_state_dict(out / "adapter_model.safetensors")
    for module, rank in modules.items():
        assert written[f"base_model.model.{module}.lora_A.weight"].shape[0] == rank
        assert peft_rank(config, module) == rank
    base = write_state_dict({f"{m}.weight": torch.zeros(4, 3) for m in modules},
                            tmp_path / "base.safetensors")  # fmt: skip
    merged = merged_state(capsys, out, "--base", base, "-m", "ta", "--compute-dtype", "float64",
                          tmp_path / "back.safetensors")  # fmt: skip
    for module in modules:
        key = f"base_model.model.{module}"
        expected = (
            tensors[f"{key}.lora_B.weight"].double() @ tensors[f"{key}.lora_A.weight"].double()
        )
        np.testing.assert_allclose(
            merged[f"{module}.weight"], expected.numpy(), rtol=1e-6, atol=1e-6
        )


@pytest.mark.parametrize(
    ("weights", "fragment"),
    [("1,-1", "mean: weights sum to 0"), ("1e308,1e308", "mean: weights (1e+308, 1e+308) sum")],
    ids=["zero", "overflow"],
)
def test_mean_weights_summing_to_zero_or_overflowing_are_refused_alike(
    adapters, tmp_path, capsys, weights, fragment
):
    """Before, adapters gave a ZeroDivisionError traceback (from the factors, and with
    --lora-output) and 1e308 weights ``error: intermediate overflow in fsum`` naming nothing.
    Adapters and full models now get one message, before anything is written."""
    base, folders = adapters
    state = load_state_dict(base)
    full = [
        write_state_dict({n: t + step for n, t in state.items()}, tmp_path / f"ft{i}.safetensors")
        for i, step in enumerate((0.1, -0.1))
    ]
    lines = []
    for models, extra in ((full, []), (folders[:2], []), (folders[:2], ["--lora-output"])):
        out = tmp_path / "out"
        code, _, err = run_main(capsys, "merge", *models, "--base", base, "-m", "mean",
                                "--option", f"weights={weights}", *extra, "-o", out)  # fmt: skip
        assert code == 2
        assert_one_line_error(err, fragment)
        assert not out.exists() and not temp_leftovers(tmp_path)
        lines.append(err)
    assert lines[0] == lines[1] == lines[2]


def test_a_weighted_mean_of_adapters_is_the_weighted_mean(adapters, tmp_path, capsys, monkeypatch):
    """``mean`` with weights 3, -1: ``(3 tau_1 - tau_2) / 2``, from the factors and as an
    adapter."""
    base, folders = adapters
    no_dense_deltas(monkeypatch)
    merged = merged_state(capsys, *folders[:2], "--base", base, "-m", "mean", "--option",
                          "weights=3,-1", "--compute-dtype", "float64",
                          tmp_path / "out.safetensors")  # fmt: skip
    out = tmp_path / "adapter"
    code, _, err = run_main(capsys, "merge", *folders[:2], "-m", "mean", "--option",
                            "weights=3,-1", "--lora-output", "-o", out)  # fmt: skip
    assert code in (0, None), err
    base_state, deltas = float64_inputs(base, folders[:2])
    written = dense_deltas(out, base_state)
    for name, theta in base_state.items():
        expected = (3 * deltas[0][name] - deltas[1][name]) / 2
        np.testing.assert_allclose(merged[name], theta + expected, rtol=2**-23, atol=1e-9)
        np.testing.assert_allclose(written[name], expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize("method", ["ta", "mean", "ties"])
def test_float64_adapters_on_a_float64_base_are_not_rounded_through_float32(
    tmp_path, capsys, method
):
    """A float64 tensor of the base is merged in float64 (docs/merging.md); before, an adapter's
    factors were read in the default compute dtype, float32, first (errors near 1e-8)."""
    generator = torch.Generator().manual_seed(11)
    base_state = {f"m{i}.weight": torch.randn(6, 5, generator=generator, dtype=torch.float64)
                  for i in range(2)}  # fmt: skip
    base = write_state_dict(base_state, tmp_path / "base.safetensors")
    folders = []
    for index in range(2):
        tensors = {}
        for name in base_state:
            key = f"base_model.model.{name.removesuffix('.weight')}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(
                2, 5, generator=generator, dtype=torch.float64
            )
            tensors[f"{key}.lora_B.weight"] = torch.randn(
                6, 2, generator=generator, dtype=torch.float64
            )
        folders.append(
            write_factors(tmp_path / f"a{index}", tensors, lora_alpha=3, use_rslora=False)
        )
    options = ["--density", "0.5"] if method == "ties" else []
    merged = merged_state(capsys, *folders, "--base", base, "-m", method, *options,
                          tmp_path / "out.safetensors")  # fmt: skip
    base_np, deltas = float64_inputs(base, folders)
    for name, theta in base_np.items():
        taus = [delta[name] for delta in deltas]
        if method == "ties":
            expected = reference_ties(taus, 0.5)
        else:
            expected = sum(taus) / (2 if method == "mean" else 1)
        assert merged[name].dtype == np.float64
        np.testing.assert_allclose(merged[name], theta + expected, rtol=0, atol=1e-13)


@pytest.mark.parametrize("file_name", ["adapter_model.safetensors", "adapter_config.json"])
def test_a_file_of_an_adapter_given_for_the_adapter_names_its_folder(
    tiny_base, tmp_path, capsys, file_name
):
    """A file inside an adapter folder given in place of the folder (before: the weights file
    was read as a whole model, `tensor 'a.weight' of the base ... is missing`; the config file
    got `give a .safetensors file instead`)."""
    folder = write_factors(tmp_path / "ad1", FACTORS)
    other = write_factors(tmp_path / "ad2", FACTORS)
    args = [folder / file_name, other, "--base", tiny_base, "-m", "ta"]
    assert_refused(capsys, tmp_path / "merged.safetensors", args,
                   f"{folder / file_name}: a file of the PEFT LoRA adapter {folder}; give the "
                   f"adapter's folder, {folder}, instead")  # fmt: skip
