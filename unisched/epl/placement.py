"""Placement, as EPL derives it, and the unified-scheme strategy it compiles to.

EPL's rules: one model replica needs the sum of its TaskGraphs' device
counts (or, with ``cluster.colocate_split_and_replicate``, all TaskGraphs
share the same devices); the data-parallel degree is the world size divided
by that.  Each TaskGraph is one stage of the scheme, and the ``num_micro_batch``
micro-batches of every replica are the scheme's batches: micro-batch b
belongs to replica ``b // num_micro_batch``.

A TaskGraph spanning k > 1 devices is a *group*: its work item on a
micro-batch is done by all k devices together (shares of the batch for
``replicate``, shards of the weights for ``split``), a gang in the
simulator's terms (``Strategy.gang``: all k busy at once).  The mapping names
the group's first device as the compute worker; ``params["groups"]`` lists
every group and ``params["split_groups"]`` the tensor-parallel ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from unisched.errors import ShapeError
from unisched.epl.config import Config
from unisched.epl.scopes import SPLIT, ScopeError, TaskGraph
from unisched.simulate import BackwardFirst, Costs, OldestStageFirst, simulate
from unisched.strategy import Gang, Strategy
from unisched.work import ComputeAndWeightWorkers, Shape, Work, is_whole


@dataclass(frozen=True)
class StageInfo:
    """What the placement needs to know of one TaskGraph."""

    index: int
    kind: str
    device_count: int
    name: str


@dataclass(frozen=True)
class Placement:
    """Which devices run which TaskGraph of which replica.

    ``groups[r][s]`` is the tuple of ranks that run TaskGraph s for replica r.
    """

    world_size: int
    stages: tuple[StageInfo, ...]
    devices_per_replica: int
    data_parallel: int
    num_micro_batch: int
    colocate: bool
    groups: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_batches(self) -> int:
        return self.data_parallel * self.num_micro_batch

    def replica_of(self, batch: int) -> int:
        return batch // self.num_micro_batch

    def group(self, replica: int, stage: int) -> tuple[int, ...]:
        return self.groups[replica][stage]

    def stages_of(self, rank: int) -> list[tuple[int, int]]:
        """``(replica, stage)`` pairs whose group contains ``rank``."""
        return [(r, s) for r in range(self.data_parallel) for s in range(self.num_stages) if rank in self.groups[r][s]]

    def describe(self) -> str:
        lines = [
            f"{self.world_size} devices: {self.data_parallel} replica(s) x {self.devices_per_replica} device(s)"
            f"{' (TaskGraphs colocated)' if self.colocate else ''}, {self.num_micro_batch} micro-batch(es) each"
        ]
        for info in self.stages:
            ranks = "; ".join(",".join(map(str, self.groups[r][info.index])) for r in range(self.data_parallel))
            lines.append(f"  TaskGraph {info.index} {info.name!r}: {info.kind}({info.device_count}) on ranks {ranks}")
        return "\n".join(lines)


def place(taskgraphs: Sequence[TaskGraph | StageInfo], config: Config, world_size: int) -> Placement:
    """EPL's placement of ``taskgraphs`` on ``world_size`` devices."""
    if not is_whole(world_size):
        raise ShapeError(f"the world size must be a positive number of devices, got {world_size!r}")
    if not taskgraphs:
        raise ScopeError(
            "no TaskGraph was annotated: build the model inside epl.replicate(...)/epl.split(...) "
            "or call epl.set_default_strategy first"
        )
    stages = tuple(StageInfo(t.index, t.kind, t.device_count, t.name) for t in taskgraphs)
    colocate = bool(config.cluster.colocate_split_and_replicate)
    counts = [s.device_count for s in stages]
    if colocate:
        if len(set(counts)) > 1:
            listed = ", ".join(f"{s.name}: {s.device_count}" for s in stages)
            raise ScopeError(
                f"cluster.colocate_split_and_replicate places every TaskGraph on the same devices, so their "
                f"device counts must be equal; got {listed}"
            )
        per_replica = counts[0]
    else:
        per_replica = sum(counts)
    if world_size % per_replica:
        raise ScopeError(
            f"the world size {world_size} is not divisible by the {per_replica} devices one model replica needs "
            f"({' + '.join(map(str, counts)) if not colocate else counts[0]}); "
            "change the device counts or the number of processes"
        )
    data_parallel = world_size // per_replica
    groups = []
    for r in range(data_parallel):
        base = r * per_replica
        offsets = [0] * len(stages) if colocate else list(np.cumsum([0] + counts[:-1]))
        groups.append(tuple(tuple(range(base + int(o), base + int(o) + c)) for o, c in zip(offsets, counts)))
    return Placement(
        world_size=world_size,
        stages=stages,
        devices_per_replica=per_replica,
        data_parallel=data_parallel,
        num_micro_batch=config.pipeline.num_micro_batch,
        colocate=colocate,
        groups=tuple(groups),
    )


def compile_strategy(placement: Placement, config: Config) -> Strategy:
    """The unified-scheme strategy of a placement and the config's memory features.

    - compute worker: the first device of the group running (replica, stage);
    - weight worker: that same device (replicas, all-reduced at the end), or
      with ``zero.level: v1`` the group of replica ``stage mod D`` (each
      stage's weights of truth, and optimizer state, on one replica, which
      the others fetch from and return gradients to); with
      ``offload.level: v0`` the host memory of that device, worker
      ``world_size + device``, which only stores weights (the executor keeps
      them in that rank's host memory);
    - a group of k > 1 devices is a gang: ``Gang(ranks, collective=True)``
      for ``split`` (tensor parallelism all-reduces activations inside the
      group), ``collective=False`` for ``replicate`` (each device takes 1/k
      of the rows; nothing is reduced until the gradients at the end);
    - priority: ``PreferBackward`` = 1F1B (:class:`BackwardFirst` plus a limit
      of ``min(M, S - s)`` stashes per stage), ``PreferForward`` = GPipe's
      fill-drain (:class:`OldestStageFirst`, no limit).
    """
    P = placement
    S, B, D, M = P.num_stages, P.num_batches, P.data_parallel, P.num_micro_batch
    zero = config.zero.level == "v1"
    offload = config.offload.level == "v0"
    W = num_workers(P, config)
    leaders = np.array([[P.groups[r][s][0] for s in range(S)] for r in range(D)], dtype=np.int64)
    weight_table = leaders.copy()
    if zero:
        weight_table = np.array([[leaders[s % D, s] for s in range(S)] for _ in range(D)], dtype=np.int64)
    if offload:
        weight_table += P.world_size
    hosts = sorted(set(weight_table.ravel().tolist())) if offload else []

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        replica = work.batch // M
        return ComputeAndWeightWorkers(int(leaders[replica, work.stage]), int(weight_table[replica, work.stage]))

    def map_arrays(batch, stage, direction):
        replica = np.asarray(batch) // M
        return leaders[replica, stage], weight_table[replica, stage]

    kinds = {info.index: info.kind for info in P.stages}

    def gang(work: Work) -> Gang | None:
        group = P.groups[work.batch // M][work.stage]
        return Gang(group, collective=kinds[work.stage] == SPLIT) if len(group) > 1 else None

    prefer_backward = config.pipeline.strategy == "PreferBackward"
    priority = BackwardFirst(S, B) if prefer_backward else OldestStageFirst(S, B)
    limit = stash_limit(P, config)

    groups = {s: [P.groups[r][s] for r in range(D)] for s in range(S)}
    memory = [name for name, on in (("recompute", config.gradient_checkpoint.type == "auto"),
                                    ("zero-v1", zero), ("offload-v0", offload)) if on]
    name = "EPL " + "+".join(
        f"{info.kind}({info.device_count})" for info in P.stages
    ) + (f" x{D}" if D > 1 else "") + ("" if not memory else " [" + ",".join(memory) + "]")
    description = (
        f"{P.describe()}\n{'1F1B (PreferBackward)' if prefer_backward else 'GPipe fill-drain (PreferForward)'}"
    )
    return Strategy(
        mapping=mapping,
        name=name,
        description=description,
        priority=priority,
        memory_limit=limit,
        shape=Shape(W, S, B),
        map_arrays=map_arrays,
        gang=gang if any(info.device_count > 1 for info in P.stages) else None,
        params={
            "data_parallel": D,
            "num_micro_batch": M,
            "devices_per_replica": P.devices_per_replica,
            "colocate": P.colocate,
            "taskgraphs": [f"{info.name}:{info.kind}({info.device_count})" for info in P.stages],
            "groups": groups,
            "split_groups": {s: g for s, g in groups.items() if kinds[s] == SPLIT},
            "recompute": config.gradient_checkpoint.type == "auto",
            "zero": config.zero.level,
            "offload": config.offload.level,
            "host_workers": hosts,
        },
    )


def num_workers(placement: Placement, config: Config) -> int:
    """Workers of the compiled strategy: the devices, and with
    ``offload.level: v0`` each device's host memory after them."""
    return placement.world_size * (2 if config.offload.level == "v0" else 1)


def stash_limit(placement: Placement, config: Config, stash_bytes: Sequence[float] | None = None):
    """1F1B's activation limit per worker: ``min(M, S - s)`` stashes of each
    stage s it leads (in bytes when ``stash_bytes`` gives each stage's
    stash); None for ``PreferForward``, which has no limit."""
    if config.pipeline.strategy != "PreferBackward":
        return None
    P = placement
    S, D, M = P.num_stages, P.data_parallel, P.num_micro_batch
    W = num_workers(P, config)
    size = np.ones(S) if stash_bytes is None else np.asarray(stash_bytes, dtype=float)
    per_worker = np.zeros(W)
    for r in range(D):
        for s in range(S):
            per_worker[P.groups[r][s][0]] += min(M, S - s) * size[s]
    per_worker[per_worker == 0] = M if stash_bytes is None else np.inf
    return per_worker.tolist()


def stage_costs(
    placement: Placement,
    config: Config,
    base: Costs | None = None,
    *,
    input_bytes: float | Sequence[float] | None = None,
    internal_bytes: float | Sequence[float] | None = None,
) -> Costs:
    """Costs of the compiled strategy's work items from single-device costs.

    Time: a group of k devices does a stage's item in 1/k of the time;
    recompute (``gradient_checkpoint.type: auto``) adds a forward to every
    backward.  A split stage's all-reduces are not added here: its items are
    collective gangs, and the simulator adds a ring all-reduce of the stage's
    ``activation_bytes`` per pass from the costs' latency and bandwidth.

    Memory, per stage: ``input_bytes`` is the stage's input (what flows in
    from the previous TaskGraph, default ``base.activation_bytes``) and
    ``internal_bytes`` the activations its layers save for the backward
    (default what ``base.stash_bytes`` holds beyond the input, else 0).  A
    forward keeps the input only with recompute, the input and the internal
    activations otherwise (``Costs.stash_bytes``), counted per device: a
    ``replicate(k)`` device holds 1/k of both (its rows), a ``split(k)``
    device the whole input and 1/k of the internal activations (its features).
    """
    base = base if base is not None else Costs()
    if not isinstance(base, Costs):
        raise TypeError(f"costs must be a unisched.Costs (one device's times and sizes), got {type(base).__name__}; "
                        "e.g. unisched.Costs(forward=..., backward=...)")
    S = placement.num_stages
    forward = base.per_stage("forward", S).copy()
    backward = base.per_stage("backward", S).copy()
    inputs = _per_stage(input_bytes, S, "input_bytes") if input_bytes is not None else base.per_stage(
        "activation_bytes", S)
    if internal_bytes is not None:
        internal = _per_stage(internal_bytes, S, "internal_bytes")
    elif base.stash_bytes is not None:
        internal = np.maximum(base.per_stage("stash_bytes", S) - base.per_stage("activation_bytes", S), 0.0)
    else:
        internal = np.zeros(S)
    recompute = config.gradient_checkpoint.type == "auto"
    stash = np.zeros(S)
    for info in placement.stages:
        k = info.device_count
        forward[info.index] /= k
        backward[info.index] /= k
        held_input = inputs[info.index] / (k if info.kind != SPLIT else 1)
        stash[info.index] = held_input + (0.0 if recompute else internal[info.index] / k)
    if recompute:
        backward = backward + forward
    return replace(base, forward=forward.tolist(), backward=backward.tolist(),
                   backward_input=None, backward_weight=None,
                   activation_bytes=inputs.tolist(), stash_bytes=stash.tolist())


def _per_stage(value: float | Sequence[float], num_stages: int, name: str) -> np.ndarray:
    try:
        array = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        array = np.full((), np.nan)  # refused below, by name
    if array.ndim == 0:
        array = np.full(num_stages, float(array))
    if array.ndim != 1 or len(array) != num_stages or np.any(array < 0) or not np.all(np.isfinite(array)):
        raise ScopeError(
            f"epl.stage_costs({name}=...) takes a non-negative number or one per TaskGraph "
            f"({num_stages}), got {value!r}"
        )
    return array


def simulate_placement(
    placement: Placement,
    config: Config,
    costs: Costs | None = None,
    *,
    input_bytes: float | Sequence[float] | None = None,
    internal_bytes: float | Sequence[float] | None = None,
    **options,
):
    """Simulate the compiled strategy with :func:`stage_costs` (a ``unisched.Simulation``)."""
    strategy = compile_strategy(placement, config)
    W, S, B = strategy.shape
    stage = stage_costs(placement, config, costs, input_bytes=input_bytes, internal_bytes=internal_bytes)
    if stage.has_sizes and "memory_limit" not in options:
        options["memory_limit"] = stash_limit(placement, config, stage.per_stage("stash_bytes", S))
    return simulate(W, S, B, strategy, costs=stage, **options)
