"""Anytime search for plans too large for the CP-SAT models.

The idea is the zero-bubble paper's automatic scheduling, followed by local
search, all on fixed mappings taken from the named strategies:

1. **Seeds.** Every named strategy the family search could run gives a
   mapping (who computes each item) and its simulated per-worker orders;
   the planner's constructed mappings and the named strategies whose greedy
   replay deadlocks under the memory limit give mappings without orders.
2. **Construction** (:func:`construct`). For each seed mapping, a list
   scheduler walks time forward: a free worker runs a ready backward (the
   input-gradient pass) first; else a forward, while it has fewer forwards in
   flight than its warm-up allows and its memory has room (and, in the
   warm-up, if it ends before a backward known to be on its way arrives: a
   forward that delays the first backward delays it on every stage below;
   the paper's heuristic has the same choice); else a weight pass when the
   gap before its next backward or forward is long enough, or when memory or
   the end of the step asks for it.  A grid of warm-ups, gap thresholds,
   fits and memory reservations (:class:`Rule`) gives as many schedules.
3. **Refinement.** On problems small enough, CP-SAT reorders the best
   construction (:func:`unisched.plan.order.solve_order`, hinted with it), as
   the paper refines its heuristic's schedule with an ILP.
4. **Improvement** (:func:`improve`). Local search on the per-worker orders
   of the best few: fill an idle gap with a later item that could have run
   there, or move an item (weight passes most often) a few places in its
   worker's order; keep the move when the schedule is no longer, and prefer
   the worker that sets the objective.

Every candidate is timed as the CP-SAT models time fixed per-worker orders:
each item starts when its worker's previous item has ended and its inputs
have arrived, after the fixed transfer delays of :class:`TimedProblem`
(:func:`evaluate`, compiled with numba), and it is rejected if a worker's
stashes exceed the memory limit.  Where links carry latency only, this is
the simulator's replay item for item; the simulator's compiled engine
(:mod:`unisched.simulate.fast`) is not called instead because it books link
contention and parks forwards that do not fit in memory (another schedule
than the one being judged), and because each move would rebuild its problem
(on 6,144 items its run alone takes about 15 times one evaluation, and
building the problem as long again).  The best is replayed by
:func:`unisched.simulate` and reported as that replay, beside the named
strategies' own replays, so the plan is never worse than the best of them.

Anytime: the search stops at its time limit (less the time two simulations
of the step took, kept for that replay and its measures), on Ctrl-C (the best plan so far is
returned) or as soon as the best meets the lower bound of
:mod:`unisched.plan.bounds` (the replica ramp, which holds for every schedule a
plan can hold, and the ramp where the best lies in the whole scheme, for
which alone it holds).  ``objective="span"`` minimizes the longest
per-worker busy span (first item's start to last item's end), the measure of
the zero-bubble paper's bubble rate; the default is the step's latency.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import cache
from heapq import heappop, heappush
from typing import Iterable, Sequence, TextIO

import numpy as np

from unisched.errors import UniSchedError
from unisched.metrics import gap
from unisched.strategy import Strategy
from unisched.work import BACKWARD_WEIGHT, FORWARD

from unisched.plan.bounds import ANY_SCHEDULE, every_ramp, ramp, shape_bounds
from unisched.plan.family import (NOT_SIMULATED, Member, constructed_members, measures, registry_members, search_family,
                                  unplannable)
from unisched.plan.mapping import EVERY, WHOLE_SCHEME, claimable, fits
from unisched.plan.order import capacity as stash_capacity
from unisched.plan.order import live_stashes, memory_demands, releases, solve_order, step_tails
from unisched.plan.planfile import Plan, objective_value
from unisched.plan.problem import (PlanInputError, PlanProblem, TimedProblem, check_plan_size, check_time_limit,
                                   mapping_of, rows_of)
from unisched.plan.schedule import Schedule

SEARCH_FROM_ITEMS = 500
"""From this many work items on, ``unisched plan`` runs this search instead of the CP-SAT models."""
FAMILY_SHARE = 0.3
"""Share of the time limit the named strategies' simulations may take (large steps simulate slowly)."""
CONSTRUCT_SHARE = 0.25
"""Share of the time left after them that the constructions may take."""
REFINE_SHARE = 0.5
"""Share of that time CP-SAT may take to reorder the best construction (on problems of at most
:data:`REFINE_ITEMS` items); local search has the rest."""
REFINE_ITEMS = 3000
"""The most work items whose best construction CP-SAT reorders (its order model grows with items squared)."""
FIRST_RULES = 4
"""Rules every seed mapping is tried with before the rest of the grid goes to the most promising."""
NO_LIMIT = np.iinfo(np.int64).max // 4
"""No limit: a worker's stash capacity, or its warm-up, when nothing bounds it."""


@dataclass(frozen=True)
class Rule:
    """One setting of the list scheduler (:func:`construct`).

    ``warmup``: forwards a worker may run ahead of its backwards, as
    ``(scale, extra)``: ``scale * (W - w) + extra`` on worker w (None: as many
    as memory allows).  ``fill``: a weight pass runs in an idle gap at least
    ``fill`` times its length (inf: only when memory or the end of the step
    asks).  ``fit``: a forward runs only if it ends before the next backward
    known to be on its way arrives: ``"always"``, ``"warm-up"`` (until the
    worker's first backward) or ``"never"``.  ``later_stages_first``: among a worker's stages,
    later ones first (for V and interleaved placements).  ``reserve``: a
    forward claims memory for the stashes of this many stages of its
    micro-batch, its own and the next ones, on the workers that will keep
    them (0: all, from the micro-batch's first forward), so that those
    forwards do not wait for memory: where a worker keeps stashes of several
    stages, claiming stash by stash (1) can fill every worker with
    micro-batches none of which can go on, and reserving everything at once
    lets few micro-batches in."""

    warmup: tuple[float, int] | None = None
    fill: float = 1.0
    fit: str = "never"
    later_stages_first: bool = False
    reserve: int = 1

    def __post_init__(self):
        if self.fit not in FITS:
            raise ValueError(f"Rule.fit must be one of {', '.join(FITS)}, not {self.fit!r}")

    def caps(self, num_workers: int) -> np.ndarray:
        if self.warmup is None:
            return np.full(num_workers, NO_LIMIT)
        scale, extra = self.warmup
        return np.maximum(1, np.ceil(scale * (num_workers - np.arange(num_workers))).astype(np.int64) + extra)

    def label(self) -> str:
        warm = "memory" if self.warmup is None else f"{self.warmup[0]:g}(W-w){self.warmup[1]:+d}"
        return f"warm-up {warm}, fill {self.fill:g}" + ("" if self.fit == "never" else f", fit {self.fit}") + (
            ", later stages first" if self.later_stages_first else "") + (
            "" if self.reserve == 1 else ", memory reserved " + (f"{self.reserve} stages ahead" if self.reserve
                                                                 else "for the whole micro-batch"))


FITS = ("warm-up", "never", "always")
"""When a forward must end before a backward on its way arrives (:class:`Rule`)."""


def rules(split_backward: bool, several_stages: bool) -> list[Rule]:
    """The grid the constructions run over (weight-pass thresholds only with a split backward;
    stage orders and reservations only where a worker computes several stages), the likeliest
    first: warm-up 2(W-w), fill 0.25 or 0, fit in the warm-up gives the paper's ZB-2p bubble
    rate on eleven of the twelve settings of its table, and the same without the fit is as good
    or better where p is at most 16; a fit beyond the warm-up comes last."""
    warmups = [(2.0, 0), None, (2.0, -1), (1.75, 0), (1.0, 0), (1.5, 0), (1.0, 1), (1.25, 0), (2.5, 0), (3.0, 0)]
    fills = [0.25, 0.0, 0.5, 0.75, 1.0, math.inf] if split_backward else [math.inf]
    orders = [False, True] if several_stages else [False]
    reserves = [0, 2, 4, 1] if several_stages else [1]
    return [Rule(w, f, fit, o, r) for fits in (FITS[:2], FITS[2:]) for w in warmups for f in fills for fit in fits
            for r in reserves for o in orders]


# ---------------------------------------------------------------------- one mapping, timed
@dataclass(eq=False)
class Mapped:
    """A planning problem with its mapping fixed, in CP-SAT's integer ticks: what
    :func:`evaluate` and :func:`construct` need (durations, dependencies with
    their transfer delays, release times, step tails, stashes and the limit)."""

    timed: TimedProblem
    label: str
    compute: np.ndarray
    weight: np.ndarray
    duration: np.ndarray
    release: np.ndarray
    tail: np.ndarray
    succ_ptr: np.ndarray
    succ_idx: np.ndarray
    succ_delay: np.ndarray
    num_preds: np.ndarray
    stash_forward: np.ndarray
    stash_release: np.ndarray
    stash_demand: np.ndarray
    capacity: np.ndarray
    """Each worker's stash limit in the stashes' integer unit (:data:`NO_LIMIT`: none)."""

    @classmethod
    def build(cls, timed: TimedProblem, compute, weight, label: str) -> "Mapped":
        compute = np.asarray(compute, dtype=np.int64)
        weight = np.asarray(weight, dtype=np.int64)
        n = len(compute)
        edges = timed.data_edges()
        delay = timed.delays(edges, compute).astype(np.int64)
        order = np.argsort(edges.src, kind="stable")
        succ_ptr = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(edges.src, minlength=n), out=succ_ptr[1:])
        problem = timed.problem
        stashes = np.zeros((3, 0), dtype=np.int64)
        capacity = np.full(problem.shape.num_workers, NO_LIMIT, dtype=np.int64)
        limits = problem.stash_limits(compute, weight)
        if limits is not None:
            _, unit = memory_demands(timed)
            limits = np.broadcast_to(np.asarray(limits, dtype=float), capacity.shape)
            capacity = np.array([stash_capacity(unit, limit) if np.isfinite(limit) else NO_LIMIT for limit in limits],
                                dtype=np.int64)
            rows = live_stashes(timed)
            stashes = np.array([(f, r, d) for _, _, f, r, d in rows], dtype=np.int64).reshape(-1, 3).T
        return cls(
            timed=timed, label=label, compute=compute, weight=weight,
            duration=timed.duration[np.arange(n), compute].astype(np.int64),
            release=releases(timed, compute, weight), tail=step_tails(timed, compute, weight).astype(np.int64),
            succ_ptr=succ_ptr, succ_idx=edges.dst[order].astype(np.int64), succ_delay=delay[order],
            num_preds=np.bincount(edges.dst, minlength=n).astype(np.int64),
            stash_forward=stashes[0], stash_release=stashes[1], stash_demand=stashes[2], capacity=capacity,
        )

    @property
    def problem(self) -> PlanProblem:
        return self.timed.problem

    @property
    def limited(self) -> bool:
        return bool(np.any(self.capacity < NO_LIMIT))

    @property
    def num_workers(self) -> int:
        return self.problem.shape.num_workers


@dataclass(eq=False)
class Timing:
    """What :func:`evaluate` found for one set of orders (ticks)."""

    start: np.ndarray
    end: np.ndarray
    ready: np.ndarray
    """When each item's inputs are there (and its weights): the earliest it could start."""
    score: tuple[int, float]
    """(objective, tie-break): the tie-break (the sum of the workers' finishing
    times, or of their squared spans) lets the local search move across plateaus."""
    busiest: int
    """The worker that sets the objective."""


def evaluate(m: Mapped, orders: Sequence[np.ndarray], objective: str = "latency") -> Timing | None:
    """These fixed per-worker orders timed with every item as early as its worker's order and its
    inputs allow (the simulator's replay where links carry latency only), or None when the
    orders contradict the dependencies or exceed the memory limit."""
    kernels = _kernels()
    prev, nxt = _sequence(orders, len(m.compute))
    start, end, ready, ok = kernels.asap(m.duration, m.release, m.succ_ptr, m.succ_idx, m.succ_delay, m.num_preds,
                                         prev, nxt)
    if not ok:
        return None
    if m.limited and not kernels.memory_ok(start, end, m.stash_forward, m.stash_release, m.stash_demand,
                                                  m.compute, m.capacity, m.num_workers):
        return None
    best, total, busiest = kernels.score(start, end, m.tail, m.compute, m.num_workers, objective == "span")
    return Timing(start, end, ready, (int(best), float(total)), int(busiest))


def _sequence(orders: Sequence[np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Each item's predecessor and successor in its worker's order (-1: none)."""
    prev = np.full(n, -1, dtype=np.int64)
    nxt = np.full(n, -1, dtype=np.int64)
    for order in orders:
        if len(order) > 1:
            prev[order[1:]] = order[:-1]
            nxt[order[:-1]] = order[1:]
    return prev, nxt


# ---------------------------------------------------------------------- compiled kernels
def _asap(duration, release, succ_ptr, succ_idx, succ_delay, num_preds, prev, nxt):
    """Earliest start of every item given its data dependencies and its
    worker's order, and when its data alone would let it start (``ready``);
    ok is False when they form a cycle."""
    n = duration.shape[0]
    waiting = num_preds.copy()
    start = release.copy()
    ready = release.copy()
    end = np.zeros(n, dtype=np.int64)
    stack = np.empty(n, dtype=np.int64)
    top = 0
    for i in range(n):
        if prev[i] >= 0:
            waiting[i] += 1
        if waiting[i] == 0:
            stack[top] = i
            top += 1
    done = 0
    while top > 0:
        top -= 1
        u = stack[top]
        done += 1
        finish = start[u] + duration[u]
        end[u] = finish
        for k in range(succ_ptr[u], succ_ptr[u + 1]):
            v = succ_idx[k]
            arrive = finish + succ_delay[k]
            if arrive > start[v]:
                start[v] = arrive
            if arrive > ready[v]:
                ready[v] = arrive
            waiting[v] -= 1
            if waiting[v] == 0:
                stack[top] = v
                top += 1
        v = nxt[u]
        if v >= 0:
            if finish > start[v]:
                start[v] = finish
            waiting[v] -= 1
            if waiting[v] == 0:
                stack[top] = v
                top += 1
    return start, end, ready, done == n


def _worker_score(start, end, tail, compute, num_workers, span):
    """(objective, tie-break, the worker that sets the objective): the latest finish (with
    tails, in ticks) and the sum of the workers' finishes, or the longest busy span and the
    sum of squared spans."""
    first = np.full(num_workers, np.iinfo(np.int64).max)
    last = np.zeros(num_workers, dtype=np.int64)
    for i in range(start.shape[0]):
        w = compute[i]
        if start[i] < first[w]:
            first[w] = start[i]
        finish = end[i] if span else end[i] + tail[i]
        if finish > last[w]:
            last[w] = finish
    best, busiest, total = 0, 0, 0.0
    for w in range(num_workers):
        value = last[w]
        if span:
            value = last[w] - first[w] if last[w] > 0 else 0
            total += float(value) * float(value)
        else:
            total += float(value)
        if value > best:
            best, busiest = value, w
    return best, total, busiest


def _memory_ok(start, end, forward, release, demand, compute, capacity, num_workers):
    """Whether every worker's live stashes stay within ``capacity``: a stash
    share is live on its freeing pass's worker from the forward's start to that
    pass's end (a share freed at an instant is free for a forward starting then)."""
    k = forward.shape[0]
    times = np.empty(2 * k, dtype=np.int64)
    for j in range(k):
        times[2 * j] = 2 * start[forward[j]] + 1
        times[2 * j + 1] = 2 * end[release[j]]
    order = np.argsort(times, kind="mergesort")
    level = np.zeros(num_workers, dtype=np.int64)
    for e in order:
        j = e // 2
        w = compute[release[j]]
        if e % 2 == 0:
            level[w] += demand[j]
            if level[w] > capacity[w]:
                return False
        else:
            level[w] -= demand[j]
    return True


@dataclass(frozen=True)
class _Kernels:
    asap: object
    memory_ok: object
    score: object


@cache
def _kernels() -> _Kernels:
    """The kernels compiled by numba on first use (plain Python without numba)."""
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency
        return _Kernels(_asap, _memory_ok, _worker_score)
    jit = numba.njit(cache=True, nogil=True)
    return _Kernels(jit(_asap), jit(_memory_ok), jit(_worker_score))


# ---------------------------------------------------------------------- construction
def construct(m: Mapped, rule: Rule) -> list[np.ndarray] | None:
    """Per-worker orders made by walking time forward with ``rule`` (see the
    module docstring), or None when the rule leaves every worker waiting."""
    return _Builder(m, rule).run()


class _Builder:
    """The list scheduler of :func:`construct`: one decision each time a worker is free."""

    def __init__(self, m: Mapped, rule: Rule):
        problem = m.problem
        W = m.num_workers
        batch, stage, direction = problem.items.arrays()
        self.m, self.rule = m, rule
        self.kind = np.where(direction == FORWARD, 0, np.where(direction == BACKWARD_WEIGHT, 2, 1)).tolist()
        sign = -1 if rule.later_stages_first else 1
        self.key = list(zip(batch.tolist(), (sign * stage).tolist()))
        self.worker = m.compute.tolist()
        self.duration = m.duration.tolist()
        self.arrival = m.release.tolist()
        self.waiting = m.num_preds.tolist()
        self.succ_ptr, self.succ_idx, self.succ_delay = m.succ_ptr.tolist(), m.succ_idx.tolist(), m.succ_delay.tolist()
        self.cap = rule.caps(W).tolist()
        self.free = [0] * W
        self.ahead = [0] * W  # forwards run minus first backwards run, per worker
        self.warming = [True] * W  # no backward run yet
        self.left = np.bincount(m.compute[direction != BACKWARD_WEIGHT], minlength=W).tolist()
        self.ready: list[list[list[int]]] = [[[], [], []] for _ in range(W)]
        self.orders: list[list[int]] = [[] for _ in range(W)]
        self.events: list[tuple[int, int]] = []
        self.idle = [False] * W
        self._memory_tables(m)

    def _memory_tables(self, m: Mapped) -> None:
        """Per forward, its claims (holder, amount); per freeing pass, its release."""
        n = len(m.compute)
        self.claims: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self.frees: list[tuple[int, int] | None] = [None] * n
        items = m.problem.items
        batch, stage, _ = items.arrays()
        ahead = self.rule.reserve or m.problem.shape.num_stages
        claimer = items.id(batch[m.stash_forward], np.maximum(0, stage[m.stash_forward] - ahead + 1), FORWARD)
        for c, r, d in zip(claimer.tolist(), m.stash_release.tolist(), m.stash_demand.tolist()):
            holder = self.worker[r]
            self.claims[c].append((holder, d))
            self.frees[r] = (holder, d)
        self.capacity = m.capacity.tolist()
        self.limited = m.limited
        self.live = [0] * m.num_workers
        self.releases: list[list[tuple[int, int]]] = [[] for _ in range(m.num_workers)]

    def run(self) -> list[np.ndarray] | None:
        for i, count in enumerate(self.waiting):
            if count == 0:
                self._make_ready(i)
        for w in range(len(self.free)):
            heappush(self.events, (0, w))
        while self.events:
            t, w = heappop(self.events)
            if t < self.free[w]:
                continue
            self._decide(w, t)
        if any(count != -1 for count in self.waiting):
            return None
        return [np.array(order, dtype=np.int64) for order in self.orders]

    def _make_ready(self, item: int) -> None:
        w = self.worker[item]
        self.ready[w][self.kind[item]].append(item)
        if self.idle[w]:
            self.idle[w] = False
            heappush(self.events, (max(self.free[w], self.arrival[item]), w))

    def _level(self, holder: int, t: int) -> int:
        releases = self.releases[holder]
        while releases and releases[0][0] <= t:
            self.live[holder] -= heappop(releases)[1]
        return self.live[holder]

    def _fits(self, item: int, t: int) -> bool:
        if not self.limited:
            return True
        need: dict[int, int] = {}
        for holder, amount in self.claims[item]:
            need[holder] = need.get(holder, 0) + amount
        return all(self._level(h, t) + a <= self.capacity[h] for h, a in need.items())

    def _decide(self, w: int, t: int) -> None:
        forwards, backwards, weights = self.ready[w]
        arrival, key = self.arrival, self.key
        now_b = [i for i in backwards if arrival[i] <= t]
        if now_b:
            return self._run(w, min(now_b, key=key.__getitem__), t)
        may_forward = self.ahead[w] < self.cap[w]
        next_b = min((arrival[i] for i in backwards), default=math.inf)
        fitting = [i for i in forwards if may_forward and self._fits(i, t)]
        fit = self.rule.fit == "always" or (self.rule.fit == "warm-up" and self.warming[w])
        now_f = [i for i in fitting if arrival[i] <= t and (not fit or t + self.duration[i] <= next_b)]
        if now_f:
            return self._run(w, min(now_f, key=key.__getitem__), t)
        now_w = [i for i in weights if arrival[i] <= t]
        if now_w:
            item = min(now_w, key=key.__getitem__)
            blocked = any(not self._fits(i, t) for i in forwards if arrival[i] <= t) and may_forward
            upcoming = min([next_b] + [arrival[i] for i in fitting], default=math.inf)
            if blocked or self.left[w] == 0 or upcoming - t >= self.rule.fill * self.duration[item]:
                return self._run(w, item, t)
        self._wait(w, t)

    def _wait(self, w: int, t: int) -> None:
        """Look again at the next known arrival or memory release; else when new work arrives."""
        times = [self.arrival[i] for kind in self.ready[w] for i in kind if self.arrival[i] > t]
        times += [r[0] for r in self.releases[w] if r[0] > t]
        if times:
            heappush(self.events, (min(times), w))
        self.idle[w] = True

    def _run(self, w: int, item: int, t: int) -> None:
        self.ready[w][self.kind[item]].remove(item)
        self.waiting[item] = -1
        self.orders[w].append(item)
        finish = t + self.duration[item]
        self.free[w] = finish
        kind = self.kind[item]
        if kind == 0:
            self.ahead[w] += 1
            for holder, amount in self.claims[item]:
                self._level(holder, t)
                self.live[holder] += amount
        elif kind == 1:
            self.ahead[w] -= 1
            self.warming[w] = False
        if kind != 2:
            self.left[w] -= 1
        if self.frees[item] is not None:
            holder, amount = self.frees[item]
            heappush(self.releases[holder], (finish, amount))
            self._wake(holder, finish)
        for k in range(self.succ_ptr[item], self.succ_ptr[item + 1]):
            nxt = self.succ_idx[k]
            self.arrival[nxt] = max(self.arrival[nxt], finish + self.succ_delay[k])
            self.waiting[nxt] -= 1
            if self.waiting[nxt] == 0:
                self._make_ready(nxt)
        self.idle[w] = False
        heappush(self.events, (finish, w))

    def _wake(self, holder: int, when: int) -> None:
        for w in range(len(self.idle)):
            if self.idle[w] and self.ready[w][0]:
                self.idle[w] = False
                heappush(self.events, (max(self.free[w], when), w))


# ---------------------------------------------------------------------- improvement
@dataclass(eq=False)
class Start:
    """A point the local search works from: a mapping, its orders and their timing."""

    m: Mapped
    orders: list[np.ndarray]
    timing: Timing
    how: str
    stale: int = 0
    """Moves tried since the last one that made it better."""


def improve(start: Start, objective: str, moves: int, rng: np.random.Generator, deadline: float = math.inf) -> bool:
    """Try ``moves`` local moves on ``start`` (changed in place), fewer if the ``deadline`` (a
    ``time.perf_counter()`` value) comes first; whether it got strictly better.

    A move works on one worker's order (the worker that sets the objective
    half the time): either it fills an idle gap, moving there a later item
    whose inputs were there before the gap began (a weight pass most often),
    or it moves an item a few places earlier or later.  It is kept when the
    schedule is valid and no worse (ties too, so the search drifts across
    plateaus)."""
    m, orders = start.m, start.orders
    W = m.num_workers
    weights = m.problem.items.arrays()[2] == BACKWARD_WEIGHT
    better = False
    for _ in range(moves):
        if time.perf_counter() > deadline:
            break
        w = start.timing.busiest if rng.random() < 0.5 else int(rng.integers(W))
        order = orders[w]
        if len(order) < 2:
            continue
        move = _fill_gap(order, start.timing, weights, rng) if rng.random() < 0.5 else None
        if move is None:
            move = _shift(order, weights, rng, reach=max(2, 2 * W))
        if move is None:
            continue
        i, j = move
        orders[w] = np.insert(np.delete(order, i), j, order[i])
        timing = evaluate(m, orders, objective)
        if timing is not None and timing.score <= start.timing.score:
            better = better or timing.score[0] < start.timing.score[0]
            start.stale = 0 if timing.score < start.timing.score else start.stale + 1
            start.timing = timing
        else:
            orders[w] = order
            start.stale += 1
    return better


def _fill_gap(order: np.ndarray, timing: Timing, weights: np.ndarray, rng: np.random.Generator):
    """(from, to) positions that move into an idle gap of this order a later item that could
    have started when the gap began, or None when the order has no such gap."""
    begins = timing.end[order[:-1]]
    gaps = np.flatnonzero(timing.start[order[1:]] > begins) + 1
    if not len(gaps):
        return None
    g = int(gaps[rng.integers(len(gaps))])
    later = np.arange(g + 1, len(order))
    fits = later[timing.ready[order[later]] <= timing.end[order[g - 1]]]
    if not len(fits):
        return None
    preferred = fits[weights[order[fits]]]
    pool = preferred if len(preferred) and rng.random() < 0.7 else fits
    return int(pool[rng.integers(len(pool))]), g


def _shift(order: np.ndarray, weights: np.ndarray, rng: np.random.Generator, reach: int):
    """(from, to) positions a few places apart, the item a weight pass more often than not."""
    candidates = np.flatnonzero(weights[order]) if rng.random() < 0.6 else np.zeros(0, dtype=np.int64)
    i = int(candidates[rng.integers(len(candidates))]) if len(candidates) else int(rng.integers(len(order)))
    j = int(np.clip(i + rng.integers(-reach, reach + 1), 0, len(order) - 1))
    return None if i == j else (i, j)


# ---------------------------------------------------------------------- the search
def search(
    problem: PlanProblem,
    *,
    time_limit: float = 10.0,
    members: Iterable[tuple[str, Strategy | None, str]] | None = None,
    progress: TextIO | None = None,
    seed: int = 0,
) -> Plan:
    """The best plan found within ``time_limit`` seconds (see the module docstring).

    It minimizes the problem's objective; ``members`` replaces the
    registry's strategies as seeds; ``progress`` gets a line per improvement
    (at most two a second) and one when the search ends.  Ctrl-C ends the
    search early with the best plan so far."""
    objective = problem.objective
    check_time_limit(time_limit)
    check_plan_size(problem.shape, problem.split_backward, heuristic=True)
    begin = time.perf_counter()
    run = _Run(problem, objective, progress, begin)
    try:
        family = search_family(problem, _promising_first(problem, members),
                               deadline=begin + FAMILY_SHARE * float(time_limit))
    except KeyboardInterrupt:
        raise UniSchedError("interrupted before any schedule was found: let the search run longer") from None
    replay = ANSWER_SIMULATIONS * _one_simulation(family, time.perf_counter() - run.built)
    seeds = sorted(family.feasible, key=lambda member: objective_value(member.simulation, objective))
    if seeds:
        run.offer_seed(seeds[0])
    run.measure_seeds(seeds)
    try:
        mappings = seed_mappings(problem, seeds, family, constructed=members is None)
        now, end = time.perf_counter(), begin + float(time_limit) - replay
        starts = run.constructions(mappings, now + CONSTRUCT_SHARE * (end - now))
        starts = run.refine(starts, now + (CONSTRUCT_SHARE + REFINE_SHARE) * (end - now), seed)
        run.local_search(starts, end, np.random.default_rng(seed))
    except KeyboardInterrupt:
        run.interrupted = True
    if not seeds and run.best_start is None:
        raise UniSchedError(_nothing_runs(problem, family))
    return run.answer(seeds, family)


def _one_simulation(family, elapsed: float) -> float:
    """Seconds one simulation of the step took in the family search (``elapsed`` over the
    members that ran to the end or to a deadlock)."""
    ran = len(family.feasible) + sum(m.reason.startswith("deadlock") for m in family.dropped)
    return elapsed / max(1, ran)


def _promising_first(problem: PlanProblem, members) -> list:
    """The seeds to simulate, hand-made orders for this backward form first (on large problems
    the family search may not reach the end of the list within its share of the time)."""
    members = list(members if members is not None else registry_members(problem))
    return sorted(members, key=lambda member: member[1] is None or member[1].worker_orders is None
                  or member[1].split_backward != problem.split_backward)


@dataclass(frozen=True)
class SeedMapping:
    """A mapping to construct orders for, with the orders it came with (None: none that run)."""

    label: str
    compute: np.ndarray
    weight: np.ndarray
    orders: list[np.ndarray] | None = None


def seed_mappings(problem: PlanProblem, feasible: list[Member], family, constructed: bool = True) -> list[SeedMapping]:
    """Distinct mappings to start from: the named strategies that ran (best first, with their
    simulated orders), the planner's constructed mappings (with ``constructed``), and the
    named strategies whose greedy replay deadlocked under the memory limit (a memory-aware
    order may run them)."""
    found: list[SeedMapping] = []
    for member in feasible:
        schedule = member.schedule(problem)
        orders = [np.asarray(schedule.orders[w], dtype=np.int64) for w in range(problem.shape.num_workers)]
        found.append(SeedMapping(member.label, schedule.compute, schedule.weight, orders))
    others = [(label, strategy) for label, strategy, _ in constructed_members(problem)] if constructed else []
    others += [(m.label, m.strategy) for m in family.dropped
               if m.strategy is not None and m.reason.startswith("deadlock")]
    for label, strategy in others:
        if unplannable(strategy, problem.split_backward):
            continue
        compute, weight = mapping_of(problem, strategy)
        found.append(SeedMapping(label, compute, weight))
    distinct, seen = [], set()
    for mapping in found:
        key = mapping.compute.tobytes() + mapping.weight.tobytes()
        if key not in seen and _within_limits(problem, mapping.compute, mapping.weight):
            seen.add(key)
            distinct.append(mapping)
    return distinct


def _within_limits(problem: PlanProblem, compute: np.ndarray, weight: np.ndarray) -> bool:
    """Whether a mapping can run at all: the stages a worker holds (computed or owned), and
    one micro-batch's stashes on a worker against the least worker's limit."""
    K = problem.max_stages_per_worker
    held = np.zeros((problem.shape.num_workers, problem.shape.num_stages), dtype=bool)
    stage = problem.items.arrays()[1]
    held[compute, stage] = True
    held[weight, stage] = True
    if K is not None and held.sum(axis=1).max() > K:
        return False
    if problem.memory_limit is None:
        return True
    need, worker = problem.min_memory_mapped(compute)
    return need <= float(np.min(problem.memory_limit)) + 1e-9


ANSWER_SIMULATIONS = 2
"""The time the search keeps back for its answer, in simulations of the step: the best plan's
replay, and measuring it for the candidates table."""
SAY_EVERY = 0.5
"""Seconds between two progress lines."""


@dataclass(eq=False)
class _Run:
    """One search: the best so far (a seed's replay or a searched order), the bound, progress."""

    problem: PlanProblem
    objective: str
    progress: TextIO | None
    begin: float
    best_value: float = math.inf
    best_label: str = ""
    best_seed: Member | None = None
    best_start: Start | None = None
    interrupted: bool = False
    said: float = -math.inf
    unsaid: bool = False
    seed_rows: list[tuple[dict, float]] = field(default_factory=list)
    """The named strategies' rows of the candidates table, each with its objective value (its gap is
    set in :meth:`answer`, against the bound of the best's class)."""

    def __post_init__(self):
        self.timed = TimedProblem.build(self.problem)
        self.built = time.perf_counter()
        bounds = shape_bounds(self.problem)
        self.bounds = {"work": bounds["work"]} if self.objective == "span" else bounds
        self.bound = max(self.bounds.values())
        self.ramp = self.timed.ticks.time(ramp(self.timed))
        """The ramp bound (:func:`unisched.plan.bounds.ramp`), for the whole scheme alone."""
        self.replica_ramp = self.timed.ticks.time(every_ramp(self.timed))
        """:func:`unisched.plan.bounds.every_ramp`, for every schedule a plan can hold (every candidate)."""
        self.best_bound = self.bound
        """The strongest bound for the class the best lies in."""

    @property
    def met(self) -> bool:
        return self.best_value <= self.best_bound * (1 + 1e-9)

    def class_bound(self, compute, weight) -> float:
        """The strongest bound for a mapping's class: the replica ramp, and the ramp too where it
        lies in the whole scheme."""
        bound = max(self.bound, self.replica_ramp)
        if self.ramp > bound and fits(self.timed, compute, weight, WHOLE_SCHEME):
            return self.ramp
        return bound

    def offer_seed(self, member: Member) -> None:
        self.best_value = objective_value(member.simulation, self.objective)
        self.best_label, self.best_seed = member.label, member
        t = member.simulation.timeline
        rows = rows_of(self.problem, t)
        self.best_bound = self.class_bound(t.worker[rows], t.weight_worker[rows])
        self._announce()

    def measure_seeds(self, seeds: list[Member]) -> None:
        """The named strategies' rows of the candidates table, measured before the search (so
        that the answer takes no more than the replay the time limit keeps back)."""
        self.seed_rows = [(self._row(m.label, "family", m.simulation, False),
                           objective_value(m.simulation, self.objective)) for m in seeds]

    def offer(self, start: Start) -> bool:
        """Keep ``start`` as the best if it is; whether it was."""
        value = self.timed.ticks.time(start.timing.score[0])
        if value >= self.best_value - 1e-9:
            return False
        self.best_value, self.best_label, self.best_start = value, f"{start.m.label} + {start.how}", start
        self.best_bound = self.class_bound(start.m.compute, start.m.weight)
        self._announce()
        return True

    def _announce(self, final: str = "") -> None:
        now = time.perf_counter()
        if self.progress is None or (not final and now - self.said < SAY_EVERY):
            self.unsaid = not final
            return
        above = gap(self.best_value, self.best_bound)
        self.progress.write(f"search: {self.objective} {self.best_value:g}, {above:.1%} above the bound "
                            f"{self.best_bound:g} ({self.best_label}) after {now - self.begin:.1f} s{final}\n")
        self.progress.flush()
        self.said, self.unsaid = now, False

    def constructions(self, seeds: list[SeedMapping], until: float) -> list[Start]:
        """The seeds' own orders, then the list scheduler's: first a few rules on every seed
        mapping, then the rest of the grid on the most promising mappings, until ``until``."""
        problem = self.problem
        starts: list[Start] = []
        tried: list[tuple[Mapped, list[Rule]]] = []
        for seed in seeds:
            if self.met or time.perf_counter() > until:
                break
            try:
                m = Mapped.build(self.timed, seed.compute, seed.weight, seed.label)
            except PlanInputError:  # its weights alone exceed a worker's memory budget
                continue
            if seed.orders is not None:
                timing = evaluate(m, seed.orders, self.objective)
                if timing is not None:
                    starts.append(Start(m, seed.orders, timing, "its own order"))
            held = np.zeros((m.num_workers, problem.shape.num_stages), dtype=bool)
            held[m.compute, m.timed.stage] = True
            grid = rules(problem.split_backward, bool(held.sum(axis=1).max() > 1))
            made = [self._construct(m, rule, starts) for rule in grid[:FIRST_RULES] if time.perf_counter() < until]
            if any(made):
                tried.append((m, grid[FIRST_RULES:]))
        by_mapping = {id(s.m): s.timing.score for s in sorted(starts, key=lambda s: s.timing.score, reverse=True)}
        for m, rest in sorted(tried, key=lambda mr: by_mapping.get(id(mr[0]), (math.inf,))):
            for rule in rest:
                if self.met or time.perf_counter() > until:
                    break
                self._construct(m, rule, starts)
        return sorted(starts, key=lambda s: s.timing.score)

    def _construct(self, m: Mapped, rule: Rule, starts: list[Start]) -> bool:
        orders = construct(m, rule)
        timing = evaluate(m, orders, self.objective) if orders is not None else None
        if timing is None:
            return False
        start = Start(m, orders, timing, rule.label())
        starts.append(start)
        self.offer(start)
        return True

    def refine(self, starts: list[Start], until: float, seed: int) -> list[Start]:
        """The zero-bubble paper's last step: the best construction reordered by CP-SAT
        (:func:`unisched.plan.order.solve_order`, hinted with it), timed again as fixed orders."""
        left = until - time.perf_counter()
        if not starts or self.met or left < 0.5 or len(starts[0].m.compute) > REFINE_ITEMS:
            return starts
        best = starts[0]
        m = best.m
        self.say(f"search: CP-SAT order of {m.label} ({left:.1f} s) ...")
        solved = solve_order(self.timed, m.compute, m.weight, time_limit=left, hint_starts=best.timing.start,
                             num_workers=2, seed=seed)
        self.interrupted |= solved.interrupted
        if not solved.found:
            return starts
        schedule = Schedule.from_starts(self.problem, m.compute, m.weight, solved.starts)
        orders = [np.asarray(schedule.orders[w], dtype=np.int64) for w in range(m.num_workers)]
        timing = evaluate(m, orders, self.objective)
        if timing is None or timing.score > best.timing.score:
            return starts
        refined = Start(m, orders, timing, f"{best.how} + cpsat order")
        self.offer(refined)
        if self.interrupted:
            raise KeyboardInterrupt
        return [refined] + starts

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.write(text + "\n")
            self.progress.flush()

    def local_search(self, starts: list[Start], deadline: float, rng: np.random.Generator) -> None:
        """Improve the best few starting points, the most promising first, until the deadline or the bound."""
        pool = starts[:3]
        while pool and not self.met and time.perf_counter() < deadline:
            pool.sort(key=lambda s: (s.stale > 20 * len(s.m.compute), s.timing.score))
            start = pool[0]
            if improve(start, self.objective, 50, rng, deadline):
                start.how = start.how.removesuffix(" + local search") + " + local search"
                self.offer(start)

    def answer(self, seeds: list[Member], family) -> Plan:
        """The best found, replayed by the simulator, as a Plan (the best seed if the replay disagrees)."""
        stop = " (interrupted)" if self.interrupted else " (bound met)" if self.met else " (time limit)"
        label, source, schedule, sim = self._replayed_best(seeds[0] if seeds else None)
        self.best_label = label
        self.best_value = objective_value(sim, self.objective)
        self.best_bound = self.class_bound(schedule.compute, schedule.weight)
        self._announce(final=stop)
        value = self.best_value
        bounds, classes = dict(self.bounds), {name: ANY_SCHEDULE for name in self.bounds}
        bounds["replica_ramp"], classes["replica_ramp"] = self.replica_ramp, EVERY
        bounds["ramp"], classes["ramp"] = self.ramp, WHOLE_SCHEME
        bounds, classes = claimable(bounds, classes, value)
        held = max(self.bound, self.replica_ramp)  # for every schedule a plan can hold
        bound_for = WHOLE_SCHEME if self.best_bound > held else EVERY if self.best_bound > self.bound else ANY_SCHEDULE
        proven_for = bound_for if value <= self.best_bound * (1 + 1e-9) else ""
        rows = [self._row(label, source, sim, bool(proven_for))]
        rows += [dict(row, gap=gap(seed_value, self.best_bound)) for row, seed_value in self.seed_rows
                 if row["strategy"] != label]
        rows.sort(key=lambda row: row["latency"])
        return Plan(
            schedule=schedule,
            strategy_name=label,
            latency=float(sim.latency),
            lower_bound=float(self.best_bound),
            bounds=bounds,
            optimal=bool(proven_for),
            candidates=rows,
            dropped=[{"strategy": m.label, "reason": m.reason} for m in family.dropped],
            elapsed=time.perf_counter() - self.begin,
            replay=sim,
            objective=self.objective,
            objective_value=value,
            proven_for=proven_for,
            bound_for=bound_for,
            bound_classes=classes,
            interrupted=self.interrupted,
            search="heuristic search",
        )

    def _row(self, label: str, source: str, sim, optimal: bool) -> dict:
        """A row of the plan's candidates table; its gap is of the objective, to the bound of the
        best's class."""
        value = objective_value(sim, self.objective)
        return dict(strategy=label, source=source, **measures(sim), gap=gap(value, self.best_bound), optimal=optimal,
                    pareto=False, model_latency=None)

    def _replayed_best(self, seed: Member | None):
        """(label, source, schedule, replay) of the best: the searched orders as the simulator
        replays them, unless that replay fails or is worse than the best seed's."""
        fallback = None if seed is None else (seed.label, "family", seed.schedule(self.problem), seed.simulation)
        start = self.best_start
        if start is None:
            return fallback
        schedule = Schedule(self.problem, start.m.compute, start.m.weight,
                            {w: order.tolist() for w, order in enumerate(start.orders)}, name="search")
        try:
            sim = schedule.simulate()
        except UniSchedError as error:
            if fallback is None:
                raise UniSchedError(f"the search's best schedule does not replay: {error}") from None
            return fallback
        if fallback is not None and objective_value(sim, self.objective) > objective_value(seed.simulation,
                                                                                           self.objective) + 1e-9:
            return fallback
        return f"{start.m.label} + {start.how}", "search", schedule, sim


def _nothing_runs(problem: PlanProblem, family) -> str:
    W, S, B = problem.shape
    reasons = "; ".join(f"{m.label}: {m.reason}" for m in family.dropped[:4])
    unsimulated = sum(m.reason == NOT_SIMULATED for m in family.dropped)
    if unsimulated:
        return (f"no named strategy ran on W={W}, S={S}, B={B} within the time limit, so the search has no seed: "
                f"{unsimulated} of {len(family.dropped)} were not simulated before it was spent (dropped: {reasons}); "
                "raise time_limit (--time-limit)")
    return (f"no named strategy runs on W={W}, S={S}, B={B} under these limits, so the search has no seed"
            + (f" (dropped: {reasons})" if reasons else "") + "; raise memory_limit (--memory-limit) or allow more stages per worker")
