"""Fixed per-worker orders as each item's successor, on whole arrays.

A strategy's ``worker_orders`` fixes the sequence each worker runs; the
simulator follows it as an edge from each item to the next one in its
worker's order (``Problem.next_fixed``: it moves nothing and triggers
nothing), kept as one successor per item, after checking that the orders name every item of
the step once, each on the worker the mapping sends it to.  An order written for the other backward
form is adapted: with a split backward each B becomes I then W in its
place; without, I becomes B and W is dropped.

Orders arrive as a :class:`~unisched.strategy.WorkerOrders` (arrays of
item ids, what the named schedules build), used as they are, or as lists of
Work (or ``(batch, stage, direction)`` tuples), read into integer arrays in
one pass each (``np.fromiter``); everything after that is numpy.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from unisched.dataflow import Items
from unisched.errors import StrategyError
from unisched.strategy import WorkerOrders, order_ids
from unisched.work import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, Direction, Shape, Work


def fixed_successors(orders, compute: np.ndarray, shape: Shape, items: Items) -> np.ndarray:
    """Per item: the item after it in its worker's order (-1: it ends the
    order), after checking the orders."""
    W, S, B = shape
    unknown = sorted(set(orders) - set(range(W)))
    if unknown:
        raise StrategyError(f"worker_orders names workers {unknown}, but workers are numbered 0..{W - 1}")
    given = order_ids(orders, items)
    if given is not None:
        owner = _owners(orders, [len(given.ids[w]) for w in orders])
        ids = np.concatenate([given.ids[w] for w in orders]) if orders else np.zeros(0, np.int64)
        if not _each_once_on_its_worker(ids, owner, compute):
            ids = _checked_ids(owner, *items.columns(ids), compute, shape, items)
            _none_left_out(ids, compute, items)
    else:
        columns = [_in_directions(order_columns(orders, w), items.split_backward) for w in orders]
        owner = _owners(orders, [len(c[0]) for c in columns])
        batch, stage, direction = (np.concatenate([c[i] for c in columns]) if columns else np.zeros(0, np.int64)
                                   for i in range(3))
        ids = _checked_ids(owner, batch, stage, direction, compute, shape, items)
        _none_left_out(ids, compute, items)
    follows = owner[1:] == owner[:-1]  # the next row is in the same worker's order
    successor = np.full(len(compute), -1, dtype=np.int64)
    successor[ids[:-1][follows]] = ids[1:][follows]
    return successor


def _owners(orders, lengths: list[int]) -> np.ndarray:
    """Per row of the orders laid end to end: the worker whose order it is in."""
    return np.repeat(np.fromiter(orders, dtype=np.int64, count=len(orders)), np.array(lengths, dtype=np.int64))


def _each_once_on_its_worker(ids: np.ndarray, owner: np.ndarray, compute: np.ndarray) -> bool:
    """Whether ``ids`` name every item once, each in the order of the worker
    the mapping sends it to (the common case, checked without sorting: as
    many ids as items, and none left out)."""
    if len(ids) != len(compute) or not (compute[ids] == owner).all():
        return False
    seen = np.zeros(len(compute), dtype=bool)
    seen[ids] = True
    return bool(seen.all())


def _none_left_out(ids: np.ndarray, compute: np.ndarray, items: Items) -> None:
    """Every item must appear in its worker's order."""
    seen = np.zeros(len(compute), dtype=bool)
    seen[ids] = True
    if not seen.all():
        item = int(np.flatnonzero(~seen)[0])
        raise StrategyError(
            f"the fixed orders leave out {int((~seen).sum())} work item(s), e.g. {items.work(item)!r} on worker "
            f"{compute[item]}; every item must appear in its worker's order"
        )


def order_columns(orders, worker: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(batch, stage, direction) columns of ``worker``'s order, from a
    :class:`WorkerOrders` or from a list of Work or 3-tuples."""
    if isinstance(orders, WorkerOrders):
        return orders.columns(worker)
    order = list(orders[worker])
    try:
        flat = np.fromiter(chain.from_iterable(order), dtype=np.int64, count=3 * len(order))
    except (TypeError, ValueError) as error:
        raise StrategyError(
            f"worker {worker}'s order must list work items Work(batch, stage, direction): {error}"
        ) from error
    return flat[0::3], flat[1::3], flat[2::3]


def _in_directions(columns, split: bool):
    """The order in this step's backward form (see the module docstring)."""
    batch, stage, direction = columns
    if split:
        twice = np.where(direction == BACKWARD, 2, 1)
        batch, stage, direction = np.repeat(batch, twice), np.repeat(stage, twice), np.repeat(direction, twice)
        first = np.cumsum(twice) - twice  # where each original row now starts
        halves = np.flatnonzero(twice == 2)
        direction[first[halves]] = BACKWARD_INPUT
        direction[first[halves] + 1] = BACKWARD_WEIGHT
        return batch, stage, direction
    keep = direction != BACKWARD_WEIGHT
    direction = np.where(direction == BACKWARD_INPUT, BACKWARD, direction)
    return batch[keep], stage[keep], direction[keep]


def _checked_ids(owner, batch, stage, direction, compute, shape: Shape, items: Items) -> np.ndarray:
    """The item ids of the orders (``owner``: whose order each row is in),
    after checking that each is an item of the step, sent to its worker by
    the mapping, and named only once.  The fault reported is the first of
    the first worker's order that has one (and in it, an item outside the
    step before one on the wrong worker before one named twice)."""
    W, S, B = shape

    def work(i: int) -> Work:
        return Work(int(batch[i]), int(stage[i]), Direction(int(direction[i])))

    unknown = ~np.isin(direction, [int(d) for d in Direction])
    if unknown.any():
        i = int(np.argmax(unknown))
        raise StrategyError(f"worker {owner[i]}'s order has direction {int(direction[i])}, which is no Direction "
                            f"({', '.join(d.name for d in Direction)})")
    outside = ~np.isin(direction, items.dirs) | (batch < 0) | (batch >= B) | (stage < 0) | (stage >= S)
    ids = np.where(outside, 0, items.id(np.where(outside, 0, batch), np.where(outside, 0, stage),
                                        np.where(outside, items.dirs[0], direction)))
    elsewhere = ~outside & (compute[ids] != owner)
    repeated = ~outside & _repeats(np.where(outside, -1 - np.arange(len(ids)), ids))
    faulty = outside | elsewhere | repeated
    if not faulty.any():
        return ids
    mine = owner == owner[int(np.argmax(faulty))]
    if (outside & mine).any():
        i = int(np.argmax(outside & mine))
        raise StrategyError(f"worker {owner[i]}'s order has {work(i)!r}, which is not a work item of this shape")
    if (elsewhere & mine).any():
        i = int(np.argmax(elsewhere & mine))
        raise StrategyError(
            f"worker {owner[i]}'s order has {work(i)!r}, but the mapping sends it to worker {compute[ids[i]]}")
    i = int(np.argmax(repeated & mine))
    earlier = int(np.argmax(ids[:i] == ids[i]))
    start = int(np.argmax(mine))  # a worker's rows are contiguous: positions count from its first
    w = work(i)
    raise StrategyError(f"worker {owner[i]}'s order has {w} (micro-batch {w.batch}, stage {w.stage}, "
                        f"{w.direction.name.lower()}) twice, at positions "
                        f"{earlier - start} and {i - start}; name each work item once")


def _repeats(ids: np.ndarray) -> np.ndarray:
    """Per position: whether the same id came earlier in ``ids``."""
    first = np.zeros(len(ids), dtype=bool)
    first[np.unique(ids, return_index=True)[1]] = True
    return ~first
