"""Lower bounds reported beside every answer, so a plan says how good it is.

- critical path: one micro-batch's forwards then backwards along the longest
  path of the stage graph, on the fastest worker;
- work / W: all work spread perfectly over all workers;
- memory-time: the input of (stage s, batch b) lives at least from F(s, b)'s
  start to its backward's end, i.e. through the forwards and backwards of
  every stage downstream of s; W workers holding M each give at most W M of "live memory" per
  unit of time (the paper's throughput bound rho <= M / S, made exact).  With
  per-worker limits the sum of the limits stands for W M, and with a memory
  budget in bytes, at most the budgets less every stage's weights and
  optimizer state (each held by at least one worker);
- CP-SAT's own bound, when a model ran, and the pooled step's
  (:mod:`unisched.plan.pooled`, which the planner runs under a memory limit).

These hold for every schedule of the whole scheme (:data:`ANY_SCHEDULE`), and
for the latency objective; for the span objective only the work bound does
(a worker's busy span is at least its work).  One more holds for the
planner's whole scheme only (one weight worker per stage, a split
backward's I and W on one worker: :func:`ramp`): the work
bound with the time workers must stand idle at the step's two ends; and a
weaker one like it for every schedule a plan can hold, replicas among them
(:func:`every_ramp`).  For a
fixed mapping the same ideas apply per worker: its own work, and the
memory-time of the stashes it keeps against its own limit.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import networkx as nx
import numpy as np

from unisched import dataflow
from unisched.plan.problem import PlanProblem, TimedProblem
from unisched.simulate.simulation import downstream_paths, shape_bounds as simulated_shape_bounds
from unisched.work import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD

ANY_SCHEDULE = "any schedule"
"""Every schedule: the class the shape bounds hold for, and the only one ``"optimal": true`` in a
plan file claims."""


def shape_bounds(problem: PlanProblem) -> dict[str, float]:
    """Bounds no mapping or order can beat (of the problem's objective)."""
    bounds = simulated_shape_bounds(problem.shape, problem.costs, problem.split_backward, problem.stage_graph)
    if problem.objective == "span":
        return {"work": bounds["work"]}
    B = problem.shape.num_batches
    room = stash_room(problem)
    if room and np.isfinite(room):
        live = _live_time(problem) / problem.costs.speeds(problem.shape.num_workers).max()
        bounds["memory_time"] = float(B * (live * problem.stash_sizes).sum() / room)
    return bounds


def stash_room(problem: PlanProblem) -> float:
    """The most stash all workers together may hold at once (inf: unlimited): the sum of the
    stash limits, and with a memory budget in bytes at most the budgets less every stage's
    weights, their gradient and optimizer state (each held by its weight worker:
    :meth:`PlanProblem.owned_need`)."""
    room = float(problem.limits().sum())
    if problem.memory_budget is not None and problem.costs.has_sizes:
        budget = np.broadcast_to(np.asarray(problem.memory_budget, dtype=float), (problem.shape.num_workers,))
        room = min(room, float(budget.sum() - problem.owned_need().sum()))
    return room


def ramp(timed: TimedProblem) -> int:
    """The work bound with the workers' idle time at the step's two ends, in ticks, for every
    schedule with one weight worker per stage and a split backward's I and W on one worker (the
    planner's whole scheme, :data:`unisched.plan.mapping.WHOLE_SCHEME`); 0 for the span objective,
    which it does not bound (a worker's busy span leaves out its idle ends).

    Only the weight workers of source stages can start at once.  Any other worker's first pass
    either is a source stage's forward, waiting for that stage's weights to arrive, or takes
    inputs that all come from other workers: it starts no sooner than ``head``, the least of
    these over the passes of a micro-batch (upstream passes at the fastest worker's speed, each
    transfer over the shortest link).  Likewise only the weight workers of the stages whose
    passes end a micro-batch's work (sinks: a source stage's backward, or with a split backward
    every W) can be busy until the step ends: any other worker's last pass either has successors,
    all on other workers, or is a sink's gradient pass, whose gradient must then go back to the
    stage's weight worker; it ends at least ``tail`` before the step does.  So at least
    ``W - sources`` workers idle for ``head`` and ``W - sinks`` for ``tail`` (a worker idle
    throughout idles for the whole step), and since a worker of speed v does v units of work
    a unit of time, the step is at least as long as the shortest T with
    ``sum(v) T >= work + sum(v idle(T))``, the idle time on the slowest workers.  For W = S = 4,
    B = 8, comm 1 (weights fetched in 1 too) head and tail are 1, so 4 T >= 96 + 3 + 3: T >= 26,
    where the work bound is 24 and the planner's plan takes 26.

    Within the class a W pass follows its I on one worker, so it is never a worker's first pass,
    nor an I pass its last (apart, W may need nothing moved and end the step sooner).  Replicated
    weights escape it: every replica of a source stage starts at once (:func:`every_ramp` covers
    them)."""
    if timed.problem.objective != "latency":
        return 0
    return _Ends.of(timed).one_holder_each(timed)


def every_ramp(timed: TimedProblem) -> int:
    """:func:`ramp` for every schedule a plan can hold (:data:`unisched.plan.mapping.EVERY`:
    whole-stage weights on one or several workers, each pass on any one), in ticks; 0 for the span
    objective.

    Any pass may now be a worker's first or last, and a stage's replicas end the step with its
    all-reduce (:attr:`TimedProblem.allreduce`). Either every source stage has one weight worker,
    and then, as in :func:`ramp`, only those start at once, and only the sole holders of sink stages
    end with the step: any other worker's last pass passes data on, returns a gradient or is
    followed by its stage's all-reduce.  Or some source stage s has k > 1 holders: where s is the
    only source stage, only they start at once; only the sole holders of the other sink stages end
    with the step; and the all-reduce of k holders follows s's last gradient pass.  In its ticks
    only passes that no gradient pass of s needs can run: a split backward's W passes of other
    stages, and none with an unsplit backward, where every worker idles for it.  The bound is the
    least over these cases.  (Where links differ, the all-reduces are taken as 0: which workers
    hold a stage decides how long theirs takes.)

    For W = S = 2, B = 8, comm 1 (an all-reduce of 2), unsplit and without a memory limit: one
    holder of stage 0 gives 2 T >= 48 + 1 + 1, replicas of it 2 T >= 48 + 2 + 2, so T >= 25,
    where the work bound is 24.  With a split backward, W = 4, S = 2, B = 8, comm 1:
    one holder of stage 0 gives 4 T >= 48 + 3 + 2; two leave two workers waiting for its weights,
    4 T >= 48 + 2 + 3; three or four make the all-reduce 4 or 6 long, in which only stage 1's W
    passes (8 of work) can run: 4 (T - 4) >= 40 + 1, or 4 (T - 6) >= 40; so 14, where the work
    bound is 12."""
    if timed.problem.objective != "latency":
        return 0
    W, S, _ = timed.shape
    # per stage and number of holders, its all-reduce (0 where links differ: it depends on which)
    allreduce = timed.allreduce if timed.problem.links_alike else np.zeros((S, W + 1), dtype=np.int64)
    ends = _Ends.of(timed, allreduce[:, 2:].min(axis=1) if W > 1 else np.zeros(S, dtype=np.int64))
    cases = [ends.one_holder_each(timed)]
    for s in ends.sources if W > 1 else ():
        early = W - min(W, len(ends.sinks - {s}))
        for k in range(2, W + 1):  # k replicas of source stage s
            late = W - k if len(ends.sources) == 1 else 0  # other sources' holders may be any
            others = _least_step(timed, ends.work, late, ends.head, early, ends.tail)
            closing = _least_step(timed, ends.work - ends.free[s], late, ends.head, 0, 0) + int(allreduce[s, k])
            cases.append(max(others, closing))
    return min(cases)


class _Ends(NamedTuple):
    """What a micro-batch's dependencies say about the step's two ends (:func:`ramp`,
    :func:`every_ramp`)."""

    work: float
    """Every pass at its fastest, at speed 1."""
    sources: set[int]
    """Stages with a pass that needs nothing: only their weight workers start at once."""
    sinks: set[int]
    """Stages with a pass nothing needs: only their weight workers can be busy until the step ends."""
    head: int
    """The least time any other worker's first pass waits."""
    tail: int
    """The least time from any other worker's last pass's end to the step's."""
    free: dict[int, float]
    """Per source stage s, the work (as :attr:`work`) of the passes that neither are s's gradient
    pass nor come before it in their micro-batch: all that can run after s's last gradient pass."""

    @classmethod
    def of(cls, timed: TimedProblem, reduce: np.ndarray | None = None) -> "_Ends":
        """The ends of the whole scheme's schedules, where a W pass follows its I on one worker
        (never a worker's first pass, nor an I its last); given ``reduce`` (per stage, the least
        all-reduce among its holders), of every schedule a plan can hold, where a sink stage's
        gradient pass may end before its all-reduce instead of returning its gradient."""
        problem = timed.problem
        W, _, B = problem.shape
        every = reduce is not None
        edges = timed.data_edges()
        first = np.flatnonzero(timed.batch == 0)  # a micro-batch's dependencies are every micro-batch's
        mine = np.isin(edges.src, first)
        delay = timed.least_delays(edges)
        if every:  # a W pass apart from its I may need nothing from I's worker (dataflow.stash_needs)
            delay[(timed.direction[edges.src] == BACKWARD_INPUT) & (timed.direction[edges.dst] == BACKWARD_WEIGHT)] = 0
        delay = delay[mine]
        fastest = timed.duration.min(axis=1)
        graph = nx.DiGraph()
        graph.add_nodes_from(first.tolist())
        graph.add_weighted_edges_from(zip(edges.src[mine].tolist(), edges.dst[mine].tolist(), delay.tolist()))
        order = list(nx.topological_sort(graph))
        done_by, to_end = {}, {}  # earliest end; longest path from an item's start to the step's end
        for i in order:
            done_by[i] = max((done_by[u] for u in graph.predecessors(i)), default=0) + int(fastest[i])
        for i in reversed(order):
            to_end[i] = int(fastest[i]) + max((to_end[v] for v in graph.successors(i)), default=0)
        stage, direction = timed.stage, timed.direction
        sources = {int(stage[i]) for i in first if graph.in_degree(i) == 0}
        sinks = {int(stage[i]) for i in first if graph.out_degree(i) == 0}
        gradient = dataflow.gradient_pass(problem.split_backward)
        fetch = timed.shortest(timed.fetch)

        def waits(i: int) -> int:  # for the worker whose first pass is i
            arrival = max((done_by[u] + graph[u][i]["weight"] for u in graph.predecessors(i)), default=0)
            return max(arrival, int(fetch[stage[i]]) if stage[i] in sources else 0)

        def leaves(i: int) -> int:  # for the worker whose last pass is i
            if graph.out_degree(i):
                return max(graph[i][v]["weight"] + to_end[v] for v in graph.successors(i))
            if direction[i] != gradient:
                return 0
            back = int(fetch[stage[i]])  # the gradient goes back to the stage's weight worker
            return min(back, int(reduce[stage[i]])) if every else back

        head = min(waits(i) for i in first if every or direction[i] != BACKWARD_WEIGHT)
        tail = min(leaves(i) for i in first if every or direction[i] != BACKWARD_INPUT)
        least = (timed.duration[first] * problem.costs.speeds(W)).min(axis=1)  # each pass's work at speed 1
        free = {int(stage[i]): B * float(least[~np.isin(first, [*nx.ancestors(graph, int(i)), int(i)])].sum())
                for i in first if stage[i] in sources and direction[i] == gradient}
        return cls(B * float(least.sum()), sources, sinks, head, tail, free)

    def one_holder_each(self, timed: TimedProblem) -> int:
        """The shortest step where every source and sink stage has one weight worker: only those
        start at once and end with the step (:func:`ramp`'s count)."""
        W = timed.shape.num_workers
        return _least_step(timed, self.work, W - min(W, len(self.sources)), self.head,
                           W - min(W, len(self.sinks)), self.tail)


def _least_step(timed: TimedProblem, work: float, late: int, head: int, early: int, tail: int) -> int:
    """The shortest step, in ticks, in which the workers do ``work`` (at speed 1) while ``late`` of
    them idle ``head`` at its start and ``early`` idle ``tail`` at its end: the shortest T with
    ``sum(v) T >= work + sum(v idle(T))``, the idle time on the slowest workers (a worker of speed
    v does v units of work a unit of time; one idle throughout idles for the whole step)."""
    both = min(late, early)
    speeds = np.sort(timed.problem.costs.speeds(timed.shape.num_workers))  # the slowest first: they idle
    idle_each = [head + tail] * both + [head] * (late - both) + [tail] * (early - both)

    def fits_in(T: int) -> bool:
        idle = sum(v * min(T, each) for v, each in zip(speeds, idle_each))
        return speeds.sum() * T >= (work + idle) * (1 - 1e-12)

    low, high = 0, int(math.ceil((work + speeds.max() * (late * head + early * tail)) / speeds.sum()))
    while low < high:  # sum(v) T - idle(T) never falls as T grows
        middle = (low + high) // 2
        low, high = (low, middle) if fits_in(middle) else (middle + 1, high)
    return low


def mapping_bounds(problem: PlanProblem, compute: np.ndarray, weight: np.ndarray | None = None) -> dict[str, float]:
    """Bounds for one fixed mapping (``compute`` and ``weight`` over the simulator's item ids)."""
    W, S, B = problem.shape
    costs = problem.costs
    batch, stage, direction = problem.items.arrays()
    compute = np.asarray(compute)
    speeds = costs.speeds(W)
    seconds = costs.item_time(stage, direction, compute, S, W)
    bounds = shape_bounds(problem)
    bounds["busiest_worker"] = float(np.bincount(compute, weights=seconds, minlength=W).max())
    limits = problem.stash_limits(compute, compute if weight is None else np.asarray(weight))
    if limits is not None and problem.objective != "span":
        limits = np.broadcast_to(np.asarray(limits, dtype=float), (W,))
        shares = dataflow.stash_share_array(direction, problem.split_backward, costs.input_grad_frees)
        lives = _live_time(problem, per_share=True)
        held = np.zeros(W)
        for d in problem.dirs[1:]:
            rows = direction == d
            live = lives[d] / speeds.max()
            np.add.at(held, compute[rows], (live * problem.stash_sizes)[stage[rows]] * shares[rows])
        with np.errstate(divide="ignore", invalid="ignore"):
            per_worker = np.where(held > 0, held / limits, 0.0)
        bounds["memory_time"] = float(np.max(per_worker))
    return bounds


def _live_time(problem: PlanProblem, per_share: bool = False):
    """Shortest time a stash of each stage is held (forward start to releasing backward end),
    averaged over its shares; or per freeing pass (a dict by direction) with ``per_share``."""
    later = _downstream(problem)
    first = dataflow.first_backward(problem.split_backward)
    if not problem.split_backward:
        return {first: later} if per_share else later
    durations = problem.costs.durations(problem.shape.num_stages)
    lives = {first: later, BACKWARD_WEIGHT: later + durations[BACKWARD_WEIGHT]}
    if per_share:
        return lives
    shares = dataflow.stash_shares(True, problem.costs.input_grad_frees)
    return sum(shares[d] * lives[d] for d in lives)


def _downstream(problem: PlanProblem) -> np.ndarray:
    """Per stage: :func:`unisched.simulate.simulation.downstream_paths` with
    the forward and the first backward pass."""
    durations = problem.costs.durations(problem.shape.num_stages)
    first = dataflow.first_backward(problem.split_backward)
    return downstream_paths(problem.stage_graph, durations[FORWARD], durations[first])
