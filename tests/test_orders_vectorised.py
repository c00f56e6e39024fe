"""The warm-up / steady orders built for every worker at once
(:func:`unisched.policies._orders.warmup_steady_orders`) against a readable
round-by-round reference, and the orders of the named schedules numbered
together (:func:`fixed_orders`) against worker by worker."""

from __future__ import annotations

import numpy as np
import pytest

import unisched
from unisched.dataflow import Items
from unisched.errors import StrategyError
from unisched.policies import _orders as orders_module
from unisched.policies._orders import fixed_orders, warmup_steady_orders
from unisched.work import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Shape


def reference_order(stages, num_batches, warmup, weight_lag=None, per_round=None):
    """The rule read round by round: ``warmup`` forwards; then for the k-th
    backward (I), it, the W pass of the (k - L)-th, the next forward; the W
    passes still owed last.  The k-th pass of a kind is micro-batch
    (k mod R) of round k // (R v), on the worker's stage (k // R) mod v
    (counted from the last stage for backward passes)."""
    stages = list(np.atleast_1d(stages))
    v, per_round = len(stages), per_round or num_batches
    total = num_batches * v
    warm = min(warmup, total)
    rows = [(FORWARD, j) for j in range(warm)]
    for k in range(total):
        rows.append((BACKWARD if weight_lag is None else BACKWARD_INPUT, k))
        if weight_lag is not None and k >= weight_lag:
            rows.append((BACKWARD_WEIGHT, k - weight_lag))
        if warm + k < total:
            rows.append((FORWARD, warm + k))
    if weight_lag is not None:
        rows += [(BACKWARD_WEIGHT, m) for m in range(max(total - weight_lag, 0), total)]

    def place(direction, index):
        chunk = (index // per_round) % v
        stage = stages[chunk if direction == FORWARD else v - 1 - chunk]
        return (index // (per_round * v)) * per_round + index % per_round, stage, int(direction)

    return tuple(np.array(column, dtype=np.int64) for column in zip(*(place(d, i) for d, i in rows)))


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


SHAPES = [(W, v, B, per) for W in (1, 2, 3, 4, 7) for v in (1, 2, 3) for B, per in ((1, None), (4, None), (6, 2),
                                                                                     (8, 4), (9, 3), (12, None))]


@pytest.mark.parametrize("W, v, B, per_round", SHAPES)
@pytest.mark.parametrize("split", [False, True])
def test_every_worker_at_once_matches_the_reference(W, v, B, per_round, split):
    rng = np.random.default_rng(W * 1000 + v * 100 + B)
    total = B * v
    stages = np.arange(W * v).reshape(v, W).T  # worker r holds r, r + W, ...
    warmup = rng.integers(0, total + 3, size=W)
    lag = rng.integers(0, total + 3, size=W) if split else None
    batch, stage, direction = warmup_steady_orders(stages, B, warmup, lag, per_round)
    assert batch.shape == stage.shape == direction.shape == (W, (3 if split else 2) * total)
    for w in range(W):
        expected = reference_order(stages[w], B, int(warmup[w]), None if lag is None else int(lag[w]), per_round)
        assert same((batch[w], stage[w], direction[w]), expected), (w, warmup[w], None if lag is None else lag[w])


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_the_schedules_warm_ups_and_lags_match_the_reference(p):
    """1F1B, ZB-H1, ZB-H2 and Megatron's interleaved counts, each worker's row."""
    B = 2 * p
    s = np.arange(p)
    cases = [(s, p - s, None, None), (s, p - s, s, None), (s, 2 * (p - s) - 1, 2 * s, None),
             (np.arange(2 * p).reshape(2, p).T, 1 + (p - s - 1) * 2 + p, None, p)]
    for stages, warmup, lag, per_round in cases:
        columns = warmup_steady_orders(stages, B, warmup, lag, per_round)
        for w in range(p):
            expected = reference_order(np.atleast_1d(stages[w]), B, int(warmup[w]),
                                       None if lag is None else int(lag[w]), per_round)
            assert same([c[w] for c in columns], expected)


@pytest.mark.parametrize("name, shape", [
    ("one_f_one_b", (4, 4, 8)), ("interleaved", (4, 8, 8)), ("zb_h1", (4, 4, 8)), ("zb_h2", (4, 4, 8)),
    ("zbv", (4, 8, 8)), ("ScheduleInterleaved1F1B", (4, 8, 8)), ("ScheduleInterleavedZeroBubble", (4, 8, 12)),
    ("Schedule1F1B", (4, 4, 6)),
])
def test_named_schedules_number_their_orders_as_worker_by_worker(monkeypatch, name, shape):
    def built():
        return unisched.policies.get(name, num_workers=shape[0], num_stages=shape[1], num_batches=shape[2])

    strategy = built()
    together = strategy.worker_orders
    monkeypatch.setattr(orders_module, "NUMBERED_TOGETHER", 0)
    assert built().worker_orders == together
    items = Items(shape[1], shape[2], strategy.split_backward)
    assert sorted(np.concatenate(list(together.ids.values()))) == list(range(items.count))


def one_worker(stage: int, num_batches: int, warmup: int, weight_lag: int | None = None):
    """The order of a worker of one stage: row 0 of a one-worker table."""
    columns = warmup_steady_orders([stage], num_batches, [warmup], None if weight_lag is None else [weight_lag])
    return tuple(column[0] for column in columns)


def test_fixed_orders_take_every_worker_at_once_or_worker_by_worker():
    shape = Shape(4, 4, 8)
    s = np.arange(4)
    at_once = fixed_orders(shape, True, warmup_steady_orders(s, 8, 4 - s, s))
    by_worker = fixed_orders(shape, True, lambda w: one_worker(w, 8, 4 - w, w))
    assert at_once == by_worker
    assert [len(at_once.ids[w]) for w in range(4)] == [24] * 4


def test_an_order_outside_the_step_names_its_worker():
    shape = Shape(2, 2, 2)

    def order(w):
        batch, stage, direction = one_worker(w, 2, 2 - w)
        return (batch + (w == 1), stage, direction)  # worker 1 runs a micro-batch 2 of a two-batch step

    with pytest.raises(StrategyError, match="worker 1's order has batch 2"):
        fixed_orders(shape, False, order)


def test_orders_at_once_need_one_row_per_worker():
    s = np.arange(3)
    with pytest.raises(StrategyError, match="one row per worker, 4 rows"):
        fixed_orders(Shape(4, 4, 8), False, warmup_steady_orders(s, 8, 4 - s))


@pytest.mark.parametrize("split", [False, True])
def test_orders_numbered_together_or_worker_by_worker_agree(monkeypatch, split):
    shape = Shape(4, 4, 8)
    s = np.arange(4)
    columns = warmup_steady_orders(s, 8, 4 - s, s if split else None)
    together = fixed_orders(shape, split, columns)
    monkeypatch.setattr(orders_module, "NUMBERED_TOGETHER", 0)
    assert fixed_orders(shape, split, columns) == together
    assert fixed_orders(shape, split, lambda w: tuple(c[w] for c in columns)) == together
