"""Priorities: the total order that breaks ties when several work items could
start at the same moment on one worker.

As in the reference scheduler, the order is applied to the item whose
completion made a candidate ready (its *trigger*: F(s-1, b) for F(s, b), the
virtual item ``Work(b, -1, FORWARD)`` for the first stage, F(S-1, b) for the
last stage's backward, B(s+1, b) for B(s, b)).  Smaller keys go first.

Any callable ``Work -> sortable key`` is a priority.  The built-in ones also
offer ``sort_keys``, the same order computed on whole arrays at once, which
keeps million-item simulations fast.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from unisched.errors import ShapeError
from unisched.strategy import works
from unisched.work import FORWARD, Work, name_key

Priority = Callable[[Work], Any]


class _BuiltinPriority:
    """A priority for a shape, usable as ``priority(work) -> key``."""

    description = ""

    def __init__(self, num_stages: int, num_batches: int | None = None):
        self.num_stages = num_stages
        self.num_batches = num_batches

    def __call__(self, work: Work) -> tuple:
        keys = self.sort_keys(
            np.array([work.batch]), np.array([work.stage]), np.array([int(work.direction)])
        )
        return tuple(int(k[0]) for k in keys)

    def sort_keys(self, batch: np.ndarray, stage: np.ndarray, direction: np.ndarray) -> Sequence[np.ndarray]:
        """Key columns, most significant first (as a tuple key reads)."""
        raise TypeError(f"{type(self).__name__} defines no order")  # pragma: no cover

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.num_stages}, {self.num_batches})"


class OldestBatchFirst(_BuiltinPriority):
    """The default: lower batch first, then forward before backward, then stage."""

    description = "oldest micro-batch first, then forward before backward, then stage"

    def sort_keys(self, batch, stage, direction):
        return batch, direction, stage


class OldestStageFirst(_BuiltinPriority):
    """Lower stage first, then forward before backward, then batch: every
    worker runs all its forwards before its backwards (GPipe's fill-drain)."""

    description = "lowest stage first, then forward before backward, then batch"

    def sort_keys(self, batch, stage, direction):
        return stage, direction, batch


class BackwardFirst(_BuiltinPriority):
    """Work that leads to a backward first (1F1B's rule), then oldest batch.

    The key is applied to the trigger, so "leads to a backward" means the
    trigger is a backward item or the forward of the last stage.
    """

    description = "backward passes first, then oldest micro-batch"

    def sort_keys(self, batch, stage, direction):
        leads_to_backward = (direction != FORWARD) | (stage == self.num_stages - 1)
        return (~leads_to_backward).astype(np.int64), batch, stage, direction


BUILTIN_PRIORITIES = {
    "oldest_batch_first": OldestBatchFirst,
    "oldest_stage_first": OldestStageFirst,
    "backward_first": BackwardFirst,
}


def priority_by_name(name: str, num_stages: int, num_batches: int) -> _BuiltinPriority:
    try:
        return BUILTIN_PRIORITIES[name_key(name)](num_stages, num_batches)
    except KeyError:
        raise ShapeError(
            f"unknown priority {name!r}; choose one of {', '.join(BUILTIN_PRIORITIES)}"
        ) from None


def as_priority(priority, num_stages: int, num_batches: int):
    """A priority as :func:`ranks` takes it: a built-in one also by its name
    ("backward_first") or its class (``BackwardFirst``), made for this shape."""
    if isinstance(priority, str):
        return priority_by_name(priority, num_stages, num_batches)
    if isinstance(priority, type) and issubclass(priority, _BuiltinPriority):
        return priority(num_stages, num_batches)
    if isinstance(priority, _BuiltinPriority) and (
            priority.num_stages != num_stages or priority.num_batches not in (None, num_batches)):
        raise ShapeError(f"{priority!r} was made for {priority.num_stages} stages and {priority.num_batches} "
                         f"micro-batches, but the step has {num_stages} and {num_batches}; pass its class or its "
                         f"name and it is made for the step's shape")
    return priority


def ranks(priority: Priority, batch: np.ndarray, stage: np.ndarray, direction: np.ndarray) -> np.ndarray:
    """Rank of each item under ``priority`` (0 = first), ties broken by position."""
    sort_keys = getattr(priority, "sort_keys", None)
    if sort_keys is not None:
        order = _sorted_by(sort_keys(batch, stage, direction))
    else:
        try:
            keys = [priority(w) for w in works(batch, stage, direction)]
            order = np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)
        except TypeError as error:
            raise TypeError(f"priority {priority!r} must return keys that compare with each other: {error}") from error
    result = np.empty(len(order), dtype=np.int64)
    result[order] = np.arange(len(order))
    return result


def _sorted_by(columns: Sequence[np.ndarray]) -> np.ndarray:
    """The stable order of rows by key ``columns`` (most significant first):
    one sort of the columns packed into one integer where they fit, else
    ``np.lexsort``."""
    columns = [np.asarray(c) for c in columns]
    if not all(np.issubdtype(c.dtype, np.integer) or c.dtype == bool for c in columns) or not len(columns[0]):
        return np.lexsort(tuple(reversed(columns)))
    key = np.zeros(len(columns[0]), dtype=np.int64)
    span = 1
    for column in columns:
        low, high = int(column.min()), int(column.max())
        span *= high - low + 1
        if span >= 1 << 62:
            return np.lexsort(tuple(reversed(columns)))
        key = key * (high - low + 1) + (column.astype(np.int64) - low)
    return np.argsort(key, kind="stable")
