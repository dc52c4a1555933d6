"""PEFT LoRA adapters as task vectors through `mloco merge`, against dense float64 deltas.

Adapters are written in PEFT's on-disk format (as ``peft`` 0.21's ``save_pretrained`` writes it
for a Llama: ``base_model.model.<module>.lora_A.weight`` (r x in), ``...lora_B.weight``
(out x r) and ``adapter_config.json``), since peft is not a dependency.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from checkpoint_factory import load_state_dict, save_model, tiny_llama, write_state_dict
from test_cli_merge import assert_one_line_error, run_main
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
    base_state, deltas = float64_inputs(base, folders)
    written = dense_deltas(out, base_state)
    divisor = 3 if method == "mean" else 1
    for name in base_state:
        expected = 0.5 * sum(delta[name] for delta in deltas) / divisor
        np.testing.assert_allclose(written[name], expected, rtol=0, atol=1e-7)
    code, _, err = run_main(capsys, "merge", *folders, "--method", "ta", "--lora-output", "-o", out)
    assert code == 2
    assert_one_line_error(err, str(out), "exists", "--force")


def test_lora_output_of_other_methods_is_an_error(adapters, tmp_path, capsys):
    base, folders = adapters
    code, _, err = run_main(
        capsys, "merge", *folders, "--method", "iso-c", "--lora-output", "-o", tmp_path / "o"
    )
    assert code == 2
    assert_one_line_error(err, "--lora-output", "only ta and mean", "iso-c")
