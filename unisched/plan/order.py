"""CP-SAT for the order of work when the mapping is fixed.

One start variable and one interval per work item; no two items of a worker
overlap; an item starts after its inputs end, plus the transfer time when
they ran on another worker; a borrowed stage's weights arrive ``fetch`` after
the step starts and its gradient goes back ``fetch`` after its last backward.
Activation memory is a cumulative constraint per worker over "live"
intervals, from a forward's start to its backward's end on the backward's
worker, which CP-SAT propagates far better than a reservoir.  A stash kept
on another worker than its forward's is counted there from the earliest time
its forward can start in any schedule (:func:`earliest_forwards`) when the
schedule is replayed from its orders alone (``asap_replay``): the simulator
then runs each item as early as it can, so such a forward may claim its room
sooner than the model placed it, and counting it from then is what keeps
the replay within the limit (and free of deadlocks).  A replay that follows
start times as well (the planner's: :meth:`unisched.plan.schedule.Schedule.planned`
keeps them as release times) does not need this restriction.

Micro-batches with identical mappings are interchangeable, so the model
fixes their order at the first stage (sound); ``fifo=True`` also keeps them
first-in-first-out at every stage, a restriction that shrinks the search but
may cut off the optimum, so a FIFO answer is never called proven.

A lower bound proven elsewhere (``lower_bound``) is a constraint on the
objective, so the search stops as soon as a schedule meets it.  A solve runs
in a thread of its own, so Ctrl-C stops it and says so (``Solved.interrupted``)
instead of ending only that one call.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

import numpy as np
from ortools.sat.python import cp_model

from unisched import dataflow
from unisched.network import allreduce_time
from unisched.plan.problem import PlanInputError, TimedProblem, Ticks
from unisched.simulate.simulation import upstream_forwards
from unisched.work import FORWARD


@dataclass(frozen=True)
class Solved:
    """What a CP-SAT run found: start ticks, objective and bound (ticks), status."""

    status: str
    starts: np.ndarray | None
    compute: np.ndarray | None
    weight: np.ndarray | None
    objective: int | None
    bound: int
    wall: float
    score: float | None = None
    """The replayed latency of this solution, when the search scored its solutions."""
    interrupted: bool = False
    """Ctrl-C stopped the search: the caller stops searching and answers with what it has."""

    @property
    def optimal(self) -> bool:
        return self.status == "OPTIMAL"

    @property
    def found(self) -> bool:
        return self.starts is not None


def solve_order(
    timed: TimedProblem,
    compute: np.ndarray,
    weight: np.ndarray,
    *,
    time_limit: float,
    hint_starts: np.ndarray | None = None,
    fifo: bool = False,
    num_workers: int = 2,
    seed: int = 0,
    lower_bound: int = 0,
    asap_replay: bool = True,
    report=None,
) -> Solved:
    """Best order for the mapping ``compute`` / ``weight`` (arrays over item ids);
    ``lower_bound`` (ticks): a bound proven for this mapping, where the search may stop;
    ``asap_replay``: the order will be replayed from orders alone (see the module docstring);
    ``report``: told of each better solution (:class:`Improvements`)."""
    compute = np.asarray(compute, dtype=np.int64)
    weight = np.asarray(weight, dtype=np.int64)
    begin = time.perf_counter()
    model = cp_model.CpModel()
    n = len(compute)
    duration = timed.duration[np.arange(n), compute]
    tails = step_tails(timed, compute, weight)
    release = releases(timed, compute, weight)
    edges = timed.data_edges()
    delay = timed.delays(edges, compute)
    horizon = int(duration.sum() + delay.sum() + release.max(initial=0) + tails.max(initial=0) + 1)
    span = timed.problem.objective == "span"
    if hint_starts is not None and len(hint_starts) and not span:
        horizon = min(horizon, int(max(np.max(hint_starts + duration + tails), 0)) + 1)

    start = [model.new_int_var(int(release[i]), horizon, f"s{i}") for i in range(n)]
    end = [start[i] + int(duration[i]) for i in range(n)]
    intervals = [model.new_fixed_size_interval_var(start[i], int(duration[i]), f"x{i}") for i in range(n)]
    makespan = model.new_int_var(0 if span else min(int(lower_bound), horizon), horizon, "makespan")

    for w in range(timed.shape.num_workers):
        mine = [intervals[i] for i in np.flatnonzero(compute == w)]
        if len(mine) > 1:
            model.add_no_overlap(mine)
    for u, v, d in zip(edges.src.tolist(), edges.dst.tolist(), delay.tolist()):
        model.add(start[v] >= end[u] + d)
    for i in range(n):
        model.add(makespan >= end[i] + int(tails[i]))

    _memory(model, timed, compute, weight, start, end, horizon, asap_replay)
    _symmetry(model, timed, compute, weight, start, fifo)

    if hint_starts is not None:
        for i in range(n):
            model.add_hint(start[i], int(hint_starts[i]))
        model.add_hint(makespan, int(np.max(np.asarray(hint_starts) + duration + tails)))
    workers = [[(start[i], end[i], None) for i in np.flatnonzero(compute == w)]
               for w in range(timed.shape.num_workers)]
    model.minimize(busy_span(model, workers, horizon, lower_bound) if span else makespan)
    solver = make_solver(time_limit, num_workers, seed)
    # the FIFO pass fixes part of the order, so its bound says nothing of the order class
    status, interrupted = run_solver(solver, model, Improvements(report, bounded=not fifo) if report else None)
    wall = time.perf_counter() - begin
    name = solver.status_name(status)
    if status == cp_model.INFEASIBLE:
        return Solved(name, None, compute, weight, None, horizon, wall, interrupted=interrupted)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Solved(name, None, compute, weight, None, int(solver.best_objective_bound), wall,
                      interrupted=interrupted)
    starts = np.array([solver.value(s) for s in start], dtype=np.int64)
    return Solved(name, starts, compute, weight, int(solver.objective_value), int(solver.best_objective_bound), wall,
                  interrupted=interrupted)


def busy_span(model, workers, horizon: int, lower_bound: int = 0):
    """The span objective: the longest worker busy span, first item's start to last item's end.
    ``workers``: per worker, (start, end, literal "on this worker" or None) of its possible items."""
    span = model.new_int_var(min(int(lower_bound), horizon), horizon, "span")
    for w, items in enumerate(workers):
        if not items:
            continue
        first = model.new_int_var(0, horizon, f"first{w}")
        last = model.new_int_var(0, horizon, f"last{w}")
        for begin, finish, on in items:
            model.add(first <= begin).only_enforce_if(on) if on is not None else model.add(first <= begin)
            model.add(last >= finish).only_enforce_if(on) if on is not None else model.add(last >= finish)
        model.add(span >= last - first)
    return span


def solve_order_staged(
    timed: TimedProblem,
    compute: np.ndarray,
    weight: np.ndarray,
    *,
    time_limit: float,
    hint_starts: np.ndarray | None = None,
    num_workers: int = 2,
    seed: int = 0,
    lower_bound: int = 0,
    cold_share: float = 0.25,
    fifo_share: float = 0.3,
    asap_replay: bool = True,
    report=None,
) -> Solved:
    """The full model without a hint first, briefly (a hint can steer CP-SAT's search away from a
    proof it finds at once without), then a first-in-first-out pass (small search, good schedules
    fast), then the full model warm-started from the best so far, which alone can prove optimality."""
    begin = time.perf_counter()

    def left() -> float:
        return time_limit - (time.perf_counter() - begin)

    common = dict(num_workers=num_workers, seed=seed, lower_bound=lower_bound, asap_replay=asap_replay, report=report)
    cold = solve_order(timed, compute, weight, time_limit=time_limit * cold_share, **common)
    if cold.optimal or cold.status == "INFEASIBLE" or cold.interrupted or left() <= 0.05:
        return replace(cold, wall=time.perf_counter() - begin)
    first = solve_order(timed, compute, weight, time_limit=min(left(), time_limit * fifo_share),
                        hint_starts=hint_starts, fifo=True, **common)
    best = min((s for s in (cold, first) if s.found), key=lambda s: s.objective, default=None)
    if first.interrupted or left() <= 0.05:
        return _settled(best, cold, begin, interrupted=first.interrupted)
    hint = best.starts if best is not None else hint_starts
    full = solve_order(timed, compute, weight, time_limit=left(), hint_starts=hint, **common)
    best = min((s for s in (full, cold, first) if s.found), key=lambda s: s.objective, default=None)
    return _settled(best, full, begin, bound=max(full.bound, cold.bound))


def _settled(best: Solved | None, last: Solved, begin: float, bound: int | None = None,
             interrupted: bool = False) -> Solved:
    """The best solution of a staged search, interrupted where any of its stages was; proven where
    it meets a full model's bound (a first-in-first-out pass proves nothing)."""
    bound = last.bound if bound is None else bound
    wall = time.perf_counter() - begin
    interrupted = interrupted or last.interrupted or (best is not None and best.interrupted)
    if best is None:
        return replace(last, wall=wall, bound=bound, interrupted=interrupted)
    return replace(best, status="OPTIMAL" if best.objective <= bound else "FEASIBLE", bound=bound, wall=wall,
                   interrupted=interrupted)


class Improvements(cp_model.CpSolverSolutionCallback):
    """Tells ``report(objective, bound, seconds)`` (ticks, and seconds into the
    solve) of each better solution CP-SAT finds; ``bound`` is None where the
    model's bound proves nothing of the whole problem (a neighbourhood of it)."""

    def __init__(self, report=None, bounded: bool = True):
        super().__init__()
        self.report, self.bounded = report, bounded

    def on_solution_callback(self) -> None:
        if self.report is not None:
            self.report(self.objective_value, self.best_objective_bound if self.bounded else None, self.wall_time)


PORTFOLIO = ("fixed", "quick_restart")
"""CP-SAT's two full-problem searches in a solve with three workers (the third searches
neighbourhoods): the fixed search (the model's decision strategy, a list scheduler under a memory
limit), which proves the small memory-limited steps, and the default search restarting often,
which finds shorter schedules than CP-SAT's default search with its LP in the same time
(docs/planner-measurements.md).  With more workers CP-SAT's own portfolio runs, both among
its searches."""


def make_solver(time_limit: float, num_workers: int, seed: int, searches: tuple[str, ...] | None = None
                ) -> cp_model.CpSolver:
    """A CP-SAT solver with a time limit, a number of search workers and a fixed seed; Ctrl-C is
    left to :func:`run_solver`.  ``searches`` names CP-SAT's searches, one per worker; by default
    three workers run those of :data:`PORTFOLIO` and one for neighbourhoods, and any other number
    CP-SAT's own portfolio."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, float(time_limit))
    solver.parameters.num_workers = max(1, int(num_workers))
    if searches is None and num_workers == len(PORTFOLIO) + 1:
        searches = PORTFOLIO
    solver.parameters.subsolvers.extend(searches or ())
    solver.parameters.random_seed = seed
    solver.parameters.catch_sigint_signal = False
    return solver


def run_solver(solver: cp_model.CpSolver, model: cp_model.CpModel, callback=None) -> tuple[int, bool]:
    """Solve in a thread of its own while this one waits, so that Ctrl-C (a KeyboardInterrupt here)
    stops the search and keeps its best solution: (status, whether Ctrl-C stopped it)."""
    outcome: list = []
    finished = threading.Event()

    def solve() -> None:
        try:
            outcome.append(solver.solve(model, callback))
        except BaseException as error:  # handed to the waiting thread
            outcome.append(error)
        finally:
            finished.set()

    threading.Thread(target=solve, daemon=True).start()
    interrupted = False
    while not finished.is_set():
        try:
            finished.wait(0.05)
        except KeyboardInterrupt:
            interrupted = True
            solver.stop_search()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0], interrupted


def releases(timed: TimedProblem, compute, weight) -> np.ndarray:
    """Ticks before which an item cannot start: its borrowed weights' arrival."""
    stage = timed.stage
    borrowed = dataflow.fetches_weights(compute, weight)
    release = np.zeros(len(compute), dtype=np.int64)
    release[borrowed] = timed.fetch[weight[borrowed], compute[borrowed], stage[borrowed]]
    return release


def step_tails(timed: TimedProblem, compute, weight) -> np.ndarray:
    """Ticks the step lasts after each item: the return of its weight gradient to
    the weight worker, then the all-reduce of a replicated stage, then the longest of
    those of the tied weights the stage holds a copy of (a ring, or a tree where a topology says
    so; all priced by :mod:`unisched.network`, as the simulator books them, without
    the waits for busy links the simulator adds)."""
    problem = timed.problem
    W, S, B = problem.shape
    last = timed.direction == dataflow.gradient_pass(problem.split_backward)
    tails = np.zeros(len(compute), dtype=np.int64)
    returning = dataflow.returns_gradient(timed.direction, compute, weight, problem.split_backward)
    tails[returning] = timed.fetch[compute[returning], weight[returning], timed.stage[returning]]
    wbytes = problem.costs.per_stage("weight_bytes", S)
    holders = dataflow.replicas(timed.stage, weight, S)
    for s, replicas in enumerate(holders):
        if len(replicas) > 1:
            tails[last & (timed.stage == s)] += timed.ticks(allreduce_time(problem.costs, replicas, wbytes[s]))
    tied = np.zeros(S, dtype=np.int64)  # ties all-reduce side by side, so a stage waits for its longest
    for tie in problem.costs.tied_weights:
        members = dataflow.tie_holders(tie.stages, holders)
        if len(members) > 1:
            ticks = timed.ticks(allreduce_time(problem.costs, members, tie.nbytes))
            tied[list(tie.stages)] = np.maximum(tied[list(tie.stages)], ticks)
    return tails + np.where(last, tied[timed.stage], 0)


def memory_demands(timed: TimedProblem) -> tuple[dict, Ticks]:
    """Integer demand of each backward pass's share of its stash, and the unit it and every
    memory limit and weight size are counted in."""
    problem = timed.problem
    sizes = problem.stash_sizes
    shares = dataflow.stash_shares(problem.split_backward, problem.costs.input_grad_frees)
    values = [sizes[s] * share for s in range(len(sizes)) for share in shares.values()]
    limits = problem.limits()
    values += limits[np.isfinite(limits)].tolist()
    if problem.memory_budget is not None:
        values += np.ravel(problem.memory_budget).tolist() + problem.owner_bytes().tolist() \
            + (2 * problem.weight_bytes()).tolist() + problem.weight_bytes().tolist()
    unit = Ticks.for_times(values)
    demands = {(s, d): unit(sizes[s] * share) for s in range(len(sizes)) for d, share in shares.items()}
    return demands, unit


MOST_TICKS = 2**53
"""The largest memory limit the CP-SAT models take, in ticks (a larger one is as good as none: more
than a step's stashes can claim in a model whose sums CP-SAT can hold in 64 bits)."""


def capacity(unit: Ticks, limit: float) -> int:
    """A memory limit in the integer unit of :func:`memory_demands` (rounded down: never looser),
    at most :data:`MOST_TICKS`."""
    return int(min(np.floor(float(limit) * unit.scale + 1e-6), MOST_TICKS))


def live_stashes(timed: TimedProblem) -> list[tuple[int, int, int, int, int]]:
    """(stage, batch, forward id, freeing pass id, demand) of every stash share that
    takes memory: it is live from the forward's start to that pass's end."""
    problem = timed.problem
    demands, _ = memory_demands(timed)
    grid = problem.item_grid()
    W, S, B = problem.shape
    k = {d: i for i, d in enumerate(problem.dirs)}
    return [(s, b, int(grid[b, s, k[FORWARD]]), int(grid[b, s, k[d]]), demands[s, d])
            for b in range(B) for s in range(S) for d in problem.dirs if demands.get((s, d))]


def earliest_forwards(timed: TimedProblem) -> np.ndarray:
    """Per stage: the earliest tick its forward can start in any schedule (its upstream
    forwards on the fastest workers, transfers left out)."""
    problem = timed.problem
    forward = problem.item_grid()[0, :, problem.dirs.index(FORWARD)]
    return upstream_forwards(problem.stage_graph, timed.duration[forward].min(axis=1).astype(np.int64))


def live_start(model, earliest: np.ndarray, s: int, f: int, start, away) -> object:
    """When a stash of stage ``s`` (forward ``f``) starts taking room on the worker that frees it:
    at the forward's start on the same worker (``away`` False), at its stage's earliest start
    away from it (``away`` True, or a literal)."""
    if away is False:
        return start[f]
    if away is True:
        return int(earliest[s])
    begin = model.new_int_var(int(earliest[s]), cp_model.INT32_MAX, f"claim{f}")
    model.add(begin == start[f]).only_enforce_if(away.Not())
    model.add(begin == int(earliest[s])).only_enforce_if(away)
    return begin


def _memory(model, timed: TimedProblem, compute, weight, start, end, horizon, asap_replay: bool) -> None:
    """Per worker, its live stashes within its stash limit (what its weights leave of a budget)."""
    problem = timed.problem
    limits = problem.stash_limits(compute, weight)
    if limits is None:
        return
    limits = np.broadcast_to(np.asarray(limits, dtype=float), (problem.shape.num_workers,))
    _, unit = memory_demands(timed)
    earliest = earliest_forwards(timed)
    per_worker: dict[int, tuple[list, list]] = {w: ([], []) for w in range(problem.shape.num_workers)}
    for s, _, f, r, demand in live_stashes(timed):
        size = model.new_int_var(0, horizon, f"live{r}")
        begin = live_start(model, earliest, s, f, start, asap_replay and bool(compute[f] != compute[r]))
        live = model.new_interval_var(begin, size, end[r], f"l{r}")
        intervals, amounts = per_worker[int(compute[r])]
        intervals.append(live)
        amounts.append(demand)
    for w, (intervals, amounts) in per_worker.items():
        if intervals and np.isfinite(limits[w]) and sum(amounts) > capacity(unit, limits[w]):
            model.add_cumulative(intervals, amounts, capacity(unit, limits[w]))


def _symmetry(model, timed: TimedProblem, compute, weight, start, fifo: bool) -> None:
    """Order interchangeable micro-batches (same workers for every item)."""
    problem = timed.problem
    grid = problem.item_grid()
    first, forward = problem.stage_graph.sources[0], problem.dirs.index(FORWARD)
    groups: dict[bytes, list[int]] = {}
    for b, rows in enumerate(grid):
        groups.setdefault(compute[rows].tobytes() + weight[rows].tobytes(), []).append(b)
    for batches in groups.values():
        for a, b in zip(batches, batches[1:]):
            model.add(start[grid[a, first, forward]] <= start[grid[b, first, forward]])
            if fifo:
                for u, v in zip(grid[a].ravel().tolist(), grid[b].ravel().tolist()):
                    model.add(start[u] <= start[v])


def order_class(label: str) -> str:
    """The class of schedules a proof of the order model covers: the orders of one mapping."""
    return f"orders of the mapping of {label}"


def check_mapping_memory(timed: TimedProblem, compute: np.ndarray, weight: np.ndarray | None = None) -> None:
    """A mapping whose weights exceed a worker's budget, or that keeps more of one micro-batch's
    stashes on a worker than its limit, can never run."""
    problem = timed.problem
    compute = np.asarray(compute)
    limits = problem.stash_limits(compute, compute if weight is None else np.asarray(weight))
    if limits is None:
        return
    need, worker = problem.min_memory_mapped(compute, limits)
    limit = float(np.broadcast_to(np.asarray(limits, dtype=float), (problem.shape.num_workers,))[worker])
    if need > limit + 1e-9:
        raise PlanInputError(
            f"infeasible: this mapping keeps {need:g} of one micro-batch's stashes on worker {worker}, so its "
            f"memory limit needs at least {need:g} (got {limit:g}); raise --memory-limit or "
            "choose another strategy"
        )
