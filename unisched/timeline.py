"""The Timeline: the one value that flows between every layer of unisched.

It says which work item ran on which worker and when, which transfers moved
what between workers, and (derived from those) what each worker held in
memory over time.  The simulator produces one; the executor records one from
a real run; metrics and renderers take either, so a simulated and a measured
step are drawn and compared the same way.

The storage is columnar (one numpy array per field) because a Timeline of a
million work items must stay small and fast; ``records`` and ``transfers``
give the familiar row view.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import networkx as nx
import numpy as np

from unisched import dataflow
from unisched.costs import Costs
from unisched.errors import ShapeError, TimelineError, UniSchedError
from unisched.strategy import Strategy, fixed_strategy
from unisched.work import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Direction,
    Shape,
    StageGraph,
    Work,
    as_stage_graph,
    is_real,
    is_whole,
)

TRANSFER_KINDS = ("activation", "gradient", "stash", "weights", "weight_gradient", "allreduce")
"""What a transfer carries.

- activation: a forward's output to the next stage's forward worker;
- gradient: a backward's input gradient to the previous stage's backward worker;
- stash: a forward's input to the worker that runs its backward elsewhere;
- weights: a stage's weights fetched from its weight worker;
- weight_gradient: a fetched stage's gradient sent back to its weight worker;
- allreduce: one replica's part of the end-of-step gradient all-reduce.
"""
ACTIVATION_KINDS = frozenset({"activation", "gradient", "stash"})


class WorkRecord(NamedTuple):
    work: Work
    worker: int
    weight_worker: int
    start: float
    end: float


class TransferRecord(NamedTuple):
    kind: str
    src: int
    dst: int
    start: float
    end: float
    nbytes: float
    work: Work | None


class MemoryCurve(NamedTuple):
    """A per-worker step function: ``values[i]`` holds from ``times[i]`` to ``times[i+1]``."""

    times: np.ndarray
    values: np.ndarray

    @property
    def peak(self) -> float:
        return float(self.values.max()) if len(self.values) else 0.0

    def at(self, time: float) -> float:
        index = np.searchsorted(self.times, time, side="right") - 1
        return float(self.values[index]) if index >= 0 else 0.0


def _ints(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _floats(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).reshape(-1)


@dataclass(frozen=True, eq=False)
class Transfers:
    """Columnar table of transfers; see ``TRANSFER_KINDS``.  ``batch``,
    ``stage`` and ``direction`` name the work item a transfer serves (-1 when
    none, e.g. an all-reduce)."""

    kind: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    start: np.ndarray
    end: np.ndarray
    nbytes: np.ndarray
    batch: np.ndarray
    stage: np.ndarray
    direction: np.ndarray

    @classmethod
    def empty(cls) -> "Transfers":
        return cls.from_rows([])

    @classmethod
    def from_rows(cls, rows: Iterable[TransferRecord]) -> "Transfers":
        rows = list(rows)
        kinds = [TRANSFER_KINDS.index(r.kind) for r in rows]
        works = [r.work if r.work is not None else Work(-1, -1, FORWARD) for r in rows]
        return cls(
            kind=np.asarray(kinds, dtype=np.int8),
            src=_ints([r.src for r in rows]),
            dst=_ints([r.dst for r in rows]),
            start=_floats([r.start for r in rows]),
            end=_floats([r.end for r in rows]),
            nbytes=_floats([r.nbytes for r in rows]),
            batch=_ints([w.batch for w in works]),
            stage=_ints([w.stage for w in works]),
            direction=_ints([int(w.direction) for w in works]),
        )

    def __len__(self) -> int:
        return len(self.kind)

    def __iter__(self):
        for i in range(len(self)):
            work = None
            if self.batch[i] >= 0:
                work = Work(int(self.batch[i]), int(self.stage[i]), Direction(int(self.direction[i])))
            yield TransferRecord(
                TRANSFER_KINDS[self.kind[i]],
                int(self.src[i]),
                int(self.dst[i]),
                float(self.start[i]),
                float(self.end[i]),
                float(self.nbytes[i]),
                work,
            )

    def of_kind(self, *kinds: str) -> np.ndarray:
        """Boolean mask of the rows whose kind is one of ``kinds``."""
        codes = [TRANSFER_KINDS.index(k) for k in kinds]
        return np.isin(self.kind, codes)


@dataclass(frozen=True, eq=False)
class Timeline:
    """One training step as it ran (or would run).

    Work columns have one row per work item: ``batch``, ``stage``,
    ``direction``, ``worker`` (compute), ``weight_worker``, ``start``, ``end``.
    ``activation_bytes[s]`` is the size of stage s's input (what a forward
    stashes and what travels into it); ``weight_bytes[s]`` the size of its
    weights.  ``input_grad_frees`` is the fraction of a stash that a split
    backward's input-gradient pass frees (the weight-gradient pass frees the
    rest).  ``source`` is "simulated" or "measured".

    It also carries what a consumer needs to read it without the simulator:
    the ``stage_graph`` its dependencies follow, whether fetched weights
    were cached, the ``costs`` it was simulated with (None when measured),
    and its gangs.
    """

    num_workers: int
    num_stages: int
    num_batches: int
    batch: np.ndarray
    stage: np.ndarray
    direction: np.ndarray
    worker: np.ndarray
    weight_worker: np.ndarray
    start: np.ndarray
    end: np.ndarray
    transfers: Transfers = field(default_factory=Transfers.empty)
    activation_bytes: np.ndarray | None = None
    weight_bytes: np.ndarray | None = None
    stash_bytes: np.ndarray | None = None
    """What a forward keeps for its backward, per stage (default: ``activation_bytes``)."""
    input_grad_frees: float = 0.0
    split_backward: bool = False
    source: str = "simulated"
    label: str = ""
    gang: np.ndarray | None = None
    """Per row: index into ``gang_members`` when a group of workers ran the
    item jointly (tensor parallelism), else -1.  ``worker`` is then one of them."""
    gang_members: tuple[tuple[int, ...], ...] = ()
    item_count: int | None = None
    """Distinct work items, where rows repeat items (see :meth:`per_worker`)."""
    stage_graph: StageGraph | nx.DiGraph | None = None
    """Which stage feeds which; None (the chain) or a ``networkx.DiGraph`` is
    turned into a :class:`~unisched.StageGraph`, so this is always one."""
    cache_weights: bool = True
    """Whether a worker kept a fetched stage's weights for the rest of the step."""
    costs: Costs | None = None
    """The costs it was simulated with; None for a measured step."""
    gang_collective: tuple[bool, ...] = ()
    """Per gang: whether its items end with an all-reduce among its workers
    (default: every gang does, as :class:`~unisched.Gang`)."""
    limit_in_bytes: bool | None = None
    """Whether a memory limit for this step counts bytes of stashes (True) or
    stashes: what the simulator's own limit counted (a strategy's limit
    counts stashes, one passed to ``simulate`` bytes when the costs give
    sizes).  None: bytes when ``costs`` give sizes."""
    weight_shards: Mapping[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    """(stage, weight worker) -> the workers holding that stage's weights of
    truth in equal shards, shard i on the i-th (``Strategy.weight_shards``),
    for the stages held in shards; any other is held whole by its weight
    worker."""

    def __post_init__(self):
        for name, kind in (("batch", _ints), ("stage", _ints), ("direction", _ints), ("worker", _ints),
                           ("weight_worker", _ints), ("start", _floats), ("end", _floats)):
            column = getattr(self, name)
            if not isinstance(column, np.ndarray):  # a list, as a hand-made timeline gives them
                try:
                    object.__setattr__(self, name, kind(column))
                except (TypeError, ValueError):
                    raise TimelineError(f"Timeline.{name} must be a sequence of numbers, one per row, got "
                                        f"{column!r}"[:200]) from None
        gang = np.full(len(self.batch), -1, dtype=np.int64) if self.gang is None else _ints(self.gang)
        object.__setattr__(self, "gang", gang)
        object.__setattr__(self, "gang_members", tuple(tuple(int(m) for m in g) for g in self.gang_members))
        collective = tuple(bool(c) for c in self.gang_collective) or (True,) * len(self.gang_members)
        if len(collective) != len(self.gang_members):
            raise ShapeError(
                f"gang_collective has {len(collective)} entries but there are {len(self.gang_members)} gangs; "
                "give one per gang, or none"
            )
        object.__setattr__(self, "gang_collective", collective)
        object.__setattr__(self, "stage_graph", as_stage_graph(self.num_stages, self.stage_graph))
        sizes = {
            "activation_bytes": self.activation_bytes,
            "weight_bytes": self.weight_bytes,
            "stash_bytes": self.activation_bytes if self.stash_bytes is None else self.stash_bytes,
        }
        for name, value in sizes.items():
            try:
                value = np.zeros(self.num_stages) if value is None else np.broadcast_to(_floats(value),
                                                                                          (self.num_stages,))
            except (TypeError, ValueError):
                raise TimelineError(f"Timeline.{name} must be one number, or one per stage ({self.num_stages}), got "
                                    f"{value!r}") from None
            object.__setattr__(self, name, np.array(value, dtype=np.float64))
        self._check_row_values()

    def _check_row_values(self) -> None:
        """Refuse rows no view can draw: columns of different lengths, an item that is not one
        of this step's, a worker that does not exist, or a time that is not a finite number.
        (Whether the rows make a valid step is :meth:`check`'s question.)"""
        columns = {name: getattr(self, name) for name in ("batch", "stage", "direction", "worker", "weight_worker",
                                                            "start", "end", "gang")}
        lengths = {name: len(column) for name, column in columns.items()}
        if len(set(lengths.values())) > 1:
            raise TimelineError(f"the columns of {self._name()} differ in length: {lengths}; give one entry per row "
                                "in each")
        items = dataflow.Items(self.num_stages, self.num_batches, self.split_backward)
        known = (self.batch >= 0) & (self.batch < self.num_batches) & (self.stage >= 0) & (self.stage < self.num_stages)
        known &= np.isin(self.direction, np.asarray(items.dirs, dtype=np.int64))
        if not known.all():
            i = int(np.flatnonzero(~known)[0])
            row = (int(self.batch[i]), int(self.stage[i]), int(self.direction[i]))
            raise TimelineError(
                f"row {i} of {self._name()} is (batch, stage, direction) = {row}, which is not a work item of a step "
                f"with S={self.num_stages}, B={self.num_batches}, split_backward={self.split_backward}; give the "
                "timeline the step's shape and backward form",
                items=[Work(row[0], row[1], Direction(row[2]))] if row[2] in set(map(int, Direction)) else [],
            )
        W = self.num_workers
        for role, column in (("compute", self.worker), ("weight", self.weight_worker)):
            bad = np.flatnonzero((column < 0) | (column >= W))
            if len(bad):
                i = int(bad[0])
                raise TimelineError(
                    f"{_named(self.work(i))} has {role} worker {column[i]}, but {self._name()} has workers 0..{W - 1}",
                    items=[self.work(i)], workers=[int(column[i])],
                )
        bad = np.flatnonzero((self.gang < -1) | (self.gang >= len(self.gang_members)))
        if len(bad):
            i = int(bad[0])
            raise TimelineError(f"{_named(self.work(i))} is in gang {self.gang[i]}, but {self._name()} has "
                                f"{len(self.gang_members)} gangs; give -1 (no gang) or an index into gang_members",
                                items=[self.work(i)])
        for name in ("start", "end"):
            bad = np.flatnonzero(~np.isfinite(columns[name]))
            if len(bad):
                i = int(bad[0])
                raise TimelineError(f"{_named(self.work(i))} has {name} time {float(columns[name][i])} in {self._name()}; "
                                    "times must be finite numbers", items=[self.work(i)])

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_records(
        cls,
        shape: Shape | Sequence[int],
        records: Iterable[WorkRecord],
        transfers: Iterable[TransferRecord] = (),
        **kwargs,
    ) -> "Timeline":
        """Build a Timeline from rows (the executor's path)."""
        shape = Shape(*shape)
        records = list(records)
        works = [r.work for r in records]
        return cls(
            *shape,
            batch=_ints([w.batch for w in works]),
            stage=_ints([w.stage for w in works]),
            direction=_ints([int(w.direction) for w in works]),
            worker=_ints([r.worker for r in records]),
            weight_worker=_ints([r.weight_worker for r in records]),
            start=_floats([r.start for r in records]),
            end=_floats([r.end for r in records]),
            transfers=Transfers.from_rows(transfers),
            split_backward=kwargs.pop("split_backward", any(w.direction == BACKWARD_INPUT for w in works)),
            **kwargs,
        )

    # ------------------------------------------------------------------ row views
    @property
    def shape(self) -> Shape:
        return Shape(self.num_workers, self.num_stages, self.num_batches)

    def __len__(self) -> int:
        return len(self.batch)

    def work(self, index: int) -> Work:
        return Work(int(self.batch[index]), int(self.stage[index]), Direction(int(self.direction[index])))

    @property
    def records(self) -> list[WorkRecord]:
        """Every work item as a row, in start order."""
        return [
            WorkRecord(self.work(i), int(self.worker[i]), int(self.weight_worker[i]), float(self.start[i]), float(self.end[i]))
            for i in self.order()
        ]

    def order(self) -> np.ndarray:
        """Row indices sorted by (start, worker)."""
        return np.lexsort((self.worker, self.start))

    def worker_order(self, worker: int) -> list[Work]:
        """The work items ``worker`` ran, in the order it ran them (see :meth:`worker_orders`)."""
        if not (is_whole(worker, 0) and worker < self.num_workers):
            raise TimelineError(f"worker_order({worker!r}): the workers are 0..{self.num_workers - 1}")
        rows = self._run_order()
        return [self.work(i) for i in rows[self.worker[rows] == worker]]

    def worker_orders(self) -> dict[int, list[Work]]:
        """Every worker's items in the order it ran them ([] for an idle
        worker); a gang item is listed under its compute worker.  Items that
        start and end at one instant (zero durations) are listed in an order
        their dependencies allow, so a replay can follow it."""
        orders: dict[int, list[Work]] = {w: [] for w in range(self.num_workers)}
        for i in self._run_order().tolist():
            orders[int(self.worker[i])].append(self.work(i))
        return orders

    def _run_order(self) -> np.ndarray:
        """Rows by (worker, start, end), ties at one instant broken
        forwards first, along the stage graph, then backwards against it."""
        topo = np.empty(self.num_stages, dtype=np.int64)
        topo[list(nx.topological_sort(self.stage_graph.graph))] = np.arange(self.num_stages)
        forward = self.direction == FORWARD
        tie_pass = (~forward).astype(np.int64) + (self.direction == BACKWARD_WEIGHT)
        tie_stage = np.where(forward, topo[self.stage], -topo[self.stage]) if len(self) else tie_pass
        return np.lexsort((tie_stage, tie_pass, self.end, self.start, self.worker))

    def index(self) -> dict[Work, int]:
        """Map each work item to its row."""
        return {self.work(i): i for i in range(len(self))}

    # ------------------------------------------------------------------ validity and replay
    def check(self, memory_limit: float | Sequence[float] | None = None, tolerance: float = 1e-9) -> "Timeline":
        """Raise :class:`~unisched.TimelineError` unless this is a valid step; return self.

        Valid: every item of the step ran exactly once, on workers that
        exist, after every item it depends on had ended (the rules of
        :func:`unisched.dataflow.dependencies` over ``stage_graph``); no
        worker ran two items at once (a gang item occupies all its workers);
        and, given ``memory_limit`` (one number or one per worker), no worker
        held more stashed activations than that, counted in the unit the
        simulation's own limit used (:attr:`limit_in_bytes`).
        ``tolerance`` absorbs float round-off (relative to the largest time,
        and to the limit for memory).
        Check a timeline, not its :meth:`per_worker` view, which repeats items."""
        rows = self._rows_by_item()
        if not (is_real(tolerance) and 0 <= tolerance < math.inf):
            raise TimelineError(f"check(tolerance=...) must be a number >= 0 (relative round-off), got {tolerance!r}")
        slack = tolerance * max(1.0, float(np.abs(self.start).max(initial=0.0)), float(np.abs(self.end).max(initial=0.0)))
        self._check_durations(slack)
        self._check_dependencies(rows, slack)
        self._check_one_item_at_a_time(slack)
        if memory_limit is not None:
            self._check_memory(rows, memory_limit, tolerance, slack)
        return self

    def as_strategy(self, name: str | None = None, *, memory_limit: float | Sequence[float] | None = None) -> Strategy:
        """A Strategy that replays exactly this schedule: every item on the
        workers it ran on, every worker's items in the order it ran them
        (:meth:`worker_orders`), with the same gangs, backward form and stage
        graph.  Simulated with other costs, it re-times the order that ran
        instead of letting the greedy choose another.  ``memory_limit``
        becomes the strategy's own limit, which counts stashes; pass a limit
        in bytes to :func:`unisched.simulate` instead."""
        rows = self._rows_by_item()
        return fixed_strategy(
            self.shape,
            self.worker[rows],
            self.weight_worker[rows],
            self.worker_orders(),
            split_backward=self.split_backward,
            stage_graph=self.stage_graph,
            gang=self.gang[rows],
            gang_members=self.gang_members,
            gang_collective=self.gang_collective,
            weight_shards=self.weight_shards,
            memory_limit=memory_limit,
            name=name or f"{self.label or self.source} (replay)",
            description=f"the {self.source} schedule {self.label!r} replayed: fixed workers and orders",
        )

    def _rows_by_item(self) -> np.ndarray:
        """The row of each item id (:class:`unisched.dataflow.Items`), after
        checking that every item of the step ran exactly once."""
        items = dataflow.Items(self.num_stages, self.num_batches, self.split_backward)
        ids = items.id(self.batch, self.stage, self.direction)
        counts = np.bincount(ids, minlength=items.count)
        repeated = np.flatnonzero(counts > 1)
        if len(repeated):
            first = int(repeated[0])
            runs = ", ".join(f"worker {self.worker[r]} at {self.start[r]:g}" for r in np.flatnonzero(ids == first))
            more = f" ({len(repeated) - 1} more items repeated)" if len(repeated) > 1 else ""
            raise TimelineError(
                f"{self._name()} runs {_named(items.work(first))} {counts[first]} times ({runs}){more}; "
                "every work item runs exactly once",
                items=[items.work(i) for i in repeated.tolist()],
            )
        missing = np.flatnonzero(counts == 0)
        if len(missing):
            shown = ", ".join(_named(items.work(i)) for i in missing[:4].tolist())
            raise TimelineError(
                f"{self._name()} lacks {len(missing)} of the step's {items.count} work items: {shown}"
                f"{' ...' if len(missing) > 4 else ''}; every item of the step must run once",
                items=[items.work(i) for i in missing.tolist()],
            )
        rows = np.empty(items.count, dtype=np.int64)
        rows[ids] = np.arange(len(self))
        return rows

    def _check_durations(self, slack: float) -> None:
        backwards = np.flatnonzero(~(self.end >= self.start - slack))
        if len(backwards):
            i = int(backwards[0])
            raise TimelineError(
                f"{_named(self.work(i))} on worker {self.worker[i]} ends at {self.end[i]:g}, before it starts at "
                f"{self.start[i]:g}; an item's end must not precede its start",
                items=[self.work(i)], workers=[int(self.worker[i])],
            )

    def _check_dependencies(self, rows: np.ndarray, slack: float) -> None:
        items = dataflow.Items(self.num_stages, self.num_batches, self.split_backward)
        src, dst, _, moves = dataflow.edges(items, self.stage_graph)
        before, after = rows[src], rows[dst]
        early = np.flatnonzero(self.start[after] < self.end[before] - slack)
        if not len(early):
            return
        k = int(early[np.argmin(self.start[after[early]])])
        i, j = int(after[k]), int(before[k])
        more = f" ({len(early) - 1} more dependencies broken)" if len(early) > 1 else ""
        raise TimelineError(
            f"{_named(self.work(i))} starts at {self.start[i]:g} on worker {self.worker[i]}, before "
            f"{_named(self.work(j))} ends at {self.end[j]:g} on worker {self.worker[j]}, whose "
            f"{TRANSFER_KINDS[moves[k]] if moves[k] != dataflow.MOVES_NOTHING else 'completion'} it needs{more}; "
            "an item starts only after its dependencies end",
            items=[self.work(i), self.work(j)], workers=sorted({int(self.worker[i]), int(self.worker[j])}),
        )

    def _check_one_item_at_a_time(self, slack: float) -> None:
        rows, workers = self.occupancy()
        order = np.lexsort((self.end[rows], self.start[rows], workers))
        rows, workers = rows[order], workers[order]
        clash = np.flatnonzero((workers[1:] == workers[:-1]) & (self.start[rows[1:]] < self.end[rows[:-1]] - slack))
        if not len(clash):
            return
        k = int(clash[0])
        a, b, w = int(rows[k]), int(rows[k + 1]), int(workers[k])
        raise TimelineError(
            f"worker {w} runs {_named(self.work(a))} ({self.start[a]:g} to {self.end[a]:g}) and "
            f"{_named(self.work(b))} ({self.start[b]:g} to {self.end[b]:g}) at once; a worker runs one item "
            "at a time (a gang item occupies each of its workers)",
            items=[self.work(a), self.work(b)], workers=[w],
        )

    def _check_memory(self, rows: np.ndarray, memory_limit, tolerance: float, slack: float) -> None:
        W = self.num_workers
        limits = np.asarray(memory_limit, dtype=float)
        if limits.ndim == 0:
            limits = np.full(W, float(limits))
        elif limits.shape != (W,):
            raise ShapeError(f"memory_limit has {limits.size} entries but there are {W} workers")
        in_bytes = self.limit_in_bytes
        if in_bytes is None:
            in_bytes = self.costs is not None and self.costs.has_sizes
        unit = "bytes of stashed activations" if in_bytes else "stashed activations"
        for w, curve in enumerate(self.memory("activations", "bytes" if in_bytes else "units")):
            over = np.flatnonzero(curve.values > limits[w] + tolerance * max(1.0, abs(limits[w])))
            if not len(over):
                continue
            at = float(curve.times[over[0]])
            taken = self._stashes_taken(rows, w, at, slack)
            named = ", ".join(_named(self.work(i)) for i in taken[:4].tolist()) or "nothing new"
            raise TimelineError(
                f"worker {w} holds {curve.values[over[0]]:g} {unit} from time {at:g} "
                f"(peak {curve.peak:g}), over its memory_limit {limits[w]:g}; it took the stash of {named} then. "
                f"Raise the limit to at least {curve.peak:g}, or run backwards that free worker {w}'s stashes earlier",
                items=[self.work(i) for i in taken.tolist()], workers=[w],
            )

    def _stashes_taken(self, rows: np.ndarray, worker: int, at: float, slack: float) -> np.ndarray:
        """Rows of the forwards starting at ``at`` whose stash ``worker`` keeps."""
        items = dataflow.Items(self.num_stages, self.num_batches, self.split_backward)
        forwards = np.flatnonzero((self.direction == FORWARD) & (np.abs(self.start - at) <= slack))
        kept_here = np.zeros(len(forwards), dtype=bool)
        for freeing in dataflow.stash_shares(self.split_backward, self.input_grad_frees):
            releaser = rows[items.id(self.batch[forwards], self.stage[forwards], freeing)]
            kept_here |= self.worker[releaser] == worker
        return forwards[kept_here]

    def _name(self) -> str:
        return f"timeline {self.label!r}" if self.label else f"the {self.source} timeline"

    # ------------------------------------------------------------------ metrics
    @property
    def latency(self) -> float:
        """Time from the start of the step to the end of its last work item or
        of the last gradient transfer or all-reduce that the step needs."""
        ends = [self.end.max(initial=0.0)]
        tail = self.transfers.of_kind("weight_gradient", "allreduce")
        if tail.any():
            ends.append(self.transfers.end[tail].max())
        return float(max(ends) - self.origin)

    @property
    def origin(self) -> float:
        """When the step began: time 0 for a simulation, the first item's start
        for a measured run (whose clock may count from anywhere)."""
        first = float(self.start.min()) if len(self) else 0.0
        return first if self.source == "measured" else min(first, 0.0)

    def occupancy(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, worker) pairs of every worker each item kept busy: one per
        item, or every member of its gang.  Renderers and busy times use it."""
        rows = np.arange(len(self))
        ganged = np.flatnonzero(self.gang >= 0)
        if not len(ganged):
            return rows, self.worker
        extra_rows, extra_workers = [], []
        for row in ganged:
            for member in self.gang_members[self.gang[row]]:
                if member != self.worker[row]:
                    extra_rows.append(row)
                    extra_workers.append(member)
        return np.concatenate([rows, extra_rows]).astype(np.int64), np.concatenate([self.worker, extra_workers]).astype(np.int64)

    def per_worker(self) -> "Timeline":
        """This timeline with every gang item repeated on each of its workers
        (and no gangs): what the renderers draw, one row per worker busy."""
        if not np.any(self.gang >= 0):
            return self
        rows, workers = self.occupancy()
        columns = {name: getattr(self, name)[rows] for name in ("batch", "stage", "direction", "weight_worker", "start", "end")}
        return replace(self, worker=workers, gang=None, gang_members=(), gang_collective=(), item_count=len(self),
                       **columns)

    @property
    def busy_time(self) -> np.ndarray:
        """Seconds (or time units) each worker spent computing."""
        rows, workers = self.occupancy()
        return np.bincount(workers, weights=(self.end - self.start)[rows], minlength=self.num_workers)

    @property
    def throughput(self) -> float:
        """Micro-batches per unit of time: B / latency (per second when the
        costs are in seconds).  Each micro-batch counts once whatever form its
        backward takes, so the rate compares any two strategies of a shape."""
        return self.num_batches / self.latency if self.latency > 0 else float("inf")

    batch_throughput = throughput
    """The same rate as :attr:`throughput` (an earlier name)."""

    @property
    def item_rate(self) -> float:
        """Work items run per unit of time per worker: how busy the schedule
        keeps its workers in items, not a throughput.  A split backward is two
        items, so the rate does not compare strategies whose backwards take
        different forms (:attr:`throughput` does)."""
        items = len(self) if self.item_count is None else self.item_count
        return items / (self.latency * self.num_workers) if self.latency > 0 else float("inf")

    @property
    def bubble_fraction(self) -> float:
        """Share of worker-time spent idle."""
        total = self.latency * self.num_workers
        return float(1.0 - self.busy_time.sum() / total) if total > 0 else 0.0

    # ------------------------------------------------------------------ derived views
    @classmethod
    def register_view(cls, name: str, function: Callable[..., Any]) -> None:
        """Let the method ``name`` (one of ``VIEWS``) call ``function(timeline, ...)``.

        Memory curves, statistics and drawings live in modules that import
        the Timeline; they register here when imported (``import unisched``
        imports them all), so the Timeline depends on none of them."""
        if name not in VIEWS:
            raise ValueError(f"{name!r} is not a Timeline view; the views are {sorted(VIEWS)}")
        _VIEWS[name] = function

    def memory(self, kind: str = "total", unit: str = "bytes") -> list[MemoryCurve]:
        """Per-worker memory over time; see :mod:`unisched.memory`."""
        return _view("memory")(self, kind=kind, unit=unit)

    def worker_stats(self) -> dict[str, list]:
        """Column name -> list indexed by worker; see :mod:`unisched.metrics`."""
        return _view("worker_stats")(self)

    def to_text(self, width: int = 100, color: bool | None = None, **options) -> str:
        return _view("to_text")(self, width=width, color=color, **options)

    def to_html(self, **options) -> str:
        return _view("to_html")(self, **options)

    def _repr_html_(self) -> str:
        return self.to_html()

    def figure(self, **options):
        return _view("figure")(self, **options)

    def to_chrome_trace(self, time_unit: str | float = "s") -> dict:
        """The Chrome trace (``time_unit``: what one unit of time is, default a second)."""
        return _view("to_chrome_trace")(self, time_unit=time_unit)

    def save(self, path, **options) -> None:
        """Write the diagram by extension: .html, .png, .svg, .pdf, .json (Chrome trace), .txt."""
        _view("save")(self, path, **options)

    def __repr__(self) -> str:
        return (
            f"<Timeline {self.label or self.source} W={self.num_workers} S={self.num_stages} "
            f"B={self.num_batches}: {len(self)} items, latency {self.latency:g}, "
            f"bubble {self.bubble_fraction:.1%}>"
        )


VIEWS = {
    "memory": "unisched.memory",
    "worker_stats": "unisched.metrics",
    "to_text": "unisched.render",
    "to_html": "unisched.render",
    "figure": "unisched.render",
    "to_chrome_trace": "unisched.render",
    "save": "unisched.render",
}
"""The Timeline's methods that other modules compute, and the module that
registers each (:meth:`Timeline.register_view`)."""

_VIEWS: dict[str, Callable[..., Any]] = {}


def as_timeline(value: Any, caller: str) -> "Timeline":
    """``value`` as a Timeline: a Timeline, or a Simulation's (its ``.timeline``); anything else
    is a TypeError naming ``caller``."""
    timeline = getattr(value, "timeline", value)
    if not isinstance(timeline, Timeline):
        raise TypeError(f"{caller}() needs a Timeline or Simulation, got {type(value).__name__}")
    return timeline


def _view(name: str) -> Callable[..., Any]:
    try:
        return _VIEWS[name]
    except KeyError:
        raise UniSchedError(
            f"Timeline.{name}() is computed by {VIEWS[name]}, which is not imported; import it (import unisched does)"
        ) from None


def _named(work: Work) -> str:
    """``"backward of stage 1, batch 0 (1B0)"``: readable, and the compact form to search for."""
    direction = Direction(work.direction).name.lower().replace("_", " ")
    return f"{direction} of stage {work.stage}, batch {work.batch} ({work})"
