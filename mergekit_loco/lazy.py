"""Packages whose public names are imported on first use (PEP 562), so that importing the
package (as ``mloco --help`` does) loads neither torch nor transformers."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, homes: Mapping[str, str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``, whose public name ``n`` lives in the module
    ``homes[n]``: the first access imports that module and caches the name in the package."""

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(getattr(sys.modules[package], "__all__", homes))

    return __getattr__, __dir__
