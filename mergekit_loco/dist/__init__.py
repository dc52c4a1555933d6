"""Merging across torch.distributed ranks: transport (codecs, guarded collectives, owners,
byte accounting) and the generic plans; the methods bring their own math and plans."""

from mergekit_loco.dist.checks import verify_identical
from mergekit_loco.dist.codec import COMPRESSIONS, Codec
from mergekit_loco.dist.merge import (
    available_plans,
    cheapest_plan,
    gather_then_merge,
    merge_across_ranks,
    modelled_comm_stats,
    plan_bytes,
)
from mergekit_loco.dist.transport import (
    CollectiveFailed,
    CommStats,
    Transport,
    assign_owners,
    guarded,
)

__all__ = [
    "COMPRESSIONS",
    "Codec",
    "CollectiveFailed",
    "CommStats",
    "Transport",
    "assign_owners",
    "available_plans",
    "cheapest_plan",
    "gather_then_merge",
    "guarded",
    "merge_across_ranks",
    "modelled_comm_stats",
    "plan_bytes",
    "verify_identical",
]
