"""CP-SAT for the order of work when the mapping is fixed.

One start variable and one interval per work item; no two items of a worker
overlap; an item starts after its inputs end, plus the transfer time when
they ran on another worker; a borrowed stage's weights arrive ``fetch`` after
the step starts and its gradient goes back ``fetch`` after its last backward.
Activation memory is a cumulative constraint per worker over "live"
intervals, from a forward's start to its backward's end on the backward's
worker, which CP-SAT propagates far better than a reservoir.

Micro-batches with identical mappings are interchangeable, so the model
fixes their order at the first stage (sound); ``fifo=True`` also keeps them
first-in-first-out at every stage, a restriction that shrinks the search but
may cut off the optimum, so a FIFO answer is never called proven.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np
from ortools.sat.python import cp_model

from unisched import dataflow
from unisched.network import ring_allreduce_time
from unisched.plan.problem import PlanInputError, TimedProblem, Ticks
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
) -> Solved:
    """Best order for the mapping ``compute`` / ``weight`` (arrays over item ids)."""
    compute = np.asarray(compute, dtype=np.int64)
    weight = np.asarray(weight, dtype=np.int64)
    begin = time.perf_counter()
    model = cp_model.CpModel()
    n = len(compute)
    duration = timed.duration[np.arange(n), compute]
    tails = step_tails(timed, compute, weight)
    release = _releases(timed, compute, weight)
    edges = timed.data_edges()
    delay = timed.delays(edges, compute)
    horizon = int(duration.sum() + delay.sum() + release.max(initial=0) + tails.max(initial=0) + 1)
    if hint_starts is not None:
        horizon = min(horizon, int(max(np.max(hint_starts + duration + tails), 0)) + 1) if len(hint_starts) else horizon

    start = [model.new_int_var(int(release[i]), horizon, f"s{i}") for i in range(n)]
    end = [start[i] + int(duration[i]) for i in range(n)]
    intervals = [model.new_fixed_size_interval_var(start[i], int(duration[i]), f"x{i}") for i in range(n)]
    makespan = model.new_int_var(0, horizon, "makespan")

    for w in range(timed.shape.num_workers):
        mine = [intervals[i] for i in np.flatnonzero(compute == w)]
        if len(mine) > 1:
            model.add_no_overlap(mine)
    for u, v, d in zip(edges.src.tolist(), edges.dst.tolist(), delay.tolist()):
        model.add(start[v] >= end[u] + d)
    for i in range(n):
        model.add(makespan >= end[i] + int(tails[i]))

    _memory(model, timed, compute, start, end, horizon)
    _symmetry(model, timed, compute, weight, start, fifo)

    if hint_starts is not None:
        for i in range(n):
            model.add_hint(start[i], int(hint_starts[i]))
        model.add_hint(makespan, int(np.max(np.asarray(hint_starts) + duration + tails)))
    model.minimize(makespan)
    solver = make_solver(time_limit, num_workers, seed)
    status = solver.solve(model)
    wall = time.perf_counter() - begin
    name = solver.status_name(status)
    if status == cp_model.INFEASIBLE:
        return Solved(name, None, compute, weight, None, horizon, wall)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Solved(name, None, compute, weight, None, int(solver.best_objective_bound), wall)
    starts = np.array([solver.value(s) for s in start], dtype=np.int64)
    return Solved(name, starts, compute, weight, int(solver.objective_value), int(solver.best_objective_bound), wall)


def solve_order_staged(
    timed: TimedProblem,
    compute: np.ndarray,
    weight: np.ndarray,
    *,
    time_limit: float,
    hint_starts: np.ndarray | None = None,
    num_workers: int = 2,
    seed: int = 0,
    fifo_share: float = 0.4,
) -> Solved:
    """A first-in-first-out pass (small search, good schedules fast), then the full
    model warm-started from it, which alone can prove optimality."""
    begin = time.perf_counter()
    first = solve_order(timed, compute, weight, time_limit=time_limit * fifo_share, hint_starts=hint_starts,
                        fifo=True, num_workers=num_workers, seed=seed)
    hint = first.starts if first.found else hint_starts
    left = time_limit - (time.perf_counter() - begin)
    if left <= 0.05:
        return replace(first, status="FEASIBLE" if first.found else first.status, bound=0)
    full = solve_order(timed, compute, weight, time_limit=left, hint_starts=hint, num_workers=num_workers, seed=seed)
    if full.found and (not first.found or full.objective <= first.objective):
        return replace(full, wall=time.perf_counter() - begin)
    return replace(first, status="FEASIBLE", bound=full.bound, wall=time.perf_counter() - begin)


def make_solver(time_limit: float, num_workers: int, seed: int) -> cp_model.CpSolver:
    """A CP-SAT solver with a time limit, a number of search workers and a fixed seed."""
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, float(time_limit))
    solver.parameters.num_workers = max(1, int(num_workers))
    solver.parameters.random_seed = seed
    return solver


def _releases(timed: TimedProblem, compute, weight) -> np.ndarray:
    """Ticks before which an item cannot start: its borrowed weights' arrival."""
    stage = timed.stage
    borrowed = dataflow.fetches_weights(compute, weight)
    release = np.zeros(len(compute), dtype=np.int64)
    release[borrowed] = timed.fetch[weight[borrowed], compute[borrowed], stage[borrowed]]
    return release


def step_tails(timed: TimedProblem, compute, weight) -> np.ndarray:
    """Ticks the step lasts after each item: the return of its weight gradient to
    the weight worker, then the ring all-reduce of a replicated stage (both
    priced by :mod:`unisched.network`, as the simulator books them)."""
    problem = timed.problem
    W, S, B = problem.shape
    last = timed.direction == dataflow.gradient_pass(problem.split_backward)
    tails = np.zeros(len(compute), dtype=np.int64)
    returning = dataflow.returns_gradient(timed.direction, compute, weight, problem.split_backward)
    tails[returning] = timed.fetch[compute[returning], weight[returning], timed.stage[returning]]
    wbytes = problem.costs.per_stage("weight_bytes", S)
    for s, replicas in enumerate(dataflow.replicas(timed.stage[last], weight[last], S)):
        if len(replicas) > 1:
            tails[last & (timed.stage == s)] += timed.ticks(ring_allreduce_time(problem.costs, replicas, wbytes[s]))
    return tails


def memory_demands(timed: TimedProblem) -> tuple[dict, int, Ticks]:
    """Integer demand of each backward's share of its stash, and the limit, in one unit."""
    problem = timed.problem
    sizes = problem.stash_sizes
    shares = dataflow.stash_shares(problem.split_backward, problem.costs.input_grad_frees)
    values = [sizes[s] * share for s in range(len(sizes)) for share in shares.values()]
    unit = Ticks.for_times(values + [problem.memory_limit or 0.0])
    demands = {(s, d): unit(sizes[s] * share) for s in range(len(sizes)) for d, share in shares.items()}
    capacity = int(np.floor(problem.memory_limit * unit.scale + 1e-6))
    return demands, capacity, unit


def live_stashes(timed: TimedProblem) -> list[tuple[int, int, int, int, int]]:
    """(stage, batch, forward id, freeing pass id, demand) of every stash share that
    takes memory: it is live from the forward's start to that pass's end."""
    problem = timed.problem
    demands, _, _ = memory_demands(timed)
    grid = problem.item_grid()
    W, S, B = problem.shape
    k = {d: i for i, d in enumerate(problem.dirs)}
    return [(s, b, int(grid[b, s, k[FORWARD]]), int(grid[b, s, k[d]]), demands[s, d])
            for b in range(B) for s in range(S) for d in problem.dirs if demands.get((s, d))]


def _memory(model, timed: TimedProblem, compute, start, end, horizon) -> None:
    problem = timed.problem
    if problem.memory_limit is None:
        return
    _, capacity, _ = memory_demands(timed)
    per_worker: dict[int, tuple[list, list]] = {w: ([], []) for w in range(problem.shape.num_workers)}
    for _, _, f, r, demand in live_stashes(timed):
        size = model.new_int_var(0, horizon, f"live{r}")
        live = model.new_interval_var(start[f], size, end[r], f"l{r}")
        intervals, amounts = per_worker[int(compute[r])]
        intervals.append(live)
        amounts.append(demand)
    for w, (intervals, amounts) in per_worker.items():
        if intervals and sum(amounts) > capacity:
            model.add_cumulative(intervals, amounts, capacity)


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


def check_mapping_memory(timed: TimedProblem, compute: np.ndarray) -> None:
    """A mapping that keeps more of one micro-batch's stashes on a worker than its limit can never run."""
    problem = timed.problem
    if problem.memory_limit is None:
        return
    need, worker = problem.min_memory_mapped(compute)
    if need > problem.memory_limit + 1e-9:
        raise PlanInputError(
            f"infeasible: this mapping keeps {need:g} of one micro-batch's stashes on worker {worker}, so the "
            f"memory limit needs at least {need:g} (got {problem.memory_limit:g}); raise --memory-limit or "
            "choose another strategy"
        )
