"""A strategy: the pair of functions of the unified scheme, plus what else a
named schedule fixes (a priority, a memory limit, a split backward, or an
explicit order of work on each worker).

Underneath it stays a plain function ``Work -> ComputeAndWeightWorkers``:
``strategy(work)`` calls the mapping, so a Strategy can go anywhere the seed
notebook passes a function.

Fixed orders are given either as lists of ``Work`` (what a user writes) or
as a :class:`WorkerOrders`, which holds each worker's order as an array of
item ids (the numbering of :class:`unisched.dataflow.Items`): the named
schedules build theirs that way, so a million-item order costs no Python
object per item, and the simulator reads the ids directly.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

import networkx as nx

from unisched import dataflow
from unisched.errors import ShapeError, StrategyError
from unisched.work import ComputeAndWeightWorkers, Direction, Shape, StageGraph, Work

Mapping_ = Callable[[Work], ComputeAndWeightWorkers]
ArrayMapping = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


class Gang(NamedTuple):
    """Workers that run one item jointly.  ``collective``: the item ends with
    an all-reduce of its activations among them (a tensor-parallel split);
    False for a group that shares the work without one (data split inside a
    replica)."""

    workers: Sequence[int]
    collective: bool = True

    @classmethod
    def of(cls, group: "Sequence[int] | Gang | None") -> "Gang | None":
        """What ``Strategy.gang`` returned, as a Gang: a plain list of workers
        is a tensor-parallel gang; None stays None."""
        if group is None or isinstance(group, Gang):
            return group
        return cls(group, True)


class WorkerOrders(Mapping[int, list]):
    """Each worker's fixed order as an array of item ids in the numbering
    ``numbering`` (the items of one step).

    It reads as ``dict[int, list[Work]]``: ``orders[w]`` makes worker w's
    list of Work when asked; :attr:`ids` holds the arrays themselves."""

    def __init__(self, numbering: dataflow.Items, ids: Mapping[int, Any]):
        self.numbering = numbering
        self.ids = {int(w): np.asarray(order, dtype=np.int64).reshape(-1) for w, order in ids.items()}
        n = numbering.count
        bad = [w for w, order in self.ids.items() if len(order) and (order.min() < 0 or order.max() >= n)]
        if bad:
            raise StrategyError(
                f"worker {bad[0]}'s order has item ids outside 0..{n - 1}, the items of S={numbering.num_stages}, "
                f"B={numbering.num_batches}, split_backward={numbering.split_backward}; number items with "
                f"unisched.dataflow.Items(S, B, split_backward).id(batch, stage, direction)")

    @classmethod
    def from_columns(cls, items: dataflow.Items, columns: Mapping[int, Sequence]) -> "WorkerOrders":
        """From per-worker ``(batch, stage, direction)`` arrays, each row an item of ``items``."""
        ids = {}
        for w, (batch, stage, direction) in columns.items():
            batch, stage = np.asarray(batch, dtype=np.int64), np.asarray(stage, dtype=np.int64)
            outside = (batch < 0) | (batch >= items.num_batches) | (stage < 0) | (stage >= items.num_stages)
            if outside.any():
                i = int(np.argmax(outside))
                raise StrategyError(f"worker {w}'s order has batch {batch[i]}, stage {stage[i]}, outside "
                                    f"S={items.num_stages}, B={items.num_batches}")
            ids[w] = items.id(batch, stage, direction)
        return cls(items, ids)

    def columns(self, worker: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(batch, stage, direction) arrays of ``worker``'s order."""
        return self.numbering.columns(self.ids[worker])

    def __getitem__(self, worker: int) -> list[Work]:
        return works(*self.columns(worker))

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __eq__(self, other) -> bool:
        if isinstance(other, WorkerOrders) and other.numbering == self.numbering:
            return self.ids.keys() == other.ids.keys() and all(
                np.array_equal(order, other.ids[w]) for w, order in self.ids.items())
        return super().__eq__(other)

    __hash__ = None

    def __repr__(self) -> str:
        return (f"<WorkerOrders of {len(self.ids)} workers, {sum(map(len, self.ids.values()))} items of "
                f"S={self.numbering.num_stages}, B={self.numbering.num_batches}>")


def works(batch, stage, direction) -> list[Work]:
    """The Work of each row of (batch, stage, direction) arrays."""
    return list(map(Work, np.asarray(batch).tolist(), np.asarray(stage).tolist(),
                    map(_DIRECTIONS.__getitem__, np.asarray(direction).tolist())))


_DIRECTIONS = tuple(Direction)
"""Direction by code, for making Work from arrays."""


def order_ids(orders: Mapping[int, Any], items: dataflow.Items) -> WorkerOrders | None:
    """``orders`` as a :class:`WorkerOrders` of ``items`` when it is one, or
    when every order is a one-dimensional integer array (item ids); None for
    orders of Work (or of ``(batch, stage, direction)`` rows)."""
    if isinstance(orders, WorkerOrders):
        return orders if orders.numbering == items else None
    arrays = [np.asarray(o) if isinstance(o, np.ndarray) else None for o in orders.values()]
    if orders and all(a is not None and a.ndim == 1 and np.issubdtype(a.dtype, np.integer) for a in arrays):
        return WorkerOrders(items, orders)
    return None


@dataclass(frozen=True, eq=False)
class Strategy:
    """A named strategy.

    ``mapping(work)`` gives the compute and weight workers of a work item.
    ``priority`` and ``memory_limit`` are used by :func:`unisched.simulate`
    unless the call gives its own.  ``worker_orders`` fixes the sequence each
    worker runs (hand-made schedules such as ZB-H1's delayed weight passes, or
    a plan file); the simulator then follows it instead of choosing.
    ``release`` (with fixed orders): per item id, the earliest time it may
    start ("not before"), so that a planned schedule replays at its planned
    times rather than each item as early as its order allows.
    ``map_arrays(batch, stage, direction) -> (compute, weight)`` is an
    optional vectorised form of ``mapping`` used to simulate large shapes fast;
    it must agree with ``mapping``.  ``gang_arrays(batch, stage, direction)
    -> (index, members, collective)`` is the same for ``gang``: per item an
    index into ``members`` (tuples of workers) and ``collective`` (whether
    that gang all-reduces), or -1 for one worker.
    """

    mapping: Mapping_
    name: str = ""
    description: str = ""
    priority: Callable[[Work], Any] | None = None
    memory_limit: float | Sequence[float] | None = None
    split_backward: bool = False
    worker_orders: Mapping[int, Sequence[Work]] | WorkerOrders | None = None
    shape: Shape | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    map_arrays: ArrayMapping | None = None
    stage_graph: Any = None
    gang: Callable[[Work], Sequence[int] | Gang | None] | None = None
    """Tensor parallelism: ``gang(work)`` names the workers that run an item
    jointly (its compute worker among them; a :class:`Gang` to say whether
    they all-reduce), or None for one worker.  A gang item starts when all of
    them are free and keeps all of them busy."""
    release: np.ndarray | None = None
    gang_arrays: Callable[..., tuple] | None = None
    weight_shards: Callable[[int, int], Sequence[int] | None] | None = None
    """Fully sharded weights (ZeRO-3): ``weight_shards(stage, weight_worker)``
    names the workers that hold that stage's weights of truth (and their
    gradients and optimizer state) in equal shards, shard i on the i-th, the
    weight worker among them; None: the weight worker holds the whole stage.
    A worker computing with the stage gathers the shards it does not hold and
    sends each shard's gradient back to its holder
    (:func:`unisched.dataflow.sharded_weights`)."""

    def __call__(self, work: Work) -> ComputeAndWeightWorkers:
        return self.mapping(work)

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", getattr(self.mapping, "__name__", type(self.mapping).__name__))
        if self.worker_orders is not None:
            _check_orders(self.worker_orders, "Strategy.worker_orders")
        if not isinstance(self.split_backward, (bool, np.bool_)):  # "False" would read as true
            raise ShapeError(f"Strategy.split_backward must be True or False, got {self.split_backward!r}")

    def check_shape(self, shape: Sequence[int], use: str) -> None:
        """Refuse a shape other than the one this strategy was built for (where it says), ``use``
        saying what is done with it ("simulated", "planned")."""
        if self.shape is not None and tuple(self.shape) != tuple(shape):
            (W, S, B), (w, s, b) = self.shape, shape
            raise ShapeError(f"strategy {self.name!r} was built for W={W}, S={S}, B={B} but is {use} with W={w}, "
                             f"S={s}, B={b}")

    def with_(self, **changes) -> "Strategy":
        """A copy with some fields changed (e.g. another memory limit).  A new
        ``mapping`` or ``gang`` drops the vectorised form of the old one
        (``map_arrays``, ``gang_arrays``) unless the changes give one too."""
        for field_, vectorised in (("mapping", "map_arrays"), ("gang", "gang_arrays")):
            if field_ in changes:
                changes.setdefault(vectorised, None)
        return replace(self, **changes)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"<Strategy {self.name}{'(' + params + ')' if params else ''}>"


def as_strategy(schedule: Strategy | Mapping_, name: str | None = None, description: str = "") -> Strategy:
    """Wrap a user's function (the notebook's style) so it shows with its own name."""
    if isinstance(schedule, Strategy):
        return schedule if name is None else schedule.with_(name=name)
    if isinstance(schedule, str):
        raise TypeError(f"a strategy is a Strategy or a function Work -> ComputeAndWeightWorkers, not its name "
                        f"{schedule!r}: build the named one for the shape with "
                        f"unisched.policies.get({schedule!r}, num_workers, num_stages, num_batches)")
    if isinstance(schedule, type) and schedule.__module__.startswith("torch.distributed.pipelining"):
        raise TypeError(f"{schedule.__name__} is torch's class, which runs a schedule on torch's runtime: give its "
                        f"name to simulate its order, unisched.policies.get({schedule.__name__!r}, num_workers, "
                        "num_stages, num_batches)")
    if not callable(schedule):
        raise TypeError(f"a strategy must be callable Work -> ComputeAndWeightWorkers, got {schedule!r}")
    if required_arguments(schedule) == 3:
        shown = getattr(schedule, "__name__", "it")
        raise StrategyError(f"{shown} takes three arguments: a factory (num_workers, num_stages, num_batches), as the "
                            f"command loads one; call it with the shape, {shown}(W, S, B), and pass what it returns")
    return Strategy(mapping=schedule, name=name or "", description=description or (schedule.__doc__ or "").strip())


def required_arguments(function) -> int | None:
    """How many positional arguments ``function`` requires (None when it does not say)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in signature.parameters.values() if p.kind in kinds and p.default is p.empty)


def _check_orders(orders, what: str) -> None:
    """Refuse orders that are not a mapping of each worker to its order."""
    if not isinstance(orders, Mapping):
        raise TypeError(f"{what} must map each worker to its order, {{worker: [Work, ...]}} or item ids, got "
                        f"{type(orders).__name__}")


def fixed_strategy(
    shape: Shape | Sequence[int],
    compute: Sequence[int],
    weight: Sequence[int],
    worker_orders: Mapping[int, Sequence[Work]] | WorkerOrders,
    *,
    split_backward: bool = False,
    stage_graph: StageGraph | nx.DiGraph | None = None,
    gang: Sequence[int] | None = None,
    gang_members: Sequence[Sequence[int]] = (),
    gang_collective: Sequence[bool] = (),
    weight_shards: Mapping[tuple[int, int], Sequence[int]] | None = None,
    memory_limit: float | Sequence[float] | None = None,
    release: Sequence[float] | None = None,
    name: str = "fixed",
    description: str = "",
) -> Strategy:
    """A Strategy that fixes everything: ``compute[i]``, ``weight[i]`` (and
    ``gang[i]``, an index into ``gang_members`` or -1) are the workers of the
    item with id i (:class:`unisched.dataflow.Items`), ``worker_orders`` the
    sequence each worker runs: lists of Work, or arrays of item ids (a
    :class:`WorkerOrders`, or a dict of one-dimensional integer arrays).
    ``release[i]``, when given, is the earliest time item i may start (a
    plan's start times, so that its replay keeps them).  ``weight_shards``: (stage,
    weight worker) -> the workers holding that stage in shards, for the
    sharded ones (``Strategy.weight_shards`` as a table).
    What a plan and a timeline replay as (:meth:`Timeline.as_strategy`)."""
    shape = Shape(*shape).check()
    W, S, B = shape
    _check_orders(worker_orders, "worker_orders")
    items = dataflow.Items(S, B, split_backward)
    compute, weight = _int_array(compute), _int_array(weight)
    if len(compute) != items.count or len(weight) != items.count:
        raise ShapeError(
            f"a fixed strategy needs the workers of all {items.count} items of W={W}, S={S}, B={B}, "
            f"split_backward={split_backward}; got {len(compute)} compute and {len(weight)} weight workers"
        )

    def item(work: Work) -> int:
        if not (0 <= work.batch < B and 0 <= work.stage < S):
            raise ShapeError(f"{work!r} is not a work item of the fixed schedule {name!r} (S={S}, B={B})")
        return int(items.id(work.batch, work.stage, work.direction))

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        i = item(work)
        return ComputeAndWeightWorkers(int(compute[i]), int(weight[i]))

    def map_arrays(batch, stage, direction):
        ids = items.id(batch, stage, direction)
        return compute[ids], weight[ids]

    release = release_times(release, items.count, name)
    ganged = gang is not None and bool(np.any(_int_array(gang) >= 0))
    gang = _int_array(gang) if ganged else None
    if gang is not None and gang.max() >= len(gang_members):
        raise ShapeError(f"gang names gang {int(gang.max())} but gang_members lists {len(gang_members)}; give every "
                         "gang's members (an index into gang_members, or -1 for an item one worker runs)")
    if len(gang_collective) and len(gang_collective) != len(gang_members):
        raise ShapeError(f"gang_collective has {len(gang_collective)} entries for {len(gang_members)} gangs; give "
                         "one per gang, or none (every gang all-reduces)")
    collective = tuple(gang_collective) or (True,) * len(gang_members)
    groups = [Gang(tuple(m), bool(c)) for m, c in zip(gang_members, collective)]

    def gang_of(work: Work) -> Gang | None:
        g = int(gang[item(work)])
        return groups[g] if g >= 0 else None

    return Strategy(
        mapping=mapping,
        name=name,
        description=description or "fixed workers and a fixed order of work on each worker",
        memory_limit=memory_limit,
        split_backward=split_backward,
        worker_orders=order_ids(worker_orders, items) or {int(w): list(order) for w, order in worker_orders.items()},
        shape=shape,
        map_arrays=map_arrays,
        stage_graph=stage_graph,
        gang=gang_of if ganged else None,
        release=release,
        weight_shards=shards_from_table(weight_shards),
    )


def shards_from_table(table: Mapping[tuple[int, int], Sequence[int]] | None):
    """A ``Strategy.weight_shards`` function that looks (stage, weight
    worker) up in ``table`` (None: a whole stage); None for no table."""
    if not table:
        return None
    held = {(int(s), int(w)): tuple(holders) for (s, w), holders in table.items()}
    return lambda stage, weight: held.get((stage, weight))


def release_times(release, count: int, name: str) -> np.ndarray | None:
    """``release`` as one finite, non-negative time per item, checked (None stays None)."""
    if release is None:
        return None
    times = np.asarray(release, dtype=float).reshape(-1)
    if len(times) != count:
        raise ShapeError(f"the fixed schedule {name!r} has {count} items but release gives {len(times)} times; "
                         f"give one per item id (unisched.dataflow.Items numbering)")
    bad = np.flatnonzero(~np.isfinite(times) | (times < 0))
    if len(bad):
        raise StrategyError(f"the fixed schedule {name!r}: release[{bad[0]}] is {times[bad[0]]}; release times "
                            f"must be finite and at least 0")
    return times


def _int_array(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)
