"""Per-worker statistics of a Timeline, with the seed notebook's definitions.

- weight_transmissions: work items the worker computed whose weight worker is
  another worker (each needs that stage's weights fetched), or whose stage is
  held in shards not all of which are the worker's;
- weight_storage: stages the worker is the weight worker of, or holds a
  shard of;
- activation_transmissions: activations, gradients and stashes the worker
  received from another worker;
- max_activation_storage: the most stashed inputs it held at once (see
  :mod:`unisched.memory`).

And the zero-bubble paper's measures of a step that repeats: a worker's
*span*, from the start of its first item to the end of its last, and the
*bubble rate*, the idle share of the longest span (steps that follow each
other overlap the fill of one with the drain of the last, so the span, not
the latency, is what each step costs).
"""

from __future__ import annotations

import math

import numpy as np

from unisched.memory import memory_curves, own_share, weights_held
from unisched.timeline import ACTIVATION_KINDS, Timeline, as_timeline

STAT_COLUMNS = (
    "busy_time",
    "utilization",
    "weight_transmissions",
    "weight_storage",
    "activation_transmissions",
    "max_activation_storage",
    "bytes_sent",
    "bytes_received",
    "peak_memory_bytes",
)


def gap(value: float, bound: float) -> float:
    """How far ``value`` lies above ``bound``, as a fraction of the bound (for a bound of 0 or less:
    0 where ``value`` meets it, else infinite)."""
    if bound > 0:
        return (value - bound) / bound
    return 0.0 if value <= bound else math.inf


def above(value: float, bound: float) -> str:
    """How far ``value`` lies above ``bound``, in words: "12.5% above", "above" (a bound of 0), "at"."""
    if value <= bound:
        return "at"
    return f"{gap(value, bound):.1%} above" if bound > 0 else "above"


def worker_stats(timeline: Timeline) -> dict[str, list]:
    """Column name -> list indexed by worker (columns in ``STAT_COLUMNS``)."""
    timeline = as_timeline(timeline, "worker_stats")
    t, tr, n = timeline, timeline.transfers, timeline.num_workers
    busy = t.busy_time
    latency = t.latency
    fetching = own_share(t, np.arange(len(t))) < 1
    owned = weights_held(t)[0]
    moved = tr.of_kind(*ACTIVATION_KINDS) & (tr.src != tr.dst)
    columns = {
        "busy_time": busy,
        "utilization": busy / latency if latency > 0 else np.zeros(n),
        "weight_transmissions": np.bincount(t.worker[fetching], minlength=n),
        "weight_storage": np.bincount(owned, minlength=n),
        "activation_transmissions": np.bincount(tr.dst[moved], minlength=n),
        "max_activation_storage": [c.peak for c in memory_curves(t, "activations", "units")],
        "bytes_sent": np.bincount(tr.src, weights=tr.nbytes, minlength=n),
        "bytes_received": np.bincount(tr.dst, weights=tr.nbytes, minlength=n),
        "peak_memory_bytes": [c.peak for c in memory_curves(t, "total", "bytes")],
    }
    return {name: [_plain(v) for v in columns[name]] for name in STAT_COLUMNS}


def stage_spans(timeline: Timeline) -> np.ndarray:
    """Per worker: from the start of its first item to the end of its last (0 for an idle worker)."""
    rows, workers = timeline.occupancy()
    n = timeline.num_workers
    first = np.full(n, np.inf)
    last = np.full(n, -np.inf)
    np.minimum.at(first, workers, timeline.start[rows])
    np.maximum.at(last, workers, timeline.end[rows])
    return np.where(last >= first, last - first, 0.0)


def bubble_rate(timeline: Timeline) -> float:
    """The zero-bubble paper's bubble rate, (cost - work) / cost: cost is the
    longest span of any worker, work the busiest worker's busy time (the
    paper's m (T_F + T_B + T_W) when every worker has the same work)."""
    cost = float(stage_spans(timeline).max(initial=0.0))
    return (cost - float(timeline.busy_time.max(initial=0.0))) / cost if cost > 0 else 0.0


def _plain(value):
    """numpy scalar -> int when integral, else float (for JSON and tables)."""
    value = float(value)
    return int(value) if value.is_integer() else value


Timeline.register_view("worker_stats", worker_stats)
