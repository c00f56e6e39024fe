"""The pooled step's lower bound (unisched.plan.pooled): what it proves, that it is never above a
schedule that runs, and that its symmetry breaking cuts off no optimum."""

from __future__ import annotations

import _thread
import threading

import pytest

from unisched import Costs
from unisched.plan import encode_costs, plan
from unisched.plan import planner, pooled
from unisched.plan.bounds import ANY_SCHEDULE, shape_bounds
from unisched.plan.command import report
from unisched.plan.problem import PlanProblem, TimedProblem
from unisched.work import Shape


def bound_of(shape, costs, memory=None, split=False, seconds=20.0, **limits) -> tuple[float, bool]:
    problem = PlanProblem(Shape(*shape), costs, memory, split_backward=split, **limits)
    timed = TimedProblem.build(problem)
    solved = pooled.pooled_bound(timed, time_limit=seconds)
    assert not solved.found, "the pooled step's solutions are not schedules of the step"
    return timed.ticks.time(solved.bound), solved.optimal


def test_the_pooled_step_proves_what_the_memory_time_bound_cannot():
    """W = S = 4, B = 8, memory 2: the memory-time bound spreads the stashes' live time evenly
    and gives 30; filling and draining the room make it 38, the planner's best schedule."""
    problem = PlanProblem(Shape(4, 4, 8), Costs(), 2)
    assert shape_bounds(problem)["memory_time"] == 30
    assert bound_of((4, 4, 8), Costs(), 2) == (38, True)


def test_a_micro_batch_whose_stashes_need_two_workers_pays_a_gradient_transfer():
    """Two stashes of one micro-batch with room 1 per worker: its backward passes run on two
    workers, so one gradient moves between them (comm 1), as in the best schedule (13)."""
    assert PlanProblem(Shape(2, 2, 2), encode_costs(comm=1), 1).first_backward_workers() == 2
    assert bound_of((2, 2, 2), encode_costs(comm=1), 1) == (13, True)
    assert bound_of((2, 2, 2), encode_costs(comm=0), 1)[0] < 13


@pytest.mark.parametrize("shape, costs, memory, split, extra, workers", [
    ((4, 4, 8), Costs(), 2, False, {}, 2),
    ((4, 4, 8), Costs(), 4, False, {}, 1),
    ((4, 4, 8), Costs(), None, False, {}, 1),
    ((2, 4, 8), Costs(), (1, 3), False, {}, 2),  # the larger room first: 3 + 1 hold the 4 stashes
    ((3, 4, 8), Costs(), (1, 1, 2), False, {}, 3),
    ((4, 4, 8), encode_costs(backward_input=1, backward_weight=1), 2, True, {}, 1),  # I frees half
    ((4, 4, 8), Costs(backward_input=1, backward_weight=1, input_grad_frees=0.75), 2, True, {}, 2),
    ((2, 2, 4), Costs(activation_bytes=10.0, weight_bytes=1.0), None, False, {"memory_budget": 14.0}, 2),
])
def test_first_backward_workers_counts_the_rooms_a_micro_batchs_stashes_need(shape, costs, memory, split, extra,
                                                                            workers):
    problem = PlanProblem(Shape(*shape), costs, memory, split_backward=split, **extra)
    assert problem.first_backward_workers() == workers


@pytest.mark.parametrize("shape, costs, memory, split", [
    ((2, 2, 3), encode_costs(comm=1), 1, False),  # crossings counted: forwards in order only
    ((2, 3, 4), encode_costs(comm=1), 2, False),
    ((3, 3, 4), encode_costs(backward_input=1, backward_weight=1), 2, True),  # every pass in order
    ((2, 3, 4), Costs(forward=1, backward=3, latency=0.5), 2, False),
])
def test_micro_batches_in_one_order_cut_off_no_optimum(monkeypatch, shape, costs, memory, split):
    """The pooled optimum with micro-batches first-in-first-out equals the optimum without."""
    ordered = bound_of(shape, costs, memory, split)
    monkeypatch.setattr(pooled, "_first_in_first_out", lambda *args, **kwargs: None)
    free = bound_of(shape, costs, memory, split, seconds=60)
    assert ordered[1] and free[1], "both solved to optimality"
    assert ordered[0] == free[0]


@pytest.mark.parametrize("shape, costs, memory, split", [
    ((2, 2, 4), encode_costs(comm=1), 1, False),
    ((3, 3, 4), encode_costs(comm=1), 2, False),
    ((2, 3, 4), encode_costs(backward_input=1, backward_weight=1, comm=1), 2, True),
    ((3, 4, 4), Costs(forward=1, backward=2, latency=0.5, stash_bytes=[1, 2, 1, 2], activation_bytes=1.0,
                      bandwidth=4.0), 4.0, False),
    ((3, 2, 4), Costs(forward=2, backward=3, worker_speed=[1.0, 2.0, 1.0], latency=1.0), (1, 2, 1), False),
])
def test_no_schedule_the_planner_finds_or_simulates_is_shorter_than_the_pooled_bound(shape, costs, memory, split):
    """A bound for every schedule: at most every candidate's replayed latency, named strategies' included."""
    result = plan(*shape, costs, memory_limit=memory, split_backward=split, time_limit=3)
    bound = result.bounds["cpsat_pooled"]
    assert result.bound_classes["cpsat_pooled"] == ANY_SCHEDULE
    assert bound > 0
    assert all(row["latency"] >= bound - 1e-9 for row in result.candidates)
    assert result.simulate().latency >= bound - 1e-9


def test_the_report_names_the_pooled_bound_among_those_for_every_schedule():
    result = plan(2, 2, 2, encode_costs(comm=1), memory_limit=1, time_limit=10)
    text = report(result)
    assert "for any schedule:" in text and "cpsat pooled 13" in text.split("for any schedule:")[1].splitlines()[0]


def test_the_pooled_bound_is_not_taken_for_the_span_or_without_a_memory_limit():
    assert "cpsat_pooled" not in plan(2, 2, 4, memory_limit=1, objective="span", time_limit=2).bounds
    assert "cpsat_pooled" not in plan(2, 2, 4, time_limit=2).bounds


def test_ctrl_c_stops_the_pooled_step_and_the_planner_after_it(monkeypatch):
    """Ctrl-C in the pooled step ends its solve at once, saying so; the planner then answers with
    the best plan so far instead of going on to its searches."""
    problem = PlanProblem(Shape(4, 4, 16), encode_costs(comm=1))  # no limit: no proof within a minute
    timer = threading.Timer(0.5, _thread.interrupt_main)
    timer.start()
    try:
        solved = pooled.pooled_bound(TimedProblem.build(problem), time_limit=60)
    finally:
        timer.cancel()
    assert solved.interrupted and solved.wall < 10

    def interrupted(timed, **kwargs):
        return pooled.Solved("UNKNOWN", None, None, None, None, 0, 0.0, interrupted=True)
    monkeypatch.setattr(planner, "pooled_bound", interrupted)
    result = plan(4, 4, 8, memory_limit=2, time_limit=60)
    assert result.interrupted and result.elapsed < 10
    assert all(row["source"] in ("family", "constructed") for row in result.candidates)
