"""torch.distributed.pipelining's schedules, as unisched strategies, and its
CSV schedule format, both ways.

Each of torch's schedule classes is a fixed order of actions per rank.  The
strategies here rebuild those orders rule for rule (without importing
torch) and fix them (``Strategy.worker_orders``), so ``Schedule1F1B``
simulated here runs what torch runs, under any costs:

- ``ScheduleGPipe``, ``Schedule1F1B``: stage s on rank s, full backwards (B);
- ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``: stage s on rank s mod W, B;
- ``ScheduleInterleavedZeroBubble``: stage s on rank s mod W, split backwards (I and W);
- ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``: stages r and 2W - 1 - r on
  rank r (a V), I and W (DualPipeV's full backwards run as I then W).

The CSV format is the one ``_PipelineScheduleRuntime._load_csv`` reads and
``_dump_csv`` writes: one row per rank, one cell per action in the order the
rank runs them.  A compute cell is stage, pass and micro-batch (``2F0``,
``1I3``, ``0W1``, ``3B2``); an empty cell is an idle step; ``(0F7;7B3)OVERLAP_F_B``
runs its actions one after the other (DualPipeV's overlapped pair); the
communication and bookkeeping cells of torch's lowered form (``SEND_F``,
``RECV_B``, ``REDUCE_GRAD``, ``UNSHARD``, ...) follow from the compute cells
and are read past.
"""

from __future__ import annotations

import csv
import io
import os
import re
from itertools import islice
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from unisched import dataflow
from unisched.errors import UniSchedError
from unisched.policies._orders import Columns, fixed_orders, warmup_steady_orders
from unisched.policies._registry import Entry, require
from unisched.policies.pipeline import stage_modulo_workers
from unisched.policies.zero_bubble import _pipeline_shape, _v_mapping, _v_shape, dualpipe_v_columns, zbv_columns
from unisched.simulate import simulate
from unisched.strategy import Strategy, fixed_strategy
from unisched.timeline import Timeline
from unisched.work import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Direction,
    Shape,
    Work,
    directions,
    is_whole,
)

Orders = dict[int, list[Work]]


class TorchCSVError(UniSchedError, ValueError):
    """A torch CSV schedule that cannot be read, or a schedule that torch's
    format (or its runtime) cannot express."""


# ====================================================================== torch's schedules
def schedule_gpipe(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """torch's ``ScheduleGPipe``: every forward (micro-batch 0 first), then every backward (0 first)."""
    shape = _pipeline_shape("ScheduleGPipe", num_workers, num_stages, num_batches)
    batches = np.tile(np.arange(num_batches), 2)
    passes = np.repeat([FORWARD, BACKWARD], num_batches)
    return _torch_strategy(GPIPE, shape, lambda r: (batches, np.full(2 * num_batches, r), passes),
                           stage_modulo_workers(num_workers))


def schedule_1f1b(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """torch's ``Schedule1F1B`` as its ``_step_microbatches`` runs it: S - s
    forwards on stage s's rank, then one backward one forward, then the
    remaining backwards."""
    shape = _pipeline_shape("Schedule1F1B", num_workers, num_stages, num_batches)
    require(num_batches >= num_stages, "Schedule1F1B",
            f"torch needs at least as many micro-batches as stages, got B={num_batches}, S={num_stages}")
    ranks = np.arange(num_workers)
    return _torch_strategy(ONE_F_ONE_B, shape, warmup_steady_orders(ranks, num_batches, num_stages - ranks),
                           stage_modulo_workers(num_workers))


def schedule_interleaved_1f1b(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """torch's ``ScheduleInterleaved1F1B``: v = S / W stages per rank (stage s
    on rank s mod W), forwards in rounds of micro-batches per stage, warm-up
    (v - 1) * round + 2 (W - 1 - r) forwards on rank r."""
    shape, v, per_round = _interleaved_shape("ScheduleInterleaved1F1B", num_workers, num_stages, num_batches)
    return _torch_strategy(INTERLEAVED_1F1B, shape,
                           _interleaved_orders(num_workers, v, num_batches, per_round, zero_bubble=False),
                           stage_modulo_workers(num_workers))


def schedule_looped_bfs(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """torch's ``ScheduleLoopedBFS``: each local stage for every micro-batch in
    turn, then the backwards from the last local stage and the last micro-batch."""
    num_workers, num_stages, num_batches = shape = Shape(num_workers, num_stages, num_batches).check()
    require(num_stages % num_workers == 0, "ScheduleLoopedBFS",
            f"puts stages r, r + W, ... on rank r, so S must be a multiple of W; got S={num_stages}, W={num_workers}")

    def order(rank: int) -> Columns:
        stages, batches = np.arange(rank, num_stages, num_workers), np.arange(num_batches)
        return (np.concatenate([np.tile(batches, len(stages)), np.tile(batches[::-1], len(stages))]),
                np.concatenate([np.repeat(stages, num_batches), np.repeat(stages[::-1], num_batches)]),
                np.repeat([FORWARD, BACKWARD], len(stages) * num_batches))

    return _torch_strategy(LOOPED_BFS, shape, order, stage_modulo_workers(num_workers))


def schedule_interleaved_zero_bubble(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """torch's ``ScheduleInterleavedZeroBubble`` (ZB1P): the interleaved order
    with one warm-up forward fewer per hop, I passes for backwards, and each W
    pass run r forward-backward pairs after its I on rank r."""
    shape, v, per_round = _interleaved_shape("ScheduleInterleavedZeroBubble", num_workers, num_stages, num_batches)
    return _torch_strategy(INTERLEAVED_ZERO_BUBBLE, shape,
                           _interleaved_orders(num_workers, v, num_batches, per_round, zero_bubble=True),
                           stage_modulo_workers(num_workers), split_backward=True)


def schedule_zbv_zero_bubble(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """torch's ``ScheduleZBVZeroBubble``: stages r and 2W - 1 - r on rank r,
    designed for at least 2W - 1 micro-batches (the passes of the ones that do
    not exist are left out, as torch does)."""
    shape = _v_shape("ScheduleZBVZeroBubble", num_workers, num_stages, num_batches)
    return _torch_strategy(ZBV_ZERO_BUBBLE, shape, lambda r: zbv_columns(num_workers, r, num_batches),
                           _v_mapping(num_workers), split_backward=True)


def schedule_dualpipe_v(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """torch's ``ScheduleDualPipeV``: DualPipeV's phases on the V placement,
    the order of :func:`~unisched.policies.dualpipe_v_order` (torch's, with
    its overlapped forward-backward pairs run one after the other, as torch's
    runtime runs them, and its full backwards as an I pass then a W pass)."""
    shape = _v_shape("ScheduleDualPipeV", num_workers, num_stages, num_batches)
    require(num_batches >= num_stages, "ScheduleDualPipeV",
            f"torch needs at least as many micro-batches as stages, got B={num_batches}, S={num_stages}")
    return _torch_strategy(DUALPIPE_V, shape, lambda r: dualpipe_v_columns(num_workers, r, num_batches),
                           _v_mapping(num_workers), split_backward=True)


def split_full_backwards(order: Iterable[Work]) -> list[Work]:
    """Each full backward B of ``order`` as its I pass followed by its W pass."""
    out = []
    for work in order:
        if Direction(work.direction) is BACKWARD:
            out += [Work(work.batch, work.stage, BACKWARD_INPUT), Work(work.batch, work.stage, BACKWARD_WEIGHT)]
        else:
            out.append(work)
    return out


# ---------------------------------------------------------------------- torch's rules, every rank at once
def _interleaved_orders(p: int, v: int, m: int, per_round: int, zero_bubble: bool) -> Columns:
    """``_get_1f1b_rank_ops`` of torch's interleaved schedules, idle steps left
    out, for ranks r = 0..p-1 (rank r holds stages r, r + p, ...): (v - 1)
    rounds plus 2 (p - 1 - r) forwards (p - 1 - r for ZB1P) before the
    forward-backward pairs, and ZB1P's W passes r backwards late."""
    ranks = np.arange(p)
    pairs_from = (v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - ranks)
    return warmup_steady_orders(ranks[:, None] + p * np.arange(v), m, 1 + pairs_from,
                                ranks if zero_bubble else None, per_round)


# ---------------------------------------------------------------------- shapes, placements, the strategy
def _interleaved_shape(name: str, W: int, S: int, B: int) -> tuple[Shape, int, int]:
    W, S, B = shape = Shape(W, S, B).check()
    require(S % W == 0, name,
            f"puts stages r, r + W, ... on rank r, so S must be a multiple of W; got S={S}, W={W}")
    rounds = max(1, B // W)
    require(B % rounds == 0, name,
            f"takes micro-batches in {rounds} rounds (B // W), so B must be a multiple of {rounds}; got B={B}")
    return shape, S // W, B // rounds


def _torch_strategy(entry: Entry, shape: Shape, order: Callable[[int], Columns] | Columns,
                    placement: tuple[Callable, Callable], *, split_backward: bool = False) -> Strategy:
    """torch's orders (rank r's is ``order(r)``, or row r of every rank's at once) on a placement of
    the policies (``stage_modulo_workers`` or the V of ``zero_bubble``): its mapping and vectorised form."""
    mapping, map_arrays = placement
    return Strategy(mapping, name=entry.name, description=entry.description, split_backward=split_backward,
                    worker_orders=fixed_orders(shape, split_backward, order), shape=shape, map_arrays=map_arrays)


def _blocked(orders: Mapping[int, Sequence[Work]], num_stages: int, split_backward: bool) -> str | None:
    """Where per-rank ``orders`` (every pass of a step, once) wait on each
    other for good: each stuck rank's next pass and what it waits for (None
    when they run through).  Dependencies are :func:`unisched.dataflow.dependencies`."""
    done: set[Work] = set()
    position = {rank: 0 for rank in orders}

    def needs(rank: int) -> list[Work]:
        work = orders[rank][position[rank]]
        return [d for d in dataflow.dependencies(work, num_stages, split_backward=split_backward) if d not in done]

    progress = True
    while progress:
        progress = False
        for rank, order in orders.items():
            while position[rank] < len(order) and not needs(rank):
                done.add(order[position[rank]])
                position[rank] += 1
                progress = True
    stuck = [rank for rank, order in orders.items() if position[rank] < len(order)]
    return "; ".join(f"rank {rank} step {position[rank]} ({orders[rank][position[rank]]}) waits for "
                     f"{', '.join(map(str, needs(rank)))}" for rank in stuck) or None


# ---------------------------------------------------------------------- registry entries
def _entry(name: str, factory, description: str, constraints: str) -> Entry:
    return Entry(name=name, factory=factory, description=description, family="torch", constraints=constraints)


GPIPE = _entry("ScheduleGPipe", schedule_gpipe,
               "torch's ScheduleGPipe: stage s on rank s, every forward then every backward (fill-drain)", "W = S")
ONE_F_ONE_B = _entry("Schedule1F1B", schedule_1f1b,
                     "torch's Schedule1F1B: stage s on rank s, S - s warm-up forwards, then one backward one forward",
                     "W = S, B >= S")
INTERLEAVED_1F1B = _entry("ScheduleInterleaved1F1B", schedule_interleaved_1f1b,
                          "torch's ScheduleInterleaved1F1B: stage s on rank s mod W, depth first, fixed order",
                          "S = vW, B a multiple of max(1, B // W)")
LOOPED_BFS = _entry("ScheduleLoopedBFS", schedule_looped_bfs,
                    "torch's ScheduleLoopedBFS: stage s on rank s mod W, each stage for every micro-batch in turn",
                    "S a multiple of W")
INTERLEAVED_ZERO_BUBBLE = _entry("ScheduleInterleavedZeroBubble", schedule_interleaved_zero_bubble,
                                 "torch's ScheduleInterleavedZeroBubble (ZB1P): stage s on rank s mod W, "
                                 "split backward",
                                 "S = vW, B a multiple of max(1, B // W)")
ZBV_ZERO_BUBBLE = _entry("ScheduleZBVZeroBubble", schedule_zbv_zero_bubble,
                         "torch's ScheduleZBVZeroBubble: stages r and 2W-1-r on rank r, split backward", "S = 2W")
DUALPIPE_V = _entry("ScheduleDualPipeV", schedule_dualpipe_v,
                    "torch's ScheduleDualPipeV: V placement, DualPipeV's phases; overlapped pairs run back to back",
                    "S = 2W, B >= S")

ALIASES = (GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B, LOOPED_BFS, INTERLEAVED_ZERO_BUBBLE, ZBV_ZERO_BUBBLE, DUALPIPE_V)
"""torch's schedule classes, by their class names."""


# ====================================================================== the CSV format
_COMPUTE = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD_INPUT, "W": BACKWARD_WEIGHT}
_OTHER = ("UNSHARD", "RESHARD", "REDUCE_GRAD", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
_ACTION = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")


def from_torch_csv(source: str | os.PathLike | io.TextIOBase, *, num_stages: int | None = None,
                   num_batches: int | None = None, split_full_backward: bool = False,
                   name: str | None = None) -> Strategy:
    """A strategy that runs the schedule of a torch CSV file: rank r's row is
    worker r's fixed order, each stage on (and holding its weights on) the
    rank whose row names it.

    ``source`` is a path or an open text file.  The shape comes from the file
    (W = rows, S and B = the largest stage and micro-batch + 1); give
    ``num_stages`` or ``num_batches`` to check them.  A file with I and W
    passes gives a split-backward strategy.  A file that mixes full backwards
    (B) with split ones (I, W), as DualPipeV's does, is refused unless
    ``split_full_backward=True``, which runs each B as its I pass followed by
    its W pass (so does a file of B only).  Raises :class:`TorchCSVError`
    naming the rank and cell at fault.
    """
    for name, value in (("num_stages", num_stages), ("num_batches", num_batches)):
        if value is not None and not is_whole(value):
            raise TorchCSVError(f"from_torch_csv({name}=...) checks the file's count: a whole number >= 1, or None, "
                                f"got {value!r}")
    label, rows = _read_rows(source)
    orders, cells = _parse_rows(label, rows)
    kinds = {Direction(w.direction) for order in orders.values() for w in order}
    full = BACKWARD in kinds
    split = bool(kinds & {BACKWARD_INPUT, BACKWARD_WEIGHT})
    if full and split and not split_full_backward:
        first = next(cells[w] for order in orders.values() for w in order if Direction(w.direction) is BACKWARD)
        raise TorchCSVError(
            f"{label}: mixes full backwards (B, e.g. {first}) with split ones (I and W); unisched runs a step with "
            f"one or the other. Pass split_full_backward=True to run each B as its I pass then its W pass"
        )
    if full and split_full_backward:
        for work in [w for order in orders.values() for w in order if Direction(w.direction) is BACKWARD]:
            for half in split_full_backwards([work]):
                cells.setdefault(half, cells[work])
        orders = {rank: split_full_backwards(order) for rank, order in orders.items()}
        split = True
    items = [w for order in orders.values() for w in order]
    if not items:
        raise TorchCSVError(f"{label}: names no compute action (cells such as 2F0, 1B3, 0I1, 0W1)")
    S = max(w.stage for w in items) + 1
    B = max(w.batch for w in items) + 1
    for given, found, what in ((num_stages, S, "stages"), (num_batches, B, "micro-batches")):
        if given is not None and given != found:
            raise TorchCSVError(f"{label}: names {found} {what} (0 to {found - 1}), expected {given}")
    shape = Shape(len(rows), S, B).check()
    rank_of = _stage_ranks(label, orders, cells, S)
    dirs = directions(split)
    if len(items) < S * B * len(dirs):
        listed = set(items)
        absent = (Work(b, s, d) for s in range(S) for b in range(B) for d in dirs if Work(b, s, d) not in listed)
        raise TorchCSVError(
            f"{label}: lists {len(items)} of the {S * B * len(dirs)} passes of {S} stage(s) and {B} micro-batch(es); "
            f"missing e.g. {', '.join(map(str, islice(absent, 4)))}")
    problem = _blocked(orders, S, split)
    if problem:
        raise TorchCSVError(f"{label}: this schedule cannot run: {problem}")
    _, stage, _ = dataflow.Items(S, B, split).arrays()
    compute = np.array([rank_of[s] for s in range(S)], dtype=np.int64)[stage]
    return fixed_strategy(shape, compute, compute, orders, split_backward=split,
                          name=name or f"torch csv {label}",
                          description=f"the torch CSV schedule {label}: fixed ranks and orders")


def to_torch_csv(schedule: Any, path: str | os.PathLike | None = None, *, align: bool = True) -> str:
    """Write ``schedule`` as a torch CSV file (and return its text): a
    :class:`~unisched.Timeline` (simulated or measured), a
    :class:`~unisched.Simulation`, a plan (anything with ``simulate()``) or a
    Strategy built for a shape.

    Row r lists worker r's passes in the order it ran them, I and W for a
    split backward, B otherwise.  With ``align``, a cell's column is the
    moment its pass started among all the step's start times, so cells in
    one column ran together and empty cells are idle time, as in torch's own
    files; without, each row is packed.

    torch's format puts each stage, and its weights, on one rank and chains
    stage s into s + 1: a schedule that runs a stage on several workers,
    fetches weights, splits items over a gang of workers or follows another
    stage graph raises :class:`TorchCSVError` saying which.
    """
    timeline = _timeline_of(schedule)
    orders = torch_orders(timeline)
    if align:
        rows = _aligned(timeline, orders)
    else:
        rows = [[str(w) for w in orders[r]] for r in range(timeline.num_workers)]
    buffer = io.StringIO()
    csv.writer(buffer).writerows(rows)
    text = buffer.getvalue()
    if path is not None:
        try:
            with open(path, "w", newline="", encoding="utf-8") as file:
                file.write(text)
        except OSError as error:
            raise TorchCSVError(f"cannot write {os.fspath(path)}: {error.strerror or error}; name a file in a folder "
                                "that exists and that you may write to") from None
    return text


def torch_orders(schedule: Any) -> Orders:
    """Each worker's passes in the order ``schedule`` (as for
    :func:`to_torch_csv`) runs them, after checking that torch's format can
    express it."""
    timeline = _timeline_of(schedule)
    if not timeline.stage_graph.is_chain:
        raise TorchCSVError("torch's runtime chains stage s into stage s + 1; "
                            "this schedule follows another stage graph")
    if len(timeline.gang_members):
        raise TorchCSVError("torch's format runs each pass on one rank; this schedule runs some on gangs of workers "
                            f"({', '.join(map(str, timeline.gang_members))})")
    if timeline.weight_shards:
        (stage, _), holders = min(timeline.weight_shards.items())
        raise TorchCSVError(f"torch's format keeps each stage's weights whole on the rank that runs it; this schedule "
                            f"holds stage {stage}'s in shards on workers {list(holders)} (weight_shards)")
    fetched = np.flatnonzero(timeline.worker != timeline.weight_worker)
    if len(fetched):
        i = int(fetched[0])
        raise TorchCSVError(
            f"torch's format keeps each stage's weights on the rank that runs it; {timeline.work(i)} runs on worker "
            f"{int(timeline.worker[i])} with the weights of worker {int(timeline.weight_worker[i])} "
            f"({len(fetched)} pass(es) fetch weights)")
    for s in range(timeline.num_stages):
        workers = sorted(set(timeline.worker[timeline.stage == s].tolist()))
        if len(workers) > 1:
            raise TorchCSVError(
                f"torch's format runs each stage on one rank; stage {s} runs on workers "
                f"{', '.join(map(str, workers))}")
    return timeline.worker_orders()


# ---------------------------------------------------------------------- reading
def _read_rows(source) -> tuple[str, list[list[str]]]:
    if hasattr(source, "read"):
        label = str(getattr(source, "name", "<csv>"))
        text = source.read()
    else:
        label = os.fspath(source)
        try:
            with open(label, "rb") as file:
                text = file.read()
        except OSError as error:
            raise TorchCSVError(f"cannot read the torch CSV schedule {label}: {error.strerror or error}") from None
    if isinstance(text, bytes):  # a file read as bytes (a path, BytesIO): the CSV is UTF-8 text
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise TorchCSVError(f"{label}: is not a text file; a torch CSV schedule is UTF-8 text") from None
    try:
        rows = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as error:
        raise TorchCSVError(f"{label}: not a CSV file ({error})") from None
    if not rows:
        raise TorchCSVError(f"{label}: is empty; a torch CSV schedule has one row of actions per rank")
    return label, rows


def _parse_rows(label: str, rows: list[list[str]]) -> tuple[Orders, dict[Work, str]]:
    orders: Orders = {}
    cells: dict[Work, str] = {}
    for rank, row in enumerate(rows):
        order = orders.setdefault(rank, [])
        for column, text in enumerate(row):
            where = f"rank {rank} (row {rank + 1}), column {column + 1}"
            for work in _parse_cell(label, where, text):
                if work in cells:
                    raise TorchCSVError(f"{label}: {where}: {work} runs twice (also at {cells[work]})")
                cells[work] = where
                order.append(work)
    return orders, cells


def _parse_cell(label: str, where: str, text: str) -> list[Work]:
    text = text.strip()
    if not text:
        return []
    overlap = _OVERLAP.fullmatch(text)
    if overlap:
        works = [w for part in overlap.group(1).split(";") for w in _parse_cell(label, where, part)]
        if not works:
            raise TorchCSVError(f"{label}: {where}: {text!r} overlaps no compute action")
        return works
    match = _ACTION.fullmatch(text)
    if not match:
        raise TorchCSVError(
            f"{label}: {where}: cannot read {text!r}; a cell is empty (idle), an action "
            f"[stage][F|B|I|W][micro-batch] such as 2F0, or (0F7;7B3)OVERLAP_F_B")
    stage, kind, batch = match.groups()
    if kind in _OTHER:
        return []
    if not batch:
        raise TorchCSVError(f"{label}: {where}: {text!r} names no micro-batch; write e.g. {stage}{kind}0")
    return [Work(int(batch), int(stage), _COMPUTE[kind])]


def _stage_ranks(label: str, orders: Orders, cells: Mapping[Work, str], num_stages: int) -> list[int]:
    rank_of: dict[int, int] = {}
    for rank, order in orders.items():
        for work in order:
            other = rank_of.setdefault(work.stage, rank)
            if other != rank:
                raise TorchCSVError(
                    f"{label}: {cells[work]}: stage {work.stage} runs on ranks {other} and {rank}; torch's format "
                    f"places each stage (and its weights) on one rank")
    if len(rank_of) < num_stages:  # the first few named, not a list of them: one cell may name stage 10^11
        absent = list(islice((s for s in range(num_stages) if s not in rank_of), 8))
        count = num_stages - len(rank_of)
        more = f" and {count - len(absent)} more" if count > len(absent) else ""
        raise TorchCSVError(f"{label}: stage(s) {', '.join(map(str, absent))}{more} run nowhere")
    return [rank_of[s] for s in range(num_stages)]


# ---------------------------------------------------------------------- writing
def _timeline_of(schedule: Any) -> Timeline:
    if isinstance(schedule, Timeline):
        return schedule
    timeline = getattr(schedule, "timeline", None)
    if isinstance(timeline, Timeline):
        return timeline
    if isinstance(schedule, Strategy):
        if schedule.shape is None:
            raise TorchCSVError(f"strategy {schedule.name!r} has no shape; simulate it first and pass the simulation")
        return simulate(*schedule.shape, schedule).timeline
    if callable(getattr(schedule, "simulate", None)):
        return _timeline_of(schedule.simulate())
    raise TorchCSVError(
        f"cannot write {type(schedule).__name__} as a torch CSV schedule; pass a Timeline, a Simulation, a plan "
        "or a Strategy built for a shape")


def _aligned(timeline, orders: Orders) -> list[list[str]]:
    index = timeline.index()
    moments = np.unique(timeline.start)
    rows = []
    for rank in range(timeline.num_workers):
        row: list[str] = []
        for work in orders[rank]:
            column = max(int(np.searchsorted(moments, timeline.start[index[work]])), len(row))
            row += [""] * (column - len(row)) + [str(work)]
        rows.append(row)
    return rows
