"""DiLoCo training where every merge method is the aggregator.

``DiLoCo`` and ``OuterOptimizer`` are imported on first use (PEP 562), so the light modules
(``train.config``) load without torch: ``mloco train --help`` needs only them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mergekit_loco.train.diloco import DiLoCo
    from mergekit_loco.train.outer import OuterOptimizer

#: public name -> the module that defines it
_HOMES = {"DiLoCo": "mergekit_loco.train.diloco", "OuterOptimizer": "mergekit_loco.train.outer"}
__all__ = ["DiLoCo", "OuterOptimizer"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'mergekit_loco.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
