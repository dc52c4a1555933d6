"""`mloco merge --config merge.yml`: mergekit's YAML for the shared methods, checked against
mergekit's formulas written out here in float64, and mloco's own method names."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch
import yaml
from checkpoint_factory import load_state_dict, write_state_dict
from test_cli_merge import REPO, assert_one_line_error, run_main

from mergekit_loco.merge_config import MergeConfigError, load_merge_config

SHAPES = {"layer.weight": (12, 9), "layer.bias": (12,), "head.weight": (7, 12)}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A float32 base and three fine-tunes as .safetensors files (float64 copies for checks)."""
    root = tmp_path_factory.mktemp("config")
    generator = torch.Generator().manual_seed(0)
    base = {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}
    paths = {"base": write_state_dict(base, root / "base.safetensors")}
    for index in range(1, 4):
        tuned = {n: t + 0.1 * torch.randn(t.shape, generator=generator) for n, t in base.items()}
        paths[f"ft{index}"] = write_state_dict(tuned, root / f"ft{index}.safetensors")
    return paths


def states(family, *keys) -> list[dict[str, np.ndarray]]:
    return [
        {n: t.double().numpy() for n, t in load_state_dict(family[key]).items()} for key in keys
    ]


def write_config(tmp_path, family, method, models, parameters=None, base=True) -> str:
    """A mergekit YAML: ``models`` is ``[(key, {per-model parameters})]``; float64 math."""
    lines = [f"merge_method: {method}", "dtype: float64"]
    if base:
        lines.append(f"base_model: {family['base']}")
    lines.append("models:")
    for key, own in models:
        lines.append(f"  - model: {family[key]}")
        if own:
            lines.append(f"    parameters: {own}")
    if parameters:
        lines.append(f"parameters: {parameters}")
    config = tmp_path / "merge.yml"
    config.write_text("\n".join(lines) + "\n")
    return config


def merge_with_config(capsys, config, out) -> dict[str, np.ndarray]:
    code, _, err = run_main(capsys, "merge", "--config", config, "-o", out, "--quiet")
    assert code == 0, err
    return {n: t.numpy() for n, t in load_state_dict(out).items()}


def assert_all_close(merged, expected):
    assert set(merged) == set(expected)
    for name in expected:
        assert merged[name].dtype == np.float64
        np.testing.assert_allclose(merged[name], expected[name], rtol=0, atol=1e-12)


# -- mergekit's formulas, per tensor, in float64 --------------------------------------------------
def magnitude_mask(delta: np.ndarray, density: float) -> np.ndarray:
    """mergekit's magnitude(): keep the top k = max(1, int(density n)) entries by |x|."""
    if density >= 1:
        return np.ones(delta.shape, dtype=bool)
    k = max(1, int(density * delta.size))
    keep = np.zeros(delta.size, dtype=bool)
    keep[np.argsort(-np.abs(delta.ravel()), kind="stable")[:k]] = True
    return keep.reshape(delta.shape)


def mergekit_ties(deltas, weights, densities, normalize):
    weighted = np.stack(
        [w * d * magnitude_mask(d, p) for d, w, p in zip(deltas, weights, densities, strict=True)]
    )
    majority = np.where(weighted.sum(axis=0) >= 0, 1.0, -1.0)
    mask = np.sign(weighted) == majority
    mixed = (weighted * mask).sum(axis=0)
    divisor = (np.array(weights).reshape(-1, *[1] * deltas[0].ndim) * mask).sum(axis=0)
    divisor[divisor == 0] = 1
    return mixed / divisor if normalize else mixed


def band_mask(delta: np.ndarray, density: float, gamma: float) -> np.ndarray:
    """mergekit's magnitude_outliers(): sort by |x|, keep [n_bot, n_bot + int(density n))."""
    if density >= 1:
        return np.ones(delta.shape, dtype=bool)
    n = delta.size
    target, top = int(density * n), int(gamma * n)
    bottom = max(0, n - target - top)
    keep = np.zeros(n, dtype=bool)
    keep[np.argsort(np.abs(delta.ravel()), kind="stable")[bottom : bottom + target]] = True
    return keep.reshape(delta.shape)


# -- the shared methods --------------------------------------------------------------------------
@pytest.mark.parametrize("normalize", [False, True])
def test_task_arithmetic_weights_lambda_normalize(family, tmp_path, capsys, normalize):
    weights = [0.5, 1.5, -0.3]
    models = [(f"ft{i + 1}", {"weight": w}) for i, w in enumerate(weights)]
    parameters = {"lambda": 0.7, "normalize": normalize}
    config = write_config(tmp_path, family, "task_arithmetic", models, parameters)
    merged = merge_with_config(capsys, config, tmp_path / "out.safetensors")
    base, *tuned = states(family, "base", "ft1", "ft2", "ft3")
    divisor = sum(weights) if normalize else 1.0
    expected = {
        n: theta
        + 0.7 * sum(w * (t[n] - theta) for w, t in zip(weights, tuned, strict=True)) / divisor
        for n, theta in base.items()
    }
    assert_all_close(merged, expected)


def test_linear_is_the_weighted_mean_of_the_models(family, tmp_path, capsys):
    models = [("ft1", {"weight": 1.0}), ("ft2", {"weight": 3.0})]
    config = write_config(tmp_path, family, "linear", models, base=False)
    merged = merge_with_config(capsys, config, tmp_path / "out.safetensors")
    one, two = states(family, "ft1", "ft2")
    assert_all_close(merged, {n: (one[n] + 3 * two[n]) / 4 for n in one})


@pytest.mark.parametrize("normalize", [True, False])
def test_ties_per_model_weight_and_density(family, tmp_path, capsys, normalize):
    weights, densities = [1.0, 2.0, 0.5], [0.5, 0.3, 0.8]
    models = [
        (f"ft{i + 1}", {"weight": w, "density": p})
        for i, (w, p) in enumerate(zip(weights, densities, strict=True))
    ]
    parameters = {"normalize": normalize, "lambda": 0.9, "int8_mask": True}
    config = write_config(tmp_path, family, "ties", models, parameters)
    merged = merge_with_config(capsys, config, tmp_path / "out.safetensors")
    base, *tuned = states(family, "base", "ft1", "ft2", "ft3")
    expected = {
        n: theta + 0.9 * mergekit_ties([t[n] - theta for t in tuned], weights, densities, normalize)
        for n, theta in base.items()
    }
    assert_all_close(merged, expected)


def test_dare_ties_without_dropping_is_weighted_unnormalised_ties(family, tmp_path, capsys):
    models = [("ft1", {"weight": 0.6}), ("ft2", {"weight": 1.4})]
    config = write_config(tmp_path, family, "dare_ties", models, {"density": 1.0})
    merged = merge_with_config(capsys, config, tmp_path / "out.safetensors")
    base, *tuned = states(family, "base", "ft1", "ft2")
    expected = {
        n: theta + mergekit_ties([t[n] - theta for t in tuned], [0.6, 1.4], [1, 1], False)
        for n, theta in base.items()
    }
    assert_all_close(merged, expected)


@pytest.mark.parametrize("method", ["ties", "dare_ties"])
def test_an_entry_whose_weighted_sum_is_zero_takes_plus_as_in_mergekit(tmp_path, capsys, method):
    """Row 0 cancels exactly between the two models while most entries are negative: mergekit
    elects + there (``sum >= 0``), where the TIES code's majority rule would elect -."""
    base = np.zeros((3, 4))
    one = np.array([[1.0, -2.0, 3.0, -4.0], [-1.0, -2.0, -3.0, -4.0], [-1.0, -1.0, -1.0, -1.0]])
    two = np.array([[-1.0, 2.0, -3.0, 4.0], [-2.0, -2.0, -2.0, -2.0], [-3.0, -1.0, -1.0, 2.0]])
    family = {}
    for key, values in (("base", base), ("ft1", one), ("ft2", two)):
        family[key] = write_state_dict({"w": torch.tensor(values)}, tmp_path / f"{key}.safetensors")
    config = write_config(tmp_path, family, method, [("ft1", {"weight": 1.0}),
                                                     ("ft2", {"weight": 1.0})])  # fmt: skip
    merged = merge_with_config(capsys, config, tmp_path / "out.safetensors")
    normalize = method == "ties"
    expected = mergekit_ties([one, two], [1.0, 1.0], [1.0, 1.0], normalize)
    assert expected[0].tolist() == [1.0, 2.0, 3.0, 4.0]  # + elected on the cancelling row
    np.testing.assert_allclose(merged["w"], expected, rtol=0, atol=1e-12)


def test_dare_linear_rescale_keeps_each_l1_norm(family, tmp_path, capsys):
    """One model: merged - base = w * c * (m * tau) with one c per tensor such that the L1
    norm of tau is kept (mergekit's ``rescale: true``); about density of the entries kept."""
    config = write_config(
        tmp_path, family, "dare_linear", [("ft1", {"weight": 2.0})], {"density": 0.5}
    )
    merged = merge_with_config(capsys, config, tmp_path / "out.safetensors")
    base, tuned = states(family, "base", "ft1")
    for name, theta in base.items():
        delta, got = tuned[name] - theta, (merged[name] - theta) / 2.0
        kept = got != 0
        assert 0.2 < kept.mean() < 0.8
        np.testing.assert_allclose(np.abs(got).sum(), np.abs(delta).sum(), rtol=1e-12)
        ratios = got[kept] / delta[kept]
        np.testing.assert_allclose(ratios, ratios[0], rtol=1e-9)


def test_breadcrumbs_weighted_sum_of_bands(family, tmp_path, capsys):
    weights = [1.0, 0.5]
    models = [("ft1", {"weight": 1.0, "gamma": 0.1}), ("ft2", {"weight": 0.5, "gamma": 0.2})]
    config = write_config(tmp_path, family, "breadcrumbs", models, {"density": 0.6})
    merged = merge_with_config(capsys, config, tmp_path / "out.safetensors")
    base, *tuned = states(family, "base", "ft1", "ft2")
    gammas = [0.1, 0.2]
    expected = {}
    for n, theta in base.items():
        deltas = [t[n] - theta for t in tuned]
        expected[n] = theta + sum(
            w * d * band_mask(d, 0.6, g) for w, d, g in zip(weights, deltas, gammas, strict=True)
        )
    assert_all_close(merged, expected)


def test_own_method_names_take_their_parameters(family, tmp_path, capsys):
    config = write_config(
        tmp_path,
        family,
        "iso-c",
        [("ft1", None), ("ft2", None)],
        {"spectral": "exact", "lambda": 0.5},
    )
    merged = merge_with_config(capsys, config, tmp_path / "out.safetensors")
    base, *tuned = states(family, "base", "ft1", "ft2")
    for name, theta in base.items():
        summed = sum(t[name] - theta for t in tuned)
        if summed.ndim == 2:
            left, singular, right = np.linalg.svd(summed, full_matrices=False)
            summed = singular.mean() * left @ right
        else:
            summed = summed / 2
        np.testing.assert_allclose(merged[name], theta + 0.5 * summed, rtol=0, atol=1e-10)


@pytest.mark.parametrize(
    ("keys", "compute", "out"),
    [
        ("dtype: bfloat16\nout_dtype: null\n", torch.bfloat16, torch.bfloat16),  # before: None
        ("dtype: null\nout_dtype: float16\n", torch.float32, torch.float16),  # before: refused
        ("dtype: null\n", torch.float32, None),
        ("", torch.float32, None),
    ],
)
def test_a_null_dtype_counts_as_not_given(family, tmp_path, keys, compute, out):
    config = tmp_path / "merge.yml"
    config.write_text(
        f"merge_method: task_arithmetic\nbase_model: {family['base']}\n"
        f"models:\n  - model: {family['ft1']}\n    parameters: {{weight: 1}}\n{keys}"
    )
    merge = load_merge_config(config)
    assert (merge.compute_dtype, merge.dtype) == (compute, out)


def test_config_keeps_out_dtype_and_skips_the_base_listed_among_models(family, tmp_path):
    config = tmp_path / "merge.yml"
    config.write_text(
        f"merge_method: task_arithmetic\nbase_model: {family['base']}\nmodels:\n"
        f"  - model: {family['base']}\n  - model: {family['ft1']}\n    parameters: {{weight: 1}}\n"
        "dtype: float32\nout_dtype: bfloat16\n"
    )
    configured = load_merge_config(config)
    assert configured.models == [family["ft1"]] and configured.base == family["base"]
    assert (configured.compute_dtype, configured.dtype) == (torch.float32, torch.bfloat16)


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "models", "parameters", "fragments"),
    [
        ("slerp", [("ft1", {"weight": 1})], None, ["merge_method 'slerp'", "dare_ties"]),
        ("ties", [("ft1", {"weight": 1})], {"rescale": True}, ["'rescale: true'", "'ties'"]),
        ("ties", [("ft1", {"weight": 1})], {"epsilon": 0.1}, ["'epsilon'", "not supported"]),
        ("ties", [("ft1", {"density": 0.5})], None, ["ft1", "needs a 'weight'"]),
        ("ties", [("ft1", {"weight": [0, 1]})], None, ["'weight'", "layer-wise"]),
        ("task_arithmetic", [("ft1", {"weight": 1, "lambda": 2})], None, ["'lambda'", "per model"]),
        ("iso-c", [("ft1", {"weight": 2})], None, ["'iso-c'", "per-model weights"]),
    ],
)
def test_unsupported_configs_are_one_line_errors(
    family, tmp_path, capsys, method, models, parameters, fragments
):
    config = write_config(tmp_path, family, method, models, parameters)
    code, _, err = run_main(capsys, "merge", "--config", config, "-o", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, str(config), *fragments)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("edit", "fragments"),
    [
        (("parameters: {'weight': 1}", "parameters: [1]"), ["'parameters' must be a mapping"]),
        # before: [], 0 and false were taken for no parameters
        (("parameters: {'weight': 1}", "parameters: []"), ["'parameters' must be a mapping"]),
        (("parameters: {'density': 0.5}", "parameters: 0"), ["'parameters' must be a mapping"]),
        (("parameters: {'density': 0.5}", "parameters: false"), ["'parameters' must be a mapping"]),
        (("dtype: float64", "dtype: [float32]"), ["dtype [", "is not one of"]),
        (("merge_method: ties", "merge_method: [ta]"), ["merge_method ['ta']", "not supported"]),
        (("base_model: ", "base_model: {model: x}\n#"), ["base_model must be a path"]),
        (("parameters: {'weight': 1}", "parameters: {weight: .nan}"), ["must be a finite number"]),
        (("parameters: {'weight': 1}", "parameters: {weight: yes}"), ["must be a finite number"]),
        (("parameters: {'density': 0.5}", "parameters: {lambda: big}"), ["lambda", "'big'"]),
        (("parameters: {'density': 0.5}", "parameters: {normalize: 'no'}"), ["normalize", "'no'"]),
        (
            ("parameters: {'weight': 1}", "parameters: {weight: 1" + "0" * 400 + "}"),
            ["'weight' must be a finite number, not an integer of about 401 digits"],
        ),
        (
            ("parameters: {'weight': 1}", "parameters: {weight: 1" + "0" * 5000 + "}"),
            ["not valid YAML", "Exceeds the limit"],
        ),
    ],
)
def test_config_values_of_the_wrong_type_are_one_line_errors(
    family, tmp_path, capsys, edit, fragments
):
    """Every value of a hostile YAML gets a one-line error naming the file, never a
    traceback: mappings where lists belong, lists where names belong, NaN, strings."""
    config = write_config(tmp_path, family, "ties", [("ft1", {"weight": 1})], {"density": 0.5})
    text = config.read_text()
    assert edit[0] in text
    config.write_text(text.replace(edit[0], edit[1], 1))
    code, _, err = run_main(capsys, "merge", "--config", config, "-o", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, str(config), *fragments)
    assert not (tmp_path / "out").exists()


def test_dare_seed_out_of_range_and_method_parameters_of_the_wrong_type(family, tmp_path, capsys):
    config = write_config(tmp_path, family, "dare_linear", [("ft1", {"weight": 1})], {"seed": 1e26})
    code, _, err = run_main(capsys, "merge", "--config", config, "-o", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, str(config), "seed must be an integer in [0, 2**63)")
    config = write_config(tmp_path, family, "ties", [("ft1", {})], {"density": "lots"}, base=True)
    text = config.read_text().replace("merge_method: ties", "merge_method: iso-cts")
    config.write_text(text.replace("'density': 'lots'", "'common_fraction': 'lots'"))
    code, _, err = run_main(capsys, "merge", "--config", config, "-o", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, "common_fraction must be a finite number", "'lots'")


def test_mergekit_keys_mloco_lacks_are_named(tmp_path):
    config = tmp_path / "merge.yml"
    config.write_text("merge_method: ties\nslices:\n  - sources: []\n")
    with pytest.raises(MergeConfigError, match="'slices' is not supported"):
        load_merge_config(config)
    config.write_text("merge_method: ties\nmodels:\n  - model: a+lora\n")
    with pytest.raises(MergeConfigError, match=r"MODEL\+LORA"):
        load_merge_config(config)


@pytest.mark.parametrize(
    "flags",
    [
        ["--method", "ta"],
        # at their defaults too (before: accepted, while the file's values were used)
        ["--scale", "1"],
        ["--compute-dtype", "float32"],
        ["--dtype", "float32"],
    ],
)
def test_config_and_method_options_together_are_an_error(family, tmp_path, capsys, flags):
    config = write_config(tmp_path, family, "task_arithmetic", [("ft1", {"weight": 1})])
    code, _, err = run_main(capsys, "merge", "--config", config, *flags, "-o", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, f"{flags[0]} cannot be given with a config file")
    assert not (tmp_path / "out").exists()


def test_the_docs_yaml_block_is_the_example_file():
    docs = (REPO / "docs" / "merging.md").read_text()
    blocks = re.findall(r"^```yaml\n(.*?)^```", docs, re.MULTILINE | re.DOTALL)
    assert blocks == [(REPO / "examples" / "tiny" / "ties.yml").read_text()]


def test_the_base_listed_among_models_through_another_path_is_skipped(family, tmp_path):
    """mergekit configs often list the base as a model: any spelling of its path is skipped."""
    link = tmp_path / "base-link.safetensors"
    link.symlink_to(family["base"])
    config = tmp_path / "merge.yml"
    config.write_text(
        f"merge_method: ties\nbase_model: {family['base']}\nmodels:\n  - model: {link}\n"
        f"  - model: {family['ft1']}\n    parameters: {{weight: 1, density: 0.5}}\n"
    )
    assert load_merge_config(config).models == [family["ft1"]]


# -- hostile YAML ---------------------------------------------------------------------------------
def config_error(capsys, tmp_path, text: str) -> tuple[str, str]:
    """(the config file, the one error line) of ``mloco merge --config`` on ``text``."""
    config = tmp_path / "merge.yml"
    config.write_text(text)
    code, _, err = run_main(capsys, "merge", "--config", config, "-o", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, str(config))
    assert not (tmp_path / "out").exists()
    return str(config), err.strip()


def alias_bomb(levels: int = 9) -> str:
    """A flow list whose aliases expand to 10**levels strings (a "billion laughs")."""
    nested = ['&l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    nested += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return f"[{', '.join(nested)}]"


@pytest.mark.parametrize("key", ["base_model", "merge_method", "dtype", "out_dtype", "extra"])
def test_a_yaml_alias_bomb_is_refused_before_anything_expands_it(family, tmp_path, capsys, key):
    """Values are counted as a tree (each alias every time it is reached) up to a cap, so the
    error messages that show the value never expand a billion strings."""
    lines = {
        "merge_method": "ties",
        "base_model": str(family["base"]),
        "models": f"[{{model: {family['ft1']}, parameters: {{weight: 1}}}}]",
        key: alias_bomb(),
    }
    started = time.process_time()
    config, line = config_error(capsys, tmp_path, "".join(f"{k}: {v}\n" for k, v in lines.items()))
    assert time.process_time() - started < 0.5
    assert (
        line == f"error: {config}: more than 100000 values once YAML aliases are expanded; refused"
    )


def test_a_yaml_merge_key_bomb_is_refused(tmp_path, capsys):
    """``<<: [*b, *b, ...]`` merges one big mapping many times: counted, refused early."""
    keys = ", ".join(f"k{index}: 1" for index in range(2000))
    text = f"b: &b {{{keys}}}\nc: {{<<: [{', '.join(['*b'] * 2000)}]}}\n"  # 4M entries merged
    started = time.process_time()
    config, line = config_error(capsys, tmp_path, text)
    assert time.process_time() - started < 0.5
    assert (
        line == f"error: {config}: more than 100000 values once YAML aliases are expanded; refused"
    )


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("merge_method: " + "[" * 50_000 + "]" * 50_000 + "\n", "line 1: "),
        ("merge_method: " + "{a: " * 50_000 + "1" + "}" * 50_000 + "\n", "line 1: "),
        ("merge_method: ta\nparameters: &p {lambda: *p}\n", ""),  # a cycle: infinitely deep
        ("merge_method: ta\nmodels: &m [*m]\n", ""),
    ],
)
def test_deep_nesting_is_refused_without_a_recursion_error(tmp_path, capsys, text, where):
    config, line = config_error(capsys, tmp_path, text)
    assert line == f"error: {config}: {where}nested more than 32 levels deep"


@pytest.mark.parametrize(
    ("entry", "line_number"),
    [
        ("{model: m.safetensors, 1: x, foo: y}", 2),
        ("{model: m.safetensors, parameters: {1: 2, foo: 3}}", 2),
        ("{model: m.safetensors, parameters: {<<: {null: 2}, foo: 3}}", 2),
    ],
)
def test_a_mapping_key_that_is_not_a_string_is_named(tmp_path, capsys, entry, line_number):
    config, line = config_error(capsys, tmp_path, f"merge_method: ta\nmodels: [{entry}]\n")
    key = "None" if "null" in entry else "1"
    assert line == (
        f"error: {config}: line {line_number}: key {key} is not a string "
        "(every mapping key must be)"
    )


@pytest.mark.parametrize(
    ("text", "key", "line_number"),
    [
        ("merge_method: ta\nmerge_method: mean\nmodels: [a]\n", "merge_method", 2),
        (
            "merge_method: ties\nmodels:\n  - model: a\n    parameters: {weight: 1, weight: 0}\n",
            "weight",
            4,
        ),
        ("merge_method: ta\n'models': [a]\nmodels: [b]\n", "models", 3),
    ],
)
def test_a_key_given_twice_is_refused(tmp_path, capsys, text, key, line_number):
    """As the JSON readers do: the last value never silently wins."""
    config, line = config_error(capsys, tmp_path, text)
    assert line == f"error: {config}: line {line_number}: key {key!r} appears twice"


def test_an_integer_yaml_1_1_and_1_2_read_differently_is_refused(tmp_path, capsys):
    """``seed: 010`` was DARE's seed 8 (YAML 1.1's octal), where YAML 1.2 reads 10."""
    text = (
        "merge_method: dare_ties\nmodels:\n  - model: a\n    parameters: {density: 0.5}\n"
        "parameters:\n  seed: 010\n"
    )
    config, line = config_error(capsys, tmp_path, text)
    assert line == (
        f"error: {config}: line 6: '010' is 8 in YAML 1.1 and 10 in YAML 1.2; write the number "
        "in decimal"
    )


def test_a_merge_key_may_be_overridden(family, tmp_path):
    """YAML's ``<<`` merge is not a key given twice: the mapping's own key wins."""
    config = tmp_path / "merge.yml"
    config.write_text(
        f"merge_method: task_arithmetic\nbase_model: {family['base']}\n"
        f"models: [{{model: {family['ft1']}, parameters: &p {{weight: 1}}}},\n"
        f"  {{model: {family['ft2']}, parameters: {{<<: *p, weight: 3}}}}]\n"
    )
    assert load_merge_config(config).params["weights"] == (1.0, 3.0)


@pytest.mark.parametrize(("written", "value"), [("1e-3", 1e-3), ("2E-1", 0.2), (".5", 0.5)])
def test_yaml_1_2_floats_are_numbers(family, tmp_path, capsys, written, value):
    """``lambda: 1e-3`` is a number, as mergekit reads it (YAML 1.1 would make it a string);
    yaml.safe_load itself is left as it is."""
    config = tmp_path / "merge.yml"
    config.write_text(
        f"merge_method: task_arithmetic\ndtype: float64\nbase_model: {family['base']}\n"
        f"models: [{{model: {family['ft1']}, parameters: {{weight: 1}}}}]\n"
        f"parameters: {{lambda: {written}}}\n"
    )
    merged = merge_with_config(capsys, config, tmp_path / "out.safetensors")
    base, tuned = states(family, "base", "ft1")
    assert_all_close(merged, {n: theta + value * (tuned[n] - theta) for n, theta in base.items()})
    assert yaml.safe_load("lambda: 1e-3") == {"lambda": "1e-3"}


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (
            "[" + ", ".join(["x" * 1000] * 500) + "]",
            "['xxxxxxxxx...xxxxxxxxxx', 'xxxxxxxxx...xxxxxxxxxx', 'xxxxxxxxx...xxxxxxxxxx', ...]",
        ),
        ("{a: [[1]], b: 2, c: 3, d: 4}", "{'a': [...], 'b': 2, 'c': 3, ...}"),
        ("y" * 100_000, "'yyyyyyyyy...yyyyyyyyyy'"),
    ],
)
def test_error_messages_show_a_big_value_cut_short(tmp_path, capsys, value, shown):
    config, line = config_error(capsys, tmp_path, f"merge_method: {value}\nmodels: [a]\n")
    assert line.startswith(f"error: {config}: merge_method {shown} is not supported (use: ")


# -- per-model weights: all or none ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "fragments"),
    [
        ("ta", ["'weight' is given for some models but not for", "or to none"]),
        ("iso-c", ["'weight' is given for some models but not for", "or to none"]),
        ("task_arithmetic", ["'task_arithmetic' needs a 'weight' for every model", "none for"]),
        ("linear", ["'linear' needs a 'weight' for every model", "none for"]),
        ("ties", ["'ties' needs a 'weight' for every model", "none for"]),
    ],
)
def test_a_weight_for_some_models_only_is_refused_naming_those_without(
    family, tmp_path, capsys, method, fragments
):
    """Before, ``ta`` dropped ft1's weight in silence when ft2 had none, and ``iso-c``, which
    takes no weights, merged such a file. One rule for mloco's names and mergekit's: a weight
    for some models but not all is an error naming the file and the models without one."""
    models = [("ft1", {"weight": 2}), ("ft2", None), ("ft3", {"weight": 1})]
    config = write_config(tmp_path, family, method, models)
    code, _, err = run_main(capsys, "merge", "--config", config, "-o", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, f"error: {config}: ", *fragments, str(family["ft2"]))
    assert str(family["ft1"]) not in err and str(family["ft3"]) not in err
    assert not (tmp_path / "out").exists()


def test_a_top_level_weight_fills_the_models_without_one(family, tmp_path, capsys):
    """``parameters: {weight: 3}`` is every model's weight unless the model gives its own, for
    mloco's ``ta`` as for mergekit's methods: ``theta = base + 1 tau_1 + 3 tau_2``."""
    models = [("ft1", {"weight": 1}), ("ft2", None)]
    config = write_config(tmp_path, family, "ta", models, {"weight": 3})
    merged = merge_with_config(capsys, config, tmp_path / "out.safetensors")
    base, one, two = states(family, "base", "ft1", "ft2")
    expected = {n: theta + (one[n] - theta) + 3 * (two[n] - theta) for n, theta in base.items()}
    assert_all_close(merged, expected)


# -- ties and breadcrumbs are mergekit's in a YAML -------------------------------------------------
def test_yaml_ties_is_mergekits_and_trim_points_to_the_command_line(family, tmp_path, capsys):
    """``merge_method: ties`` means mergekit's TIES, as in mergekit (mergekit's trim, + where a
    sum is 0); ``trim: reference`` (mloco's own ties) is answered with the command that runs it."""
    models = [("ft1", {"weight": 1}), ("ft2", {"weight": 1})]
    config = write_config(tmp_path, family, "ties", models, {"density": 0.5})
    configured = load_merge_config(config)
    assert (configured.method, configured.params["trim"]) == ("ties", "mergekit")
    assert configured.params["zero_sign"] == "positive"
    config = write_config(tmp_path, family, "ties", models, {"density": 0.5, "trim": "reference"})
    code, _, err = run_main(capsys, "merge", "--config", config, "-o", tmp_path / "out")
    assert code == 2
    assert_one_line_error(
        err,
        f"error: {config}: parameter 'trim' of 'ties' is not supported",
        "merge_method: ties in a YAML means mergekit's ties",
        "mloco merge MODEL... --base BASE --method ties --option trim=reference",
    )


# -- errors name the YAML file --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "models", "parameters", "fragment"),
    [
        ("ties", [("ft1", {"weight": 1})], {"density": 1.5}, "ties: density must lie in (0, 1]"),
        ("iso-c", [("ft1", None)], {"spectral": "svd"}, "iso-c: spectral must be one of"),
        ("tsv", [("ft1", None)], {"rank_aware": "yes"}, "rank_aware must be true or false"),
        ("linear", [("ft1", {"weight": 1}), ("ft2", {"weight": -1})], None, "weights sum to 0"),
        (
            "mean",
            [("ft1", {"weight": 1e308}), ("ft2", {"weight": 1e308})],
            None,
            "mean: weights (1e+308, 1e+308) sum beyond the largest float",
        ),
    ],
    ids=["density", "spectral", "rank_aware", "weights-0", "weights-overflow"],
)
def test_method_parameter_errors_name_the_yaml_file(
    family, tmp_path, capsys, method, models, parameters, fragment
):
    """Before, a parameter out of range came from the method with no file named (and weights of
    1e308 gave ``error: intermediate overflow in fsum``)."""
    config = write_config(tmp_path, family, method, models, parameters, base=method != "linear")
    code, _, err = run_main(capsys, "merge", "--config", config, "-o", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, f"error: {config}: ", fragment)
    assert not (tmp_path / "out").exists()


def test_a_model_listed_twice_is_named(family, tmp_path, capsys):
    """Before: ``M: given twice as a model ... give a mergekit YAML with per-model weight``, a
    command-line message about a YAML that is one."""
    link = tmp_path / "ft1-link.safetensors"
    link.symlink_to(family["ft1"])
    for second, also in (
        (family["ft1"], "(also as models[1])"),
        (link, f"models[1] {family['ft1']}"),
    ):
        config = tmp_path / "merge.yml"
        config.write_text(
            f"merge_method: ta\nbase_model: {family['base']}\nmodels:\n"
            f"  - model: {family['ft1']}\n  - model: {second}\n"
        )
        code, _, err = run_main(capsys, "merge", "--config", config, "-o", tmp_path / "out")
        assert code == 2
        assert_one_line_error(err, f"error: {config}: models[2] {second} is listed twice", also)


def test_a_yaml_listing_only_the_base_says_so(family, tmp_path, capsys):
    """Before: ``error: no models to merge: give at least one MODEL``."""
    config = tmp_path / "merge.yml"
    config.write_text(
        f"merge_method: ties\nbase_model: {family['base']}\n"
        f"models:\n  - model: {family['base']}\n    parameters: {{weight: 1}}\n"
    )
    code, _, err = run_main(capsys, "merge", "--config", config, "-o", tmp_path / "out")
    assert code == 2
    assert_one_line_error(
        err, f"error: {config}: the only model listed is base_model ({family['base']})"
    )


@pytest.mark.parametrize("method", ["ta", "ties", "task_arithmetic"])
def test_a_yaml_without_base_model_is_told_to_add_one(family, tmp_path, capsys, method):
    """Before: the command-line advice ``run: mloco merge M1 M2 --base BASE ...``, which cannot
    be given beside --config; then, for mergekit's names, ``'ties' needs base_model``. Now: add
    ``base_model:`` to the file, whichever family's name the method has."""
    given = [("ft1", "{weight: 1.0}"), ("ft2", "{weight: 1.0}")]
    config = write_config(tmp_path, family, method, given, base=False)
    code, _, err = run_main(capsys, "merge", "--config", config, "-o", tmp_path / "out")
    assert code == 2
    assert_one_line_error(
        err, f"error: {config}: merge_method {method}", f"add 'base_model: BASE' to {config}"
    )
    assert "--base" not in err and "mloco merge" not in err
