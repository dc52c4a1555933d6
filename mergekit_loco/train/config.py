"""Run configuration: ``TrainConfig``, six typed sections (train/config_sections.py) that
presets, a TOML/YAML/JSON file and flags fill by their flat option names.

Precedence, lowest first: dataclass defaults < preset < config file < flags. When resuming
(``resume=True``) the run's saved ``config.json`` takes the place of the defaults, so
``--resume --out DIR`` continues the run as it was configured. What to do with the run folder
(:data:`FOLDER_ACTIONS`: resume, allow a config change, start over) is only ever typed: a config
file may not set it and ``config.json`` does not hold it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergekit_loco.io.files import brief, read_json, read_limited, shown, unique_keys
from mergekit_loco.io.yaml_config import (
    MAX_CONFIG_BYTES,
    ConfigFileError,
    bounded,
    load_yaml,
    parse_error_text,
)
from mergekit_loco.run_layout import check_not_a_model
from mergekit_loco.train.config_sections import (
    DEFAULT_TOKENS,
    CheckpointConfig,
    DataConfig,
    InnerConfig,
    ModelConfig,
    OptionError,
    OuterConfig,
    RunConfig,
    bad_value,
    flag_name,
)

#: The seed paper's tuned 178M, R = 8 values, as changes to the sections' defaults (which are
#: the diloco preset). Every preset starts from the defaults of PRESET_KEYS, so switching
#: presets never leaves a value of the previous one behind.
PRESETS: dict[str, dict[str, Any]] = {
    "diloco": {},
    "diloco-sgd": dict(aggregator="mean", outer_lr=1.6, outer_momentum=0.0, nesterov=False,
                       inner_lr=1.38e-3),
    "isoloco": dict(aggregator="iso-c", outer_lr=1.8, outer_momentum=0.8, nesterov=True,
                    inner_lr=1.38e-3),
    "isoloco-ns": dict(aggregator="iso-c", aggregator_options={"spectral": "ns"}, outer_lr=1.8,
                       outer_momentum=0.8, nesterov=True, inner_lr=1.38e-3),
    "isoc-sgd": dict(aggregator="iso-c", outer_lr=2.1, outer_momentum=0.0, nesterov=False,
                     inner_lr=3.91e-3),
    "iso-cts": dict(aggregator="iso-cts", outer_lr=3.1, outer_momentum=0.0, nesterov=False,
                    inner_lr=3.91e-3),
    "tsv": dict(aggregator="tsv", outer_lr=0.6, outer_momentum=0.0, nesterov=False,
                inner_lr=2.76e-3),
    "ties": dict(aggregator="ties", aggregator_options={"density": 0.9}, outer_lr=0.7,
                 outer_momentum=0.0, nesterov=False, inner_lr=2.76e-3),
    "dare": dict(aggregator="dare", aggregator_options={"density": 0.9}, outer_lr=1.5,
                 outer_momentum=0.0, nesterov=False, inner_lr=2.76e-3),
    "dp": dict(mode="dp", inner_lr=1.95e-3, weight_decay=0.15),
}  # fmt: skip
PRESET_KEYS = (
    "mode", "aggregator", "aggregator_options", "outer_lr", "outer_momentum", "nesterov",
    "inner_lr", "weight_decay",
)  # fmt: skip

#: Fields that only say how this invocation runs, not what is computed: they may differ
#: between a checkpoint and the run that resumes it.
RUNTIME_FIELDS = frozenset(
    {"out", "resume", "allow_config_change", "force", "checkpoint_every", "keep_checkpoints",
     "eval_every", "stop_after", "timeout", "device", "quiet"}
)  # fmt: skip
#: What to do with the run folder, typed for one invocation: never read from a config file nor
#: saved in config.json (a saved ``force`` would let any copy of the file clobber a run).
FOLDER_ACTIONS = ("resume", "allow_config_change", "force")
#: Saved in config.json but not carried into a resume: they say how the invocation that typed
#: them ends (``stop_after``) or talks (``quiet``). The other runtime fields (device, timeout,
#: eval and checkpoint cadence) describe the run and carry over unless given again.
ONE_INVOCATION = ("stop_after", "quiet")
FLOAT32_MAX = 3.4028234663852886e38
#: option -> (largest value, as messages show it): a trained BPE's vocabulary (the tokenizer
#: trainer aborts far beyond it), the collective timeout (a timedelta holds 8.6e13 seconds),
#: the optimizers' hyperparameters torch holds in float32.
UPPER_BOUNDS: dict[str, tuple[float, str]] = {
    "vocab_size": (2**20, "2**20"),
    "timeout": (1e9, "1e9 seconds"),
    "inner_lr": (FLOAT32_MAX, "3.4e38 (float32)"),
    "outer_lr": (FLOAT32_MAX, "3.4e38 (float32)"),
    "weight_decay": (FLOAT32_MAX, "3.4e38 (float32)"),
}


SECTIONS = {
    "model": ModelConfig, "data": DataConfig, "inner": InnerConfig, "outer": OuterConfig,
    "checkpoint": CheckpointConfig, "run": RunConfig,
}  # fmt: skip
#: The flat option names (flags, config files, config.json) -> (section, field).
FLAT_KEYS: dict[str, tuple[str, str]] = {
    "model": ("model", "name"), "init": ("model", "init"), "data": ("data", "source"),
    "inner_steps": ("inner", "steps"), "inner_optimizer": ("inner", "optimizer"),
    "inner_lr": ("inner", "lr"), "outer_lr": ("outer", "lr"),
    "outer_momentum": ("outer", "momentum"), "checkpoint_every": ("checkpoint", "every"),
    "keep_checkpoints": ("checkpoint", "keep"),
}  # fmt: skip
for _section, _kind in SECTIONS.items():
    for _field in dataclasses.fields(_kind):
        if (_section, _field.name) not in FLAT_KEYS.values():
            FLAT_KEYS[_field.name] = (_section, _field.name)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs, in six sections, each validated when built; the
    defaults are the ``diloco`` preset on the nano model. Flat names (``workers``,
    ``outer_lr``: the flags) read and build it through :meth:`to_dict` / :meth:`from_dict`.

    FLOP-matched protocol: each worker's batch is ``global_batch / R``. Inner steps
    ``S = tokens // (global_batch * seq_len)``; rounds ``= S // inner_steps`` (floor: a round
    is never cut short, the budget's remainder is left unused).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        check_values(self)
        check_preset(self.run.preset)
        if self.data.global_batch % self.run.workers:
            raise OptionError(
                "a global batch of {batch} ({0}) is not divisible by {workers} workers ({1}); "
                "each worker's batch is the global batch / R", ("global_batch", "workers"),
                dict(batch=self.data.global_batch, workers=self.run.workers),
            )  # fmt: skip
        if self.data.chinchilla is None:
            self.check_budget(None)

    # -- derived quantities ---------------------------------------------------------------------
    @property
    def worker_batch(self) -> int:
        """Sequences per inner step of one worker: ``global_batch / R``."""
        return self.data.global_batch // self.run.workers

    def token_budget(self, parameter_count: int | None = None) -> int:
        """``tokens``, or ``chinchilla * parameter_count``, or the 2M default."""
        if self.data.chinchilla is not None:
            if parameter_count is None:
                raise ValueError("chinchilla budget needs the model's parameter count")
            return int(self.data.chinchilla * parameter_count)
        return self.data.tokens if self.data.tokens is not None else DEFAULT_TOKENS

    def total_rounds(self, parameter_count: int | None = None) -> int:
        """``floor(S / H)`` with ``S = tokens // (global_batch * seq_len)`` inner steps."""
        steps = self.token_budget(parameter_count) // (self.data.global_batch * self.data.seq_len)
        return steps // self.inner.steps

    def tokens_per_round(self) -> int:
        return self.inner.steps * self.data.global_batch * self.data.seq_len

    def check_budget(self, parameter_count: int | None) -> None:
        """At least one round: ``tokens >= H * global_batch * seq_len``."""
        budget = self.token_budget(parameter_count)
        if self.total_rounds(parameter_count) < 1:
            raise ValueError(
                f"token budget {budget:,} is less than one round: {self.inner.steps} inner steps"
                f" x {self.data.global_batch} sequences x {self.data.seq_len} tokens = "
                f"{self.tokens_per_round():,} tokens"
            )

    # -- flat names -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The flat options as config.json holds them: all but :data:`FOLDER_ACTIONS`."""
        values = {
            flat: getattr(getattr(self, section), name)
            for flat, (section, name) in FLAT_KEYS.items()
            if flat not in FOLDER_ACTIONS
        }
        values["betas"] = list(self.inner.betas)
        values["aggregator_options"] = dict(self.outer.aggregator_options)
        return values

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        """From flat options (checked and converted by :func:`coerce_values`); missing ones
        take the defaults."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for flat, value in coerce_values(dict(values)).items():
            section, name = FLAT_KEYS[flat]
            sections[section][name] = value
        return cls(**{name: SECTIONS[name](**fields) for name, fields in sections.items()})

    def replace(self, **flat: Any) -> TrainConfig:
        """A copy with some flat options changed (the folder actions kept), validated. Another
        ``preset`` brings its values, as in :func:`resolve_config` (the options given here on
        top); another ``aggregator`` drops the options of the one it replaces (they belong to
        it, as :func:`resolve_config` drops a preset's); ``aggregator_options`` given here are
        checked against the new aggregator."""
        actions = {name: getattr(self.checkpoint, name) for name in FOLDER_ACTIONS}
        values = {**self.to_dict(), **actions}
        if flat.get("preset", values["preset"]) != values["preset"]:
            check_preset(flat["preset"])
            defaults = TrainConfig().to_dict()
            values.update({key: defaults[key] for key in PRESET_KEYS})
            values.update(PRESETS[flat["preset"]])
        if flat.get("aggregator", values["aggregator"]) != values["aggregator"]:
            values["aggregator_options"] = {}
        return TrainConfig.from_dict({**values, **flat})

    def run_defining(self) -> dict[str, Any]:
        """The fields that decide what is computed (all but :data:`RUNTIME_FIELDS`)."""
        return {k: v for k, v in self.to_dict().items() if k not in RUNTIME_FIELDS}

    def differences(self, saved: Mapping[str, Any]) -> list[str]:
        """``"name: saved -> now"`` for every run-defining field that differs from ``saved``
        (a config dict, e.g. a checkpoint's). Floats equal to 1e-9 relative are the same value:
        0.497 typed from a printed 0.71 x 0.7 = 0.49699999999999994 names the same run."""
        mine = self.run_defining()
        theirs = TrainConfig.from_dict(saved).run_defining()
        return [
            f"{name}: {theirs[name]!r} -> {value!r}"
            for name, value in mine.items()
            if not same_value(theirs[name], value)
        ]


def check_values(config: TrainConfig) -> None:
    """The bounds the sections leave to the whole config: every float finite, every integer
    (seeds too) in [0, 2**63), :data:`UPPER_BOUNDS`. NaN or Infinity in config.json would make
    the run unresumable (strict JSON)."""
    values = config.to_dict()
    for name, value in values.items():
        for number in value if isinstance(value, list) else [value]:
            if isinstance(number, float) and not math.isfinite(number):
                raise bad_value(name, "must be a finite number, got {value}", value=number)
            if isinstance(number, int) and not 0 <= number < 2**63:
                text = "must be an integer in [0, 2**63), got {value}"
                raise bad_value(name, text, value=brief(number))
    for name, (bound, shown_bound) in UPPER_BOUNDS.items():
        if values[name] > bound:
            text = "must be at most {bound}, got {value}"
            raise bad_value(name, text, bound=shown_bound, value=brief(values[name]))


def same_value(a: Any, b: Any) -> bool:
    """Equal, with floats (also inside lists, tuples and dicts) equal to 1e-9 relative."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


def default(flat: str) -> Any:
    """The declared default of a flat option (CLI help reads it here), read off the section's
    field without building the section (whose checks import the merge methods, and torch)."""
    section, name = FLAT_KEYS[flat]
    declared = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    if declared.default is dataclasses.MISSING:
        return declared.default_factory()
    return declared.default


# -- filling a config ---------------------------------------------------------------------------
FIELD_TYPES = {
    flat: typing.get_type_hints(SECTIONS[section])[name]
    for flat, (section, name) in FLAT_KEYS.items()
}


def coerce_values(values: Mapping[str, Any], source: str = "config") -> dict[str, Any]:
    """Check names and convert values (``outer-lr`` -> ``outer_lr``, ints to floats, lists to
    tuples); an unknown key or a value of the wrong type raises ``ValueError`` naming the option
    and ``source``, as do two spellings of one option (``outer-lr`` and ``outer_lr``)."""
    coerced, spelled = {}, {}
    for raw_key, value in values.items():
        key = raw_key.replace("-", "_") if isinstance(raw_key, str) else raw_key
        if key not in FIELD_TYPES:
            where = aggregator_option_advice(key, value, source)
            raise ValueError(f"{source}: unknown option {bounded(raw_key)}{where}")
        if key in spelled:
            raise ValueError(
                f"{source}: {spelled[key]} and {raw_key} are one option, {key}; give it once"
            )
        spelled[key] = raw_key
        coerced[key] = _coerce(key, FIELD_TYPES[key], value, source)
    return coerced


def aggregator_option_advice(key: Any, value: Any, source: str) -> str:
    """Where a merge method's parameter (``density``) goes when it was given as a run option:
    in ``aggregator_options`` (the Python keyword, or a config file's table); else ``""``."""
    from mergekit_loco.methods.registry import METHODS  # torch: on error only

    if not any(key in method.parameter_names() for method in METHODS.values()):
        return ""
    advice = "; it is an aggregator option: "
    if source == "flags":
        return advice + f"pass aggregator_options={{{key!r}: {bounded(value)}}}"
    return advice + "put it in the aggregator_options table ([aggregator_options] in TOML)"


def _coerce(key: str, annotation: Any, value: Any, source: str) -> Any:
    """``value`` as the option's type; the message is built only on failure and shows the value
    through :func:`bounded` (never expanding a huge one)."""
    kinds = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else ()
    if value is None:
        if type(None) in kinds:
            return None
        raise ValueError(f"{source}: option {key!r} cannot be empty")
    target = next((kind for kind in kinds if kind is not type(None)), annotation)
    origin = typing.get_origin(target) or target
    if origin is bool and isinstance(value, bool):
        return value
    integral = isinstance(value, numbers.Integral) or (
        (number := float_or_none(value)) is not None and number.is_integer()
    )
    if origin is int and integral and not isinstance(value, bool):
        return int(value)
    if origin is float and (number := float_or_none(value)) is not None:
        return number
    if origin is str and isinstance(value, str | os.PathLike):
        return os.fspath(value)
    if origin is dict and isinstance(value, Mapping):
        return dict(value)
    if origin is tuple and isinstance(value, list | tuple):
        items = [float_or_none(item) for item in value]
        if len(items) == len(typing.get_args(target)) and None not in items:
            return tuple(items)
    expected = {tuple: f"a list of {len(typing.get_args(target))} numbers"}.get(
        origin, getattr(origin, "__name__", origin)
    )
    raise ValueError(f"{source}: option {key!r} expects {expected}, got {bounded(value)}")


def float_or_none(value: Any) -> float | None:
    """``value`` as a float if it is a real number (``numbers.Real``, numpy's too; not a bool)
    that fits one, else None."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer beyond 1.8e308
        return None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Keys and values of a ``.toml``, ``.yaml``/``.yml`` or ``.json`` config file (a regular
    file of at most 1 MiB, no key given twice; YAML read by the hardened loader of
    :mod:`mergekit_loco.io.yaml_config`); any error names the file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise ValueError(f"config file {shown(path)}: use .toml, .yaml, .yml or .json")
    if not path.exists():
        raise ValueError(f"config file {shown(path)} does not exist")
    raw = read_limited(path, MAX_CONFIG_BYTES, "config file")
    try:
        text = raw.decode("utf-8")
        if suffix == ".toml":
            values = tomllib.loads(text)  # refuses a key given twice itself
        elif suffix == ".json":
            values = json.loads(text, object_pairs_hook=unique_keys)
        else:
            values = load_yaml(text, path) or {}
    except ConfigFileError:  # an alias bomb, deep nesting, a key twice or not a string
        raise
    except Exception as error:  # decoding and the three parsers' errors, huge integers
        cause = parse_error_text(error)
        raise ValueError(f"config file {shown(path)} cannot be parsed: {cause}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config file {shown(path)} must hold a table of options")
    return values


def resolve_config(config_file: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """Build and validate a config: defaults < preset < ``config_file`` < ``overrides``.

    ``overrides`` with the value None are ignored (a flag not given). An aggregator given
    without a preset brings its tuned preset (:func:`aggregator_preset`: ``aggregator="tsv"``
    is ``preset="tsv"``), whose values explicit ones override. ``aggregator_options`` from the
    preset, the file and the overrides are merged key by key, unless the aggregator was changed
    from the preset's, in which case the preset's options are dropped. With ``resume=True`` the
    run's saved ``OUT/config.json`` replaces the defaults. ``mode="dp"`` without a preset brings
    the ``dp`` preset; in that mode outer-step options other than the preset's are refused
    (:func:`check_no_outer_step`).
    """
    explicit, flags, given = read_options(config_file, overrides)
    explicit = without_folder_actions(explicit, config_file)
    file_options = explicit.pop("aggregator_options", {})
    options = {**file_options, **flags.pop("aggregator_options", {})}
    explicit.update(flags)
    if "preset" not in explicit and not explicit.get("resume"):
        if explicit.get("mode") == "dp":
            explicit["preset"] = "dp"
        elif "aggregator" in explicit:
            tuned = aggregator_preset(explicit["aggregator"])
            if tuned is not None:
                explicit["preset"] = tuned

    base = TrainConfig().to_dict()
    if explicit.get("resume"):
        check_not_a_model(Path(explicit.get("out", base["out"])))
        saved = Path(explicit.get("out", base["out"])) / "config.json"
        if saved.exists():  # a FIFO or device there is refused by read_json, not skipped
            saved_values = read_json(saved, "run config")  # a regular file, strict, bounded
            if not isinstance(saved_values, dict):
                raise ValueError(f"{shown(saved)}: not a JSON object (a damaged run config?)")
            dropped = (*FOLDER_ACTIONS, *ONE_INVOCATION)  # folder actions: runs of old versions
            kept = {k: v for k, v in saved_values.items() if k not in dropped}
            base.update(coerce_values(kept, shown(saved)))
    if "preset" in explicit:
        preset = explicit["preset"]
        check_preset(preset)
        base.update({key: TrainConfig().to_dict()[key] for key in PRESET_KEYS})
        base.update(PRESETS[preset])
    if explicit.get("aggregator", base["aggregator"]) != base["aggregator"]:
        base["aggregator_options"] = {}
    values = {**base, **explicit}
    if "chinchilla" in explicit and "tokens" not in explicit:
        values["tokens"] = None  # the default budget gives way to the chinchilla one
    values["aggregator_options"] = {**base.get("aggregator_options", {}), **options}
    if values["mode"] == "dp":
        check_no_outer_step(explicit, options, base, given)
    check_file_options(values["aggregator"], file_options, config_file)
    return TrainConfig.from_dict(values)


def check_file_options(
    aggregator: str, options: Mapping[str, Any], config_file: str | Path | None
) -> None:
    """Refuse, naming ``config_file``, an ``[aggregator_options]`` key the aggregator does not
    take (a typo there, ``densty``); the values are checked with the rest of the config."""
    if not options:
        return
    from mergekit_loco.methods.registry import METHODS  # torch: only for a file with options

    if aggregator not in METHODS:
        return  # the unknown aggregator is refused, by name, with the rest of the config
    accepted = METHODS[aggregator].parameter_names()
    unknown = [key for key in options if key not in accepted]
    if unknown:
        takes = ", ".join(accepted) if accepted else "no options"
        raise ValueError(
            f"aggregator_options in {shown(config_file)}: method {aggregator!r} does not take "
            f"{unknown[0]!r} (it takes {takes})"
        )


def without_folder_actions(
    from_file: Mapping[str, Any], config_file: str | Path | None
) -> dict[str, Any]:
    """A config file's options but :data:`FOLDER_ACTIONS`: one set true there is refused (only a
    typed flag may resume, or start over in, a run folder); a false one, as the config.json of
    earlier versions holds, is dropped."""
    for key in FOLDER_ACTIONS:
        if from_file.get(key):
            raise ValueError(
                f"{key} in {shown(config_file)}: a config file cannot say what to do with the run "
                f"folder; pass {flag_name(key)} instead"
            )
    return {key: value for key, value in from_file.items() if key not in FOLDER_ACTIONS}


def option_names(
    config_file: str | Path | None, from_file: Mapping[str, Any], flags: Mapping[str, Any]
) -> dict[str, str]:
    """Each option the user set (by its flat name), named as they wrote it: ``--outer-lr`` for
    a flag (which wins), ``outer-lr in FILE`` for a key of the config file."""
    names = {key.replace("-", "_"): f"{key} in {shown(Path(config_file))}" for key in from_file}
    return names | {key: flag_name(key) for key in flags}


def read_options(
    config_file: str | Path | None, overrides: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """The config file's options and the flags (those not None), each checked and converted,
    and :func:`option_names` of both."""
    from_file = read_config_file(config_file) if config_file else {}
    explicit = coerce_values(from_file, shown(config_file))
    flags = coerce_values({k: v for k, v in overrides.items() if v is not None}, "flags")
    return explicit, flags, option_names(config_file, from_file, flags)


def given_options(config_file: str | Path | None, **overrides: Any) -> dict[str, str]:
    """:func:`option_names` of the options :func:`resolve_config` would read as set."""
    return read_options(config_file, overrides)[2]


def resumed_names(config_file: str | Path | None, **overrides: Any) -> dict[str, str]:
    """On ``--resume``, every option named ``key in OUT/config.json``: a refused value that no
    flag or config file set came from the run's saved config (the defaults are valid); {}
    otherwise."""
    explicit, flags, _ = read_options(config_file, overrides)
    options = {**explicit, **flags}
    if not options.get("resume"):
        return {}
    saved = shown(Path(options.get("out", TrainConfig().run.out)) / "config.json")
    return {key: f"{key} in {saved}" for key in TrainConfig().to_dict()}


#: Options that only the DiLoCo outer step reads.
OUTER_KEYS = ("aggregator", "outer_lr", "outer_momentum", "nesterov", "compression")


def check_no_outer_step(
    explicit: Mapping[str, Any],
    options: Mapping[str, Any],
    base: Mapping[str, Any],
    given: Mapping[str, str],
) -> None:
    """Refuse, in the data-parallel mode, outer-step options set to other values than the
    preset's: the baseline has no outer step, so they would be ignored without a word.
    ``given`` names each option as the user wrote it (``--outer-lr``, ``outer_lr in FILE``).
    A DiLoCo ``--preset`` typed with the dp mode is refused too, except on resume (runs of
    earlier versions were started that way) and from a config file (a saved ``config.json``)."""
    preset = explicit.get("preset")
    typed = given.get("preset", "").startswith("--")
    if typed and not explicit.get("resume") and PRESETS[preset].get("mode") != "dp":
        raise ValueError(
            f"preset {preset} (--preset) is a DiLoCo preset, but mode dp "
            f"({given.get('mode', 'mode')}) asks for the data-parallel AdamW baseline; "
            "use --preset dp for the baseline, or drop the mode"
        )
    ignored = [given[key] for key in OUTER_KEYS if key in explicit and explicit[key] != base[key]]
    ignored += [f"aggregator option {key}" for key in options]
    if ignored:
        raise ValueError(
            f"mode dp, the data-parallel AdamW baseline, has no outer step: {', '.join(ignored)} "
            "would be ignored; drop it, or train DiLoCo (--mode diloco, or a DiLoCo --preset)"
        )


def presets_using(aggregator: str) -> list[str]:
    """The DiLoCo presets (in :data:`PRESETS` order) whose aggregator is ``aggregator``: mean
    -> diloco, diloco-sgd; iso-c -> isoloco, isoloco-ns, isoc-sgd; none for ta and breadcrumbs."""
    return [
        name
        for name, changes in PRESETS.items()
        if changes.get("mode", default("mode")) == "diloco"
        and changes.get("aggregator", default("aggregator")) == aggregator
    ]


def aggregator_preset(aggregator: str) -> str | None:
    """The first DiLoCo preset that uses ``aggregator`` (:func:`presets_using`), if any."""
    return next(iter(presets_using(aggregator)), None)


def check_preset(preset: str) -> None:
    """Refuse an unknown preset; a merge method's name (``iso-c``, or mergekit's
    ``task_arithmetic``) is answered with the presets that aggregate with it."""
    if preset in PRESETS:
        return
    message = f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}"
    from mergekit_loco.methods.registry import (  # torch: on error only
        METHODS,
        closest_name,
        mergekit_equivalent,
    )

    method = preset if preset in METHODS else mergekit_equivalent(preset)
    what = "a merge method" if method == preset else f"mergekit's name of the merge method {method}"
    if method is None:  # a misspelling: of a preset, or of a method (iso_c -> iso-c)
        close = closest_name(preset, [*PRESETS, *METHODS])
        if close is None or close in PRESETS:
            raise ValueError(message + (f" (did you mean {close}?)" if close else ""))
        method, what = close, f"close to the merge method {close}"
    using = presets_using(method)
    advice = (
        f"the presets that aggregate with it: {', '.join(using)}"
        if using
        else f"no preset aggregates with it (mloco train --aggregator {method} does)"
    )
    raise ValueError(f"{message} ({preset!r} is {what}; {advice})")


def preset_config(preset: str = "diloco", **overrides: Any) -> TrainConfig:
    """``TrainConfig`` of ``preset`` with ``overrides`` (Python API shortcut), validated."""
    return resolve_config(None, preset=preset, **overrides)
