"""DiLoCo training where every merge method is the aggregator.

``DiLoCo`` and ``OuterOptimizer`` are imported on first use (PEP 562), so the light modules
(``train.config``) load without torch: ``mloco train --help`` needs only them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergekit_loco.lazy import lazy_exports

if TYPE_CHECKING:
    from mergekit_loco.train.diloco import DiLoCo
    from mergekit_loco.train.outer import OuterOptimizer

#: public name -> the module that defines it
_HOMES = {"DiLoCo": "mergekit_loco.train.diloco", "OuterOptimizer": "mergekit_loco.train.outer"}
__all__ = ["DiLoCo", "OuterOptimizer"]


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
