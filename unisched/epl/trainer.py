"""``epl.Trainer``: runs the annotated model on the placement EPL derives.

Every process runs the same script, builds the whole model (same seed, so
the same initial weights) and then keeps the parts its rank runs.  One step:

1. the global batch (the same on every rank) is cut into ``D * M``
   micro-batches; replica r takes micro-batches ``r*M .. r*M + M - 1``;
2. each micro-batch flows through the TaskGraphs of its replica.  Inside a
   group, ``replicate(k)`` gives each device 1/k of the rows and ``split(k)``
   gives every device all rows and a shard of the weights
   (:mod:`unisched.epl.tensor_parallel`).  TaskGraphs on the same devices
   (colocated) hand tensors over with a gather or scatter on the group;
   TaskGraphs on different devices send the whole tensor from the first
   device of one group to the first device of the next (point-to-point),
   which shares it with its group;
3. after the backward passes of all micro-batches, each parameter's gradient
   is summed over the devices that hold a copy of it and saw other rows (the
   data-parallel replicas, and the members of a ``replicate(k)`` group), and
   the optimizer steps (with ``zero.level: v1``, each device's optimizer
   holds only its shard of those copies, see :class:`_Shard`).

With ``offload.level: v0`` the weights of truth and the optimizer live in
host memory (:class:`_HostWeights`): a stage's weights are copied to the
compute device before its first forward of the step, its gradients are
copied back to the host after they are summed, the device copies are freed,
and the optimizer steps on the host.

The compute device is ``cuda:LOCAL_RANK`` when the process group runs NCCL
(:func:`compute_device`), the CPU with gloo; without a process group but
with torchrun's variables set, the trainer starts one (NCCL when CUDA is
available, gloo otherwise).

Every micro-batch's loss is weighted by its share of the global batch, so the
gradients are those of the mean loss over the global batch, as in
``unisched.Trainer``.

Both runtimes follow one order: the simulation of the strategy EPL compiles
(:meth:`Trainer.simulate`, what ``epl.simulate`` draws).  On ``"groups"``
each rank runs, item by item, the forward and backward passes
``Work(batch, stage, direction)`` that the simulation gives its group's
first device (the compute worker; every member of a group runs the same
items in the same order, so the group's collectives meet); colocated
TaskGraphs are separate items there, so their graph is cut between
TaskGraphs.  Sends do not wait; receives do.  That cannot deadlock: every
item the simulation runs starts after the items it reads from have ended,
so the earliest blocked item would be waiting for one that already ran.
``Trainer.last_order`` is what this rank ran in the last step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from unisched.epl.placement import Placement, compile_strategy, place
from unisched.epl.scopes import REPLICATE, SPLIT, Env, ScopeError, TaskGraph, world_size
from unisched.epl.tensor_parallel import (
    CLASS,
    Group,
    SplitError,
    gather,
    scatter,
    shard_dims,
    sharded_cross_entropy,
    split_module,
    split_plan,
)
from unisched.strategy import Strategy
from unisched.work import BACKWARD, FORWARD, Work

FULL, ROWS, CLASSES = "full", "rows", "classes"
"""Layouts of a tensor in a group: whole on every device, 1/k of the rows
each, or 1/k of the classes each (a class-sharded classifier's logits)."""

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class _Stash:
    """What a micro-batch's forward leaves for its backward on this rank."""

    leaf: torch.Tensor | None
    output: torch.Tensor
    layout: str
    loss: torch.Tensor | None


@dataclass
class _StepState:
    """One step on the groups runtime: the batch, what each (stage,
    micro-batch) keeps for its backward, what colocated TaskGraphs hand each
    other, the sends still in flight and the loss counted here."""

    inputs: torch.Tensor
    targets: torch.Tensor
    rows: int
    size: int
    contribution: torch.Tensor
    stashes: dict = field(default_factory=dict)
    handoff: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    pending: list = field(default_factory=list)


class Trainer:
    """Train the model annotated since the last ``epl.init``.

    ``loss_fn(outputs, targets)`` must average over the rows it is given;
    ``optimizer`` is a function from parameters to a torch optimizer.

    ``runtime`` picks who runs the step: ``"schedule"`` hands the stages and
    the simulated compiled strategy (:attr:`simulation`) to
    :class:`unisched.Trainer`, which follows it item by item (weight fetches
    for ``zero.level: v1``); ``"groups"`` is this module's runtime, which
    follows the same simulation (:attr:`order`) and also runs groups of
    devices (``replicate(k > 1)``, ``split``), shards optimizer state for
    ``zero.level: v1`` and keeps the weights of truth in host memory for
    ``offload.level: v0``.  ``"auto"`` takes
    ``"schedule"`` whenever it can run the placement (every TaskGraph on one
    device per replica, no offload, a process group set up) and ``"groups"``
    otherwise.  ``device`` overrides :func:`compute_device` on ``"groups"``;
    other ``options`` (e.g. ``timeout``) go to :class:`unisched.Trainer`.

    :attr:`simulation` is the schedule both runtimes follow; on ``"groups"``
    :attr:`order` is this rank's share of it and :attr:`last_order` the
    items the last step ran, in the order it ran them (None on
    ``"schedule"``, whose measured :attr:`last_timeline` on rank 0 says the
    same for every rank).
    """

    def __init__(self, loss_fn: Callable, optimizer: OptimizerFactory, *, runtime: str = "auto",
                 device: torch.device | str | None = None, **options):
        _ensure_process_group(float(options.get("timeout", 300.0)))
        self.env = Env.get()
        self.config = self.env.config
        taskgraphs = _checked(self.env.taskgraphs)
        self.placement: Placement = place(taskgraphs, self.config, world_size())
        self.strategy: Strategy = compile_strategy(self.placement, self.config)
        self.loss_fn = loss_fn
        self.rank = dist.get_rank() if _distributed() else 0
        self.stages = [t.module() for t in taskgraphs]
        self.recompute = self.config.gradient_checkpoint.type == "auto"
        self.runtime = _pick_runtime(runtime, self.placement, self.config)
        self.scheduled = None
        self.offloaded: dict[int, _HostWeights] = {}
        self.shards: dict[int, _Shard] = {}
        self.simulation = self.simulate()
        self.order: list[Work] | None = None
        self.last_order: list[Work] | None = None
        if self.runtime == SCHEDULE:
            from unisched.execute import Trainer as ScheduledTrainer

            if self.recompute:
                for stage in self.stages:
                    _recompute_forward(stage)
            if device is not None:
                options["device"] = device
            self.scheduled = ScheduledTrainer(self.stages, self.simulation, loss_fn, optimizer, **options)
            self.device = self.scheduled.device
            return
        if options:
            raise ScopeError(f"options {sorted(options)} are for runtime='schedule'; this model runs on 'groups'")
        self.device = compute_device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.class_sharded = _is_cross_entropy(loss_fn) and taskgraphs[-1].kind == SPLIT
        self.plans = {
            t.index: split_plan(self.stages[t.index], classifier=self.class_sharded and t.index == len(taskgraphs) - 1)
            for t in taskgraphs
            if t.kind == SPLIT
        }
        self._process_groups = _make_process_groups(self.placement)
        self.replica, self.segment = self._my_segment()
        try:
            self.order = self._my_order()
            for s in self.segment:
                if self.placement.stages[s].kind == SPLIT:
                    with self.env.paused():
                        self.stages[s] = split_module(self.stages[s], self.group(self.replica, s), self.plans[s])
                self.stages[s].to(self.device)
            if self.config.offload.level == "v0":
                self.offloaded = {s: _HostWeights(self.stages[s], self.device) for s in self.segment}
            self.shards = _zero_shards(self) if self.config.zero.level == "v1" else {}
            parameters = [p for s in self.segment if s not in self.shards for p in self.weights_of_truth(s)]
            parameters += [shard.parameter for shard in self.shards.values()]
            self.optimizer = optimizer(parameters) if parameters else None
        except Exception as error:
            _agree(error)
            raise
        _agree(None)

    def weights_of_truth(self, stage: int) -> list[nn.Parameter]:
        """The parameters the optimizer updates for ``stage`` (before ZeRO
        sharding): the host copies with offload, else the module's own."""
        if stage in self.offloaded:
            return self.offloaded[stage].host
        return list(self.stages[stage].parameters())

    # ------------------------------------------------------------------ layout of the run
    def group(self, replica: int, stage: int) -> Group:
        ranks = self.placement.group(replica, stage)
        index = ranks.index(self.rank) if self.rank in ranks else 0
        return Group(self._process_groups.get(ranks), ranks, index)

    def _my_segment(self) -> tuple[int, list[int]]:
        mine = self.placement.stages_of(self.rank)
        if not mine:
            raise ScopeError(f"rank {self.rank} runs no TaskGraph under this placement:\n{self.placement.describe()}")
        replica = mine[0][0]
        return replica, [s for r, s in mine if r == replica]

    def _my_order(self) -> list[Work]:
        """The items this rank runs, in the order the simulated compiled
        strategy runs them on its group's first device (the compute worker;
        every member of a group follows the same order)."""
        P = self.placement
        leader = P.group(self.replica, self.segment[0])[0]
        order = self.simulation.timeline.worker_orders()[leader]
        M = P.num_micro_batch
        batches = range(self.replica * M, self.replica * M + M)
        expected = {Work(b, s, d) for b in batches for s in self.segment for d in (FORWARD, BACKWARD)}
        for work in order:
            if work not in expected:
                raise ScopeError(
                    f"the simulated schedule gives worker {leader} (rank {self.rank}'s group) the item {work}, "
                    f"which is not a forward or backward of replica {self.replica}'s TaskGraph(s) {self.segment}; "
                    "the 'groups' runtime runs only those, so it cannot run this simulation"
                )
        missing = expected - set(order)
        if missing or len(order) != len(expected):
            raise ScopeError(
                f"the simulated schedule runs {len(order)} items on worker {leader} (rank {self.rank}'s group), "
                f"not each of the {len(expected)} expected once (missing: {sorted(missing)[:4]})"
            )
        return order

    def _layout_in(self, stage: int) -> str:
        info = self.placement.stages[stage]
        return ROWS if info.kind == REPLICATE and info.device_count > 1 else FULL

    def _layout_out(self, stage: int) -> str:
        if stage == self.placement.num_stages - 1 and self.class_sharded and any(
            p.style == CLASS for p in self.plans.get(stage, [])
        ):
            return CLASSES
        return self._layout_in(stage)

    # ------------------------------------------------------------------ one step
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One optimizer step on the global batch; returns its mean loss."""
        if self.scheduled is not None:
            return self.scheduled.step(inputs, targets)
        P = self.placement
        rows = len(inputs)
        if rows % P.num_batches:
            raise ScopeError(
                f"the global batch has {rows} rows, which cannot be cut into {P.data_parallel} replica(s) x "
                f"{P.num_micro_batch} micro-batch(es); use a multiple of {P.num_batches}"
            )
        size = rows // P.num_batches
        for info in P.stages:
            if info.kind == REPLICATE and size % info.device_count:
                raise ScopeError(
                    f"TaskGraph {info.index} ({info.name!r}) shares each micro-batch of {size} rows over "
                    f"{info.device_count} devices; make the global batch a multiple of "
                    f"{P.num_batches * info.device_count}"
                )
        run = _StepState(inputs, targets, rows, size, torch.zeros((), device=self.device))
        self.last_order = []
        for work in self.order:
            if work.direction == FORWARD:
                self._forward(work, run)
            else:
                self._backward(work, run)
            self.last_order.append(work)
        for sent in run.pending:
            sent.wait()
        for host in self.offloaded.values():
            host.fetch()
        self._reduce_gradients()
        for host in self.offloaded.values():
            host.return_gradients()
            host.release()
        for shard in self.shards.values():
            shard.take_gradient()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        for shard in self.shards.values():
            shard.write_back()
        for s in self.shards:
            for parameter in self.weights_of_truth(s):
                parameter.grad = None
        if _distributed():
            dist.all_reduce(run.contribution)
        return float(run.contribution)

    def _forward(self, work: Work, run: "_StepState") -> None:
        """Stage s's forward of one micro-batch: its input comes from the
        batch (s = 0), from the TaskGraph before on these devices
        (colocated, the graph is cut there so each stage goes back on its
        own), or from the previous group's first device; its output goes
        the same ways forward."""
        P, s, b = self.placement, work.stage, work.batch
        group = self.group(self.replica, s)
        rows = slice(b * run.size, (b + 1) * run.size)
        if s == 0:
            x, layout, leaf = run.inputs[rows].to(self.device), FULL, None
        else:
            if s - 1 in self.segment:
                x, layout = run.handoff.pop((s - 1, b))
            else:
                source = P.group(self.replica, s - 1)[0]
                x = _share(_recv(source, self.device, b) if group.index == 0 else None, group, self.device)
                layout = FULL
            leaf = x.requires_grad_(True) if x.is_floating_point() else None
        if s in self.offloaded:
            self.offloaded[s].fetch()
        x = _convert(x, layout, self._layout_in(s), group)
        x = checkpoint(self.stages[s], x, use_reentrant=False) if self.recompute else self.stages[s](x)
        layout = self._layout_out(s)
        loss = None
        if s == P.num_stages - 1:
            target = run.targets[rows].to(self.device)
            share = len(target) / (group.size if layout == ROWS else 1)
            loss = self._loss(x, target, layout, group) * (share / run.rows)
        elif s + 1 in self.segment:
            run.handoff[(s, b)] = (x.detach(), layout)
        elif group.index == 0 or layout == ROWS:
            whole = _all_gather_rows(x.detach(), group) if layout == ROWS else x.detach()
            if group.index == 0:
                run.pending.extend(_send(whole, P.group(self.replica, s + 1)[0], b))
        run.stashes[(s, b)] = _Stash(leaf, x, layout, loss)

    def _loss(self, output, target, layout, group) -> torch.Tensor:
        if layout == ROWS:
            return self.loss_fn(output, _own_rows(target, group))
        if layout == CLASSES:
            classifier = _last_linear(self.stages[self.segment[-1]])
            return sharded_cross_entropy(output, target, group, classifier.class_offset)
        return self.loss_fn(output, target)

    def _backward(self, work: Work, run: "_StepState") -> None:
        """Stage s's backward of one micro-batch: the output's gradient comes
        from the loss, the TaskGraph after on these devices, or the next
        group's first device; the input's goes back the same ways."""
        P, s, b = self.placement, work.stage, work.batch
        stash = run.stashes.pop((s, b))
        group = self.group(self.replica, s)
        if stash.loss is not None:
            stash.loss.backward()
            if stash.layout == ROWS or group.index == 0:
                run.contribution += stash.loss.detach()
        elif stash.output.is_floating_point():
            if s + 1 in self.segment:
                grad = run.grads.pop((s, b))
            else:
                source = P.group(self.replica, s + 1)[0]
                grad = _share(_recv(source, self.device, b) if group.index == 0 else None, group, self.device)
                grad = _own_rows(grad, group) if stash.layout == ROWS else grad
            if stash.output.requires_grad:
                torch.autograd.backward(stash.output, grad)
        if stash.leaf is None:
            return
        grad = stash.leaf.grad if stash.leaf.grad is not None else torch.zeros_like(stash.leaf)
        if s - 1 in self.segment:
            run.grads[(s - 1, b)] = grad
        elif group.index == 0:
            run.pending.extend(_send(grad, P.group(self.replica, s - 1)[0], b))

    def _reduce_gradients(self) -> None:
        for s in self.segment:
            ranks = _gradient_ranks(self.placement, s, self.rank)
            if len(ranks) == 1:
                continue
            process_group = self._process_groups[ranks]
            for parameter in self.stages[s].parameters():
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
                dist.all_reduce(parameter.grad, group=process_group)

    # ------------------------------------------------------------------ results
    def gather_state_dict(self) -> dict[str, torch.Tensor]:
        """``{"<taskgraph index>.<param name>": whole tensor}`` on every rank,
        from replica 0; split parameters are put back together."""
        if self.scheduled is not None:
            return self.scheduled.gather_state_dict()
        state: dict[str, torch.Tensor] = {}
        device = self.device
        for s, module in enumerate(self.stages):
            owners = self.placement.group(0, s)
            dims = shard_dims(self.plans[s]) if s in self.plans else {}
            converted = s in self.segment
            values = module.state_dict()
            if s in self.offloaded:
                values.update(self.offloaded[s].named())
            for name, parameter in values.items():
                if name in dims:
                    dim = dims[name]
                    shape = list(_full_shape(parameter, dim, len(owners), converted))
                    shape[dim] //= len(owners)
                    parts = []
                    for owner in owners:
                        mine = self.rank == owner
                        part = (parameter.detach().to(device, copy=True) if mine
                                else torch.empty(shape, dtype=parameter.dtype, device=device))
                        if _distributed():
                            dist.broadcast(part, src=owner)
                        parts.append(part)
                    state[f"{s}.{name}"] = torch.cat(parts, dim=dim).cpu()
                else:
                    whole = parameter.detach().to(device, copy=True)
                    if _distributed():
                        dist.broadcast(whole, src=owners[0])
                    state[f"{s}.{name}"] = whole.cpu()
        return state

    @property
    def last_timeline(self):
        """The measured Timeline of the last step (on rank 0, with the
        ``"schedule"`` runtime; None otherwise)."""
        return None if self.scheduled is None else self.scheduled.last_timeline

    def simulate(self, costs=None, **options):
        """Simulate this trainer's compiled strategy (see :func:`unisched.epl.simulate`)."""
        from unisched.epl.placement import simulate_placement

        return simulate_placement(self.placement, self.config, costs, **options)


# ---------------------------------------------------------------------- ZeRO
class _Shard:
    """``zero.level: v1`` on the groups runtime: the optimizer of one stage
    sees only this rank's 1/n of the stage's flattened parameters (n = the
    copies that all-reduce their gradients), so its state is sharded; after
    the step the shards are all-gathered back into every copy."""

    def __init__(self, parameters: list[nn.Parameter], ranks: tuple[int, ...], process_group, rank: int,
                 device: torch.device):
        self.parameters = parameters
        self.process_group = process_group
        self.device = device
        self.count = len(ranks)
        self.index = ranks.index(rank)
        total = sum(p.numel() for p in parameters)
        self.size = -(-total // self.count)
        flat = self._flat([p.detach() for p in parameters])
        self.parameter = nn.Parameter(flat[self.index * self.size : (self.index + 1) * self.size].clone())

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return F.pad(flat, (0, self.size * self.count - len(flat)))

    def take_gradient(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.parameters]
        self.parameter.grad = self._flat(grads)[self.index * self.size : (self.index + 1) * self.size].clone()

    def write_back(self) -> None:
        mine = self.parameter.data.to(self.device).contiguous()
        parts = [torch.empty_like(mine) for _ in range(self.count)]
        dist.all_gather(parts, mine, group=self.process_group)
        flat = torch.cat(parts)
        offset = 0
        with torch.no_grad():
            for p in self.parameters:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


def _zero_shards(trainer: "Trainer") -> dict[int, _Shard]:
    shards = {}
    for s in trainer.segment:
        ranks = _gradient_ranks(trainer.placement, s, trainer.rank)
        parameters = trainer.weights_of_truth(s)
        if len(ranks) > 1 and parameters:
            shards[s] = _Shard(parameters, ranks, trainer._process_groups[ranks], trainer.rank, trainer.device)
    return shards


# ---------------------------------------------------------------------- CPU offload
class _HostWeights:
    """``offload.level: v0``: one stage's weights of truth in host memory.

    The compute module keeps its parameter objects (autograd and the
    tensor-parallel layers refer to them) but holds their data only from
    :meth:`fetch` (before the stage's first forward of a step) to
    :meth:`release` (after its gradients went back to the host), so between
    steps the device keeps neither weights nor gradients; the optimizer,
    and so its state, sees only :attr:`host`.  Host copies are pinned when
    the device is a GPU, so the copies can overlap with work.
    """

    def __init__(self, module: nn.Module, device: torch.device):
        self.device = device
        named = list(module.named_parameters())
        self.names = [name for name, _ in named]
        self.compute = [parameter for _, parameter in named]
        pin = device.type == "cuda"
        self.host = [nn.Parameter(_host_copy(p.detach(), pin), requires_grad=p.requires_grad) for p in self.compute]
        self.fetched = True
        self.release()

    def fetch(self) -> None:
        if self.fetched:
            return
        for parameter, host in zip(self.compute, self.host):
            parameter.data = host.detach().to(self.device, copy=True, non_blocking=True)
        self.fetched = True

    def return_gradients(self) -> None:
        for parameter, host in zip(self.compute, self.host):
            if not host.requires_grad:
                continue
            grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
            host.grad = grad.detach().to("cpu", copy=True)

    def release(self) -> None:
        for parameter in self.compute:
            parameter.grad = None
            parameter.data = torch.empty(0, dtype=parameter.dtype, device=self.device)
        self.fetched = False

    def named(self) -> dict[str, torch.Tensor]:
        return {name: host.detach() for name, host in zip(self.names, self.host)}


def _host_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    copy.copy_(tensor)
    return copy


# ---------------------------------------------------------------------- model assembly
SCHEDULE, GROUPS = "schedule", "groups"


def compute_device(device: torch.device | str | None = None) -> torch.device:
    """Where this rank computes: ``device`` if given; with an NCCL process
    group (or none and CUDA present) ``cuda:LOCAL_RANK`` (else the current
    CUDA device); the CPU otherwise (gloo moves CPU tensors)."""
    if device is not None:
        return torch.device(device)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if _distributed() and dist.get_backend() != "nccl":
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())


def _ensure_process_group(timeout: float) -> None:
    """Under torchrun (``RANK`` and ``WORLD_SIZE`` set) with no process group
    yet, start one as :mod:`unisched.execute` does (NCCL on
    ``cuda:LOCAL_RANK`` when CUDA is available, gloo otherwise); without
    torchrun's variables EPL runs in one process, where the executor would
    raise."""
    if _distributed() or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    from unisched.execute.runtime import ensure_process_group

    ensure_process_group(timeout)


def _agree(error: Exception | None) -> None:
    """Every rank learns whether any rank failed to set up, so all stop
    together instead of waiting for each other in the first step."""
    if not _distributed():
        return
    verdicts: list = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, message) for rank, message in enumerate(verdicts) if message is not None]
    if failed and error is None:
        rank, message = failed[0]
        raise ScopeError(f"rank {rank} could not set up its part of the model: {message}")


def _pick_runtime(runtime: str, placement: Placement, config) -> str:
    problems = []
    if not _distributed():
        problems.append("no torch.distributed process group is set up")
    grouped = [info.name for info in placement.stages if info.device_count > 1]
    if grouped:
        problems.append(f"TaskGraph(s) {grouped} span several devices per replica")
    if config.offload.level:
        problems.append("offload.level keeps the weights in host memory, which only the 'groups' runtime does")
    if runtime == "auto":
        return GROUPS if problems else SCHEDULE
    if runtime == SCHEDULE and problems:
        raise ScopeError(f"runtime='schedule' cannot run this model: {'; '.join(problems)}; use runtime='groups'")
    if runtime not in (SCHEDULE, GROUPS):
        raise ScopeError(f"runtime must be 'auto', 'schedule' or 'groups', got {runtime!r}")
    return runtime


def _recompute_forward(module: nn.Module) -> None:
    """Make ``module`` keep only its input and recompute its forward in the
    backward (parameter names stay as they are)."""
    forward = module.forward

    def recomputed(x):
        return checkpoint(forward, x, use_reentrant=False) if torch.is_grad_enabled() else forward(x)

    module.forward = recomputed


def _checked(taskgraphs: list[TaskGraph]) -> list[TaskGraph]:
    if not taskgraphs:
        raise ScopeError(
            "no TaskGraph was annotated since epl.init(): build the model inside epl.replicate(...) or "
            "epl.split(...), or call epl.set_default_strategy(...) first"
        )
    owner: dict[int, TaskGraph] = {}
    for t in taskgraphs:
        if not t.modules:
            raise ScopeError(
                f"TaskGraph {t.index} ({t.name!r}) holds no module with parameters or submodules; "
                "build its modules inside the scope or remove the scope"
            )
        for top in t.top_modules():
            for sub in top.modules():
                if id(sub) in owner and owner[id(sub)] is not t:
                    raise ScopeError(
                        f"a {type(sub).__name__} built in TaskGraph {owner[id(sub)].index} "
                        f"({owner[id(sub)].name!r}) is also used in TaskGraph {t.index} ({t.name!r}); "
                        "a module belongs to one TaskGraph"
                    )
                owner[id(sub)] = t
    return taskgraphs


def _is_cross_entropy(loss_fn) -> bool:
    if loss_fn is F.cross_entropy:
        return True
    return (
        isinstance(loss_fn, nn.CrossEntropyLoss)
        and loss_fn.reduction == "mean"
        and loss_fn.weight is None
        and loss_fn.label_smoothing == 0.0
    )


def _last_linear(module: nn.Module):
    last = None
    for sub in module.modules():
        if hasattr(sub, "class_offset"):
            last = sub
    if last is None:
        raise SplitError("the last TaskGraph has no class-sharded classifier")
    return last


def _gradient_ranks(placement: Placement, stage: int, rank: int) -> tuple[int, ...]:
    """The ranks whose copies of ``stage``'s parameters (or of our shard) saw other rows."""
    info = placement.stages[stage]
    groups = [placement.group(r, stage) for r in range(placement.data_parallel)]
    if info.kind == REPLICATE:
        return tuple(sorted(rank_ for g in groups for rank_ in g))
    index = next(g.index(rank) for g in groups if rank in g)
    return tuple(g[index] for g in groups)


def _make_process_groups(placement: Placement) -> dict[tuple[int, ...], object]:
    """Every subgroup any rank needs, created in the same order on all ranks."""
    wanted: set[tuple[int, ...]] = set()
    for s in range(placement.num_stages):
        for r in range(placement.data_parallel):
            group = placement.group(r, s)
            wanted.add(group)
            for rank in group:
                wanted.add(_gradient_ranks(placement, s, rank))
    wanted = {g for g in wanted if len(g) > 1}
    if not wanted or not _distributed():
        return {}
    return {ranks: dist.new_group(list(ranks)) for ranks in sorted(wanted)}


def _full_shape(parameter: torch.Tensor, dim: int, parts: int, sharded_here: bool) -> torch.Size:
    if not sharded_here:
        return parameter.shape
    shape = list(parameter.shape)
    shape[dim] *= parts
    return torch.Size(shape)


# ---------------------------------------------------------------------- moving tensors
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _convert(x: torch.Tensor, have: str, want: str, group: Group) -> torch.Tensor:
    if have == want or group.size == 1:
        return x
    if have == FULL and want == ROWS:
        return scatter(x, group, 0) if x.requires_grad else _own_rows(x, group)
    if have == ROWS and want == FULL:
        return gather(x, group, 0)
    raise SplitError(f"cannot hand a tensor laid out as {have!r} to a TaskGraph that needs {want!r}")


def _own_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x.chunk(group.size, dim=0)[group.index] if group.size > 1 else x


def _all_gather_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.process_group)
    return torch.cat(parts)


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_MAX_DIMS = 8


def _header(x: torch.Tensor) -> torch.Tensor:
    """Rank, dtype and shape of ``x``, on ``x``'s device (NCCL moves only GPU tensors)."""
    if x.dim() > _MAX_DIMS or x.dtype not in _DTYPES:
        raise SplitError(f"cannot send a {x.dtype} tensor of {x.dim()} dimensions between TaskGraphs")
    header = [x.dim(), _DTYPES.index(x.dtype), *x.shape] + [0] * (_MAX_DIMS - x.dim())
    return torch.tensor(header, dtype=torch.int64).to(x.device)


def _empty_like_header(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    values = header.tolist()
    ndim, dtype = values[0], _DTYPES[values[1]]
    return torch.empty(values[2 : 2 + ndim], dtype=dtype, device=device)


def _send(x: torch.Tensor, destination: int, batch: int) -> list:
    """Shape then data, tagged with the micro-batch, without waiting: the
    works are waited on at the step's end."""
    payload = x.detach().contiguous()
    return [dist.isend(_header(payload), destination, tag=batch), dist.isend(payload, destination, tag=batch)]


def _recv(source: int, device: torch.device, batch: int) -> torch.Tensor:
    header = torch.empty(_MAX_DIMS + 2, dtype=torch.int64, device=device)
    dist.recv(header, source, tag=batch)
    x = _empty_like_header(header, device)
    dist.recv(x, source, tag=batch)
    return x


def _share(x: torch.Tensor | None, group: Group, device: torch.device) -> torch.Tensor:
    """The group's first device has ``x``; every device of the group gets it."""
    if group.size == 1:
        return x
    leader = group.ranks[0]
    header = _header(x) if x is not None else torch.empty(_MAX_DIMS + 2, dtype=torch.int64, device=device)
    dist.broadcast(header, leader, group=group.process_group)
    if x is None:
        x = _empty_like_header(header, device)
    dist.broadcast(x, leader, group=group.process_group)
    return x
