"""``simulate``: a strategy, a shape, costs and limits in; a Simulation out.

A :class:`Simulation` is a Timeline plus what produced it (strategy, costs,
memory limit, priority) and the lower bounds it can be compared with.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import networkx as nx
import numpy as np

from unisched.costs import DEFAULT_COSTS, Costs
from unisched import metrics
from unisched.errors import ShapeError, StrategyError
from unisched.simulate import engine, fast
from unisched.simulate.priorities import OldestBatchFirst, as_priority
from unisched.simulate.problem import build
from unisched.simulate.transfers import transfers
from unisched.strategy import Strategy, as_strategy
from unisched.timeline import Timeline
from unisched.work import Shape, StageGraph, Work, as_stage_graph, directions


def simulate(
    num_workers: int,
    num_stages: int,
    num_batches: int,
    schedule: Strategy | Callable[[Work], Any],
    priority: Callable[[Work], Any] | str | None = None,
    *,
    costs: Costs | None = None,
    memory_limit: float | Sequence[float] | None = None,
    split_backward: bool | None = None,
    stage_graph: nx.DiGraph | StageGraph | None = None,
    priority_order: Callable[[Work], Any] | str | None = None,
) -> "Simulation":
    """Run the reference greedy scheduler and return a :class:`Simulation`.

    ``schedule`` maps each ``Work`` to ``ComputeAndWeightWorkers``; a named
    :class:`~unisched.Strategy` also brings its own priority, memory limit,
    split backward and fixed orders, which the arguments here override (but
    for a priority given to a strategy that fixes every worker's order,
    which is refused: it would change nothing).
    ``priority`` is any callable ``Work -> sortable key``, or a built-in
    priority's class or name ("backward_first") (default
    :class:`OldestBatchFirst`), as a strategy's ``priority=`` parameter and
    the command's ``--priority`` take it; a strategy's own priority may be
    either too.  ``priority_order`` is its former name, still taken (with a
    DeprecationWarning).
    ``memory_limit`` caps the activations a worker may hold (stash units, or
    bytes when ``costs`` give ``activation_bytes``/``stash_bytes``), scalar
    or one per worker; a strategy's own limit always counts stashes.
    ``split_backward``: whether the backward runs as an input pass (I) and a
    weight pass (W); by default when the strategy splits it, or when the costs
    time its halves (``backward_input``/``backward_weight``, as ``plan``
    decides) and the strategy fixes no order of its own.
    """
    num_workers, num_stages, num_batches = shape = Shape(num_workers, num_stages, num_batches).check()
    strategy = as_strategy(schedule)
    strategy.check_shape(shape, "simulated")
    costs = costs if costs is not None else DEFAULT_COSTS
    if not isinstance(costs, Costs):
        raise TypeError(f"costs must be a unisched.Costs, got {type(costs).__name__}")
    if split_backward is not None and not isinstance(split_backward, (bool, np.bool_)):
        raise ShapeError(f"split_backward must be True, False or None (as the strategy and costs say), "
                         f"got {split_backward!r}")
    split = bool(split_backward) if split_backward is not None else strategy.split_backward or (
        costs.times_halves and strategy.worker_orders is None)
    check_size(shape, split)
    costs.check(num_workers, num_stages)
    priority = _renamed_priority(priority, priority_order)
    if priority is not None and strategy.worker_orders is not None:
        raise StrategyError(
            f"the priority {getattr(priority, '__name__', priority)!r} would change nothing: "
            f"{strategy.name or 'the strategy'} fixes every worker's order of work, and a priority only breaks the "
            "ties the simulator chooses; drop it (priority=, or the command's --priority)")
    priority = as_priority(priority or strategy.priority or OldestBatchFirst, num_stages, num_batches)
    limit = memory_limit if memory_limit is not None else strategy.memory_limit
    limit_in_bytes = costs.has_sizes and memory_limit is not None  # a strategy's own limit counts stashes
    graph = stage_graph if stage_graph is not None else strategy.stage_graph
    graph = as_stage_graph(num_stages, graph)

    problem = build(shape, strategy, priority, costs, limit, split, graph, limit_in_bytes, max_gathers=MAX_ITEMS)
    start, end, booked = _run(problem)
    timeline = Timeline(
        *shape,
        batch=problem.batch,
        stage=problem.stage,
        direction=problem.direction,
        worker=problem.worker_array,
        weight_worker=problem.weight_worker_array,
        start=start,
        end=end,
        transfers=transfers(problem, start, end, booked),
        activation_bytes=problem.activation_bytes,
        stash_bytes=problem.stash_bytes,
        weight_bytes=np.asarray(problem.weight_bytes),
        input_grad_frees=costs.input_grad_frees,
        split_backward=split,
        source="simulated",
        label=strategy.name,
        gang=problem.gang,
        gang_members=problem.gang_members,
        gang_collective=problem.gang_collective,
        stage_graph=graph,
        cache_weights=costs.cache_weights,
        costs=costs,
        limit_in_bytes=limit_in_bytes if limit is not None else costs.has_sizes,
        weight_shards=problem.weight_shards,
    )
    return Simulation(timeline, strategy, costs, limit, priority, graph)


MAX_ITEMS = 20_000_000
"""The most work items :func:`simulate` takes (about 350 bytes each on the
compiled path, twice that with communication costs: 7 to 14 GB at the ceiling).
Raise it on a machine with more memory."""


def check_size(shape: Shape, split_backward: bool = False) -> None:
    """Refuse, before allocating anything, a step too large to simulate in memory."""
    W, S, B = shape
    items = S * B * len(directions(split_backward))
    if items > MAX_ITEMS or W > MAX_ITEMS:
        what = f"{items:,} work items" if items > MAX_ITEMS else f"{W:,} workers"
        raise ShapeError(
            f"W={W}, S={S}, B={B} has {what}; the simulator takes at most {MAX_ITEMS:,} "
            "(MAX_ITEMS, about 350 bytes per item): simulate fewer micro-batches or stages (once the pipeline "
            "is full, every micro-batch adds the same time), or on a machine with the memory raise it: "
            "from unisched.simulate import simulation; simulation.MAX_ITEMS = ..."
        )


def _renamed_priority(priority, priority_order):
    """The priority given, under its name or its former one (``priority_order``, with a warning)."""
    if priority_order is None:
        return priority
    if priority is not None:
        raise TypeError("simulate() takes the priority once: give priority=, the name of priority_order")
    warnings.warn("simulate(priority_order=...) is now simulate(priority=...)", DeprecationWarning, stacklevel=3)
    return priority_order


def _run(problem):
    """The compiled greedy from :data:`fast.COMPILED_FROM` items on (and
    where numba is installed), else the general engine.

    The general engine also runs when the compiled one leaves items
    unscheduled, to explain the deadlock.  Either gives the transfers it
    booked as :class:`~unisched.simulate.transfers.Booked` columns."""
    if problem.num_items >= fast.COMPILED_FROM:
        compiled = fast.run(problem)
        if compiled is not None and compiled[0].min(initial=0.0) >= 0:
            return compiled
    start, end, booked = engine.run(problem)
    return np.asarray(start), np.asarray(end), booked


def shape_lower_bound(shape: Shape, costs: Costs = DEFAULT_COSTS, split_backward: bool = False,
                      stage_graph: StageGraph | None = None) -> float:
    """A bound no strategy can beat: max(all work / total speed, one batch's critical path)."""
    return max(shape_bounds(shape, costs, split_backward, stage_graph).values())


def shape_bounds(shape: Shape, costs: Costs = DEFAULT_COSTS, split_backward: bool = False,
                 stage_graph: StageGraph | None = None) -> dict[str, float]:
    """The terms of :func:`shape_lower_bound`: ``critical_path`` (one
    micro-batch through every stage and back, on the fastest worker; with a
    split backward, ending with a stage's W after its I) and ``work`` (all
    the work over the workers' total speed)."""
    W, S, B = shape
    durations = costs.durations(S)
    speeds = costs.speeds(W)
    passes = directions(split_backward)
    graph = as_stage_graph(S, stage_graph)
    paths = downstream_paths(graph, durations[passes[0]], durations[passes[1]])
    if split_backward:  # each stage's W follows its I: a path through s may end there
        paths = upstream_forwards(graph, durations[passes[0]]) + paths + durations[passes[2]]
    path = paths.max(initial=0.0) / speeds.max()
    work = B * sum(durations[d] for d in passes).sum() / speeds.sum()
    return {"critical_path": float(path), "work": float(work)}


def downstream_paths(graph: StageGraph, forward: np.ndarray, backward: np.ndarray) -> np.ndarray:
    """Per stage s: the longest path of one micro-batch from F(s) through the
    forwards of the stages downstream of s and back through their backwards
    to the end of s's backward.  Its maximum (at a source) is the batch's
    critical path; it is also the least time a stash of s is held."""
    longest = np.zeros(graph.num_stages)
    for s in reversed(list(nx.topological_sort(graph.graph))):
        longest[s] = forward[s] + backward[s] + max((longest[t] for t in graph.successors[s]), default=0.0)
    return longest


def upstream_forwards(graph: StageGraph, forward: np.ndarray) -> np.ndarray:
    """Per stage s: the longest path of one micro-batch's forwards from a source to F(s)'s start
    (of ``forward``'s dtype)."""
    longest = np.zeros(graph.num_stages, dtype=np.asarray(forward).dtype)
    for s in nx.topological_sort(graph.graph):
        longest[s] = max((longest[p] + forward[p] for p in graph.predecessors[s]), default=0.0)
    return longest


class Simulation:
    """The result of :func:`simulate`: a Timeline and how it came about."""

    def __init__(self, timeline: Timeline, strategy: Strategy, costs: Costs, memory_limit, priority, stage_graph):
        self.timeline = timeline
        self.strategy = strategy
        self.costs = costs
        self.memory_limit = memory_limit
        self.priority = priority
        self.stage_graph = stage_graph

    # the Timeline's measures, at hand
    @property
    def shape(self) -> Shape:
        return self.timeline.shape

    @property
    def latency(self) -> float:
        return self.timeline.latency

    @property
    def throughput(self) -> float:
        return self.timeline.throughput

    batch_throughput = throughput
    """The same rate as :attr:`throughput` (an earlier name)."""

    @property
    def bubble_fraction(self) -> float:
        return self.timeline.bubble_fraction

    @property
    def transfers(self):
        return self.timeline.transfers

    @property
    def memory(self):
        """Per-worker total memory in bytes over time (``timeline.memory(...)`` for more)."""
        return self.timeline.memory()

    def worker_stats(self) -> dict[str, list]:
        return self.timeline.worker_stats()

    @property
    def lower_bounds(self) -> dict[str, float]:
        """Each bound this run can be measured against."""
        shape_bound = shape_lower_bound(self.shape, self.costs, self.timeline.split_backward, self.stage_graph)
        return {
            "shape": shape_bound,
            "busiest_worker": float(self.timeline.busy_time.max(initial=0.0)),
        }

    @property
    def lower_bound(self) -> float:
        """The best of :attr:`lower_bounds`: no schedule with this mapping can be shorter."""
        return max(self.lower_bounds.values())

    @property
    def gap(self) -> float:
        """How far the latency is above the lower bound, as a fraction of the bound."""
        return metrics.gap(self.latency, self.lower_bound)

    def summary(self) -> str:
        stats = self.worker_stats()
        lines = [
            f"{self.strategy.name}: W={self.shape.num_workers} S={self.shape.num_stages} B={self.shape.num_batches}",
            f"  latency {self.latency:g} ({metrics.above(self.latency, self.lower_bounds['shape'])} "
            f"{self.lower_bounds['shape']:g}, the shape's lower bound; this run's own {self.lower_bound:g})",
            f"  throughput {self.throughput:.4g} micro-batches/time, bubble {self.bubble_fraction:.1%}",
            f"  peak activations per worker {_compact(stats['max_activation_storage'])}",
            f"  weight fetches per worker {_compact(stats['weight_transmissions'])}",
            f"  weight storage per worker {_compact(stats['weight_storage'])}",
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"<Simulation {self.strategy.name} W={self.shape.num_workers} S={self.shape.num_stages} "
            f"B={self.shape.num_batches}: latency {self.latency:g}, {self.throughput:.4g} micro-batches/time, "
            f"bubble {self.bubble_fraction:.1%}>"
        )

    # drawing goes through the Timeline
    def _repr_html_(self) -> str:
        return self.timeline.to_html()

    def to_text(self, width: int = 100, color: bool | None = None, **options) -> str:
        return self.timeline.to_text(width=width, color=color, **options)

    def to_html(self, **options) -> str:
        return self.timeline.to_html(**options)

    def to_chrome_trace(self, time_unit: str | float = "s") -> dict:
        return self.timeline.to_chrome_trace(time_unit=time_unit)

    def figure(self, **options):
        return self.timeline.figure(**options)

    def save(self, path, **options) -> None:
        self.timeline.save(path, **options)


def _compact(values: list) -> str:
    if len(values) > 16:
        return f"min {min(values)}, max {max(values)} over {len(values)} workers"
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)
