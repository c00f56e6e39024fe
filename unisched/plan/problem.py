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

A weight fetch is a transfer like any other: it pays the link's latency, so
``--comm T`` alone makes a fetch (and a gradient return) take ``T`` too;
``--fetch`` makes them longer, never shorter.

The one thing the model leaves out is contention on a link (a fetch and an
activation queueing on the same pair of workers); the latency a plan reports
is always the simulator's replay, which includes it.

On a cluster topology (:class:`unisched.topology.ClusterCosts`) the tables
hold each pair of workers' own transfer time, ``latency + bytes /
bandwidth`` of its route's bottleneck (:func:`unisched.network.transfer_matrix`),
still without contention: a transfer never waits for a NIC or an NVLink port
that another transfer holds, which the replay books.

Memory is limited two ways, both per worker (one number for all, or a list):
``memory_limit`` caps the stashed activations, as :func:`unisched.simulate`
does; ``memory_budget`` caps everything a worker holds, in bytes: the weights
it is weight worker of (with their ``optimizer_bytes``), the weights it
fetches to compute (kept for the step), and its stashes.  A budget leaves
each worker the stash limit :meth:`PlanProblem.stash_limits` says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from fractions import Fraction
from typing import NamedTuple, Sequence

import numpy as np

from unisched import dataflow
from unisched.costs import Costs, Link
from unisched.errors import ShapeError
from unisched.network import allreduce_time, link_arrays, transfer_matrix, transfer_time
from unisched.simulate.problem import map_workers
from unisched.strategy import Strategy
from unisched.timeline import TRANSFER_KINDS
from unisched.work import Direction, Shape, StageGraph, chain, is_whole

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
        raise PlanInputError(f"comm and fetch (--comm, --fetch) must be >= 0, got comm={comm:g}, fetch={fetch:g}")
    if base is not None:
        return base
    if fetch and fetch < comm:
        raise PlanInputError(
            f"fetch {fetch:g} is shorter than comm {comm:g} (--fetch, --comm); the simulator's link model (latency "
            "plus size over bandwidth) cannot make a weight fetch faster than an activation transfer: give fetch >= comm "
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


OBJECTIVES = ("latency", "span")
"""What a plan minimizes: the step's latency (first item to the last gradient
return), or the longest busy span of one worker (its first item's start to its
last item's end), which is what repeats when steps follow each other with the
optimizer step overlapped (the zero-bubble paper's measure)."""


def split_from(costs: Costs, split_backward: bool | None) -> bool:
    """Whether a step splits its backward: when asked, or when the costs give
    an input- or weight-gradient time.  Asking for a split without those times
    is a contradiction (the halves would be guesses), refused."""
    given = costs.times_halves
    if split_backward and not given:
        raise PlanInputError(
            "a split backward was asked for but the costs give no backward_input or backward_weight time: give "
            "backward_input and backward_weight (--backward-input and --backward-weight, or those fields of the costs "
            "file), or do not split"
        )
    return bool(split_backward) or given


MAX_PLAN_ITEMS = 20_000
"""The most work items :func:`plan` takes: its CP-SAT models have a few
variables per item and worker, and its family search simulates dozens of
strategies.  Larger steps are for :func:`unisched.simulate` and ``unisched compare``."""
MAX_PLAN_CELLS = 4_000_000
"""The most entries of the planner's per-item-and-worker and per-link-and-stage tables."""
MAX_SEARCH_ITEMS = 200_000
"""The most work items the heuristic search (:mod:`unisched.plan.search`) takes."""
MAX_SEARCH_CELLS = 40_000_000
"""The most entries of the heuristic search's per-item-and-worker tables."""
def check_time_limit(time_limit) -> None:
    """Refuse a time limit that is not a positive, finite number of seconds."""
    if (isinstance(time_limit, bool) or not isinstance(time_limit, (int, float, np.number))
            or not 0 < time_limit < math.inf):
        raise PlanInputError(f"time_limit must be a positive number of seconds, got {time_limit!r}")


def check_plan_size(shape: Shape, split_backward: bool = False, heuristic: bool = False) -> None:
    """Refuse, before building anything, a step too large to plan (with the
    CP-SAT planner, or with the heuristic search when ``heuristic``)."""
    W, S, B = shape
    items = dataflow.Items(S, B, split_backward).count
    cells = max(items * W, W * W * S)
    most_items, most_cells = (MAX_SEARCH_ITEMS, MAX_SEARCH_CELLS) if heuristic else (MAX_PLAN_ITEMS, MAX_PLAN_CELLS)
    names = ("MAX_SEARCH_ITEMS", "MAX_SEARCH_CELLS") if heuristic else ("MAX_PLAN_ITEMS", "MAX_PLAN_CELLS")
    if items > most_items or cells > most_cells:
        what = (f"{items:,} work items (at most {most_items:,}, unisched.plan.problem.{names[0]}"
                + (f"; the CP-SAT models take {MAX_PLAN_ITEMS:,}, MAX_PLAN_ITEMS" if heuristic else "") + ")"
                if items > most_items else
                f"{cells:,} table entries of items or links by workers (at most {most_cells:,}, "
                f"unisched.plan.problem.{names[1]})")
        raise PlanInputError(
            f"W={W}, S={S}, B={B} is too large to plan: {what}. Plan fewer micro-batches (a schedule found for "
            "a few times W micro-batches shows the pattern), or compare strategies on this shape with "
            "`unisched compare`"
        )


@dataclass(frozen=True)
class PlanProblem:
    """One planning question: shape, costs and the limits a plan must respect.

    ``memory_limit`` caps each worker's stashes, in activation units or in
    bytes when the costs give ``activation_bytes``, as in
    :func:`unisched.simulate` (one number, or one per worker);
    ``memory_budget`` caps each worker's bytes of weights, optimizer state
    (``optimizer_bytes`` per stage, held by a stage's weight workers) and
    stashes.  ``max_stages_per_worker`` caps how many stages' weights a worker
    holds: those it is weight worker of plus those it fetches to compute.
    ``objective`` is one of :data:`OBJECTIVES`.
    """

    shape: Shape
    costs: Costs = field(default_factory=Costs)
    memory_limit: float | tuple[float, ...] | None = None
    max_stages_per_worker: int | None = None
    split_backward: bool = False
    memory_budget: float | tuple[float, ...] | None = None
    optimizer_bytes: float | tuple[float, ...] = 0.0
    objective: str = "latency"

    def __post_init__(self):
        object.__setattr__(self, "shape", Shape(*self.shape).check())
        object.__setattr__(self, "costs", _infinite_links(self.costs))
        W, S = self.shape.num_workers, self.shape.num_stages
        object.__setattr__(self, "memory_limit", _per_worker("memory_limit", self.memory_limit, W))
        object.__setattr__(self, "memory_budget", _per_worker("memory_budget", self.memory_budget, W))
        optimizer = _per_worker("optimizer_bytes", self.optimizer_bytes, S, what="stage")
        object.__setattr__(self, "optimizer_bytes", 0.0 if optimizer is None else optimizer)
        K = self.max_stages_per_worker
        if K is not None and not is_whole(K):
            raise PlanInputError(f"max_stages_per_worker (--max-stages-per-worker) must be a positive integer, got {K!r}")
        if self.objective not in OBJECTIVES:
            raise PlanInputError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        self.check_feasible()

    # ------------------------------------------------------------------ items
    @property
    def memory_limited(self) -> bool:
        """Whether a stash limit or a memory budget bounds the plan."""
        return self.memory_limit is not None or self.memory_budget is not None

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

    # ------------------------------------------------------------------ memory per worker
    def limits(self) -> np.ndarray:
        """Each worker's stash limit (``inf`` where none)."""
        W = self.shape.num_workers
        return np.full(W, np.inf) if self.memory_limit is None else np.broadcast_to(
            np.asarray(self.memory_limit, dtype=float), (W,)).copy()

    @property
    def identical_workers(self) -> bool:
        """Whether every worker is alike (same speed, links, limits): workers can then be relabelled."""
        return (self.costs.worker_speed is None and self.links_alike
                and np.ndim(self.memory_limit) == 0 and np.ndim(self.memory_budget) == 0)

    @property
    def links_alike(self) -> bool:
        """Whether every pair of workers has the same latency and bandwidth, so that a transfer or
        a collective takes as long among any workers."""
        return not self.costs.links and _one_link_time(self.costs, self.shape.num_workers)

    def weight_bytes(self) -> np.ndarray:
        """Per stage: the bytes of its weights a worker holds (owned or fetched)."""
        return self.costs.per_stage("weight_bytes", self.shape.num_stages)

    def owner_bytes(self) -> np.ndarray:
        """Per stage: its weights and their optimizer state (what its weight worker keeps)."""
        return self.weight_bytes() + np.broadcast_to(np.asarray(self.optimizer_bytes, dtype=float),
                                                     (self.shape.num_stages,))

    def owned_need(self) -> np.ndarray:
        """Per stage: the bytes its weight worker holds for it through the step (its weights,
        their gradient and optimizer state), as :meth:`weight_need` counts an owned stage."""
        return self.owner_bytes() + self.weight_bytes()

    def weight_need(self, compute: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """Per worker: the most bytes of weights, their gradients and optimizer state a mapping
        has it hold at once, as :mod:`unisched.memory` counts them, taken for the whole step:
        a stage it holds (owned or fetched) twice (its weights and their gradient), an owned
        stage's optimizer state, and a buffer per worker that returns it a gradient."""
        W, S, B = self.shape
        _, stage, _ = self.items.arrays()
        owned = np.zeros((W, S), dtype=bool)
        owned[np.asarray(weight), stage] = True
        held = owned.copy()
        held[np.asarray(compute), stage] = True
        borrowers = (held & ~owned).sum(axis=0)
        weights = self.weight_bytes()
        return held @ (2 * weights) + owned @ (self.owner_bytes() - weights + borrowers * weights)

    def stash_limits(self, compute: np.ndarray, weight: np.ndarray):
        """The per-worker stash limits a mapping runs under (what :func:`unisched.simulate` takes):
        ``memory_limit``, and with a budget what the mapping's weights leave of it.  None: no limit.
        Raises :class:`PlanInputError` naming the worker whose weights alone exceed its budget."""
        if self.memory_budget is None:
            return self.memory_limit
        budget = np.broadcast_to(np.asarray(self.memory_budget, dtype=float), (self.shape.num_workers,))
        need = self.weight_need(compute, weight)
        worst = int(np.argmax(need - budget))
        if need[worst] > budget[worst] + 1e-9:
            raise PlanInputError(
                f"infeasible: worker {worst} holds {need[worst]:.4g} bytes of weights and optimizer state, more "
                f"than its memory budget of {budget[worst]:.4g}: hold fewer stages there, or raise the budget"
            )
        limits = self.limits()
        if self.costs.has_sizes:
            limits = np.minimum(limits, budget - need)
        if np.all(np.isinf(limits)):
            return None
        return float(limits[0]) if np.all(limits == limits[0]) else tuple(float(v) for v in limits)

    # ------------------------------------------------------------------ feasibility
    def check_feasible(self) -> None:
        """Reject limits no mapping can meet, saying the least that would do."""
        W, S, B = self.shape
        K = self.max_stages_per_worker
        if K is not None and K * W < S:
            need = -(-S // W)
            raise PlanInputError(
                f"infeasible: {W} workers holding at most {K} stage(s) each cannot hold {S} stages; "
                f"raise max_stages_per_worker (--max-stages-per-worker) to at least {need}"
            )
        self._check_budget()
        if self.memory_limit is None:
            return
        need = self.min_memory_free()
        most = float(self.limits().max())
        if most + 1e-9 < need:
            raise PlanInputError(
                f"infeasible: memory limit {most:g} is too small; every micro-batch holds all its "
                f"{S} stashes at once after its last forward, so some worker needs at least {need:g}; "
                f"raise memory_limit (--memory-limit) to {need:g} or more"
            )
        every = float(self.stash_sizes.sum())
        together = float(self.limits().sum())
        if together + 1e-9 < every:
            raise PlanInputError(
                f"infeasible: the workers' memory limits add up to {together:g}, but every micro-batch holds all its "
                f"{S} stashes at once after its last forward ({every:g} in all); raise the limits (--memory-limit) "
                "so that they add up to that much"
            )

    def _check_budget(self) -> None:
        """A budget must hold every stage's weights and optimizer state somewhere, and its stash."""
        if self.memory_budget is None:
            return
        budget = np.broadcast_to(np.asarray(self.memory_budget, dtype=float), (self.shape.num_workers,))
        owner = self.owned_need()
        stash = self.stash_sizes if self.costs.has_sizes else np.zeros_like(owner)
        if not np.any(owner > 0) and not np.any(stash > 0):
            raise PlanInputError(
                "a memory budget counts bytes, but the costs give no sizes: give each stage's weight_bytes and "
                "activation_bytes (or stash_bytes) in the costs (the command: --costs FILE)"
            )
        s = int(np.argmax(owner + stash))
        if owner[s] + stash[s] > budget.max() + 1e-9:
            raise PlanInputError(
                f"infeasible: no worker's memory budget (at most {budget.max():.4g} bytes) holds stage {s}'s "
                f"weights, their gradient and optimizer state and one stash ({owner[s] + stash[s]:.4g} bytes): raise "
                "the memory budget or split the model into more stages"
            )
        if owner.sum() > budget.sum() + 1e-9:
            raise PlanInputError(
                f"infeasible: the stages' weights, gradients and optimizer state take {owner.sum():.4g} bytes, more "
                f"than the workers' memory budgets together ({budget.sum():.4g}): raise the memory budget or use more "
                "workers"
            )
        if owner.sum() + stash.sum() > budget.sum() + 1e-9:
            raise PlanInputError(
                f"infeasible: the stages' weights, gradients and optimizer state ({owner.sum():.4g} bytes) and the "
                f"stashes one micro-batch holds at once after its last forward ({stash.sum():.4g}) take more than the "
                f"workers' memory budgets together ({budget.sum():.4g}): raise the memory budget or use more workers"
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

    def stash_workers(self, share: float = 1.0) -> int:
        """The fewest workers that hold ``share`` of every stash of one micro-batch at once, each
        within its own room (its stash limit, or its budget)."""
        W = self.shape.num_workers
        rooms = self.limits()
        if self.memory_budget is not None and self.costs.has_sizes:
            rooms = np.minimum(rooms, np.broadcast_to(np.asarray(self.memory_budget, dtype=float), (W,)))
        reach = np.cumsum(np.sort(rooms)[::-1])
        return int(min(W, np.searchsorted(reach, float(self.stash_sizes.sum()) * share * (1 - 1e-9)) + 1))

    def first_backward_workers(self) -> int:
        """The fewest workers a micro-batch's first backward passes (B, or I) can run on: when its
        last forward starts every stash of it is live, each on the worker of the pass that frees
        it, so the shares the first backward passes free need :meth:`stash_workers` of them."""
        first = dataflow.first_backward(self.split_backward)
        return self.stash_workers(dataflow.stash_shares(self.split_backward, self.costs.input_grad_frees)[first])

    def stash_need(self, compute: np.ndarray) -> np.ndarray:
        """Per worker: the most stash one micro-batch keeps there under the mapping ``compute``,
        the least stash limit that worker runs with."""
        batch, stage, direction = self.items.arrays()
        shares = dataflow.stash_share_array(direction, self.split_backward, self.costs.input_grad_frees)
        W, S, B = self.shape
        table = np.zeros((B, W))
        keep = shares > 0
        np.add.at(table, (batch[keep], np.asarray(compute)[keep]), (self.stash_sizes[stage] * shares)[keep])
        return table.max(axis=0)

    def min_memory_mapped(self, compute: np.ndarray, limits=None) -> tuple[float, int]:
        """How far a fixed mapping is from fitting: (the most stash of one micro-batch on one worker,
        that worker), the worker with the least room under ``limits`` (default ``memory_limit``)."""
        most = self.stash_need(compute)
        limits = self.limits() if limits is None else np.broadcast_to(np.asarray(limits, dtype=float), most.shape)
        worst = int(np.argmax(most - limits)) if np.any(np.isfinite(limits)) else int(np.argmax(most))
        return float(most[worst]), worst


def rows_of(problem: PlanProblem, t) -> np.ndarray:
    """Timeline row of each of the problem's item ids."""
    rows = np.empty(problem.num_items, dtype=np.int64)
    rows[problem.items.id(t.batch, t.stage, t.direction)] = np.arange(len(t))
    return rows


def mapping_of(problem: PlanProblem, strategy: Strategy) -> tuple[np.ndarray, np.ndarray]:
    """Every item's compute and weight worker under ``strategy``, in the
    problem's item order: the simulator's mapping, checked as it checks it, with each
    worker holding a replica of a stage computing it with its own copy
    (:func:`unisched.dataflow.own_copies`; plans hold no shards or gangs)."""
    batch, stage, direction = problem.items.arrays()
    compute, weight = map_workers(strategy, problem.shape, batch, stage, direction)
    return compute, dataflow.own_copies(stage, compute, weight, problem.shape.num_stages)


def _one_link_time(costs: Costs, num_workers: int) -> bool:
    """Whether every pair of workers has the same latency and bandwidth (on a topology:
    whether they all sit in one node, or in nodes alike, a pair apart by the same route)."""
    if getattr(costs, "topology", None) is None:
        return True
    off = ~np.eye(num_workers, dtype=bool)
    return all(np.all(a[off] == a[off][:1]) for a in link_arrays(costs, num_workers))


def _per_worker(name: str, value, count: int, what: str = "worker"):
    """A number, or one per worker (stage), non-negative and finite; a list whose entries are all
    equal is one number, any other a tuple."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        numbers = None
    else:
        try:
            nested = np.ndim(value) > 1  # [[1, 2]] is no list of numbers
            numbers = [value] if np.ndim(value) == 0 else list(np.asarray(value, dtype=object).ravel())
        except ValueError:  # ragged nesting
            nested = True
        if nested:
            numbers = None
    if numbers is None or not all(isinstance(v, (int, float, np.number)) and not isinstance(v, (bool, np.bool_))
                                  for v in numbers):
        raise PlanInputError(f"{name} must be a number or a list of numbers, one per {what}, got {value!r}")
    if not all(v >= 0 and math.isfinite(v) for v in numbers):
        raise PlanInputError(f"{name} must be non-negative finite numbers, got {value!r}")
    if np.ndim(value) == 0:
        return float(value)
    if len(numbers) != count:
        raise PlanInputError(f"{name} gives {len(numbers)} values but there are {count} {what}s: give one per {what}")
    return float(numbers[0]) if len(set(numbers)) == 1 else tuple(float(v) for v in numbers)


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
    simulator's replay in the original unit.  The planner's tables (W x W x S
    transfer times: 98,304 values for W = S = 32) repeat a few distinct times,
    so both the scale and a table's ticks are worked out once per distinct time.
    """

    scale: int

    @classmethod
    def for_times(cls, times: Sequence[float]) -> "Ticks":
        """The scale for every time in ``times`` (any shape), reading each distinct time once."""
        values = np.unique(np.asarray(times, dtype=float).ravel())
        positive = [float(t) for t in values if t > 0]
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

    def table(self, times) -> np.ndarray:
        """Ticks of every time of an array, as an int64 array of its shape: each distinct
        time converted once (as :meth:`__call__` converts it) and mapped back."""
        times = np.asarray(times, dtype=float)
        values, back = np.unique(times, return_inverse=True)
        ticks = np.array([self(t) for t in values], dtype=np.int64)
        return ticks[back].reshape(times.shape)

    def time(self, ticks: float) -> float:
        return float(ticks) / self.scale


def exact_links(timed: TimedProblem) -> bool:
    """Whether every link between two workers takes as long for each kind of data and stage, so
    that one transfer time per stage is every link's (the mapping models' bounds need it: with
    one time per stage they take the worst link) and an all-reduce takes as long among any k
    workers."""
    W = timed.shape.num_workers
    off = ~np.eye(W, dtype=bool)
    return all(np.all(m[off] == m[off][:1]) for m in (timed.comm, timed.fetch, timed.stash)) if W > 1 else True


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


def seconds_tables(problem: PlanProblem) -> list[np.ndarray]:
    """The times :meth:`TimedProblem.build` turns into ticks, in seconds:
    each pass of the first micro-batch's items on each worker (an item's
    time depends on its stage, pass and worker only), and the W x W x S
    tables of an activation's, a stage's weights' and a stash's transfer."""
    W, S, _ = problem.shape
    costs = problem.costs
    batch, stage, direction = problem.items.arrays()
    first = np.flatnonzero(batch == 0)
    activations = costs.per_stage("activation_bytes", S)
    return [costs.item_time(stage[first, None], direction[first, None], np.arange(W)[None, :], S, W),
            transfer_matrix(costs, W, activations),
            transfer_matrix(costs, W, costs.per_stage("weight_bytes", S)),
            transfer_matrix(costs, W, dataflow.input_bytes(activations, problem.stage_graph))]


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
        """The tables in ticks, refused (naming the fix) when the times do not fit integers.

        An item's time depends on its stage, pass and worker only, so durations are
        converted for the first micro-batch's items and spread over all (converting per
        item and worker takes seconds on large steps)."""
        batch, stage, direction = problem.items.arrays()
        first = np.flatnonzero(batch == 0)
        seconds, comm, fetch, stash = seconds_tables(problem)
        try:
            ticks = Ticks.for_times(np.concatenate([seconds.ravel(), comm.ravel(), fetch.ravel(), stash.ravel()]))
            row = np.empty(problem.num_items, dtype=np.int64)
            row[first] = np.arange(len(first))
            duration = ticks.table(seconds)[row[problem.items.id(0, stage, direction)]]
            return cls(problem, ticks, duration, ticks.table(comm), ticks.table(fetch), ticks.table(stash),
                       batch, stage, direction)
        except (OverflowError, ValueError) as error:
            raise PlanInputError(
                f"the costs do not fit the integer ticks the planner counts time in ({error}): give the times in a "
                "coarser unit (e.g. milliseconds instead of microseconds)"
            ) from None

    @property
    def shape(self) -> Shape:
        return self.problem.shape

    @property
    def uniform(self) -> bool:
        """Whether every item takes as long on each worker."""
        return bool(np.all(self.duration == self.duration[:, :1]))

    @property
    def free_transfers(self) -> bool:
        """Whether no transfer takes time: activations, gradients, weights and stashes alike."""
        return not any(np.any(table) for table in (self.comm, self.fetch, self.stash))

    def data_edges(self) -> DataEdges:
        """Every dependency of the step, from :func:`unisched.dataflow.edges` over the problem's stage graph."""
        table = dataflow.edges(self.problem.items, self.problem.stage_graph)
        src, dst, _, moves = table
        return DataEdges(src, dst, dataflow.moved_stage(self.stage[src], self.stage[dst], moves), moves, table)

    def shortest(self, table: np.ndarray) -> np.ndarray:
        """Per stage: the least ticks of a transfer table (``comm``, ``fetch`` or ``stash``) between
        two different workers (0 with one worker)."""
        W = self.shape.num_workers
        if W == 1:
            return np.zeros(self.shape.num_stages, dtype=np.int64)
        return table[~np.eye(W, dtype=bool)].min(axis=0)

    @cached_property
    def allreduce(self) -> np.ndarray:
        """(S, W + 1) table: the ticks, rounded down, of a stage's end-of-step all-reduce among k
        holders of its weights (k = 0, 1: none), as :func:`unisched.network.allreduce_time` prices it
        over the first k workers (exact where every link is alike); worked out once per problem."""
        W, S, _ = self.shape
        nbytes = self.problem.costs.per_stage("weight_bytes", S)
        table = np.zeros((S, W + 1), dtype=np.int64)
        for k in range(2, W + 1):
            seconds = np.asarray(allreduce_time(self.problem.costs, list(range(k)), nbytes), dtype=float)
            table[:, k] = np.floor(seconds * self.ticks.scale + 1e-6).astype(np.int64)
        table.setflags(write=False)
        return table

    def least_delays(self, edges: DataEdges) -> np.ndarray:
        """Ticks each edge's data takes at least to reach another worker, where it moves: the
        table of what the edge's kind carries over the shortest link, 0 where it carries nothing.
        (Whether an I -> W edge moves the stash depends on the mapping:
        :func:`unisched.dataflow.moved_data`.)"""
        delay = np.where(edges.moves == TRANSFER_KINDS.index("stash"), self.shortest(self.stash)[edges.stage],
                         self.shortest(self.comm)[edges.stage])
        delay[edges.moves == dataflow.MOVES_NOTHING] = 0
        return delay

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
