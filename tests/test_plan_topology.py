"""The planner on a cluster topology: its models take each pair of workers' transfer
time from the topology, every plan it reports is a replay on the topology (links
shared, contention included), and a topology that does not fit is refused as
`unisched simulate --topology` refuses it, before any search."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from unisched import network
from unisched.cli import main
from unisched.errors import ShapeError
from unisched.plan import load_plan, plan
from unisched.plan.problem import exact_links
from unisched.plan.order import step_tails
from unisched.plan.problem import PlanInputError, PlanProblem, TimedProblem
from unisched.strategy import Strategy
from unisched.topology import ClusterCosts
from unisched.work import ComputeAndWeightWorkers, Shape

TINY = {
    "name": "tiny",
    "devices_per_node": 2,
    "intra_node": {"bandwidth": 100.0, "latency": 0.01},
    "nics_per_node": 1,
    "nic": {"bandwidth": 10.0},
    "inter_node": {"latency": 0.05},
}
"""Two GPUs a node sharing one NIC: a node's GPUs queue for it."""


def tiny_costs(**changes) -> ClusterCosts:
    fields = dict(forward=1.0, backward=2.0, activation_bytes=2.0, weight_bytes=4.0, topology=TINY)
    return ClusterCosts(**{**fields, **changes})


def test_a_plan_on_a_topology_is_its_replay_there(tmp_path):
    result = plan(4, 4, 4, tiny_costs(), time_limit=1.5, search_workers=1, search="cpsat")
    assert isinstance(result.costs, ClusterCosts) and result.costs.topology.name == "tiny"
    assert result.latency == result.simulate().latency
    assert result.lower_bound <= result.latency + 1e-9
    # links differ (NVLink inside a node, the NIC between): the mapping model takes the worst
    # link, so its bounds prove nothing and none is reported
    assert not {"cpsat_paired", "cpsat_whole_scheme"} & set(result.bounds)
    result.save(tmp_path / "plan.json")
    again = load_plan(tmp_path / "plan.json")  # checks its replay against the file
    assert again.costs.topology == result.costs.topology and again.latency == result.latency


def test_the_heuristic_search_plans_on_a_topology_too():
    result = plan(4, 4, 8, tiny_costs(), time_limit=1, search="heuristic")
    assert result.search.startswith("heuristic") and isinstance(result.costs, ClusterCosts)
    assert result.latency == result.simulate().latency


def test_the_models_take_each_pairs_route():
    problem = PlanProblem(Shape(4, 2, 2), tiny_costs())
    timed = TimedProblem.build(problem)
    inside, between = 0.01 + 2.0 / 100.0, 0.05 + 2.0 / 10.0  # latency + bytes / the route's bottleneck
    assert timed.comm[0, 1, 0] == timed.ticks(inside) and timed.comm[0, 2, 0] == timed.ticks(between)
    assert timed.fetch[3, 1, 0] == timed.ticks(0.05 + 4.0 / 10.0) and timed.comm[2, 2, 0] == 0
    assert not exact_links(timed) and not problem.identical_workers
    one_node = PlanProblem(Shape(2, 2, 2), tiny_costs())
    assert exact_links(TimedProblem.build(one_node)) and one_node.identical_workers


def test_all_reduce_tails_follow_the_topologys_collective():
    """A stage replicated across the nodes all-reduces as the topology says (here a tree), as the simulator does."""
    costs = tiny_costs(weight_bytes=10.0, topology={**TINY, "collective": "tree"})
    problem = PlanProblem(Shape(4, 2, 2), costs)
    timed = TimedProblem.build(problem)
    placed = 2 * timed.batch  # micro-batch b on worker 2b: every stage on workers 0 and 2
    tails = step_tails(timed, placed, placed)
    tree = network.tree_allreduce_time(costs, [0, 2], 10.0)
    assert tree != network.ring_allreduce_time(costs, [0, 2], 10.0)
    last = timed.direction == timed.direction.max()
    assert np.all(tails[last] == timed.ticks(tree)) and np.all(tails[~last] == 0)


def test_contention_is_in_the_replay_and_no_bound_claims_past_it():
    """Two GPUs of a node send their activations through its one NIC at once: the order model
    (no contention) expects both at 2.05, the replay queues the second behind the first."""
    mapping = Strategy(lambda w: ComputeAndWeightWorkers(2 * w.stage + w.batch, 2 * w.stage + w.batch),
                       name="across")
    costs = tiny_costs(activation_bytes=10.0, weight_bytes=0.0)
    result = plan(4, 2, 2, costs, strategy="across", members=[("across", mapping, "")], time_limit=1.5,
                  search_workers=1)
    ordered = next(row for row in result.candidates if row["source"] == "cpsat-order")
    # F 1, activation 0.05 + 10/10, F 1, B 2, gradient 1.05, B 2, intra-node all-reduce 2 x 0.01
    assert ordered["model_latency"] == pytest.approx(8.12)
    assert result.latency == pytest.approx(9.12) == result.simulate().latency  # one NIC second later, twice
    assert not result.optimal and result.lower_bound <= result.latency


@pytest.mark.parametrize("workers, topology, field", [
    (3, TINY, "devices_per_node=2"),
    (6, {**TINY, "nodes": 2}, 'set "nodes"'),
])
def test_a_topology_that_does_not_fit_is_refused_before_any_search(workers, topology, field):
    progress = io.StringIO()
    with pytest.raises(ShapeError, match=field):
        plan(workers, 3, 2, tiny_costs(topology=topology), time_limit=1, progress=progress)
    assert progress.getvalue() == ""


def test_replicas_of_a_layout_are_refused():
    with pytest.raises(PlanInputError, match="replicas=1"):
        plan(2, 2, 2, tiny_costs(replicas=2), time_limit=1)


def test_the_plan_command_takes_a_topology(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"activation_bytes": 2.0, "weight_bytes": 4.0, "topology": "dgx_h100"}))
    cluster = tmp_path / "tiny.json"
    cluster.write_text(json.dumps(TINY))
    out = tmp_path / "plan.json"
    args = ["plan", "-W", "4", "-S", "4", "-B", "4", "--costs", str(costs), "--time-limit", "1.5", "--json"]
    assert main([*args, "--topology", str(cluster), "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["topology"]["name"] == "tiny" and result["topology"]["nodes"] == 2  # the flag's, not the file's
    assert load_plan(out).simulate().latency == result["latency"]
    assert main([*args, "--topology", str(cluster), "--comm", "1"]) == 2
    assert "drop --comm" in json.loads(capsys.readouterr().err.splitlines()[-1])["error"]


@pytest.mark.parametrize("topology, shape, expected", [
    ("no_such_cluster", ["-W", "4", "-S", "4"], "no topology file 'no_such_cluster' and no preset of that name"),
    ("dgx_h100", ["-W", "12", "-S", "12"], "12 workers do not fill whole nodes of devices_per_node=8 (dgx_h100)"),
])
def test_plan_refuses_a_topology_as_simulate_does(capsys, topology, shape, expected):
    errors = []
    for verb in (["simulate", "--strategy", "gpipe"], ["plan"]):
        assert main([*verb, *shape, "-B", "2", "--topology", topology, "--json"]) == 2
        err = capsys.readouterr().err.splitlines()
        assert not any("progress" in line for line in err)  # refused before any search
        errors.append(json.loads(err[-1])["error"])
    assert errors[0] == errors[1] and expected in errors[1]


def test_plan_help_names_the_topology_flag(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--topology FILE|PRESET" in text and "dgx_h100" in text and "not with --comm or --fetch" in text
