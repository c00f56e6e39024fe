"""A lower bound for every schedule: the step with its workers pooled, solved by CP-SAT.

Pool every worker's compute into W identical machines, each running any item
at the fastest worker's speed, and every worker's memory into one room (the
room :mod:`unisched.plan.bounds` gives the memory-time bound).  The items
keep their dependencies (:func:`unisched.dataflow.edges`) and each stash
share is live from its forward's start to the end of the pass that frees it
(the rule of :mod:`unisched.dataflow`).  Every schedule of the step is a
schedule of this pooled step, no longer than it, so CP-SAT's lower bound on
the pooled step's makespan bounds every schedule's latency.  Where the
memory-time bound spreads the stashes' live time evenly over the step, the
pooled step also pays for filling and draining the room: for W = S = 4,
B = 8, memory limit 2 the memory-time bound is 30 and the pooled step 38.

One rule of the scheme keeps some of what pooling loses: every stash of a
micro-batch is live when its last forward starts, each on the worker of the
first backward pass that frees it (B, or I with a split backward).  When
they do not fit in one worker's room, the micro-batch's first backward
passes run on at least k workers, so at least k - 1 of the gradients
between them move between workers, each taking at least the shortest
transfer of its stage's gradient (stage graphs are chains here, as
:attr:`unisched.plan.problem.PlanProblem.stage_graph` says).

It bounds the latency only: a worker's busy span (``objective="span"``) can
be shorter than the step.
"""

from __future__ import annotations

import time

import numpy as np
from ortools.sat.python import cp_model

from unisched.plan.bounds import stash_room
from unisched.plan.order import Solved, capacity, live_stashes, make_solver, memory_demands, run_solver
from unisched.plan.problem import TimedProblem
from unisched.timeline import TRANSFER_KINDS
from unisched.work import FORWARD


SEARCHES = ("core", "objective_lb_search")
"""CP-SAT's searches for the pooled step, one worker each: both raise the lower bound, which is all
this model is for.  On the hard steps of ``benchmarks/planner_small.py`` they proved the pooled
optimum in 0.3 to 4.6 s where CP-SAT's default search with its LP took up to 6 s and more, and the
planner's portfolio (:data:`unisched.plan.order.PORTFOLIO`) longer still (W = S = 4, B = 8, memory
2: no proof in 5 s, against 0.4 to 0.7 s)."""


def pooled_bound(timed: TimedProblem, *, time_limit: float, seed: int = 0, lower: int = 0,
                 upper: int | None = None) -> Solved:
    """CP-SAT's lower bound on the pooled step's makespan within ``time_limit`` seconds
    (``Solved.bound``, in ticks; ``Solved.optimal`` when it is the pooled step's optimum, and no
    schedule: the pooled step's are not schedules of the step); ``lower`` and ``upper`` (ticks)
    are known bounds on the optimum (a bound proven elsewhere; the latency of a schedule found).
    Ctrl-C stops it (``Solved.interrupted``)."""
    problem = timed.problem
    W = problem.shape.num_workers
    n = problem.num_items
    duration = timed.duration.min(axis=1)
    horizon = int(duration.sum() + timed.comm.max() * n) if upper is None else int(upper)
    model = cp_model.CpModel()
    start = [model.new_int_var(0, horizon - int(duration[i]), f"s{i}") for i in range(n)]
    end = [start[i] + int(duration[i]) for i in range(n)]
    model.add_cumulative([model.new_fixed_size_interval_var(start[i], int(duration[i]), f"x{i}") for i in range(n)],
                         [1] * n, W)
    k = problem.first_backward_workers()
    _dependencies(model, timed, start, end, k)
    room = stash_room(problem)
    if np.isfinite(room):
        _, unit = memory_demands(timed)
        lives, demands = [], []
        for _, _, f, r, demand in live_stashes(timed):
            lives.append(model.new_interval_var(start[f], model.new_int_var(0, horizon, f"l{r}"), end[r], f"l{r}"))
            demands.append(demand)
        model.add_cumulative(lives, demands, capacity(unit, room))
    _first_in_first_out(model, problem, start, backward=k == 1)
    makespan = model.new_int_var(int(lower), horizon, "makespan")
    model.add_max_equality(makespan, end)
    model.minimize(makespan)
    solver = make_solver(time_limit, len(SEARCHES), seed, SEARCHES)
    begin = time.perf_counter()
    status, interrupted = run_solver(solver, model)
    # INFEASIBLE cannot be (a schedule within ``upper`` exists): then claim nothing of it
    bound = int(lower) if status == cp_model.INFEASIBLE else int(solver.best_objective_bound)
    return Solved(solver.status_name(status), None, None, None, None, bound, time.perf_counter() - begin,
                  interrupted=interrupted)


def _dependencies(model, timed: TimedProblem, start, end, k: int) -> None:
    """Every item after its inputs; a micro-batch's gradients between first backward passes on
    different workers (at least k - 1 of them, k the workers they need:
    :meth:`~unisched.plan.problem.PlanProblem.first_backward_workers`) after a transfer."""
    edges = timed.data_edges()
    gradient = edges.moves == TRANSFER_KINDS.index("gradient")
    shortest = timed.least_delays(edges)
    moves: dict[int, list] = {}
    for e, (src, dst) in enumerate(zip(edges.src.tolist(), edges.dst.tolist())):
        if not (gradient[e] and k > 1):
            model.add(start[dst] >= end[src])
            continue
        moved = model.new_bool_var(f"m{e}")  # a crossing of no delay still counts among the k - 1
        model.add(start[dst] >= end[src] + int(shortest[e]) * moved)
        moves.setdefault(int(timed.batch[src]), []).append(moved)
    for crossings in moves.values():
        model.add(sum(crossings) >= k - 1)


def _first_in_first_out(model, problem, start, backward: bool) -> None:
    """Micro-batches in one order through every stage's forward and, where no crossings are counted
    (``backward``: k = 1), through every backward pass.

    Sound because micro-batches are alike in the pooled step: where two of them swap order at a
    stage's forward for the first time, exchanging everything from there on between them gives a
    schedule as long, with the same dependencies met and the same memory in use at every moment
    (each stage's stashes start and end at the same times, only paired otherwise).  The exchange
    along the backward chain would move crossings from one micro-batch to the other, so it is made
    only where none are counted."""
    grid = problem.item_grid()
    passes = [problem.dirs.index(FORWARD)] if not backward else range(len(problem.dirs))
    for k in passes:
        for s in range(problem.shape.num_stages):
            for a, b in zip(grid[:, s, k], grid[1:, s, k]):
                model.add(start[a] <= start[b])
