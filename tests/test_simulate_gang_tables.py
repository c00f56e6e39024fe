"""The gang tables a Problem is built with (what each gang item's first
member hands out and collects, the weights each member computes with) are,
item by item, what the dataflow's rules give when applied to that item
alone: the per-item reading the tables are computed in bulk from."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import unisched
from unisched import Costs, dataflow
from unisched.errors import StrategyError
from unisched.simulate.priorities import OldestBatchFirst
from unisched.simulate.layout import replicated, tensor_parallel
from unisched.simulate.problem import build
from unisched.strategy import Gang
from unisched.work import Direction, Shape, as_stage_graph


def random_gangs(rng, W: int, S: int, B: int, split: bool):
    """Random workers per item, and per item a random gang holding its
    compute worker (tensor-parallel or sharing rows), of one size per stage
    (a stage's shards are alike): a (worker, stage) computes with different
    gangs in different micro-batches."""
    table = {}
    sizes = rng.integers(1, W + 1, S)
    for work in unisched.all_work(S, B, split_backward=split):
        compute = int(rng.integers(W))
        size = int(sizes[work.stage])
        others = [o for o in range(W) if o != compute]
        members = [compute, *rng.choice(others, size - 1, replace=False).tolist()] if size > 1 else [compute]
        table[work] = (compute, int(rng.integers(W)), tuple(rng.permutation(members).tolist()),
                       bool(rng.integers(2)))
    strategy = unisched.as_strategy(lambda work: unisched.ComputeAndWeightWorkers(*table[work][:2]))
    return strategy.with_(gang=lambda work: Gang(table[work][2], table[work][3]))


def per_item(p, costs, S):
    """The gang moves and weights of every gang item, the dataflow's rules applied to each item alone."""
    act = costs.per_stage("activation_bytes", S)
    sizes = {"input": dataflow.input_bytes(act, p.stage_graph), "output": dataflow.output_bytes(act, p.stage_graph)}
    weight_bytes = costs.per_stage("weight_bytes", S)
    tensor_parallel = {}
    for item in np.flatnonzero(p.gang >= 0).tolist():
        if p.gang_collective[p.gang[item]]:
            tensor_parallel[(int(p.worker_array[item]), int(p.stage[item]))] = p.gang_members[p.gang[item]]
    moves, weights = {}, {}
    for item in np.flatnonzero(p.gang >= 0).tolist():
        members, collective, s = p.gang_members[p.gang[item]], p.gang_collective[p.gang[item]], int(p.stage[item])
        planned = dataflow.gang_moves(Direction(int(p.direction[item])), members, collective)
        moved = [(m, float(sizes[m.data][s] * m.share)) for m in planned]
        moves[item] = tuple(tuple((m.kind, m.src, m.dst, nbytes) for m, nbytes in moved
                                  if m.after is after and nbytes > 0) for after in (False, True))
        holder_gang = tensor_parallel.get((int(p.weight_worker_array[item]), s)) if collective else None
        links = dataflow.gang_weights(members, collective, int(p.weight_worker_array[item]), holder_gang)
        weights[item] = tuple((member, holder, share, float(weight_bytes[s] * fraction))
                              for member, holder, share, fraction in links)
    return moves, weights


@settings(max_examples=60, deadline=None)
@given(W=st.integers(1, 5), S=st.integers(1, 4), B=st.integers(1, 6), split=st.booleans(), seed=st.integers(0, 2**31))
def test_gang_tables_are_the_rules_applied_per_item(W, S, B, split, seed):
    rng = np.random.default_rng(seed)
    strategy = random_gangs(rng, W, S, B, split)
    costs = Costs(forward=list(rng.choice([0.5, 1.0], S)), backward=2.0,
                  activation_bytes=list(rng.choice([0.0, 1.0, 3.0], S)),
                  weight_bytes=list(rng.choice([0.0, 1.0, 4.0], S)), bandwidth=1.0)
    p = build(Shape(W, S, B), strategy, OldestBatchFirst(S, B), costs, None, split, as_stage_graph(S, None))
    moves, weights = per_item(p, costs, S)
    assert p.gang_moves == moves
    assert p.weight_shares == weights
    for item, links in weights.items():  # the weight links list each gang item's members in that order
        rows = np.flatnonzero(p.weight_links[0] == item)
        assert [tuple(column[rows].tolist()) for column in p.weight_links[1:]] == [tuple(c) for c in zip(*links)]


def test_a_gang_without_its_compute_worker_is_named():
    """The first item whose gang leaves out its compute worker is named, even
    when the same gang was accepted for an item it holds."""
    strategy = unisched.as_strategy(lambda w: unisched.ComputeAndWeightWorkers(w.batch % 2, 0))
    strategy = strategy.with_(gang=lambda w: (0, 2))
    with pytest.raises(StrategyError, match=r"Work\(batch=1, stage=0.*gang \[0, 2\].*compute worker 1"):
        build(Shape(3, 1, 2), strategy, OldestBatchFirst(1, 2), Costs(), None, False, as_stage_graph(1, None))


def test_a_bad_gang_worker_is_named_once_per_answer_type():
    """An answer equal to an accepted one but of other types (a bool for a
    worker) is still checked."""
    strategy = unisched.as_strategy(lambda w: unisched.ComputeAndWeightWorkers(1, 1))
    strategy = strategy.with_(gang=lambda w: (1, 2) if w.batch == 0 else (True, 2))
    with pytest.raises(StrategyError, match=r"gang worker True \(bool\)"):
        build(Shape(3, 1, 2), strategy, OldestBatchFirst(1, 2), Costs(), None, False, as_stage_graph(1, None))


@pytest.mark.parametrize("holders, gang_of_batch_1", [((0, 1), (2, 3, 4)), ((0, 1, 2), (3, 4))])
def test_a_gang_whose_shards_its_weight_holders_do_not_hold_is_named(holders, gang_of_batch_1):
    """A tensor-parallel gang of 3 whose weight worker computes the stage in
    a gang of 2 (the third shard has no holder), or of 2 whose holders hold
    thirds of the stage, not halves: the error names the item and both gangs."""
    def gang(work):
        return holders if work.batch == 0 else gang_of_batch_1

    strategy = unisched.as_strategy(lambda w: unisched.ComputeAndWeightWorkers(0 if w.batch == 0 else gang_of_batch_1[0], 0))
    strategy = strategy.with_(gang=gang)
    pattern = (r"Work\(batch=1.*" + re.escape(f"gang {list(gang_of_batch_1)} ({len(gang_of_batch_1)} shards)")
               + f".*weight worker 0 holds the stage in {len(holders)} shards")
    with pytest.raises(StrategyError, match=pattern):
        build(Shape(5, 1, 2), strategy, OldestBatchFirst(1, 2), Costs(), None, False, as_stage_graph(1, None))


@pytest.mark.parametrize("name, W, S, B, T, D", [("one_f_one_b", 4, 4, 8, 2, 1), ("interleaved", 2, 4, 4, 4, 1),
                                                 ("zb_h1", 3, 3, 4, 2, 1), ("fsdp", 4, 2, 4, 2, 1),
                                                 ("one_f_one_b", 2, 2, 4, 2, 3)])
def test_gangs_from_arrays_are_the_per_item_gangs(name, W, S, B, T, D):
    """A tensor-parallel layout's ``gang_arrays`` (of D replicas) gives the
    gangs (numbered alike) that calling its ``gang`` per item gives."""
    strategy = tensor_parallel(unisched.policies.get(name, num_workers=W, num_stages=S, num_batches=B), T)
    if D > 1:
        strategy = replicated(strategy, D)
    assert strategy.gang_arrays is not None
    shape = Shape(W * T * D, S, B * D)
    priority = strategy.priority or OldestBatchFirst(S, B * D)
    split = strategy.split_backward
    on_arrays = build(shape, strategy, priority, Costs(), None, split, as_stage_graph(S, None))
    per_item = build(shape, strategy.with_(gang_arrays=None), priority, Costs(), None, split, as_stage_graph(S, None))
    assert np.array_equal(on_arrays.gang, per_item.gang) and (on_arrays.gang >= 0).all()
    assert on_arrays.gang_members == per_item.gang_members
    assert on_arrays.gang_collective == per_item.gang_collective


def test_gang_arrays_that_disagree_with_gang_are_named():
    strategy = tensor_parallel(unisched.policies.get("gpipe", num_workers=2, num_stages=2, num_batches=4), 2)
    wrong = strategy.with_(gang_arrays=lambda b, s, d: (np.zeros(len(b), np.int64), ((0, 1),), (True,)))
    with pytest.raises(StrategyError, match="gang_arrays gives Work.*gang gives"):
        build(Shape(4, 2, 4), wrong, OldestBatchFirst(2, 4), Costs(), None, False, as_stage_graph(2, None))


def test_a_new_gang_drops_the_old_gangs_arrays():
    """``with_(gang=...)`` without new arrays: the old ``gang_arrays`` would
    disagree with it, so they go (the mapping's ``map_arrays`` likewise)."""
    strategy = tensor_parallel(unisched.policies.get("gpipe", num_workers=2, num_stages=2, num_batches=4), 2)
    sharing = strategy.with_(gang=lambda w: Gang(strategy.gang(w).workers, False))
    assert sharing.gang_arrays is None and sharing.map_arrays is not None
    assert strategy.with_(mapping=strategy.mapping).map_arrays is None
    problem = build(Shape(4, 2, 4), sharing, OldestBatchFirst(2, 4), Costs(), None, False, as_stage_graph(2, None))
    assert problem.gang_collective == (False, False)


def _some_gangs(batch, stage, direction):
    """Micro-batch 0 on gang (0, 1), micro-batch 1 on one worker, the rest on
    gang (2, 3), given twice over (two answers naming one gang), as numpy integers."""
    members = (tuple(np.int64(w) for w in (0, 1)), (2, 3), (3, 2))
    index = np.where(batch == 0, 0, np.where(batch == 1, -1, 1 + batch % 2))
    return index, members, (True, True, True)


def _some_gang(work):
    return None if work.batch == 1 else (0, 1) if work.batch == 0 else (2, 3) if work.batch % 2 == 0 else [3, 2]


def _some_mapping(work):
    worker = 0 if work.batch == 0 else 1 if work.batch == 1 else 2
    return unisched.ComputeAndWeightWorkers(worker, worker)


def test_gang_arrays_with_single_workers_and_repeated_gangs_are_the_per_item_gangs():
    strategy = unisched.as_strategy(_some_mapping).with_(gang=_some_gang, gang_arrays=_some_gangs)
    shape, order = Shape(4, 1, 6), OldestBatchFirst(1, 6)
    on_arrays = build(shape, strategy, order, Costs(), None, False, as_stage_graph(1, None))
    per_item = build(shape, strategy.with_(gang_arrays=None), order, Costs(), None, False, as_stage_graph(1, None))
    assert on_arrays.gang.tolist() == per_item.gang.tolist() == [0, 0, -1, -1, 1, 1, 1, 1, 1, 1, 1, 1]
    assert on_arrays.gang_members == per_item.gang_members == ((0, 1), (2, 3))


def test_gang_arrays_that_leave_out_the_compute_worker_are_named():
    strategy = unisched.as_strategy(lambda w: unisched.ComputeAndWeightWorkers(3, 3)).with_(
        gang=lambda w: (0, 1), gang_arrays=lambda b, s, d: (np.zeros(len(b), np.int64), ((0, 1),), (True,)))
    for gangs in (strategy, strategy.with_(gang_arrays=None)):
        with pytest.raises(StrategyError, match=r"puts Work\(batch=0.* on the gang \[0, 1\], which must hold its "
                                                r"compute worker 3"):
            build(Shape(4, 1, 2), gangs, OldestBatchFirst(1, 2), Costs(), None, False, as_stage_graph(1, None))


def test_gang_arrays_agree_with_a_gang_of_one_worker_or_its_workers_in_another_order():
    """``gang`` may name one worker (no gang) where ``gang_arrays`` gives -1,
    or the same workers in another order: they mean the same gangs."""
    def gang(work):
        return (work.batch % 2,) if work.batch < 2 else (3, 2)

    def gang_arrays(batch, stage, direction):
        return np.where(batch < 2, -1, 0), ((2, 3),), (True,)

    strategy = unisched.as_strategy(lambda w: unisched.ComputeAndWeightWorkers(
        w.batch % 2 if w.batch < 2 else 2, 0)).with_(gang=gang, gang_arrays=gang_arrays)
    shape, order = Shape(4, 1, 4), OldestBatchFirst(1, 4)
    on_arrays = build(shape, strategy, order, Costs(), None, False, as_stage_graph(1, None))
    per_item = build(shape, strategy.with_(gang_arrays=None), order, Costs(), None, False, as_stage_graph(1, None))
    assert on_arrays.gang.tolist() == per_item.gang.tolist() == [-1] * 4 + [0] * 4
    assert on_arrays.gang_members == per_item.gang_members == ((2, 3),)
