"""CP-SAT for the mapping itself: which worker computes each (stage, batch),
which worker holds each stage's weights, and in what order.

Every (stage, batch) has one optional interval per worker for each of its
passes; one presence literal per (stage, batch, worker) is shared by the
forward and its backward(s), so a stash never moves.  A stage has one weight
worker; a worker computing a stage it does not hold waits ``fetch`` for the
weights and sends the gradient back ``fetch`` after its last backward.  A
worker may hold at most ``max_stages_per_worker`` stages (its own and
fetched ones).  Activations and gradients take ``comm`` only when the two ends
of an edge of the stage graph run on different workers for that batch.  Redundant cumulatives (all work
with capacity W; all live activations with capacity W*M) tighten the bound.

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
from unisched.plan.order import Solved, live_stashes, make_solver, memory_demands
from unisched.plan.problem import TimedProblem
from unisched.work import FORWARD

WHOLE_MODEL_LIMIT = 160
"""Above this many (stage, batch) pairs the whole model is too slow to improve: use LNS."""
LNS_PAIRS = 64
"""(stage, batch) pairs whose workers one LNS round frees."""
LNS_ROUND_SECONDS = 4.0
"""Longest single LNS round: many short rounds beat a few long ones on large models."""


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


def solve_mapping(
    timed: TimedProblem,
    *,
    time_limit: float,
    hint: Incumbent | None = None,
    num_workers: int = 2,
    seed: int = 0,
    lns: bool | None = None,
    score: Scorer | None = None,
) -> Solved:
    """Search mappings and orders together; LNS when the model is large (or ``lns=True``).

    The model leaves out link contention, so with ``score`` every solution
    CP-SAT reports is replayed and the one with the best replay is kept.
    """
    W, S, B = timed.shape
    if lns is None:
        lns = S * B > WHOLE_MODEL_LIMIT and hint is not None
    if hint is not None and score is not None:
        hint = replace(hint, score=score(hint.compute, hint.weight, hint.starts))
    if not lns or hint is None:
        return _solve(timed, time_limit=time_limit, hint=hint, num_workers=num_workers, seed=seed, score=score)
    return _lns(timed, time_limit=time_limit, hint=hint, num_workers=num_workers, seed=seed, score=score)


def _lns(timed: TimedProblem, *, time_limit: float, hint: Incumbent, num_workers: int, seed: int,
         score: Scorer | None) -> Solved:
    """Free a window of micro-batches, keep the others' workers; repeat while time lasts."""
    begin = time.perf_counter()
    deadline = begin + time_limit
    rng = random.Random(seed)
    W, S, B = timed.shape
    best = hint
    window = max(2, min(B, LNS_PAIRS // S))
    round_limit = max(1.0, min(LNS_ROUND_SECONDS, time_limit / 6))
    whole = _solve(timed, time_limit=min(round_limit, time_limit / 3), hint=best, num_workers=num_workers,
                   seed=seed, score=score)
    bound = whole.bound
    best = _better(best, whole)
    while time.perf_counter() < deadline - 0.2 and best.makespan > bound:
        first = rng.randrange(B)
        free = {(first + k) % B for k in range(window)} if rng.random() < 0.5 else set(rng.sample(range(B), window))
        left = deadline - time.perf_counter()
        result = _solve(timed, time_limit=min(round_limit, left), hint=best, num_workers=num_workers,
                        seed=rng.randrange(1 << 30), free_batches=free, score=score)
        best = _better(best, result)
    status = "OPTIMAL" if best.makespan <= bound and whole.optimal else "FEASIBLE"
    return Solved(status, best.starts, best.compute, best.weight, best.makespan, bound,
                  time.perf_counter() - begin, best.score)


def _better(best: Incumbent, result: Solved) -> Incumbent:
    if not result.found:
        return best
    candidate = Incumbent(result.compute, result.weight, result.starts, result.objective,
                          result.score if result.score is not None else math.inf)
    if math.isinf(candidate.score) and math.isinf(best.score):
        return candidate if candidate.makespan < best.makespan else best
    return candidate if (candidate.score, candidate.makespan) < (best.score, best.makespan) else best


class _Collector(cp_model.CpSolverSolutionCallback):
    """Keeps every solution CP-SAT reports, to be replayed afterwards."""

    def __init__(self, x, owner, start, shape, timed: TimedProblem, limit: int = 64):
        super().__init__()
        self.x, self.owner, self.start, self.shape, self.timed = x, owner, start, shape, timed
        self.limit = limit
        self.solutions: list[tuple[np.ndarray, np.ndarray, np.ndarray, int]] = []

    def on_solution_callback(self) -> None:
        W, S, B = self.shape
        owners = [next(w for w in range(W) if self.boolean_value(self.owner[s, w])) for s in range(S)]
        where = np.array([[next(w for w in range(W) if self.boolean_value(self.x[s, b, w])) for s in range(S)]
                          for b in range(B)])
        batch, stage = self.timed.batch, self.timed.stage
        compute = where[batch, stage].astype(np.int64)
        weight = np.asarray(owners, dtype=np.int64)[stage]
        starts = np.array([self.value(v) for v in self.start], dtype=np.int64)
        self.solutions.append((compute, weight, starts, int(self.objective_value)))
        if len(self.solutions) > self.limit:
            del self.solutions[0]


def _solve(
    timed: TimedProblem,
    *,
    time_limit: float,
    hint: Incumbent | None,
    num_workers: int,
    seed: int,
    free_batches: set[int] | None = None,
    score: Scorer | None = None,
) -> Solved:
    begin = time.perf_counter()
    problem = timed.problem
    W, S, B = problem.shape
    model = cp_model.CpModel()
    if hint is not None:
        hint = canonical(timed, hint) if free_batches is None else hint
    duration = timed.duration  # (items, workers)
    comm = timed.comm.max(axis=(0, 1)) if W > 1 else np.zeros(S, dtype=np.int64)
    fetch = timed.fetch.max(axis=(0, 1)) if W > 1 else np.zeros(S, dtype=np.int64)
    uniform = bool(np.all(duration == duration[:, :1]))
    horizon = int(duration.max(axis=1).sum() + 2 * B * S * comm.max(initial=0) + 2 * fetch.max(initial=0) + 1)
    if hint is not None:
        horizon = min(horizon, int(hint.makespan))

    x = {(s, b, w): model.new_bool_var(f"x{s},{b},{w}") for s in range(S) for b in range(B) for w in range(W)}
    owner = {(s, w): model.new_bool_var(f"o{s},{w}") for s in range(S) for w in range(W)}
    held = {(w, s): model.new_bool_var(f"h{w},{s}") for s in range(S) for w in range(W)}
    for s in range(S):
        model.add_exactly_one(owner[s, w] for w in range(W))
        for b in range(B):
            model.add_exactly_one(x[s, b, w] for w in range(W))
            for w in range(W):
                model.add_implication(x[s, b, w], held[w, s])
        for w in range(W):
            model.add_implication(owner[s, w], held[w, s])
            model.add_bool_or([owner[s, w]] + [x[s, b, w] for b in range(B)]).only_enforce_if(held[w, s])
    if problem.max_stages_per_worker is not None and problem.max_stages_per_worker < S:
        for w in range(W):
            model.add(sum(held[w, s] for s in range(S)) <= problem.max_stages_per_worker)

    n = problem.num_items
    start = [model.new_int_var(0, horizon, f"s{i}") for i in range(n)]
    end = []
    per_worker: list[list] = [[] for _ in range(W)]
    main = []
    for i in range(n):
        b, s = int(timed.batch[i]), int(timed.stage[i])
        if uniform:
            end.append(start[i] + int(duration[i, 0]))
            main.append(model.new_fixed_size_interval_var(start[i], int(duration[i, 0]), f"m{i}"))
        else:
            e = model.new_int_var(0, horizon, f"e{i}")
            model.add(e == start[i] + sum(int(duration[i, w]) * x[s, b, w] for w in range(W)))
            end.append(e)
        for w in range(W):
            per_worker[w].append(model.new_optional_fixed_size_interval_var(
                start[i], int(duration[i, w]), x[s, b, w], f"o{i},{w}"))
    for w in range(W):
        model.add_no_overlap(per_worker[w])
    if uniform:
        model.add_cumulative(main, [1] * n, W)

    makespan = model.new_int_var(0, horizon, "makespan")
    for i in range(n):
        model.add(makespan >= end[i])

    same = {}
    for b in range(B):
        for p, t in problem.stage_graph.graph.edges:
            z = [model.new_bool_var(f"z{p},{t},{b},{w}") for w in range(W)]
            for w in range(W):
                model.add_implication(z[w], x[p, b, w])
                model.add_implication(z[w], x[t, b, w])
            same[p, t, b] = z
    edges = timed.data_edges()
    for u, v, s in zip(edges.src.tolist(), edges.dst.tolist(), edges.stage.tolist()):
        su, sv = int(timed.stage[u]), int(timed.stage[v])
        if su == sv:
            model.add(start[v] >= end[u])
        else:
            upstream, downstream = (su, sv) if timed.direction[u] == FORWARD else (sv, su)
            c = int(comm[s])
            model.add(start[v] >= end[u] + c - c * sum(same[upstream, downstream, int(timed.batch[u])]))

    grid = problem.item_grid()
    forward = problem.dirs.index(FORWARD)
    last = problem.dirs.index(dataflow.gradient_pass(problem.split_backward))
    for s in range(S):
        if not fetch[s]:
            continue
        for b in range(B):
            f, r = grid[b, s, forward], grid[b, s, last]
            for w in range(W):
                model.add(start[f] >= int(fetch[s])).only_enforce_if([x[s, b, w], owner[s, w].Not()])
                model.add(makespan >= end[r] + int(fetch[s])).only_enforce_if([x[s, b, w], owner[s, w].Not()])

    _memory(model, timed, x, start, end, horizon)

    first = problem.stage_graph.sources[0]
    if free_batches is None:
        for b in range(B - 1):
            model.add(start[grid[b, first, forward]] <= start[grid[b + 1, first, forward]])
        if uniform and problem.costs.worker_speed is None and not problem.costs.links:
            model.add(x[first, 0, 0] == 1)

    if hint is not None:
        _add_hint(model, timed, hint, x, owner, held, same, start, makespan)
        if free_batches is not None:
            for b in range(B):
                if b in free_batches:
                    continue
                for s in range(S):
                    model.add(x[s, b, int(hint.compute[grid[b, s, forward]])] == 1)
            for s in range(S):
                model.add(owner[s, int(hint.weight[grid[0, s, forward]])] == 1)
    model.minimize(makespan)
    solver = make_solver(time_limit, num_workers, seed)
    collector = _Collector(x, owner, start, (W, S, B), timed)
    status = solver.solve(model, collector)
    wall = time.perf_counter() - begin
    name = solver.status_name(status)
    bound = int(solver.best_objective_bound) if free_batches is None else 0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE) or not collector.solutions:
        if status == cp_model.INFEASIBLE and free_batches is None:
            bound = horizon
        return Solved(name, None, None, None, None, bound, wall)
    solutions = collector.solutions
    if score is None:
        compute, weight, starts, objective = solutions[-1]
        return Solved(name, starts, compute, weight, objective, bound, wall)
    scored = [(score(c, w, st), obj, c, w, st) for c, w, st, obj in solutions]
    value, objective, compute, weight, starts = min(scored, key=lambda row: (row[0], row[1]))
    return Solved(name, starts, compute, weight, objective, bound, wall, value)


def _memory(model, timed: TimedProblem, x, start, end, horizon) -> None:
    problem = timed.problem
    if problem.memory_limit is None:
        return
    _, capacity, _ = memory_demands(timed)
    W = problem.shape.num_workers
    per_worker: list[tuple[list, list]] = [([], []) for _ in range(W)]
    everything, amounts = [], []
    for s, b, f, r, demand in live_stashes(timed):
        size = model.new_int_var(0, horizon, f"live{r}")
        everything.append(model.new_interval_var(start[f], size, end[r], f"l{r}"))
        amounts.append(demand)
        for w in range(W):
            per_worker[w][0].append(model.new_optional_interval_var(start[f], size, end[r], x[s, b, w], f"l{r},{w}"))
            per_worker[w][1].append(demand)
    for intervals, demand in per_worker:
        if sum(demand) > capacity:
            model.add_cumulative(intervals, demand, capacity)
    if sum(amounts) > capacity * W:
        model.add_cumulative(everything, amounts, capacity * W)


def canonical(timed: TimedProblem, hint: Incumbent) -> Incumbent:
    """Relabel micro-batches (by first-stage start) and workers (batch 0's first
    stage on worker 0) so the hint satisfies the model's symmetry breaking."""
    problem = timed.problem
    W = problem.shape.num_workers
    grid = problem.item_grid()
    first = grid[:, problem.stage_graph.sources[0], problem.dirs.index(FORWARD)]
    order = sorted(range(len(grid)), key=lambda b: (hint.starts[first[b]], b))
    compute, weight, starts = (np.empty_like(a) for a in (hint.compute, hint.weight, hint.starts))
    for relabelled, a in ((compute, hint.compute), (weight, hint.weight), (starts, hint.starts)):
        relabelled[grid] = a[grid[order]]
    symmetric = bool(np.all(timed.duration == timed.duration[:, :1])) and timed.problem.costs.worker_speed is None \
        and not timed.problem.costs.links
    if symmetric:
        leader = int(compute[first[0]])
        swap = np.arange(W)
        swap[[0, leader]] = swap[[leader, 0]]
        compute, weight = swap[compute], swap[weight]
    return Incumbent(compute, weight, starts, hint.makespan)


def _add_hint(model, timed: TimedProblem, hint: Incumbent, x, owner, held, same, start, makespan) -> None:
    problem = timed.problem
    W, S, B = problem.shape
    forwards = problem.item_grid()[:, :, problem.dirs.index(FORWARD)]
    where = {}
    for b in range(B):
        for s in range(S):
            where[s, b] = int(hint.compute[forwards[b, s]])
            for w in range(W):
                model.add_hint(x[s, b, w], where[s, b] == w)
    owners = [int(hint.weight[forwards[0, s]]) for s in range(S)]
    for s in range(S):
        for w in range(W):
            model.add_hint(owner[s, w], owners[s] == w)
            model.add_hint(held[w, s], owners[s] == w or any(where[s, b] == w for b in range(B)))
    for (p, t, b), z in same.items():
        for w in range(W):
            model.add_hint(z[w], where[p, b] == w and where[t, b] == w)
    for i, v in enumerate(start):
        model.add_hint(v, int(hint.starts[i]))
    model.add_hint(makespan, int(hint.makespan))


def incumbent_from(timed: TimedProblem, compute, weight, starts) -> Incumbent | None:
    """A hint for the mapping model, if the schedule fits its structure (a forward and its
    backwards on one worker, one weight worker per stage) and its timing rules."""
    problem = timed.problem
    W, S, B = problem.shape
    compute = np.asarray(compute, dtype=np.int64)
    weight = np.asarray(weight, dtype=np.int64)
    grid = problem.item_grid()
    per_pair = compute[grid]
    if np.any(per_pair != per_pair[:, :, :1]):
        return None
    owners = weight[grid]
    if np.any(owners != owners[:1, :, :1]):
        return None
    starts = np.asarray(starts, dtype=np.int64)
    ends = starts + timed.duration[np.arange(len(compute)), compute]
    fetch = timed.fetch.max(axis=(0, 1)) if W > 1 else np.zeros(S, dtype=np.int64)
    returning = dataflow.returns_gradient(timed.direction, compute, weight, problem.split_backward)
    tails = np.where(returning, fetch[timed.stage], 0)
    makespan = int(np.max(ends + tails))
    return Incumbent(compute, weight, starts, makespan)
