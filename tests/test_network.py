"""The network model, and the planner and simulator pricing transfers with it alike."""

from __future__ import annotations

import numpy as np
import pytest

from unisched import Costs, network, simulate
from unisched.costs import Link
from unisched.errors import ShapeError
from unisched.network import (
    link_arrays,
    ring_allreduce_time,
    tensor_parallel_time,
    transfer_matrix,
    transfer_time,
)
from unisched.plan.order import solve_order, step_tails
from unisched.plan.problem import PlanProblem, TimedProblem
from unisched.plan.schedule import Schedule
from unisched.work import BACKWARD, ComputeAndWeightWorkers, Shape, Work


# ---------------------------------------------------------------------- point to point
def test_point_to_point_is_latency_plus_size_over_bandwidth():
    costs = Costs(latency=1.0, bandwidth=4.0, links={(0, 2): Link(latency=3.0, bandwidth=1.0)})
    assert transfer_time(costs, 0, 1, 8.0) == 3.0
    assert transfer_time(costs, 0, 2, 8.0) == 11.0
    assert transfer_time(costs, 2, 0, 8.0) == 3.0
    assert np.array_equal(transfer_time(costs, 0, 1, np.array([0.0, 4.0])), [1.0, 2.0])


def test_nothing_moves_to_the_same_worker():
    costs = Costs(latency=1.0, bandwidth=4.0, links={(1, 1): Link(latency=5.0)})
    assert transfer_time(costs, 1, 1, 8.0) == 0.0
    assert np.array_equal(transfer_time(costs, 1, 1, np.array([2.0, 3.0])), [0.0, 0.0])


def test_transfer_matrix_matches_point_to_point_entry_by_entry():
    costs = Costs(latency=0.5, bandwidth=2.0, links={(0, 1): Link(latency=2.0, bandwidth=0.5), (2, 1): Link(0.0)})
    sizes = [0.0, 1.0, 3.0]
    times = transfer_matrix(costs, 3, sizes)
    assert times.shape == (3, 3, 3)
    for a in range(3):
        for b in range(3):
            assert np.array_equal(times[a, b], [transfer_time(costs, a, b, x) for x in sizes])
    assert not times[np.arange(3), np.arange(3)].any()
    latency, bandwidth = link_arrays(costs, 3)
    assert latency[0, 1] == 2.0 and bandwidth[0, 1] == 0.5 and bandwidth[2, 1] == np.inf
    with pytest.raises(ShapeError, match="1-d"):
        transfer_matrix(costs, 3, [[1.0]])


# ---------------------------------------------------------------------- collectives
def test_ring_allreduce_steps_at_the_pace_of_its_slowest_hop():
    slow_latency = {(0, 1): Link(latency=3.0, bandwidth=8.0)}
    slow_bandwidth = {(2, 0): Link(latency=1.0, bandwidth=2.0)}
    costs = Costs(latency=1.0, bandwidth=8.0, links={**slow_latency, **slow_bandwidth})
    # 3 members: 4 steps of a third of the data, each with latency 3 and bandwidth 2
    assert ring_allreduce_time(costs, [0, 1, 2], 6.0) == 4 * 3.0 + 4 / 3 * 6.0 / 2.0
    # the ring 0 -> 2 -> 1 -> 0 uses neither slow link
    assert ring_allreduce_time(costs, [0, 2, 1], 6.0) == 4 * 1.0 + 4 / 3 * 6.0 / 8.0
    assert np.array_equal(ring_allreduce_time(costs, [0, 2, 1], np.array([0.0, 6.0])), [4.0, 5.0])


def test_a_ring_of_one_costs_nothing_and_an_empty_one_is_an_error():
    costs = Costs(latency=1.0, bandwidth=2.0)
    assert ring_allreduce_time(costs, [3], 10.0) == 0.0
    with pytest.raises(ShapeError, match="at least one worker"):
        ring_allreduce_time(costs, [], 10.0)


def test_tensor_parallel_collective_is_a_ring_allreduce_of_the_activation():
    costs = Costs(latency=0.5, bandwidth=4.0, links={(1, 0): Link(latency=2.0)})
    assert tensor_parallel_time(costs, [0, 1], 8.0) == 2 * 2.0 + 8.0 / 4.0  # the slow hop 1 -> 0 sets the pace


# ---------------------------------------------------------------------- planner == simulator
def ddp(work):
    return ComputeAndWeightWorkers(work.batch, work.batch)


@pytest.mark.parametrize(
    "costs, slowest, first_hop",
    [
        (Costs(latency=0.25, weight_bytes=1.0, links={(1, 2): Link(latency=2.0)}), 8.0, 1.0),
        (Costs(latency=0.25, bandwidth=4.0, weight_bytes=3.0, links={(1, 2): Link(latency=2.0, bandwidth=1.0)}),
         12.0, 2.0),
    ],
)
def test_planner_prices_an_allreduce_as_the_simulator_books_it(costs, slowest, first_hop):
    """Three replicas of each stage, one slow hop in the ring: both price the slowest hop."""
    W = S = B = 3
    sim = simulate(W, S, B, ddp, costs=costs)
    reduces = [r for r in sim.timeline.transfers if r.kind == "allreduce"]
    assert len(reduces) == S * W
    assert {r.end - r.start for r in reduces} == {slowest}

    problem = PlanProblem(Shape(W, S, B), costs)
    timed = TimedProblem.build(problem)
    compute = timed.batch.copy()
    tails = step_tails(timed, compute, compute)
    gradients = timed.direction == BACKWARD
    assert {timed.ticks.time(t) for t in tails[gradients]} == {slowest}
    hop = costs.link(0, 1)  # what the ring costs when every hop is as fast as its first
    assert ring_allreduce_time(Costs(latency=hop.latency, bandwidth=hop.bandwidth), [0, 1, 2], costs.weight_bytes) \
        == first_hop != slowest
    assert not tails[~gradients].any()

    solved = solve_order(timed, compute, compute, time_limit=5)
    assert solved.optimal and timed.ticks.time(solved.objective) == sim.latency
    replay = Schedule.from_starts(problem, compute, compute, solved.starts).simulate()
    assert replay.latency == sim.latency


def test_planner_prices_a_tied_weights_all_reduce_as_the_simulator_books_it():
    """A pipeline of 3 stages on 3 workers whose first and last stages share a
    weight: the order model's step tails hold its all-reduce for those
    stages' backwards only, and its proven optimum is the replay's latency."""
    W = S = 3
    B = 2
    costs = Costs(bandwidth=2.0, latency=0.25, tied_weights=[((0, 2), 6.0)])
    problem = PlanProblem(Shape(W, S, B), costs)
    timed = TimedProblem.build(problem)
    compute = timed.stage.copy()
    tails = step_tails(timed, compute, compute)
    tied = (timed.direction == BACKWARD) & np.isin(timed.stage, (0, 2))
    assert {timed.ticks.time(t) for t in tails[tied]} == {ring_allreduce_time(costs, [0, 2], 6.0)} == {2 * 0.25 + 3.0}
    assert not tails[~tied].any()

    solved = solve_order(timed, compute, compute, time_limit=5)
    replay = Schedule.from_starts(problem, compute, compute, solved.starts).simulate()
    assert solved.optimal and timed.ticks.time(solved.objective) == replay.latency
    assert [r.kind for r in replay.timeline.transfers].count("allreduce") == 2


def test_planner_prices_a_moved_stash_as_the_stage_inputs():
    """Backwards on worker 1, forwards on worker 0: stage 1's stash moves as its
    input (2 bytes, not the 7 it keeps); stage 0's input is the micro-batch."""
    costs = Costs(bandwidth=1.0, activation_bytes=2.0, stash_bytes=7.0)
    problem = PlanProblem(Shape(2, 2, 1), costs)
    timed = TimedProblem.build(problem)
    compute = np.where(timed.direction == BACKWARD, 1, 0)
    solved = solve_order(timed, compute, compute, time_limit=5)
    replay = Schedule.from_starts(problem, compute, compute, solved.starts).simulate()
    stash = [(r.work, r.end - r.start) for r in replay.timeline.transfers if r.kind == "stash"]
    assert stash == [(Work(0, 1, BACKWARD), 2.0)]
    assert timed.ticks.time(solved.objective) == replay.latency == 1.0 + 1.0 + 2.0 + 2.0 + 2.0


def test_a_link_table_gives_the_times_of_link_times_for_every_pair():
    costs = Costs(latency=0.5, bandwidth=4.0, links={(0, 2): Link(latency=2.0, bandwidth=1.0), (2, 1): Link(0.1, 8.0)})
    table = network.LinkTable(costs)
    for src in range(3):
        for dst in range(3):
            if src != dst:
                assert table.times(src, dst, 8.0) == network.link_times(costs, src, dst, 8.0)
    assert table.times(0, 2, 8.0) == (2.0, 8.0)
