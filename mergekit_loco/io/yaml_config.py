"""YAML config files from strangers (``mloco merge --config``, ``mloco train --config``).

A file is read as hostile by :func:`load_yaml`: nesting at most ``MAX_CONFIG_DEPTH`` deep, at
most ``MAX_CONFIG_NODES`` values once YAML aliases are expanded (so an alias bomb is refused,
not expanded), string keys only, no key given twice, and YAML 1.2's floats (``1e-3``) read as
numbers; an integer that YAML 1.1 and 1.2 read differently (``010``) is refused.
:func:`check_size` bounds a tree read from any format; messages show values from a
file through :func:`bounded`, which never expands them.
"""

from __future__ import annotations

import re
import reprlib
from pathlib import Path

import yaml

from mergekit_loco.io.files import brief, shown

#: Bound on a config file's bytes.
MAX_CONFIG_BYTES = 2**20
#: bounds on the tree a config is: values (an aliased one counted each time it is used), depth
MAX_CONFIG_NODES = 100_000
MAX_CONFIG_DEPTH = 32
#: YAML 1.2's floats with an exponent (``1e-3``, ``1E5``, ``.5e1``), strings to YAML 1.1
YAML12_FLOAT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")
#: YAML 1.2's integers (decimal, hexadecimal), which YAML 1.1 reads alike; 1.1's others
#: (``010`` octal, ``1:30`` base 60, ``1_000``, ``0b11``) mean something else in 1.2
YAML12_INT = re.compile(r"^[-+]?(?:0|[1-9][0-9]*|0x[0-9a-fA-F]+)$")
INT_TAG = "tag:yaml.org,2002:int"
STR_TAG = "tag:yaml.org,2002:str"
MERGE_TAG = "tag:yaml.org,2002:merge"
#: how messages show a value from the file: one level deep, a few items, short strings
SHOWN = reprlib.Repr()
SHOWN.maxlevel, SHOWN.maxlist, SHOWN.maxtuple, SHOWN.maxdict = 1, 3, 3, 3
SHOWN.maxstring = SHOWN.maxother = 24


class ConfigFileError(ValueError):
    """A config file that cannot be used; the message names the file (and the line)."""


def bounded(value: object) -> str:
    """``value`` for a one-line message in a few dozen characters: an abridged repr (a big list,
    mapping or string is cut, never expanded; a big integer is described by its size)."""
    return brief(value) if isinstance(value, int) else SHOWN.repr(value)


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader for a file from a stranger: nesting at most ``MAX_CONFIG_DEPTH``
    deep, every mapping key a string given once, merge keys (``<<``) bounded, YAML 1.2 floats."""

    def __init__(self, text: str | bytes, path: Path) -> None:
        super().__init__(text)
        self.path = shown(path)
        self.depth = 0
        self.merged = 0  # mapping entries flattened, merged ones counted each time
        self.checked: set[yaml.MappingNode] = set()

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        """The next node, refused deeper than ``MAX_CONFIG_DEPTH`` (before Python's recursion
        limit is reached)."""
        self.depth += 1
        if self.depth > MAX_CONFIG_DEPTH:
            line = self.peek_event().start_mark.line + 1
            raise ConfigFileError(
                f"{self.path}: line {line}: nested more than {MAX_CONFIG_DEPTH} levels deep"
            )
        node = super().compose_node(parent, index)
        self.depth -= 1
        return node

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """``node``'s entries with merge keys applied, once its own keys are checked (strings,
        none twice; a merged-in key may be overridden, as YAML has it); at most
        ``MAX_CONFIG_NODES`` entries in all, so merging one alias many times cannot hang."""
        if node not in self.checked:
            self.checked.add(node)
            seen = set()
            for key, _ in node.value:
                if key.tag == MERGE_TAG:
                    continue
                line = key.start_mark.line + 1
                if not isinstance(key, yaml.ScalarNode) or key.tag != STR_TAG:
                    shown_key = bounded(self.construct_object(key, deep=True))
                    raise ConfigFileError(
                        f"{self.path}: line {line}: key {shown_key} is not a string "
                        "(every mapping key must be)"
                    )
                if key.value in seen:
                    raise ConfigFileError(
                        f"{self.path}: line {line}: key {bounded(key.value)} appears twice"
                    )
                seen.add(key.value)
        super().flatten_mapping(node)
        self.merged += len(node.value)
        if self.merged > MAX_CONFIG_NODES:
            raise ConfigFileError(too_big(self.path))

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """An integer as YAML 1.1 and 1.2 both read it; one they read differently (``010``: 8
        in 1.1, 10 in 1.2; ``1:30``: 90 in 1.1, a string in 1.2) is refused, naming the line."""
        value = super().construct_yaml_int(node)
        if YAML12_INT.match(node.value):
            return value
        decimal = int(node.value) if re.fullmatch(r"[-+]?[0-9]+", node.value) else None
        if decimal != value:
            new = "a string" if decimal is None else bounded(decimal)
            raise ConfigFileError(
                f"{self.path}: line {node.start_mark.line + 1}: {bounded(node.value)} is "
                f"{bounded(value)} in YAML 1.1 and {new} in YAML 1.2; write the number in decimal"
            )
        return value


ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", YAML12_FLOAT, list("-+.0123456789"))
ConfigLoader.add_constructor(INT_TAG, ConfigLoader.construct_yaml_int)


def parse_error_text(error: BaseException) -> str:
    """What a config parser's ``error`` says, on one line and at most 200 characters, without
    the snippet of the file that PyYAML's errors quote: its problem and where it lies."""
    text = str(error)
    if isinstance(error, yaml.MarkedYAMLError) and error.problem:
        mark = error.problem_mark
        text = error.problem + (
            f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        )
    return shown(" ".join(text.split()))[:200]


def too_big(path: Path | str) -> str:
    """The message for a document over ``MAX_CONFIG_NODES`` values."""
    return f"{path}: more than {MAX_CONFIG_NODES} values once YAML aliases are expanded; refused"


def check_size(path: Path, config: object) -> None:
    """Refuse a document whose tree (an aliased value counted each time it is reached) has
    more than ``MAX_CONFIG_NODES`` values or is nested more than ``MAX_CONFIG_DEPTH`` deep (as
    a cyclic alias is); stops at the first bound passed, so a bomb costs no more than that."""
    count, stack = 1, [(config, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigFileError(f"{shown(path)}: nested more than {MAX_CONFIG_DEPTH} levels deep")
        if isinstance(value, dict | list | tuple):
            children = value.values() if isinstance(value, dict) else value
            count += len(children)
            if count > MAX_CONFIG_NODES:
                raise ConfigFileError(too_big(shown(path)))
            stack.extend((child, depth + 1) for child in children)


def load_yaml(raw: bytes, path: Path) -> object:
    """The document in ``raw`` (the bytes of the file ``path``) read by :class:`ConfigLoader`
    and bounded by :func:`check_size`: each of those faults is a :class:`ConfigFileError`
    naming the file. Text that is not YAML raises ``yaml.YAMLError`` (or ``ValueError``, for
    an integer over 4300 digits), which the caller words."""
    loader = ConfigLoader(raw, path)
    try:
        config = loader.get_single_data()
    finally:
        loader.dispose()
    check_size(path, config)
    return config
