"""PEFT LoRA adapters read as task vectors: ``delta W = scaling * B @ A`` per target module.

An adapter folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` with, per
adapted linear layer ``M``, ``base_model.model.M.lora_A.weight`` (r x in) and
``base_model.model.M.lora_B.weight`` (out x r); it adapts the base tensor ``M.weight``.
``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), ``r`` and
``lora_alpha`` of a module taken from the first ``rank_pattern`` / ``alpha_pattern`` key that
matches its name as PEFT matches it (:class:`ModulePattern`; a key that can backtrack
catastrophically is refused). Options that are not
a plain low-rank delta of a weight (DoRA, trained biases, saved full modules, embedding LoRA,
``fan_in_fan_out``) are refused with the option named. So is an adapter whose factors are not
finite floating-point matrices of matching rank, that names one factor twice, holds none, or
whose files are symlinks leading outside its folder. Factors stored in a narrower dtype than
float32 (8-bit floats included) are scaled and multiplied in float32.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from mergekit_loco.io.atomic import ADAPTER_CONFIG, ADAPTER_WEIGHTS, check_output, staged_output
from mergekit_loco.io.files import inside, read_json, shown
from mergekit_loco.io.reader import CheckpointError, CheckpointReader, read_header
from mergekit_loco.task_vector import all_finite

try:
    from re import _parser as regex_parser  # Python's own regex parser (3.11+)
except ImportError:  # pragma: no cover - an older name of the same module
    import sre_parse as regex_parser

KEY_PREFIX = "base_model.model."


def is_lora_adapter(path: str | Path) -> bool:
    """A folder with ``adapter_config.json`` (a PEFT adapter, not a full checkpoint)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


#: The longest ``rank_pattern`` / ``alpha_pattern`` key read (PEFT's own are module names).
MAX_PATTERN_CHARS = 1000
#: The most keys a ``rank_pattern`` / ``alpha_pattern`` may hold: each module name is matched
#: against every key (PEFT's rule), keys x modules matches in all; PEFT writes at most one key
#: per module, and 100000 are more modules than any model we know adapts.
MAX_PATTERN_KEYS = 100_000


#: Parsed-pattern operators that repeat their body: ``*``, ``+``, ``?``, ``{m,n}`` (greedy, lazy,
#: possessive).
_REPEATS = (regex_parser.MAX_REPEAT, regex_parser.MIN_REPEAT, regex_parser.POSSESSIVE_REPEAT)


def _subpatterns(argument: object) -> Iterator[regex_parser.SubPattern]:
    """The parsed sub-patterns inside the argument of one parsed-pattern item."""
    if isinstance(argument, regex_parser.SubPattern):
        yield argument
    elif isinstance(argument, tuple | list):
        for part in argument:
            yield from _subpatterns(part)


def _choice_in_repeat(items: regex_parser.SubPattern, in_repeat: bool = False) -> str | None:
    """What the first choice (a repeat of varying count, or an alternation) inside a repeat of
    more than one count in parsed pattern ``items`` is, else None. Such a pattern can match one
    text in exponentially many ways, which a backtracking matcher tries one after another:
    ``(a+)+b``, ``(a|a)*b``, ``(a?){30}a{30}``."""
    for operator, argument in items:
        if operator in _REPEATS:
            low, high, body = argument
            if in_repeat and low != high:
                return "a repeat (*, +, ? or {m,n})"
            found = _choice_in_repeat(body, in_repeat or high > 1)
        elif in_repeat and operator == regex_parser.BRANCH:
            return "an alternation (|)"
        else:
            parts = _subpatterns(argument)
            found = next(filter(None, (_choice_in_repeat(p, in_repeat) for p in parts)), None)
        if found:
            return found
    return None


def _varying_repeats(items: regex_parser.SubPattern) -> int:
    """The most repeats of varying count (``*``, ``+``, ``?``, ``{m,n}`` with m < n), nested
    ones included, on one path through parsed pattern ``items``: an alternation (``|``) counts
    its largest alternative, since a match tries them one after another."""
    count = 0
    for operator, argument in items:
        if operator in _REPEATS:
            low, high, body = argument
            count += (low != high) + _varying_repeats(body)
        elif operator == regex_parser.BRANCH:
            count += max(_varying_repeats(branch) for branch in argument[1])
        else:
            count += sum(_varying_repeats(part) for part in _subpatterns(argument))
    return count


#: The most repeats of varying count one key may hold on one path through it (the largest
#: alternative of an alternation counts: ``.*q_proj|.*k_proj`` holds one). A match that fails
#: tries every way to share the module name among them and PEFT's ``(.*\.)?``: measured on this
#: project's CPU, a key of ``.*`` eight times took 0.4 s on a 31-character name, ten times 7 s;
#: three times, 0.025 s on a 150-character name (real models' are shorter), 0.24 s on 300 (four
#: times: 0.6 s on 150).
#: Three allow keys such as ``.*\.layers\.\d+\..*proj``.
MAX_KEY_REPEATS = 3

#: The longest module name a pattern key is matched against: a failed match of a key of
#: :data:`MAX_KEY_REPEATS` repeats grows with about the fourth power of the name's length
#: (measured: ``.*.*.*z`` 0.025 s on 150 characters, 0.33 s on 300, 4.5 s on 600); real
#: models' names are under 150 (``base_model.model.model.vision_tower...self_attn.out_proj``).
MAX_MODULE_CHARS = 300

#: The repeats of PEFT's own ``(.*\.)?`` around each key.
_PEFT_REPEATS = 2


def _peft_regex(key: str) -> re.Pattern[str]:
    r"""``(.*\.)?({key})$`` compiled; ValueError saying why for one that is no
    regular expression, that nests a choice inside a repeat (:func:`_choice_in_repeat`) or that
    holds more than :data:`MAX_KEY_REPEATS` repeats of varying count on one path
    (:func:`_varying_repeats`)."""
    pattern = rf"(.*\.)?({key})$"
    try:
        parsed = regex_parser.parse(pattern)
        choice = _choice_in_repeat(parsed)
        repeats = _varying_repeats(parsed) - _PEFT_REPEATS
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as error:
        reason = getattr(error, "msg", error)
        raise ValueError(f"is not a regular expression as PEFT reads it ({reason})") from None
    if choice is not None:
        raise ValueError(
            f"nests {choice} inside a repeat: it can backtrack exponentially (hours on one "
            "module name); refused"
        )
    if repeats > MAX_KEY_REPEATS:
        raise ValueError(
            f"holds {repeats} repeats (*, +, ? or {{m,n}}) in a row, more than the "
            f"{MAX_KEY_REPEATS} allowed: a match that fails tries every way to share the module "
            "name among them, a time that grows steeply with each one (seconds for ten on a "
            "short name); refused"
        )
    return compiled


class ModulePattern:
    r"""A ``rank_pattern`` / ``alpha_pattern`` as PEFT applies it: module ``M`` takes the value
    of the first key ``k`` (in the file's order) with ``re.match(rf"(.*\.)?({k})$", M)``, the
    key a regular expression for the module's whole name or a dotted suffix of it.

    Every key is checked and compiled once, here: one longer than :data:`MAX_PATTERN_CHARS`,
    that is no regular expression, that nests a choice inside a repeat (``(a+)+b``, ``(a|a)*b``:
    exponential backtracking) or holds more than :data:`MAX_KEY_REPEATS` repeats, and a pattern
    of more than :data:`MAX_PATTERN_KEYS` keys raise :class:`CheckpointError` naming ``file``,
    ``option`` and the key."""

    def __init__(self, file: Path, option: str, pattern: dict[str, object]):
        self.file, self.option = file, option
        if len(pattern) > MAX_PATTERN_KEYS:
            raise CheckpointError(
                f"{shown(file)}: {option} has {len(pattern)} keys, more than {MAX_PATTERN_KEYS} "
                "(each key is matched against every module name)"
            )
        self._keys = [(key, self._compiled(key), value) for key, value in pattern.items()]

    def _where(self, key: str) -> str:
        return f"{shown(self.file)}: {self.option} key {json.dumps(key)[:60]}"

    def _compiled(self, key: str) -> re.Pattern[str]:
        if len(key) > MAX_PATTERN_CHARS:
            raise CheckpointError(
                f"{self._where(key)} has {len(key)} characters, more than {MAX_PATTERN_CHARS} "
                "(each key is a regular expression for module names)"
            )
        try:
            return _peft_regex(key)
        except ValueError as error:
            raise CheckpointError(f"{self._where(key)} {error}") from None

    def value(self, module: str, default: object) -> object:
        """The value of the first key that applies to ``module``, else ``default``; a module
        name longer than :data:`MAX_MODULE_CHARS` raises :class:`CheckpointError`."""
        if self._keys and len(module) > MAX_MODULE_CHARS:
            raise CheckpointError(
                f"{self._where(self._keys[0][0])} cannot be matched against module "
                f"{json.dumps(module[:60])}..., whose name has {len(module)} characters, more "
                f"than {MAX_MODULE_CHARS}: a pattern's match time grows steeply with the name "
                "(real module names are dotted paths under 150 characters); refused"
            )
        for _, regex, value in self._keys:
            if regex.match(module) is not None:
                return value
        return default


def _check_settings(file: Path, config: dict) -> dict[str, ModulePattern]:
    """Rank and alpha settings are what PEFT writes: ``r`` and every ``rank_pattern`` value a
    positive int, ``lora_alpha`` and every ``alpha_pattern`` value a positive finite number,
    the patterns objects keyed by module names (returned compiled), ``use_rslora`` a bool."""
    ranks = {"r": config.get("r")}
    alphas = {"lora_alpha": config.get("lora_alpha", 8)}
    patterns = {}
    for option, into in (("rank_pattern", ranks), ("alpha_pattern", alphas)):
        pattern = config.get(option) or {}
        if not isinstance(pattern, dict):
            raise CheckpointError(f"{shown(file)}: {option!r} must be an object of module names")
        patterns[option] = ModulePattern(file, option, pattern)  # bad keys refused before use
        into.update({f"{option}[{key!r}]": value for key, value in pattern.items()})
    for where, rank in ranks.items():
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 < rank < 2**31:
            raise CheckpointError(
                f"{shown(file)}: {where} must be a positive integer below 2**31, not "
                f"{json.dumps(rank)[:40]}"
            )
    for where, alpha in alphas.items():
        if not _is_number(alpha) or alpha <= 0:
            raise CheckpointError(
                f"{shown(file)}: {where} must be a positive finite number, not "
                f"{json.dumps(alpha)[:40]}"
            )
    if not isinstance(config.get("use_rslora", False), bool):
        raise CheckpointError(f"{shown(file)}: 'use_rslora' must be true or false")
    return patterns


def read_adapter_config(folder: Path) -> tuple[dict, dict[str, ModulePattern]]:
    """``adapter_config.json`` of ``folder``, its unsupported options and bad settings refused,
    and its ``rank_pattern`` and ``alpha_pattern`` compiled."""
    file = inside(folder, ADAPTER_CONFIG, ADAPTER_CONFIG)  # no symlink out of the folder
    config = read_json(file, "adapter config")  # a regular file, strict JSON, bounded
    if not isinstance(config, dict):
        raise CheckpointError(f"{shown(file)}: must hold a JSON object")
    refusals = [
        ("peft_type", config.get("peft_type", "LORA") != "LORA", "only LORA adapters are read"),
        ("use_dora", bool(config.get("use_dora")), "DoRA's magnitude vector is not a delta"),
        ("bias", config.get("bias", "none") != "none", "trained biases are not supported"),
        ("modules_to_save", bool(config.get("modules_to_save")), "saved modules unsupported"),
        ("fan_in_fan_out", bool(config.get("fan_in_fan_out")), "Conv1D layouts unsupported"),
        ("layers_to_transform", config.get("layers_to_transform") is not None, "unsupported"),
        (
            "alora_invocation_tokens",
            bool(config.get("alora_invocation_tokens")),
            "aLoRA's delta applies only after its invocation tokens: not a weight delta",
        ),
        (
            "layer_replication",
            bool(config.get("layer_replication")),
            "it adds copies of base layers that the merged model would not have",
        ),
    ]
    for option, refused, reason in refusals:
        if refused:
            shown_value = json.dumps(config.get(option))
            raise CheckpointError(f"{file}: {option!r} is {shown_value}: {reason}")
    return config, _check_settings(file, config)


def _at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """``dtype``, or float32 if it is narrower (torch has no arithmetic on 8-bit floats)."""
    return dtype if dtype.itemsize >= 4 else torch.float32


class LoraAdapter:
    """The deltas one PEFT LoRA adapter makes to the base tensors, read lazily.

    ``targets()`` lists the base tensor names it adapts; ``factors(name)`` returns
    ``(scaling * B, A)`` so that ``delta = scaling * B @ A``.
    """

    def __init__(self, folder: str | Path):
        self.path = Path(folder)
        config, self._patterns = read_adapter_config(self.path)
        weights = self.path / ADAPTER_WEIGHTS
        if not weights.is_file():
            found = sorted(p.name for p in self.path.glob("adapter_model.*"))
            hint = f" (found {found[0]}: convert it to safetensors)" if found else ""
            raise CheckpointError(f"{self.path}: no {ADAPTER_WEIGHTS}{hint}")
        weights = inside(self.path, ADAPTER_WEIGHTS, ADAPTER_WEIGHTS)
        self.config = config
        self._reader = CheckpointReader(self.path, weights, read_header(weights))
        self._modules = self._pair_factors(weights)
        if not self._modules:
            raise CheckpointError(f"{shown(weights)}: holds no LoRA factors (nothing to merge)")
        self._ranks: dict[str, int] = {}  # module -> the rank its config gives
        self._scalings = {
            name: self._scaling(config, module) for name, module in self._module_names.items()
        }
        self._check_ranks(weights)

    def _pair_factors(self, weights: Path) -> dict[str, tuple[str, str]]:
        """base tensor name -> (key of A, key of B), every key accounted for, each a
        floating-point matrix and the only one of its module and factor."""
        pairs: dict[str, dict[str, str]] = {}
        self._module_names: dict[str, str] = {}
        for key in self._reader.names():
            stem = key.removeprefix(KEY_PREFIX)
            for factor in ("lora_A", "lora_B"):
                marker = f".{factor}."
                if marker in stem and stem.endswith(".weight"):
                    shape, dtype = self._reader.shape(key), self._reader.dtype(key)
                    if len(shape) != 2 or 0 in shape or not dtype.is_floating_point:
                        raise CheckpointError(
                            f"{shown(weights)}: tensor {key!r} is {dtype} of shape "
                            f"{list(shape)}; a LoRA factor must be a non-empty floating-point "
                            "matrix"
                        )
                    module = stem.split(marker)[0]
                    found = pairs.setdefault(f"{module}.weight", {})
                    if factor in found:
                        raise CheckpointError(
                            f"{shown(weights)}: tensors {found[factor]!r} and {key!r} are both "
                            f"the {factor} of {module!r} (one module under two names)"
                        )
                    found[factor] = key
                    self._module_names[f"{module}.weight"] = module
                    break
            else:
                what = "embedding LoRA" if "lora_embedding" in key else "not a lora_A/lora_B weight"
                raise CheckpointError(f"{weights}: tensor {key!r}: {what} (unsupported)")
        for name, found in pairs.items():
            missing = {"lora_A", "lora_B"} - set(found)
            if missing:
                raise CheckpointError(f"{weights}: {name!r} has no {missing.pop()} factor")
        return {name: (found["lora_A"], found["lora_B"]) for name, found in pairs.items()}

    def _scaling(self, config: dict, module: str) -> float:
        """``alpha / r`` (or ``alpha / sqrt(r)``), ``r`` and ``alpha`` from the first
        rank_pattern / alpha_pattern key that applies to ``module`` (:class:`ModulePattern`)."""
        rank = self._patterns["rank_pattern"].value(module, config["r"])
        alpha = self._patterns["alpha_pattern"].value(module, config.get("lora_alpha", 8))
        self._ranks[module] = rank
        return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    def targets(self) -> list[str]:
        return list(self._modules)

    def __contains__(self, name: object) -> bool:
        return name in self._modules

    def factor_shapes(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        key_a, key_b = self._modules[name]
        return self._reader.shape(key_b), self._reader.shape(key_a)

    def delta_shape(self, name: str) -> tuple[int, int]:
        """``(B rows, A columns)``: the shape of the delta of base tensor ``name``."""
        (rows, _), (_, cols) = self.factor_shapes(name)
        return rows, cols

    def _check_ranks(self, weights: Path) -> None:
        """B (out x r) and A (r x in) of every module share the rank its config gives."""
        for name, module in self._module_names.items():
            (rows, rank_b), (rank_a, cols) = self.factor_shapes(name)
            if rank_a != rank_b:
                raise CheckpointError(
                    f"{shown(weights)}: {name!r}: B {[rows, rank_b]} @ A {[rank_a, cols]}: "
                    "the factors' ranks differ"
                )
            if rank_a != self._ranks[module]:
                raise CheckpointError(
                    f"{self.path}: {name!r}: factors of rank {rank_a}, but {ADAPTER_CONFIG} "
                    f"gives rank {self._ranks[module]} (its scaling would be wrong)"
                )

    def check_against(self, base: CheckpointReader) -> None:
        """Every adapted tensor is a floating tensor of the base with shape
        ``(B rows, A columns)``."""
        for name in self._modules:
            if name not in base:
                raise CheckpointError(
                    f"{self.path}: adapts {name!r}, which is not a tensor of the base ({base.path})"
                )
            if not base.dtype(name).is_floating_point:
                raise CheckpointError(
                    f"{shown(base.file_of(name))}: tensor {name!r} is {base.dtype(name)}, but "
                    f"{shown(self.path)} adapts it: a LoRA delta applies only to a "
                    "floating-point tensor"
                )
            if tuple(base.shape(name)) != self.delta_shape(name):
                (rows, rank), (_, cols) = self.factor_shapes(name)
                raise CheckpointError(
                    f"{self.path}: {name!r}: B {[rows, rank]} @ A {[rank, cols]} does not "
                    f"give the base's shape {list(base.shape(name))}"
                )

    def _read(self, key: str, dtype: torch.dtype, scaling: float = 1.0) -> torch.Tensor:
        """Factor ``key`` times ``scaling`` (computed in ``dtype``, at least float32), in
        ``dtype``; refused unless finite, whatever dtype it is stored in (8-bit floats too)."""
        where = f"{shown(self._reader.weights_file)}: tensor {key!r}"
        factor = self._reader.get(key)
        if not all_finite(factor):
            raise CheckpointError(f"{where} contains {'NaN' if factor.isnan().any() else 'Inf'}")
        factor = factor.to(_at_least_float32(dtype)).mul_(scaling).to(dtype)
        if not all_finite(factor):
            raise CheckpointError(f"{where} times its scaling {scaling:g} overflows {dtype}")
        return factor

    def factors(self, name: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scaling * B, A)`` of base tensor ``name`` in ``dtype``, both finite."""
        key_a, key_b = self._modules[name]
        return self._read(key_b, dtype, self._scalings[name]), self._read(key_a, dtype)

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> LoraAdapter:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def write_lora_adapter(
    out: str | Path,
    tensors: dict[str, torch.Tensor],
    config: dict,
    force: bool = False,
    inputs: Sequence[str | Path | None] = (),
) -> Path:
    """Write a PEFT adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``)
    atomically, with the output rules of every mloco output (see
    :func:`mergekit_loco.io.atomic.check_output`). An OSError while writing (read-only folder,
    full disk) raises :class:`CheckpointError` ``cannot write OUT: reason``, naming ``out``."""
    out = Path(out)
    check_output(out, force, inputs, kind="LoRA adapter")
    try:
        with staged_output(out, "lora adapter", replace=force) as staging:
            save_file(tensors, staging / ADAPTER_WEIGHTS, metadata={"format": "pt"})
            (staging / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    except OSError as error:
        reason = error.strerror or str(error)
        raise CheckpointError(f"cannot write {shown(out)}: {reason}") from error
    return out
