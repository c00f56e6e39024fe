"""Fixed per-worker orders as dependency edges, on whole arrays.

A strategy's ``worker_orders`` fixes the sequence each worker runs; the
simulator follows it as edges from each item to the next one in its
worker's order (:data:`unisched.simulate.problem.EDGE_SEQUENCE`), after
checking that the orders name every item of the step once, each on the
worker the mapping sends it to.  An order written for the other backward
form is adapted: with a split backward each B becomes I then W in its
place; without, I becomes B and W is dropped.

Orders arrive as lists of Work (or ``(batch, stage, direction)`` tuples);
they are read into integer arrays in one pass each (``np.fromiter``), and
everything after that is numpy, so a million-item order takes
milliseconds rather than seconds.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from unisched.dataflow import Items
from unisched.errors import StrategyError
from unisched.work import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, Direction, Shape, Work


def sequence_edges(orders, compute: np.ndarray, shape: Shape, items: Items, kind: int) -> np.ndarray:
    """(4, E) edges src, dst, ``kind``, -1 that make each worker follow its
    given order, after checking the orders."""
    W, S, B = shape
    unknown = sorted(set(orders) - set(range(W)))
    if unknown:
        raise StrategyError(f"worker_orders names workers {unknown}, but workers are numbered 0..{W - 1}")
    seen = np.zeros(len(compute), dtype=bool)
    src, dst = [], []
    for w, order in orders.items():
        batch, stage, direction = _in_directions(_as_columns(w, order), items.split_backward)
        ids = _checked_ids(w, batch, stage, direction, compute, shape, items, seen)
        seen[ids] = True
        src.append(ids[:-1])
        dst.append(ids[1:])
    if not seen.all():
        item = int(np.flatnonzero(~seen)[0])
        raise StrategyError(
            f"the fixed orders leave out {int((~seen).sum())} work item(s), e.g. {items.work(item)!r} on worker "
            f"{compute[item]}; every item must appear in its worker's order"
        )
    src = np.concatenate(src) if src else np.zeros(0, dtype=np.int64)
    dst = np.concatenate(dst) if dst else np.zeros(0, dtype=np.int64)
    return np.stack([src, dst, np.full(len(src), kind), np.full(len(src), -1)]).astype(np.int64)


def _as_columns(worker: int, order) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(batch, stage, direction) columns of an order of Work or 3-tuples."""
    order = list(order)
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


def _checked_ids(w: int, batch, stage, direction, compute, shape: Shape, items: Items, seen) -> np.ndarray:
    """The item ids of worker w's order, after checking that each is an item
    of the step, sent to w by the mapping, and named only once."""
    W, S, B = shape

    def work(i: int) -> Work:
        return Work(int(batch[i]), int(stage[i]), Direction(int(direction[i])))

    known = np.isin(direction, [int(d) for d in Direction])
    if not known.all():
        i = int(np.argmin(known))
        raise StrategyError(f"worker {w}'s order has direction {int(direction[i])}, which is no Direction "
                            f"({', '.join(d.name for d in Direction)})")
    outside = ~np.isin(direction, items.dirs) | (batch < 0) | (batch >= B) | (stage < 0) | (stage >= S)
    if outside.any():
        raise StrategyError(f"worker {w}'s order has {work(int(np.argmax(outside)))!r}, which is not a work item "
                            f"of this shape")
    ids = items.id(batch, stage, direction)
    elsewhere = compute[ids] != w
    if elsewhere.any():
        i = int(np.argmax(elsewhere))
        raise StrategyError(f"worker {w}'s order has {work(i)!r}, but the mapping sends it to worker {compute[ids[i]]}")
    repeated = seen[ids] | _repeats(ids)
    if repeated.any():
        raise StrategyError(f"{work(int(np.argmax(repeated)))!r} appears twice in the fixed orders")
    return ids


def _repeats(ids: np.ndarray) -> np.ndarray:
    """Per position: whether the same id came earlier in ``ids``."""
    first = np.zeros(len(ids), dtype=bool)
    first[np.unique(ids, return_index=True)[1]] = True
    return ~first
