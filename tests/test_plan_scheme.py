"""The planner over the whole scheme: exact references for the smallest cases, claims that name
the class they are proven for, memory budgets with weights, split backward from costs, early
stops and Ctrl-C."""

from __future__ import annotations

import _thread
import argparse
import json
import threading

import numpy as np
import pytest

from unisched import ComputeAndWeightWorkers, Costs, all_work, dataflow, policies, simulate
from unisched.errors import UniSchedError
from unisched.memory import memory_curves
from unisched.plan import PlanInputError, encode_costs, plan
from unisched.plan.bounds import ANY_SCHEDULE, every_ramp
from unisched.plan.planfile import objective_value
from unisched.plan import mapping, order
from unisched.plan.mapping import EVERY, PAIRED, WHOLE_SCHEME, solve_mapping, whole_scheme_is_any
from unisched.plan.problem import PlanProblem, TimedProblem, mapping_of, rows_of
from unisched.plan.schedule import Schedule
from unisched.strategy import Strategy
from unisched.work import FORWARD, Shape


# ---------------------------------------------------------------------- exact references
def timed_2_2_4(costs, **options) -> TimedProblem:
    """The CP-SAT models' tables of W = S = 2, B = 4 under ``costs`` and the problem's ``options``."""
    return TimedProblem.build(PlanProblem(Shape(2, 2, 4), costs, **options))


def test_smallest_case_is_13_over_every_schedule_and_15_only_with_paired_passes():
    """W = S = 2, B = 2, memory 1, comm 1: a backward away from its forward gives 13, which the
    pooled step proves for every schedule; keeping the passes of a (stage, micro-batch) together
    cannot beat 15, and says so only for that class."""
    whole = plan(2, 2, 2, encode_costs(comm=1), memory_limit=1, time_limit=10)
    assert whole.latency == 13 and whole.simulate().latency == 13
    assert whole.optimal and whole.proven_for == ANY_SCHEDULE and whole.bounds["cpsat_pooled"] == 13
    compute = whole.schedule.compute[whole.problem.item_grid()]
    assert np.any(compute[:, :, 0] != compute[:, :, 1])  # some backward runs away from its forward

    paired = plan(2, 2, 2, encode_costs(comm=1), memory_limit=1, time_limit=10, scheme="paired")
    assert paired.latency == 15 and paired.optimal and paired.proven_for == PAIRED
    assert paired.lower_bound == 15 and paired.bound_for == PAIRED


def test_whole_scheme_model_finds_43_where_paired_passes_give_48():
    """W = 2, S = 4, B = 4, memory 2, comm 1: the whole-scheme model's optimum is 43 (the paired
    planner claimed 48 optimal)."""
    problem = PlanProblem(Shape(2, 4, 4), encode_costs(comm=1), memory_limit=2)
    timed = TimedProblem.build(problem)
    solved = solve_mapping(timed, time_limit=60, scheme=WHOLE_SCHEME, asap_replay=False)
    assert solved.optimal and solved.objective == 43
    # its start times as release times: the simulator replays it exactly as planned, within the limit
    replay = Schedule.planned(timed, solved.compute, solved.weight, solved.starts).simulate()
    t = replay.timeline
    assert replay.latency == 43 and np.array_equal(t.start[rows_of(problem, t)], solved.starts / timed.ticks.scale)
    assert max(replay.worker_stats()["max_activation_storage"]) <= 2


def test_a_periodic_mapping_search_places_micro_batches_alike_and_claims_no_bound():
    """With a period of 2 every micro-batch runs where the one two before it ran; the model's
    bound holds for that restriction only, so the result carries none.  The whole scheme's
    optimum (43) is not periodic: no periodic mapping reaches it."""
    problem = PlanProblem(Shape(2, 4, 4), encode_costs(comm=1), memory_limit=2)
    timed = TimedProblem.build(problem)
    bounds = []
    solved = solve_mapping(timed, time_limit=30, scheme=WHOLE_SCHEME, asap_replay=False, period=2,
                           report=lambda objective, bound, seconds: bounds.append(bound))
    assert solved.found and solved.bound == 0 and not solved.optimal
    assert bounds and bounds == [None] * len(bounds), "its progress reports no bound either"
    compute = solved.compute[problem.item_grid()]  # (batch, stage, pass)
    assert np.array_equal(compute[2:], compute[:-2])
    assert solved.objective / timed.ticks.scale > 43
    replay = Schedule.planned(timed, solved.compute, solved.weight, solved.starts).simulate()
    assert replay.latency == solved.objective / timed.ticks.scale


@pytest.mark.parametrize("shape, costs, memory, optimum, proven", [
    ((2, 2, 8), encode_costs(comm=1), 1, 49, ANY_SCHEDULE),
    ((3, 2, 4), encode_costs(backward_input=1, backward_weight=1, comm=1), 1, 15, EVERY),  # the whole scheme's: 17
    ((2, 4, 8), encode_costs(comm=1), None, 49, EVERY),  # the replica ramp's
])
def test_small_steps_are_planned_to_their_proven_optimum(shape, costs, memory, optimum, proven):
    """Exact references: the plan meets a bound proven for the class named, and replays to it."""
    result = plan(*shape, costs, memory_limit=memory, time_limit=10)
    assert result.latency == optimum and result.simulate().latency == optimum
    assert result.optimal and result.lower_bound == optimum and result.proven_for == proven


SPLIT_COMM_1 = encode_costs(backward_input=1, backward_weight=1, comm=1)


def test_every_schedule_beats_the_whole_schemes_optimum_with_a_split_backward():
    """W = 2, S = 3, B = 2, split backward, memory 2, comm 1: the whole scheme (one weight worker
    per stage, a split backward's I and W on one worker) cannot beat 14; running some I and W
    apart gives 12, which the model over every schedule a plan can hold proves."""
    problem = PlanProblem(Shape(2, 3, 2), SPLIT_COMM_1, memory_limit=2, split_backward=True)
    timed = TimedProblem.build(problem)
    whole = solve_mapping(timed, time_limit=30, scheme=WHOLE_SCHEME, asap_replay=False)
    assert whole.optimal and timed.ticks.time(whole.objective) == 14

    result = plan(2, 3, 2, SPLIT_COMM_1, memory_limit=2, split_backward=True, time_limit=10)
    assert result.latency == 12 and result.optimal and result.proven_for == EVERY
    assert result.bounds["cpsat_every_schedule"] == 12
    replay = result.simulate()
    assert replay.latency == 12 and max(replay.worker_stats()["max_activation_storage"]) <= 2
    compute = result.schedule.compute[problem.item_grid()]  # (batch, stage, pass): F, I, W
    assert np.any(compute[:, :, 1] != compute[:, :, 2])  # some I and W run apart


@pytest.mark.parametrize("split, optimum, replicated, proven", [(False, 8, "ddp", EVERY),
                                                                 (True, 9, None, ANY_SCHEDULE)])
def test_replicated_weights_are_searched_and_proven_beyond_the_whole_scheme(split, optimum, replicated, proven):
    """W = 2, B = 2, comm 1, no memory limit: replicas all-reduce their gradient at the end
    (2 (k - 1) comm), and the model over every schedule a plan can hold weighs that against
    fetching.  S = 2: ddp's 8, proven for that class (the whole scheme's model proved it for one
    weight worker per stage only).  S = 3 with a split backward: 9, stage 0 held by both workers,
    where the whole scheme's optimum is 10; 9 is the work bound, for any schedule."""
    S = 3 if split else 2
    costs = SPLIT_COMM_1 if split else encode_costs(comm=1)
    result = plan(2, S, 2, costs, split_backward=split, time_limit=10)
    assert result.latency == optimum and result.simulate().latency == optimum
    assert result.optimal and result.proven_for == proven
    holders = [len(h) for h in dataflow.replicas(result.problem.items.arrays()[1], result.schedule.weight, S)]
    assert max(holders) == 2
    if replicated:
        assert result.strategy_name == replicated
    else:
        whole = plan(2, S, 2, costs, split_backward=split, time_limit=10, scheme="whole")
        assert whole.latency == 10 and whole.optimal and whole.proven_for == WHOLE_SCHEME


@pytest.mark.parametrize("shape, costs, memory, whole_ticks", [
    ((2, 2, 2), SPLIT_COMM_1, 2, True),
    ((2, 2, 2), SPLIT_COMM_1, 1, True),
    ((3, 1, 3), encode_costs(fetch=1), None, False),  # replicas, an all-reduce of 4/3 (rounded down to 1)
    ((2, 3, 2), encode_costs(comm=1), None, True),
])
def test_every_schedules_bound_is_below_every_schedule_tried(shape, costs, memory, whole_ticks):
    """The model over every schedule a plan can hold leaves out link contention and the sum of a
    weight pass's stash parts, so its bound must stay at or below any such schedule the simulator
    runs: the registry's strategies and random mappings (compute and weight worker per pass:
    replicas, passes of a (stage, micro-batch) apart) under the same costs and limit.  Its own
    solution replays to it where the all-reduces take whole ticks.  The replica ramp, for the
    same class, too."""
    W, S, B = shape
    split = costs.backward_input is not None
    problem = PlanProblem(Shape(*shape), costs, memory_limit=memory, split_backward=split)
    timed = TimedProblem.build(problem)
    solved = solve_mapping(timed, time_limit=30, scheme=EVERY, asap_replay=False)
    assert solved.optimal
    bound = timed.ticks.time(solved.bound)
    rng = np.random.default_rng(1)
    mappings = [policies.get(name, W, S, B, **params) for name, params in policies.variants(W, S, B)]
    for _ in range(300):
        table = {w: ComputeAndWeightWorkers(int(rng.integers(W)), int(rng.integers(W)))
                 for w in all_work(S, B, split_backward=split)}
        mappings.append(lambda w, table=table: table[w])
    # data parallel, but worker 0 named for every backward: worker b holds each stage for its forwards
    mappings.append(lambda w: ComputeAndWeightWorkers(w.batch % W, w.batch % W if w.direction == FORWARD else 0))
    latencies = []
    for strategy in mappings:
        try:
            latencies.append(simulate(W, S, B, strategy, costs=costs, memory_limit=memory,
                                      split_backward=split).latency)
        except UniSchedError:
            continue  # it deadlocks under the limit, or needs a split backward
    assert len(latencies) >= 20 and min(latencies) >= bound - 1e-9
    replay = Schedule.planned(timed, solved.compute, solved.weight, solved.starts).simulate()
    assert replay.latency >= bound - 1e-9
    assert min(latencies + [replay.latency]) >= timed.ticks.time(every_ramp(timed)) - 1e-9  # the same class
    if whole_ticks:
        assert replay.latency == bound


def test_weights_in_shards_can_beat_the_model_over_every_schedule_so_it_claims_no_more():
    """Shards move part of a stage's weights at a time, which no plan holds and the model does not
    price: W = S = B = 2, latency 0, bandwidth 1, stage 1's weights 3 bytes: fsdp(shard=true)
    takes 6.5 where the model proves 7 for its class (ddp), so the plan says its class, not
    "any schedule"."""
    costs = Costs(forward=1, backward=2, latency=0.0, bandwidth=1.0, weight_bytes=[0.0, 3.0])
    timed = TimedProblem.build(PlanProblem(Shape(2, 2, 2), costs))
    solved = solve_mapping(timed, time_limit=30, scheme=EVERY, asap_replay=False)
    assert solved.optimal and timed.ticks.time(solved.bound) == 7
    assert simulate(2, 2, 2, policies.get("fsdp", 2, 2, 2, shard=True), costs=costs).latency == 6.5
    result = plan(2, 2, 2, costs, time_limit=10)
    assert result.latency == 7 and result.optimal and result.proven_for == EVERY
    assert result.bound_classes["cpsat_every_schedule"] == EVERY


def test_the_planners_mappings_read_replicas_as_the_simulator_does():
    """Micro-batch b on worker b, each forward naming its own worker's weights, each backward
    worker 0's: worker 1 holds stage 0 (for its forward), so its backward computes with that copy,
    fetching and returning nothing, and both replicas all-reduce (2 (k - 1) comm plus
    2 (k - 1) / k of the 2 weight bytes at bandwidth 1: 4).  The planner's mapping of the strategy
    says so, and the order model's tails follow, as the simulator books them.  So too where worker
    1 holds the stage for its forward alone, both backwards running on worker 0: it takes part in
    the all-reduce all the same (3 + 2 on worker 0, then 4)."""
    def mixed(w):
        return ComputeAndWeightWorkers(w.batch, w.batch if w.direction == FORWARD else 0)

    def lends(w):
        return ComputeAndWeightWorkers(*2 * [w.batch if w.direction == FORWARD else 0])

    costs = encode_costs(comm=1, fetch=3)
    problem = PlanProblem(Shape(2, 1, 2), costs)
    timed = TimedProblem.build(problem)
    compute, weight = mapping_of(problem, Strategy(mapping=mixed))  # F, B of micro-batch 0, then 1
    assert compute.tolist() == [0, 0, 1, 1] and weight.tolist() == [0, 0, 1, 1]
    assert order.step_tails(timed, compute, weight).tolist() == [0, 4, 0, 4]
    assert simulate(2, 1, 2, mixed, costs=costs).latency == 3 + 4
    compute, weight = mapping_of(problem, Strategy(mapping=lends))
    assert compute.tolist() == weight.tolist() == [0, 0, 1, 0]
    assert order.step_tails(timed, compute, weight).tolist() == [0, 4, 0, 4]
    assert simulate(2, 1, 2, lends, costs=costs).latency == 5 + 4


def test_a_mapping_whose_greedy_replay_deadlocks_starts_from_a_list_schedule():
    """W = 2, S = 3, B = 8, split backward, memory 2: every named strategy's greedy replay
    deadlocks, and CP-SAT finds no order of its own in a few seconds; the list scheduler's
    orders give the searches a start, so a plan comes back."""
    costs = encode_costs(backward_input=1, backward_weight=1)
    result = plan(2, 3, 8, costs, memory_limit=2, time_limit=4)
    assert any(row["source"] == "constructed" and row["strategy"].endswith(" + list schedule")
               for row in result.candidates)
    assert result.simulate().latency == result.latency
    assert result.latency >= result.lower_bound >= 36  # the work bound: 72 units on 2 workers
    assert max(result.simulate().worker_stats()["max_activation_storage"]) <= 2


def test_a_bound_of_a_restricted_class_never_claims_more():
    result = plan(2, 2, 2, encode_costs(comm=1), memory_limit=1, time_limit=10, scheme="paired")
    classes = result.bound_classes
    assert classes["work"] == classes["critical_path"] == ANY_SCHEDULE
    assert classes["cpsat_paired"] == PAIRED and result.bounds["cpsat_paired"] == 15
    # 15 is no bound for every schedule: 13 exists
    assert max(v for k, v in result.bounds.items() if classes[k] == ANY_SCHEDULE) <= 13


def test_without_transfer_times_the_whole_schemes_proof_holds_for_every_schedule():
    """With no time to any transfer, an unsplit backward and no budget, any schedule's compute
    workers and starts with one weight worker per stage are a schedule of the whole scheme, so
    that model's proof holds for every schedule.  W = S = 2, B = 4, memory 1, span (no pooled
    step runs for it): 19, proven by the whole-scheme model; with comm 1 the proof covers the
    whole scheme only, as it does with a split backward or a budget."""
    free = plan(2, 2, 4, encode_costs(comm=0), memory_limit=1, time_limit=10, objective="span")
    assert free.objective_value == 19 and free.optimal and free.proven_for == ANY_SCHEDULE
    assert free.bound_classes["cpsat_whole_scheme"] == ANY_SCHEDULE and free.bounds["cpsat_whole_scheme"] == 19
    paid = plan(2, 2, 4, encode_costs(comm=1), memory_limit=1, time_limit=10, objective="span", scheme="whole")
    assert paid.optimal and paid.proven_for == WHOLE_SCHEME
    # the every-schedule model, which follows the whole scheme's by default, lifts that proof
    lifted = plan(2, 2, 4, encode_costs(comm=1), memory_limit=1, time_limit=10, objective="span")
    assert lifted.objective_value == paid.objective_value and lifted.proven_for == EVERY
    assert lifted.bound_classes["cpsat_every_schedule"] == EVERY
    # and no schedule beats it: the registry's strategies and random mappings (replicated weights,
    # backwards away from their forwards) under the same costs and limit
    rng = np.random.default_rng(0)
    spans = []
    mappings = [policies.get(name, 2, 2, 4, **params) for name, params in policies.variants(2, 2, 4)]
    for _ in range(400):  # few run under a limit of one stash
        table = {w: ComputeAndWeightWorkers(int(rng.integers(2)), int(rng.integers(2))) for w in all_work(2, 4)}
        mappings.append(lambda w, table=table: table[w])
    for strategy in mappings:
        try:
            sim = simulate(2, 2, 4, strategy, costs=encode_costs(comm=0), memory_limit=1)
        except UniSchedError:
            continue  # it deadlocks under the limit
        spans.append(objective_value(sim, "span"))
    assert len(spans) >= 10 and min(spans) >= 19

    def covers(costs, **limits) -> bool:
        return whole_scheme_is_any(timed_2_2_4(costs, **limits))

    assert covers(encode_costs(comm=0), memory_limit=1) and covers(encode_costs(comm=0))
    assert not covers(encode_costs(comm=0.5))
    assert not covers(encode_costs(backward_input=1, backward_weight=1, comm=0), split_backward=True)
    assert covers(weighty_costs()) and not covers(weighty_costs(), memory_budget=34.0)


@pytest.mark.parametrize("shape, costs, memory", [
    ((2, 2, 4), encode_costs(backward_input=1, backward_weight=1), 1),
    ((3, 2, 4), encode_costs(), 1),  # a backward of two ticks
    ((3, 3, 4), encode_costs(backward_input=1, backward_weight=1), 2),
])
def test_forwards_filled_in_after_the_search_lose_no_schedule(monkeypatch, shape, costs, memory):
    """Without transfer times a forward's worker decides only which worker is busy, so the
    whole-scheme model leaves forwards unplaced and fills them in afterwards: the same proven
    optimum as the model placing them, and its solution replays as planned within the limit,
    each forward on a worker with nothing else to run in its tick."""
    problem = PlanProblem(Shape(*shape), costs, memory_limit=memory,
                          split_backward=costs.backward_input is not None)
    timed = TimedProblem.build(problem)
    assert mapping.forwards_fill_in(timed, WHOLE_SCHEME, False)
    filled = solve_mapping(timed, time_limit=30, scheme=WHOLE_SCHEME, asap_replay=False)
    with monkeypatch.context() as patch:
        patch.setattr(mapping, "forwards_fill_in", lambda *args: False)
        placed = solve_mapping(timed, time_limit=30, scheme=WHOLE_SCHEME, asap_replay=False)
    assert filled.optimal and placed.optimal and filled.objective == placed.objective
    replay = Schedule.planned(timed, filled.compute, filled.weight, filled.starts).simulate()
    assert replay.latency == timed.ticks.time(filled.objective)
    assert max(replay.worker_stats()["max_activation_storage"]) <= memory
    ends = filled.starts + timed.duration[:, 0]
    for i in np.flatnonzero(timed.direction == FORWARD):
        same = (filled.compute == filled.compute[i]) & (np.arange(len(ends)) != i)
        assert not np.any(same & (filled.starts < ends[i]) & (ends > filled.starts[i]))


def test_forwards_are_placed_by_the_model_wherever_their_worker_matters():
    def fills(costs, scheme=WHOLE_SCHEME, asap_replay=False, **limits) -> bool:
        return mapping.forwards_fill_in(timed_2_2_4(costs, **limits), scheme, asap_replay)

    assert fills(encode_costs(), memory_limit=1) and fills(encode_costs())
    assert not fills(encode_costs(), scheme=PAIRED)  # the paired class: forwards go with their backward
    assert not fills(encode_costs(), asap_replay=True)  # a stash away from its forward counts from elsewhere
    assert not fills(encode_costs(comm=1)) and not fills(encode_costs(fetch=1))  # transfers wait on it
    assert not fills(encode_costs(), objective="span")  # a worker's span depends on its forwards
    assert not fills(encode_costs(), max_stages_per_worker=1)  # a forward holds its stage's weights
    assert not fills(weighty_costs(), memory_budget=34.0)  # and takes their bytes
    assert not fills(Costs(forward=2, backward=3))  # a forward of two ticks needs a worker free for both
    # a pass of no time leaves its worker free at its tick for the list order to put a forward first
    assert not fills(Costs(forward=1, backward_input=0, backward_weight=2), split_backward=True)


def test_a_periodic_run_keeps_its_forwards_periodic_without_transfer_times():
    """Forwards filled in after the search would land wherever a worker is free; a periodic
    run places them itself."""
    problem = PlanProblem(Shape(3, 3, 6), encode_costs(), memory_limit=2)
    timed = TimedProblem.build(problem)
    assert mapping.forwards_fill_in(timed, WHOLE_SCHEME, False)
    solved = solve_mapping(timed, time_limit=3, scheme=WHOLE_SCHEME, asap_replay=False, period=2)
    assert solved.found
    compute = solved.compute[problem.item_grid()]  # (batch, stage, pass)
    assert np.array_equal(compute[2:], compute[:-2])


# ---------------------------------------------------------------------- split backward
def test_a_costs_file_with_both_halves_splits_the_backward(tmp_path, capsys):
    from unisched.plan.command import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    costs = Costs(forward=1, backward=2, backward_input=1, backward_weight=1)
    assert plan(2, 2, 4, costs, time_limit=5).problem.split_backward
    path = tmp_path / "costs.json"
    costs.save(path)
    args = parser.parse_args(["-W", "2", "-S", "2", "-B", "4", "--costs", str(path), "--time-limit", "3", "--json"])
    assert run(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["split_backward"] is True
    assert any(text.startswith("0W") for text in data["plan"]["mapping"])


def test_a_split_backward_without_its_times_is_refused():
    with pytest.raises(PlanInputError, match="backward_input or backward_weight"):
        plan(2, 2, 2, Costs(), split_backward=True, time_limit=2)


@pytest.mark.parametrize("scheme", [WHOLE_SCHEME, PAIRED])
def test_mapping_model_with_a_split_backward_replays_within_its_memory(scheme):
    problem = PlanProblem(Shape(2, 2, 3), encode_costs(backward_input=1, backward_weight=1, comm=1),
                          memory_limit=1.5, split_backward=True)
    timed = TimedProblem.build(problem)
    solved = solve_mapping(timed, time_limit=20, scheme=scheme)
    assert solved.found
    replay = Schedule.from_starts(problem, solved.compute, solved.weight, solved.starts).simulate()
    assert replay.latency <= timed.ticks.time(solved.objective)
    assert max(replay.worker_stats()["max_activation_storage"]) <= 1.5
    grid = problem.item_grid()
    assert np.all(solved.compute[grid][:, :, 1] == solved.compute[grid][:, :, 2])  # I and W together


def test_fixed_strategy_needing_a_split_backward_is_not_planned_without_one():
    with pytest.raises(UniSchedError, match="split backward"):
        plan(4, 4, 8, strategy="zb_h1", time_limit=3)


# ---------------------------------------------------------------------- memory
def weighty_costs() -> Costs:
    return Costs(forward=1, backward=2, activation_bytes=1.0, weight_bytes=10.0)


def test_a_memory_budget_stops_replication_of_weights_that_do_not_fit():
    free = plan(2, 2, 2, weighty_costs(), time_limit=5)
    assert free.latency == 6  # data parallel: each worker holds both stages

    # one stage's weights and gradient (20) and optimizer state (10), and a few stashes
    budget = 34.0
    fitted = plan(2, 2, 2, weighty_costs(), memory_budget=budget, optimizer_bytes=10.0, time_limit=5)
    assert fitted.latency > free.latency
    schedule = fitted.schedule
    assert np.all(fitted.problem.weight_need(schedule.compute, schedule.weight) <= budget)
    peaks = [curve.peak for curve in memory_curves(fitted.simulate().timeline, "total", "bytes")]
    _, stage, _ = fitted.problem.items.arrays()
    owned = [len(set(stage[schedule.weight == w].tolist())) for w in range(2)]
    for w in range(2):  # the simulator's total leaves out the optimizer state
        assert peaks[w] + 10.0 * owned[w] <= budget


def test_a_budget_no_mapping_fits_names_what_to_change():
    with pytest.raises(PlanInputError, match="memory budget"):
        plan(2, 2, 2, weighty_costs(), memory_budget=30.0, optimizer_bytes=10.0, time_limit=2)


def test_a_budget_without_sizes_to_count_is_refused():
    with pytest.raises(PlanInputError, match="a memory budget counts bytes, but the costs give no sizes"):
        plan(2, 2, 2, memory_budget=100.0, time_limit=2)


def test_per_worker_memory_limits_are_each_workers_own():
    result = plan(2, 2, 4, memory_limit=[1, 4], time_limit=5, scheme="paired")
    peaks = result.simulate().worker_stats()["max_activation_storage"]
    assert peaks[0] <= 1 and peaks[1] <= 4
    least = plan(2, 2, 4, memory_limit=1, time_limit=5, scheme="paired")
    assert result.latency < least.latency


def test_a_worker_with_no_room_leaves_the_others_to_plan_on():
    """Limits [0, 4, 4]: named strategies run under the least limit, which holds no micro-batch,
    so they are dropped saying so; the CP-SAT models plan on the workers with room."""
    result = plan(3, 2, 4, memory_limit=[0, 4, 4], time_limit=5)
    peaks = result.simulate().worker_stats()["max_activation_storage"]
    assert peaks[0] == 0 and max(peaks) <= 4
    assert result.dropped and all("least of the workers' memory limits, 0" in d["reason"] for d in result.dropped)


# ---------------------------------------------------------------------- stopping
def test_the_search_stops_once_a_plan_meets_a_bound():
    result = plan(2, 4, 8, time_limit=120)
    assert result.optimal and result.proven_for == ANY_SCHEDULE
    assert result.elapsed < 60


def test_a_starting_hint_does_not_keep_the_order_solver_from_its_proof():
    costs = encode_costs(backward_input=1, backward_weight=1)
    result = plan(4, 4, 8, costs, memory_limit=8, strategy="zb_h1", time_limit=20)
    assert result.latency == 27 and result.optimal
    assert result.proven_for == "orders of the mapping of zb_h1"


def test_ctrl_c_returns_the_best_plan_so_far():
    timer = threading.Timer(3.0, _thread.interrupt_main)
    timer.start()
    try:
        result = plan(3, 4, 8, encode_costs(comm=1), memory_limit=2, time_limit=120)
    finally:
        timer.cancel()
    assert result.interrupted and result.elapsed < 60
    assert result.simulate().latency == result.latency
    assert result.lower_bound <= result.latency


# ---------------------------------------------------------------------- the span objective
def test_span_objective_is_said_and_measured():
    costs = encode_costs(backward_input=1, backward_weight=1)
    result = plan(4, 4, 8, costs, memory_limit=8, max_stages_per_worker=1, time_limit=10, objective="span")
    assert result.objective == "span"
    t = result.simulate().timeline
    spans = [t.end[t.worker == w].max() - t.start[t.worker == w].min() for w in range(4)]
    assert result.objective_value == max(spans) == 24  # the work bound: no bubble in steady state
    latency = plan(4, 4, 8, costs, memory_limit=8, max_stages_per_worker=1, time_limit=10)
    assert latency.objective == "latency" and latency.objective_value == latency.latency


# ---------------------------------------------------------------------- constructed mappings
def test_a_backward_folded_over_the_workers_its_stashes_need_is_a_starting_point():
    """W = S = 4, B = 8, memory 2: a micro-batch's four stashes need two workers, so the planner
    builds mappings running every forward and the last two stages' backward passes on one
    worker and the first two stages' on another (one gradient transfer, no activation moves),
    each within the limit; none where the search keeps a backward with its forward, where the
    stashes fit on one worker, or where a worker may hold fewer than every stage."""
    from unisched.plan.family import constructed_members
    from unisched.work import BACKWARD, Work

    problem = PlanProblem(Shape(4, 4, 8), encode_costs(comm=1), 2)
    folded = [(label, strategy) for label, strategy, _ in constructed_members(problem, whole=True)
              if "folded" in label]
    assert [label for label, _ in folded] == [f"backward folded over 2 workers (shift {k})" for k in (1, 2, 3)]
    for shift, (label, strategy) in enumerate(folded, start=1):
        for b in range(8):
            forwards = {strategy.mapping(Work(b, s)).compute_worker for s in range(4)}
            assert forwards == {b % 4}
            backward = [strategy.mapping(Work(b, s, BACKWARD)).compute_worker for s in range(4)]
            assert backward == [(b + shift) % 4] * 2 + [b % 4] * 2
        compute, _ = mapping_of(problem, strategy)
        assert problem.stash_need(compute).max() <= 2
    # with a split backward the whole scheme's search keeps I and W together, so the whole stash counts
    split = PlanProblem(Shape(4, 4, 8), encode_costs(backward_input=1, backward_weight=1, comm=1), 2,
                        split_backward=True)
    assert split.first_backward_workers() == 1 and split.stash_workers() == 2
    assert len([m for m in constructed_members(split, whole=True) if "folded" in m[0]]) == 3
    assert not [m for m in constructed_members(problem) if "folded" in m[0]]  # the heuristic's seeds, paired runs
    roomy = PlanProblem(Shape(4, 4, 8), Costs(), 4)
    assert not [m for m in constructed_members(roomy, whole=True) if "folded" in m[0]]
    assert not [m for m in constructed_members(PlanProblem(Shape(4, 4, 8), Costs(), 2, max_stages_per_worker=2),
                                               whole=True) if "folded" in m[0]]


def test_ctrl_c_in_the_first_in_first_out_pass_stops_the_staged_order_search(monkeypatch):
    """The staged order search's middle pass heard Ctrl-C, and the search then went on to its full
    model and answered as if it had not been interrupted."""
    from unisched.plan import order
    calls = []

    def solve(timed, compute, weight, *, time_limit, fifo=False, **kwargs):
        calls.append("fifo" if fifo else "full")
        return order.Solved("FEASIBLE", np.zeros(timed.problem.num_items), compute, weight, 50, 30, 0.0,
                            interrupted=fifo)
    monkeypatch.setattr(order, "solve_order", solve)
    problem = PlanProblem(Shape(4, 4, 8), encode_costs(comm=1), memory_limit=2)
    compute, weight = mapping_of(problem, policies.get("one_f_one_b", 4, 4, 8))
    solved = order.solve_order_staged(TimedProblem.build(problem), compute, weight, time_limit=60)
    assert calls == ["full", "fifo"] and solved.interrupted


@pytest.mark.parametrize("shape, costs, memory, scheme", [
    ((3, 2, 4), encode_costs(comm=1), 2, EVERY),
    ((3, 3, 2), SPLIT_COMM_1, 2, EVERY),
    ((3, 2, 3), encode_costs(comm=1), 1, WHOLE_SCHEME),
    ((3, 2, 4), encode_costs(), 2, WHOLE_SCHEME),  # forwards filled in: numbered by their backwards
], ids=["every", "every-split", "whole", "whole-filled-in"])
def test_numbering_identical_workers_cuts_off_no_optimum(monkeypatch, shape, costs, memory, scheme):
    """Identical workers are numbered in the order micro-batch by micro-batch, stage by stage,
    their passes first meet them (mapping._Places.number_workers): the same proven optimum as the
    model that numbers them not at all; and the numbered model's solution is numbered so."""
    problem = PlanProblem(Shape(*shape), costs, memory_limit=memory, split_backward=costs.backward_input is not None)
    timed = TimedProblem.build(problem)
    numbered = solve_mapping(timed, time_limit=30, scheme=scheme, asap_replay=False)
    filled_in = mapping.forwards_fill_in(timed, scheme, False)  # forwards placed after the search: not numbered
    placed = [i for i in range(problem.num_items) if not (filled_in and timed.direction[i] == FORWARD)]
    met = []
    for i in sorted(placed, key=lambda i: (timed.batch[i], timed.stage[i], timed.direction[i])):
        if numbered.compute[i] not in met:
            met.append(int(numbered.compute[i]))
    assert met == list(range(len(met)))
    monkeypatch.setattr(mapping._Places, "number_workers", lambda places: None)
    free = solve_mapping(timed, time_limit=60, scheme=scheme, asap_replay=False)
    assert numbered.optimal and free.optimal
    assert numbered.objective == free.objective


@pytest.mark.parametrize("scheme", [EVERY, WHOLE_SCHEME], ids=["every", "whole"])
def test_a_hint_with_workers_and_micro_batches_relabelled_is_a_solution_of_the_model(monkeypatch, scheme):
    """The search starts from the best schedule so far, relabelled (mapping.canonical) to meet
    the model's symmetry breaking: with every hinted variable fixed to its hint, the model still
    has that schedule as a solution, whichever way the schedule numbered its workers and
    micro-batches."""
    problem = PlanProblem(Shape(3, 2, 4), encode_costs(comm=1), memory_limit=2)
    timed = TimedProblem.build(problem)
    solved = solve_mapping(timed, time_limit=30, scheme=scheme, asap_replay=False)
    grid = problem.item_grid()
    workers, batches = np.array([2, 0, 1]), np.array([3, 1, 0, 2])
    compute, weight, starts = (np.empty_like(a) for a in (solved.compute, solved.weight, solved.starts))
    for relabelled, a in ((compute, solved.compute), (weight, solved.weight), (starts, solved.starts)):
        relabelled[grid] = a[grid[batches]]
    hint = mapping.Incumbent(workers[compute], workers[weight], starts, solved.objective)

    def fixed_to_the_hint(*args, **kwargs):
        solver = order.make_solver(*args, **kwargs)
        solver.parameters.fix_variables_to_their_hinted_value = True
        return solver

    monkeypatch.setattr(mapping, "make_solver", fixed_to_the_hint)
    again = solve_mapping(timed, time_limit=30, hint=hint, scheme=scheme, asap_replay=False)
    assert again.objective == solved.objective
    assert again.status in ("OPTIMAL", "FEASIBLE")
