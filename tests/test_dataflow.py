"""The data-flow module: item ids, the per-item rules and their vectorised
form agree, and what each backward frees adds up to the whole stash."""

import networkx as nx
import numpy as np
import pytest

from unisched import dataflow
from unisched.dataflow import EDGE_PRIMARY, EDGE_STASH, Flow, Items
from unisched.errors import ShapeError
from unisched.timeline import TRANSFER_KINDS
from unisched.work import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, StageGraph, Work, as_stage_graph

GRAPHS = {
    "chain": None,
    "two encoders": nx.DiGraph([(0, 2), (1, 2), (2, 3)]),
    "diamond": nx.DiGraph([(0, 1), (0, 2), (1, 3), (2, 3)]),
}


@pytest.mark.parametrize("split", [False, True])
def test_item_ids_number_every_item_once_batch_major(split):
    items = Items(num_stages=3, num_batches=4, split_backward=split)
    works = list(items)
    assert len(works) == items.count == 3 * 4 * (3 if split else 2)
    batch, stage, direction = items.arrays()
    assert [Work(b, s, d) for b, s, d in zip(batch, stage, direction)] == works
    assert list(items.id(batch, stage, direction)) == list(range(items.count))
    assert [items.work(i) for i in range(items.count)] == works
    assert items.id(2, 1, FORWARD) == works.index(Work(2, 1, FORWARD))


def test_item_ids_refuse_a_direction_of_the_other_backward_form():
    with pytest.raises(ShapeError, match="not a pass of this step"):
        Items(2, 2, split_backward=True).id(0, 0, BACKWARD)
    with pytest.raises(ShapeError, match="not a pass of this step"):
        Items(2, 2, split_backward=False).id(0, 0, BACKWARD_WEIGHT)
    with pytest.raises(ShapeError):
        Items(2, 2).id(0, 0, -1)


@pytest.mark.parametrize("name", GRAPHS)
@pytest.mark.parametrize("split", [False, True])
def test_vectorised_edges_are_the_per_item_flows(name, split):
    num_stages = 4
    graph = as_stage_graph(num_stages, GRAPHS[name])
    items = Items(num_stages, 3, split)
    src, dst, kind, moved = dataflow.edges(items, graph)
    stage_of = items.arrays()[1]
    vectorised = {
        (items.work(a), items.work(b), TRANSFER_KINDS[m] if m != dataflow.MOVES_NOTHING else None, int(s))
        for a, b, m, s in zip(src, dst, moved, dataflow.moved_stage(stage_of[src], stage_of[dst], moved))
    }
    per_item = {
        (flow.source, work, flow.kind, flow.stage)
        for work in items
        for flow in dataflow.flows(work, num_stages, split_backward=split, stage_graph=graph)
    }
    assert vectorised == per_item
    # a stash edge (F -> its backward at a stage with successors) is one a gradient from downstream also leads to;
    # every other edge is primary
    for a, b, k in zip(src, dst, kind):
        first, then = items.work(a), items.work(b)
        stash_of_inner_stage = (first.direction == FORWARD and then.stage == first.stage
                                and then.direction != FORWARD and bool(graph.successors[first.stage]))
        assert k == (EDGE_STASH if stash_of_inner_stage else EDGE_PRIMARY), (first, then)


@pytest.mark.parametrize("name", GRAPHS)
@pytest.mark.parametrize("split", [False, True])
def test_depths_put_every_dependency_first_and_are_tight(name, split):
    num_stages = 4
    graph = as_stage_graph(num_stages, GRAPHS[name])
    items = Items(num_stages, 2, split)
    depth = dataflow.depths(items, graph)
    src, dst = dataflow.edges(items, graph)[:2]
    assert np.all(depth[src] < depth[dst])
    # each item with a depth d > 0 has a dependency at depth d - 1 (the longest chain, not any order)
    for item in np.flatnonzero(depth):
        assert depth[item] - 1 in depth[src[dst == item]]
    if name == "chain":  # F of every stage, then B (or I) of every stage, then the last W
        assert depth.max() == 2 * num_stages - 1 + split


def test_flows_of_a_chain_say_what_moves():
    flows = dataflow.flows(Work(5, 1, BACKWARD_INPUT), 3, split_backward=True)
    assert flows == (Flow(Work(5, 2, BACKWARD_INPUT), "gradient", 2), Flow(Work(5, 1, FORWARD), "stash", 1))
    assert dataflow.flows(Work(0, 2, FORWARD), 3) == (Flow(Work(0, 1, FORWARD), "activation", 2),)
    assert dataflow.flows(Work(0, 0, FORWARD), 3) == ()
    assert dataflow.flows(Work(0, 2, BACKWARD), 3) == (Flow(Work(0, 2, FORWARD), "stash", 2),)
    assert dataflow.flows(Work(0, 2, BACKWARD_WEIGHT), 3, split_backward=True) == (
        Flow(Work(0, 2, BACKWARD_INPUT), "stash", 2),
    )


def test_a_stage_with_two_consumers_waits_for_both_gradients():
    graph = StageGraph(4, nx.DiGraph([(0, 1), (0, 2), (1, 3), (2, 3)]))
    deps = dataflow.dependencies(Work(0, 0, BACKWARD), 4, stage_graph=graph)
    assert set(deps) == {Work(0, 1, BACKWARD), Work(0, 2, BACKWARD), Work(0, 0, FORWARD)}
    assert set(dataflow.dependencies(Work(0, 3, FORWARD), 4, stage_graph=graph)) == {
        Work(0, 1, FORWARD), Work(0, 2, FORWARD)}


@pytest.mark.parametrize("split,frees", [(False, 0.5), (True, 0.0), (True, 0.3), (True, 1.0)])
def test_backward_passes_free_the_whole_stash(split, frees):
    shares = dataflow.stash_shares(split, frees)
    expected = {BACKWARD_INPUT: frees, BACKWARD_WEIGHT: 1.0 - frees} if split else {BACKWARD: 1.0}
    assert shares == pytest.approx(expected)
    directions = np.array([FORWARD, BACKWARD_WEIGHT, *expected][: 2 + len(expected)])
    table = dataflow.stash_share_array(directions, split, frees)
    assert list(table) == pytest.approx([0.0, expected.get(BACKWARD_WEIGHT, 0.0), *expected.values()])


def test_weight_traffic_follows_from_the_two_workers():
    direction = np.array([FORWARD, BACKWARD, BACKWARD, BACKWARD_WEIGHT])
    compute = np.array([0, 1, 2, 2])
    weight = np.array([1, 1, 0, 0])
    assert list(dataflow.fetches_weights(compute, weight)) == [True, False, True, True]
    assert list(dataflow.returns_gradient(direction, compute, weight, split_backward=False)) == [False, False, True, False]
    assert list(dataflow.returns_gradient(direction, compute, weight, split_backward=True)) == [False, False, False, True]
    assert dataflow.replicas(np.array([0, 0, 1, 1]), np.array([2, 0, 1, 1]), 3) == [(0, 2), (1,), ()]


def test_a_gang_member_uses_its_shard_or_the_whole_stage_held_where_the_share_rule_says():
    assert dataflow.weight_share((3, 4), True, 4) == 1, "tensor-parallel member i uses shard i"
    assert dataflow.weight_share((3, 4), False, 4) == 0, "a member sharing rows uses the whole stage"
    assert dataflow.share_holder(5, 1, (5, 6)) == 6, "shard i lives on member i of the weight worker's gang"
    assert dataflow.share_holder(5, 0, None) == 5, "a whole stage lives on its weight worker"


def test_a_gang_hands_out_what_an_item_starts_from_and_collects_rows():
    tensor_parallel = dataflow.gang_moves(FORWARD, (3, 4, 5), True)
    assert [(m.kind, m.src, m.dst, m.data, m.share, m.after) for m in tensor_parallel] == [
        ("activation", 3, 4, "input", 1.0, False), ("activation", 3, 5, "input", 1.0, False)
    ]
    rows = dataflow.gang_moves(BACKWARD, (3, 4), False)
    assert [(m.kind, m.src, m.dst, m.data, m.share, m.after) for m in rows] == [
        ("gradient", 3, 4, "output", 0.5, False), ("gradient", 4, 3, "input", 0.5, True)
    ]
    assert dataflow.gang_moves(BACKWARD_WEIGHT, (3, 4), False) == ()
    assert dataflow.gang_weights((3, 4), True, 7, (7, 8)) == ((3, 7, 0, 0.5), (4, 8, 1, 0.5))
    assert dataflow.gang_weights((3, 4), False, 3, None) == ((3, 3, 0, 1.0), (4, 3, 0, 1.0))


def test_a_moved_stash_carries_inputs_except_at_a_source_and_a_gradient_the_weight_pass_lacks():
    graph = as_stage_graph(3, None)
    where = {Work(0, 0, FORWARD): 0, Work(0, 1, FORWARD): 0, Work(0, 2, BACKWARD_INPUT): 2, Work(0, 1, BACKWARD_INPUT): 1}
    assert dataflow.stash_needs(Work(0, 0, BACKWARD), 1, where.get, graph) == (False, False)
    assert dataflow.stash_needs(Work(0, 1, BACKWARD), 1, where.get, graph) == (True, False)
    assert dataflow.stash_needs(Work(0, 1, BACKWARD_WEIGHT), 2, where.get, graph) == (True, False)
    assert dataflow.stash_needs(Work(0, 1, BACKWARD_WEIGHT), 0, where.get, graph) == (False, True)
    assert list(dataflow.input_bytes([5.0, 6.0, 7.0], graph)) == [0.0, 6.0, 7.0]
    assert list(dataflow.output_bytes([5.0, 6.0, 7.0], graph)) == [6.0, 7.0, 7.0]
