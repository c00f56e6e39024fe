"""Chrome trace event format: open a Timeline in Perfetto (ui.perfetto.dev) or
chrome://tracing.

Layout of the trace:

- one *process* per worker, pid N + 1, named ``worker N`` (``process_name``
  and ``process_sort_index`` metadata events, so workers appear in order;
  ids start at 1 because some viewers treat pid / tid 0 as special);
- in it, thread 1 (named ``worker N``) holds one complete event
  (``"ph": "X"``) per work item the worker computed, named like ``F3``
  (direction letter + stage), category ``compute``, with the batch, stage,
  direction and weight worker in ``args``;
- further threads ``send`` hold the transfers the worker sends (category
  ``transfer``, named e.g. ``activation -> w2``); items or transfers that
  overlap in time on one worker are spread over extra lanes (``worker N
  (2)``, ``send (2)``), because the viewers do not nest overlapping slices;
- counter events (``"ph": "C"``) per worker: ``activations`` (stashed inputs,
  in units) and, when sizes are known, ``memory`` in bytes.

Times: one unit of the timeline is one second unless ``time_unit`` says
otherwise (``"ms"``, ``"us"``, ``"ns"`` or a number of seconds), and the trace
holds microseconds, as the format wants.  A measured timeline is in seconds;
a simulated one is in the unit of its costs, so costs given in seconds
(calibrated ones are) line up with a measured trace of the same step, and
costs in milliseconds want ``time_unit="ms"``.
"""

from __future__ import annotations

import math

import numpy as np

from unisched.errors import UniSchedError
from unisched.render._common import DIRECTION_NAMES, LETTERS, lanes, time_origin
from unisched.timeline import TRANSFER_KINDS, Timeline, as_timeline

COMPUTE_TID = 1
"""Thread id of a worker's compute track (overlap lanes follow: 2, 3, ...)."""
SEND_TID = 1001
"""Thread ids of the send lanes start here."""


LONGEST_US = 2.0 ** 53
"""The longest step a trace holds, in microseconds: past it a double no longer counts whole ones."""


def pid_of(worker: int) -> int:
    """Process id of a worker's tracks."""
    return worker + 1


TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
"""Names ``time_unit`` takes, in seconds."""


def unit_seconds(time_unit: str | float = "s") -> float:
    """Seconds in one time unit: a name of :data:`TIME_UNITS` or a positive number (also as text, as the
    command line gives it)."""
    if isinstance(time_unit, str):
        name = time_unit.strip().lower()
        if name in TIME_UNITS:
            return TIME_UNITS[name]
        try:
            time_unit = float(name)
        except ValueError:
            raise UniSchedError(
                f"unknown time unit {time_unit!r}; use one of {', '.join(TIME_UNITS)} or a number of seconds"
            ) from None
    if isinstance(time_unit, bool) or not isinstance(time_unit, (int, float, np.number)) or not (
        0 < float(time_unit) < math.inf
    ):
        raise UniSchedError(f"time_unit must be a unit name or a positive number of seconds, got {time_unit!r}")
    return float(time_unit)


def to_chrome_trace(timeline: Timeline, time_unit: str | float = "s") -> dict:
    """The trace as a JSON-ready dict ``{"traceEvents": [...], ...}``.

    ``time_unit``: what one unit of the timeline's times is (default one
    second: a measured timeline, or a simulation whose costs are in seconds);
    e.g. ``"ms"`` for costs in milliseconds.  Events are in microseconds."""
    timeline = as_timeline(timeline, "to_chrome_trace")
    seconds = unit_seconds(time_unit)
    timeline = timeline.per_worker()  # a gang item is drawn on each of its workers
    scale = seconds * 1e6  # microseconds per time unit
    origin = time_origin(timeline)
    span = timeline.latency * scale
    if not span <= LONGEST_US:
        raise UniSchedError(f"a step of {timeline.latency:g} units of {seconds:g} s is too long for a trace in "
                            f"microseconds (more than 2**53 us, where they stop being whole); give a smaller time_unit")
    # Rounded to 12 significant digits of the step (and at least to the nanosecond), so that back-to-back
    # slices touch exactly however small the unit.
    decimals = max(3, 12 - math.ceil(math.log10(span))) if span > 0 else 3
    W = timeline.num_workers
    events: list[dict] = []

    def us(t) -> np.ndarray:
        return np.round((np.asarray(t, dtype=float) - origin) * scale, decimals)

    for w in range(W):
        pid = pid_of(w)
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": COMPUTE_TID, "args": {"name": f"worker {w}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": COMPUTE_TID, "args": {"sort_index": w}})

    # ---- work items
    ts, te = us(timeline.start), us(timeline.end)
    lane = np.zeros(len(timeline), dtype=np.int64)
    for w in np.unique(timeline.worker).tolist():
        rows = np.flatnonzero(timeline.worker == w)
        lane[rows] = lanes(ts[rows], te[rows])
    named: set[tuple[int, int]] = set()
    for i in range(len(timeline)):
        w, l = int(timeline.worker[i]), int(lane[i])
        tid = COMPUTE_TID + l
        if (w, tid) not in named:
            named.add((w, tid))
            events += _thread_name(pid_of(w), tid, f"worker {w}" + (f" ({l + 1})" if l else ""))
        letter = LETTERS[int(timeline.direction[i])]
        stage, batch, ww = int(timeline.stage[i]), int(timeline.batch[i]), int(timeline.weight_worker[i])
        events.append(
            {
                "name": f"{letter}{stage}",
                "cat": "compute",
                "ph": "X",
                "pid": pid_of(w),
                "tid": tid,
                "ts": float(ts[i]),
                "dur": float(max(round(te[i] - ts[i], decimals), 0.0)),
                "args": {
                    "batch": batch,
                    "stage": stage,
                    "direction": DIRECTION_NAMES[letter],
                    "weight_worker": ww,
                    "work": f"{stage}{letter}{batch}",
                },
            }
        )

    # ---- transfers, on the sender's send lanes
    tr = timeline.transfers
    if len(tr):
        ss, se = us(tr.start), us(tr.end)
        lane = np.zeros(len(tr), dtype=np.int64)
        for w in np.unique(tr.src).tolist():
            rows = np.flatnonzero(tr.src == w)
            lane[rows] = lanes(ss[rows], se[rows])
        for i in range(len(tr)):
            src, dst, l = int(tr.src[i]), int(tr.dst[i]), int(lane[i])
            tid = SEND_TID + l
            if (src, tid) not in named:
                named.add((src, tid))
                events += _thread_name(pid_of(src), tid, "send" + (f" ({l + 1})" if l else ""))
            kind = TRANSFER_KINDS[int(tr.kind[i])]
            args = {"kind": kind, "src": src, "dst": dst, "bytes": float(tr.nbytes[i])}
            if tr.batch[i] >= 0:
                letter = LETTERS[int(tr.direction[i])]
                args["for"] = f"{int(tr.stage[i])}{letter}{int(tr.batch[i])}"
            events.append(
                {
                    "name": f"{kind} -> w{dst}",
                    "cat": "transfer",
                    "ph": "X",
                    "pid": pid_of(src),
                    "tid": tid,
                    "ts": float(ss[i]),
                    "dur": float(max(round(se[i] - ss[i], decimals), 0.0)),
                    "args": args,
                }
            )

    # ---- memory counters
    events += _counters(timeline, "activations", "units", "activations", "stashed", us)
    if np.any(timeline.activation_bytes > 0) or np.any(timeline.weight_bytes > 0):
        events += _counters(timeline, "total", "bytes", "memory", "bytes", us)

    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "unisched",
            "label": timeline.label,
            "source": timeline.source,
            "time_unit": f"1 unit = {seconds:g} s",
            "unit_seconds": seconds,
            "num_workers": W,
            "num_stages": timeline.num_stages,
            "num_batches": timeline.num_batches,
            "latency": float(timeline.latency),
            "bubble_fraction": float(timeline.bubble_fraction),
        },
    }


def _thread_name(pid: int, tid: int, name: str) -> list[dict]:
    return [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}},
        {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}},
    ]


def _counters(timeline: Timeline, kind: str, unit: str, name: str, series: str, us) -> list[dict]:
    out = []
    for w, curve in enumerate(timeline.memory(kind, unit)):
        times = us(curve.times)
        values = curve.values
        previous = None
        for t, v in zip(times.tolist(), values.tolist()):
            if t < 0:
                t = 0.0
            v = int(v) if float(v).is_integer() else float(v)
            if v == previous:
                continue
            previous = v
            out.append({"name": name, "ph": "C", "pid": pid_of(w), "tid": COMPUTE_TID, "ts": t, "args": {series: v}})
    return out
