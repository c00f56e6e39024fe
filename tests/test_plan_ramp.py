"""The ramp bound (unisched.plan.bounds.ramp): the work bound with the idle time at a step's two
ends, for the whole scheme's schedules (one weight worker per stage, a split backward's I and W on
one worker).  Never above that class's optimum
(proven by the whole-scheme CP-SAT model), often equal to it, and what it lets the planner claim.
And its like for every schedule a plan can hold (unisched.plan.bounds.every_ramp: replicas, each
pass on any worker), never above the replay of any such schedule."""

from __future__ import annotations

import numpy as np
import pytest

from unisched import Costs
from unisched.plan import encode_costs, plan
from unisched.plan.bounds import ANY_SCHEDULE, every_ramp, ramp, shape_bounds
from unisched.plan.mapping import EVERY, WHOLE_SCHEME, fits, solve_mapping
from unisched.plan.problem import PlanProblem, TimedProblem
from unisched.plan.schedule import Schedule
from unisched.work import Shape


def timed_of(shape, costs, memory=None, split=False) -> TimedProblem:
    return TimedProblem.build(PlanProblem(Shape(*shape), costs, memory, split_backward=split))


SPLIT = dict(backward_input=1, backward_weight=1)


@pytest.mark.parametrize("shape, costs, memory, split, optimum, tight", [
    ((2, 2, 2), encode_costs(comm=1), None, False, 8, False),
    ((2, 2, 2), encode_costs(comm=1, fetch=3), None, False, 9, True),
    ((2, 2, 4), encode_costs(comm=1, fetch=2), None, False, 14, True),
    ((3, 2, 4), encode_costs(comm=1), None, False, 10, True),
    ((3, 3, 3), encode_costs(comm=1), None, False, 11, True),
    ((3, 2, 4), encode_costs(comm=1, **SPLIT), None, True, 9, True),
    ((3, 2, 4), encode_costs(comm=1), 2, False, 11, False),
    ((3, 2, 3), Costs(forward=2, backward=3, worker_speed=[1.0, 2.0, 1.0], latency=1.0), None, False, 10, False),
    ((4, 2, 4), encode_costs(comm=2, fetch=2), None, False, 10, False),
])
def test_the_ramp_is_never_above_the_proven_optimum_of_its_class(shape, costs, memory, split, optimum, tight):
    """Never above the whole-scheme model's proven optimum, and equal to it (``tight``) on five of
    these steps, where the bounds for every schedule fall short."""
    timed = timed_of(shape, costs, memory, split)
    solved = solve_mapping(timed, time_limit=60, scheme=WHOLE_SCHEME, num_workers=2)
    assert solved.optimal and timed.ticks.time(solved.objective) == optimum
    bound = timed.ticks.time(ramp(timed))
    assert bound <= optimum
    if tight:
        assert bound == optimum > max(shape_bounds(timed.problem).values())


def test_the_ramp_counts_both_ends():
    """W = S = B = 2, comm 1, weights fetched in 3: a worker without stage 0's weights starts no
    sooner than 2 (stage 1's forward after stage 0's and a transfer; stage 0's forward waits 3 for
    its weights), and one without them ends 3 before the step (stage 0's gradient goes back, or
    stage 1's backward hands its gradient over: 1 + 2).  One worker lacks them: 2 T >= 12 + 2 + 3,
    T >= 8.5, so 9 in whole ticks; the work bound is 6."""
    timed = timed_of((2, 2, 2), encode_costs(comm=1, fetch=3))
    assert shape_bounds(timed.problem)["work"] == 6
    assert ramp(timed) == 9


def test_the_ramp_puts_the_idle_time_on_the_slowest_workers():
    """Speeds 1, 2, 1; forward 2, backward 3, transfers and fetches 1; W = 3, S = 2, B = 3: 30 units
    of work over a total speed of 4 (the work bound 7.5).  Two workers lack stage 0's weights and
    idle 1 at each end; at the least they are the two slow ones: 4 T >= 30 + 2 + 2, T >= 8.5."""
    timed = timed_of((3, 2, 3), Costs(forward=2, backward=3, worker_speed=[1.0, 2.0, 1.0], latency=1.0))
    assert shape_bounds(timed.problem)["work"] == 7.5
    assert timed.ticks.time(ramp(timed)) == 8.5


def test_without_transfers_the_ramp_is_the_work_bound():
    timed = timed_of((4, 4, 8), Costs())
    assert ramp(timed) == shape_bounds(timed.problem)["work"] == 24


def test_the_planner_proves_the_unlimited_step_with_transfers_optimal_in_its_class():
    """W = S = 4, B = 8, comm 1: the work bound is 24 and CP-SAT's bounds stay below 26 within the
    time limit; the replica ramp (one holder of stage 0: 4 T >= 96 + 3 + 3; replicas of it: 4 T
    >= 96 + 4 x 2, their all-reduce) proves the plan's 26 for every schedule a plan can hold, and
    the planner stops there.  The claim names that class, and the report lists the bound under it
    (the whole scheme's ramp, 26 too, says no more and is left out)."""
    result = plan(4, 4, 8, encode_costs(comm=1), time_limit=20)
    assert result.latency == 26 and result.bounds["replica_ramp"] == 26 and "ramp" not in result.bounds
    assert result.bound_classes["replica_ramp"] == EVERY
    assert result.optimal and result.proven_for == EVERY
    assert result.bounds["work"] == 24 and result.bound_classes["work"] == ANY_SCHEDULE
    assert result.elapsed < 5  # it stops at the bound (about 0.2 s), long before the time limit


def test_the_ramp_is_left_out_where_it_says_no_more_or_bounds_nothing():
    for bounds in (plan(2, 2, 4, time_limit=2).bounds,  # no transfers: the work bound
                   plan(2, 2, 4, encode_costs(comm=1), objective="span", time_limit=2).bounds):
        assert "ramp" not in bounds and "replica_ramp" not in bounds


def test_replicas_escape_the_ramp_and_the_plan_claims_nothing_of_it():
    """W = B = 3, one stage, no transfer time, weights fetched in 1: ddp (every worker holds
    the stage) starts every worker at once and takes 4.33, under the ramp's 5, which holds for one
    weight worker per stage only.  The plan is ddp, and the ramp, above it, is left out of its
    bounds rather than claimed.  The replica ramp counts the all-reduce of replicas (4/3, taken
    as 1 in whole ticks) and stays below: 4."""
    costs = encode_costs(comm=0, fetch=1)
    timed = timed_of((3, 1, 3), costs)
    result = plan(3, 1, 3, costs, time_limit=5)
    assert result.strategy_name == "ddp" and result.latency < timed.ticks.time(ramp(timed)) == 5
    assert "ramp" not in result.bounds and not result.optimal
    assert result.bounds["replica_ramp"] == timed.ticks.time(every_ramp(timed)) == 4 < result.latency


def test_a_split_backwards_passes_apart_escape_the_ramp():
    """One stage, W = 2, weights on worker 0 (fetched in 5): worker 1 runs micro-batch 0's W pass,
    which needs nothing moved, early, and ends with micro-batch 1's I pass, whose W runs on worker 0
    (the one-stage input needs no stash).  Its replay takes 11, under the ramp's 12: a schedule
    with I and W apart lies outside the ramp's class, and the planner's class check says so."""
    costs = encode_costs(forward=1, backward=3, backward_input=2, backward_weight=1, comm=1, fetch=5)
    problem = PlanProblem(Shape(2, 1, 4), costs, split_backward=True)
    timed = TimedProblem.build(problem)
    F, I, W = problem.dirs
    orders = {0: [(0, F), (0, I), (3, F), (3, I), (3, W), (2, I), (2, W), (1, W)],
              1: [(0, W), (2, F), (1, F), (1, I)]}
    items = problem.items
    compute = np.zeros(problem.num_items, dtype=np.int64)
    for worker, passes in orders.items():
        compute[[items.id(b, 0, d) for b, d in passes]] = worker
    weight = np.zeros(problem.num_items, dtype=np.int64)
    schedule = Schedule(problem, compute, weight,
                        {w: [int(items.id(b, 0, d)) for b, d in passes] for w, passes in orders.items()})
    assert schedule.simulate().latency == 11 < ramp(timed) == 12
    assert not fits(timed, compute, weight, WHOLE_SCHEME)
    assert every_ramp(timed) == 11  # a W pass may be a worker's first, and an I its last


def test_the_heuristic_search_stops_at_the_ramp_and_claims_its_class():
    """W = S = 8, B = 32, comm 1 with the heuristic search (large steps): the work bound is 96 and
    the replica ramp 98 (8 T >= 768 + 7 + 7; replicas of stage 0 would idle every worker for their
    all-reduce, 2 at the least), which the seed with every micro-batch on one worker meets; the
    search stops there and claims every schedule a plan can hold, not every schedule."""
    result = plan(8, 8, 32, encode_costs(comm=1), search="heuristic", time_limit=20)
    assert result.bounds["work"] == 96 and result.bounds["replica_ramp"] == 98 == result.latency
    assert result.optimal and result.proven_for == result.bound_for == EVERY
    assert result.lower_bound == 98 and result.elapsed < 5  # stopped at the bound, not the 20 s limit
    bounds = plan(8, 8, 32, encode_costs(comm=1), search="heuristic", time_limit=2, objective="span").bounds
    assert "ramp" not in bounds and "replica_ramp" not in bounds


@pytest.mark.parametrize("shape, costs, split, optimum", [
    ((2, 2, 2), encode_costs(comm=1, fetch=3), False, 9),
    ((3, 2, 4), encode_costs(comm=1), False, 10),
    ((3, 2, 4), encode_costs(comm=1, **SPLIT), True, 9),
    ((2, 3, 2), encode_costs(comm=1, **SPLIT), True, 9),
    ((4, 2, 4), encode_costs(comm=1, **SPLIT), True, 8),
    ((3, 1, 3), encode_costs(comm=0, fetch=1), False, 4.0),
])
def test_the_replica_ramp_meets_the_proven_optimum_of_every_schedule_a_plan_can_hold(
        shape, costs, split, optimum):
    """The every-schedule model's proven optimum (replicas and passes apart allowed; the model's
    all-reduces are rounded down to whole ticks, as the replica ramp's are) on these small steps,
    never above it (W = 4, S = 2, B = 4, split: only with the all-reduce's last ticks counted for
    each number of holders)."""
    timed = timed_of(shape, costs, None, split)
    solved = solve_mapping(timed, time_limit=60, scheme=EVERY, num_workers=2)
    assert solved.optimal and timed.ticks.time(solved.objective) == optimum
    assert timed.ticks.time(every_ramp(timed)) == optimum


def test_the_replica_ramp_counts_the_all_reduce_of_replicated_source_stages():
    """W = S = 2, B = 8, comm 1 (an all-reduce among two takes 2): with one holder of stage 0, 2 T
    >= 48 + 1 + 1; with two, both start at once but every pass comes before stage 0's backward, so
    both idle 2 at the end: 2 T >= 48 + 2 + 2. The least, 25, above the work bound 24, proves the
    plan's 25 for every schedule a plan can hold.  With a split backward the other stages' W passes
    may fill that end, and a W pass need not wait for its I's worker, so the bound falls below the
    whole scheme's ramp; without a link time it is the work bound."""
    timed = timed_of((2, 2, 8), encode_costs(comm=1))
    assert timed.allreduce[:, 2].tolist() == [2, 2]
    assert shape_bounds(timed.problem)["work"] == 24 and every_ramp(timed) == 25
    result = plan(2, 2, 8, encode_costs(comm=1), time_limit=20)  # CP-SAT's bounds stay at 24 here
    assert result.latency == 25 and result.optimal and result.proven_for == EVERY
    split = timed_of((2, 3, 8), encode_costs(comm=1, **SPLIT), split=True)
    assert every_ramp(split) == 36 < ramp(split) == 37
    assert every_ramp(timed_of((4, 4, 8), Costs())) == 24


def test_with_a_split_backward_only_passes_no_gradient_pass_needs_run_in_the_all_reduce():
    """W = 4, S = 2, B = 8, split, comm 1: one holder of stage 0 gives 4 T >= 48 + 3 + 2; two leave
    the other two waiting for its weights, 4 T >= 48 + 2 + 3; three or four make its all-reduce 4 or
    6 long, and in those last ticks only stage 1's W passes (8 of work) can run: 4 (T - 4) >= 40 + 1
    (one worker waits for stage 0's weights), or 4 (T - 6) >= 40.
    So 14 (where the work bound is 12, and the count that let replicas start every worker at once
    said 13), and the plan proves its 14 for every schedule a plan can hold."""
    costs = encode_costs(comm=1, **SPLIT)
    timed = timed_of((4, 2, 8), costs, split=True)
    assert timed.allreduce[0, 2:].tolist() == [2, 4, 6] and shape_bounds(timed.problem)["work"] == 12
    assert every_ramp(timed) == 14
    result = plan(4, 2, 8, costs, split_backward=True, time_limit=20)
    assert result.latency == 14 and result.optimal and result.proven_for == EVERY
