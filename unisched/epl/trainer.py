"""``epl.Trainer``: trains the annotated model on unisched's one runtime.

EPL compiles the placement into a strategy of the unified scheme
(:func:`unisched.epl.placement.compile_strategy`), simulates it
(:meth:`Trainer.simulate`, what ``epl.simulate`` draws) and hands the
TaskGraphs and that simulation to :class:`unisched.Trainer`, which runs it
item by item, the same programs on every rank:

- a ``replicate(k > 1)`` TaskGraph is a gang that shares each micro-batch's
  rows: member i runs the i-th share, the first member gathers the outputs;
- a ``split(k)`` TaskGraph is a tensor-parallel gang: every member runs the
  whole micro-batch with its shard of the Linear layers
  (:func:`unisched.epl.tensor_parallel.split_module`), whose collectives
  meet inside the module;
- data-parallel replicas hold copies of each stage's weights (or shard) and
  all-reduce their gradients; ``zero.level: v1`` keeps each stage's weights
  of truth, and its optimizer state, on one replica only, which the others
  fetch from and return gradients to;
- ``offload.level: v0`` gives each device a host worker: the rank keeps the
  weights of truth and optimizer state in host memory, copies them to the
  device for a step and frees the device copies after;
- ``gradient_checkpoint.type: auto`` recomputes each TaskGraph's forward in
  its backward (``torch.utils.checkpoint``).

Every process runs the same script and builds the whole model with the same
seed, so every rank cuts its shards from the same initial weights.  Under
torchrun the trainer starts the process group if none runs (NCCL on
``cuda:LOCAL_RANK`` with CUDA, gloo otherwise); in one process without
torchrun it trains as a world of one (over an in-process store; NCCL on the
current GPU when there is one, gloo on the CPU otherwise).  It computes on
:func:`compute_device` unless ``device=`` says otherwise.
"""

from __future__ import annotations

import warnings
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from unisched.epl.placement import Placement, compile_strategy, place
from unisched.epl.scopes import SPLIT, Env, ScopeError, world_size
from unisched.epl.tensor_parallel import Group, shard_dims, split_module, split_plan
from unisched.execute.runtime import Trainer as ScheduledTrainer
from unisched.execute.process_group import compute_device, ensure_process_group
from unisched.strategy import Strategy
from unisched.work import Work

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SCHEDULE = "schedule"


class Trainer:
    """Train the model annotated since the last ``epl.init``.

    ``loss_fn(outputs, targets)`` must average over the rows it is given;
    ``optimizer`` is a function from parameters to a torch optimizer.
    ``device`` and other ``options`` (e.g. ``timeout``, ``record``) go to
    :class:`unisched.Trainer`, which runs every placement (:attr:`scheduled`).

    :attr:`simulation` is the schedule it runs; :attr:`order` is this rank's
    share of it (a group's items are run by every member), and
    :attr:`last_timeline` (rank 0) is what the last step measured.
    ``runtime`` is kept for old scripts: ``"auto"`` and ``"schedule"`` are
    the one runtime; ``"groups"``, the former second runtime, now runs on it
    too, with a warning.
    """

    def __init__(self, loss_fn: Callable, optimizer: OptimizerFactory, *, runtime: str = "auto",
                 device: torch.device | str | None = None, **options):
        _check_runtime(runtime)
        self.env = Env.get()
        self.config = self.env.config
        taskgraphs = self.env.checked_taskgraphs()  # annotations refused before any process group is started
        self.placement: Placement = place(taskgraphs, self.config, world_size())
        self.strategy: Strategy = compile_strategy(self.placement, self.config)
        ensure_process_group(float(options.get("timeout", 300.0)))
        self.loss_fn = loss_fn
        self.rank = dist.get_rank()
        self.runtime = SCHEDULE
        self.simulation = self.simulate()
        self.plans = {t.index: split_plan(t.module()) for t in taskgraphs if t.kind == SPLIT}
        tensor_parallel = _tensor_parallel_groups(self.placement, self.plans)
        modules = [t.module() for t in taskgraphs]
        recompute = self.config.gradient_checkpoint.type == "auto"

        def build(stage: int) -> nn.Module:
            module = modules[stage]
            if stage in self.plans:
                module = split_module(module, self._group(stage, tensor_parallel), self.plans[stage])
            if recompute:
                _recompute_forward(module)
            return module

        options["device"] = compute_device(device)
        with self.env.paused():  # the modules built from here on are the trainer's, not the model's
            self.scheduled = ScheduledTrainer(build, self.simulation, loss_fn, optimizer, **options)
        self.stages: list[nn.Module] = self.scheduled.stages
        self.device = self.scheduled.device
        self.optimizer = self.scheduled.optimizer

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on the global batch; returns its mean loss."""
        return self.scheduled.step(inputs, targets)

    @property
    def order(self) -> list[Work]:
        """The items this rank runs in a step, in order (its groups' items included)."""
        return self.scheduled.program.compute_order(self.rank)

    @property
    def last_timeline(self):
        """The measured Timeline of the last step (on rank 0; None elsewhere)."""
        return self.scheduled.last_timeline

    def gather_state_dict(self) -> dict[str, torch.Tensor]:
        """``{"<taskgraph index>.<param name>": whole tensor}`` on every rank;
        split parameters are put back together from their shards."""
        state: dict[str, torch.Tensor] = {}
        for s in range(len(self.stages)):
            shares = self.scheduled.gather_shares(s)
            dims = shard_dims(self.plans[s]) if s in self.plans and len(shares) > 1 else {}
            for name, value in shares[0].items():
                parts = [share[name] for share in shares]
                state[f"{s}.{name}"] = torch.cat(parts, dim=dims[name]) if name in dims else value
        return state

    def close(self) -> None:
        """Release the runtime's process groups (every rank calls it)."""
        self.scheduled.close()

    def simulate(self, costs=None, **options):
        """Simulate this trainer's compiled strategy (see :func:`unisched.epl.simulate`)."""
        from unisched.epl.placement import simulate_placement

        return simulate_placement(self.placement, self.config, costs, **options)

    def _group(self, stage: int, process_groups: dict[tuple[int, ...], object]) -> Group:
        """This rank's tensor-parallel group for ``stage`` (a rank outside every
        group of the stage builds shard 0, which it never runs)."""
        P = self.placement
        groups = [P.group(r, stage) for r in range(P.data_parallel)]
        mine = next((g for g in groups if self.rank in g), None)
        if mine is None:
            return Group(None, groups[0], 0)
        return Group(process_groups.get(mine), mine, mine.index(self.rank))


def _check_runtime(runtime: str) -> None:
    if runtime == "groups":
        warnings.warn(
            "runtime='groups' is gone: every placement runs on unisched.Trainer (runtime='auto'), which now "
            "runs replicate(k), split, ZeRO and offload itself; drop the argument",
            DeprecationWarning,
            stacklevel=3,
        )
    elif runtime not in ("auto", SCHEDULE):
        raise ScopeError(f"runtime must be 'auto' or 'schedule', got {runtime!r}")


def _tensor_parallel_groups(placement: Placement, plans: dict) -> dict[tuple[int, ...], object]:
    """A process group for every group of devices that runs a split
    TaskGraph, created in the same order on every rank."""
    wanted = sorted({placement.group(r, s) for s in plans for r in range(placement.data_parallel)})
    return {ranks: dist.new_group(list(ranks)) for ranks in wanted if len(ranks) > 1}


def _recompute_forward(module: nn.Module) -> None:
    """Make ``module`` keep only its input and recompute its forward in the
    backward (parameter names stay as they are)."""
    forward = module.forward

    def recomputed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = recomputed


__all__ = ["Trainer", "compute_device"]  # compute_device: the runtime's, kept here for EPL scripts
