"""The planner: proven optima, replay equality, limits, time limits, plan files and the CLI."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import unisched
from unisched import Costs, Strategy, simulate
from unisched.plan import PlanFileError, PlanInputError, encode_costs, load_plan, plan, shape_bounds
from unisched.plan.command import _is_demo, add_arguments, run
from unisched.plan.family import stages_held
from unisched.plan.mapping import EVERY
from unisched.plan.order import solve_order
from unisched.plan.problem import PlanProblem, TimedProblem
from unisched.plan.schedule import Schedule
from unisched.work import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, ComputeAndWeightWorkers, Shape, Work


def gpipe_member(W: int, S: int, B: int):
    strategy = Strategy(lambda w: ComputeAndWeightWorkers(w.stage, w.stage), name="inline-gpipe")
    return [("inline-gpipe", strategy, "")]


# ---------------------------------------------------------------------- proven optima
@pytest.mark.parametrize("memory_limit, optimum", [(None, 33), (2, 51)])
def test_gpipe_order_is_proven_optimal(memory_limit, optimum):
    result = plan(4, 4, 8, memory_limit=memory_limit, strategy="gpipe", time_limit=10)
    assert result.latency == optimum
    assert result.optimal
    assert result.lower_bound == optimum


def test_gpipe_order_with_communication_matches_the_fixed_stage_optimum():
    problem = PlanProblem(Shape(4, 4, 16), encode_costs(comm=1, fetch=2), memory_limit=4, max_stages_per_worker=2)
    timed = TimedProblem.build(problem)
    solved = solve_order(timed, timed.stage, timed.stage, time_limit=10)
    assert solved.optimal and solved.objective == 84


def test_free_mapping_beats_every_named_strategy_under_a_memory_limit():
    result = plan(4, 4, 8, memory_limit=2, time_limit=4)
    family = [row["latency"] for row in result.candidates if row["source"] == "family"]
    assert result.latency <= min(family)
    assert result.latency < 51
    assert 30.0 <= result.lower_bound <= result.latency
    assert result.optimal == (result.lower_bound == result.latency)


def test_memory_time_bound_is_the_papers_figure():
    bounds = shape_bounds(PlanProblem(Shape(4, 4, 8), Costs(), memory_limit=2))
    assert bounds["memory_time"] == pytest.approx(30.0)
    assert bounds["work"] == pytest.approx(24.0)
    assert bounds["critical_path"] == pytest.approx(12.0)


def test_memory_time_bound_under_a_budget_leaves_out_weights_gradients_and_optimizer_state():
    """A budget of 27 bytes a worker, of which each stage's weight worker keeps 10 of weights, 10 of
    gradient and 5 of optimizer state, leaves the four workers 8 bytes of stash: the room of a
    limit of 2 one-byte stashes each."""
    costs = Costs(activation_bytes=1.0, weight_bytes=10.0)
    limited = shape_bounds(PlanProblem(Shape(4, 4, 8), costs, memory_limit=2))
    budgeted = shape_bounds(PlanProblem(Shape(4, 4, 8), costs, memory_budget=27.0, optimizer_bytes=5.0))
    assert limited["memory_time"] == pytest.approx(30.0)
    assert budgeted["memory_time"] == pytest.approx(limited["memory_time"])


# ---------------------------------------------------------------------- replay and limits
def test_plan_replays_to_its_latency_and_respects_the_limits(tmp_path):
    costs = encode_costs(comm=1, fetch=2)
    result = plan(4, 4, 8, costs, memory_limit=3, max_stages_per_worker=2, time_limit=4)
    sim = result.simulate()
    assert sim.latency == result.latency
    assert max(sim.worker_stats()["max_activation_storage"]) <= 3
    assert stages_held(sim).max() <= 2
    assert all(sim.timeline.worker_order(w) == order for w, order in result.worker_orders().items())

    path = tmp_path / "plan.json"
    result.save(path)
    again = load_plan(path)
    assert again.shape == result.shape and again.costs == result.costs
    assert again.simulate().latency == result.latency
    assert unisched.load_plan(path).latency == result.latency
    W, S, B = result.shape
    replay = simulate(W, S, B, again.strategy(), costs=again.costs)
    assert replay.latency == result.latency


def test_plan_with_a_split_backward_replays():
    costs = encode_costs(backward_input=1.0, backward_weight=1.0)
    result = plan(4, 4, 6, costs, strategy="zb_h1", split_backward=True, time_limit=5)
    assert result.simulate().latency == result.latency
    family = [row["latency"] for row in result.candidates if row["source"] == "family"]
    assert result.latency <= min(family)


def test_a_fixed_strategy_with_zero_time_passes_is_planned():
    # passes of no time start together: the orders read off start times must still keep dependencies
    result = plan(4, 4, 8, Costs(forward=1.0, backward=0.0), strategy="looped(group_size=2)", time_limit=2)
    assert result.simulate().latency == result.latency >= 8 * 4 / 4 * 1.0  # at least each worker's forwards


def test_time_limit_is_honoured():
    begin = time.perf_counter()
    result = plan(4, 4, 24, encode_costs(comm=1, fetch=2), memory_limit=4, max_stages_per_worker=2, time_limit=3)
    elapsed = time.perf_counter() - begin
    assert elapsed < 3 + 4.0
    assert result.simulate().latency == result.latency


def test_inline_members_replace_the_registry():
    result = plan(4, 4, 8, memory_limit=2, members=gpipe_member(4, 4, 8), strategy="inline-gpipe", time_limit=5)
    assert result.latency == 51 and result.optimal


def test_your_own_strategy_is_planned_as_a_function_or_a_strategy():
    def stage_per_worker(w: Work):
        return ComputeAndWeightWorkers(w.stage, w.stage)

    for strategy, label in [(stage_per_worker, "stage_per_worker"), (unisched.policies.get("gpipe", 4, 4, 8), "gpipe"),
                            (lambda w: ComputeAndWeightWorkers(w.stage, w.stage), "your strategy")]:
        result = plan(4, 4, 8, memory_limit=2, strategy=strategy, time_limit=5)
        assert result.latency == 51 and result.optimal and result.strategy_name.startswith(label)
        assert np.array_equal(result.schedule.compute, result.problem.items.arrays()[1])  # its mapping kept
    with pytest.raises(PlanInputError, match="only the command loads.*pass the Strategy or the function"):
        plan(4, 4, 8, strategy="mine.py:f", time_limit=1)
    with pytest.raises(PlanInputError, match="strategy must be"):
        plan(4, 4, 8, strategy=42, time_limit=1)


# ---------------------------------------------------------------------- bad input
def test_impossible_memory_limit_is_a_clear_error():
    with pytest.raises(PlanInputError, match="infeasible: .*needs at least 1"):
        plan(4, 4, 8, memory_limit=0.5, time_limit=5)


@pytest.mark.parametrize("search", ["cpsat", "heuristic"])
def test_a_step_in_which_nothing_takes_time_is_refused_and_one_with_transfers_is_planned(search):
    nothing = Costs(forward=0, backward=0)
    with pytest.raises(PlanInputError, match="nothing in the step takes time"):
        plan(2, 2, 2, nothing, memory_limit=1, time_limit=2, search=search)
    moved = plan(2, 2, 2, encode_costs(forward=0, backward=0, comm=1), memory_limit=1, time_limit=2, search=search)
    assert moved.latency > 0 and moved.simulate().latency == moved.latency


def test_memory_limit_too_small_for_a_mapping_names_the_worker():
    with pytest.raises(PlanInputError, match="infeasible: .*worker 0.*needs at least 4"):
        plan(4, 4, 4, memory_limit=2, strategy="ddp", time_limit=5)


def test_too_few_weight_slots_is_a_clear_error():
    with pytest.raises(PlanInputError, match=r"max_stages_per_worker \(--max-stages-per-worker\) to at least 2"):
        plan(2, 4, 4, max_stages_per_worker=1, time_limit=5)


def test_fetch_shorter_than_comm_is_rejected():
    with pytest.raises(PlanInputError, match="--fetch"):
        encode_costs(comm=2, fetch=1)


@pytest.fixture
def saved_plan(tmp_path):
    result = plan(2, 2, 4, strategy="gpipe", time_limit=5)
    path = tmp_path / "plan.json"
    result.save(path)
    return path


def test_malformed_plan_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(PlanFileError, match="not valid JSON"):
        load_plan(path)
    path.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(PlanFileError, match="not a unisched plan file"):
        load_plan(path)


def test_plan_file_of_another_version(saved_plan):
    data = json.loads(saved_plan.read_text())
    data["version"] = 99
    saved_plan.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="version 99"):
        load_plan(saved_plan)


def test_plan_file_for_another_shape(saved_plan):
    with pytest.raises(PlanFileError, match="is for W=2, S=2, B=4"):
        load_plan(saved_plan, shape=(4, 4, 8))
    data = json.loads(saved_plan.read_text())
    data["shape"]["num_batches"] = 5
    saved_plan.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="another shape"):
        load_plan(saved_plan)


def test_plan_file_with_a_missing_field(saved_plan):
    data = json.loads(saved_plan.read_text())
    del data["orders"]
    saved_plan.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="malformed"):
        load_plan(saved_plan)


def test_plan_file_with_an_order_that_contradicts_the_mapping(saved_plan):
    data = json.loads(saved_plan.read_text())
    data["orders"]["0"], data["orders"]["1"] = data["orders"]["1"], data["orders"]["0"]
    saved_plan.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="worker 0's order"):
        load_plan(saved_plan)


# ---------------------------------------------------------------------- command line
def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_json_and_out(tmp_path, capsys):
    out = tmp_path / "p.json"
    code = run(parse(["--workers", "4", "--stages", "4", "--batches", "8", "--memory-limit", "2",
                      "--strategy", "gpipe", "--time-limit", "5", "--json", "--out", str(out)]))
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["latency"] == 51 and data["optimal"] is False
    assert data["shape"] == [4, 4, 8] and data["throughput"] == 8 / 51  # as simulate --json says them
    assert data["plan"]["proven_for"] == "orders of the mapping of gpipe"
    assert data["lower_bound"] == 51 and data["strategy"].startswith("gpipe")
    assert data["bound_classes"]["critical_path"] == "any schedule"
    assert data["bound_classes"]["cpsat_order"] == "orders of the mapping of gpipe"
    assert set(data["bound_classes"]) == set(data["bounds"])
    assert data["plan"]["version"] >= 1
    assert load_plan(out).simulate().latency == 51


def test_cli_report_shows_table_bounds_and_diagram(capsys):
    code = run(parse(["-W", "2", "-S", "2", "-B", "4", "--comm", "1", "--fetch", "2", "--time-limit", "3",
                      "--no-color"]))
    assert code == 0
    text = capsys.readouterr().out
    assert "lower bounds" in text and "best:" in text and "w0|" in text


def test_report_names_the_class_each_bound_holds_for(capsys):
    """W = S = B = 2, comm 1, the whole scheme's model alone (``--scheme whole``): replicas (ddp)
    take 8, which no schedule with one weight worker per stage beats (CP-SAT proves 8 there),
    while the bounds for every schedule stay at 6 and the replica ramp, for every schedule a plan
    can hold, is 7 (the whole scheme's ramp, 7 too, adds nothing and is left out).  The report
    lists each bound under its class and claims no more than that.  By default the model over
    every schedule a plan can hold runs after it and proves 8 for that class."""
    code = run(parse(["-W", "2", "-S", "2", "-B", "2", "--comm", "1", "--time-limit", "10", "--no-color",
                      "--scheme", "whole"]))
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    bounds = next(i for i, line in enumerate(lines) if line.startswith("lower bounds"))
    assert lines[bounds] == "lower bounds (latency), for any schedule: critical path 6, work 6"
    assert lines[bounds + 1] == f"  for {EVERY} only: replica ramp 7"
    whole = lines[bounds + 2]
    assert whole.startswith("  for schedules with one weight worker per stage") and whole.endswith(
        "only: cpsat whole scheme 8")
    best = next(line for line in lines if line.startswith("best:"))
    assert "latency 8, 14.3% above the lower bound 7; none of the schedules with one weight worker" in best
    assert best.endswith("is shorter (proven)") and "proven optimal" not in best

    assert run(parse(["-W", "2", "-S", "2", "-B", "2", "--comm", "1", "--time-limit", "10", "--no-color"])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "lower bounds (latency), for any schedule: critical path 6, work 6" in lines
    assert f"  for {EVERY} only: replica ramp 7, cpsat every schedule 8" in lines
    assert f"best: ddp: latency 8, proven optimal among {EVERY} only" in lines


def test_cli_costs_file_clashes_with_flags(tmp_path):
    path = tmp_path / "costs.json"
    Costs(forward=1, backward=2).save(path)
    with pytest.raises(PlanInputError, match="--comm"):
        run(parse(["--costs", str(path), "--comm", "1"]))


def test_cli_costs_file_is_used(tmp_path, capsys):
    path = tmp_path / "costs.json"
    Costs(forward=[1, 2], backward=[2, 4]).save(path)
    assert run(parse(["-W", "2", "-S", "2", "-B", "4", "--costs", str(path), "--strategy", "gpipe",
                      "--time-limit", "3", "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    result = load_plan_from(data)
    assert result.simulate().latency == data["latency"]
    assert np.allclose(result.costs.per_stage("forward", 2), [1, 2])


def load_plan_from(data: dict):
    from unisched.plan.planfile import plan_from_dict

    return plan_from_dict(data["plan"])


# ---------------------------------------------------------------------- data flow
def chain_edges_as_written_before(problem: PlanProblem) -> set[tuple[int, int, int]]:
    """The planner's hand-written chain rule, before it derived its edges from unisched.dataflow."""
    W, S, B = problem.shape
    split = problem.split_backward
    dirs = problem.dirs
    back = BACKWARD_INPUT if split else BACKWARD

    def item(b, s, d):
        return (b * S + s) * len(dirs) + dirs.index(d)

    edges = set()
    for b in range(B):
        for s in range(S):
            if s + 1 < S:
                edges.add((item(b, s, FORWARD), item(b, s + 1, FORWARD), s + 1))
                edges.add((item(b, s + 1, back), item(b, s, back), s + 1))
            edges.add((item(b, s, FORWARD), item(b, s, back), s))
            if split:
                edges.add((item(b, s, BACKWARD_INPUT), item(b, s, BACKWARD_WEIGHT), s))
    return edges


@pytest.mark.parametrize("S, B", [(1, 1), (1, 3), (2, 1), (3, 2), (4, 5)])
@pytest.mark.parametrize("split", [False, True])
def test_data_edges_are_the_chain_rule(S, B, split):
    problem = PlanProblem(Shape(2, S, B), split_backward=split)
    edges = TimedProblem.build(problem).data_edges()
    found = list(zip(edges.src.tolist(), edges.dst.tolist(), edges.stage.tolist()))
    assert len(found) == len(set(found))
    assert set(found) == chain_edges_as_written_before(problem)


def test_the_item_grid_is_the_dataflow_encoding():
    problem = PlanProblem(Shape(2, 3, 4), split_backward=True)
    assert problem.num_items == 4 * 3 * 3
    grid = problem.item_grid()
    assert grid.shape == (4, 3, 3) and np.array_equal(np.sort(grid.ravel()), np.arange(36))
    for (b, s, k), item in np.ndenumerate(grid):
        assert problem.items.work(int(item)) == Work(b, s, problem.dirs[k])
    assert problem.dirs[2] == BACKWARD_WEIGHT


# ---------------------------------------------------------------------- the order model is exact

@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    W=st.integers(1, 3), S=st.integers(1, 3), B=st.integers(1, 4), comm=st.sampled_from([0.0, 1.0]),
    memory=st.sampled_from([None, 2.0, 3.0]), data=st.data(),
)
def test_order_model_replays_exactly_without_link_contention(W, S, B, comm, memory, data):
    """With transfers that only delay (no fetches), the simulator's replay of a CP-SAT order
    is never longer than the model says, and equal when the model is proven optimal."""
    problem = PlanProblem(Shape(W, S, B), encode_costs(comm=comm), memory_limit=None)
    timed = TimedProblem.build(problem)
    pairs = data.draw(st.lists(st.integers(0, W - 1), min_size=S * B, max_size=S * B))
    compute = np.repeat(np.asarray(pairs, dtype=np.int64), len(problem.dirs))
    limit = None
    if memory is not None and problem.min_memory_mapped(compute)[0] <= memory:
        limit = memory
    problem = PlanProblem(Shape(W, S, B), encode_costs(comm=comm), memory_limit=limit)
    timed = TimedProblem.build(problem)
    solved = solve_order(timed, compute, compute, time_limit=5)
    assert solved.found
    replay = Schedule.from_starts(problem, compute, compute, solved.starts).simulate()
    assert replay.latency <= solved.objective + 1e-9
    if solved.optimal:
        assert replay.latency == solved.objective
    if limit is not None:
        assert max(replay.worker_stats()["max_activation_storage"]) <= limit


def test_a_plan_compiles_into_executor_programs(tmp_path):
    from unisched.execute.program import compile_program

    result = plan(4, 4, 6, encode_costs(comm=1, fetch=2), memory_limit=2, max_stages_per_worker=2, time_limit=3)
    path = tmp_path / "plan.json"
    result.save(path)
    program = compile_program(load_plan(path).simulate().timeline, num_stages=4, world_size=4)
    assert program is not None


def test_strategy_with_parameters_and_progress_output():
    import io

    stream = io.StringIO()
    result = plan(4, 4, 8, memory_limit=3, strategy="looped(group_size=2)", time_limit=4, progress=stream)
    assert result.strategy_name.startswith("looped(group_size=2)")
    family = [row["latency"] for row in result.candidates if row["source"] == "family"]
    assert result.latency <= min(family)
    assert "family search" in stream.getvalue() and "CP-SAT order" in stream.getvalue()
    with pytest.raises(unisched.policies.StrategyParameterError, match="key=value"):  # as policies.get says it
        plan(4, 4, 8, strategy="looped(group_size)", time_limit=2)


def test_each_better_cp_sat_solution_is_a_line_of_progress():
    """While CP-SAT runs, each better solution it finds is reported, with its class's bound."""
    import io
    import re

    stream = io.StringIO()
    plan(2, 4, 8, encode_costs(comm=1), memory_limit=2, time_limit=4, progress=stream)
    lines = stream.getvalue().replace("\r", "\n").splitlines()
    found = [(line.split(":")[0], float(m.group(1)), float(m.group(2)))
             for line in lines if (m := re.search(r": ([0-9.]+), bound ([0-9.]+) after [0-9.]+ s", line))]
    assert any(what.startswith("CP-SAT mapping") for what, _, _ in found)
    assert any(what.startswith("CP-SAT order") for what, _, _ in found)
    runs = []  # each run's values, with or without a bound: a line "... (1.2 s) ..." starts a run
    for line in map(str.rstrip, lines):
        if line.endswith("..."):
            runs.append([])
        elif runs and (m := re.search(r": ([0-9.]+)(, bound [0-9.]+)? after [0-9.]+ s$", line)):
            runs[-1].append(float(m.group(1)))
    assert sum(len(values) > 1 for values in runs) >= 1
    for values in runs:  # each line a better solution than every one before it in its run
        assert all(a > b for a, b in zip(values, values[1:])), values


@pytest.mark.parametrize("fifo", [False, True])
def test_the_fifo_pass_reports_no_bound(fifo):
    """The FIFO pass fixes part of the order: its bound holds for no class a plan claims, so none is reported."""
    timed = TimedProblem.build(PlanProblem(Shape(2, 2, 4), encode_costs(comm=1), memory_limit=2))
    told = []
    solve_order(timed, timed.stage, timed.stage, time_limit=5, fifo=fifo,
                report=lambda objective, bound, seconds: told.append(bound))
    assert told and all((bound is None) == fifo for bound in told)


def test_large_neighbourhood_search_keeps_a_feasible_incumbent():
    from unisched.plan.mapping import incumbent_from, solve_mapping
    from unisched.errors import UniSchedError
    from unisched.plan.planner import replayed

    problem = PlanProblem(Shape(3, 3, 8), encode_costs(comm=1, fetch=2), memory_limit=2, max_stages_per_worker=2)
    timed = TimedProblem.build(problem)
    start = solve_order(timed, timed.stage, timed.stage, time_limit=2)
    hint = incumbent_from(timed, timed.stage, timed.stage, start.starts)

    def score(compute, weight, starts) -> float:  # the replayed latency, as the planner scores a solution
        try:
            return replayed(Schedule.planned(timed, compute, weight, starts), "latency")[1].latency
        except UniSchedError:
            return float("inf")

    solved = solve_mapping(timed, time_limit=4, hint=hint, lns=True, score=score)
    assert solved.found and solved.objective <= hint.makespan
    _, replay = replayed(Schedule.planned(timed, solved.compute, solved.weight, solved.starts), "latency")
    assert replay.latency == solved.score
    assert max(replay.worker_stats()["max_activation_storage"]) <= 2
    assert stages_held(replay).max() <= 2


def test_costs_file_with_a_link_of_unlimited_bandwidth(tmp_path, capsys):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"forward": 1, "backward": 2, "latency": 1,
                                "links": {"0,1": {"latency": 3, "bandwidth": None}}}))
    out = tmp_path / "plan.json"
    assert run(parse(["-W", "2", "-S", "2", "-B", "4", "--costs", str(path), "--time-limit", "2",
                      "--json", "--out", str(out)])) == 0
    latency = json.loads(capsys.readouterr().out)["latency"]
    again = load_plan(out)
    assert again.costs.link(0, 1).latency == 3
    assert again.simulate().latency == latency


def test_family_search_without_a_limit_adds_memory_variants():
    from unisched.plan.family import search_family

    problem = PlanProblem(Shape(4, 4, 8))
    family = search_family(problem, memory_variants=True)
    variants = [m for m in family.feasible if m.memory_limit is not None]
    assert variants
    for member in variants:
        assert member.measures()["peak_activations"] <= member.memory_limit
    points = {id(m): (m.latency, m.measures()["peak_activations"], m.measures()["traffic"]) for m in family.feasible}

    def dominated(p):
        return any(q != p and all(a <= b for a, b in zip(q, p)) for q in points.values())

    for member in family.feasible:
        assert member.pareto == (not dominated(points[id(member)]))


def test_plan_command_rejects_zero_and_impossible_split(capsys):
    from unisched.cli import main

    assert main(["plan", "-W", "0"]) == 2
    assert "positive integer" in capsys.readouterr().err
    assert main(["plan", "-W", "2", "-S", "2", "-B", "2", "--backward-weight", "3"]) == 2
    assert "Costs.backward 2.0 is shorter than its half backward_weight 3" in capsys.readouterr().err


def test_plan_file_with_a_list_for_its_shape_is_malformed(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "unisched-plan", "version": 1, "shape": [4, 4, 8],
                                "costs": {}, "mapping": {}, "orders": {}}))
    with pytest.raises(unisched.PlanFileError, match="'shape' must be a JSON object"):
        unisched.load_plan(path)


def test_the_mapping_models_search_order_is_set_under_memory_limits_only():
    """Earliest start first, lower half first, where a memory limit or budget
    applies; CP-SAT's own search otherwise (which proves the unlimited cases)."""
    from ortools.sat.python import cp_model

    from unisched.plan.mapping import _search_order
    from unisched.plan.problem import PlanProblem

    for limit, budget, expected in ((None, None, 0), (2, None, 1), (None, 1e9, 1)):
        model = cp_model.CpModel()
        start = [model.new_int_var(0, 10, f"start{i}") for i in range(3)]
        problem = PlanProblem(Shape(2, 2, 2), Costs(weight_bytes=1.0, activation_bytes=1.0), limit, None, False, budget)
        _search_order(model, problem, start)
        assert len(model.proto.search_strategy) == expected
        if expected:
            strategy = model.proto.search_strategy[0]
            assert strategy.variable_selection_strategy == cp_model.CHOOSE_LOWEST_MIN
            assert strategy.domain_reduction_strategy == cp_model.SELECT_LOWER_HALF


def test_plan_takes_the_stages_and_micro_batches_from_the_workers_as_every_verb_does(capsys):
    from unisched.cli import main

    assert main(["plan", "-W", "2", "--strategy", "gpipe", "--time-limit", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["latency"] == (4 + 2 - 1) * 3  # gpipe on W = S = 2, B = 4
    assert main(["simulate", "-W", "2", "--strategy", "gpipe", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["latency"] == (4 + 2 - 1) * 3  # as unisched run would run it



def test_a_strategy_keeps_its_own_stash_limit_when_the_costs_count_bytes():
    """one_f_one_b's own limit (S - s stashes) was passed on as a memory limit, which costs with
    sizes read as bytes: it was dropped as not holding one stash."""
    costs = Costs(forward=[1] * 4, backward=[2] * 4, activation_bytes=1e6)
    result = plan(4, 4, 8, costs, time_limit=2)
    assert not any(row["strategy"] == "one_f_one_b" for row in result.dropped)
    ours = [row for row in result.candidates if row["strategy"] == "one_f_one_b"]
    assert ours and ours[0]["latency"] == simulate(4, 4, 8, unisched.policies.get("one_f_one_b", 4, 4, 8),
                                                   costs=costs).latency


def test_any_cost_flag_plans_that_problem_not_the_demo():
    """``--comm 0`` and ``--fetch 0`` are flags of the problem as much as ``--comm 1``: given, the
    step is planned as given, without the demo's memory limit (as ``simulate --plan`` reads them)."""
    assert _is_demo(parse([]))
    for flags in (["--comm", "0"], ["--fetch", "0"], ["--comm", "1"]):
        assert not _is_demo(parse(flags))
