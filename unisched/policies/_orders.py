"""Building fixed per-worker orders for hand-made schedules.

The pipelines that run a warm-up, a steady phase and a drain (1F1B, ZB-H1,
ZB-H2, the interleaved pipelines of Megatron-LM and torch) share one
structure, which :func:`warmup_steady_order` builds: a warm-up of forwards,
then a steady phase that follows each backward (or each input-gradient
pass I) with the next forward, and, with a split backward, runs each weight
pass W a fixed number of backwards after its I.  The schedules differ only
in those counts (and an interleaved worker's stages), so their orders hold
under any costs.

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

from unisched.dataflow import dependencies
from unisched.errors import DeadlockError
from unisched.work import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Direction,
    StageGraph,
    Work,
    directions,
)


def warmup_steady_order(stages: int | Sequence[int], num_batches: int, warmup: int, weight_lag: int | None = None,
                        per_round: int | None = None) -> list[Work]:
    """A worker's sequence: ``warmup`` forwards, then for each backward k
    (the k-th of the worker) the backward followed by the next forward, then
    nothing but backwards once the forwards are done.

    ``stages`` are the worker's stages in the order a micro-batch meets them
    (one stage, or an interleaved worker's r, r + W, ...).  Forwards go in
    rounds of ``per_round`` micro-batches per stage (stage 0 of the worker for
    micro-batches 0..R-1, then its next stage for the same, ...), backwards
    the same way from the last stage down; ``num_batches`` must be a multiple
    of ``per_round`` (default: all micro-batches in one round).

    With ``weight_lag`` L the backward is split: the k-th I pass is followed
    by the W pass of the (k - L)-th (when k >= L), and the W passes still owed
    run last, oldest first.  1F1B is ``warmup = S - s`` on one stage; ZB-H1
    adds ``weight_lag = s``; ZB-H2 takes ``warmup = 2(S - s) - 1`` and
    ``weight_lag = 2s``; the interleaved pipelines add their v - 1 rounds.
    """
    stages = [stages] if isinstance(stages, int) else list(stages)
    v, per_round = len(stages), per_round or num_batches
    total = num_batches * v

    def item(k: int, direction: Direction) -> Work:
        chunk = (k // per_round) % v
        stage = stages[chunk if direction is FORWARD else v - 1 - chunk]
        return Work((k // (per_round * v)) * per_round + k % per_round, stage, direction)

    forwards = min(warmup, total)
    order = [item(k, FORWARD) for k in range(forwards)]
    weights = 0
    for k in range(total):
        if weight_lag is None:
            order.append(item(k, BACKWARD))
        else:
            order.append(item(k, BACKWARD_INPUT))
            if k >= weight_lag:
                order.append(item(weights, BACKWARD_WEIGHT))
                weights += 1
        if forwards < total:
            order.append(item(forwards, FORWARD))
            forwards += 1
    if weight_lag is not None:
        order += [item(k, BACKWARD_WEIGHT) for k in range(weights, total)]
    return order


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
