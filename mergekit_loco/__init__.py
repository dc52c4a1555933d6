"""mergekit_loco: model merging and DiLoCo aggregation on one task-vector abstraction.

The public names are imported on first use (PEP 562), so ``import mergekit_loco.cli`` does not
load torch: ``mloco --help`` starts in a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mergekit_loco.merge import MergeSummary, MissingBaseError, merge_checkpoints
    from mergekit_loco.methods import MergeMethod, get_method, list_methods
    from mergekit_loco.task_vector import TaskVector
    from mergekit_loco.train.diloco import DiLoCo
    from mergekit_loco.train.outer import OuterOptimizer

#: public name -> the module that defines it
_HOMES = {
    "DiLoCo": "mergekit_loco.train.diloco",
    "MergeMethod": "mergekit_loco.methods",
    "MergeSummary": "mergekit_loco.merge",
    "MissingBaseError": "mergekit_loco.merge",
    "OuterOptimizer": "mergekit_loco.train.outer",
    "TaskVector": "mergekit_loco.task_vector",
    "get_method": "mergekit_loco.methods",
    "list_methods": "mergekit_loco.methods",
    "merge_checkpoints": "mergekit_loco.merge",
}
__all__ = [
    "DiLoCo",
    "MergeMethod",
    "MergeSummary",
    "MissingBaseError",
    "OuterOptimizer",
    "TaskVector",
    "get_method",
    "list_methods",
    "merge_checkpoints",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'mergekit_loco' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, "__version__"])
