"""The compiled greedy (unisched.simulate.fast) against the engine on
networks: random strategies, with and without gangs (tensor-parallel or
sharing rows), over random small topologies (several nodes, NICs shared by
devices, oversubscribed switches, replicas) and over links between pairs of
workers.  Timelines and every transfer booked, the end-of-step all-reduces
(of tied weights too) included, are identical item for item; simulate() takes the compiled path."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_simulate_compiled import RandomPriority, assert_same, both_runs, diamond_or_chain, random_mapping

import unisched
from unisched import Costs
from unisched.simulate import engine, fast
from unisched.simulate.layout import tensor_parallel
from unisched.simulate.priorities import BUILTIN_PRIORITIES
from unisched.simulate.problem import build
from unisched.strategy import Gang
from unisched.timeline import TRANSFER_KINDS
from unisched.topology import ClusterCosts, Fabric, Topology
from unisched.work import Shape, as_stage_graph

pytestmark = pytest.mark.skipif(fast.compiled_schedule() is None, reason="numba is not installed")


def random_topology(rng, devices: int) -> Topology:
    """A small cluster of ``devices``: nodes of 1, 2 or 4 devices, one NIC
    per node or one per device, switches of one or two nodes, maybe
    oversubscribed, all-reduces as rings or trees."""
    per_node = int(rng.choice([1, 2, 4]))
    if devices % per_node and devices > per_node:
        per_node = 1
    return Topology(
        devices_per_node=per_node,
        intra_node=Fabric(float(rng.choice([4.0, 16.0])), float(rng.choice([0.0, 0.05]))),
        nics_per_node=int(rng.choice([1, per_node])),
        nic=Fabric(float(rng.choice([0.5, 2.0]))),
        inter_node_latency=float(rng.choice([0.0, 0.25])),
        oversubscription=float(rng.choice([1.0, 3.0])),
        nodes_per_switch=[None, 1, 2][int(rng.integers(3))],
        collective=str(rng.choice(["ring", "tree"])),
    )


def network_costs(rng, W: int, S: int, topology: bool, replicas: int):
    """Random per-stage times and sizes, weights fetched with or without
    prefetch and caching, on a random topology or on links between pairs."""
    values = dict(
        forward=list(rng.choice([0.5, 1.0, 1.25], S)),
        backward=list(rng.choice([1.0, 2.0], S)),
        activation_bytes=list(rng.choice([0.5, 1.0, 3.0], S)),
        weight_bytes=list(rng.choice([0.0, 1.0, 4.0], S)),
        prefetch_depth=int(rng.integers(0, 3)),
        cache_weights=bool(rng.integers(2)),
        input_grad_frees=float(rng.choice([0.5, 1.0])),
        tied_weights=[(sorted(rng.choice(S, 2, replace=False).tolist()), float(rng.choice([1.0, 4.0])))]
        if S > 1 and rng.integers(2) else [],
    )
    if not topology:
        links = {(0, W - 1): unisched.Link(0.5, 1.0)} if W > 1 else {}
        return Costs(bandwidth=float(rng.choice([0.5, 2.0])), latency=float(rng.choice([0.0, 0.25])), links=links,
                     **values)
    tensor_bytes = list(rng.choice([0.5, 2.0], S)) if rng.integers(2) else None
    return ClusterCosts(topology=random_topology(rng, W * replicas), replicas=replicas,
                        tensor_parallel_bytes=tensor_bytes, **values)


def with_gangs(rng, W: int, S: int, B: int, split: bool, kind: str):
    """A random mapping whose items run on gangs: tensor-parallel ones (a
    collective), ones that share the rows (hand out and collect), or both,
    stage by stage."""
    strategy = random_mapping(rng, W, S, B, split, gangs=kind != "none")
    if kind == "none":
        return strategy
    collective = {"tensor": [True] * S, "rows": [False] * S, "mixed": list(rng.integers(2, size=S) == 1)}[kind]
    groups = strategy.gang
    return strategy.with_(gang=lambda work: Gang(groups(work), bool(collective[work.stage])))


def with_shards(rng, strategy, W: int, S: int):
    """``strategy`` with some stages held in shards (``weight_shards``): per
    such stage one size k and each worker's slice (a random position, every
    one taken), each weight worker's group of k holders one worker per
    slice, itself among them; so groups of one stage may overlap
    (replicated shards, all-reduced)."""
    sizes = {s: int(rng.integers(2, W + 1)) for s in range(S) if W > 1 and rng.integers(2)}
    groups = {}
    for s, k in sizes.items():
        slice_of = rng.permutation(np.concatenate([np.arange(k), rng.integers(0, k, W - k)]))
        for w in range(W):
            group = [int(rng.choice(np.flatnonzero(slice_of == i))) for i in range(k)]
            group[slice_of[w]] = w
            groups[(s, w)] = tuple(group)
    return strategy.with_(weight_shards=lambda stage, weight: groups.get((stage, weight)))


@settings(max_examples=150, deadline=None)
@given(
    W=st.integers(1, 4),
    S=st.integers(1, 4),
    B=st.integers(1, 5),
    split=st.booleans(),
    diamond=st.booleans(),
    priority=st.sampled_from([*BUILTIN_PRIORITIES, "random"]),
    limit=st.sampled_from([None, None, 2.0, 4.0]),
    topology=st.booleans(),
    replicas=st.sampled_from([1, 1, 2]),
    gangs=st.sampled_from(["none", "tensor", "rows", "mixed", "shards"]),
    seed=st.integers(0, 2**31),
)
def test_random_strategies_on_networks_same_timeline(W, S, B, split, diamond, priority, limit, topology, replicas,
                                                     gangs, seed):
    """Every item's start and end and every transfer row (fetches,
    hand-outs, collects, returns, moves, and on a topology the all-reduces
    booked at the end) are the engine's, or both deadlock; with gangs, or
    with stages held in shards."""
    rng = np.random.default_rng(seed)
    costs = network_costs(rng, W, S, topology, replicas)
    if gangs == "shards":
        strategy = with_shards(rng, random_mapping(rng, W, S, B, split), W, S)
    else:
        strategy = with_gangs(rng, W, S, B, split, gangs)
    order = RandomPriority(rng) if priority == "random" else BUILTIN_PRIORITIES[priority](S, B)
    limit = None if limit is None else 3.0 * limit  # bytes: at least one stash of the largest stage
    expected, got = both_runs(Shape(W, S, B), strategy, order, costs, limit, split, diamond_or_chain(S, diamond),
                              True)
    assert_same(expected, got)


@pytest.mark.parametrize("name, topology, W, S, B, replicas, tensor", [
    ("one_f_one_b", "dgx_h100", 16, 16, 8, 1, 1),
    ("zb_h1", "p4d_24xlarge", 16, 16, 8, 2, 1),
    ("fsdp", "dgx_a100", 16, 4, 16, 1, 1),
    ("interleaved", "dgx_h100", 4, 8, 8, 2, 4),
    ("gpipe", "p4d_24xlarge", 4, 4, 8, 1, 2),
])
def test_named_strategies_on_presets_same_timeline(name, topology, W, S, B, replicas, tensor):
    """Named strategies on the preset clusters, replicated and lifted to
    tensor-parallel gangs (a 3D layout's strategy)."""
    strategy = unisched.policies.get(name, num_workers=W, num_stages=S, num_batches=B)
    priority = strategy.priority or BUILTIN_PRIORITIES["oldest_batch_first"](S, B)
    if tensor > 1:
        strategy = tensor_parallel(strategy, tensor)
        W *= tensor
    costs = ClusterCosts(forward=[1e-3] * S, backward=[2e-3] * S, activation_bytes=2e7, weight_bytes=4e8,
                         prefetch_depth=1, topology=topology, replicas=replicas)
    expected, got = both_runs(Shape(W, S, B), strategy, priority, costs, strategy.memory_limit,
                              strategy.split_backward, as_stage_graph(S, None), False)
    assert_same(expected, got)
    assert (got[2].kind == TRANSFER_KINDS.index("allreduce")).any() == (replicas > 1)  # one holder per stage otherwise


def test_simulate_takes_the_compiled_path_on_a_topology(monkeypatch):
    """At a size the compiled greedy runs, simulate() on a cluster with
    tensor-parallel gangs never calls the engine, and its timeline and
    transfers, the all-reduces included, are the engine's."""
    S, T = 4, 2
    B = fast.COMPILED_FROM // (2 * S) + 1
    strategy = tensor_parallel(unisched.policies.get("one_f_one_b", num_workers=S, num_stages=S, num_batches=B), T)
    costs = ClusterCosts(forward=1e-3, backward=2e-3, activation_bytes=2e7, weight_bytes=4e8, topology="dgx_h100",
                         replicas=2)
    p = build(Shape(S * T, S, B), strategy, strategy.priority or BUILTIN_PRIORITIES["oldest_batch_first"](S, B), costs,
              None, False, as_stage_graph(S, None), False)
    start, end, rows = engine.run(p)
    assert p.num_items >= fast.COMPILED_FROM

    def refuse(problem):
        raise AssertionError("the engine ran a step the compiled greedy covers")

    monkeypatch.setattr(engine, "run", refuse)
    t = unisched.simulate(S * T, S, B, strategy, costs=costs).timeline
    index = t.index()
    rows_of = np.array([index[p.work(i)] for i in range(p.num_items)])
    assert np.array_equal(t.start[rows_of], start) and np.array_equal(t.end[rows_of], end)
    got = t.transfers
    assert sorted(zip(rows.src.tolist(), rows.dst.tolist(), rows.start.tolist(), rows.end.tolist(),
                      rows.nbytes.tolist())) == sorted(zip(
        got.src.tolist(), got.dst.tolist(), got.start.tolist(), got.end.tolist(), got.nbytes.tolist()))


@pytest.mark.parametrize("topology, gangs", [("dgx_h100", "tensor"), ("p4d_24xlarge", "rows"), (None, "mixed")])
def test_simulate_gives_the_engines_transfer_table(monkeypatch, topology, gangs):
    """The Timeline's transfers from the compiled greedy's columns are the
    engine's rows, column for column and in the same order: kinds, workers,
    times, bytes, and the item each serves (-1 for an all-reduce)."""
    rng = np.random.default_rng(7)
    W, S = 4, 4
    B = fast.COMPILED_FROM // (2 * S) + 1
    strategy = with_gangs(rng, W, S, B, False, gangs)
    costs = network_costs(rng, W, S, False, 1) if topology is None else ClusterCosts(
        forward=1e-3, backward=2e-3, activation_bytes=2e7, weight_bytes=4e8, prefetch_depth=1, topology=topology,
        replicas=2)
    run = engine.run

    def refuse(problem):
        raise AssertionError("the engine ran a step the compiled greedy covers")

    monkeypatch.setattr(engine, "run", refuse)
    compiled = unisched.simulate(W, S, B, strategy, costs=costs).timeline.transfers
    monkeypatch.setattr(engine, "run", run)
    monkeypatch.setattr(fast, "COMPILED_FROM", 10 * B * S)  # the engine runs it
    expected = unisched.simulate(W, S, B, strategy, costs=costs).timeline.transfers
    assert len(expected) > 0
    for column in ("kind", "src", "dst", "start", "end", "nbytes", "batch", "stage", "direction"):
        assert getattr(compiled, column).dtype == getattr(expected, column).dtype, column
        assert np.array_equal(getattr(compiled, column), getattr(expected, column)), column
