"""Bad input is refused with a clear error that names what to change: costs,
plan files, shapes too large to hold, and command-line numbers."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import unisched
from unisched import Costs, Link, ShapeError, UniSchedError, simulate
from unisched.cli import main
from unisched.plan import PlanFileError, PlanInputError, load_plan, plan


def gpipe(W=4, S=4, B=8):
    return unisched.policies.get("gpipe", num_workers=W, num_stages=S, num_batches=B)


# ---------------------------------------------------------------------- costs
@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(links={(0, 1): Link(latency=-5)}), r"links\[0,1\]\.latency"),
        (dict(links={(0, 1): Link(latency=math.nan)}), r"links\[0,1\]\.latency"),
        (dict(links={(0, 1): Link(latency=math.inf)}), r"links\[0,1\]\.latency"),
        (dict(links={(0, 1): Link(bandwidth=0)}), r"links\[0,1\]\.bandwidth"),
        (dict(links={(0, 1): Link(bandwidth=math.nan)}), r"links\[0,1\]\.bandwidth"),
        (dict(links={"0,1": {"latency": None}}), r"links\[0,1\]\.latency"),
        (dict(links={"a,b": {"latency": 1}}), "links keys"),
        (dict(links={(0, -1): Link()}), "links keys"),
        (dict(latency=math.nan), "Costs.latency"),
        (dict(latency=math.inf), "Costs.latency"),
        (dict(bandwidth=0), "Costs.bandwidth"),
        (dict(bandwidth=math.nan), "Costs.bandwidth"),
        (dict(forward=None), "Costs.forward"),
        (dict(backward=[1, None]), "Costs.backward"),
        (dict(backward=2, backward_input=5, backward_weight=5), "Costs.backward"),
        (dict(forward="fast"), "Costs.forward"),
        (dict(forward=[1, "fast"]), "Costs.forward"),
        (dict(forward=[[1, 2]]), "Costs.forward"),
        (dict(weight_bytes=math.nan), "Costs.weight_bytes"),
        (dict(worker_speed=[1, math.nan, 1, 1]), "Costs.worker_speed"),
        (dict(worker_speed=[1, math.inf]), "Costs.worker_speed"),
        (dict(worker_speed=2.0), "Costs.worker_speed"),
        (dict(worker_speed=["fast"]), "Costs.worker_speed"),
        (dict(backward_input=[1.0, 1.0], backward_weight=[]), "backward_weight"),
    ],
)
def test_bad_costs_are_refused_by_name(fields, named):
    with pytest.raises(ShapeError, match=named):
        Costs(**fields)


def test_one_half_of_the_backward_leaves_the_other_what_remains_as_the_flags_do(tmp_path, capsys):
    """A costs file with the whole backward and one half read the other half as half of the whole
    (backward 3, I 1: W 1.5), where the same flags give W 2; a half longer than the default whole
    was taken, with a step longer than the pass it splits."""
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"backward": 3, "backward_input": 1}))
    assert main(["simulate", "--strategy", "gpipe", "-W", "2", "--costs", str(path), "--json"]) == 0
    from_file = json.loads(capsys.readouterr().out)["latency"]
    assert main(["simulate", "--strategy", "gpipe", "-W", "2", "--backward", "3", "--backward-input", "1",
                 "--json"]) == 0
    from_flags = json.loads(capsys.readouterr().out)["latency"]
    assert main(["simulate", "--strategy", "gpipe", "-W", "2", "--backward-input", "1", "--backward-weight", "2",
                 "--json"]) == 0
    assert from_file == from_flags == json.loads(capsys.readouterr().out)["latency"]
    assert Costs(backward_weight=0.5).backward_input == 1.5
    with pytest.raises(ShapeError, match="Costs.backward 2.0 is shorter than its half backward_weight 5"):
        Costs(backward_weight=5)
    with pytest.raises(ShapeError, match="Costs.backward has 3 entries but Costs.backward_input has 2"):
        Costs(backward=[3, 3, 3], backward_input=[1, 1])
    assert Costs(backward=0.3, backward_input=0.1 + 0.2).backward_weight == 0.0  # round-off, not a longer half
    assert Costs(backward=3).with_times(backward_input=1).backward_weight == 2.0  # the flags' rule, the same one


def test_a_costs_file_with_a_null_time_is_refused(tmp_path, capsys):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"forward": None}))
    with pytest.raises(ShapeError, match="forward"):
        Costs.load(path)
    code = main(["simulate", "--strategy", "gpipe", "--costs", str(path), "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "forward" in json.loads(err)["error"]


def test_a_costs_file_that_is_not_text_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "costs.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ShapeError, match=f"costs file {path} is not valid JSON: 'utf-8' codec can't decode"):
        Costs.load(path)


@pytest.mark.parametrize("flag, what, fix", [("--costs", "costs", "the fields of unisched.Costs"),
                                             ("--topology", "topology", "docs/topology.md")])
def test_a_yaml_file_is_told_it_must_be_json_and_what_to_write(capsys, tmp_path, flag, what, fix):
    path = tmp_path / "file.yaml"
    path.write_text("forward: 1\nbackward: 2\n")
    code = main(["simulate", "--strategy", "gpipe", flag, str(path)])
    err = capsys.readouterr().err
    assert code == 2 and f"{what} file {path} is not valid JSON" in err and fix in err


def test_links_to_workers_that_do_not_exist_are_refused():
    costs = Costs(links={(0, 9): Link(latency=5)})
    with pytest.raises(ShapeError, match="link 0,9 but there are 4 workers"):
        simulate(4, 4, 8, gpipe(), costs=costs)
    with pytest.raises(ShapeError, match="link 0,9"):
        costs.check(num_workers=4, num_stages=4)
    with pytest.raises(ShapeError, match="link 0,9"):
        plan(4, 4, 8, costs, strategy="gpipe", time_limit=2)
    assert costs.check(num_workers=10, num_stages=4) is costs


def test_costs_whose_sum_overflows_are_refused():
    huge = Costs(forward=1e308, backward=1e308)
    with pytest.raises(ShapeError, match="too large"):
        simulate(4, 4, 8, gpipe(), costs=huge)


@pytest.mark.parametrize("costs", [Costs(forward=1e-310, backward=1e-310), Costs(forward=1, backward=2, latency=1e-300),
                                   Costs(activation_bytes=1e-300, bandwidth=1e10)])
def test_costs_too_small_to_draw_or_plan_are_refused(costs):
    """A pass or transfer of 1e-310 made the diagram's characters per time unit infinite (an
    OverflowError from the renderer); times of none (0) stay free."""
    with pytest.raises(ShapeError, match="too small to measure"):
        simulate(4, 4, 8, gpipe(), costs=costs)
    assert simulate(4, 4, 8, gpipe(), costs=Costs(forward=0, backward=0)).latency == 0


def test_costs_too_small_on_the_command_line_are_an_error_not_a_traceback(capsys):
    code = main(["simulate", "--strategy", "gpipe", "--forward", "1e-310", "--backward", "1e-310"])
    assert code == 2 and "too small to measure" in capsys.readouterr().err


def test_a_scheme_beside_a_strategy_is_refused_not_ignored(capsys):
    """With a strategy its mapping is kept: there is no mapping search for --scheme to choose the class of."""
    with pytest.raises(PlanInputError, match="drop one of the two"):
        plan(2, 2, 4, strategy="gpipe", scheme="whole", time_limit=1)
    assert main(["plan", "-W", "2", "-S", "2", "-B", "4", "--strategy", "gpipe", "--scheme", "paired"]) == 2
    assert "no mapping search" in capsys.readouterr().err


def test_costs_of_another_shape_are_refused_where_they_meet_it():
    with pytest.raises(ShapeError, match="3 entries but the model has 4 stages"):
        Costs(forward=[1, 2, 3]).check(num_workers=4, num_stages=4)
    with pytest.raises(ShapeError, match="worker_speed has 2 entries"):
        Costs(worker_speed=[1, 2]).check(num_workers=4, num_stages=4)


# ---------------------------------------------------------------------- plan files
@pytest.fixture(scope="module")
def plan_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan(2, 2, 4, strategy="gpipe", time_limit=5).save(path)
    return json.loads(path.read_text())


def load(tmp_path, data, **checks):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return load_plan(path, **checks)


def edited(data, **changes):
    copy = json.loads(json.dumps(data))
    for key, value in changes.items():
        where = copy
        *parents, last = key.split("__")
        for parent in parents:
            where = where[parent]
        where[last] = value
    return copy


def test_a_saved_plan_loads_with_its_replayed_latency(tmp_path, plan_data):
    loaded = load(tmp_path, plan_data)
    assert loaded.latency == loaded.simulate().latency == plan_data["latency"]


def test_a_plan_file_with_a_looser_bound_than_its_problem_gives_still_loads(tmp_path, plan_data):
    """An earlier unisched worked out some bounds more loosely: less than the problem gives is no
    false claim (more is, and is refused below)."""
    looser = edited(plan_data, bounds__critical_path=plan_data["bounds"]["critical_path"] - 1)
    assert load(tmp_path, looser).latency == plan_data["latency"]


@pytest.mark.parametrize(
    "changes, words",
    [
        (dict(latency=1.0, optimal=True), "replays to"),
        (dict(latency=1.0), "replays to"),
        (dict(lower_bound=1e6), "lower bound lower_bound = 1e\\+06 above"),
        (dict(bounds={"work": 1e6}), "bounds.work"),
        (dict(optimal=True, lower_bound=1.0), "claims to be optimal"),
        (dict(shape__num_workers=3), "says its bound work is 12 but its problem gives only 8"),  # its proof was for W=2
        (dict(starts=None), "is a version 2 plan file without its 'starts'"),
        (dict(latency="fast"), "'latency' must be a finite number"),
        (dict(optimal="yes"), "'optimal' must be true or false"),
        (dict(shape__num_batches=2.9), "num_batches must be a positive integer"),
        (dict(shape__num_batches=1e10), "num_batches must be a positive integer"),
        (dict(shape__num_batches=10**10), "the simulator takes at most"),
        (dict(shape__num_workers=True), "num_workers must be a positive integer"),
        (dict(shape__extra=1), "exactly the fields"),
        (dict(candidates=5), "'candidates' must be a list of JSON objects"),
        (dict(candidates=[{"strategy": 3}]), "needs a string 'strategy'"),
        (dict(candidates=[{"strategy": "x", "source": "y", "latency": "slow"}]), "candidates\\[\\].latency"),
        (dict(dropped=[{"strategy": "x"}]), "needs a string 'reason'"),
        (dict(split_backward="no"), "split_backward"),
        (dict(costs__forward=None), "Costs.forward"),
        (dict(costs__links={"0,5": {"latency": 1}}), "link 0,5"),
        (dict(costs__tied_weights=[{"stages": [0, 9], "bytes": 1}]), "names stages \\[0, 9\\] but there are"),
        (dict(memory_limit=-1), "impossible problem: memory_limit must be non-negative finite numbers, got -1"),
        (dict(strategy=7), "'strategy' must be a string"),
        (dict(bound_classes=True), "'bound_classes' must be a JSON object of strings"),
        (dict(bound_classes={"work": 3}), "'bound_classes.work' must be a string"),
        (dict(interrupted="no"), "'interrupted' must be true or false"),
        (dict(bounds=[]), "'bounds' must be a JSON object of numbers"),
    ],
)
def test_a_plan_file_is_not_trusted(tmp_path, plan_data, changes, words):
    begin = time.perf_counter()
    with pytest.raises(PlanFileError, match=words):
        load(tmp_path, edited(plan_data, **changes))
    assert time.perf_counter() - begin < 5  # refused before allocating anything for a huge shape


def test_a_plan_file_whose_order_breaks_a_dependency_is_refused(tmp_path, plan_data):
    orders = {w: list(reversed(items)) for w, items in plan_data["orders"].items()}
    with pytest.raises(PlanFileError, match="cannot be replayed"):
        load(tmp_path, edited(plan_data, orders=orders))


def test_a_plan_file_mapping_of_booleans_is_refused(tmp_path, plan_data):
    mapping = dict(plan_data["mapping"])
    mapping["0F0"] = [True, False]
    with pytest.raises(PlanFileError, match="mapping of 0F0"):
        load(tmp_path, edited(plan_data, mapping=mapping))


def test_a_plan_file_for_another_world_size_or_model(tmp_path, plan_data):
    with pytest.raises(PlanFileError, match="is for 2 workers but the world has 4; launch 2 processes"):
        load(tmp_path, plan_data, num_workers=4)
    with pytest.raises(PlanFileError, match="model of 2 stages but the model has 3"):
        load(tmp_path, plan_data, num_stages=3)
    assert load(tmp_path, plan_data, num_workers=2, num_stages=2).shape == (2, 2, 4)


# ---------------------------------------------------------------------- shapes too large to hold
@pytest.mark.parametrize("arguments, words", [
    (dict(shape=(2, 2)), r"shape must be \(W, S, B\), got \(2, 2\)"),
    (dict(shape=(2, 2, 4, 1)), r"shape must be \(W, S, B\)"),
    (dict(shape=(2, 0, 4)), "shape's S must be a positive integer, got 0"),
    (dict(num_workers="2"), "num_workers must be a positive integer, got '2'"),
    (dict(num_stages=True), "num_stages must be a positive integer, got True"),
])
def test_load_plan_refuses_arguments_it_cannot_compare_by_name(tmp_path, plan_data, arguments, words):
    """shape=(2, 2) raised IndexError; (2, 2, 4, 1) said "is for W=2, S=2, B=4 but W=2, S=2, B=4 was
    asked for"; num_workers='2' said "for 2 workers but the world has 2"."""
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_data))
    with pytest.raises(ShapeError, match=words):  # PlanInputError for the shape's length, a ShapeError
        load_plan(path, **arguments)


def test_a_huge_simulation_is_refused_up_front():
    begin = time.perf_counter()
    with pytest.raises(ShapeError, match="128,000,000 work items.*MAX_ITEMS"):
        simulate(64, 64, 10**6, lambda work: (work.stage, work.stage))
    with pytest.raises(ShapeError, match="workers"):
        simulate(10**9, 1, 1, lambda work: (0, 0))
    assert time.perf_counter() - begin < 5


def test_a_huge_plan_is_refused_up_front():
    begin = time.perf_counter()
    with pytest.raises(PlanInputError, match="too large to plan.*MAX_PLAN_ITEMS"):
        plan(64, 64, 10**5, time_limit=5)
    with pytest.raises(PlanInputError, match="MAX_PLAN_CELLS"):
        plan(2000, 4, 4, time_limit=5)
    assert time.perf_counter() - begin < 5


@pytest.mark.parametrize("verb", [["simulate", "--strategy", "gpipe"], ["compare"], ["plan", "--time-limit", "5"]])
def test_huge_shapes_on_the_command_line(capsys, verb):
    begin = time.perf_counter()
    code = main([*verb, "-W", "64", "-S", "64", "-B", "1000000"])
    _, err = capsys.readouterr()
    assert code == 2 and "1,000,000" not in err and "128,000,000 work items" in err
    assert time.perf_counter() - begin < 10


def test_a_shape_too_large_to_plan_is_refused_before_its_per_worker_tables_are_built(capsys):
    """10^12 workers once allocated terabytes for the costs' per-worker speeds before the size check."""
    code = main(["plan", "-W", "1000000000000", "--time-limit", "1"])
    assert code == 2 and "too large to plan" in capsys.readouterr().err


# ---------------------------------------------------------------------- numbers on the command line
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--comm", "inf"], "--comm must be a finite number"),
        (["--comm", "nan"], "--comm must be a finite number"),
        (["--fetch", "-1"], "--fetch must be a finite number"),
        (["--forward", "1e300"], "too large to add up"),
        (["--forward", "1e18"], "ticks"),
        (["--forward", "1e250"], "ticks"),
        (["--forward", "nan"], "--forward must be a finite number"),
        (["--time-limit", "nan"], "--time-limit must be a positive number"),
        (["--time-limit", "inf"], "--time-limit must be a positive number"),
    ],
)
def test_plan_numbers_that_cannot_be_planned_are_clear_errors(capsys, flags, words):
    code = main(["plan", "--strategy", "gpipe", *flags])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("unisched: error:") and words in err and "Traceback" not in err


def test_limits_that_cannot_hold_one_micro_batch_together_are_refused_before_the_search(tmp_path):
    with pytest.raises(PlanInputError, match="limits add up to 2, but every micro-batch holds all its 4 stashes"):
        plan(4, 4, 4, memory_limit=[1, 1, 0, 0], time_limit=60)
    sizes = Costs(activation_bytes=1e6, weight_bytes=1e7)
    plan(2, 4, 2, sizes, memory_budget=4.2e7, time_limit=2)  # per worker; weights and gradients 8e7, stashes 4e6
    with pytest.raises(PlanInputError, match=r"stashes one micro-batch holds at once after its last forward \(4e\+06\)"):
        plan(2, 4, 2, sizes, memory_budget=4.1e7, time_limit=60)


@pytest.mark.parametrize("limit", [[[1, 2]], [[1], [2, 3]]])
def test_a_nested_memory_limit_is_refused(limit):
    """[[1, 2]] was read as one limit per worker, and a ragged list raised numpy's ValueError."""
    with pytest.raises(PlanInputError, match="memory_limit must be a number or a list of numbers, one per worker"):
        plan(2, 2, 2, memory_limit=limit, time_limit=1)
    with pytest.raises(ShapeError, match="a flat list of one per worker|one number per worker"):
        simulate(2, 2, 2, gpipe(2, 2, 2), memory_limit=limit)


def test_plan_time_limit_from_the_api():
    for bad in (math.nan, math.inf, 0, -1, "5", True):
        with pytest.raises(UniSchedError, match="time_limit"):
            plan(2, 2, 2, time_limit=bad)


@pytest.mark.parametrize("limit", [10**400, [10**400, 1], "x", {"workers": 1}])
def test_a_memory_limit_that_is_no_number_is_refused_by_name(limit):
    with pytest.raises(ShapeError, match="memory_limit"):
        simulate(2, 2, 2, gpipe(2, 2, 2), memory_limit=limit)


@pytest.mark.parametrize("limit", [[1e19, 1], [1e300, 1]])
def test_a_memory_limit_beyond_any_need_plans_as_none_on_that_worker(limit):
    """A limit past what CP-SAT holds in 64 bits raised a C++ cast error from the pooled step."""
    result = plan(2, 2, 2, memory_limit=limit, time_limit=5)
    assert result.optimal and result.latency == plan(2, 2, 2, memory_limit=[100, 1], time_limit=5).latency


def topology_file(tmp_path, **changes):
    """The dgx_h100 preset with ``changes``, as a file."""
    preset = json.loads((Path(unisched.__file__).parent / "topologies" / "dgx_h100.json").read_text())
    path = tmp_path / "topology.json"
    path.write_text(json.dumps({**preset, **changes}))
    return path


@pytest.mark.parametrize("changes", [dict(intra_node={"bandwidth": 1e9, "latency": 1e308}),
                                     dict(devices_per_node=10**30)])
def test_a_topology_too_large_to_add_up_is_refused(tmp_path, capsys, changes):
    path = topology_file(tmp_path, **changes)
    code = main(["simulate", "--strategy", "gpipe", "--topology", str(path), "--json"])
    _, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and "topology" in json.loads(err)["error"]


def test_halves_given_alone_make_the_whole_their_sum():
    """(A whole that disagrees with its halves is refused: see the bad costs above.)"""
    durations = Costs(backward_input=5, backward_weight=5).durations(2)
    halves = durations[unisched.BACKWARD_INPUT] + durations[unisched.BACKWARD_WEIGHT]
    assert list(durations[unisched.BACKWARD]) == list(halves)


def test_a_costs_file_with_a_topology_reads_in_a_fresh_process(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"topology": "dgx_h100", "activation_bytes": 1e6}))
    done = subprocess.run([sys.executable, "-m", "unisched", "simulate", "--strategy", "gpipe", "--costs", str(path),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["topology"]["name"] == "dgx_h100"


def test_a_strategy_naming_a_worker_beyond_any_integer_is_refused_by_name():
    with pytest.raises(UniSchedError, match=r"returned compute worker 10{30} \(int\).*integers in 0\.\.1"):
        simulate(2, 2, 2, lambda work: (10**30, 0))


def test_a_process_group_that_does_not_start_in_time_is_a_clear_error():
    import socket

    with socket.socket() as probe:  # a port no one listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = ("from unisched.execute.process_group import ensure_process_group\n"
            "try:\n    ensure_process_group(0.5)\n"
            "except Exception as error:\n    print(type(error).__name__, error)\n")
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("ExecutionError the process group did not start within the timeout of 0.5 s (")
    assert f"raise the timeout (unisched run: --timeout), or check that every rank reaches MASTER_ADDR:MASTER_PORT " \
        f"(127.0.0.1:{port})" in out


def test_a_master_port_in_use_is_named_as_such_not_as_a_timeout():
    import socket

    code = ("from unisched.execute.process_group import ensure_process_group\n"
            "try:\n    ensure_process_group(30)\n"
            "except Exception as error:\n    print(type(error).__name__, error)\n")
    with socket.socket() as taken:  # rank 0 must listen on MASTER_PORT, and cannot
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120).stdout
    assert out.startswith(f"ExecutionError rank 0 could not listen on MASTER_ADDR:MASTER_PORT (127.0.0.1:{port}): "
                          "the port is in use")
    assert "pick another port (torchrun --master-port, or MASTER_PORT)" in out and "timeout" not in out


def test_a_strategy_of_another_shape_is_refused_by_plan_as_by_simulate():
    """plan() took it and planned its mapping on the wrong shape, "optimal"."""
    built = unisched.policies.get("one_f_one_b", 4, 4, 4)
    with pytest.raises(ShapeError, match="built for W=4, S=4, B=4 but is planned with W=2, S=2, B=2"):
        plan(2, 2, 2, strategy=built, time_limit=1)
    with pytest.raises(ShapeError, match="but is simulated with"):
        simulate(2, 2, 2, built)


def test_a_strategys_split_backward_must_be_a_truth_value():
    """split_backward="False" read as true: I and W passes where none were asked for."""
    with pytest.raises(ShapeError, match="must be True or False, got 'False'"):
        unisched.Strategy(gpipe(2, 2, 2).mapping, split_backward="False")


@pytest.mark.parametrize("graph, error, words", [
    ([(0, 1), (1, 2), (2, 3)], TypeError, "must be a networkx.DiGraph"),  # an AttributeError on .nodes before
    ("0-1-2-3", TypeError, "got str"),
    ("undirected", TypeError, "got Graph"),
    ("twice", TypeError, "no edge twice"),  # a reshape error deep in the dataflow before
    ("floats", ShapeError, "nodes must be the stage numbers"),  # an IndexError before
])
def test_a_stage_graph_of_the_wrong_kind_is_refused_naming_what_is_needed(graph, error, words):
    import networkx as nx

    named = {"undirected": nx.path_graph(4), "twice": nx.MultiDiGraph([(0, 1), (0, 1), (1, 2), (2, 3)]),
             "floats": nx.DiGraph([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)])}
    graph = named.get(graph, graph) if isinstance(graph, str) else graph
    with pytest.raises(error, match=words):
        simulate(4, 4, 8, gpipe(), stage_graph=graph)


@pytest.mark.parametrize("members", [[("x",)], "gpipe", [unisched.policies.get("gpipe", 2, 2, 2)],
                                     [("x", lambda work: work, "")]])
def test_members_of_the_wrong_form_are_refused_saying_what_they_must_be(members):
    with pytest.raises(PlanInputError, match=r"members must be \(label, Strategy, ''\) triples"):
        plan(2, 2, 2, members=members, time_limit=1)
    assert plan(2, 2, 2, members=[["gpipe", gpipe(2, 2, 2), ""]], time_limit=1).latency == 6  # a list, as before


def test_fixed_orders_and_gangs_of_the_wrong_form_are_refused_saying_what_is_needed():
    from unisched.strategy import fixed_strategy

    mapping = gpipe(2, 2, 2).mapping
    with pytest.raises(TypeError, match=r"worker_orders must map each worker to its order"):
        unisched.Strategy(mapping, worker_orders=[[unisched.Work(0, 0, unisched.FORWARD)]])
    compute = weight = [0] * 8
    for orders in (None, [[0, 1]]):
        with pytest.raises(TypeError, match="worker_orders must map each worker"):
            fixed_strategy((2, 2, 2), compute, weight, orders)
    with pytest.raises(ShapeError):
        fixed_strategy((2, -2, 2), compute, weight, {0: []})
    with pytest.raises(ShapeError, match="gang names gang 1 but gang_members lists 1"):
        fixed_strategy((2, 2, 2), compute, weight, {0: []}, gang=[1] + [-1] * 7, gang_members=[(0, 1)])
    with pytest.raises(ShapeError, match="gang_collective has 2 entries for 1 gangs"):
        fixed_strategy((2, 2, 2), compute, weight, {0: []}, gang=[0] + [-1] * 7, gang_members=[(0, 1)],
                       gang_collective=[True, False])
    assert fixed_strategy((2, 2, 2), compute, weight, {0: []}, gang=[0] + [-1] * 7, gang_members=[(0, 1)],
                          gang_collective=np.array([True])).shape == (2, 2, 2)  # an array, as before


def test_odd_arguments_of_the_layout_and_registry_helpers_are_named():
    from unisched.render import to_html
    from unisched.simulate.layout import simulate_layout

    with pytest.raises(TypeError, match="layout must be a unisched Layout"):
        simulate_layout((2, 2, 2), "dgx_h100", gpipe(2, 2, 2), None)
    assert {name for name, _ in unisched.policies.variants(4, 4, 8, only="gpipe")} == {"gpipe"}  # not 'g', 'p', ...
    with pytest.raises(ValueError, match="max_columns must be a whole number of at least 1"):
        to_html(simulate(4, 4, 8, gpipe()), max_columns=0)


def test_a_tied_weight_of_an_infinite_stage_is_refused_by_shape():
    with pytest.raises(ShapeError, match="a tied weight is"):
        Costs(tied_weights=[{"stages": [0, float("inf")], "bytes": 1}])  # an OverflowError before
