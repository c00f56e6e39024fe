"""The anytime search for large plans (unisched.plan.search) and how `unisched plan` runs it."""

from __future__ import annotations

import dataclasses
import io
import json
import math

import numpy as np
import pytest

from unisched.cli import main
from unisched.plan import PlanInputError, PlanProblem, encode_costs
from unisched.plan import search as search_module
from unisched.plan.family import registry_members, search_family
from unisched.plan.planfile import objective_value
from unisched.plan.problem import TimedProblem
from unisched.plan.search import Mapped, Rule, Start, construct, evaluate, improve, rules, search, seed_mappings
from unisched.work import BACKWARD_INPUT, Shape

# the zero-bubble paper's profiled times of its 1.5B model (T_F, T_B = input gradient, T_W, T_comm)
PAPER_COSTS = encode_costs(forward=18.522, backward=18.086 + 9.337, backward_input=18.086, backward_weight=9.337,
                           comm=0.601)


def paper_problem(p: int, m: int, memory: float, objective: str = "latency") -> PlanProblem:
    return PlanProblem(Shape(p, p, m), PAPER_COSTS, memory_limit=memory, max_stages_per_worker=1,
                       split_backward=True, objective=objective)


def best_named(problem: PlanProblem, objective: str) -> float:
    family = search_family(problem, registry_members(problem))
    return min(objective_value(member.simulation, objective) for member in family.feasible)


def test_evaluate_times_fixed_orders_as_the_simulator_replays_them():
    problem = paper_problem(4, 8, memory=8)
    timed = TimedProblem.build(problem)
    family = search_family(problem, registry_members(problem, only="zb_h2"))
    mapping = seed_mappings(problem, family.feasible, family, constructed=False)[0]
    m = Mapped.build(timed, mapping.compute, mapping.weight, mapping.label)
    checked = 0
    for rule in rules(True, False)[::7]:
        orders = construct(m, rule)
        timing = evaluate(m, orders)
        assert timing is not None, rule
        schedule = search_module.Schedule(problem, m.compute, m.weight, {w: o.tolist() for w, o in enumerate(orders)})
        t = schedule.simulate().timeline
        ids = problem.items.id(t.batch, t.stage, t.direction)
        np.testing.assert_allclose(t.start, timed.ticks.time(1) * timing.start[ids])
        t.check(memory_limit=8)
        checked += 1
    assert checked >= 3


def test_evaluate_rejects_orders_against_dependencies_or_memory():
    problem = PlanProblem(Shape(2, 2, 4), encode_costs(), memory_limit=2)
    timed = TimedProblem.build(problem)
    stage = problem.items.arrays()[1]
    m = Mapped.build(timed, stage % 2, stage % 2, "gpipe")
    ids = problem.item_grid()  # [batch, stage, pass]
    gpipe = [np.concatenate([ids[:, w, 0], ids[::-1, w, 1]]) for w in range(2)]  # all forwards, then backwards
    assert evaluate(m, gpipe) is None  # four stashes of stage 0 on worker 0, over its limit 2
    one_f_one_b = [np.array([ids[0, 0, 0], ids[1, 0, 0], ids[0, 0, 1], ids[2, 0, 0], ids[1, 0, 1], ids[3, 0, 0],
                             ids[2, 0, 1], ids[3, 0, 1]]),
                   np.array([x for b in range(4) for x in (ids[b, 1, 0], ids[b, 1, 1])])]
    assert evaluate(m, one_f_one_b) is not None
    backwards_first = [gpipe[0][::-1], one_f_one_b[1]]
    assert evaluate(m, backwards_first) is None  # a backward before its own forward


def one_stage_per_worker(problem: PlanProblem) -> Mapped:
    stage = problem.items.arrays()[1]
    return Mapped.build(TimedProblem.build(problem), stage, stage, "one stage per worker")


def test_a_fit_in_the_warm_up_keeps_forwards_from_delaying_the_first_backward():
    # the paper's 28.3B times, where a forward outlasts a backward: one run as the first backward
    # arrives on a stage delays that backward on every stage below
    costs = encode_costs(forward=10.419, backward=10.207 + 7.715, backward_input=10.207, backward_weight=7.715,
                         comm=0.408)
    problem = PlanProblem(Shape(4, 4, 8), costs, memory_limit=8, max_stages_per_worker=1, split_backward=True,
                          objective="span")
    m = one_stage_per_worker(problem)
    first_backward = problem.items.id(0, np.arange(4), BACKWARD_INPUT)
    waited = {}
    for fit in ("warm-up", "never"):
        timing = evaluate(m, construct(m, Rule((2.0, 0), 0.25, fit)), "span")
        waited[fit] = (timing.start[first_backward] - timing.ready[first_backward]).tolist()
    assert waited["warm-up"] == [0, 0, 0, 0]  # each stage's first backward starts as its gradient arrives
    assert max(waited["never"]) > 0  # without the fit a warm-up forward is in the way on some stage


def test_rules_name_their_fit_and_refuse_others():
    assert Rule(fit="warm-up").label() == "warm-up memory, fill 1, fit warm-up"
    assert Rule().label() == "warm-up memory, fill 1"
    with pytest.raises(ValueError, match="Rule.fit must be one of warm-up, never, always, not True"):
        Rule(fit=True)
    first = rules(True, False)[:2]  # the likeliest first: with and without the fit in the warm-up
    assert [(r.warmup, r.fill, r.fit) for r in first] == [((2.0, 0), 0.25, "warm-up"), ((2.0, 0), 0.25, "never")]


def test_local_search_makes_no_move_past_its_deadline():
    problem = paper_problem(4, 8, memory=8, objective="span")
    m = one_stage_per_worker(problem)
    orders = construct(m, Rule((1.0, 0), math.inf))
    start = Start(m, [o.copy() for o in orders], evaluate(m, orders, "span"), "1F1B-like")
    assert not improve(start, "span", 50, np.random.default_rng(0), deadline=0.0)
    assert start.stale == 0 and all((a == b).all() for a, b in zip(start.orders, orders))
    assert improve(start, "span", 200, np.random.default_rng(0))  # with time, the same moves shorten it


def test_search_beats_the_zero_bubble_hand_schedule_at_twice_its_memory():
    problem = paper_problem(4, 8, memory=8, objective="span")
    result = search(problem, time_limit=1.5)
    replay = result.simulate()
    replay.timeline.check(memory_limit=8)
    assert result.search == "heuristic search" and result.objective == "span"
    assert result.value == pytest.approx(objective_value(replay, "span"))
    assert result.value < best_named(problem, "span") - 1.0  # zb_h2, the best named strategy here
    assert not result.optimal and result.lower_bound == pytest.approx(8 * (18.522 + 18.086 + 9.337))


def test_search_finds_memory_aware_orders_where_named_strategies_deadlock():
    problem = PlanProblem(Shape(4, 4, 8), encode_costs(), memory_limit=2)
    result = search(problem, time_limit=1.0)
    result.simulate().timeline.check(memory_limit=2)
    assert result.latency < best_named(problem, "latency")  # gpipe and 1F1B: 51


def test_search_stops_as_soon_as_the_bound_is_met():
    problem = PlanProblem(Shape(4, 4, 4), encode_costs())  # each micro-batch on its own worker meets the bound
    stream = io.StringIO()
    result = search(problem, time_limit=60, progress=stream)
    assert result.optimal and result.latency == result.lower_bound == 12
    assert result.elapsed < 30
    assert "(bound met)" in stream.getvalue()


def test_an_interrupted_search_returns_the_best_plan_so_far(monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(search_module, "construct", interrupted)
    problem = paper_problem(4, 8, memory=4)
    stream = io.StringIO()
    result = search(problem, time_limit=30, progress=stream)
    assert result.interrupted and result.elapsed < 15
    assert result.latency == pytest.approx(best_named(problem, "latency"))
    assert "(interrupted)" in stream.getvalue()


def test_progress_is_a_plain_line_per_improvement():
    stream = io.StringIO()
    search(paper_problem(4, 8, memory=8, objective="span"), time_limit=1.0, progress=stream)
    assert "\r" not in stream.getvalue()
    lines = [line for line in stream.getvalue().splitlines() if not line.startswith("search: CP-SAT order of")]
    assert len(lines) >= 2 and all(line.startswith("search: span ") for line in lines)
    values = [float(line.split()[2].rstrip(",")) for line in lines]
    assert values == sorted(values, reverse=True) and values[-1] < values[0]


def test_bad_search_arguments_are_refused():
    problem = PlanProblem(Shape(2, 2, 2))
    with pytest.raises(PlanInputError, match="time_limit"):
        search(problem, time_limit=0)
    with pytest.raises(PlanInputError, match="time_limit"):
        search(problem, time_limit=float("nan"))


# ---------------------------------------------------------------------- the command
def test_plan_runs_the_heuristic_search_on_large_problems(capsys):
    assert main(["plan", "-W", "8", "-S", "8", "-B", "32", "--memory-limit", "4", "--time-limit", "2", "--json"]) == 0
    captured = capsys.readouterr()
    answer = json.loads(captured.out)
    assert answer["search"] == "heuristic search" and answer["plan"]["search"] == "heuristic search"
    assert "search: heuristic" in captured.err and "\r" not in captured.err  # progress lines, even with --json
    assert answer["latency"] >= answer["lower_bound"] and not answer["optimal"]
    best_family = min(row["latency"] for row in answer["plan"]["candidates"] if row["source"] == "family")
    assert answer["latency"] <= best_family


def test_plan_search_flag_and_report_say_which_search_ran(capsys):
    assert main(["plan", "-W", "2", "-S", "2", "-B", "4", "--search", "heuristic", "--time-limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "search: heuristic search, minimizing latency" in out
    assert main(["plan", "-W", "2", "-S", "2", "-B", "4", "--search", "cpsat", "--time-limit", "1"]) == 0
    assert "search: cpsat, minimizing latency" in capsys.readouterr().out


def test_plan_and_the_command_pick_the_search_by_one_rule():
    from unisched.plan import plan
    from unisched.plan.planner import uses_heuristic
    from unisched.plan.search import SEARCH_FROM_ITEMS

    assert SEARCH_FROM_ITEMS == 500  # the shapes below sit on either side of it
    assert uses_heuristic("auto", Shape(2, 2, 125), False) and not uses_heuristic("auto", Shape(2, 2, 124), False)
    assert uses_heuristic("auto", Shape(2, 2, 84), True) and not uses_heuristic("auto", Shape(2, 2, 83), True)
    assert uses_heuristic("heuristic", Shape(2, 2, 2), False) and not uses_heuristic("cpsat", Shape(2, 2, 125), False)
    stream = io.StringIO()
    assert plan(2, 2, 125, time_limit=1, progress=stream).search == "heuristic search"
    assert "search: heuristic" in stream.getvalue()
    assert plan(2, 2, 4, time_limit=1, search="heuristic", strategy="gpipe").strategy_name.startswith("gpipe")
    with pytest.raises(PlanInputError, match="search must be one of auto, cpsat, heuristic"):
        plan(2, 2, 4, time_limit=1, search="greedy")


def test_a_strategy_whose_order_needs_a_split_backward_is_refused_before_planning(capsys):
    assert main(["plan", "--strategy", "zb_h1", "--time-limit", "1"]) == 2
    err = capsys.readouterr().err
    assert "--strategy zb_h1: its fixed order needs a split backward" in err and "--backward-weight" in err
    assert "raise time_limit" not in err  # refused up front, not after a search


def test_the_report_names_the_class_an_optimum_is_proven_for(capsys):
    assert main(["plan", "-W", "4", "-S", "4", "-B", "8", "--backward-input", "1", "--backward-weight", "1",
                 "--memory-limit", "8", "--strategy", "zb_h1", "--time-limit", "5"]) == 0
    out = capsys.readouterr().out
    assert "best: zb_h1: latency 27, proven optimal among orders of the mapping of zb_h1 only" in out
    assert "dropped" not in out


def test_timed_durations_are_every_items_time_on_every_worker_in_ticks():
    costs = encode_costs(forward=[1.5, 2.0, 1.0], backward=[3.0, 4.5, 2.5], backward_input=[2.0, 3.0, 1.5],
                         backward_weight=[1.0, 1.5, 1.0])
    costs = dataclasses.replace(costs, worker_speed=[1.0, 2.0])
    problem = PlanProblem(Shape(2, 3, 4), costs, split_backward=True)
    timed = TimedProblem.build(problem)
    batch, stage, direction = problem.items.arrays()
    for item in range(problem.num_items):
        for worker in range(2):
            seconds = float(costs.item_time(stage[item], direction[item], worker, 3, 2))
            assert timed.duration[item, worker] == round(seconds * timed.ticks.scale), (item, worker)
    assert timed.duration.shape == (problem.num_items, 2) and len(np.unique(timed.duration)) >= 6


def test_times_that_do_not_fit_integer_ticks_are_refused_naming_the_fix():
    with pytest.raises(PlanInputError, match="coarser unit"):
        TimedProblem.build(PlanProblem(Shape(2, 2, 2), encode_costs(forward=1e300, backward=1e-300)))


def test_family_search_past_its_deadline_drops_the_rest_unsimulated():
    import time

    from unisched.plan.family import NOT_SIMULATED

    problem = PlanProblem(Shape(4, 4, 8))
    family = search_family(problem, registry_members(problem), deadline=time.perf_counter() - 1)
    assert len(family.feasible) == 1
    assert family.dropped and all(m.reason == NOT_SIMULATED for m in family.dropped if m.strategy is not None)


def test_a_strategy_whose_greedy_replay_deadlocks_gets_orders_that_run():
    from unisched import policies

    problem = PlanProblem(Shape(4, 4, 8), encode_costs(), memory_limit=2)
    looped = [("looped(group_size=2)", policies.get("looped", 4, 4, 8, group_size=2), "")]
    assert search_family(problem, looped).feasible == []  # the simulator's greedy deadlocks
    result = search(problem, time_limit=1.0, members=looped)
    assert result.strategy_name.startswith("looped(group_size=2) + ")
    result.simulate().timeline.check(memory_limit=2)
    assert result.latency < 51  # gpipe's best order at this memory


def test_plan_takes_a_memory_budget_that_rules_out_replicated_weights(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"forward": 1, "backward": 2, "weight_bytes": 10, "activation_bytes": 1,
                                 "bandwidth": 100, "latency": 0.1}))
    base = ["plan", "-W", "2", "-S", "2", "-B", "4", "--costs", str(costs), "--time-limit", "3", "--json"]
    assert main(base) == 0
    free = json.loads(capsys.readouterr().out)
    assert main(base + ["--memory-budget", "30", "--optimizer-bytes", "5"]) == 0
    budgeted = json.loads(capsys.readouterr().out)
    held = {}
    for item, workers in budgeted["plan"]["mapping"].items():
        for worker in workers:
            held.setdefault(worker, set()).add(item[0])
    assert all(len(stages) == 1 for stages in held.values())  # two stages' weights and state exceed 30 bytes
    assert budgeted["plan"]["memory_budget"] == 30 and budgeted["latency"] > free["latency"]
    assert main(["plan", "-W", "2", "-S", "2", "-B", "4", "--optimizer-bytes", "5"]) == 2
    assert "give a --memory-budget too" in capsys.readouterr().err


def test_a_time_limit_spent_before_any_seed_ran_is_named_as_the_cause():
    """With 0.01 s the family search simulates one strategy (which deadlocks under the limit) and
    drops the rest unsimulated; the error blamed the memory limit."""
    from unisched.errors import UniSchedError

    with pytest.raises(UniSchedError, match=r"within the time limit, so the search has no seed: \d+ of \d+ were not "
                                            r"simulated .*raise time_limit"):
        search(PlanProblem(Shape(8, 8, 64), encode_costs(), memory_limit=4), time_limit=0.01)
