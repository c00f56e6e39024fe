"""The planner: which schedule should I run, and how good is it?

``plan(W, S, B, costs, memory_limit=..., max_stages_per_worker=...)``
searches the registered strategies with the simulator, improves the best
with OR-Tools CP-SAT (first the order of work for a fixed mapping, then the
mapping itself) and returns a :class:`Plan` that the simulator replays
exactly; ``load_plan`` reads one back from its JSON file.
"""

from unisched.plan.bounds import mapping_bounds, shape_bounds
from unisched.plan.planfile import FORMAT, VERSION, Plan, PlanFileError, load_plan
from unisched.plan.planner import plan
from unisched.plan.problem import PlanInputError, PlanProblem, encode_costs

__all__ = [
    "FORMAT",
    "Plan",
    "PlanFileError",
    "PlanInputError",
    "PlanProblem",
    "VERSION",
    "encode_costs",
    "load_plan",
    "mapping_bounds",
    "plan",
    "shape_bounds",
]
