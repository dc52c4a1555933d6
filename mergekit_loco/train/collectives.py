"""Training code's door to :mod:`mergekit_loco.dist` (the transport and the generic plans live
there; each method's own plan lives in its method file)."""

from mergekit_loco.dist import (
    CommStats,
    gather_then_merge,
    guarded,
    merge_across_ranks,
    modelled_comm_stats,
    verify_identical,
)

__all__ = [
    "CommStats",
    "gather_then_merge",
    "guarded",
    "merge_across_ranks",
    "modelled_comm_stats",
    "verify_identical",
]
