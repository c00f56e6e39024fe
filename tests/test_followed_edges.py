"""The dependencies the engines follow (``Problem.data_followed`` and
``next_fixed``, ``num_deps``, ``sources``) are those of a plain stable sort
by source of the dataflow's edges and of the fixed orders (each item to the
next in its worker's order), on every named strategy, random
mappings with random fixed orders, branching stage graphs, and with and
without communication costs."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

import unisched
from unisched import ComputeAndWeightWorkers, Costs
from unisched.dataflow import EDGE_STASH, Items
from unisched.errors import UniSchedError
from unisched.simulate.priorities import BUILTIN_PRIORITIES
from unisched.simulate.problem import build
from unisched.strategy import WorkerOrders
from unisched.work import FORWARD, Shape, as_stage_graph

FREE, LINKS = Costs(), Costs(activation_bytes=1.0, latency=0.25, bandwidth=2.0)


def reference_fixed(strategy, items: Items) -> np.ndarray:
    """(2, F) fixed-order pairs: each item to the next in its worker's order."""
    pairs = []
    for order in (strategy.worker_orders or {}).values():
        ids = [items.id(w.batch, w.stage, int(w.direction)) for w in order]
        pairs += zip(ids[:-1], ids[1:])
    return np.array(pairs, dtype=np.int64).reshape(-1, 2).T


def reference_followed(p, strategy) -> dict[str, np.ndarray]:
    """The readable form: the data edges, stash edges dropped where
    communication is free, stably sorted by source; each item's successor in
    its worker's order; an item's dependencies are both."""
    edges = p.data_edges if p.comm else p.data_edges[:, p.data_edges[2] != EDGE_STASH]
    edges = edges[:, np.argsort(edges[0], kind="stable")]
    src, dst = reference_fixed(strategy, p.items)
    n = p.num_items
    next_fixed = np.full(n, -1, np.int64)
    next_fixed[src] = dst
    num_deps = np.bincount(np.concatenate([edges[1], dst]), minlength=n)
    first = np.flatnonzero((num_deps == 0) & (p.direction == FORWARD))
    return {"data_followed.ptr": np.concatenate([[0], np.cumsum(np.bincount(edges[0], minlength=n))]),
            "data_followed.idx": edges[1], "data_followed.kind": edges[2], "data_followed.moved": edges[3],
            "next_fixed": next_fixed, "num_deps": num_deps, "sources": np.stack([first, n + p.batch[first]])}


def assert_follows_reference(p, strategy) -> None:
    for name, expected in reference_followed(p, strategy).items():
        got = p
        for part in name.split("."):
            got = getattr(got, part)
        assert got.dtype == np.int64, name
        np.testing.assert_array_equal(got, expected, err_msg=name)


def built(W, S, B, strategy, costs, graph=None):
    split = strategy.split_backward
    priority = strategy.priority or BUILTIN_PRIORITIES["oldest_batch_first"](S, B)
    return build(Shape(W, S, B), strategy, priority, costs, strategy.memory_limit, split,
                 as_stage_graph(S, graph), False)


NAMES = [entry["name"] for entry in unisched.policies.catalog()]
SHAPES = [(4, 4, 4), (4, 8, 6), (2, 8, 5), (3, 6, 7), (8, 8, 16), (6, 3, 6), (8, 4, 8), (2, 4, 8), (5, 5, 9)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("costs", [FREE, LINKS], ids=["free", "links"])
def test_named_strategies_follow_the_sorted_edges(name, costs):
    checked = 0
    for W, S, B in SHAPES:
        try:
            strategy = unisched.policies.get(name, num_workers=W, num_stages=S, num_batches=B)
        except UniSchedError:
            continue  # a shape this strategy does not take
        p = built(W, S, B, strategy, costs)
        assert_follows_reference(p, strategy)
        if strategy.worker_orders is not None:
            assert (p.next_fixed >= 0).sum() == p.num_items - len(strategy.worker_orders)
        checked += 1
    assert checked >= 2, f"{name}: too few shapes taken"


def random_ordered(rng, W, S, B, split, as_work):
    """A random mapping, and per worker a random order of its items, as
    item ids or as lists of Work."""
    works = list(unisched.all_work(S, B, split_backward=split))
    table = {w: int(rng.integers(W)) for w in works}
    orders = {w: [] for w in range(W)}
    for i in rng.permutation(len(works)).tolist():
        orders[table[works[i]]].append(works[i])
    orders = {w: order for w, order in orders.items() if order}
    strategy = unisched.as_strategy(lambda work: ComputeAndWeightWorkers(table[work], table[work]))
    if not as_work:
        items = Items(S, B, split)
        orders = WorkerOrders(items, {w: [items.id(o.batch, o.stage, int(o.direction)) for o in order]
                                      for w, order in orders.items()})
    return strategy.with_(worker_orders=orders, split_backward=split)


@pytest.mark.parametrize("seed", range(6))
def test_random_orders_and_graphs_follow_the_sorted_edges(seed):
    rng = np.random.default_rng(seed)
    W, S, B = int(rng.integers(1, 6)), 4, int(rng.integers(1, 9))
    graph = [None, nx.DiGraph([(0, 1), (0, 2), (1, 3), (2, 3)]), nx.DiGraph([(0, 2), (1, 2), (2, 3)])][seed % 3]
    for split in (False, True):
        for as_work in (False, True):
            strategy = random_ordered(rng, W, S, B, split, as_work)
            for costs in (FREE, LINKS):
                assert_follows_reference(built(W, S, B, strategy, costs, graph), strategy)
