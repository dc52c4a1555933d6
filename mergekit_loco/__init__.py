"""mergekit_loco: model merging and DiLoCo aggregation on one task-vector abstraction.

The public names are imported on first use (PEP 562), so ``import mergekit_loco.cli`` does not
load torch: ``mloco --help`` starts in a fraction of a second.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mergekit_loco.lazy import lazy_exports

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


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
