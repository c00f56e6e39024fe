"""CP-SAT for the mapping itself: which worker computes each pass, which
worker holds each stage's weights, and in what order.

Two classes of schedules, each named by the claim a proof makes
(:data:`WHOLE_SCHEME`, :data:`PAIRED`; a whole-scheme proof holds for every
schedule where no transfer takes time: :func:`proven_class`):

- the whole scheme: a (stage, batch) has one placement literal per worker for
  its forward and another for its backward passes (B, or I and W together),
  so the backward may run away from its forward and the stash follows it
  (what moves, and what it costs, is :func:`unisched.dataflow.moved_data`'s
  rule: nothing at a source stage, the stage's inputs elsewhere);
- paired: one literal per (stage, batch, worker) shared by all its passes, so a
  stash never moves: far fewer choices, for larger problems.

A stage has one weight worker, chosen apart from its compute workers; a worker
computing a stage it does not hold waits ``fetch`` for the weights and sends
the gradient back ``fetch`` after its last gradient pass.  A third model,
over every schedule (:data:`EVERY`: on small problems, after the whole
scheme's, :func:`every_schedule_applies`), places each pass
alone (a split backward's I and W too) and lets a stage have several
weight workers, each computing with its own copy
(:func:`unisched.dataflow.own_copies`), whose end-of-step all-reduce
takes :attr:`~unisched.plan.problem.TimedProblem.allreduce`; it relaxes
the simulator's rules (it leaves out link contention, and waits for the
parts of a weight pass's stash one at a time rather than summed:
:func:`_weight_stash`), so its bound holds for
every schedule a plan can hold (:data:`EVERY`).  A worker may hold at
most ``max_stages_per_worker`` stages (its own and fetched ones), and within a
memory budget its weights, optimizer state and live stashes.  Data takes its
transfer time only when the two ends of a dependency run on different
workers.  Cumulatives of all work with capacity W and of all live activations
with capacity W*M tighten the bound (the first is also what leaves a free
worker for each forward filled in after the search: :func:`forwards_fill_in`).

The search starts from a complete feasible hint (the best schedule found so
far, relabelled to fit the symmetry breaking); when the model is large, a
large-neighbourhood search frees a few micro-batches at a time and keeps the
rest of the incumbent's mapping.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
from ortools.sat.python import cp_model

from unisched import dataflow
from unisched.plan.bounds import ANY_SCHEDULE
from unisched.plan.order import (Improvements, Solved, busy_span, capacity, earliest_forwards, live_start,
                                 live_stashes, make_solver, memory_demands, run_solver)
from unisched.plan.problem import TimedProblem
from unisched.timeline import TRANSFER_KINDS
from unisched.work import BACKWARD_WEIGHT, FORWARD

WHOLE_MODEL_LIMIT = 160
"""Above this many (stage, batch) pairs the whole model is too slow to improve: use LNS."""
WHOLE_SCHEME_LNS = 32
"""The same over the whole scheme (twice the placement literals)."""
LNS_PAIRS = 64
"""(stage, batch) pairs whose workers one LNS round frees."""
LNS_ROUND_SECONDS = 4.0
"""Longest single LNS round: many short rounds beat a few long ones on large models."""
WHOLE_SCHEME_UP_TO = (4, 4, 8)
"""The largest (W, S, B) whose mapping search covers the whole scheme by default."""

WHOLE_SCHEME = ("schedules with one weight worker per stage (a forward and its backward may run on different "
                "workers; a split backward's I and W on one)")
PAIRED = "schedules with one worker per (stage, micro-batch) and one weight worker per stage"
EVERY = ("schedules a plan can hold: whole-stage weights on one or several workers (replicas, all-reduced at the "
         "end), every pass, a split backward's I and W too, on any one worker")
"""What the every-schedule model searches and proves for: every schedule but those holding weights in
shards or computing with tensor-parallel gangs, which move less than a stage's weights at a time and
can be shorter (W = S = B = 2, latency 0, bandwidth 1, weight bytes [0, 3]: fsdp(shard=true)
takes 6.5, this class at least 7); plan files hold neither."""


def whole_scheme_by_default(shape) -> bool:
    """Whether the mapping search covers the whole scheme when not told (small problems)."""
    return all(n <= most for n, most in zip(shape, WHOLE_SCHEME_UP_TO))


SCHEMES = (PAIRED, WHOLE_SCHEME, EVERY)
"""The classes the mapping model searches, each within the next: its ``scheme``."""


def proven_class(timed: TimedProblem, scheme: str) -> str:
    """The class of schedules a proof of the mapping model over ``scheme`` covers: that class, or
    every schedule where the whole scheme's are as short as any (:func:`whole_scheme_is_any`) and
    the class holds them."""
    return ANY_SCHEDULE if scheme != PAIRED and whole_scheme_is_any(timed) else scheme


def every_schedule_applies(timed: TimedProblem) -> bool:
    """Whether the every-schedule model (:data:`EVERY`) may run and prove something the whole scheme's
    does not: a small problem (:func:`whole_scheme_by_default`) whose whole scheme is not already
    as short as any schedule, with every link alike (:attr:`PlanProblem.links_alike
    <unisched.plan.problem.PlanProblem.links_alike>`: an all-reduce then takes as long among any
    workers) and no memory budget (replicated weights would take bytes the model does not count)."""
    return (whole_scheme_by_default(timed.shape) and not whole_scheme_is_any(timed) and timed.problem.links_alike
            and timed.problem.memory_budget is None)


def whole_scheme_is_any(timed: TimedProblem) -> bool:
    """Whether every schedule has one of the whole scheme as short: with an unsplit backward, no
    memory budget and no time to any transfer.

    Keep any schedule's compute workers and start times, and make one of each stage's weight
    workers its only one.  The transfers this adds (weights fetched, gradients returned) arrive at
    once, the all-reduces among replicas it drops took no less, every stash stays where it was (on
    the worker of the pass that frees it: :mod:`unisched.dataflow`), and no worker holds more
    stages than before.  With a split backward the whole scheme keeps a stage's I and W on one
    worker, and running them apart can be shorter even without a memory limit (W = 2, S = B = 1,
    F = I = W = 1: 3 on one worker, 2 with I and W side by side); under a budget replicated and
    fetched weights take memory differently."""
    problem = timed.problem
    return not problem.split_backward and problem.memory_budget is None and timed.free_transfers


def class_breadth(name: str) -> int:
    """How wide a class of schedules is (0: every schedule), to state the widest claim proven."""
    order = (ANY_SCHEDULE, EVERY, WHOLE_SCHEME, PAIRED)
    return order.index(name) if name in order else len(order)


def claimable(bounds: dict[str, float], classes: dict[str, str], value: float) -> tuple[dict, dict]:
    """The bounds (and their classes) worth reporting beside a plan whose objective is ``value``:
    every bound for every schedule; a restricted class's only where it is not above ``value`` (else
    it says only that the plan lies outside the class) and no bound of a wider class that contains
    it says as much (the classes nest: every schedule, those a plan can hold, the whole scheme, the
    paired; a fixed mapping's orders lie among those a plan can hold)."""
    def breadth(key: str) -> int:
        name = classes[key]
        return class_breadth(WHOLE_SCHEME) if name.startswith("orders of") else class_breadth(name)

    def said_wider(key: str) -> bool:
        return any(class_breadth(classes[other]) < breadth(key) and bounds[other] >= bounds[key] - 1e-9
                   for other in bounds if other != key)

    keep = [k for k in bounds if classes[k] == ANY_SCHEDULE or (bounds[k] <= value + 1e-9 and not said_wider(k))]
    return {k: bounds[k] for k in keep}, {k: classes[k] for k in keep}


Scorer = Callable[[np.ndarray, np.ndarray, np.ndarray], float]
"""(compute, weight, start ticks) -> the latency that counts (the simulator's replay)."""


@dataclass(frozen=True)
class Incumbent:
    """A complete solution of the mapping model, in ticks, with its replayed score."""

    compute: np.ndarray
    weight: np.ndarray
    starts: np.ndarray
    makespan: int
    score: float = math.inf
    objective: int | None = None
    """The model's objective (ticks): the makespan, or the longest busy span with that objective."""

    @property
    def value(self) -> int:
        return self.makespan if self.objective is None else self.objective


def solve_mapping(
    timed: TimedProblem,
    *,
    time_limit: float,
    hint: Incumbent | None = None,
    num_workers: int = 2,
    seed: int = 0,
    lns: bool | None = None,
    score: Scorer | None = None,
    scheme: str | None = None,
    lower_bound: int = 0,
    asap_replay: bool = True,
    period: int = 0,
    report=None,
) -> Solved:
    """Search mappings and orders together; LNS when the model is large (or ``lns=True``).

    ``scheme``, one of :data:`SCHEMES`, is the class searched: :data:`PAIRED` (one worker per
    (stage, batch)), :data:`WHOLE_SCHEME` or :data:`EVERY` (replicated weights, each pass on its
    own worker); by default the whole scheme on small problems (:func:`whole_scheme_by_default`),
    else paired.  ``period`` p > 0 searches
    only mappings that repeat every p micro-batches (micro-batch b placed as
    b - p), where CP-SAT finds good schedules sooner; its bound then holds for
    that restriction alone, so the result carries none (bound 0); ``lower_bound`` (ticks),
    a bound proven for every schedule, lets the search stop once it is met;
    ``asap_replay``: solutions will be replayed from their orders alone, so a stash
    kept away from its forward counts from that forward's earliest start
    (:mod:`unisched.plan.order`).
    The model leaves out link contention, so with ``score`` every solution
    CP-SAT reports is replayed and the one with the best replay is kept.
    """
    W, S, B = timed.shape
    if scheme is None:
        scheme = WHOLE_SCHEME if whole_scheme_by_default(timed.shape) else PAIRED
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if scheme == EVERY and timed.problem.memory_budget is not None:
        raise ValueError("the every-schedule model does not count replicas' bytes: no memory budget "
                         "(every_schedule_applies)")
    if hint is not None and not fits(timed, hint.compute, hint.weight, scheme):
        hint = None
    if lns is None:
        lns = S * B > (WHOLE_MODEL_LIMIT if scheme == PAIRED else WHOLE_SCHEME_LNS) and hint is not None
    if hint is not None and score is not None:
        hint = replace(hint, score=score(hint.compute, hint.weight, hint.starts))
    common = dict(num_workers=num_workers, score=score, scheme=scheme, lower_bound=lower_bound,
                  asap_replay=asap_replay, period=period, report=report)
    if not lns or hint is None:
        return _solve(timed, time_limit=time_limit, hint=hint, seed=seed, **common)
    return _lns(timed, time_limit=time_limit, hint=hint, seed=seed, **common)


def _lns(timed: TimedProblem, *, time_limit: float, hint: Incumbent, num_workers: int, seed: int,
         score: Scorer | None, scheme: str, lower_bound: int, asap_replay: bool, period: int = 0,
         report=None) -> Solved:
    """Free a window of micro-batches, keep the others' workers; repeat while time lasts."""
    begin = time.perf_counter()
    deadline = begin + time_limit
    rng = random.Random(seed)
    W, S, B = timed.shape
    best = hint
    window = max(2, min(B, LNS_PAIRS // S))
    round_limit = max(1.0, min(LNS_ROUND_SECONDS, time_limit / 6))
    common = dict(num_workers=num_workers, score=score, scheme=scheme, lower_bound=lower_bound,
                  asap_replay=asap_replay, period=period, report=report)
    first = _solve(timed, time_limit=min(round_limit, time_limit / 3), hint=best, seed=seed, **common)
    bound = first.bound
    best = _better(best, first)
    interrupted = first.interrupted
    while time.perf_counter() < deadline - 0.2 and best.value > bound and not interrupted:
        first = rng.randrange(B)
        free = {(first + k) % B for k in range(window)} if rng.random() < 0.5 else set(rng.sample(range(B), window))
        left = deadline - time.perf_counter()
        result = _solve(timed, time_limit=min(round_limit, left), hint=best, seed=rng.randrange(1 << 30),
                        free_batches=free, **common)
        best = _better(best, result)
        interrupted = result.interrupted
    status = "OPTIMAL" if best.value <= bound else "FEASIBLE"
    return Solved(status, best.starts, best.compute, best.weight, best.value, bound,
                  time.perf_counter() - begin, best.score, interrupted)


def _better(best: Incumbent, result: Solved) -> Incumbent:
    if not result.found:
        return best
    candidate = Incumbent(result.compute, result.weight, result.starts, result.objective,
                          result.score if result.score is not None else math.inf, objective=result.objective)
    if math.isinf(candidate.score) and math.isinf(best.score):
        return candidate if candidate.value < best.value else best
    return candidate if (candidate.score, candidate.value) < (best.score, best.value) else best


class _Collector(Improvements):
    """Keeps every solution CP-SAT reports, to be replayed afterwards (and tells ``report`` of each)."""

    def __init__(self, places: "_Places", owner, start, timed: TimedProblem, limit: int = 64, report=None,
                 bounded: bool = True):
        super().__init__(report, bounded)
        self.places, self.owner, self.start, self.timed = places, owner, start, timed
        self.limit = limit
        self.solutions: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = []

    def on_solution_callback(self) -> None:
        W, S, B = self.timed.shape
        holders = np.array([[self.boolean_value(self.owner[s, w]) for w in range(W)] for s in range(S)])
        starts = np.array([self.value(v) for v in self.start], dtype=np.int64)
        compute = self.places.compute(self.boolean_value, starts)
        weight = weights_of(self.timed.stage, compute, holders)
        self.solutions.append((compute, weight, starts, int(self.objective_value)))
        if len(self.solutions) > self.limit:
            del self.solutions[0]
        super().on_solution_callback()


class _Places:
    """The placement literals: per (stage, batch, group, worker), group 0 the forward and group 1
    the backward passes (the whole scheme); in the paired class both groups share the forward's
    literals, and in every schedule each pass has its own group, its index among the problem's
    passes.  With a ``period`` p, micro-batch b >= p is placed as micro-batch b - p.  With
    ``fill_in`` (:func:`forwards_fill_in`) forwards have no literals: :meth:`compute` places them
    afterwards."""

    def __init__(self, model, timed: TimedProblem, scheme: str, period: int = 0, fill_in: bool = False):
        W, S, B = timed.shape
        self.timed, self.W, self.fill_in = timed, W, fill_in
        last = {PAIRED: 0, WHOLE_SCHEME: 1, EVERY: len(timed.problem.dirs) - 1}[scheme]
        self.kind = {int(d): min(k, last) for k, d in enumerate(timed.problem.dirs)}
        self.groups = tuple(range(1 if fill_in else 0, last + 1))
        self.model = model
        self.apart: dict = {}
        self.x = {(s, b, g, w): model.new_bool_var(f"x{s},{b},{g},{w}")
                  for s in range(S) for b in range(B) for g in self.groups for w in range(W)}
        for s in range(S):
            for b in range(B):
                for g in self.groups:
                    model.add_exactly_one(self.x[s, b, g, w] for w in range(W))
        for (s, b, g, w), literal in self.x.items():
            if period and b >= period:
                model.add(literal == self.x[s, b - period, g, w])

    def group(self, item: int) -> tuple[int, int, int]:
        """(stage, batch, group) of an item."""
        return int(self.timed.stage[item]), int(self.timed.batch[item]), self.kind[int(self.timed.direction[item])]

    def placed(self, item: int) -> bool:
        """Whether the model chooses the item's worker (a forward filled in afterwards: no)."""
        return not (self.fill_in and self.timed.direction[item] == FORWARD)

    def of_item(self, item: int, worker: int):
        """The literal "item runs on worker"."""
        s, b, g = self.group(item)
        return self.x[s, b, g, worker]

    def compute(self, chosen: Callable, starts: np.ndarray) -> np.ndarray:
        """Every item's worker in a solution (``chosen``: a literal's value), forwards filled in."""
        where = {(s, b, g): w for (s, b, g, w), literal in self.x.items() if chosen(literal)}
        compute = np.array([where[self.group(i)] if self.placed(i) else -1 for i in range(len(starts))],
                           dtype=np.int64)
        return fill_forwards(self.timed, compute, starts) if self.fill_in else compute

    def away(self, u: int, v: int):
        """A literal true when items u and v run on different workers (False: they never do)."""
        gu, gv = self.group(u), self.group(v)
        if gu == gv:
            return False
        key = (gu, gv) if gu < gv else (gv, gu)
        if key not in self.apart:
            self.apart[key] = literal = self.model.new_bool_var(f"apart{key}")
            for w in range(self.W):
                self.model.add(literal >= self.x[(*gu, w)] - self.x[(*gv, w)])
        return self.apart[key]

    def in_order(self) -> list[tuple[int, int, int]]:
        """Every group, by micro-batch, then stage, then pass: the order in which the symmetry
        breaking of identical workers numbers them (:meth:`number_workers`, :func:`canonical`)."""
        return sorted({key[:3] for key in self.x}, key=lambda g: (g[1], g[0], g[2]))

    def number_workers(self) -> None:
        """Identical workers are interchangeable: number them in the order :meth:`in_order` first
        meets them.  Worker w > 0 takes a group only where worker w - 1 has taken an earlier one, so
        the first group is on worker 0 and every relabelling of the workers but one is cut off."""
        model, W = self.model, self.W
        first, *rest = self.in_order()
        met = [self.x[(*first, w)] for w in range(W)]  # met[w]: worker w has taken a group so far
        model.add(met[0] == 1)
        for g in rest:
            on = [self.x[(*g, w)] for w in range(W)]
            now = [model.new_bool_var(f"met{g},{w}") for w in range(W)]
            for w in range(W):
                if w:
                    model.add_implication(on[w], met[w - 1])
                model.add_bool_or([met[w], on[w]]).only_enforce_if(now[w])
                model.add_implication(met[w], now[w])
                model.add_implication(on[w], now[w])
            met = now

    def on(self, s: int, b: int, w: int):
        """The literals of (stage, batch) on worker w."""
        return [self.x[s, b, g, w] for g in self.groups]


def weights_of(stage: np.ndarray, compute: np.ndarray, holders: np.ndarray) -> np.ndarray:
    """Every item's weight worker, given which workers hold each stage (``holders``, S x W):
    its own worker where that holds the stage (:func:`unisched.dataflow.own_copies`), else the
    stage's first holder."""
    own = holders[stage, compute]
    return np.where(own, compute, np.argmax(holders, axis=1)[stage]).astype(np.int64)


def forwards_fill_in(timed: TimedProblem, scheme: str, asap_replay: bool) -> bool:
    """Whether the whole-scheme model may leave forwards unplaced, their workers filled in after
    the search (:func:`fill_forwards`) with no schedule lost.

    It may where a forward's worker decides nothing but which worker is busy: no transfer takes
    time (so nothing waits on where a forward ran), workers alike in speed, no limit on the stages
    or bytes a worker holds, every stash charged to the worker of the backward that frees it
    (:mod:`unisched.dataflow`; counted from the forward's start: no ``asap_replay``), and the
    makespan the objective (a busy span depends on where forwards run).  If every forward lasts
    one tick and no pass lasts none, any tick where at most W items run (the model's cumulative)
    has a free worker for each forward starting then, since each worker runs at most one backward
    pass at a time.  (A periodic run, ``period`` > 0, places forwards itself, to keep them
    periodic.)  Half
    the placement literals go, and with them the symmetry of swapping forwards between idle
    workers (docs/planner-measurements.md)."""
    problem = timed.problem
    forwards = timed.direction == FORWARD
    return (scheme != PAIRED and not asap_replay and problem.objective != "span" and problem.memory_budget is None
            and (problem.max_stages_per_worker is None or problem.max_stages_per_worker >= problem.shape.num_stages)
            and timed.free_transfers and timed.uniform
            and bool(np.all(timed.duration[forwards] == 1)) and bool(np.all(timed.duration > 0)))


def fill_forwards(timed: TimedProblem, compute: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Forwards (``compute`` -1) placed on a worker that runs nothing else in their tick
    (:func:`forwards_fill_in`'s schedules)."""
    W = timed.shape.num_workers
    compute = compute.copy()
    ends = starts + timed.duration[np.arange(len(starts)), 0]
    busy = np.zeros((W, int(ends.max(initial=0)) + 1), dtype=bool)
    for i in np.flatnonzero(compute >= 0):
        busy[compute[i], starts[i]:ends[i]] = True
    for i in np.flatnonzero(compute < 0):
        free = np.flatnonzero(~busy[:, starts[i]])
        if not len(free):
            raise AssertionError(f"no worker free for forward {i} at tick {starts[i]}: more than W items run")
        compute[i] = free[0]
        busy[compute[i], starts[i]] = True
    return compute


def _solve(
    timed: TimedProblem,
    *,
    time_limit: float,
    hint: Incumbent | None,
    num_workers: int,
    seed: int,
    scheme: str,
    free_batches: set[int] | None = None,
    period: int = 0,
    score: Scorer | None = None,
    lower_bound: int = 0,
    asap_replay: bool = True,
    report=None,
) -> Solved:
    begin = time.perf_counter()
    proves = free_batches is None and not period  # whether the model's bound holds for its whole class
    problem = timed.problem
    W, S, B = problem.shape
    model = cp_model.CpModel()
    every = scheme == EVERY  # several weight workers per stage
    fill_in = not period and forwards_fill_in(timed, scheme, asap_replay)
    places = _Places(model, timed, scheme, period, fill_in)
    if hint is not None:
        hint = canonical(timed, hint, places) if free_batches is None else hint
    duration = timed.duration  # (items, workers)
    fetch = timed.fetch.max(axis=(0, 1))
    uniform = timed.uniform
    reduce = timed.allreduce if every else np.zeros((S, W + 1), dtype=np.int64)
    horizon = int(duration.max(axis=1).sum() + 2 * B * S * max(timed.comm.max(initial=0), timed.stash.max(initial=0))
                  + 2 * fetch.max(initial=0) + reduce.max(initial=0) + 1)
    span = problem.objective == "span"
    if hint is not None and not span:
        horizon = min(horizon, int(hint.makespan))

    owner = {(s, w): model.new_bool_var(f"o{s},{w}") for s in range(S) for w in range(W)}  # a weight worker
    held = {(w, s): model.new_bool_var(f"h{w},{s}") for s in range(S) for w in range(W)}
    for s in range(S):
        if every:
            model.add_bool_or(owner[s, w] for w in range(W))
        else:
            model.add_exactly_one(owner[s, w] for w in range(W))
        for w in range(W):
            mine = [v for b in range(B) for v in places.on(s, b, w)]
            for v in mine:
                model.add_implication(v, held[w, s])
            model.add_implication(owner[s, w], held[w, s])
            model.add_bool_or([owner[s, w]] + mine).only_enforce_if(held[w, s])
    if problem.max_stages_per_worker is not None and problem.max_stages_per_worker < S:
        for w in range(W):
            model.add(sum(held[w, s] for s in range(S)) <= problem.max_stages_per_worker)

    n = problem.num_items
    start = [model.new_int_var(0, horizon, f"s{i}") for i in range(n)]
    end = []
    per_worker: list[list] = [[] for _ in range(W)]
    main = []
    for i in range(n):
        if uniform:
            end.append(start[i] + int(duration[i, 0]))
            main.append(model.new_fixed_size_interval_var(start[i], int(duration[i, 0]), f"m{i}"))
        else:
            e = model.new_int_var(0, horizon, f"e{i}")
            model.add(e == start[i] + sum(int(duration[i, w]) * places.of_item(i, w) for w in range(W)))
            end.append(e)
        for w in range(W) if places.placed(i) else ():
            per_worker[w].append(model.new_optional_fixed_size_interval_var(
                start[i], int(duration[i, w]), places.of_item(i, w), f"o{i},{w}"))
    for w in range(W):
        model.add_no_overlap(per_worker[w])
    if uniform:
        model.add_cumulative(main, [1] * n, W)

    makespan = model.new_int_var(0 if span else min(int(lower_bound), horizon), horizon, "makespan")
    for i in range(n):
        model.add(makespan >= end[i])

    _transfers(model, timed, places, start, end)
    _weights(model, timed, places, owner, start, end, makespan, fetch, _allreduces(model, timed, owner, reduce))
    _memory(model, timed, places, owner, held, start, end, horizon, asap_replay)

    grid = problem.item_grid()
    forward = problem.dirs.index(FORWARD)
    first = problem.stage_graph.sources[0]
    if free_batches is None:  # micro-batches placed alike are interchangeable: their first forwards in order
        step = period or 1
        for b in range(B - step):
            model.add(start[grid[b, first, forward]] <= start[grid[b + step, first, forward]])
        if uniform and problem.identical_workers:
            places.number_workers()

    if hint is not None:
        _add_hint(model, timed, hint, places, owner, held, start, makespan)
        if free_batches is not None:
            for i in range(n):
                if int(timed.batch[i]) not in free_batches and places.placed(i):
                    model.add(places.of_item(i, int(hint.compute[i])) == 1)
            for s, holders in enumerate(dataflow.replicas(timed.stage, hint.weight, S)):
                for w in holders:
                    model.add(owner[s, w] == 1)
    _search_order(model, problem, start)
    if span:
        workers = [[(start[i], end[i], places.of_item(i, w)) for i in range(n)] for w in range(W)]
        model.minimize(busy_span(model, workers, horizon, lower_bound))
    else:
        model.minimize(makespan)
    solver = make_solver(time_limit, num_workers, seed)
    collector = _Collector(places, owner, start, timed, report=report, bounded=proves)
    status, interrupted = run_solver(solver, model, collector)
    wall = time.perf_counter() - begin
    name = solver.status_name(status)
    if status == cp_model.OPTIMAL and not proves:
        name = "FEASIBLE"  # optimal within the window or the period only
    bound = int(solver.best_objective_bound) if proves else 0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE) or not collector.solutions:
        if status == cp_model.INFEASIBLE and proves:
            bound = horizon
        return Solved(name, None, None, None, None, bound, wall, interrupted=interrupted)
    solutions = collector.solutions
    if score is None:
        compute, weight, starts, objective = solutions[-1]
        return Solved(name, starts, compute, weight, objective, bound, wall, interrupted=interrupted)
    scored = [(score(c, w, st), obj, c, w, st) for c, w, st, obj in solutions]
    value, objective, compute, weight, starts = min(scored, key=lambda row: (row[0], row[1]))
    return Solved(name, starts, compute, weight, objective, bound, wall, value, interrupted)


def _search_order(model, problem, start) -> None:
    """Under a memory limit or budget, CP-SAT's fixed-search worker takes the item that can start
    earliest and tries the lower half of its start times first: a list scheduler whose dead ends
    the solver's propagation and clause learning correct, and a complete search that can prove.
    Without a limit no order is given and CP-SAT's searches choose their own, which prove the
    unlimited small cases where this order did not (what each gave: docs/planning.md, "Small
    problems").  A search order adds
    no constraint: every bound is the model's."""
    if problem.memory_limited:
        model.add_decision_strategy(start, cp_model.CHOOSE_LOWEST_MIN, cp_model.SELECT_LOWER_HALF)


def _transfers(model, timed: TimedProblem, places: _Places, start, end) -> None:
    """Every dependency: its destination starts after its source ends, plus the time its data
    takes (:meth:`TimedProblem.delays`' rule, at the worst link) when the two run apart."""
    edges = timed.data_edges()
    comm = timed.comm.max(axis=(0, 1))
    stash = timed.stash.max(axis=(0, 1))
    outputs = dataflow.output_bytes(comm, timed.problem.stage_graph)  # its first consumer's input moves so
    is_stash = edges.moves == TRANSFER_KINDS.index("stash")
    for u, v, s, moves, stashed in zip(edges.src.tolist(), edges.dst.tolist(), edges.stage.tolist(),
                                       edges.moves.tolist(), is_stash.tolist()):
        if stashed and timed.direction[v] == BACKWARD_WEIGHT:
            _weight_stash(model, timed, places, u, v, start, end, (int(stash[s]), int(outputs[s])))
            continue
        delay = int(stash[s] if stashed else comm[s])
        away = places.away(u, v) if moves != dataflow.MOVES_NOTHING and delay else False
        if away is False:
            model.add(start[v] >= end[u])
        else:
            model.add(start[v] >= end[u] + delay * away)


def _weight_stash(model, timed: TimedProblem, places: _Places, u: int, v: int, start, end,
                  delays: tuple[int, int]) -> None:
    """A weight pass v after its input pass u: apart from u (in every schedule's model; the other
    classes keep them together), it waits for each part of its stash it needs
    (:func:`unisched.dataflow.stash_sources`), ``delays`` ticks each: its stage's inputs where it
    runs away from the forward, its output gradient where it runs away from a consumer's input
    pass.  Each part alone is waited for: a bound on their sum."""
    items = timed.problem.items
    model.add(start[v] >= end[u])
    if places.away(u, v) is False:
        return
    forward, consumers = dataflow.stash_sources(items.work(v), timed.problem.stage_graph)
    inputs, output = delays
    parts = ([(forward, inputs)] if forward is not None else []) + [(consumer, output) for consumer in consumers]
    for source, delay in parts:
        if delay:
            where = items.id(source.batch, source.stage, source.direction)
            model.add(start[v] >= end[u] + delay).only_enforce_if([places.away(u, v), places.away(where, v)])


def _weights(model, timed: TimedProblem, places: _Places, owner, start, end, makespan, fetch, reduce) -> None:
    """A pass away from its stage's weight workers starts after the fetch arrives; the gradient
    pass's worker returns the gradient, and the stage's weight workers all-reduce it (``reduce``:
    per stage, its ticks), within the step."""
    problem = timed.problem
    W, S, B = problem.shape
    gradient = dataflow.gradient_pass(problem.split_backward)
    for i in range(problem.num_items):
        s = int(timed.stage[i])
        if timed.direction[i] == gradient and not isinstance(reduce[s], int):
            model.add(makespan >= end[i] + reduce[s])
        if not fetch[s]:
            continue
        for w in range(W):
            away = [places.of_item(i, w), owner[s, w].Not()]
            model.add(start[i] >= int(fetch[s])).only_enforce_if(away)
            if timed.direction[i] == gradient:
                model.add(makespan >= end[i] + int(fetch[s]) + reduce[s]).only_enforce_if(away)


def _allreduces(model, timed: TimedProblem, owner, table: np.ndarray) -> list:
    """Per stage, the ticks of its end-of-step all-reduce among its weight workers (``table``:
    :attr:`TimedProblem.allreduce`, by how many): 0 where it never takes time."""
    W, S, _ = timed.shape
    reduce: list = []
    for s in range(S):
        if not table[s].any():
            reduce.append(0)
            continue
        holders = model.new_int_var(1, W, f"holders{s}")
        model.add(holders == sum(owner[s, w] for w in range(W)))
        ticks = model.new_int_var(0, int(table[s].max()), f"reduce{s}")
        model.add_element(holders, table[s].tolist(), ticks)
        reduce.append(ticks)
    return reduce


def _memory(model, timed: TimedProblem, places: _Places, owner, held, start, end, horizon,
            asap_replay: bool) -> None:
    """Live stashes on the worker of the pass that frees them, within each worker's stash limit
    and what its weights and optimizer state leave of its budget."""
    problem = timed.problem
    W, S, B = problem.shape
    if problem.memory_limit is None and problem.memory_budget is None:
        return
    _, unit = memory_demands(timed)
    limits = problem.limits()
    caps = []
    budget = problem.memory_budget
    for w in range(W):
        limit = capacity(unit, limits[w]) if np.isfinite(limits[w]) else None
        if budget is None:
            caps.append(limit)
            continue
        room = capacity(unit, np.broadcast_to(np.asarray(budget, dtype=float), (W,))[w])
        weights = _weight_need(model, problem, unit, owner, held, w)
        model.add(weights <= room)
        if not problem.costs.has_sizes:
            caps.append(limit)
            continue
        cap = model.new_int_var(0, room if limit is None else min(room, limit), f"cap{w}")
        model.add(cap <= room - weights)
        caps.append(cap)
    earliest = earliest_forwards(timed)
    per_worker: list[tuple[list, list]] = [([], []) for _ in range(W)]
    everything, amounts = [], []
    claims: dict = {}
    for s, b, f, r, demand in live_stashes(timed):
        size = model.new_int_var(0, horizon, f"live{r}")
        if f not in claims:
            claims[f] = live_start(model, earliest, s, f, start, asap_replay and places.away(f, r))
        begin = claims[f]
        everything.append(model.new_interval_var(begin, size, end[r], f"l{r}"))
        amounts.append(demand)
        for w in range(W):
            per_worker[w][0].append(model.new_optional_interval_var(begin, size, end[r], places.of_item(r, w),
                                                                    f"l{r},{w}"))
            per_worker[w][1].append(demand)
    for (intervals, demand), cap in zip(per_worker, caps):
        if cap is not None and (not isinstance(cap, int) or sum(demand) > cap):
            model.add_cumulative(intervals, demand, cap)
    if budget is None and all(c is not None for c in caps) and sum(amounts) > sum(caps):
        model.add_cumulative(everything, amounts, sum(caps))


def _weight_need(model, problem, unit, owner, held, w: int):
    """Worker w's bytes of weights, gradients and optimizer state (in ``unit``), as
    :meth:`PlanProblem.weight_need` counts them: with one weight worker per stage, the
    workers returning it a gradient are the other holders."""
    W, S, B = problem.shape
    weights, optimizer = problem.weight_bytes(), problem.owner_bytes() - problem.weight_bytes()
    total = 0
    for s in range(S):
        returning = model.new_int_var(0, W - 1, f"returning{w},{s}")
        model.add(returning >= sum(held[v, s] for v in range(W)) - 1 - (W - 1) * (1 - owner[s, w]))
        total += unit(2 * weights[s]) * held[w, s] + unit(optimizer[s]) * owner[s, w] + unit(weights[s]) * returning
    return total


def canonical(timed: TimedProblem, hint: Incumbent, places: _Places) -> Incumbent:
    """Relabel micro-batches (by first-stage start) and workers (in the order ``places`` numbers
    them: :meth:`_Places.number_workers`) so the hint satisfies the model's symmetry breaking."""
    problem = timed.problem
    W = problem.shape.num_workers
    grid = problem.item_grid()
    first = grid[:, problem.stage_graph.sources[0], problem.dirs.index(FORWARD)]
    order = sorted(range(len(grid)), key=lambda b: (hint.starts[first[b]], b))
    compute, weight, starts = (np.empty_like(a) for a in (hint.compute, hint.weight, hint.starts))
    for relabelled, a in ((compute, hint.compute), (weight, hint.weight), (starts, hint.starts)):
        relabelled[grid] = a[grid[order]]
    if timed.uniform and problem.identical_workers:
        where = {places.group(i): int(compute[i]) for i in range(problem.num_items) if places.placed(i)}
        label: dict[int, int] = {}
        for w in [where[g] for g in places.in_order()] + list(range(W)):
            label.setdefault(w, len(label))
        relabel = np.array([label[w] for w in range(W)])
        compute, weight = relabel[compute], relabel[weight]
    return replace(hint, compute=compute, weight=weight, starts=starts)


def _add_hint(model, timed: TimedProblem, hint: Incumbent, places: _Places, owner, held, start, makespan) -> None:
    problem = timed.problem
    W, S, B = problem.shape
    where = {places.group(i): int(hint.compute[i]) for i in range(problem.num_items)}
    for (s, b, g, w), literal in places.x.items():
        model.add_hint(literal, where[s, b, g] == w)
    holders = dataflow.replicas(timed.stage, hint.weight, S)
    for s in range(S):
        for w in range(W):
            model.add_hint(owner[s, w], w in holders[s])
            model.add_hint(held[w, s], w in holders[s] or any(where[g] == w for g in where
                                                              if g[0] == s and g[2] in places.groups))
    for (gu, gv), literal in places.apart.items():
        model.add_hint(literal, where[gu] != where[gv])
    for i, v in enumerate(start):
        model.add_hint(v, int(hint.starts[i]))
    model.add_hint(makespan, int(hint.makespan))


def fits(timed: TimedProblem, compute, weight, scheme: str) -> bool:
    """Whether a mapping lies in the class ``scheme``: one weight worker per stage, and all passes of
    a (stage, batch) on one worker (paired) or all its backward passes on one (whole scheme); every
    mapping lies in every schedule's."""
    if scheme == EVERY:
        return True
    problem = timed.problem
    grid = problem.item_grid()
    per_pair = np.asarray(compute)[grid]
    backward = per_pair if scheme == PAIRED else per_pair[:, :, 1:]
    if np.any(backward != backward[:, :, :1]):
        return False
    owners = np.asarray(weight)[grid]
    return not np.any(owners != owners[:1, :, :1])


def incumbent_from(timed: TimedProblem, compute, weight, starts, scheme: str = PAIRED) -> Incumbent | None:
    """A hint for the mapping model over ``scheme``, if the schedule fits it (:func:`fits`), with the
    makespan the model's rules give its start times (the returned gradients and the all-reduces
    among replicas).  Its weight workers are read as given: a plan's, as the
    simulator reads them (:func:`unisched.plan.problem.mapping_of`)."""
    problem = timed.problem
    W, S, B = problem.shape
    compute = np.asarray(compute, dtype=np.int64)
    weight = np.asarray(weight, dtype=np.int64)
    if not fits(timed, compute, weight, scheme):
        return None
    starts = np.asarray(starts, dtype=np.int64)
    ends = starts + timed.duration[np.arange(len(compute)), compute]
    fetch = timed.fetch.max(axis=(0, 1))
    returning = dataflow.returns_gradient(timed.direction, compute, weight, problem.split_backward)
    gradient = timed.direction == dataflow.gradient_pass(problem.split_backward)
    holders = [len(h) for h in dataflow.replicas(timed.stage, weight, S)]  # one per stage outside EVERY
    reduce = timed.allreduce[np.arange(S), holders]
    tails = np.where(returning, fetch[timed.stage], 0) + np.where(gradient, reduce[timed.stage], 0)
    makespan = int(np.max(ends + tails))
    objective = None
    if problem.objective == "span":
        first, last = np.full(W, np.iinfo(np.int64).max), np.full(W, np.iinfo(np.int64).min)
        np.minimum.at(first, compute, starts)
        np.maximum.at(last, compute, ends)
        used = np.isin(np.arange(W), compute)
        objective = int((last[used] - first[used]).max())
    return Incumbent(compute, weight, starts, makespan, objective=objective)
