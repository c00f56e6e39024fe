"""Measured timelines and cost calibration.

Each rank notes when every work item started and ended (``perf_counter`` on
CPU, CUDA events on a GPU), when it posted each send and when each receive
completed; rank 0 gathers the notes into a :class:`unisched.Timeline` with
``source="measured"``, the same type the simulator makes, so a real step is
drawn, saved and compared exactly like a simulated one.

:func:`calibrate_costs` turns measured timelines into :class:`unisched.Costs`
(per-stage forward and backward times, activation and weight sizes, and a
per-message latency), so the simulator can predict the real step.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from unisched.costs import Costs
from unisched.dataflow import first_backward
from unisched.errors import ShapeError
from unisched.execute.program import schedule_timeline, value_stage
from unisched.simulate import Simulation, simulate
from unisched.timeline import Timeline, TransferRecord, WorkRecord
from unisched.work import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Direction, Work

class Clock:
    """Host time in seconds; on a GPU, marks are CUDA events on the current
    stream, resolved after the step's one sync.  The events are made once
    and reused step after step (a step's marks are resolved before the next
    step begins), and the stream is found once per step: each mark costs one
    event record."""

    def __init__(self, device=None):
        self.cuda = device is not None and getattr(device, "type", str(device)).startswith("cuda")
        self._events: list = []
        self._used = 0
        self._stream = None
        self._origin_event = None
        self._origin_host = 0.0

    def begin(self) -> float:
        now = time.perf_counter()
        if self.cuda:
            import torch

            self._stream = torch.cuda.current_stream()
            self._used = 0
            self._origin_host = now
            self._origin_event = self.mark()
        return now

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        if self._used == len(self._events):
            import torch

            self._events.append(torch.cuda.Event(enable_timing=True))
        event = self._events[self._used]
        self._used += 1
        event.record(self._stream)
        return event

    def resolve(self, mark) -> float:
        if self.cuda and not isinstance(mark, float):
            return self._origin_host + self._origin_event.elapsed_time(mark) / 1000.0
        return float(mark)

    def resolve_spans(self, spans) -> list[tuple[int, float, float]]:
        """``(index, start mark, end mark)`` as ``(index, seconds, seconds)``,
        each mark resolved once (consecutive items share one)."""
        seconds = {}

        def resolved(mark):
            found = seconds.get(id(mark))
            if found is None:
                found = seconds[id(mark)] = self.resolve(mark)
            return found

        return [(i, resolved(a), resolved(z)) for i, a, z in spans]

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()


@dataclass
class RankNotes:
    """What one rank saw during one step (times already resolved to seconds)."""

    rank: int
    begin: float
    items: list[tuple[Work, float, float]] = field(default_factory=list)
    sends: dict[int, float] = field(default_factory=dict)
    receives: dict[int, tuple[float, float]] = field(default_factory=dict)
    reduces: list[tuple[tuple[int, ...], float, float, float]] = field(default_factory=list)
    end: float = 0.0


class NotesLayout:
    """How one rank's :class:`RankNotes` travel to rank 0: as one float64
    tensor of a length every rank knows from the program (no pickling, one
    ``gather``).  Items are named by their index in the rank's actions,
    all-reduces by their replica set's index in ``program.groups()``.

    ``[begin, end, #items, #sends, #receives, #reduces]`` then per item
    ``(action index, start, end)``, per send ``(message, posted)``, per
    receive ``(message, wait start, wait end)``, per all-reduce ``(group,
    bytes, start, end)``, padded with zeros."""

    HEAD = 6

    def __init__(self, program):
        self.program = program
        self.groups = program.groups()
        self.group_ids = {g: i for i, g in enumerate(self.groups)}
        self.length = self.HEAD + max(
            3 * sum(a.is_compute for a in acts) + 2 * sum(a.is_send for a in acts)
            + 3 * sum(a.is_recv for a in acts) + 4 * sum(a.op == "R" for a in acts)
            for acts in program.actions
        )

    def pack(self, begin: float, end: float, items, sends: dict, receives: dict, reduces) -> "np.ndarray":
        """``items``: (action index, start, end); ``reduces``: (group, bytes, start, end)."""
        flat = np.zeros(self.length)
        flat[: self.HEAD] = begin, end, len(items), len(sends), len(receives), len(reduces)
        rows = [np.asarray(items, dtype=float).reshape(-1, 3),
                np.asarray(list(sends.items()), dtype=float).reshape(-1, 2),
                np.asarray([(m, a, z) for m, (a, z) in receives.items()], dtype=float).reshape(-1, 3),
                np.asarray([(self.group_ids[g], n, a, z) for g, n, a, z in reduces], dtype=float).reshape(-1, 4)]
        at = self.HEAD
        for block in rows:
            flat[at: at + block.size] = block.reshape(-1)
            at += block.size
        return flat

    def unpack(self, rank: int, flat: "np.ndarray") -> RankNotes:
        begin, end, *counts = flat[: self.HEAD]
        blocks, at = [], self.HEAD
        for count, width in zip(counts, (3, 2, 3, 4)):
            n = int(count) * width
            blocks.append(flat[at: at + n].reshape(-1, width))
            at += n
        items, sends, receives, reduces = blocks
        actions = self.program.actions[rank]
        return RankNotes(
            rank, float(begin),
            [(actions[int(i)].work, float(a), float(z)) for i, a, z in items],
            {int(m): float(t) for m, t in sends},
            {int(m): (float(a), float(z)) for m, a, z in receives},
            [(self.groups[int(g)], float(n), float(a), float(z)) for g, n, a, z in reduces],
            float(end),
        )


def assemble(program, notes: Sequence[RankNotes], activation_bytes, output_bytes, weight_bytes, offsets=None,
             label="", gradient_bytes=None) -> Timeline:
    """One measured Timeline from every rank's notes, times from the earliest step start.

    ``activation_bytes[s]``: stage s's inputs for one micro-batch;
    ``output_bytes[s]``: its output, the size of every message that carries
    that output or a stash of it; ``gradient_bytes[s]``: the size of a
    message with its gradient, which carries only the output's tensors that
    need one (all of it when not given)."""
    gradient_bytes = output_bytes if gradient_bytes is None else gradient_bytes
    offsets = offsets or [0.0] * len(notes)
    origin = min(n.begin - offsets[n.rank] for n in notes)

    def at(rank: int, t: float) -> float:
        return t - offsets[rank] - origin

    records = []
    for n in notes:
        for work, start, end in n.items:
            records.append(WorkRecord(work, n.rank, program.weight_worker[work], at(n.rank, start), at(n.rank, end)))
    sent = {}
    for n in notes:
        for index, t in n.sends.items():
            sent[index] = at(n.rank, t)
    transfers = []
    for n in notes:
        for index, (wait_start, wait_end) in n.receives.items():
            msg = program.messages[index]
            start = sent.get(index, at(n.rank, wait_start))
            end = max(at(n.rank, wait_end), start)
            transfers.append(
                TransferRecord(msg.kind, msg.src, msg.dst, start, end,
                               _message_bytes(msg, output_bytes, gradient_bytes, weight_bytes), _served_work(program, msg))
            )
        for group, nbytes, start, end in n.reduces:
            nxt = group[(group.index(n.rank) + 1) % len(group)]
            transfers.append(TransferRecord("allreduce", n.rank, nxt, at(n.rank, start), at(n.rank, end), nbytes, None))
    return Timeline.from_records(
        (program.num_ranks, program.num_stages, program.num_batches),
        records,
        transfers,
        activation_bytes=np.asarray(activation_bytes, dtype=float),
        weight_bytes=np.asarray(weight_bytes, dtype=float),
        split_backward=program.split_backward,
        stage_graph=program.stage_graph,
        source="measured",
        label=label,
    )


def _message_bytes(msg, output_bytes, gradient_bytes, weight_bytes) -> float:
    if msg.letter in "wr":
        return float(weight_bytes[msg.stage])
    return float((gradient_bytes if msg.key[0] == "g" else output_bytes)[value_stage(msg.key)])


def _served_work(program, msg) -> Work | None:
    """The work item a message feeds (as the simulator labels transfers)."""
    if msg.letter in "FBI":
        return Work(msg.batch, msg.stage, Direction.from_letter(msg.letter))
    if msg.letter in "XV":
        direction = first_backward(program.split_backward)
        if msg.letter == "V" or program.compute_worker[Work(msg.batch, msg.stage, direction)] != msg.dst:
            direction = BACKWARD_WEIGHT
        return Work(msg.batch, msg.stage, direction)
    return None


# ---------------------------------------------------------------------- calibration
class UnmeasuredBandwidth(UserWarning):
    """:func:`calibrate_costs` found nothing to measure the bandwidth by (no weights moved, no
    all-reduce ran) while the stages have weights: it is left infinite."""


def calibrate_costs(
    timelines: Timeline | Iterable[Timeline],
    *,
    activation_bytes: float | Sequence[float] | None = None,
    weight_bytes: float | Sequence[float] | None = None,
    communication: bool = True,
    overhead: bool = True,
) -> Costs:
    """Fit :class:`unisched.Costs` to measured timelines.

    Per stage and direction, the median measured duration; activation and
    weight sizes from the timelines unless given.  With ``communication``, a
    per-message latency and the all-reduce bandwidth.  The latency is the
    10th percentile of the spans from a send's post to the end of its
    receive (activations, gradients and stashes between different ranks):
    a span ends when the receiver got the message, which is later than its
    arrival when the receiver was busy, so a low percentile rather than the
    median.  The bandwidth comes from the gradient all-reduces (when there
    are replicas), else from the weights and weight gradients sent between
    ranks (the median of their bytes over their spans): a fetch or a
    returned gradient is a whole stage's weights, and how long it is in
    flight says how long its buffers live.  Steps that move neither leave
    the bandwidth infinite, with a warning (weight fetches would be free).  The simulator times every
    transfer with it, activations too, whose latency already holds their
    bytes' time: counted twice, which is small where activations are small
    beside weights.  Give a ``Trainer`` instead of timelines with
    :meth:`Trainer.calibrate`, which runs the profiling steps first.

    With ``overhead``, the runtime's own time per item (posting transfers,
    bookkeeping: the median gap between consecutive items of a worker when
    no transfer to it ended in the gap) is added once to every item, since
    the simulator has no such term: ``forward = F + o`` and, unsplit,
    ``backward = B + o``.  With a split backward the two halves are items
    of their own, ``backward_input = I + o`` and ``backward_weight = W + o``,
    while ``backward`` (what a schedule that does not split runs as one
    item) is ``I + W + o``.
    """
    if isinstance(timelines, Timeline):
        timelines = [timelines]
    timelines = [t for t in timelines if t is not None]
    if not timelines:
        raise ShapeError("calibrate_costs needs at least one measured Timeline (trainer.last_timeline on rank 0)")
    first = timelines[0]
    S = first.num_stages
    if any(t.num_stages != S for t in timelines):
        raise ShapeError("calibrate_costs got timelines with different numbers of stages; calibrate one model at a time")
    durations: dict[Direction, list[list[float]]] = {d: [[] for _ in range(S)] for d in Direction}
    for t in timelines:
        for s, d, start, end in zip(t.stage, t.direction, t.start, t.end):
            durations[Direction(int(d))][int(s)].append(float(end - start))

    def medians(direction: Direction) -> list[float] | None:
        rows = durations[direction]
        if not all(rows):
            return None
        return [float(np.median(r)) for r in rows]

    extra = _item_overhead(timelines) if overhead else 0.0
    forward = medians(FORWARD)
    if forward is None:
        raise ShapeError("the measured timelines have no forward of some stage; calibrate from complete steps")
    split = first.split_backward
    fields = {"forward": [f + extra for f in forward]}
    if split:
        inputs, weights = medians(BACKWARD_INPUT), medians(BACKWARD_WEIGHT)
        if inputs is None or weights is None:
            raise ShapeError("the measured timelines lack a backward half of some stage; calibrate from complete steps")
        fields["backward_input"] = [i + extra for i in inputs]
        fields["backward_weight"] = [w + extra for w in weights]  # the whole backward is their sum
    else:
        backward = medians(BACKWARD)
        if backward is None:
            raise ShapeError("the measured timelines have no backward of some stage; calibrate from complete steps")
        fields["backward"] = [b + extra for b in backward]
    fields["activation_bytes"] = list(first.activation_bytes) if activation_bytes is None else activation_bytes
    fields["weight_bytes"] = list(first.weight_bytes) if weight_bytes is None else weight_bytes
    if communication:
        fields["latency"] = _message_latency(timelines)
        bandwidth = _allreduce_bandwidth(timelines) or _weight_bandwidth(timelines)
        if bandwidth is not None:
            fields["bandwidth"] = bandwidth
        elif any(fields["weight_bytes"]):
            warnings.warn("calibrate_costs: the measured steps moved no weights and ran no all-reduce, so the "
                          "bandwidth is left infinite and a plan made with these costs fetches weights for free; "
                          "calibrate under a schedule that moves weights (fsdp, a plan that fetches them), or set "
                          "Costs.bandwidth", UnmeasuredBandwidth, stacklevel=2)
    return Costs(**fields)


def predict(schedule, costs: Costs) -> Simulation:
    """Re-time the schedule that ran with ``costs`` (e.g. calibrated ones).

    ``schedule`` is a Simulation, a Timeline (e.g. a measured one) or a plan
    (anything with ``.simulate()``).  Every item stays on its workers and
    every worker runs its items in the order they ran (see
    :meth:`Timeline.as_strategy`), as the executor does; only the times
    change.  No memory limit applies: the order already says when each
    forward runs, and the runtime does not wait for memory."""
    timeline, _, _ = schedule_timeline(schedule)
    return simulate(
        *timeline.shape,
        timeline.as_strategy(),
        costs=costs,
        split_backward=timeline.split_backward,
        stage_graph=timeline.stage_graph,
    )


def _item_overhead(timelines: Sequence[Timeline]) -> float:
    """Median gap between consecutive items of a worker when no transfer to it ended in the gap."""
    gaps = []
    for t in timelines:
        tr = t.transfers
        inbound = tr.of_kind("activation", "gradient", "stash", "weights")
        for w in range(t.num_workers):
            rows = np.flatnonzero(t.worker == w)
            rows = rows[np.argsort(t.start[rows], kind="stable")]
            arrivals = np.sort(tr.end[inbound & (tr.dst == w)])
            for prev, nxt in zip(rows[:-1], rows[1:]):
                lo, hi = t.end[prev], t.start[nxt]
                first = np.searchsorted(arrivals, lo, side="right")
                if first < len(arrivals) and arrivals[first] <= hi + 1e-9:
                    continue
                gaps.append(max(hi - lo, 0.0))
    return float(np.median(gaps)) if gaps else 0.0


def _allreduce_bandwidth(timelines: Sequence[Timeline]) -> float | None:
    """Bytes per second of the gradient all-reduce: per step and worker, its
    last posted all-reduce (the one that does not overlap compute)."""
    rates = []
    for t in timelines:
        tr = t.transfers
        rows = np.flatnonzero(tr.of_kind("allreduce"))
        for w in np.unique(tr.src[rows]):
            mine = rows[tr.src[rows] == w]
            last = mine[np.argmax(tr.start[mine])]
            span = tr.end[last] - tr.start[last]
            if span > 0 and tr.nbytes[last] > 0:
                rates.append(tr.nbytes[last] / span)
    return float(np.median(rates)) if rates else None


def _weight_bandwidth(timelines: Sequence[Timeline]) -> float | None:
    """Bytes per second of the weights and weight gradients sent between
    ranks: the median of each transfer's bytes over its span (from the
    send's post to the end of its receive; a span of zero says nothing)."""
    rates = []
    for t in timelines:
        tr = t.transfers
        rows = np.flatnonzero(tr.of_kind("weights", "weight_gradient") & (tr.src != tr.dst) & (tr.nbytes > 0)
                              & (tr.end > tr.start))
        rates.extend((tr.nbytes[rows] / (tr.end[rows] - tr.start[rows])).tolist())
    return float(np.median(rates)) if rates else None


def _message_latency(timelines: Sequence[Timeline]) -> float:
    spans = []
    for t in timelines:
        tr = t.transfers
        moved = tr.of_kind("activation", "gradient", "stash") & (tr.src != tr.dst)
        spans.extend((tr.end[moved] - tr.start[moved]).tolist())
    return float(np.percentile(spans, 10)) if spans else 0.0


__all__ = ["Clock", "NotesLayout", "RankNotes", "assemble", "calibrate_costs", "predict"]
