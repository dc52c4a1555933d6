"""mergekit's YAML merge configurations, read into one :func:`merge_checkpoints` call.

Supported: ``merge_method``, ``base_model``, ``models`` (each ``model`` with optional
``parameters``), top-level ``parameters``, ``dtype`` (the compute dtype; also the output dtype
unless ``out_dtype`` is given) and ``out_dtype``. mergekit's shared methods translate as
mergekit defines them (``tau_t = model_t - base``, weights ``w_t``, ``W = sum_t w_t``,
``lambda`` default 1):

- ``linear``: ``theta = sum_t w_t theta_t / W`` (normalize defaults to true; the base, if
  given, is ignored as in mergekit) -> ``mean`` with weights;
- ``task_arithmetic``: ``theta = base + lambda sum_t w_t tau_t`` (``/ W`` with normalize) ->
  ``ta``;
- ``ties``: trim each tau_t to its top-density magnitudes, elect signs on ``sum_t w_t trim_t``
  (+ where it is 0),
  ``theta = base + lambda sum_t w_t a_t / sum_{t: a_t != 0} w_t`` (no division with
  ``normalize: false``) -> ``ties`` (density defaults to 1, normalize to true);
- ``dare_linear``: ``theta = base + lambda sum_t w_t drop(tau_t)`` with drop rescaled to keep
  the L1 norm (``rescale: true``, the default) or not rescaled -> ``dare``;
- ``dare_ties``: the DARE drop, then TIES's sign election and (with normalize) weighted
  disjoint mean -> ``dare`` with ``consensus`` (both with ``zero_sign`` positive);
- ``breadcrumbs``: ``theta = base + lambda sum_t w_t band(tau_t)`` -> ``breadcrumbs``.

mloco's own method names that mergekit lacks (``mean``, ``ta``, ``dare``, ``tsv``, ``iso-c``,
``iso-cts``) are accepted in the same format: top-level ``parameters`` are the method's
parameters, per-model ``weight`` goes to methods that take weights, ``lambda`` is ``--scale``.
``ties`` and ``breadcrumbs`` are mergekit's names too and mean mergekit's methods, as a mergekit
YAML means them (mloco's own ties, with the TIES code's trim, runs from the command line).
A ``weight`` given for some models but not for all is an error naming the models without one
(mergekit's methods need one for every model). Anything mergekit has that mloco does not
(slices, tokenizer options, layer-wise parameter gradients, other methods, options like
``rescale`` on TIES) is an error naming it.

The file is read as hostile (:func:`read_yaml`, with the loader ``mloco train --config``
shares: :mod:`mergekit_loco.io.yaml_config`): at most 1 MiB, nesting and alias expansion
bounded (an alias bomb is refused, not expanded), string keys only, no key given twice, and YAML
1.2's floats (``1e-3``) read as numbers. Messages show values through :func:`bounded`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from mergekit_loco.io.files import read_limited
from mergekit_loco.io.lora import is_lora_adapter
from mergekit_loco.io.yaml_config import (
    MAX_CONFIG_BYTES,
    ConfigFileError,
    bounded,
    load_yaml,
    parse_error_text,
)
from mergekit_loco.merge_checks import Checkpoints, Fingerprint
from mergekit_loco.methods import METHODS, get_method
from mergekit_loco.methods.mean import weight_sum

#: mergekit method -> (mloco method, parameter defaults as mergekit has them)
SHARED_METHODS: dict[str, tuple[str, dict]] = {
    "linear": ("mean", {"normalize": True}),
    "task_arithmetic": ("ta", {"normalize": False, "lambda": 1.0}),
    "ties": ("ties", {"normalize": True, "lambda": 1.0, "density": 1.0, "rescale": False}),
    "dare_linear": (
        "dare",
        {"normalize": False, "lambda": 1.0, "density": 1.0, "rescale": True, "seed": 0},
    ),
    "dare_ties": (
        "dare",
        {"normalize": False, "lambda": 1.0, "density": 1.0, "rescale": True, "seed": 0},
    ),
    "breadcrumbs": (
        "breadcrumbs",
        {"normalize": False, "lambda": 1.0, "density": 1.0, "gamma": 0.01, "rescale": False},
    ),
}
#: parameters of mergekit's shared methods that change nothing in the result
NO_EFFECT = {"int8_mask"}
PER_MODEL = ("weight", "density", "gamma")
TOP_LEVEL_KEYS = {"merge_method", "base_model", "models", "parameters", "dtype", "out_dtype"}
UNSUPPORTED_TOP_LEVEL = {"slices", "modules", "tokenizer_source", "tokenizer", "chat_template"}
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class MergeConfigError(ConfigFileError):
    """A merge configuration that cannot be run; the message names the file and the key."""


@dataclass(frozen=True)
class ConfiguredMerge:
    """The arguments of :func:`mergekit_loco.merge_checkpoints` a configuration stands for."""

    models: list[Path]
    base: Path | None
    method: str
    params: dict = field(default_factory=dict)
    scale: float = 1.0
    compute_dtype: torch.dtype = torch.float32
    dtype: torch.dtype | None = None


def read_yaml(path: Path) -> dict:
    """The mapping in the YAML file ``path``, read as hostile (:func:`load_yaml`): every fault
    is a :class:`ConfigFileError` naming the file."""
    raw = read_limited(path, MAX_CONFIG_BYTES, "merge config")  # a regular file, bounded
    try:
        config = load_yaml(raw, path)
    except ConfigFileError:
        raise
    except (yaml.YAMLError, ValueError) as error:  # ValueError: an int over 4300 digits
        raise MergeConfigError(f"{path}: not valid YAML ({parse_error_text(error)})") from None
    if not isinstance(config, dict):
        raise MergeConfigError(f"{path}: expected a mapping with merge_method and models")
    return config


def scalar(path: Path, where: str, key: str, value: object) -> object:
    """A plain value; mergekit's layer-wise forms (lists, filter mappings) are refused."""
    if isinstance(value, list | dict):
        raise MergeConfigError(
            f"{path}: {where} parameter {bounded(key)}: layer-wise gradients and filters "
            f"({type(value).__name__}) are not supported; give one number"
        )
    return value


def number(path: Path, key: str, value: object) -> float:
    """A finite int or float setting (not a bool, a string, a list or an int beyond float)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            if math.isfinite(value):
                return float(value)
        except OverflowError:
            pass
    raise MergeConfigError(f"{path}: {key} must be a finite number, not {bounded(value)}")


def parse_dtype(path: Path, key: str, value: object) -> torch.dtype:
    if not isinstance(value, str) or value not in DTYPES:
        raise MergeConfigError(f"{path}: {key} {bounded(value)} is not one of {', '.join(DTYPES)}")
    return DTYPES[value]


def model_entries(path: Path, config: dict) -> list[tuple[Path, dict]]:
    """``[(model path, its parameters)]`` from ``models:``."""
    models = config.get("models")
    if not isinstance(models, list) or not models:
        raise MergeConfigError(f"{path}: 'models' must be a non-empty list of {{model: PATH}}")
    entries = []
    for index, entry in enumerate(models, start=1):
        if isinstance(entry, str):
            entry = {"model": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise MergeConfigError(f"{path}: models[{index}] needs 'model: PATH'")
        if not entry["model"].strip():
            raise MergeConfigError(
                f"{path}: models[{index}]: 'model' is an empty path (it would mean the current "
                "folder)"
            )
        unknown = sorted(set(entry) - {"model", "parameters"})
        if unknown:
            raise MergeConfigError(
                f"{path}: models[{index}]: key {bounded(unknown[0])} is not supported"
            )
        if "+" in entry["model"]:
            raise MergeConfigError(
                f"{path}: models[{index}] {bounded(entry['model'])}: mergekit's MODEL+LORA syntax "
                "is not supported; merge LoRA adapters with `mloco merge ADAPTER ... --base BASE`"
            )
        parameters = entry.get("parameters")
        parameters = {} if parameters is None else parameters  # [], 0, false: no mapping
        where = f"models[{index}] ({entry['model']})"
        if not isinstance(parameters, dict):
            raise MergeConfigError(f"{path}: {where}: 'parameters' must be a mapping")
        entries.append(
            (
                Path(entry["model"]),
                {key: scalar(path, where, key, value) for key, value in parameters.items()},
            )
        )
    return entries


def check_listed_once(path: Path, entries: list) -> None:
    """Each model listed once (by any path to it: :class:`Checkpoints`); to weight a model
    more, its ``weight`` says so."""
    seen = Checkpoints()
    for index, (model, _) in enumerate(entries):
        fingerprint = Fingerprint.of(model)
        other = seen.find(fingerprint)
        if other is not None:
            also = f"models[{seen.order[other] + 1}]" + ("" if model == other else f" {other}")
            raise MergeConfigError(
                f"{path}: models[{index + 1}] {model} is listed twice (also as "
                f"{also}); list each model once (a larger 'weight' weights it more)"
            )
        seen.add(fingerprint)


def per_model(path: Path, name: str, entries: list, shared: dict, default: object) -> list[float]:
    """Parameter ``name`` of every model: its own value, else the top-level one, else
    ``default``."""
    fallback = shared.get(name, default)
    return [
        number(path, f"{model}: parameter {name!r}", parameters.get(name, fallback))
        for model, parameters in entries
    ]


def model_weights(path: Path, method: str, entries: list, shared: dict) -> list[float] | None:
    """Each model's ``weight``: its own, else the top-level one; None where no model has one
    (an unweighted merge), which only mloco's own methods allow (mergekit's need a weight for
    every model). A weight for some models but not for all is an error naming those without."""
    lacking = [str(model) for model, parameters in entries if "weight" not in parameters]
    if "weight" in shared or not lacking:
        return per_model(path, "weight", entries, shared, None)
    names = ", ".join(lacking[:3]) + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
    if method in SHARED_METHODS:
        raise MergeConfigError(
            f"{path}: {method!r} needs a 'weight' for every model (as in mergekit); none for "
            f"{names}"
        )
    if len(lacking) < len(entries):
        raise MergeConfigError(
            f"{path}: a 'weight' is given for some models but not for {names}; give one to every "
            "model (or one for all under top-level parameters), or to none"
        )
    return None


def namesake_parameter(method: str, key: str, value: object) -> str:
    """Where parameter ``key`` of mloco's own method named like mergekit's ``method`` (``trim``
    of ``ties``) can be given: on the command line, since in a YAML the name means mergekit's
    method; empty for any other key."""
    if method not in METHODS or key not in METHODS[method].parameter_names():
        return ""
    option = f"{key}={str(value)[:40]}"
    return (
        f"; {key!r} is a parameter of mloco's own {method}, but merge_method: {method} in a YAML "
        f"means mergekit's {method}, as it does in mergekit; for mloco's {method} with {option}, "
        f"run: mloco merge MODEL... --base BASE --method {method} --option {option}"
    )


def check_known(path: Path, method: str, entries: list, shared: dict, known: set) -> None:
    for key in shared:
        if key not in known:
            raise MergeConfigError(
                f"{path}: parameter {bounded(key)} of {method!r} is not supported by mloco "
                f"(supported: {', '.join(sorted(known))})"
                f"{namesake_parameter(method, key, shared[key])}"
            )
    per_model_known = [key for key in PER_MODEL if key in known]
    for model, parameters in entries:
        for key in parameters:
            if key not in per_model_known:
                raise MergeConfigError(
                    f"{path}: {model}: per-model parameter {bounded(key)} of {method!r} is not "
                    f"supported by mloco (per model: {', '.join(per_model_known)})"
                )


def one_or_each(values: list[float]) -> float | tuple[float, ...]:
    return values[0] if len(set(values)) == 1 else tuple(values)


def missing_base_model(path: object, method: str) -> str:
    """The answer to a config file whose ``merge_method`` needs a base it does not give."""
    return (
        f"{path}: merge_method {method} merges task vectors (model - base), so it needs a base: "
        f"add 'base_model: BASE' to {path}, BASE the pre-trained checkpoint the models were "
        "fine-tuned from (only mean and linear need none)"
    )


def shared_method(path: Path, method: str, entries: list, shared: dict, base) -> tuple:
    """(mloco method, its parameters, scale) for one of mergekit's methods."""
    ours, defaults = SHARED_METHODS[method]
    check_known(path, method, entries, shared, set(defaults) | {"weight"} | NO_EFFECT)
    settings = {key: shared.get(key, default) for key, default in defaults.items()}
    for flag in ("normalize", "rescale"):
        if flag in settings and not isinstance(settings[flag], bool):
            raise MergeConfigError(
                f"{path}: {flag} must be true or false, not {bounded(settings[flag])}"
            )
    weights = model_weights(path, method, entries, shared)
    total = weight_sum(method, weights)
    params: dict = {}
    if ours == "mean":
        if not settings["normalize"] and not math.isclose(total, 1.0):
            raise MergeConfigError(
                f"{path}: linear with normalize: false and weights summing to {total:g} scales "
                "the whole model, which mloco does not do; use normalize: true"
            )
        if len(set(weights)) > 1:
            params["weights"] = tuple(weights)
        return ours, params, 1.0
    if base is None:
        raise MergeConfigError(missing_base_model(path, method))
    for name in ("density", "gamma"):
        if name in defaults:
            params[name] = one_or_each(per_model(path, name, entries, shared, defaults[name]))
    if settings.get("rescale") and ours != "dare":
        raise MergeConfigError(f"{path}: parameter 'rescale: true' of {method!r} is not supported")
    if ours == "ties":
        params["trim"] = "mergekit"
    if ours == "ties" or method == "dare_ties":
        params |= {"weights": tuple(weights), "normalize": bool(settings["normalize"]),
                   "zero_sign": "positive"}  # fmt: skip
    else:  # a weighted sum: normalizing is dividing the weights by their sum
        if settings["normalize"] and total == 0:
            raise MergeConfigError(f"{path}: normalize: true with weights summing to 0")
        params["weights"] = tuple(w / total if settings["normalize"] else w for w in weights)
    if ours == "dare":
        params["rescale"] = "l1" if settings["rescale"] else "none"
        seed = settings["seed"]
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise MergeConfigError(
                f"{path}: seed must be an integer in [0, 2**63), not {bounded(seed)}"
            )
        params["seed"] = seed
        params["consensus"] = method == "dare_ties"
    return ours, params, number(path, "lambda", settings["lambda"])


def own_method(path: Path, method: str, entries: list, shared: dict) -> tuple:
    """(method, parameters, scale) for one of mloco's names: parameters as the method's."""
    fields = set(METHODS[method].parameter_names())
    known = fields | {"lambda", "weight"}
    for key in shared:
        if key not in known:
            raise MergeConfigError(
                f"{path}: parameter {bounded(key)}: method {method!r} takes "
                f"{', '.join(sorted(fields)) or 'no parameters'} (and lambda)"
            )
    params = {key: value for key, value in shared.items() if key in fields}
    weights = model_weights(path, method, entries, shared)
    for model, parameters in entries:
        unknown = sorted(set(parameters) - {"weight"})
        if unknown:
            raise MergeConfigError(
                f"{path}: {model}: per-model parameter {bounded(unknown[0])} is not supported for "
                f"{method!r} (per model: weight)"
            )
    if weights is not None and any(weight != 1.0 for weight in weights):
        if "weights" not in fields:
            raise MergeConfigError(f"{path}: method {method!r} does not take per-model weights")
        params["weights"] = tuple(weights)
    return method, params, number(path, "lambda", shared.get("lambda", 1.0))


def load_merge_config(path: str | Path) -> ConfiguredMerge:
    """Read a mergekit-style YAML file into the merge it describes (see the module docs)."""
    path = Path(path)
    config = read_yaml(path)
    for key in config:
        if key in UNSUPPORTED_TOP_LEVEL:
            raise MergeConfigError(f"{path}: {key!r} is not supported by mloco")
        if key not in TOP_LEVEL_KEYS:
            expected = ", ".join(sorted(TOP_LEVEL_KEYS))
            raise MergeConfigError(f"{path}: unknown key {bounded(key)} (expected: {expected})")
    method = config.get("merge_method")
    if not isinstance(method, str) or (method not in SHARED_METHODS and method not in METHODS):
        names = ", ".join(dict.fromkeys([*SHARED_METHODS, *METHODS]))
        raise MergeConfigError(
            f"{path}: merge_method {bounded(method)} is not supported (use: {names})"
        )
    base_model = config.get("base_model")
    if base_model is not None and not isinstance(base_model, str):
        raise MergeConfigError(f"{path}: base_model must be a path, not {bounded(base_model)}")
    if base_model is not None and not base_model.strip():
        raise MergeConfigError(
            f"{path}: base_model is an empty path (it would mean the current folder); leave the "
            "key out for a merge without a base"
        )
    base = Path(base_model) if base_model is not None else None
    entries = model_entries(path, config)
    check_listed_once(path, entries)
    if base is not None and method != "linear":
        bases = Checkpoints()
        bases.add(Fingerprint.of(base, as_base=True))
        entries = [entry for entry in entries if bases.find(Fingerprint.of(entry[0])) is None]
        if not entries:
            raise MergeConfigError(
                f"{path}: the only model listed is base_model ({base}), which is "
                "skipped as mergekit skips it; list the fine-tuned models to merge"
            )
    # an adapter is a delta: linear keeps the base it adapts (the weights sum to 1, so
    # sum w_t theta_t is the base plus sum w_t delta_t)
    adapters = [model for model, _ in entries if is_lora_adapter(model)]
    shared = config.get("parameters")
    shared = {} if shared is None else shared
    if not isinstance(shared, dict):
        raise MergeConfigError(f"{path}: 'parameters' must be a mapping")
    shared = {key: scalar(path, "top-level", key, value) for key, value in shared.items()}
    try:
        if method in SHARED_METHODS:
            ours, params, scale = shared_method(path, method, entries, shared, base)
            if method == "linear" and not adapters:
                base = None  # mergekit's linear averages whole models: sum w_t theta_t
        else:
            ours, params, scale = own_method(path, method, entries, shared)
        get_method(ours, **params).check_tasks(len(entries))
    except MergeConfigError:
        raise
    except ValueError as error:  # a method parameter out of range or of the wrong type
        raise MergeConfigError(f"{path}: {error}") from None
    dtype, out = config.get("dtype"), config.get("out_dtype")  # null: not given, as in mergekit
    compute = parse_dtype(path, "dtype", dtype) if dtype is not None else torch.float32
    out = dtype if out is None else out
    return ConfiguredMerge(
        models=[model for model, _ in entries],
        base=base,
        method=ours,
        params=params,
        scale=scale,
        compute_dtype=compute,
        dtype=parse_dtype(path, "out_dtype", out) if out is not None else None,
    )
