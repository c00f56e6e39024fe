"""Fully sharded weights (``Strategy.weight_shards``): a stage held in
shards is gathered shard by shard from its holders and its gradient sent
back shard by shard (an all-gather and a reduce-scatter as their
point-to-point parts); its holders keep one shard of the weights of truth
and their optimizer state each."""

from __future__ import annotations

import numpy as np
import pytest

import unisched
from unisched import Costs, policies
from unisched.errors import StrategyError
from unisched.execute.program import ProgramError, compile_program
from unisched.strategy import Gang
from unisched.topology import ClusterCosts, Fabric, Topology

W = S = B = 4


def fsdp(shard: bool):
    return policies.get("fsdp", num_workers=W, num_stages=S, num_batches=B, shard=shard)


def kind(t, name):
    return t.transfers.of_kind(name)


def test_every_worker_gathers_the_shards_it_does_not_hold_and_returns_their_gradients():
    costs = Costs(weight_bytes=8.0, activation_bytes=1.0, bandwidth=2.0)
    t = unisched.simulate(W, S, B, fsdp(True), costs=costs).timeline
    tr = t.transfers
    fetch, back = kind(t, "weights"), kind(t, "weight_gradient")
    # each worker takes each other worker's shard of each stage once (cached), and sends its gradient back once
    pairs = sorted(zip(tr.src[fetch].tolist(), tr.dst[fetch].tolist(), tr.stage[fetch].tolist()))
    assert pairs == sorted((h, w, s) for h in range(W) for w in range(W) for s in range(S) if h != w)
    returned = sorted(zip(tr.src[back].tolist(), tr.dst[back].tolist(), tr.stage[back].tolist()))
    assert returned == sorted((w, h, s) for h in range(W) for w in range(W) for s in range(S) if h != w)
    assert np.all(tr.nbytes[fetch] == 8.0 / W) and np.all(tr.nbytes[back] == 8.0 / W)
    # a shard arrives before the item that needs it starts
    index = t.index()
    for row in np.flatnonzero(fetch):
        item = index[unisched.Work(int(tr.batch[row]), int(tr.stage[row]), unisched.Direction(int(tr.direction[row])))]
        assert tr.end[row] <= t.start[item] + 1e-12


def test_holders_keep_one_shard_of_weights_and_optimizer_state():
    costs = Costs(weight_bytes=[8.0, 4.0, 4.0, 8.0], optimizer_bytes=[16.0, 8.0, 8.0, 16.0], bandwidth=1.0)
    whole = unisched.simulate(W, S, B, fsdp(False), costs=costs).timeline
    sharded = unisched.simulate(W, S, B, fsdp(True), costs=costs).timeline
    assert [c.peak for c in whole.memory("weights")] == [8.0, 4.0, 4.0, 8.0]  # stage s whole on worker s
    assert [c.peak for c in sharded.memory("weights")] == [6.0] * W  # a quarter of every stage on each
    assert [c.peak for c in sharded.memory("optimizer")] == [12.0] * W
    # at the optimizer step each holds the gradient of its own shards, as each stage's holder did of the stage
    assert [c.at(sharded.latency) for c in sharded.memory("weight_gradients")] == [6.0] * W
    assert [c.at(whole.latency) for c in whole.memory("weight_gradients")] == [8.0, 4.0, 4.0, 8.0]
    # and the whole step's peak is spread evenly
    assert len({c.peak for c in sharded.memory()}) == 1 < len({c.peak for c in whole.memory()})
    # the seed's counts: every item gathers shards it does not hold; every worker holds part of every stage
    stats, whole_stats = sharded.worker_stats(), whole.worker_stats()
    assert stats["weight_transmissions"] == [2 * S] * W and stats["weight_storage"] == [S] * W
    assert whole_stats["weight_transmissions"] == [2 * (S - 1)] * W and whole_stats["weight_storage"] == [1] * W


def test_sharding_spreads_the_traffic_that_whole_stages_put_on_their_holders():
    """On a cluster of one GPU per node (a NIC each), every worker gathering
    whole stages from one holder queues on that holder's NIC; gathered as
    shards, each NIC carries (W-1)/W of a stage, as a ring all-gather does."""
    topology = Topology(devices_per_node=1, intra_node=Fabric(100.0), nics_per_node=1, nic=Fabric(1.0),
                        inter_node_latency=0.0)
    costs = ClusterCosts(forward=0.01, backward=0.02, weight_bytes=1.0, prefetch_depth=1, topology=topology)
    whole = unisched.simulate(W, S, B, fsdp(False), costs=costs)
    sharded = unisched.simulate(W, S, B, fsdp(True), costs=costs)
    assert sharded.latency < 0.6 * whole.latency
    t = sharded.timeline
    tr = t.transfers
    first = kind(t, "weights") & (tr.stage == 0)
    # stage 0 gathered by every worker at once: done after (W-1)/W of it crossed each NIC, the ring's bandwidth term
    gathered = float(tr.end[first].max() - tr.start[first].min())
    assert gathered == pytest.approx(float(unisched.network.all_gather_time(costs, list(range(W)), 1.0)))


def test_replicated_shards_all_reduce_per_shard():
    """Two groups of two, each holding every stage in two shards (hybrid
    sharding): shard i is held twice, and its gradient all-reduced between
    its two holders."""
    groups = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    strategy = unisched.as_strategy(lambda w: unisched.ComputeAndWeightWorkers(w.batch, w.batch)).with_(
        weight_shards=lambda stage, weight: groups[weight])
    topology = Topology(devices_per_node=1, intra_node=Fabric(100.0), nics_per_node=1, nic=Fabric(1.0),
                        inter_node_latency=0.0)
    costs = ClusterCosts(weight_bytes=2.0, topology=topology)
    t = unisched.simulate(W, S, B, strategy, costs=costs).timeline
    tr = t.transfers
    fetch = kind(t, "weights")
    assert set(zip(tr.src[fetch].tolist(), tr.dst[fetch].tolist())) == {(0, 1), (1, 0), (2, 3), (3, 2)}
    ring = kind(t, "allreduce")
    assert set(zip(tr.src[ring].tolist(), tr.dst[ring].tolist())) == {(0, 2), (2, 0), (1, 3), (3, 1)}
    # one ring per shard of each stage, each hop carrying 2(n-1)/n of a shard (n = 2 holders)
    assert np.allclose(tr.nbytes[ring], 2.0 / 2) and ring.sum() == S * 2 * 2
    assert [c.peak for c in t.memory("weights")] == [4.0] * W


def test_a_replay_keeps_the_shards():
    costs = Costs(weight_bytes=8.0, activation_bytes=1.0, bandwidth=2.0)
    t = unisched.simulate(W, S, B, fsdp(True), costs=costs).timeline
    replay = unisched.simulate(W, S, B, t.as_strategy(), costs=costs).timeline
    assert replay.weight_shards == t.weight_shards
    rows = [t.index()[work] for work in map(replay.work, range(len(replay)))]
    assert np.array_equal(replay.start, t.start[rows]) and np.array_equal(replay.end, t.end[rows])
    assert sorted(replay.transfers) == sorted(t.transfers)


@pytest.mark.parametrize("shards, message", [
    (lambda s, w: (1, 2), "leaves out the weight worker"),
    (lambda s, w: (w, w), "distinct worker ids"),
    (lambda s, w: (w, 9), "numbered 0..3"),
    (lambda s, w: "ab", "give a sequence of worker ids"),
    (lambda s, w: (0, 1) if w < 2 else None, "shards of one size"),
    (lambda s, w: (w, 1 - w) if w < 2 else (w, 5 - w), "holding shard 0 for weight worker 1 but shard 1"),
])
def test_bad_shards_are_refused_by_name(shards, message):
    strategy = unisched.as_strategy(lambda w: unisched.ComputeAndWeightWorkers(w.batch, w.batch), name="mine").with_(
        weight_shards=shards)
    with pytest.raises(StrategyError, match=message) as caught:
        unisched.simulate(W, S, B, strategy)
    assert "'mine'" in str(caught.value)


def test_a_gang_item_of_a_sharded_stage_is_refused():
    strategy = fsdp(True).with_(gang=lambda w: Gang((w.batch, (w.batch + 1) % W)))
    with pytest.raises(StrategyError, match="held in shards"):
        unisched.simulate(W, S, B, strategy)


def test_the_runtime_refuses_shards_by_name():
    t = unisched.simulate(W, S, B, fsdp(True)).timeline
    with pytest.raises(ProgramError, match="shards.*shard=false"):
        compile_program(t)
    compile_program(unisched.simulate(W, S, B, fsdp(False)).timeline)  # whole stages run


def test_too_many_shards_to_gather_is_refused_before_the_run(monkeypatch):
    from unisched.errors import ShapeError
    from unisched.simulate import simulation

    monkeypatch.setattr(simulation, "MAX_ITEMS", 1000)
    with pytest.raises(ShapeError, match="16,384 shards.*fewer workers"):
        unisched.simulate(32, 8, 32, policies.get("fsdp", num_workers=32, num_stages=8, num_batches=32, shard=True))


def test_the_planner_refuses_shards_by_name(capsys):
    """Plans know whole stages on one weight worker: a sharded strategy is
    refused, not planned as if its stages were whole."""
    from unisched.cli import main
    from unisched.plan import plan

    for search in ("cpsat", "heuristic"):
        with pytest.raises(unisched.UniSchedError, match="cannot plan strategy 'fsdp\\(shard=true\\)'.*in shards"):
            plan(W, S, B, strategy="fsdp(shard=true)", time_limit=2, search=search)
    assert main(["plan", "-W", "4", "-S", "4", "-B", "4", "--strategy", "fsdp", "--param", "shard=true"]) == 2
    assert "holds weights in shards" in capsys.readouterr().err


def test_torch_csv_refuses_shards():
    from unisched.policies.torch_interop import TorchCSVError, to_torch_csv

    gpipe = policies.get("gpipe", num_workers=2, num_stages=2, num_batches=2)
    sharded = gpipe.with_(weight_shards=lambda stage, weight: (weight, 1 - weight) if weight == 0 else (0, 1))
    with pytest.raises(TorchCSVError, match="stage 0's in shards on workers \\[0, 1\\]"):
        to_torch_csv(unisched.simulate(2, 2, 2, sharded))
    to_torch_csv(unisched.simulate(2, 2, 2, gpipe))


def test_layouts_carry_shards_into_every_replica_and_refuse_gangs():
    from unisched.simulate.layout import replicated, tensor_parallel

    pair = policies.get("fsdp", num_workers=2, num_stages=2, num_batches=2, shard=True)
    costs = ClusterCosts(weight_bytes=2.0, topology="dgx_h100")
    t = unisched.simulate(4, 2, 4, replicated(pair, 2), costs=costs).timeline
    tr = t.transfers
    assert set(zip(tr.src[kind(t, "weights")].tolist(), tr.dst[kind(t, "weights")].tolist())) == {
        (0, 1), (1, 0), (2, 3), (3, 2)}
    assert set(zip(tr.src[kind(t, "allreduce")].tolist(), tr.dst[kind(t, "allreduce")].tolist())) == {
        (0, 2), (2, 0), (1, 3), (3, 1)}
    with pytest.raises(StrategyError, match="in shards.*TP 2"):
        tensor_parallel(pair, 2)
