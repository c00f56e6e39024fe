"""What the planner is asked: a shape, costs and limits, and the integer form
of its times that CP-SAT works in.

Communication flags are encoded into the simulator's :class:`~unisched.Costs`
so that the simulator's replay of a plan and the CP-SAT model agree:

- ``--comm T``: every activation, gradient or stash that changes worker takes
  ``T`` (``latency = T``, zero activation bytes, so activations do not occupy
  the link and memory limits stay in activation units);
- ``--fetch T``: a stage's weights reach a worker that is not their weight
  worker ``T`` after the step starts (``weight_bytes = T - comm`` at bandwidth
  1, ``prefetch_depth`` large enough that every fetch is issued at time 0,
  cached for the step); the accumulated gradient goes back in ``T`` after the
  worker's last backward of that stage.

The one thing the model leaves out is contention on a link (a fetch and an
activation queueing on the same pair of workers); the latency a plan reports
is always the simulator's replay, which includes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import NamedTuple, Sequence

import numpy as np

from unisched import dataflow
from unisched.costs import Costs, Link
from unisched.errors import ShapeError
from unisched.network import transfer_matrix, transfer_time
from unisched.timeline import TRANSFER_KINDS
from unisched.work import Direction, Shape, StageGraph, chain

PREFETCH_AT_START = 1_000_000
"""A prefetch depth no step reaches: every weight fetch is issued at time 0."""


class PlanInputError(ShapeError):
    """A planning problem that cannot be solved as asked (limits too tight, bad flags)."""


def encode_costs(
    *,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 2.0,
    backward_input: float | Sequence[float] | None = None,
    backward_weight: float | Sequence[float] | None = None,
    comm: float = 0.0,
    fetch: float = 0.0,
    base: Costs | None = None,
) -> Costs:
    """The simulator's Costs for the planner's flags (see the module docstring)."""
    if comm < 0 or fetch < 0:
        raise PlanInputError(f"--comm and --fetch must be >= 0, got comm={comm:g}, fetch={fetch:g}")
    if base is not None:
        return base
    if fetch and fetch < comm:
        raise PlanInputError(
            f"--fetch {fetch:g} is shorter than --comm {comm:g}; the simulator's link model (latency plus size "
            "over bandwidth) cannot make a weight fetch faster than an activation transfer: give --fetch >= --comm "
            "or a costs file"
        )
    return Costs(
        forward=forward,
        backward=backward,
        backward_input=backward_input,
        backward_weight=backward_weight,
        latency=float(comm),
        bandwidth=1.0 if fetch else math.inf,
        activation_bytes=0.0,
        weight_bytes=float(fetch - comm) if fetch else 0.0,
        prefetch_depth=PREFETCH_AT_START,
        cache_weights=True,
    )


@dataclass(frozen=True)
class PlanProblem:
    """One planning question: shape, costs and the limits a plan must respect.

    ``memory_limit`` is in activation units (stashes), or in bytes when the
    costs give ``activation_bytes``, as in :func:`unisched.simulate`.
    ``max_stages_per_worker`` caps how many stages' weights a worker holds:
    those it is weight worker of plus those it fetches to compute.
    """

    shape: Shape
    costs: Costs = field(default_factory=Costs)
    memory_limit: float | None = None
    max_stages_per_worker: int | None = None
    split_backward: bool = False

    def __post_init__(self):
        Shape(*self.shape).check()
        object.__setattr__(self, "shape", Shape(*self.shape))
        object.__setattr__(self, "costs", _infinite_links(self.costs))
        if self.memory_limit is not None and (isinstance(self.memory_limit, bool)
                                              or not isinstance(self.memory_limit, (int, float, np.number))):
            raise PlanInputError(
                f"the planner takes one memory limit for every worker, got {self.memory_limit!r}; give a number"
            )
        if self.memory_limit is not None and not (self.memory_limit >= 0 and math.isfinite(self.memory_limit)):
            raise PlanInputError(f"--memory-limit must be a non-negative number, got {self.memory_limit!r}")
        K = self.max_stages_per_worker
        if K is not None and (isinstance(K, bool) or not isinstance(K, (int, np.integer)) or K < 1):
            raise PlanInputError(f"--max-stages-per-worker must be a positive integer, got {K!r}")
        self.check_feasible()

    # ------------------------------------------------------------------ items
    @property
    def items(self) -> dataflow.Items:
        """The step's work items and their ids (the encoding every layer shares)."""
        W, S, B = self.shape
        return dataflow.Items(S, B, self.split_backward)

    @property
    def stage_graph(self) -> StageGraph:
        """The planner plans chains: its bounds (critical path, live times) and
        its symmetry breaking (stage 0 starts every micro-batch) assume one."""
        return chain(self.shape.num_stages)

    @property
    def dirs(self) -> tuple[Direction, ...]:
        return self.items.dirs

    @property
    def num_items(self) -> int:
        return self.items.count

    def item_grid(self) -> np.ndarray:
        """A (B, S, D) array: the id of Work(b, s, dirs[k]) at [b, s, k]."""
        W, S, B = self.shape
        items = self.items
        return items.id(np.arange(B)[:, None, None], np.arange(S)[None, :, None],
                        np.asarray(items.dirs, dtype=np.int64)[None, None, :])

    @property
    def stash_sizes(self) -> np.ndarray:
        """Memory one stash of each stage takes, in the unit of ``memory_limit``."""
        S = self.shape.num_stages
        return self.costs.per_stage("stash_bytes", S) if self.costs.has_sizes else np.ones(S)

    # ------------------------------------------------------------------ feasibility
    def check_feasible(self) -> None:
        """Reject limits no mapping can meet, saying the least that would do."""
        W, S, B = self.shape
        K = self.max_stages_per_worker
        if K is not None and K * W < S:
            need = -(-S // W)
            raise PlanInputError(
                f"infeasible: {W} workers holding at most {K} stage(s) each cannot hold {S} stages; "
                f"--max-stages-per-worker needs at least {need}"
            )
        if self.memory_limit is None:
            return
        need = self.min_memory_free()
        if self.memory_limit + 1e-9 < need:
            raise PlanInputError(
                f"infeasible: memory limit {self.memory_limit:g} is too small; every micro-batch holds all its "
                f"{S} stashes at once after its last forward, so some worker needs at least {need:g}; "
                f"raise --memory-limit to {need:g} or more"
            )

    def min_memory_free(self) -> float:
        """The least memory limit any mapping can run with.

        After the last forward of a micro-batch, all its stashes are live; at
        best they are spread over the workers a stage at a time (each worker
        taking at most ``max_stages_per_worker`` stages).
        """
        W, S, B = self.shape
        sizes = np.sort(self.stash_sizes)[::-1]
        per_worker = -(-S // W)
        return float(max(sizes[:per_worker].sum(), sizes.max()))

    def min_memory_mapped(self, compute: np.ndarray) -> tuple[float, int]:
        """The least memory limit a fixed mapping runs with, and the worker that needs it:
        the most stashes of one micro-batch kept on one worker."""
        batch, stage, direction = self.items.arrays()
        keep = direction == dataflow.first_backward(self.split_backward)
        sizes = self.stash_sizes
        W, S, B = self.shape
        table = np.zeros((B, W))
        np.add.at(table, (batch[keep], compute[keep]), sizes[stage[keep]])
        worst = np.unravel_index(np.argmax(table), table.shape)
        return float(table.max()), int(worst[1])


def _infinite_links(costs: Costs) -> Costs:
    """A link written with ``"bandwidth": null`` (as JSON writes infinity) means infinite bandwidth,
    as the top-level ``bandwidth`` does in a costs file."""
    links = dict(costs.links)
    if not any(link.bandwidth is None for link in links.values()):
        return costs
    for pair, link in links.items():
        if link.bandwidth is None:
            links[pair] = Link(link.latency, math.inf)
    return replace(costs, links=links)


@dataclass(frozen=True)
class Ticks:
    """CP-SAT works on integers: times are multiplied by ``scale`` and rounded.

    The scale is the smallest that makes every given time a whole number (up
    to a resolution of 1/1000 of the shortest time); plans always report the
    simulator's replay in the original unit.
    """

    scale: int

    @classmethod
    def for_times(cls, times: Sequence[float]) -> "Ticks":
        positive = [float(t) for t in times if t > 0]
        if not positive:
            return cls(1)
        scale = 1
        for t in positive:
            fraction = Fraction(t).limit_denominator(1000)
            if abs(float(fraction) - t) > 1e-9 * max(1.0, t):
                return cls(max(1, int(round(1000 / min(positive)))))
            scale = scale * fraction.denominator // math.gcd(scale, fraction.denominator)
        return cls(min(scale, 10**6))

    def __call__(self, time: float) -> int:
        return int(round(float(time) * self.scale))

    def time(self, ticks: float) -> float:
        return float(ticks) / self.scale


class DataEdges(NamedTuple):
    """Every dependency between items, as parallel arrays (see :func:`unisched.dataflow.edges`)."""

    src: np.ndarray
    dst: np.ndarray
    stage: np.ndarray
    """The stage whose activation, gradient or stash moves when src and dst run on different workers."""
    moves: np.ndarray
    """What moves: an index into ``unisched.timeline.TRANSFER_KINDS`` (or ``dataflow.MOVES_NOTHING``)."""
    table: np.ndarray
    """The (4, E) array of :func:`unisched.dataflow.edges` they come from."""


@dataclass(frozen=True)
class TimedProblem:
    """Everything the CP-SAT models need, in ticks, per item, worker and stage.

    Transfer times come from :mod:`unisched.network`, as in the simulator."""

    problem: PlanProblem
    ticks: Ticks
    duration: np.ndarray  # (items, workers)
    comm: np.ndarray  # (src worker, dst worker, stage): activation/gradient of that stage
    fetch: np.ndarray  # (owner, worker, stage): weights to a borrowing worker, or gradient back
    stash: np.ndarray  # (src worker, dst worker, stage): a stash that follows its backward elsewhere (its inputs)
    batch: np.ndarray
    stage: np.ndarray
    direction: np.ndarray

    @classmethod
    def build(cls, problem: PlanProblem) -> "TimedProblem":
        W, S, B = problem.shape
        costs = problem.costs
        batch, stage, direction = problem.items.arrays()
        seconds = costs.item_time(stage[:, None], direction[:, None], np.arange(W)[None, :], S, W)
        comm = transfer_matrix(costs, W, costs.per_stage("activation_bytes", S))
        fetch = transfer_matrix(costs, W, costs.per_stage("weight_bytes", S))
        stash = transfer_matrix(costs, W, dataflow.input_bytes(costs.per_stage("activation_bytes", S), problem.stage_graph))
        ticks = Ticks.for_times(np.concatenate([seconds.ravel(), comm.ravel(), fetch.ravel(), stash.ravel()]))
        to_ticks = np.vectorize(ticks, otypes=[np.int64])
        return cls(problem, ticks, to_ticks(seconds), to_ticks(comm), to_ticks(fetch), to_ticks(stash),
                   batch, stage, direction)

    @property
    def shape(self) -> Shape:
        return self.problem.shape

    def data_edges(self) -> DataEdges:
        """Every dependency of the step, from :func:`unisched.dataflow.edges` over the problem's stage graph."""
        table = dataflow.edges(self.problem.items, self.problem.stage_graph)
        src, dst, _, moves = table
        return DataEdges(src, dst, dataflow.moved_stage(self.stage[src], self.stage[dst], moves), moves, table)

    def delays(self, edges: DataEdges, compute: np.ndarray) -> np.ndarray:
        """Ticks each edge's data takes to reach its destination's worker (0 on
        the same worker, or when it carries nothing: :func:`unisched.dataflow.moved_data`)."""
        problem = self.problem
        a, b = compute[edges.src], compute[edges.dst]
        act = problem.costs.per_stage("activation_bytes", problem.shape.num_stages)
        codes, nbytes = dataflow.moved_data(problem.items, problem.stage_graph, edges.table, compute, act)
        delay = np.where(codes == TRANSFER_KINDS.index("stash"), self.stash[a, b, edges.stage], self.comm[a, b, edges.stage])
        delay[codes == dataflow.MOVES_NOTHING] = 0
        # a weight pass away from its input pass may also need the output gradient
        for e in np.flatnonzero((codes == TRANSFER_KINDS.index("stash")) & (a != b)
                                & (self.direction[edges.dst] == Direction.BACKWARD_WEIGHT)).tolist():
            delay[e] = self.ticks(transfer_time(problem.costs, int(a[e]), int(b[e]), float(nbytes[e])))
        return delay
