"""Run configuration: a typed dataclass that presets, a TOML/YAML/JSON file and flags fill.

Precedence, lowest first: dataclass defaults < preset < config file < flags. When resuming
(``resume=True``) the run's saved ``config.json`` takes the place of the defaults, so
``--resume --out DIR`` continues the run as it was configured.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergekit_loco.methods import get_method

MODES = ("diloco", "dp")
INNER_OPTIMIZERS = ("adamw", "muon")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_TOKENS = 2_000_000

#: The seed paper's tuned 178M, R = 8 values. Each preset sets every key listed in
#: PRESET_KEYS, so switching presets never leaves a value of the previous one behind.
PRESETS: dict[str, dict[str, Any]] = {
    "diloco": dict(aggregator="mean", outer_lr=0.7, outer_momentum=0.9, nesterov=True,
                   inner_lr=1.38e-3),
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


@dataclass
class TrainConfig:
    """Everything a training run needs. Defaults are the ``diloco`` preset on the nano model.

    FLOP-matched protocol: ``global_batch`` sequences per inner step summed over the
    ``workers`` (R), so each worker's batch is ``global_batch / R``. Inner steps
    ``S = tokens // (global_batch * seq_len)``; rounds ``= S // inner_steps`` (floor: a round
    is never cut short, the budget's remainder is left unused).
    """

    preset: str = "diloco"
    #: "diloco": R workers, H inner steps, an outer step per round; "dp": one model trained
    #: on the whole global batch every step (AdamW data-parallel baseline, no outer step).
    mode: str = "diloco"
    model: str = "nano"
    aggregator: str = "mean"
    aggregator_options: dict[str, Any] = field(default_factory=dict)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    workers: int = 8
    inner_steps: int = 30
    global_batch: int = 64
    seq_len: int = 128
    #: token budget; default 2M unless ``chinchilla`` is given.
    tokens: int | None = None
    #: token budget as tokens per model parameter (the paper uses 20).
    chinchilla: float | None = None
    inner_lr: float = 1.38e-3
    inner_optimizer: str = "adamw"
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    warmup_fraction: float = 0.1
    seed: int = 0
    #: seed of the validation documents (None: ``seed``); one value shares them across seeds.
    val_seed: int | None = None
    data: str = "stdlib"
    tokenizer: str | None = None
    vocab_size: int = 4096
    val_tokens: int = 65536
    #: start from this HF folder / safetensors file instead of a fresh init (fine-tuning).
    init: str | None = None
    out: str = "runs/train"
    #: checkpoint every N rounds (0: only at the end).
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    #: validation loss every N rounds (0: only at the end).
    eval_every: int = 0
    #: end this invocation after N completed rounds (with a checkpoint); resume continues.
    stop_after: int | None = None
    resume: bool = False
    allow_config_change: bool = False
    force: bool = False
    #: collective timeout in seconds (torchrun).
    timeout: float = 1800.0
    #: what the outer step communicates: None (exact), "bf16" or "int8" (per-row scales).
    compression: str | None = None
    device: str = "auto"
    quiet: bool = False

    # -- derived quantities ---------------------------------------------------------------------
    @property
    def worker_batch(self) -> int:
        """Sequences per inner step of one worker: ``global_batch / R``."""
        return self.global_batch // self.workers

    def token_budget(self, parameter_count: int | None = None) -> int:
        """``tokens``, or ``chinchilla * parameter_count``, or the 2M default."""
        if self.chinchilla is not None:
            if parameter_count is None:
                raise ValueError("chinchilla budget needs the model's parameter count")
            return int(self.chinchilla * parameter_count)
        return self.tokens if self.tokens is not None else DEFAULT_TOKENS

    def total_rounds(self, parameter_count: int | None = None) -> int:
        """``floor(S / H)`` with ``S = tokens // (global_batch * seq_len)`` inner steps."""
        steps = self.token_budget(parameter_count) // (self.global_batch * self.seq_len)
        return steps // self.inner_steps

    def tokens_per_round(self) -> int:
        return self.inner_steps * self.global_batch * self.seq_len

    # -- validation -----------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent option (no compute needed)."""
        _check_choice("preset", self.preset, PRESETS)
        _check_choice("mode", self.mode, MODES)
        _check_choice("inner_optimizer", self.inner_optimizer, INNER_OPTIMIZERS)
        _check_choice("device", self.device, DEVICES)
        for name in ("workers", "inner_steps", "global_batch", "keep_checkpoints", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
        if self.global_batch % self.workers:
            raise ValueError(
                f"global_batch {self.global_batch} is not divisible by {self.workers} workers "
                "(each worker's batch is global_batch / workers)"
            )
        if self.val_tokens < self.seq_len:
            raise ValueError(
                f"val_tokens must be >= seq_len ({self.seq_len}), got {self.val_tokens}"
            )
        for name in ("checkpoint_every", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"stop_after must be >= 1, got {self.stop_after}")
        if self.tokens is not None and self.chinchilla is not None:
            raise ValueError("set the token budget with tokens or chinchilla, not both")
        if self.tokens is not None and self.tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {self.tokens}")
        if self.chinchilla is not None and self.chinchilla <= 0:
            raise ValueError(f"chinchilla must be > 0, got {self.chinchilla}")
        if self.chinchilla is None:
            self.check_budget(None)
        for name in ("inner_lr", "timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ValueError("weight_decay and grad_clip must be >= 0 (grad_clip 0: no clipping)")
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must lie in [0, 1), got {self.warmup_fraction}")
        if self.compression not in (None, "bf16", "int8"):
            raise ValueError(f"compression must be bf16 or int8, not {self.compression!r}")
        if self.mode == "diloco":
            self.check_outer()

    def check_budget(self, parameter_count: int | None) -> None:
        """At least one round: ``tokens >= H * global_batch * seq_len``."""
        budget = self.token_budget(parameter_count)
        if self.total_rounds(parameter_count) < 1:
            raise ValueError(
                f"token budget {budget:,} is less than one round: {self.inner_steps} inner steps x "
                f"{self.global_batch} sequences x {self.seq_len} tokens = "
                f"{self.tokens_per_round():,} tokens"
            )

    def check_outer(self) -> None:
        if not self.outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must lie in [0, 1), got {self.outer_momentum}")
        if self.nesterov and self.outer_momentum == 0:
            raise ValueError("nesterov needs outer_momentum > 0 (use --no-nesterov)")
        try:
            get_method(self.aggregator, **self.aggregator_options)
        except ValueError as error:
            raise ValueError(f"aggregator: {error}") from None
        except TypeError as error:
            raise ValueError(f"aggregator options {self.aggregator_options}: {error}") from None

    # -- (de)serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["betas"] = list(self.betas)
        return values

    def run_defining(self) -> dict[str, Any]:
        """The fields that decide what is computed (all but :data:`RUNTIME_FIELDS`)."""
        return {k: v for k, v in self.to_dict().items() if k not in RUNTIME_FIELDS}

    def differences(self, saved: Mapping[str, Any]) -> list[str]:
        """``"name: saved -> now"`` for every run-defining field that differs from ``saved``
        (a config dict, e.g. a checkpoint's)."""
        mine = self.run_defining()
        theirs = TrainConfig.from_dict(saved).run_defining()
        return [
            f"{name}: {theirs[name]!r} -> {value!r}"
            for name, value in mine.items()
            if theirs[name] != value
        ]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        return cls(**coerce_values(dict(values)))


def _check_choice(name: str, value: str, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")


# -- filling a config ---------------------------------------------------------------------------
FIELD_TYPES = typing.get_type_hints(TrainConfig)


def coerce_values(values: dict[str, Any], source: str = "config") -> dict[str, Any]:
    """Check names and convert values (``outer-lr`` -> ``outer_lr``, ints to floats, lists to
    tuples); unknown keys raise ``ValueError`` naming the key and ``source``."""
    coerced = {}
    for raw_key, value in values.items():
        key = raw_key.replace("-", "_")
        if key not in FIELD_TYPES:
            raise ValueError(f"{source}: unknown option {raw_key!r}")
        coerced[key] = _coerce(key, FIELD_TYPES[key], value, source)
    return coerced


def _coerce(key: str, annotation: Any, value: Any, source: str) -> Any:
    kinds = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else ()
    if value is None:
        if type(None) in kinds:
            return None
        raise ValueError(f"{source}: option {key!r} cannot be empty")
    target = next((kind for kind in kinds if kind is not type(None)), annotation)
    origin = typing.get_origin(target) or target
    bad = ValueError(f"{source}: option {key!r} expects {getattr(origin, '__name__', origin)}, "
                     f"got {value!r}")  # fmt: skip
    if origin is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if origin is int:
        if isinstance(value, bool) or not float(value).is_integer():
            raise bad
        return int(value)
    if origin is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad
        return float(value)
    if origin is str:
        return str(value)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise bad
        return dict(value)
    if origin is tuple:
        return tuple(float(item) for item in value)
    raise bad


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Keys and values of a ``.toml``, ``.yaml``/``.yml`` or ``.json`` config file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    text = path.read_text()
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                raise ValueError(f"{path}: TOML config files need Python 3.11+") from None
            values = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml

            values = yaml.safe_load(text) or {}
        elif suffix == ".json":
            values = json.loads(text)
        else:
            raise ValueError(f"config file {path}: use .toml, .yaml, .yml or .json")
    except ValueError:
        raise
    except Exception as error:  # parser errors of three libraries
        raise ValueError(f"config file {path} cannot be parsed: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"config file {path} must hold a table of options")
    return values


def resolve_config(config_file: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """Build and validate a config: defaults < preset < ``config_file`` < ``overrides``.

    ``overrides`` with the value None are ignored (a flag not given). ``aggregator_options``
    from the preset, the file and the overrides are merged key by key, unless the aggregator was
    changed from the preset's, in which case the preset's options are dropped. With
    ``resume=True`` the run's saved ``OUT/config.json`` replaces the defaults.
    """
    explicit = coerce_values(read_config_file(config_file), str(config_file)) if config_file else {}
    flags = coerce_values({k: v for k, v in overrides.items() if v is not None}, "flags")
    options = {**explicit.pop("aggregator_options", {}), **flags.pop("aggregator_options", {})}
    explicit.update(flags)

    base = TrainConfig().to_dict()
    if explicit.get("resume"):
        saved = Path(explicit.get("out", base["out"])) / "config.json"
        if saved.is_file():
            base.update(coerce_values(json.loads(saved.read_text()), str(saved)))
    if "preset" in explicit:
        preset = explicit["preset"]
        _check_choice("preset", preset, PRESETS)
        base.update({key: TrainConfig().to_dict()[key] for key in PRESET_KEYS})
        base.update(PRESETS[preset])
    if explicit.get("aggregator", base["aggregator"]) != base["aggregator"]:
        base["aggregator_options"] = {}
    values = {**base, **explicit}
    values["aggregator_options"] = {**base.get("aggregator_options", {}), **options}
    config = TrainConfig.from_dict(values)
    config.validate()
    return config


def preset_config(preset: str = "diloco", **overrides: Any) -> TrainConfig:
    """``TrainConfig`` of ``preset`` with ``overrides`` (Python API shortcut), validated."""
    return resolve_config(None, preset=preset, **overrides)
