"""Building fixed per-worker orders for hand-made schedules.

The pipelines that run a warm-up, a steady phase and a drain (1F1B, ZB-H1,
ZB-H2, the interleaved pipelines of Megatron-LM and torch) share one
structure, which :func:`warmup_steady_orders` builds for every worker at
once: a warm-up of forwards,
then a steady phase that follows each backward (or each input-gradient
pass I) with the next forward, and, with a split backward, runs each weight
pass W a fixed number of backwards after its I.  The schedules differ only
in those counts (and an interleaved worker's stages), so their orders hold
under any costs.  Phase-by-phase schedules (ZB-V, DualPipeV) write theirs
with an :class:`OrderWriter`, whose repeated rounds are written at once.
Both give arrays (micro-batch, stage, direction per pass), which the
strategies hand over as :class:`unisched.strategy.WorkerOrders`: a
million-item order takes no Python object per item.

:func:`unit_time_orders` designs an order another way: it runs a design
rule of one's own slot by slot on a grid where every pass takes one slot,
and records what each worker ran (an order found that way fits unit times;
under other costs the simulator still follows it, but nothing promises it
stays good).

Also here: :class:`KeyPriority`, a priority given as array columns, for
strategies whose tie-break is not one of the built-in ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from unisched.dataflow import Items, dependencies
from unisched.errors import DeadlockError, StrategyError
from unisched.simulate.simulation import check_size
from unisched.strategy import WorkerOrders
from unisched.work import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Direction,
    Shape,
    StageGraph,
    Work,
    directions,
)


Columns = tuple[np.ndarray, np.ndarray, np.ndarray]
"""One worker's order as arrays: micro-batch, stage and direction of each pass, in order."""


def warmup_steady_orders(stages, num_batches: int, warmup, weight_lag=None, per_round: int | None = None) -> Columns:
    """Every worker's sequence, at once: ``warmup`` forwards, then for each
    backward k (the k-th of the worker) the backward followed by the next
    forward, then nothing but backwards once the forwards are done; row w of
    each returned (W, passes) array is worker w's order.

    ``stages``: one stage per worker (W,), or each worker's stages in the
    order a micro-batch meets them (W, v: an interleaved worker's r, r + W,
    ...).  Forwards go in rounds of ``per_round`` micro-batches per stage
    (the worker's first stage for micro-batches 0..R-1, then its next stage
    for the same, ...), backwards the same way from the last stage down;
    ``num_batches`` must be a multiple of ``per_round`` (default: all
    micro-batches in one round).  ``warmup`` and ``weight_lag``: one count
    per worker.  With a ``weight_lag`` L the backward is split: the k-th I
    pass is followed by the W pass of the (k - L)-th (when k >= L), and the
    W passes still owed run last, oldest first (None: a whole backward).
    1F1B is ``warmup = S - s`` on one stage; ZB-H1 adds ``weight_lag = s``;
    ZB-H2 takes ``warmup = 2(S - s) - 1`` and ``weight_lag = 2s``; the
    interleaved pipelines add their v - 1 rounds.  Every worker runs the
    same number of passes, so the orders are one table: each pass's place
    in its worker's order follows from how many passes of each kind come
    before it (the k-th backward comes after the warm-up, the k earlier
    backwards, the forwards and W passes their rounds let in).  A step too
    large to simulate (W workers of v stages each) is refused first
    (:func:`~unisched.simulate.simulation.check_size`), before the table
    takes the memory."""
    stages = np.asarray(stages, dtype=np.int64)
    stages = stages[:, None] if stages.ndim == 1 else stages
    W, v = stages.shape
    check_size(Shape(W, W * v, num_batches), weight_lag is not None)
    per_round = per_round or num_batches
    total = num_batches * v  # passes of each kind per worker
    split = weight_lag is not None
    kinds = 3 if split else 2
    warm = np.minimum(np.broadcast_to(np.asarray(warmup, dtype=np.int64), (W,)), total)[:, None]
    lag = np.broadcast_to(np.asarray(weight_lag if split else total, dtype=np.int64), (W,))[:, None]
    k = np.arange(total)[None, :]

    backward_at = warm + k + np.minimum(k, total - warm) + np.maximum(k - lag, 0)
    steady = k - warm  # the round a forward past the warm-up follows
    forward_at = np.where(steady < 0, k, warm + 2 * steady + np.maximum(steady - lag, 0) + 1 + (steady >= lag))
    places = [(backward_at, BACKWARD_INPUT if split else BACKWARD), (forward_at, FORWARD)]
    if split:  # the k-th W pass follows the (k + L)-th I pass, or, still owed then, runs at the end
        after = k + lag
        places.append((np.where(after < total, warm + after + np.minimum(after, total - warm) + k + 1, 2 * total + k),
                       BACKWARD_WEIGHT))

    index = np.empty((W, kinds * total), dtype=np.int64)
    direction = np.full((W, kinds * total), FORWARD, dtype=np.int64)
    rows = np.arange(W)[:, None]
    for at, kind in places:
        index[rows, at] = k
        if kind != FORWARD:
            direction[rows, at] = kind
    if v == 1:  # the k-th pass of a kind is micro-batch k
        return index, np.repeat(stages, kinds * total, axis=1), direction
    chunk = (index // per_round) % v
    stage = np.take_along_axis(stages, np.where(direction == FORWARD, chunk, v - 1 - chunk), 1)
    return (index // (per_round * v)) * per_round + index % per_round, stage, direction


def fixed_orders(shape: Shape, split_backward: bool, order_of: Callable[[int], Columns] | Columns) -> WorkerOrders:
    """Every worker w's order, ``order_of(w)``, as :class:`WorkerOrders` of
    the step's items; ``order_of`` may also be every worker's order at once
    (row w of each column: worker w's, as :func:`warmup_steady_orders`
    gives them).  A step too large to simulate is refused first
    (:func:`~unisched.simulate.simulation.check_size`), before its orders
    take the memory."""
    check_size(shape, split_backward)
    items = Items(shape.num_stages, shape.num_batches, split_backward)
    workers = range(shape.num_workers)
    if callable(order_of):
        columns = [order_of(w) for w in workers]
        lengths = [len(c[0]) for c in columns]

        def together() -> list[np.ndarray]:
            return [np.concatenate([np.asarray(c[i], dtype=np.int64).reshape(-1) for c in columns]) for i in range(3)]
    else:
        rows = [np.asarray(c, dtype=np.int64) for c in order_of]
        if rows[0].ndim != 2 or len(rows[0]) != len(workers):
            raise StrategyError(f"every worker's order at once needs one row per worker, {len(workers)} rows; got "
                                f"columns of shape {rows[0].shape}")
        columns = [tuple(c[w] for c in rows) for w in workers]
        lengths = [rows[0].shape[1]] * len(workers)

        def together() -> list[np.ndarray]:
            return [c.reshape(-1) for c in rows]
    if sum(lengths) <= NUMBERED_TOGETHER:
        try:
            ids = WorkerOrders.from_columns(items, {0: together()}).ids[0]
            return WorkerOrders(items, dict(zip(workers, np.split(ids, np.cumsum(lengths)[:-1]))))
        except StrategyError:
            pass  # numbered worker by worker, the error names the worker whose order is at fault
    return WorkerOrders.from_columns(items, dict(zip(workers, columns)))


NUMBERED_TOGETHER = 1 << 15
"""Orders of at most this many passes in all are numbered in one pass
(a step of a few thousand items would otherwise spend most of its time
numbering worker by worker); larger ones worker by worker, each in cache."""


class OrderWriter:
    """One worker's order written pass by pass, or in rounds repeated at
    once, as arrays.  ``stages[c]`` is the worker's chunk c; each pass of a
    chunk (forward, I, W, B) takes its micro-batches 0, 1, 2, ... in turn."""

    def __init__(self, stages: Sequence[int]):
        self.stages = tuple(stages)
        self.written: dict[tuple[int, Direction], int] = {}
        self._rows: list[tuple[int, int, int]] = []
        self._parts: list[Columns] = []

    def count(self, chunk: int, direction: Direction) -> int:
        """How many passes ``direction`` of ``chunk`` are written."""
        return self.written.get((chunk, direction), 0)

    def next(self, chunk: int, direction: Direction) -> None:
        """Write the next micro-batch's pass ``direction`` of ``chunk``."""
        batch = self.count(chunk, direction)
        self.written[(chunk, direction)] = batch + 1
        self._rows.append((batch, self.stages[chunk], int(direction)))

    def rounds(self, times: int, *steps: tuple[int, Direction]) -> None:
        """``times`` rounds of ``steps`` (each a (chunk, direction) that
        :meth:`next` would write), written at once."""
        if times <= 0:
            return
        self._flush()
        round_ = np.arange(times)[:, None]
        batch = np.empty((times, len(steps)), dtype=np.int64)
        for j, step in enumerate(steps):
            batch[:, j] = self.count(*step) + round_[:, 0] * steps.count(step) + steps[:j].count(step)
        for step in set(steps):
            self.written[step] = self.count(*step) + times * steps.count(step)
        stage = np.broadcast_to(np.array([self.stages[c] for c, _ in steps]), batch.shape)
        direction = np.broadcast_to(np.array([int(d) for _, d in steps]), batch.shape)
        self._parts.append((batch.ravel(), stage.ravel(), direction.ravel()))

    def columns(self) -> Columns:
        """The order written so far."""
        self._flush()
        return tuple(np.concatenate([p[i] for p in self._parts] or [np.zeros(0, np.int64)]).astype(np.int64)
                     for i in range(3))

    def _flush(self) -> None:
        if self._rows:
            self._parts.append(tuple(np.array(column, dtype=np.int64) for column in zip(*self._rows)))
            self._rows = []


class KeyPriority:
    """A priority whose key columns come from ``keys(batch, stage, direction)``
    on arrays; smaller keys go first (applied to the trigger item, like the
    built-in priorities)."""

    def __init__(self, keys: Callable[[np.ndarray, np.ndarray, np.ndarray], Sequence[np.ndarray]], description: str):
        self._keys = keys
        self.description = description

    def sort_keys(self, batch, stage, direction) -> Sequence[np.ndarray]:
        return self._keys(np.asarray(batch), np.asarray(stage), np.asarray(direction))

    def __call__(self, work: Work) -> tuple:
        columns = self.sort_keys(np.array([work.batch]), np.array([work.stage]), np.array([int(work.direction)]))
        return tuple(int(np.asarray(c)[0]) for c in columns)

    def __repr__(self) -> str:
        return f"KeyPriority({self.description!r})"


@dataclass
class Progress:
    """What a design rule may look at when a worker is free: per worker, how
    many forwards it started and how many input- and weight-gradient passes
    it finished, and the weight passes it still owes (oldest first)."""

    forwards: list[int]
    inputs_done: list[int]
    weights_done: list[int]
    owed_weights: list[list[Work]] = field(default_factory=list)


Rule = Callable[[int, list[Work], Progress], Work | None]
"""``rule(worker, ready, progress)``: the item the free worker runs now, or None to wait."""


def unit_time_orders(
    num_workers: int,
    num_stages: int,
    num_batches: int,
    compute: Callable[[Work], int],
    rule: Rule,
    *,
    split_backward: bool = True,
    name: str = "schedule",
) -> dict[int, list[Work]]:
    """Run ``rule`` on a grid where every pass takes one slot; return each worker's order."""
    dirs = directions(split_backward)
    items = [Work(b, s, d) for b in range(num_batches) for s in range(num_stages) for d in dirs]
    owner = {item: compute(item) for item in items}
    chain = StageGraph(num_stages)
    waiting = {}
    successors: dict[Work, list[Work]] = {item: [] for item in items}
    for item in items:
        deps = dependencies(item, num_stages, split_backward=split_backward, stage_graph=chain)
        waiting[item] = len(deps)
        for dep in deps:
            successors[dep].append(item)
    ready: list[list[Work]] = [[] for _ in range(num_workers)]
    for item in items:
        if not waiting[item]:
            ready[owner[item]].append(item)
    left = {w: sum(1 for item in items if owner[item] == w) for w in range(num_workers)}
    orders: dict[int, list[Work]] = {w: [] for w in range(num_workers)}
    progress = Progress([0] * num_workers, [0] * num_workers, [0] * num_workers,
                        [[] for _ in range(num_workers)])
    slot, remaining, idle_slots = 0, len(items), 0
    while remaining:
        finished = []
        for w in range(num_workers):
            choice = rule(w, list(ready[w]), progress) if ready[w] else None
            if choice is None:
                continue
            ready[w].remove(choice)
            orders[w].append(choice)
            finished.append((w, choice))
        for w, choice in finished:
            _record(progress, w, choice)
            left[w] -= 1
            for nxt in successors[choice]:
                waiting[nxt] -= 1
                if not waiting[nxt]:
                    ready[owner[nxt]].append(nxt)
        remaining -= len(finished)
        idle_slots = 0 if finished else idle_slots + 1
        if idle_slots > 1:
            stuck = {w: f"{left[w]} item(s) left; ready: {', '.join(map(str, ready[w])) or 'none'}"
                     for w in range(num_workers) if left[w]}
            raise DeadlockError(f"{name}: its design rule leaves every worker waiting at slot {slot}", stuck)
        slot += 1
    return orders


def _record(progress: Progress, worker: int, item: Work) -> None:
    direction = Direction(item.direction)
    if direction is FORWARD:
        progress.forwards[worker] += 1
    elif direction is BACKWARD_INPUT:
        progress.inputs_done[worker] += 1
        progress.owed_weights[worker].append(Work(item.batch, item.stage, BACKWARD_WEIGHT))
    else:
        progress.weights_done[worker] += 1
        if direction is BACKWARD_WEIGHT:
            progress.owed_weights[worker].remove(item)
