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

from dataclasses import dataclass, field, replace
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from unisched.work import BACKWARD_INPUT, FORWARD, Direction, Shape, Work

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

    def __post_init__(self):
        gang = np.full(len(self.batch), -1, dtype=np.int64) if self.gang is None else _ints(self.gang)
        object.__setattr__(self, "gang", gang)
        object.__setattr__(self, "gang_members", tuple(tuple(int(m) for m in g) for g in self.gang_members))
        sizes = {
            "activation_bytes": self.activation_bytes,
            "weight_bytes": self.weight_bytes,
            "stash_bytes": self.activation_bytes if self.stash_bytes is None else self.stash_bytes,
        }
        for name, value in sizes.items():
            value = np.zeros(self.num_stages) if value is None else np.broadcast_to(_floats(value), (self.num_stages,))
            object.__setattr__(self, name, np.array(value, dtype=np.float64))

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
        """The work items ``worker`` ran, in the order it ran them."""
        rows = np.flatnonzero(self.worker == worker)
        rows = rows[np.argsort(self.start[rows], kind="stable")]
        return [self.work(i) for i in rows]

    def index(self) -> dict[Work, int]:
        """Map each work item to its row."""
        return {self.work(i): i for i in range(len(self))}

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
        return replace(self, worker=workers, gang=None, gang_members=(), item_count=len(self), **columns)

    @property
    def busy_time(self) -> np.ndarray:
        """Seconds (or time units) each worker spent computing."""
        rows, workers = self.occupancy()
        return np.bincount(workers, weights=(self.end - self.start)[rows], minlength=self.num_workers)

    @property
    def throughput(self) -> float:
        """Work items per unit of time per worker."""
        items = len(self) if self.item_count is None else self.item_count
        return items / (self.latency * self.num_workers) if self.latency > 0 else float("inf")

    @property
    def bubble_fraction(self) -> float:
        """Share of worker-time spent idle."""
        total = self.latency * self.num_workers
        return float(1.0 - self.busy_time.sum() / total) if total > 0 else 0.0

    def memory(self, kind: str = "total", unit: str = "bytes") -> list[MemoryCurve]:
        """Per-worker memory over time; see :mod:`unisched.memory`."""
        from unisched.memory import memory_curves

        return memory_curves(self, kind=kind, unit=unit)

    def worker_stats(self) -> dict[str, list]:
        """Column name -> list indexed by worker; see :mod:`unisched.metrics`."""
        from unisched.metrics import worker_stats

        return worker_stats(self)

    # ------------------------------------------------------------------ rendering
    def to_text(self, width: int = 100, color: bool | None = None, **options) -> str:
        from unisched.render.text import to_text

        return to_text(self, width=width, color=color, **options)

    def to_html(self, **options) -> str:
        from unisched.render.html import to_html

        return to_html(self, **options)

    def _repr_html_(self) -> str:
        return self.to_html()

    def figure(self, **options):
        from unisched.render.figure import figure

        return figure(self, **options)

    def to_chrome_trace(self) -> dict:
        from unisched.render.trace import to_chrome_trace

        return to_chrome_trace(self)

    def save(self, path, **options) -> None:
        """Write the diagram by extension: .html, .png, .svg, .pdf, .json (Chrome trace), .txt."""
        from unisched.render import save

        save(self, path, **options)

    def __repr__(self) -> str:
        return (
            f"<Timeline {self.label or self.source} W={self.num_workers} S={self.num_stages} "
            f"B={self.num_batches}: {len(self)} items, latency {self.latency:g}, "
            f"bubble {self.bubble_fraction:.1%}>"
        )
