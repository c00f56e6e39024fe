"""EPL-style annotations for PyTorch, compiled to the unified scheme.

Mark where parts of a model are built with ``replicate`` (data parallelism)
or ``split`` (tensor parallelism); the placement follows from the device
count as in Alibaba's Easy Parallel Library, and compiles to a
:class:`unisched.Strategy` that the simulator can draw and the trainer runs::

    epl.init(epl.Config({"pipeline.num_micro_batch": 4}))
    with epl.replicate(device_count=1, name="stage_0"):
        part1 = nn.Sequential(...)
    with epl.replicate(device_count=1, name="stage_1"):
        part2 = nn.Sequential(...)
    epl.strategy()                     # the compiled unisched.Strategy
    trainer = epl.Trainer(loss_fn, lambda params: torch.optim.SGD(params, lr=0.1))
"""

from __future__ import annotations

from unisched.epl.config import Config, ConfigError
from unisched.epl.placement import (
    Placement,
    compile_strategy,
    place,
    simulate_placement,
    stage_costs,
    stash_limit,
)
from unisched.epl.scopes import (
    Env,
    Scope,
    ScopeError,
    TaskGraph,
    init,
    replicate,
    set_default_strategy,
    split,
)
from unisched.epl.scopes import world_size as current_world_size
from unisched.epl.tensor_parallel import (
    ClassParallelLinear,
    ColumnParallelLinear,
    Group,
    RowParallelLinear,
    SplitError,
    sharded_cross_entropy,
    split_module,
    split_plan,
)
from unisched.epl.trainer import Trainer, compute_device
from unisched.simulate import Costs
from unisched.strategy import Strategy


def placement(world_size: int | None = None) -> Placement:
    """Where the TaskGraphs annotated since ``epl.init`` go on ``world_size``
    devices (default: the world size of this run); refused as the trainer
    refuses them (:meth:`Env.checked_taskgraphs`)."""
    env = Env.get()
    return place(env.checked_taskgraphs(), env.config,
                 world_size if world_size is not None else current_world_size())


def strategy(world_size: int | None = None) -> Strategy:
    """The annotated model's placement as a :class:`unisched.Strategy`."""
    env = Env.get()
    return compile_strategy(placement(world_size), env.config)


def simulate(world_size: int | None = None, costs: Costs | None = None, **options):
    """Simulate :func:`strategy` with costs per TaskGraph (see :func:`stage_costs`;
    ``input_bytes`` and ``internal_bytes`` size each TaskGraph's activations,
    so recompute shows its memory saving)."""
    env = Env.get()
    return simulate_placement(placement(world_size), env.config, costs, **options)


__all__ = [
    "ClassParallelLinear",
    "ColumnParallelLinear",
    "Config",
    "ConfigError",
    "Env",
    "Group",
    "Placement",
    "RowParallelLinear",
    "Scope",
    "ScopeError",
    "SplitError",
    "TaskGraph",
    "Trainer",
    "compile_strategy",
    "compute_device",
    "init",
    "place",
    "placement",
    "replicate",
    "set_default_strategy",
    "sharded_cross_entropy",
    "simulate",
    "simulate_placement",
    "split",
    "split_module",
    "split_plan",
    "stage_costs",
    "stash_limit",
    "strategy",
]
