"""LoRA adapters from strangers through `mloco merge`: catastrophic rank_pattern / alpha_pattern
keys, 8-bit float factors, and a --lora-output that cannot be written.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
from checkpoint_factory import load_state_dict, write_state_dict
from test_cli_merge import run_main, temp_leftovers
from test_merge_lora import assert_refused_by_both, write_factors

from mergekit_loco.io import lora

#: a module name on which a catastrophic key backtracks for about a second per match (not
#: hours: a regression fails the test instead of hanging it)
MODULE = "a" * 24


def factors_of(modules: dict[str, int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Random factors ``A`` (rank x 3) and ``B`` (4 x rank) per module -> rank."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, rank in modules.items():
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, 3, generator=generator)
        tensors[f"{key}.lora_B.weight"] = torch.randn(4, rank, generator=generator)
    return tensors


def zero_base(path: Path, modules) -> Path:
    """A base file with a zero 4 x 3 float32 ``M.weight`` per module ``M``."""
    return write_state_dict({f"{m}.weight": torch.zeros(4, 3) for m in modules}, path)


@pytest.mark.parametrize("option", ["rank_pattern", "alpha_pattern"])
@pytest.mark.parametrize(
    ("key", "choice"),
    [
        ("(a+)+b", "nests a repeat"),  # the reviewer's key: hours on 40 'a's
        ("(a*)*b", "nests a repeat"),
        ("(a?){30}a{30}", "nests a repeat"),  # optional parts under a counted repeat
        ("(a|a)*b", "nests an alternation"),  # overlapping branches: 2**n ways
        ("(a|aa)*b", "nests an alternation"),
        (r".*\.)*(b", "nests a repeat"),  # closes PEFT's group: (.*\.)?(.*\.)*(b)$
    ],
)
def test_catastrophic_pattern_keys_are_refused_naming_the_file_and_key(
    tmp_path, capsys, option, key, choice
):
    """Before, ``(a+)+b`` against a module of 40 'a's ran for hours. A key that nests a choice
    (a repeat of varying count, an alternation) inside a repeat of more than one count is
    refused before any module is matched, by the dense merge and --lora-output alike."""
    base = zero_base(tmp_path / "base.safetensors", [MODULE])
    folder = write_factors(tmp_path / "hostile", factors_of({MODULE: 2}), **{option: {key: 2}})
    config = str(folder / "adapter_config.json")
    started = time.monotonic()
    assert_refused_by_both(
        capsys, tmp_path, [folder], base, config, f"{option} key {json.dumps(key)}", choice,
        "inside a repeat: it can backtrack exponentially", "refused",
    )  # fmt: skip
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("key", [".*" * 10 + "b", ".*a.*a.*a.*b", r"(\w+)?\d*\.?\d*x"])
def test_pattern_keys_of_many_repeats_are_refused_before_any_match(tmp_path, capsys, key):
    """Before, ten ``.*`` in a row (no repeat nested in another) took 7 s on a module name of 31
    characters, growing steeply with its length: a failed match tries every way to share the
    name among the repeats (here, 100 characters: not waited for). A key of
    more than three repeats of varying count is refused, by the dense merge and --lora-output
    alike, before any module is matched."""
    module = "a" * 100
    base = zero_base(tmp_path / "base.safetensors", [module])
    folder = write_factors(tmp_path / "hostile", factors_of({module: 2}), rank_pattern={key: 2})
    config = str(folder / "adapter_config.json")
    started = time.monotonic()
    assert_refused_by_both(
        capsys, tmp_path, [folder], base, config, f"rank_pattern key {json.dumps(key)} holds",
        f"repeats (*, +, ? or {{m,n}}) in a row, more than the {lora.MAX_KEY_REPEATS} allowed",
        "refused",
    )  # fmt: skip
    assert time.monotonic() - started < 5


def test_pattern_keys_are_not_matched_against_overlong_module_names(tmp_path, capsys):
    """A module name of 2000 characters under a key of three repeats (allowed) would take
    minutes per failed match (4.5 s at 600 characters): refused, naming the config, the key
    and the name's length, by the dense merge and --lora-output alike; a name of 300
    characters, the most allowed, merges."""
    long_module = ("a." * 1000)[:2000]
    base = zero_base(tmp_path / "base.safetensors", [long_module])
    folder = write_factors(
        tmp_path / "long", factors_of({long_module: 2}), rank_pattern={".*.*.*z": 2}
    )
    started = time.monotonic()
    assert_refused_by_both(
        capsys, tmp_path, [folder], base, str(folder / "adapter_config.json"),
        'rank_pattern key ".*.*.*z" cannot be matched against module "a.a.a.',
        f"has 2000 characters, more than {lora.MAX_MODULE_CHARS}", "refused",
    )  # fmt: skip
    assert time.monotonic() - started < 5
    module = ("a." * 150)[: lora.MAX_MODULE_CHARS]
    base = zero_base(tmp_path / "base-300.safetensors", [module])
    tensors = factors_of({module: 2})
    folder = write_factors(
        tmp_path / "300", tensors, r=2, lora_alpha=4, rank_pattern={".*.*.*z": 8}
    )
    out = tmp_path / "out.safetensors"
    code, _, err = run_main(capsys, "merge", folder, "--base", base, "-m", "ta", "-o", out, "-q")
    assert code == 0, err
    key = f"base_model.model.{module}"
    expected = 4 / 2 * tensors[f"{key}.lora_B.weight"] @ tensors[f"{key}.lora_A.weight"]
    torch.testing.assert_close(load_state_dict(out)[f"{module}.weight"], expected)


def test_pattern_keys_real_adapters_use_still_apply(tmp_path, capsys):
    """Plain dotted names, ``.*q_proj``, ``\\d+`` and an alternation outside any repeat keep
    PEFT's meaning: each module gets r and lora_alpha from the first key that applies."""
    alpha_pattern = {
        "lm.head": 1,
        ".*q_proj": 16,
        r"model\.layers\.\d+\.mlp": 32,
        r"layers\.(0|1|2)\.self_attn": 64,
        r".*\.layers\.\d+\..*_proj": 8,  # three repeats: the most a key may hold
        ".*gate_proj|.*down_proj|.*o_proj": 2,  # one repeat on any path through it
    }
    alphas = {  # by hand: the first key that applies (rank 2), else r 3 and lora_alpha 4
        "lm.head": 1,
        "model.layers.2.self_attn.q_proj": 16,
        "model.layers.10.mlp": 32,
        "model.layers.1.self_attn": 64,
        "model.layers.7.self_attn": 4,
        "model.layers.3.mlp.up_proj": 8,
        "decoder.gate_proj": 2,
    }
    ranks = {module: 3 if alpha == 4 else 2 for module, alpha in alphas.items()}
    base = zero_base(tmp_path / "base.safetensors", alphas)
    tensors = factors_of(ranks)
    folder = write_factors(
        tmp_path / "patterned", tensors, r=3, lora_alpha=4,
        rank_pattern=dict.fromkeys(alpha_pattern, 2), alpha_pattern=alpha_pattern,
    )  # fmt: skip
    out = tmp_path / "out.safetensors"
    code, _, err = run_main(capsys, "merge", folder, "--base", base, "-m", "ta",
                            "--compute-dtype", "float64", "-o", out, "-q")  # fmt: skip
    assert code == 0, err
    merged = load_state_dict(out)
    for module, alpha in alphas.items():
        key = f"base_model.model.{module}"
        lora_b, lora_a = tensors[f"{key}.lora_B.weight"], tensors[f"{key}.lora_A.weight"]
        expected = (alpha / ranks[module] * lora_b.double() @ lora_a.double()).float()
        torch.testing.assert_close(merged[f"{module}.weight"], expected, rtol=0, atol=0)


def test_each_pattern_key_is_checked_once_not_per_module(tmp_path, capsys, monkeypatch):
    """A key is parsed, checked and compiled once per adapter read, however many modules it is
    matched against, and however many keys there are: before, a cache of 4096 keys thrashed
    above that, and 5000 keys on 100 modules took 58 s (4000: 3.9 s); now 20000 keys on 300
    modules take seconds."""
    compiled = []
    monkeypatch.setattr(lora, "_peft_regex", lambda key: compiled.append(key) or re.compile(
        rf"(.*\.)?({key})$"))  # fmt: skip
    modules = [f"blocks.{index}.proj" for index in range(300)]
    base = zero_base(tmp_path / "base.safetensors", modules)
    pattern = {r"blocks\.\d+\.proj": 2, r"blocks\.0\.other": 2}
    pattern |= {f"unused_{index}": 3 for index in range(20_000)}
    folder = write_factors(
        tmp_path / "many", factors_of(dict.fromkeys(modules, 2)), rank_pattern=pattern
    )
    started = time.monotonic()
    for output in (["out.safetensors"], ["adapter", "--lora-output"]):  # dense, then LoRA
        compiled.clear()
        code, _, err = run_main(capsys, "merge", folder, "--base", base, "-m", "ta",
                                "-o", tmp_path / output[0], *output[1:], "-q")  # fmt: skip
        assert code == 0, err
        assert sorted(compiled) == sorted(pattern)
    assert time.monotonic() - started < 60


def test_a_pattern_of_too_many_keys_is_refused(tmp_path, capsys):
    """More than MAX_PATTERN_KEYS keys (each module is matched against every key) is refused,
    naming the config and the option, by the dense merge and --lora-output alike."""
    base = zero_base(tmp_path / "base.safetensors", [MODULE])
    pattern = {f"m{index}": 2 for index in range(lora.MAX_PATTERN_KEYS + 1)}
    folder = write_factors(tmp_path / "keys", factors_of({MODULE: 2}), alpha_pattern=pattern)
    assert_refused_by_both(
        capsys, tmp_path, [folder], base, str(folder / "adapter_config.json"),
        f"alpha_pattern has {lora.MAX_PATTERN_KEYS + 1} keys, more than {lora.MAX_PATTERN_KEYS}",
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_an_8bit_float_adapter_merges_as_its_float32_upcast(tmp_path, capsys, dtype):
    """Before, F8_E4M3 / F8_E5M2 factors raised ``"isfinite" not implemented`` (a traceback) in
    the dense merge and in --lora-output. They are checked and computed in float32: the results
    are those of the same adapter stored as float32, bit for bit."""
    modules = ["a", "b.c"]
    base = zero_base(tmp_path / "base.safetensors", modules)
    narrow = {name: t.to(dtype) for name, t in factors_of(dict.fromkeys(modules, 2)).items()}
    upcast = {name: t.float() for name, t in narrow.items()}
    results = []
    for label, tensors in (("f8", narrow), ("f32", upcast)):
        folder = write_factors(tmp_path / label, tensors, lora_alpha=3)
        dense, adapter = tmp_path / f"{label}.safetensors", tmp_path / f"{label}-adapter"
        for args in (["--base", base, "-o", dense], ["--lora-output", "-o", adapter]):
            code, _, err = run_main(capsys, "merge", folder, "-m", "ta", *args, "-q")
            assert code == 0, err
        results.append(
            load_state_dict(dense) | load_state_dict(adapter / "adapter_model.safetensors")
        )
    assert results[0].keys() == results[1].keys()
    for name, tensor in results[0].items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, results[1][name]), name


def test_an_8bit_float_factor_holding_nan_is_refused(tmp_path, capsys):
    base = zero_base(tmp_path / "base.safetensors", ["a"])
    tensors = factors_of({"a": 2})
    tensors["base_model.model.a.lora_A.weight"][0, 0] = float("nan")
    folder = write_factors(tmp_path / "nan", {n: t.to(torch.float8_e4m3fn) for n, t in
                                              tensors.items()})  # fmt: skip
    file = str(folder / "adapter_model.safetensors")
    key = "'base_model.model.a.lora_A.weight'"
    assert_refused_by_both(capsys, tmp_path, [folder], base, file, key, "contains NaN")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into folders whatever their mode")
def test_lora_output_into_a_read_only_folder_names_the_output(tmp_path, capsys):
    """Before, --lora-output named its hidden staging folder (``error: .../.adapter.tmp-HOST-PID-
    XXXX: Permission denied``); it now words it as the dense merge does: ``cannot write OUT``."""
    base = zero_base(tmp_path / "base.safetensors", ["a"])
    folder = write_factors(tmp_path / "ok", factors_of({"a": 2}))
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        for out, args in (
            (locked / "merged", ["--base", base]),
            (locked / "adapter", ["--lora-output"]),
        ):
            code, _, err = run_main(capsys, "merge", folder, "-m", "ta", *args, "-o", out, "-q")
            assert code == 2
            assert err == f"error: cannot write {out}: Permission denied\n"
            assert not os.listdir(locked) and not temp_leftovers(locked)
    finally:
        locked.chmod(0o755)
