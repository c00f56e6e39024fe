"""3D layouts: data x pipeline x tensor parallelism on a cluster topology.

A :class:`Layout` of D data-parallel replicas, P pipeline stages and T-way
tensor parallelism runs on D P T devices.  Device ``(d P + p) T + t`` is
tensor rank t of pipeline worker p of replica d: the T ranks of a gang are
neighbours (on one node when T divides the node), the P workers of a
replica follow, and replicas come last.  The strategy is any pipeline
strategy over P workers (GPipe, 1F1B, ...) lifted to gangs of T devices
(:func:`tensor_parallel`): each item runs on its gang, which all-reduces its
activations (the tensor-parallel collective), and each stage's gradient is
all-reduced across the D replicas at the end of the step.

Symmetry
    When every replica fills whole nodes (P T a multiple of the devices per
    node), no two replicas share an NVLink port or a NIC, and the replicas
    sit alike under the leaf switches (a replica's nodes span whole
    switches, or a switch holds whole replicas), then every replica runs the
    same schedule at the same times on links of its own.  Simulating replica
    0 alone, with each all-reduce ringing over the same workers of all D
    replicas (:class:`~unisched.topology.ClusterCosts` ``replicas``), then
    gives exactly the step of the whole cluster: that is what
    :func:`simulate_layout` does, and :attr:`LayoutResult.method` says so.
    Otherwise it simulates every replica (exact too, D times the work).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from unisched.errors import ShapeError, StrategyError
from unisched.simulate.priorities import OldestBatchFirst, as_priority
from unisched.simulate.sequences import order_columns
from unisched.simulate.simulation import Simulation, simulate
from unisched.dataflow import Items
from unisched.strategy import Gang, Strategy, WorkerOrders, works
from unisched.topology import ClusterCosts, Topology
from unisched.work import ComputeAndWeightWorkers, Shape, Work, is_real, is_whole, positive_count


@dataclass(frozen=True)
class Layout:
    """D data-parallel replicas x P pipeline stages x T-way tensor parallelism."""

    data: int
    pipeline: int
    tensor: int

    @property
    def devices(self) -> int:
        return self.data * self.pipeline * self.tensor

    def check(self, devices: int | None = None) -> "Layout":
        for name in ("data", "pipeline", "tensor"):
            value = getattr(self, name)
            if not is_whole(value):
                raise ShapeError(f"Layout.{name} must be an integer >= 1, got {value!r}")
        if devices is not None and self.devices != devices:
            raise ShapeError(
                f"the layout data={self.data} x pipeline={self.pipeline} x tensor={self.tensor} = {self.devices} "
                f"devices does not match the {devices} GPUs; choose degrees whose product is {devices}"
            )
        return self

    def __str__(self) -> str:
        return f"DP {self.data} x PP {self.pipeline} x TP {self.tensor}"


@dataclass(frozen=True)
class Model:
    """A model of identical layers, as a layout needs it: per micro-batch,
    in seconds on one GPU and in bytes."""

    layers: int
    layer_forward: float
    """One layer's forward of one micro-batch on one GPU (seconds)."""
    layer_weight_bytes: float
    activation_bytes: float
    """The tensor one layer hands the next for one micro-batch: what moves
    between stages, and what a tensor-parallel gang all-reduces twice per
    layer in each pass (Megatron-LM's layer)."""
    layer_stash_bytes: float
    """What one layer keeps for its backward per micro-batch (split over a gang's T ranks)."""
    backward_ratio: float = 2.0
    optimizer_bytes_per_weight_byte: float = 6.0
    """Optimizer state per byte of weights (Adam's fp32 copy and two moments
    for bf16 weights: 12 bytes per 2-byte weight)."""

    def __post_init__(self) -> None:
        positive_count("layers", self.layers, "Model: ")
        for name in ("layer_forward", "layer_weight_bytes", "activation_bytes", "layer_stash_bytes",
                     "backward_ratio", "optimizer_bytes_per_weight_byte"):
            value = getattr(self, name)
            if not (is_real(value) and 0 <= value < math.inf):
                raise ShapeError(f"Model.{name} must be a finite number >= 0, got {value!r}")
        if self.layer_forward == 0:
            raise ShapeError("Model.layer_forward must be positive: a layer's forward takes time")

    @classmethod
    def transformer(cls, layers: int, hidden: int, sequence: int, micro_batch: int = 1,
                    gpu_flops: float = 400e12) -> "Model":
        """A GPT-style transformer in bf16 at ``gpu_flops`` achieved: a layer's
        forward is 24 b s h^2 (1 + s / 6h) flops and 12 h^2 weights (Narayanan
        et al., "Efficient Large-Scale Language Model Training on GPU Clusters
        Using Megatron-LM", 2021); it keeps 34 s b h bytes for its backward
        with selective recomputation (Korthikanti et al., "Reducing Activation
        Recomputation in Large Transformer Models", 2022)."""
        for name, count in (("layers", layers), ("hidden", hidden), ("sequence", sequence), ("micro_batch", micro_batch)):
            positive_count(name, count, "Model.transformer: ")
        if not (is_real(gpu_flops) and 0 < gpu_flops < math.inf):
            raise ShapeError(f"Model.transformer: gpu_flops must be a positive number, got {gpu_flops!r}")
        b, s, h = micro_batch, sequence, hidden
        return cls(
            layers=layers, layer_forward=24 * b * s * h * h * (1 + s / (6 * h)) / gpu_flops,
            layer_weight_bytes=12 * h * h * 2.0, activation_bytes=2.0 * b * s * h, layer_stash_bytes=34.0 * s * b * h,
        )

    def costs(self, layout: Layout, topology, replicas: int) -> ClusterCosts:
        """Per-stage costs of this model split by ``layout`` (P stages of
        layers / P layers, each computed by T ranks)."""
        P, T = layout.pipeline, layout.tensor
        if self.layers % P:
            raise ShapeError(f"Model.layers={self.layers} does not split into pipeline={P} equal stages; "
                             f"choose a pipeline degree that divides {self.layers}")
        per_stage = self.layers // P
        forward = per_stage * self.layer_forward / T
        return ClusterCosts(
            forward=forward, backward=self.backward_ratio * forward, activation_bytes=self.activation_bytes,
            stash_bytes=per_stage * self.layer_stash_bytes / T, weight_bytes=per_stage * self.layer_weight_bytes,
            tensor_parallel_bytes=2 * per_stage * self.activation_bytes, topology=topology, replicas=replicas,
        )

    def state_bytes(self, layout: Layout) -> float:
        """Weights, gradients and optimizer state one GPU keeps (its 1/T of a stage)."""
        stage = self.layers // layout.pipeline * self.layer_weight_bytes / layout.tensor
        return stage * (2.0 + self.optimizer_bytes_per_weight_byte)


@dataclass
class LayoutResult:
    """A simulated layout: its step, and how it was simulated."""

    layout: Layout
    simulation: Simulation
    """Replica 0 (by symmetry) or every replica."""
    method: str
    memory_per_gpu: float
    """The most bytes a GPU holds: its model state and its peak stashes."""

    @property
    def step_time(self) -> float:
        return self.simulation.latency

    @property
    def symmetric(self) -> bool:
        return self.simulation.shape.num_workers < self.layout.devices

    def summary(self) -> str:
        return (f"{self.layout} on {self.layout.devices} GPUs: step {self.step_time:.4g} s, "
                f"bubble {self.simulation.bubble_fraction:.1%}, memory per GPU {self.memory_per_gpu / 2**30:.3g} GiB\n"
                f"  {self.method}")


def simulate_layout(layout: Layout, topology, pipeline: Strategy, model: Model, *, symmetry: bool = True) -> LayoutResult:
    """Simulate one training step of ``layout`` on ``topology`` (a Topology,
    preset name or file) with ``pipeline``, a strategy over
    ``layout.pipeline`` workers and stages whose shape gives the
    micro-batches per replica; by symmetry where that is exact (see the
    module docstring), else every replica."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a unisched Layout(pipeline=, tensor=, data=), got {type(layout).__name__}")
    if not isinstance(model, Model):
        raise TypeError(f"model must be a unisched Model (its layers' times and sizes), got {type(model).__name__}")
    layout.check()
    topology = Topology.load(topology).sized(layout.devices)
    P, T, D = layout.pipeline, layout.tensor, layout.data
    if not isinstance(pipeline, Strategy):
        raise ShapeError(f"the pipeline must be a Strategy built for {P} workers and {P} stages (layout "
                         f"pipeline={P}), e.g. policies.get('one_f_one_b', {P}, {P}, micro_batches); got {pipeline!r}")
    if pipeline.shape is None or tuple(pipeline.shape)[:2] != (P, P):
        raise ShapeError(f"the pipeline strategy {pipeline.name!r} must be built for {P} workers and {P} stages "
                         f"(layout pipeline={P}), e.g. policies.get('one_f_one_b', {P}, {P}, micro_batches)")
    B = pipeline.shape[2]
    exact = symmetry and _replicas_alike(topology, P * T, D)
    if exact:
        costs = model.costs(layout, topology, replicas=D)
        simulation = simulate(P * T, P, B, tensor_parallel(pipeline, T), costs=costs)
        method = (f"simulated replica 0 of {D} ({P * T} of {layout.devices} GPUs, {len(simulation.timeline.start)} "
                  f"items), each all-reduce ringing over all {D} replicas: exact by symmetry, since every replica "
                  f"fills whole nodes of {topology.devices_per_node} and sits alike under the switches")
    else:
        costs = model.costs(layout, topology, replicas=1)
        simulation = simulate(layout.devices, P, D * B, replicated(tensor_parallel(pipeline, T), D), costs=costs)
        reason = "symmetry not asked for" if not symmetry else (
            f"replicas of {P * T} GPUs share nodes of {topology.devices_per_node} or sit differently under the "
            "switches")
        method = f"simulated all {D} replicas ({layout.devices} GPUs, {len(simulation.timeline.start)} items): {reason}"
    stashes = max(curve.peak for curve in simulation.timeline.memory("activations", "bytes"))
    return LayoutResult(layout, simulation, method, model.state_bytes(layout) + stashes)


def _replicas_alike(topology: Topology, replica_devices: int, replicas: int) -> bool:
    """Whether every replica owns whole nodes and sits under the switches as replica 0 does."""
    if replica_devices % topology.devices_per_node:
        return replicas == 1
    nodes = replica_devices // topology.devices_per_node
    per_switch = topology.nodes_per_switch
    return replicas == 1 or not per_switch or nodes % per_switch == 0 or per_switch % nodes == 0


# ---------------------------------------------------------------------- strategies
def tensor_parallel(pipeline: Strategy, tensor: int) -> Strategy:
    """``pipeline`` with each of its workers w made a gang of ``tensor``
    devices w T .. w T + T - 1 that computes its items jointly (and
    all-reduces their activations); its first device is the item's compute
    worker.  Priority, split backward and stage graph stay; memory limits and
    fixed orders move to the first devices."""
    T = tensor
    if T == 1:
        return pipeline
    if pipeline.weight_shards is not None:
        raise StrategyError(f"strategy {pipeline.name!r} holds weights in shards (weight_shards), which a "
                            f"tensor-parallel gang's items cannot take; lift a strategy that holds whole stages "
                            f"to TP {T}")
    shape = pipeline.shape
    W = shape[0] if shape is not None else None

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        compute, weight = pipeline.mapping(work)
        return ComputeAndWeightWorkers(int(compute) * T, int(weight) * T)

    def map_arrays(batch, stage, direction):
        compute, weight = pipeline.map_arrays(batch, stage, direction)
        return np.asarray(compute) * T, np.asarray(weight) * T

    def gang(work: Work) -> Gang:
        first = int(pipeline.mapping(work)[0]) * T
        return Gang(tuple(range(first, first + T)), True)

    def gang_arrays(batch, stage, direction):
        workers, index = np.unique(np.asarray(pipeline.map_arrays(batch, stage, direction)[0]), return_inverse=True)
        members = tuple(tuple(range(w * T, w * T + T)) for w in workers.tolist())
        return index.reshape(-1), members, (True,) * len(members)

    limit = pipeline.memory_limit
    if limit is not None and np.ndim(limit):
        limit = [float(v) for v in np.repeat(np.asarray(limit, dtype=float), T)]
    orders = pipeline.worker_orders
    return replace(
        pipeline, mapping=mapping, map_arrays=map_arrays if pipeline.map_arrays is not None else None, gang=gang,
        gang_arrays=gang_arrays if pipeline.map_arrays is not None else None,
        memory_limit=limit, shape=None if shape is None else Shape(W * T, shape[1], shape[2]),
        worker_orders=None if orders is None else _renumbered(orders, lambda w: w * T),
        name=f"{pipeline.name}, TP {T}",
    )


def replicated(strategy: Strategy, replicas: int) -> Strategy:
    """``replicas`` copies of ``strategy`` side by side: replica d runs
    micro-batches d B .. d B + B - 1 on workers d W .. d W + W - 1, each with
    its own copy of the weights (so the copies all-reduce their gradients;
    a stage held in shards is held so in every replica, shard by shard)."""
    W, S, B = strategy.shape

    def local(work: Work) -> tuple[int, Work]:
        return work.batch // B, Work(work.batch % B, work.stage, work.direction)

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        d, inner = local(work)
        compute, weight = strategy.mapping(inner)
        return ComputeAndWeightWorkers(int(compute) + d * W, int(weight) + d * W)

    def map_arrays(batch, stage, direction):
        compute, weight = strategy.map_arrays(batch % B, stage, direction)
        return np.asarray(compute) + batch // B * W, np.asarray(weight) + batch // B * W

    def gang(work: Work):
        d, inner = local(work)
        group = Gang.of(strategy.gang(inner))
        if group is None:
            return None
        return Gang(tuple(int(m) + d * W for m in group.workers), group.collective)

    def gang_arrays(batch, stage, direction):
        index, members, collective = strategy.gang_arrays(batch % B, stage, direction)
        index = np.asarray(index)
        shifted = tuple(tuple(int(m) + d * W for m in group) for d in range(replicas) for group in members)
        return np.where(index >= 0, batch // B * len(members) + index, -1), shifted, tuple(collective) * replicas

    def weight_shards(stage: int, weight: int):
        holders = strategy.weight_shards(stage, weight % W)
        return None if holders is None else tuple(int(h) + weight // W * W for h in holders)

    limit = strategy.memory_limit
    if limit is not None and np.ndim(limit):
        limit = [float(v) for v in np.tile(np.asarray(limit, dtype=float), replicas)]
    orders = strategy.worker_orders
    if orders is not None:  # replica d's workers run its micro-batches in replica 0's order
        columns = {w: order_columns(orders, w) for w in orders}
        shifted = {w + d * W: (batch + d * B, stage, direction) for d in range(replicas)
                   for w, (batch, stage, direction) in columns.items()}
        orders = (WorkerOrders.from_columns(Items(S, B * replicas, orders.numbering.split_backward), shifted)
                  if isinstance(orders, WorkerOrders) else {w: works(*c) for w, c in shifted.items()})
    return replace(
        strategy, mapping=mapping, map_arrays=map_arrays if strategy.map_arrays is not None else None,
        gang=gang if strategy.gang is not None else None, memory_limit=limit, worker_orders=orders,
        gang_arrays=gang_arrays if strategy.gang_arrays is not None else None,
        weight_shards=weight_shards if strategy.weight_shards is not None else None,
        priority=_PerReplica(as_priority(strategy.priority or OldestBatchFirst, S, B), B),
        shape=Shape(W * replicas, S, B * replicas), name=f"{strategy.name}, DP {replicas}",
    )


def _renumbered(orders, worker_of) -> WorkerOrders | dict:
    """``orders`` with worker w's order given to ``worker_of(w)``."""
    if isinstance(orders, WorkerOrders):
        return WorkerOrders(orders.numbering, {worker_of(w): ids for w, ids in orders.ids.items()})
    return {worker_of(w): list(order) for w, order in orders.items()}


class _PerReplica:
    """A priority over one replica's micro-batches, applied within each replica."""

    def __init__(self, priority, num_batches: int):
        self.priority, self.B = priority, num_batches
        keys = getattr(priority, "sort_keys", None)
        if keys is not None:
            self.sort_keys = lambda batch, stage, direction: keys(np.asarray(batch) % num_batches, stage, direction)

    def __call__(self, work: Work):
        return self.priority(Work(work.batch % self.B, work.stage, work.direction))


__all__ = ["Layout", "LayoutResult", "Model", "replicated", "simulate_layout", "tensor_parallel"]
