"""mergekit_loco: model merging and DiLoCo aggregation on one task-vector abstraction."""

from mergekit_loco.merge import MergeSummary, MissingBaseError, merge_checkpoints
from mergekit_loco.methods import MergeMethod, get_method, list_methods
from mergekit_loco.task_vector import TaskVector
from mergekit_loco.train.diloco import DiLoCo
from mergekit_loco.train.outer import OuterOptimizer

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
