"""The six sections of a run's configuration, each a frozen dataclass that checks its own
fields when it is built (cross-section checks and the flat option names: train/config.py).
Their defaults are the only defaults. A bad value raises :class:`OptionError`, whose message
uses the flat option names until the command line names them as the user wrote them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MODES = ("diloco", "dp")
INNER_OPTIMIZERS = ("adamw", "muon")
DEVICES = ("auto", "cpu", "cuda")


DEFAULT_TOKENS = 2_000_000


def flag_name(option: str) -> str:
    """The command-line flag of a flat option name: ``global_batch`` -> ``--global-batch``."""
    return "--" + option.replace("_", "-")


class OptionError(ValueError):
    """A bad value of the options ``options`` (flat names). ``template`` refers to them as
    ``{0}``, ``{1}`` and to ``values`` by name; ``str()`` shows the flat names (``global_batch
    must be >= 1``), :meth:`named` the names the user wrote (``--global-batch``, ``global_batch
    in run.toml``). An option may name one key of a mapping option (``aggregator_options.density``):
    shown as the mapping's name unless ``names`` names the key."""

    def __init__(self, template: str, options: tuple[str, ...], values: Mapping | None = None):
        super().__init__(template, tuple(options), dict(values or {}))

    def named(self, names: Mapping[str, str]) -> str:
        """The message with each option named by ``names`` (flat name -> shown name), those it
        lacks by their flat name."""
        template, options, values = self.args

        def name(option: str) -> str:
            mapping = option.partition(".")[0]
            return names.get(option, names.get(mapping, mapping))

        return template.format(*(name(option) for option in options), **values)

    def __str__(self) -> str:
        return self.named({})


def bad_value(option: str, text: str, **values: Any) -> OptionError:
    """:class:`OptionError` of one option: ``"{option} " + text`` with ``values`` filled in."""
    return OptionError("{0} " + text, (option,), values)


def escaped(error: BaseException) -> str:
    """``error``'s message as literal text in an :class:`OptionError` template."""
    return str(error).replace("{", "{{").replace("}", "}}")


def check_choice(name: str, value: str, choices) -> None:
    if value not in choices:
        raise OptionError(
            "unknown {0} {value!r}; choose one of {choices}", (name,),
            dict(value=value, choices=", ".join(choices)),
        )  # fmt: skip


def _check_at_least(minimum: int, **values: int) -> None:
    """``values``: flat option name -> value."""
    for name, value in values.items():
        if value < minimum:
            raise bad_value(name, "must be >= {minimum}, got {value}", minimum=minimum, value=value)


def check_path_text(**paths: str | None) -> None:
    """ValueError naming the option whose path is an empty string (an unset variable in a
    config file: it would mean the current folder) or holds a NUL character (no file name
    does)."""
    for option, path in paths.items():
        if isinstance(path, str) and not path.strip():
            raise OptionError("{0}: an empty path (it would mean the current folder)", (option,))
    check_no_nul(**paths)


def check_no_nul(**texts: str | None) -> None:
    """ValueError naming the option whose path or data spec holds a NUL character (before:
    ``embedded null byte``, naming nothing)."""
    for option, text in texts.items():
        if isinstance(text, str) and "\0" in text:
            template = "{0}: {text!r} holds a NUL character, which no path can"
            raise OptionError(template, (option,), dict(text=text))


@dataclass(frozen=True)
class ModelConfig:
    """``name``: a preset (micro, nano, 178m, 512m) or a causal-LM config.json; ``init``: start
    from this HF folder / safetensors file instead of a fresh init (fine-tuning)."""

    name: str = "nano"
    init: str | None = None

    def __post_init__(self):
        check_path_text(model=self.name, init=self.init)


@dataclass(frozen=True)
class DataConfig:
    """The documents (``source``), tokenizer, validation hold-out, batch shape and token budget:
    ``tokens`` (2M, recorded as such, unless ``chinchilla``), or ``chinchilla`` tokens per model
    parameter (the
    paper uses 20). ``global_batch`` sequences per inner step summed over the workers."""

    source: str = "stdlib"
    tokenizer: str | None = None
    vocab_size: int = 4096
    val_tokens: int = 65536
    seq_len: int = 128
    global_batch: int = 64
    tokens: int | None = None
    chinchilla: float | None = None
    #: seed of the validation documents (None: the run's seed); one value shares them across seeds.
    val_seed: int | None = None

    def __post_init__(self):
        check_path_text(tokenizer=self.tokenizer)
        check_no_nul(data=self.source)
        _check_at_least(1, vocab_size=self.vocab_size, global_batch=self.global_batch)
        _check_at_least(2, seq_len=self.seq_len)
        if self.val_tokens < self.seq_len:
            raise OptionError(
                "{0} must be >= {1} ({seq_len}), got {value}", ("val_tokens", "seq_len"),
                dict(seq_len=self.seq_len, value=self.val_tokens),
            )  # fmt: skip
        if self.tokens is not None and self.chinchilla is not None:
            raise OptionError(
                "set the token budget with {0} or {1}, not both", ("tokens", "chinchilla")
            )
        if self.tokens is not None and self.tokens < 1:
            raise bad_value("tokens", "must be >= 1, got {value}", value=self.tokens)
        if self.chinchilla is not None and self.chinchilla <= 0:
            raise bad_value("chinchilla", "must be > 0, got {value}", value=self.chinchilla)
        if self.val_seed is not None and not 0 <= self.val_seed < 2**63:
            raise bad_value(
                "val_seed", "must be an integer in [0, 2**63), got {value}", value=self.val_seed
            )
        if self.tokens is None and self.chinchilla is None:  # the default budget, written down
            object.__setattr__(self, "tokens", DEFAULT_TOKENS)


@dataclass(frozen=True)
class InnerConfig:
    """Each worker's H = ``steps`` inner steps per round: AdamW (or Muon on hidden matrices)
    with a warmup-cosine schedule peaking at ``lr``, gradient norm clip (0: off)."""

    steps: int = 30
    optimizer: str = "adamw"
    lr: float = 1.38e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    warmup_fraction: float = 0.1

    def __post_init__(self):
        check_choice("inner_optimizer", self.optimizer, INNER_OPTIMIZERS)
        _check_at_least(1, inner_steps=self.steps)
        if not self.lr > 0:
            raise bad_value("inner_lr", "must be > 0, got {value}", value=self.lr)
        if self.weight_decay < 0:
            raise bad_value("weight_decay", "must be >= 0, got {value}", value=self.weight_decay)
        if self.grad_clip < 0:
            raise bad_value(
                "grad_clip", "must be >= 0 (0: no clipping), got {value}", value=self.grad_clip
            )
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise bad_value("betas", "must be two numbers in [0, 1), got {value}", value=self.betas)
        if not 0 <= self.warmup_fraction < 1:
            raise bad_value(
                "warmup_fraction", "must lie in [0, 1), got {value}", value=self.warmup_fraction
            )


def refused_option(aggregator: str, options: Mapping[str, Any]) -> str:
    """``aggregator_options.KEY`` for the first option ``aggregator`` refuses on its own, else
    ``aggregator_options`` (refused together, as ``rank_aware`` with ``spectral="ns"``)."""
    from mergekit_loco.methods import get_method
    from mergekit_loco.methods.registry import typed_options

    for key, value in options.items():
        try:
            get_method(aggregator, **typed_options(aggregator, {key: value}))
        except (ValueError, TypeError):
            return f"aggregator_options.{key}"
    return "aggregator_options"


@dataclass(frozen=True)
class OuterConfig:
    """The outer step: ``aggregator`` (a merge method with its options) merges the workers'
    deltas; SGD with ``lr``, ``momentum`` (Nesterov or not) steps on ``-merged``.
    ``compression``: what the outer step communicates, None (exact), "bf16" or "int8".
    ``aggregator_options`` from text or a config file take the method's field types
    (``weights="1,0.5"`` or ``[1, 0.5]`` -> ``(1.0, 0.5)``)."""

    aggregator: str = "mean"
    aggregator_options: dict[str, Any] = field(default_factory=dict)
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    compression: str | None = None

    def __post_init__(self):
        if not self.lr > 0:
            raise bad_value("outer_lr", "must be > 0, got {value}", value=self.lr)
        if not 0 <= self.momentum < 1:
            raise bad_value(
                "outer_momentum", "must lie in [0, 1), got {value}", value=self.momentum
            )
        if self.nesterov and self.momentum == 0:
            raise OptionError(
                "{0} needs {1} > 0 (or turn Nesterov off: --no-nesterov, nesterov = false)",
                ("nesterov", "outer_momentum"),
            )  # fmt: skip
        from mergekit_loco.methods import get_method  # torch: not for `mloco train --help`
        from mergekit_loco.methods.registry import typed_options
        from mergekit_loco.train.diloco import check_compression

        check_compression(self.compression)
        try:
            get_method(self.aggregator)
        except ValueError as error:
            raise OptionError("{0}: " + escaped(error), ("aggregator",)) from None
        try:  # the method exists: what is refused now is one of its options
            options = typed_options(self.aggregator, self.aggregator_options)
            object.__setattr__(self, "aggregator_options", options)
            get_method(self.aggregator, **options)
        except (ValueError, TypeError) as error:
            refused = refused_option(self.aggregator, self.aggregator_options)
            raise OptionError("{0}: " + escaped(error), (refused,)) from None


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoint ``every`` N rounds (0: only at the end), keep the newest ``keep``; resume the
    run in ``out`` (optionally with another config), or start over there (``force``)."""

    every: int = 1  # every round, keeping the newest: a stop after any round can resume
    keep: int = 1
    resume: bool = False
    allow_config_change: bool = False
    force: bool = False

    def __post_init__(self):
        _check_at_least(0, checkpoint_every=self.every)
        _check_at_least(1, keep_checkpoints=self.keep)


@dataclass(frozen=True)
class RunConfig:
    """The run as a whole. ``mode`` "diloco": R = ``workers`` workers, an outer step per round;
    "dp": one model on the whole global batch every step (the AdamW data-parallel baseline).
    ``eval_every`` N rounds (0: only at the end); ``stop_after`` N completed rounds (with a
    checkpoint; resume continues); ``timeout``: collective timeout in seconds (torchrun)."""

    preset: str = "diloco"
    mode: str = "diloco"
    workers: int = 8
    seed: int = 0
    out: str = "runs/train"
    eval_every: int = 0
    stop_after: int | None = None
    timeout: float = 1800.0
    device: str = "auto"
    quiet: bool = False

    def __post_init__(self):
        check_path_text(out=self.out)
        check_choice("mode", self.mode, MODES)
        check_choice("device", self.device, DEVICES)
        _check_at_least(1, workers=self.workers)
        _check_at_least(0, eval_every=self.eval_every)
        if self.stop_after is not None and self.stop_after < 1:
            raise bad_value("stop_after", "must be >= 1, got {value}", value=self.stop_after)
        if not self.timeout > 0:
            raise bad_value("timeout", "must be > 0, got {value}", value=self.timeout)
