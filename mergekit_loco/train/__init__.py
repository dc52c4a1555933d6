"""DiLoCo training where every merge method is the aggregator."""

from mergekit_loco.train.diloco import DiLoCo
from mergekit_loco.train.outer import OuterOptimizer

__all__ = ["DiLoCo", "OuterOptimizer"]
