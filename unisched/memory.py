"""What each worker holds over time, derived from a Timeline.

One definition serves simulated and measured timelines alike (the simulator
enforces memory limits incrementally with the same rules):

- activations: the input of (stage s, batch b) is held from the start of
  F(s, b) to the end of its backward, *on the backward's worker* -- a worker
  that stores an activation for a forward run elsewhere holds it from the
  forward's start.  With a split backward, the input-gradient pass frees the
  fraction ``input_grad_frees`` and the weight-gradient pass the rest.
- weights: the stages a worker is the weight worker of, for the whole step.
- fetched: a fetched copy of a stage's weights, from the fetch's start to the
  end of the last item on that worker and stage before the next fetch.
- gradients: a fetched stage's gradient, from its backward's end until it has
  been sent back to the weight worker.

Intervals are half-open, so an item that frees memory at time t and one that
takes memory at t never overlap.
"""

from __future__ import annotations

import numpy as np

from unisched import dataflow
from unisched.timeline import MemoryCurve, Timeline
from unisched.work import FORWARD

MEMORY_KINDS = ("activations", "weights", "fetched", "gradients")


def memory_curves(timeline: Timeline, kind: str = "total", unit: str = "bytes") -> list[MemoryCurve]:
    """Per-worker step curves of ``kind`` ("total" or one of ``MEMORY_KINDS``)
    in ``unit`` ("bytes", or "units": one per stash, stage or buffer)."""
    if unit not in ("bytes", "units"):
        raise ValueError(f"unit must be 'bytes' or 'units', got {unit!r}")
    kinds = MEMORY_KINDS if kind == "total" else (kind,)
    if any(k not in MEMORY_KINDS for k in kinds):
        raise ValueError(f"kind must be 'total' or one of {MEMORY_KINDS}, got {kind!r}")
    pieces = [_HOLDS[k](timeline, unit == "bytes") for k in kinds]
    workers = np.concatenate([p[0] for p in pieces])
    starts = np.concatenate([p[1] for p in pieces])
    ends = np.concatenate([p[2] for p in pieces])
    amounts = np.concatenate([p[3] for p in pieces])
    return step_curves(timeline.num_workers, workers, starts, ends, amounts)


def step_curves(num_workers: int, workers, starts, ends, amounts) -> list[MemoryCurve]:
    """Sum of half-open holds ``[start, end)`` per worker, as step curves."""
    keep = ends > starts
    workers, starts, ends, amounts = workers[keep], starts[keep], ends[keep], amounts[keep]
    ev_worker = np.concatenate([workers, workers])
    ev_time = np.concatenate([starts, ends])
    ev_delta = np.concatenate([amounts, -amounts])
    order = np.lexsort((ev_delta, ev_time, ev_worker))
    ev_worker, ev_time, ev_delta = ev_worker[order], ev_time[order], ev_delta[order]
    curves = []
    bounds = np.searchsorted(ev_worker, np.arange(num_workers + 1))
    for w in range(num_workers):
        lo, hi = bounds[w], bounds[w + 1]
        times, level = ev_time[lo:hi], np.cumsum(ev_delta[lo:hi])
        last_at_time = np.append(times[1:] != times[:-1], True) if hi > lo else np.zeros(0, bool)
        times, level = times[last_at_time], level[last_at_time]
        curves.append(MemoryCurve(np.concatenate([[0.0], times]), np.concatenate([[0.0], np.maximum(level, 0.0)])))
    return curves


def peak_activations(timeline: Timeline) -> list[float]:
    """Most stashed inputs each worker holds at once (the seed's definition)."""
    return [c.peak for c in memory_curves(timeline, "activations", "units")]


# ---------------------------------------------------------------------- holds
def _activation_holds(t: Timeline, in_bytes: bool):
    key = t.batch * t.num_stages + t.stage
    n = t.num_batches * t.num_stages
    fwd_start = np.full(n, np.nan)
    is_f = t.direction == FORWARD
    fwd_start[key[is_f]] = t.start[is_f]
    size = t.stash_bytes[t.stage] if in_bytes else np.ones(len(t))
    share = dataflow.stash_share_array(t.direction, t.split_backward, t.input_grad_frees)
    rows = np.flatnonzero(t.direction != FORWARD)
    starts = fwd_start[key[rows]]
    known = ~np.isnan(starts)
    rows, starts = rows[known], starts[known]
    return t.worker[rows], starts, t.end[rows], (size * share)[rows]


def _weight_holds(t: Timeline, in_bytes: bool):
    pairs = np.unique(np.stack([t.weight_worker, t.stage]), axis=1) if len(t) else np.zeros((2, 0), int)
    workers, stages = pairs
    amounts = t.weight_bytes[stages] if in_bytes else np.ones(len(stages))
    begin = min(float(t.start.min(initial=0.0)), 0.0)
    return workers, np.full(len(workers), begin), np.full(len(workers), t.latency), amounts


def _fetched_holds(t: Timeline, in_bytes: bool):
    tr = t.transfers
    rows = np.flatnonzero(tr.of_kind("weights"))
    ends = np.empty(len(rows))
    S = max(t.num_stages, 1)
    item_key = t.worker * S + t.stage
    by_key = np.lexsort((t.start, item_key))  # items grouped by (worker, stage), each group in start order
    sorted_keys = item_key[by_key]
    for group in _groups(tr.dst[rows], tr.stage[rows]):
        fetches = rows[group]
        fetches = fetches[np.argsort(tr.start[fetches], kind="stable")]
        key = tr.dst[fetches[0]] * S + tr.stage[fetches[0]]
        items = by_key[np.searchsorted(sorted_keys, key, "left"):np.searchsorted(sorted_keys, key, "right")]
        next_fetch = np.append(tr.start[fetches[1:]], np.inf)
        last = np.searchsorted(t.start[items], next_fetch, side="left") - 1
        running_end = np.maximum.accumulate(t.end[items]) if len(items) else np.zeros(0)
        fetch_ends = np.where(last >= 0, running_end[np.maximum(last, 0)] if len(items) else 0.0, tr.end[fetches])
        ends[np.searchsorted(rows, fetches)] = np.maximum(fetch_ends, tr.end[fetches])
    amounts = tr.nbytes[rows] if in_bytes else np.ones(len(rows))
    return tr.dst[rows], tr.start[rows], ends, amounts


def _gradient_holds(t: Timeline, in_bytes: bool):
    tr = t.transfers
    rows = np.flatnonzero(tr.of_kind("weight_gradient"))
    produced = _rows_of(t, tr.batch[rows], tr.stage[rows], tr.direction[rows])
    found = produced >= 0
    starts = np.where(found, t.end[np.maximum(produced, 0)] if len(t) else 0.0, tr.start[rows])
    amounts = tr.nbytes[rows] if in_bytes else np.ones(len(rows))
    return tr.src[rows], np.minimum(starts, tr.start[rows]), tr.end[rows], amounts


def _rows_of(t: Timeline, batch, stage, direction) -> np.ndarray:
    """The timeline row of each (batch, stage, direction), or -1 where none ran."""
    if not len(t):
        return np.full(len(batch), -1)
    items = dataflow.Items(t.num_stages, t.num_batches, t.split_backward)
    keys = items.id(t.batch, t.stage, t.direction)
    order = np.argsort(keys, kind="stable")
    wanted = items.id(batch, stage, direction)
    at = np.clip(np.searchsorted(keys[order], wanted), 0, len(keys) - 1)
    return np.where(keys[order][at] == wanted, order[at], -1)


def _groups(first: np.ndarray, second: np.ndarray):
    """Index arrays of the rows sharing each (first, second) value."""
    if not len(first):
        return []
    keys = first * (int(second.max()) + 1) + second
    order = np.argsort(keys, kind="stable")
    cuts = np.flatnonzero(np.diff(keys[order])) + 1
    return np.split(order, cuts)


_HOLDS = {
    "activations": _activation_holds,
    "weights": _weight_holds,
    "fetched": _fetched_holds,
    "gradients": _gradient_holds,
}
Timeline.register_view("memory", memory_curves)
