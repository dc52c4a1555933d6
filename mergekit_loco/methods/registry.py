"""Method registry: adding a method is one new module and one line here."""

from __future__ import annotations

import difflib
import json
import math
import numbers
import types
import typing
from collections.abc import Mapping, Sequence

from mergekit_loco.io.files import brief
from mergekit_loco.methods.base import MergeMethod
from mergekit_loco.methods.breadcrumbs import Breadcrumbs
from mergekit_loco.methods.dare import Dare
from mergekit_loco.methods.iso import IsoC
from mergekit_loco.methods.iso_cts import IsoCts
from mergekit_loco.methods.mean import Mean
from mergekit_loco.methods.ta import TaskArithmetic
from mergekit_loco.methods.ties import Ties
from mergekit_loco.methods.tsv import Tsv
from mergekit_loco.option_text import option_pairs

METHODS: dict[str, type[MergeMethod]] = {
    cls.name: cls for cls in (Mean, TaskArithmetic, Ties, Dare, Breadcrumbs, Tsv, IsoC, IsoCts)
}


def list_methods() -> list[str]:
    return list(METHODS)


def mergekit_equivalent(name: str) -> str | None:
    """The method mergekit's ``name`` translates to (``task_arithmetic`` -> ``ta``, ``linear``
    -> ``mean``), as a ``--config`` YAML reads it; None for a name mergekit does not share."""
    from mergekit_loco.merge_config import SHARED_METHODS  # it imports this module

    shared = SHARED_METHODS.get(name)
    return shared[0] if shared else None


def closest_name(name: str, names: Sequence[str]) -> str | None:
    """The one of ``names`` that ``name`` most likely misspells (case, ``_`` for ``-``, a
    dropped or swapped letter: ``ISO_C``, ``isoc`` -> ``iso-c``), or None."""
    spelled = str(name).lower().replace("_", "-")
    matches = difflib.get_close_matches(spelled, list(names), n=1, cutoff=0.75)
    return matches[0] if matches else None


def check_keyword_typos(options: Mapping[str, object], keywords: Sequence[str], call: str) -> None:
    """TypeError for a keyword in ``options`` (what ``call`` passes on to the merge method)
    that no method takes and that misspells one of ``call``'s own ``keywords``
    (``merge_checkpoints(..., forse=True)``), which the method would otherwise be blamed for."""
    taken = {option for cls in METHODS.values() for option in cls.parameter_names()}
    for key in options:
        close = None if key in taken else closest_name(key, keywords)
        if close is not None:
            raise TypeError(f"{call}() got an unexpected keyword {key!r} (did you mean {close}?)")


def unknown_method(name: str) -> ValueError:
    """The error for a method name that is not registered, with mloco's name for mergekit's,
    or the registered name it misspells."""
    message = f"unknown merge method {name!r}; choose one of {', '.join(METHODS)}"
    ours = mergekit_equivalent(name)
    if ours is not None:
        message += (
            f" (mergekit's {name} is {ours} here; a mergekit YAML given to mloco merge --config "
            "keeps mergekit's names)"
        )
    elif (close := closest_name(name, list(METHODS))) is not None:
        message += f" (did you mean {close}?)"
    return ValueError(message)


def parse_options(name: str, pairs: Sequence[str]) -> dict[str, object]:
    """``["density=0.3", "seed=2"]`` -> ``{"density": 0.3, "seed": 2}`` for method ``name``: each
    value parsed to the type of the method's field (bool: true/false, 1/0, yes/no).

    Raises ``ValueError`` naming the ``--option`` at fault: no ``=``, a key the method does not
    take, a value that does not parse, a key given twice.
    """
    if name not in METHODS:
        raise unknown_method(name)
    types = typing.get_type_hints(METHODS[name])
    accepted = METHODS[name].parameter_names()
    options: dict[str, object] = {}
    for pair, key, text in option_pairs(pairs):
        if key not in accepted:
            takes = ", ".join(accepted) if accepted else "no parameters"
            raise ValueError(f"--option {pair!r}: method {name!r} does not take {key!r} ({takes})")
        options[key] = _parse_value(pair, text, types[key])
    return options


def typed_options(name: str, options: Mapping[str, object]) -> dict[str, object]:
    """Options read from a command line or a config file as method ``name``'s field types: a
    string given to a field that is not a string parses as an ``--option`` value does
    (``"0.5,0.7"`` -> ``(0.5, 0.7)``, ``"true"`` -> True, ``"none"`` -> None) or, failing that,
    as JSON (``"[0.5, 0.7]"``, ``"null"``: what ``train --option`` took before); a list (JSON,
    TOML, YAML) becomes a tuple. Keys the method does not take, and unknown methods, are left
    for :func:`get_method` to refuse."""
    if name not in METHODS:
        return dict(options)
    kinds = typing.get_type_hints(METHODS[name])
    accepted = METHODS[name].parameter_names()
    typed: dict[str, object] = {}
    for key, value in options.items():
        if key in accepted and isinstance(value, str) and not _is_a(value, kinds[key]):
            value = _parse_text(key, value, kinds[key])
        if isinstance(value, list):
            value = tuple(value)
        typed[key] = value
    return typed


def _parse_text(key: str, text: str, kind) -> object:
    """``text`` as ``--option`` parses it, else as JSON, else the first way's error."""
    try:
        return _parse_value(f"{key}={text}", text.strip(), kind)
    except ValueError:
        try:
            return json.loads(text)
        except ValueError:
            pass
        raise


def _parse_value(pair: str, text: str, kind) -> object:
    """``text`` as a ``kind``: bool, int, float, str, ``X | None`` ("none" is None) or a tuple
    of one of them (comma-separated)."""
    arguments = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(arguments) == 1:
        return None if text.lower() == "none" else _parse_value(pair, text, arguments[0])
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(arguments) == 2:
        # X | tuple[X, ...]: one value for all tasks, or comma-separated values per task
        one, each = arguments
        if typing.get_origin(each) is tuple:
            return _parse_value(pair, text, each if "," in text else one)
    if typing.get_origin(kind) is tuple and arguments:
        return tuple(_parse_value(pair, item.strip(), arguments[0]) for item in text.split(","))
    if kind is bool:
        if text.lower() not in _BOOLEANS:
            raise ValueError(f"--option {pair!r}: {text!r} is not true or false")
        return _BOOLEANS[text.lower()]
    if kind not in _KINDS:
        raise ValueError(f"--option {pair!r}: a {kind} cannot be given as KEY=VALUE")
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"--option {pair!r}: {text!r} is not {_KINDS[kind]}") from None


_KINDS = {int: "an integer", float: "a finite number", str: "a string"}
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def get_method(name: str, **params) -> MergeMethod:
    """``get_method("ties", density=0.3)``: the method named ``name`` with its parameters.

    ``name`` is a str (else ``TypeError``). Unknown names and parameters the method does not
    take raise ``ValueError`` saying what is accepted; out-of-range values raise ``ValueError``
    from the method itself. A number field takes any real number (``numbers.Real``, not a bool:
    numpy's too), held as a Python float or int.
    """
    if not isinstance(name, str):
        raise TypeError(
            f"get_method: the method name must be a str, one of {', '.join(METHODS)}; not a "
            f"{type(name).__name__} ({brief(name)})"
        )
    if name not in METHODS:
        raise unknown_method(name)
    cls = METHODS[name]
    accepted = cls.parameter_names()
    unknown = [key for key in params if key not in accepted]
    if unknown:
        takes = ", ".join(accepted) if accepted else "no parameters"
        raise ValueError(f"method {name!r} does not take {unknown[0]!r} (it takes: {takes})")
    kinds = typing.get_type_hints(cls)
    for key, value in params.items():
        if not _is_a(value, kinds[key]):
            raise ValueError(
                f"method {name!r}: {key} must be {_describe(kinds[key])}, not {brief(value)}"
            )
    return cls(**{key: _as_python(value, kinds[key]) for key, value in params.items()})


def _is_a(value: object, kind) -> bool:
    """Whether ``value`` fits the field type ``kind`` (bool is not a number here; a float field
    takes an int)."""
    origin, arguments = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, argument) for argument in arguments)
    if origin is tuple:
        return isinstance(value, tuple) and all(_is_a(item, arguments[0]) for item in value)
    if kind is type(None):
        return value is None
    if kind is float:  # finite: no parameter takes NaN or an infinity
        return (
            isinstance(value, numbers.Real)
            and not isinstance(value, bool)
            and (isinstance(value, numbers.Integral) or math.isfinite(value))
        )
    if kind is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return isinstance(value, kind)


def _as_python(value: object, kind) -> object:
    """``value`` (one :func:`_is_a` ``kind`` accepts) with numbers of other types (numpy's)
    as Python floats and ints, item by item in a tuple."""
    origin, arguments = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return _as_python(value, next(a for a in arguments if _is_a(value, a)))
    if origin is tuple:
        return tuple(_as_python(item, arguments[0]) for item in value)
    if kind is float and type(value) not in (int, float):
        return float(value)
    if kind is int and type(value) is not int:
        return int(value)
    return value


def _describe(kind) -> str:
    origin, arguments = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(argument) for argument in arguments)
    if origin is tuple:
        return f"a tuple of {_describe(arguments[0]).removeprefix('a ').removeprefix('an ')}s"
    if kind is type(None):
        return "None"
    return {bool: "true or false", **_KINDS}.get(kind, kind.__name__)
