"""The merge methods' names, parameters and math, read from their source without importing it.

``mloco methods`` and the help of ``merge``/``train`` list the methods; importing them would
load torch (about a second), so this module reads what it needs from the syntax tree of
``methods/registry.py`` (the names, in registry order) and of each method's module (the
dataclass fields with their defaults, ``needs_base`` and the docstring). A test checks that it
agrees with the imported registry.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

METHODS_DIR = Path(__file__).resolve().parents[1] / "methods"
PACKAGE = "mergekit_loco.methods."


@dataclass(frozen=True)
class MethodInfo:
    """What ``mloco methods`` shows of one method."""

    name: str
    needs_base: bool
    parameters: dict[str, object]
    """parameter name -> default, in field order"""
    doc: str

    @property
    def math(self) -> str:
        """The docstring's first paragraph on one line, without RST quotes."""
        paragraph = self.doc.strip().split("\n\n")[0]
        return " ".join(paragraph.replace("``", "").split())

    @property
    def description(self) -> str:
        """The whole docstring, without RST quotes and roles (``:data:`NAME``` is NAME)."""
        return re.sub(r":\w+:`~?([^`]+)`", r"\1", self.doc.strip()).replace("``", "")


def parse(module: str) -> ast.Module:
    return ast.parse((METHODS_DIR / f"{module}.py").read_text(), filename=f"{module}.py")


def registered_classes() -> list[tuple[str, str]]:
    """``(module, class name)`` of every registered method, in registry order: the imports of
    ``registry.py`` name the modules, its one tuple of those classes the order."""
    registry = parse("registry")
    module_of = {
        alias.name: node.module.removeprefix(PACKAGE)
        for node in registry.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE)
        for alias in node.names
    }
    for node in ast.walk(registry):
        if isinstance(node, ast.Tuple) and node.elts:
            names = [getattr(element, "id", None) for element in node.elts]
            if all(name in module_of and name != "MergeMethod" for name in names):
                return [(module_of[name], name) for name in names]
    raise RuntimeError(f"{METHODS_DIR / 'registry.py'}: no tuple of method classes found")


def read_class(module: str, class_name: str) -> MethodInfo:
    """One method class: ``name = "..."``, ``needs_base = ...`` and annotated fields."""
    tree = parse(module)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    assigned, parameters = {}, {}
    for statement in node.body:
        if isinstance(statement, ast.Assign) and isinstance(statement.targets[0], ast.Name):
            assigned[statement.targets[0].id] = ast.literal_eval(statement.value)
        elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            if "ClassVar" not in ast.unparse(statement.annotation) and statement.value:
                parameters[statement.target.id] = ast.literal_eval(statement.value)
    return MethodInfo(
        name=assigned["name"],
        needs_base=assigned.get("needs_base", True),
        parameters=parameters,
        doc=ast.get_docstring(node) or "",
    )


@functools.cache
def method_catalog() -> tuple[MethodInfo, ...]:
    """Every registered merge method, in registry order."""
    return tuple(read_class(module, name) for module, name in registered_classes())


def method_names() -> list[str]:
    return [info.name for info in method_catalog()]
