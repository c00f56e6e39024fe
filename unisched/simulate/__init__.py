"""The discrete-event simulator: strategy in, Timeline out."""

from unisched.costs import DEFAULT_COSTS, Costs, Link, TiedWeight
from unisched.simulate.priorities import BackwardFirst, OldestBatchFirst, OldestStageFirst, priority_by_name
from unisched.simulate.simulation import Simulation, shape_lower_bound, simulate

__all__ = [
    "BackwardFirst",
    "Costs",
    "DEFAULT_COSTS",
    "Link",
    "OldestBatchFirst",
    "OldestStageFirst",
    "Simulation",
    "TiedWeight",
    "priority_by_name",
    "shape_lower_bound",
    "simulate",
]
