"""unisched: every distributed training strategy as a pair of functions.

A strategy maps each work item ``Work(batch, stage, direction)`` to a compute
worker and a weight worker; unisched simulates it, draws it, plans it and runs
it for real.
"""

from unisched.errors import DeadlockError, ShapeError, SplitError, StrategyError, TimelineError, UniSchedError
from unisched.memory import memory_curves
from unisched.metrics import worker_stats
from unisched.simulate import (
    BackwardFirst,
    Costs,
    Link,
    OldestBatchFirst,
    OldestStageFirst,
    Simulation,
    TiedWeight,
    shape_lower_bound,
    simulate,
)
from unisched.strategy import Gang, Strategy, WorkerOrders, as_strategy, fixed_strategy
from unisched.timeline import Timeline, TransferRecord, Transfers, WorkRecord
from unisched.topology import ClusterCosts, Topology  # loaded with the package: Costs.from_dict reads a topology's costs
import unisched.render  # noqa: F401,E402  (fills in Timeline.to_text, to_html, figure, save, ...)
from unisched.work import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    ComputeAndWeightWorkers,
    Direction,
    Shape,
    StageGraph,
    Work,
)
from unisched.dataflow import all_work, dependencies

__version__ = "0.1.0"

__all__ = [
    "BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "BackwardFirst",
    "ClusterCosts",
    "ComputeAndWeightWorkers",
    "Costs",
    "DeadlockError",
    "Direction",
    "FORWARD",
    "Gang",
    "Link",
    "OldestBatchFirst",
    "OldestStageFirst",
    "Shape",
    "ShapeError",
    "Simulation",
    "StageGraph",
    "Strategy",
    "WorkerOrders",
    "SplitError",
    "StrategyError",
    "Timeline",
    "TiedWeight",
    "TimelineError",
    "Topology",
    "TransferRecord",
    "Transfers",
    "UniSchedError",
    "Work",
    "WorkRecord",
    "all_work",
    "as_strategy",
    "dependencies",
    "fixed_strategy",
    "memory_curves",
    "shape_lower_bound",
    "simulate",
    "worker_stats",
]

_LAZY = {
    # name -> module that defines it; imported on first use so that the
    # simulator works without torch or OR-Tools loaded.
    "Trainer": "unisched.execute",
    "calibrate_costs": "unisched.execute",
    "ExecutionError": "unisched.execute",
    "NonFiniteLossError": "unisched.execute",
    "train_one_process": "unisched.execute",
    "build_stages": "unisched.execute",
    "stages_from_state_dict": "unisched.execute",
    "split_model": "unisched.execute",
    "ModelStages": "unisched.execute",
    "Tie": "unisched.execute",
    "save_checkpoint": "unisched.execute",
    "load_checkpoint": "unisched.execute",
    "checkpoint_state_dict": "unisched.execute",
    "CheckpointError": "unisched.execute",
    "load_plan": "unisched.plan",
    "PlanFileError": "unisched.plan",
    "PlanInputError": "unisched.plan",
    "Plan": "unisched.plan",
    "policies": "unisched.policies",
    "StrategyShapeError": "unisched.policies",
    "StrategyParameterError": "unisched.policies",
    "UnknownStrategyError": "unisched.policies",
    "to_torch_csv": "unisched.policies",
    "from_torch_csv": "unisched.policies",
    "TorchCSVError": "unisched.policies",
    "epl": "unisched.epl",
    "simulate_layout": "unisched.simulate.layout",
    "ParallelLayout": "unisched.simulate.layout",
    "TransformerModel": "unisched.simulate.layout",
}
_RENAMED = {"ParallelLayout": "Layout", "TransformerModel": "Model"}  # clearer at the package's top level


def __dir__() -> list[str]:
    """Every public name, those imported on first use as well (for completion and ``dir``)."""
    return sorted(set(globals()) | set(_LAZY))


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        return module if module.__name__.endswith(name) else getattr(module, _RENAMED.get(name, name))
    raise AttributeError(f"module 'unisched' has no attribute {name!r}")
