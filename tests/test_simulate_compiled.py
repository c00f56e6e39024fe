"""The compiled greedy (unisched.simulate.fast) against the engine it mirrors:
identical timelines, item for item, for random shapes, mappings, priorities,
costs, memory limits, split backwards, stage graphs and fixed orders; the
same deadlocks; and simulate() taking the compiled path where it applies."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import unisched
from unisched import ComputeAndWeightWorkers, Costs, DeadlockError
from unisched.simulate import engine, fast
from unisched.simulate.priorities import BUILTIN_PRIORITIES
from unisched.simulate.problem import build
from unisched.strategy import WorkerOrders
from unisched.timeline import TRANSFER_KINDS
from unisched.work import Shape, as_stage_graph

pytestmark = pytest.mark.skipif(fast.compiled_schedule() is None, reason="numba is not installed")


def random_mapping(rng, W, S, B, split, gangs=False):
    """Random compute and weight workers per item; with ``gangs``, some
    stages run on groups of one size per stage, the same group for each
    (compute worker, stage)."""
    table = {w: (int(rng.integers(W)), int(rng.integers(W))) for w in unisched.all_work(S, B, split_backward=split)}
    strategy = unisched.as_strategy(lambda work: ComputeAndWeightWorkers(*table[work]))
    if not gangs:
        return strategy
    sizes = rng.integers(1, W + 1, S)
    others = {c: [o for o in range(W) if o != c] for c in range(W)}
    group = {(c, s): tuple(sorted({c, *rng.choice(others[c], sizes[s] - 1, replace=False).tolist()}))
             for c in range(W) for s in range(S)}
    groups = {w: group[(c, w.stage)] for w, (c, _) in table.items()}
    return strategy.with_(gang=lambda work: groups[work])


class RandomPriority:
    """A random total order on work items (no vectorised form)."""

    def __init__(self, rng):
        self.salt = int(rng.integers(1 << 30))

    def __call__(self, work):
        return hash((work.batch, work.stage, int(work.direction), self.salt))


def both_runs(shape, strategy, priority, costs, limit, split, graph, in_bytes):
    """The engine's (start, end) or its DeadlockError, and the compiled greedy's (start, end)."""
    p = build(shape, strategy, priority, costs, limit, split, graph, in_bytes)
    try:
        start, end, rows = engine.run(p)
        expected = (np.asarray(start), np.asarray(end), rows)
    except DeadlockError as error:
        expected = error
    return expected, fast.run(p)


def assert_same(expected, got):
    """Same start and end of every item and the same transfers booked in the
    same order, or, where the engine deadlocks, items left unscheduled."""
    start, end, rows = got
    if isinstance(expected, DeadlockError):
        assert start.min() < 0, "the engine deadlocks, so the compiled greedy must leave items unscheduled"
    else:
        assert np.array_equal(start, expected[0]) and np.array_equal(end, expected[1])
        assert (rows is None) == (expected[2] is None)
        assert rows is None or rows.equals(expected[2])


def diamond_or_chain(S, diamond):
    if not diamond or S < 4:
        return as_stage_graph(S, None)
    graph = nx.DiGraph([(0, 1), (0, 2), (1, 3), (2, 3)])
    graph.add_edges_from((s, s + 1) for s in range(3, S - 1))
    return as_stage_graph(S, graph)


@settings(max_examples=120, deadline=None)
@given(
    W=st.integers(1, 4),
    S=st.integers(1, 5),
    B=st.integers(1, 6),
    split=st.booleans(),
    diamond=st.booleans(),
    priority=st.sampled_from([*BUILTIN_PRIORITIES, "random"]),
    limit=st.one_of(st.none(), st.sampled_from([1.0, 1.5, 2.0, 3.0, 5.0]), st.just("per worker")),
    costs=st.sampled_from(["unit", "per stage", "speeds", "bytes", "links", "weights"]),
    input_grad_frees=st.sampled_from([0.5, 0.25, 1.0]),
    gangs=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_random_strategies_same_timeline(W, S, B, split, diamond, priority, limit, costs, input_grad_frees, gangs,
                                         seed):
    """Every item's start and end and every transfer row are the engine's,
    or both deadlock (gangs with links and weights too: tests/test_simulate_compiled_topology.py
    adds topologies and gangs that share rows)."""
    rng = np.random.default_rng(seed)
    shape = Shape(W, S, B)
    strategy = random_mapping(rng, W, S, B, split, gangs=gangs)
    order = RandomPriority(rng) if priority == "random" else BUILTIN_PRIORITIES[priority](S, B)
    cost_of = {
        "unit": Costs(input_grad_frees=input_grad_frees),
        "per stage": Costs(forward=list(rng.choice([0.5, 1.0, 1.25], S)), backward=list(rng.choice([1.0, 2.0], S)),
                           input_grad_frees=input_grad_frees),
        "speeds": Costs(worker_speed=list(rng.choice([0.5, 1.0, 2.0], W)), input_grad_frees=input_grad_frees),
        "bytes": Costs(activation_bytes=list(rng.choice([1.0, 3.0], S)), input_grad_frees=input_grad_frees),
        "links": Costs(activation_bytes=list(rng.choice([1.0, 3.0], S)), bandwidth=float(rng.choice([0.5, 2.0])),
                       latency=float(rng.choice([0.0, 0.25])), input_grad_frees=input_grad_frees,
                       links={(0, W - 1): unisched.Link(0.5, 1.0)} if W > 1 else {}),
        "weights": Costs(weight_bytes=list(rng.choice([0.0, 1.0, 4.0], S)), activation_bytes=1.0, bandwidth=2.0,
                         prefetch_depth=int(rng.integers(0, 3)), cache_weights=bool(rng.integers(2)),
                         input_grad_frees=input_grad_frees),
    }[costs]
    if limit == "per worker":
        limit = list(rng.choice([2.0, 3.0, 4.0], W))
    in_bytes = cost_of.has_sizes
    if limit is not None and in_bytes:
        limit = np.asarray(limit) * 3.0
    if limit is not None and np.min(limit) < (3.0 if in_bytes else 1.0):
        limit = None  # a limit below one stash is refused before simulating (test_bad_input)
    expected, got = both_runs(shape, strategy, order, cost_of, limit, split, diamond_or_chain(S, diamond), in_bytes)
    assert_same(expected, got)


@settings(max_examples=50, deadline=None)
@given(
    W=st.integers(1, 4),
    S=st.integers(1, 4),
    B=st.integers(1, 6),
    split=st.booleans(),
    limit=st.one_of(st.none(), st.sampled_from([1.0, 2.0, 3.0])),
    released=st.booleans(),
    links=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_fixed_orders_same_timeline(W, S, B, split, limit, released, links, seed):
    """A replayed schedule (fixed orders) under other durations and a limit,
    which may deadlock, with or without transfers that take time and some
    items released late (a plan's "not before" times): both agree, and no
    item starts before its release."""
    rng = np.random.default_rng(seed)
    first = unisched.simulate(W, S, B, random_mapping(rng, W, S, B, split), split_backward=split)
    replay = first.timeline.as_strategy()
    release = np.zeros(len(first.timeline))
    if released:
        release = np.where(rng.random(len(release)) < 0.3, rng.choice([0.5, 2.0, 7.0], len(release)), 0.0)
        replay = replay.with_(release=release)
    on_links = {"activation_bytes": 1.0, "latency": 0.25, "bandwidth": 2.0} if links else {}
    costs = Costs(forward=list(rng.choice([0.5, 1.0, 2.0], S)), backward=list(rng.choice([1.0, 3.0], S)), **on_links)
    expected, got = both_runs(Shape(W, S, B), replay, BUILTIN_PRIORITIES["backward_first"](S, B), costs, limit,
                              split, as_stage_graph(S, None), None)
    assert_same(expected, got)
    if not isinstance(expected, DeadlockError):
        assert np.all(got[0] >= release)


@pytest.mark.parametrize("name, W, S, B", [
    ("one_f_one_b", 8, 8, 8), ("zb_h1", 8, 8, 8), ("zb_h2", 8, 8, 8), ("interleaved", 4, 8, 8), ("zbv", 4, 8, 8),
    ("dualpipe_v", 4, 8, 8), ("gpipe", 8, 8, 8), ("fsdp", 8, 4, 8), ("looped", 4, 8, 8),
])
def test_named_strategies_same_timeline(name, W, S, B):
    strategy = unisched.policies.get(name, num_workers=W, num_stages=S, num_batches=B)
    priority = strategy.priority or BUILTIN_PRIORITIES["oldest_batch_first"](S, B)
    expected, got = both_runs(Shape(W, S, B), strategy, priority, Costs(), strategy.memory_limit,
                              strategy.split_backward, as_stage_graph(S, None), False)
    assert not isinstance(expected, DeadlockError)
    assert_same(expected, got)


FIXED_ORDER_NAMES = ("one_f_one_b", "interleaved", "zb_h1", "zb_h2", "zbv", "dualpipe_v", "ScheduleGPipe",
                     "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
                     "ScheduleZBVZeroBubble", "ScheduleDualPipeV")


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(FIXED_ORDER_NAMES),
    W=st.integers(1, 4),
    rounds=st.integers(1, 2),
    communication=st.booleans(),
    other_backward=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_array_orders_and_work_lists_give_the_same_timeline(name, W, rounds, communication, other_backward, seed):
    """A named schedule's orders, built as arrays of item ids, give the
    timeline (and transfers) that the same orders written as lists of Work
    give, on both engines, under random per-stage costs and in either
    backward form."""
    S = {"interleaved": 2 * W, "zbv": 2 * W, "dualpipe_v": 2 * W, "ScheduleInterleaved1F1B": 2 * W,
         "ScheduleLoopedBFS": 2 * W, "ScheduleInterleavedZeroBubble": 2 * W, "ScheduleZBVZeroBubble": 2 * W,
         "ScheduleDualPipeV": 2 * W}.get(name, W)
    B = max(S, 2 * W) * rounds
    strategy = unisched.policies.get(name, num_workers=W, num_stages=S, num_batches=B)
    assert isinstance(strategy.worker_orders, WorkerOrders)
    as_lists = strategy.with_(worker_orders={w: list(order) for w, order in strategy.worker_orders.items()})
    rng = np.random.default_rng(seed)
    costs = Costs(forward=list(rng.choice([0.5, 1.0, 2.0], S)), backward=list(rng.choice([1.0, 3.0], S)),
                  **(dict(activation_bytes=1.0, weight_bytes=2.0, bandwidth=4.0, latency=0.25) if communication else {}))
    split = strategy.split_backward != other_backward
    arrays, lists = (unisched.simulate(W, S, B, s, costs=costs, split_backward=split).timeline
                     for s in (strategy, as_lists))
    assert np.array_equal(arrays.start, lists.start) and np.array_equal(arrays.end, lists.end)
    for column in ("kind", "src", "dst", "start", "end", "nbytes", "batch", "stage", "direction"):
        assert np.array_equal(getattr(arrays.transfers, column), getattr(lists.transfers, column))
    priority = BUILTIN_PRIORITIES["oldest_batch_first"](S, B)
    expected, got = both_runs(Shape(W, S, B), strategy, priority, costs, None, split, as_stage_graph(S, None), False)
    assert_same(expected, got)


@pytest.mark.parametrize("name, costs", [
    ("one_f_one_b", Costs()),
    ("zb_h1", Costs(activation_bytes=1.0, bandwidth=4.0, latency=0.1)),
    ("fsdp", Costs(activation_bytes=1.0, weight_bytes=8.0, bandwidth=4.0, prefetch_depth=2)),
])
def test_simulate_takes_the_compiled_path(monkeypatch, name, costs):
    """At a size the compiled greedy runs, simulate() never calls the engine,
    and its timeline and transfers are the engine's."""
    W = S = 16
    B = 16 if name == "fsdp" else fast.COMPILED_FROM // (2 * S) + 1
    if name == "fsdp":
        S = fast.COMPILED_FROM // (2 * B) + 1
    strategy = unisched.policies.get(name, num_workers=W, num_stages=S, num_batches=B)
    priority = strategy.priority or BUILTIN_PRIORITIES["oldest_batch_first"](S, B)
    p = build(Shape(W, S, B), strategy, priority, costs, strategy.memory_limit, strategy.split_backward,
              as_stage_graph(S, None), False)
    start, end, rows = engine.run(p)
    assert p.num_items >= fast.COMPILED_FROM and (rows is None) == (not costs.has_communication)

    def refuse(problem):
        raise AssertionError("the engine ran a step the compiled greedy covers")

    monkeypatch.setattr(engine, "run", refuse)
    t = unisched.simulate(W, S, B, strategy, costs=costs).timeline
    index = t.index()
    for i in range(p.num_items):
        row = index[p.work(i)]
        assert (t.start[row], t.end[row]) == (start[i], end[i])
    if rows is not None and len(rows.kind):
        booked = sorted(zip(rows.src.tolist(), rows.dst.tolist(), rows.start.tolist(), rows.end.tolist(),
                            rows.nbytes.tolist()))
        got = t.transfers
        kept = got.kind != TRANSFER_KINDS.index("allreduce")
        assert booked == sorted(zip(got.src[kept].tolist(), got.dst[kept].tolist(), got.start[kept].tolist(),
                                    got.end[kept].tolist(), got.nbytes[kept].tolist()))


def test_a_compiled_deadlock_is_explained_by_the_engine():
    """A fixed order that runs every forward first, under a limit of one
    stash: the compiled greedy stops, and the engine names the blocked workers."""
    W = S = 8
    B = fast.COMPILED_FROM // (2 * S) + 1
    fill_drain = unisched.simulate(W, S, B, unisched.policies.get("gpipe", num_workers=W, num_stages=S,
                                                                   num_batches=B, priority="oldest_stage_first"))
    with pytest.raises(DeadlockError, match="wait\\(s\\) for activation memory on worker"):
        unisched.simulate(W, S, B, fill_drain.timeline.as_strategy(), memory_limit=1.0)
