"""Cluster topologies: the file format and its checks, routes that share
links, NCCL's collective models, the engine booking them, and 3D layouts
simulated by symmetry."""

from __future__ import annotations

import json

import numpy as np
import pytest

from unisched import Costs, Work, network, policies, simulate
from unisched.cli import main
from unisched.errors import ShapeError
from unisched.simulate.layout import Layout, Model, replicated, simulate_layout
from unisched.timeline import TRANSFER_KINDS
from unisched.topology import ClusterCosts, Topology, presets
from unisched.work import ComputeAndWeightWorkers

ALLREDUCE = TRANSFER_KINDS.index("allreduce")
ACTIVATION = TRANSFER_KINDS.index("activation")


def small(**changes) -> dict:
    data = {
        "name": "test",
        "devices_per_node": 4,
        "intra_node": {"bandwidth": 100.0, "latency": 0.5},
        "nics_per_node": 2,
        "nic": {"bandwidth": 10.0},
        "inter_node": {"latency": 2.0},
    }
    data.update(changes)
    return data


# ---------------------------------------------------------------------- the format
def test_presets_load_and_cite_their_numbers():
    assert {"dgx_h100", "dgx_a100", "p4d_24xlarge"} <= set(presets())
    h100 = Topology.load("dgx_h100")
    assert h100.intra_node.bandwidth == 450e9  # 900 GB/s both ways, per GPU
    assert (h100.nics_per_node, h100.nic.bandwidth) == (8, 50e9)  # 8 x 400 Gb/s
    for name in presets():
        topology = Topology.load(name)
        for field in ("intra_node.bandwidth", "nics_per_node", "nic.bandwidth"):
            assert topology.sources.get(field), f"{name} cites no source for {field}"
        assert Topology.from_dict(topology.to_dict()) == topology


@pytest.mark.parametrize("change, field", [
    ({"intra_node": {"bandwidth": 0, "latency": 1.0}}, "intra_node.bandwidth"),
    ({"nic": {"bandwidth": -5.0}}, "nic.bandwidth"),
    ({"nic": None}, "'nic'"),
    ({"intra_node": {"bandwidth": 1.0}}, "intra_node.latency"),
    ({"inter_node": {"latency": 1.0, "oversubscription": 0.5}}, "inter_node.oversubscription"),
    ({"devices_per_node": 0}, "devices_per_node"),
    ({"collective": "butterfly"}, "collective"),
    ({"speed": 3}, "speed"),
])
def test_bad_files_name_the_field(tmp_path, change, field):
    data = small(**change)
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ShapeError, match=field.replace(".", r"\.")) as error:
        Topology.load(path)
    assert str(path) in str(error.value)


def test_device_count_must_match_the_workers_before_any_simulation():
    costs = ClusterCosts(topology=small(nodes=2))
    with pytest.raises(ShapeError, match="nodes=2 x devices_per_node=4 = 8 devices but the step has 6 workers; "
                                         "use a multiple of 4 workers"):
        simulate(6, 6, 2, policies.get("gpipe", num_workers=6, num_stages=6, num_batches=2), costs=costs)
    with pytest.raises(ShapeError, match='the step has 12 workers; set "nodes" to 3, or leave it out'):
        costs.check(12, 12)
    with pytest.raises(ShapeError, match='the step has 3 workers; leave "nodes" out'):
        costs.check(3, 3)
    with pytest.raises(ShapeError, match="devices_per_node=4"):
        ClusterCosts(topology=small()).check(6, 6)
    assert ClusterCosts(topology=small()).cluster(8).nodes == 2
    assert ClusterCosts(topology=small()).cluster(3).devices == 3  # less than a node: one partial node
    with pytest.raises(ShapeError, match="no topology file"):
        Topology.load("no_such_cluster")


# ---------------------------------------------------------------------- routes and collectives
def test_a_transfer_takes_its_routes_bottleneck():
    costs = ClusterCosts(topology=small(inter_node={"latency": 2.0, "oversubscription": 4, "nodes_per_switch": 1}))
    assert network.transfer_time(costs, 0, 1, 100.0) == 0.5 + 100.0 / 100.0  # NVLink inside a node
    assert network.transfer_time(costs, 0, 5, 100.0) == 2.0 + 100.0 / (10.0 / 4)  # NICs, thinned across switches
    topology = costs.cluster(8)
    assert topology.route(0, 5).links == (("nic_out", 0, 0), ("nic_in", 1, 0))
    assert topology.route(3, 6).links == (("nic_out", 0, 1), ("nic_in", 1, 1))  # devices 2, 3 share NIC 1
    latency, bandwidth = network.link_arrays(costs, 8)
    for a, b in [(0, 1), (0, 5), (3, 6)]:
        assert costs.link(a, b).bandwidth == bandwidth[a, b] and costs.link(a, b).latency == latency[a, b]


def test_collectives_follow_nccl_models():
    costs = ClusterCosts(topology="dgx_h100")
    S = 1e9
    everyone = list(range(16))  # two nodes: NVLink inside, 8 NIC channels between
    bus = min(450e9, 8 * 50e9)
    assert network.ring_allreduce_time(costs, everyone, S) == pytest.approx(30 * 5e-6 + 2 * 15 / 16 * S / bus)
    assert network.tree_allreduce_time(costs, everyone, S) == pytest.approx(2 * 4 * 5e-6 + 2 * S / bus)
    assert network.reduce_scatter_time(costs, everyone, S) == pytest.approx(15 * 5e-6 + 15 / 16 * S / bus)
    assert network.all_gather_time(costs, everyone, S) == network.reduce_scatter_time(costs, everyone, S)
    rail = [0, 8, 16, 24]  # one GPU per node: one NIC each
    assert network.ring_allreduce_time(costs, rail, S) == pytest.approx(6 * 5e-6 + 1.5 * S / 50e9)
    one_node = list(range(8))
    assert network.tensor_parallel_time(costs, one_node, S) == pytest.approx(14 * 2e-6 + 1.75 * S / 450e9)
    tree = ClusterCosts(topology={**Topology.load("dgx_h100").to_dict(), "collective": "tree"})
    assert network.allreduce_time(tree, rail, S) == network.tree_allreduce_time(tree, rail, S)


# ---------------------------------------------------------------------- the engine books links
def _two_senders(first: int, second: int):
    """Stage 0 of batch b on worker (first, second)[b], stage 1 on the next node."""
    def mapping(work: Work):
        worker = (first, second)[work.batch] + (8 if work.stage else 0)
        return ComputeAndWeightWorkers(worker, worker)
    return mapping


def test_devices_sharing_a_nic_queue_and_others_do_not():
    costs = ClusterCosts(forward=1.0, backward=2.0, activation_bytes=25e9, topology="p4d_24xlarge")  # 4 NICs for 8
    occupy = 25e9 / 12.5e9

    def arrivals(first, second):
        tr = simulate(16, 2, 2, _two_senders(first, second), costs=costs).transfers
        return sorted(tr.end[(tr.kind == ACTIVATION)].tolist())

    assert arrivals(0, 1) == pytest.approx([1 + 15e-6 + occupy, 1 + 15e-6 + 2 * occupy])  # one NIC, in turn
    assert arrivals(0, 2) == pytest.approx([1 + 15e-6 + occupy] * 2)  # two NICs, at once


def test_workers_compute_while_their_transfers_are_in_flight():
    costs = ClusterCosts(forward=1.0, backward=2.0, activation_bytes=1e11, topology="dgx_h100")
    sim = simulate(16, 2, 3, lambda w: ComputeAndWeightWorkers(8 * w.stage, 8 * w.stage), costs=costs)
    t = sim.timeline
    sent = sim.transfers.kind == ACTIVATION
    first = np.flatnonzero((t.stage == 0) & (t.direction == 0))
    assert t.start[first].tolist() == [0.0, 1.0, 2.0]  # worker 0 keeps computing
    assert sim.transfers.end[sent].max() > 3.0  # while its activations are still on the wire


def test_all_reduces_queue_on_shared_links_but_not_without_a_topology():
    fields = dict(forward=1e-3, backward=2e-3, weight_bytes=1e9)
    ddp = policies.get("ddp", num_workers=16, num_stages=4, num_batches=16)
    clustered = simulate(16, 4, 16, ddp, costs=ClusterCosts(**fields, topology="dgx_h100")).transfers
    ring = network.ring_allreduce_time(ClusterCosts(topology="dgx_h100"), range(16), 1e9)
    spans = sorted({(s, e) for s, e in zip(clustered.start[clustered.kind == ALLREDUCE],
                                           clustered.end[clustered.kind == ALLREDUCE])})
    assert len(spans) == 4
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end - 1e-12  # one after the other on the same NVLink ports and NICs
    assert spans[-1][1] - spans[0][0] == pytest.approx(4 * ring)


def test_a_gang_item_lasts_its_share_of_compute_and_its_collective():
    costs = ClusterCosts(forward=1e-3, backward=2e-3, activation_bytes=1e9, topology="dgx_h100")
    model = Model(layers=2, layer_forward=2e-3, layer_weight_bytes=0.0, activation_bytes=1e9, layer_stash_bytes=0.0)
    one = simulate_layout(Layout(1, 2, 8), "dgx_h100", policies.get("gpipe", num_workers=2, num_stages=2,
                                                                  num_batches=2), model)
    timeline = one.simulation.timeline
    tp = network.tensor_parallel_time(costs, range(8), 2e9)  # a layer all-reduces twice per pass
    forwards = timeline.direction == 0
    durations = timeline.end - timeline.start
    assert durations[forwards] == pytest.approx(2e-3 / 8 + tp)  # its share of the compute, then the all-reduce
    assert durations[~forwards] == pytest.approx(4e-3 / 8 + tp)


# ---------------------------------------------------------------------- layouts
MODEL = Model(layers=8, layer_forward=1e-3, layer_weight_bytes=2e8, activation_bytes=2e7, layer_stash_bytes=1e8)


@pytest.mark.parametrize("topology, layout, strategy", [
    ("dgx_h100", Layout(4, 2, 4), "one_f_one_b"),
    ("p4d_24xlarge", Layout(3, 4, 2), "gpipe"),
    ("dgx_a100", Layout(2, 8, 1), "one_f_one_b"),
])
def test_one_replica_by_symmetry_is_the_whole_cluster(topology, layout, strategy):
    pipeline = policies.get(strategy, num_workers=layout.pipeline, num_stages=layout.pipeline, num_batches=4)
    by_symmetry = simulate_layout(layout, topology, pipeline, MODEL)
    everything = simulate_layout(layout, topology, pipeline, MODEL, symmetry=False)
    assert by_symmetry.symmetric and "exact by symmetry" in by_symmetry.method
    assert not everything.symmetric and f"all {layout.data} replicas" in everything.method
    assert by_symmetry.step_time == everything.step_time
    assert by_symmetry.memory_per_gpu == everything.memory_per_gpu
    replica = everything.simulation.timeline
    mine = replica.batch < 4  # replica 0's micro-batches, on replica 0's workers
    assert np.array_equal(replica.start[mine], by_symmetry.simulation.timeline.start)


def test_replicas_sharing_nodes_are_all_simulated_and_said_so():
    pipeline = policies.get("gpipe", num_workers=2, num_stages=2, num_batches=2)
    result = simulate_layout(Layout(4, 2, 2), "dgx_h100", pipeline, MODEL)
    assert not result.symmetric and "share nodes" in result.method
    assert result.simulation.shape.num_workers == 16


def test_replicas_follow_fixed_orders_given_as_item_ids_or_as_lists():
    """Replica d runs replica 0's order on its workers with its own micro-batches,
    whether the orders are WorkerOrders or lists of Work or of (batch, stage, direction)."""
    zb = policies.get("zb_h1", num_workers=2, num_stages=2, num_batches=3)
    as_ids = replicated(zb, 2).worker_orders
    assert sorted(as_ids) == [0, 1, 2, 3]
    assert as_ids[3] == [Work(u.batch + 3, u.stage, u.direction) for u in zb.worker_orders[1]]
    for lists in ({w: list(zb.worker_orders[w]) for w in zb.worker_orders},
                  {w: [tuple(u) for u in zb.worker_orders[w]] for w in zb.worker_orders}):
        assert replicated(zb.with_(worker_orders=lists), 2).worker_orders == {w: as_ids[w] for w in as_ids}


def test_a_layout_that_does_not_divide_is_refused():
    with pytest.raises(ShapeError, match="the pipeline must be a Strategy built for 2 workers and 2 stages .* got "
                                         "'one_f_one_b'"):
        simulate_layout(Layout(2, 2, 4), "dgx_h100", "one_f_one_b", MODEL)  # an AttributeError before
    with pytest.raises(ShapeError, match="does not match the 64 GPUs"):
        Layout(3, 4, 8).check(64)
    with pytest.raises(ShapeError, match="Model.layers=8 does not split into pipeline=3"):
        simulate_layout(Layout(1, 3, 8), "dgx_h100", policies.get("gpipe", num_workers=3, num_stages=3,
                                                                  num_batches=2), MODEL)
    with pytest.raises(ShapeError, match="devices_per_node=8"):
        simulate_layout(Layout(3, 2, 2), "dgx_h100", policies.get("gpipe", num_workers=2, num_stages=2,
                                                                  num_batches=2), MODEL)
    with pytest.raises(ShapeError, match="nodes=4 x devices_per_node=8 = 32 devices but the step has 16"):
        cluster = {**Topology.load("dgx_h100").to_dict(), "nodes": 4}
        simulate_layout(Layout(2, 2, 4), cluster, policies.get("gpipe", num_workers=2, num_stages=2,
                                                              num_batches=2), MODEL)
    with pytest.raises(ShapeError, match="pipeline strategy 'gpipe' must be built for 4 workers"):
        simulate_layout(Layout(2, 4, 8), "dgx_h100", policies.get("gpipe", num_workers=2, num_stages=2,
                                                                  num_batches=2), MODEL)


# ---------------------------------------------------------------------- the command
def test_cluster_costs_round_trip_through_a_costs_file(tmp_path):
    """A costs dict or file that carries a topology reads back as the same
    ClusterCosts (what a plan file's costs are read with), and simulates the same."""
    costs = ClusterCosts(forward=[1.0, 2.0], activation_bytes=1e6, weight_bytes=4e6, topology="dgx_h100",
                         replicas=2, tensor_parallel_bytes=3e6)
    back = Costs.from_dict(json.loads(json.dumps(costs.to_dict())))
    assert isinstance(back, ClusterCosts) and back == costs
    path = tmp_path / "costs.json"
    costs.save(path)
    loaded = Costs.load(path)
    assert isinstance(loaded, ClusterCosts) and loaded.topology == costs.topology
    strategy = policies.get("one_f_one_b", 2, 2, 4)
    first, again = (simulate(2, 2, 4, strategy, costs=c).timeline for c in (costs, loaded))
    assert np.array_equal(first.start, again.start) and np.array_equal(first.end, again.end)
    with pytest.raises(ShapeError, match=r"unknown cost field\(s\) \['nodes'\]"):
        Costs.from_dict({"forward": 1.0, "nodes": 2})


def test_simulate_takes_a_topology(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"forward": 0.01, "backward": 0.02, "activation_bytes": 1e9}))
    args = ["simulate", "--strategy", "gpipe", "-W", "16", "-B", "4", "--costs", str(costs), "--json"]
    assert main([*args, "--topology", "dgx_h100"]) == 0
    on_cluster = json.loads(capsys.readouterr().out)
    assert on_cluster["topology"]["nodes"] == 2
    assert main(args) == 0
    free = json.loads(capsys.readouterr().out)
    assert on_cluster["latency"] > free["latency"]  # 1 GB activations take time on NVLink and NICs
    bad = tmp_path / "cluster.json"
    bad.write_text(json.dumps(small(nic={"bandwidth": 0})))
    assert main([*args[:-1], "--topology", str(bad)]) == 2
    assert "nic.bandwidth must be a number >= 1" in capsys.readouterr().err
    assert main(["simulate", "--strategy", "gpipe", "-W", "12", "--topology", "dgx_h100"]) == 2
    assert "devices_per_node=8" in capsys.readouterr().err


@pytest.mark.parametrize("changes, words", [
    (dict(layers=0), "layers must be a positive integer, got 0"),
    (dict(layers=-4), "layers must be a positive integer, got -4"),
    (dict(hidden=0), "hidden must be a positive integer, got 0"),
    (dict(sequence=2.5), "sequence must be a positive integer, got 2.5"),
    (dict(gpu_flops=float("nan")), "gpu_flops must be a positive number"),
])
def test_a_transformer_of_no_layers_or_no_width_is_refused_by_name(changes, words):
    """layers=0 simulated a step of 0 bytes; hidden=0 raised ZeroDivisionError; layers=-4 was refused
    as a negative forward time."""
    with pytest.raises(ShapeError, match=words):
        Model.transformer(**{**dict(layers=4, hidden=1024, sequence=2048), **changes})
    with pytest.raises(ShapeError, match="Model.layer_forward must be a finite number >= 0, got -1"):
        Model(layers=2, layer_forward=-1, layer_weight_bytes=0.0, activation_bytes=0.0, layer_stash_bytes=0.0)
