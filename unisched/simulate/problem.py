"""Turn (shape, strategy, priority, costs, limits) into the flat arrays the
engine runs on, checking the user's input on the way.

Item ids, dependencies, what each dependency moves and what each backward
frees come from :mod:`unisched.dataflow`; id ``J + b`` is the virtual item
``Work(b, -1, FORWARD)`` that triggers batch b's first forwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from unisched import dataflow, network
from unisched.costs import Costs
from unisched.dataflow import EDGE_STASH, Items
from unisched.errors import ShapeError, StrategyError
from unisched.simulate.priorities import ranks
from unisched.simulate.sequences import fixed_successors
from unisched.simulate.stashes import StashAccounts, stash_accounts
from unisched.strategy import Gang, Strategy, release_times, works
from unisched.timeline import TRANSFER_KINDS
from unisched.work import FORWARD, Direction, Shape, StageGraph, Work

class Followed(NamedTuple):
    """Dependencies as CSR by source: item i's are ``ptr[i]:ptr[i + 1]`` of
    their destination, kind and moved-data code."""

    ptr: np.ndarray
    idx: np.ndarray
    kind: np.ndarray
    moved: np.ndarray
    table: np.ndarray
    """(4, E): the same edges as rows src, idx, kind, moved (the form
    :func:`moves` takes)."""


class GangMoves(NamedTuple):
    """What the first members of gang items hand out before the members
    compute and collect after (:func:`unisched.dataflow.gang_moves`): a row
    per move, by item, those handed out first."""

    item: np.ndarray
    after: np.ndarray
    """False: handed out before the members compute; True: collected after."""
    kind: np.ndarray
    """A code of ``TRANSFER_KINDS``."""
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray


class WeightShares(NamedTuple):
    """The weights each worker of an item computes with, where that is not
    one whole stage from the item's weight worker: a row per member of a
    gang item (:func:`unisched.dataflow.gang_weights`) and per shard of a
    sharded stage (:func:`unisched.dataflow.sharded_weights`), by item."""

    item: np.ndarray
    member: np.ndarray
    holder: np.ndarray
    share: np.ndarray
    nbytes: np.ndarray


@dataclass(eq=False)
class Problem:
    shape: Shape
    batch: np.ndarray
    stage: np.ndarray
    direction: np.ndarray
    worker_array: np.ndarray
    weight_worker_array: np.ndarray
    duration: np.ndarray
    rank: np.ndarray
    items: Items
    stage_graph: StageGraph
    data_edges: np.ndarray
    """(4, E): src, dst, kind and moved-data code of every dependency the
    scheme's dataflow gives (:func:`unisched.dataflow.edges`)."""
    data_followed: Followed
    """The dataflow's dependencies the engine follows, by source (CSR).
    Without communication costs a stash edge never binds (the backward
    already waits for it through the chain of backwards), so it is left out."""
    next_fixed: np.ndarray
    """Per item: the item after it in its worker's fixed order (-1: none),
    followed after its data dependencies."""
    num_deps: np.ndarray
    sources: np.ndarray
    """(2, K): the items ready at time 0, and the virtual items that trigger them."""
    stashes: StashAccounts | None
    """What each item claims and releases against which limit (None: no limit)."""
    costs: Costs
    comm: bool
    activation_bytes: np.ndarray
    stash_bytes: np.ndarray
    weight_bytes: list
    gang: np.ndarray
    """Per item: index into ``gang_members``, or -1 for an item run by one worker."""
    gang_members: tuple[tuple[int, ...], ...]
    gang_collective: tuple[bool, ...]
    gang_move_table: GangMoves
    """What the first members of gang items hand out and collect."""
    weight_share_table: WeightShares
    """The weights each worker of a gang item, or of an item of a sharded
    stage, computes with, share by share; any other item computes with the
    whole stage from its weight worker."""
    collective: np.ndarray
    """Per item: the part of its duration that is its gang's tensor-parallel
    collective (0 for an item run by one worker); on a topology the engine
    books it on the gang's links."""
    weight_shards: dict = field(default_factory=dict)
    """(stage, weight worker) -> the workers holding that stage's weights in
    shards (``Strategy.weight_shards``), for the sharded ones."""
    release: np.ndarray | None = None
    """Per item: the earliest time it may start (a fixed strategy's ``release``), or None: any time."""

    @cached_property
    def gang_moves(self) -> dict:
        """Per gang item: (kind, src, dst, bytes) of what its first member
        hands out before the members compute, and of what it collects after
        (the engine's form of :attr:`gang_move_table`)."""
        t = self.gang_move_table
        moves = {item: ([], []) for item in np.flatnonzero(self.gang >= 0).tolist()}
        for item, after, kind, src, dst, nbytes in zip(*(column.tolist() for column in t)):
            moves[item][after].append((TRANSFER_KINDS[kind], src, dst, nbytes))
        return {item: (tuple(before), tuple(after)) for item, (before, after) in moves.items()}

    @cached_property
    def weight_shares(self) -> dict:
        """Per gang item or item of a sharded stage: (member, holder, share,
        bytes) of the weights each of its workers computes with (the engine's
        form of :attr:`weight_share_table`)."""
        weights: dict = {}
        for item, *link in zip(*(column.tolist() for column in self.weight_share_table)):
            weights.setdefault(item, []).append(tuple(link))
        return {item: tuple(links) for item, links in weights.items()}

    @cached_property
    def _stash_lists(self) -> tuple:
        return self.stashes.as_lists() if self.stashes is not None else (None, None, None)

    @property
    def limit(self) -> list | None:
        return self._stash_lists[0]

    @property
    def claims(self) -> list | None:
        """Per item: (worker, amount) of what it claims, or None (the Python engine's form)."""
        return self._stash_lists[1]

    @property
    def releases_of(self) -> list | None:
        """Per item: (worker, amount, owner) of what it releases, or None."""
        return self._stash_lists[2]

    @property
    def num_items(self) -> int:
        return len(self.worker_array)

    @property
    def split_backward(self) -> bool:
        return self.items.split_backward

    @cached_property
    def worker(self) -> list:
        return self.worker_array.tolist()

    @cached_property
    def stage_list(self) -> list:
        return self.stage.tolist()

    @cached_property
    def weight_worker(self) -> list:
        return self.weight_worker_array.tolist()

    @property
    def num_workers(self) -> int:
        return self.shape.num_workers

    @property
    def cache_weights(self) -> bool:
        return self.costs.cache_weights

    @property
    def prefetch_depth(self) -> int:
        return self.costs.prefetch_depth

    def work(self, item: int) -> Work:
        if item >= self.num_items:
            return Work(item - self.num_items, -1, FORWARD)
        return self.items.work(item)

    def label(self, item: int) -> str:
        w = self.work(item)
        return f"{Direction(w.direction).letter}(stage {w.stage}, batch {w.batch})"

    @cached_property
    def succ_moves(self) -> tuple[list, list]:
        """For each data edge followed (CSR order of ``data_followed``): what it moves (None: nothing) and how many bytes."""
        kinds, nbytes = moves(self, self.data_followed.table)
        return [TRANSFER_KINDS[k] if k >= 0 else None for k in kinds.tolist()], nbytes.tolist()

    @cached_property
    def weight_links(self) -> tuple[np.ndarray, ...]:
        """(item, member, holder, share, bytes) of the weights every item's
        workers compute with: its compute worker and its weight worker's
        whole stage, or the rows of :attr:`weight_share_table` (the shares
        of its gang's members, or the shards of its stage)."""
        n = self.num_items
        rows = [np.arange(n), self.worker_array, self.weight_worker_array, np.zeros(n, np.int64),
                np.asarray(self.weight_bytes, dtype=float)[self.stage]]
        if not len(self.weight_share_table.item):
            return tuple(rows)
        whole = np.ones(n, dtype=bool)
        whole[self.weight_share_table.item] = False
        return tuple(np.concatenate([column[whole], extra.astype(column.dtype)])
                     for column, extra in zip(rows, self.weight_share_table))

    @cached_property
    def gradient_items(self) -> np.ndarray:
        """The items whose pass makes their stage's weight gradient, in id order."""
        return np.flatnonzero(self.direction == dataflow.gradient_pass(self.split_backward))

    @cached_property
    def weight_pieces(self) -> np.ndarray:
        """Per row of :attr:`weight_links`: which (worker, stage, share) it
        is, numbered ``(member * S + stage) * shares + share``: what a worker
        keeps from a fetch and returns a gradient of once."""
        item, member, _, share, _ = self.weight_links
        return (member * self.shape.num_stages + self.stage[item]) * (int(share.max(initial=0)) + 1) + share

    @cached_property
    def returning_links(self) -> np.ndarray:
        """Per row of :attr:`weight_links`: whether that member returns a
        weight gradient to the holder (:func:`unisched.dataflow.returns_gradient`)."""
        item, member, holder, _, _ = self.weight_links
        return dataflow.returns_gradient(self.direction[item], member, holder, self.split_backward)

    @cached_property
    def returns_gradient(self) -> list:
        """Per item: whether any worker running it returns a weight gradient."""
        returns = np.zeros(self.num_items, dtype=bool)
        returns[self.weight_links[0][self.returning_links]] = True
        return returns.tolist()

    @cached_property
    def gradient_returns(self) -> dict[tuple[int, int, int], int]:
        """(worker, stage, share) -> how many of its items return a gradient of that share of that stage."""
        item, member, _, share, _ = (column[self.returning_links] for column in self.weight_links)
        keys, counts = np.unique(np.stack([member, self.stage[item], share]), axis=1, return_counts=True)
        return {(int(w), int(s), int(k)): int(c) for (w, s, k), c in zip(keys.T, counts)}


def moves(p: Problem, edge_table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The transfer kinds (codes into ``TRANSFER_KINDS``, -1: nothing) of
    dependency edges (rows src, dst, kind, moved-data code) and their bytes,
    as :func:`unisched.dataflow.moved_data` says for this mapping."""
    codes, nbytes = dataflow.moved_data(p.items, p.stage_graph, edge_table, p.worker_array, p.activation_bytes)
    return codes.astype(np.int8), nbytes


def build(
    shape: Shape,
    strategy: Strategy,
    priority: Callable[[Work], Any],
    costs: Costs,
    memory_limit: float | Sequence[float] | None,
    split_backward: bool,
    stage_graph: StageGraph,
    limit_in_bytes: bool | None = None,
    max_gathers: int | None = None,
) -> Problem:
    """``limit_in_bytes``: whether ``memory_limit`` counts bytes of stashes
    (default: when the costs give sizes) or stashes.  ``max_gathers``: the
    most shards the items of sharded stages may gather (one row each),
    refused before they are built (None: no limit)."""
    W, S, B = shape
    items = Items(S, B, split_backward)
    n = items.count
    batch, stage, direction = items.arrays()

    compute, weight = map_workers(strategy, shape, batch, stage, direction)
    gang, gang_members, gang_collective = _gangs(strategy, shape, batch, stage, direction, compute)
    speeds = costs.speeds(W)
    duration = costs.item_time(stage, direction, compute, S, W)
    act_bytes = costs.per_stage("activation_bytes", S)
    collective_time = np.zeros(n)
    sizes = getattr(costs, "tensor_parallel_sizes", None)  # a cluster's costs may say what a gang all-reduces
    gang_bytes = sizes(S) if sizes is not None else act_bytes
    for g, (members, collective) in enumerate(zip(gang_members, gang_collective)):
        rows = gang == g
        slowest = members[int(np.argmin(speeds[list(members)]))]  # a gang item runs at its slowest member's pace
        duration[rows] = costs.item_time(stage[rows], direction[rows], slowest, S, W)
        if collective:
            collective_time[rows] = network.tensor_parallel_time(costs, members, gang_bytes[stage[rows]])
            duration[rows] += collective_time[rows]

    virtual = (np.arange(B), np.full(B, -1), np.zeros(B, dtype=np.int64))
    rank = ranks(
        priority,
        np.concatenate([batch, virtual[0]]),
        np.concatenate([stage, virtual[1]]),
        np.concatenate([direction, virtual[2]]),
    )

    data_edges = dataflow.edges(items, stage_graph)
    data_followed = followed_edges(data_edges, n, costs.has_communication)
    num_deps = np.bincount(data_followed.idx, minlength=n)
    if strategy.worker_orders is None:
        next_fixed = np.full(n, -1, dtype=np.int64)
    else:
        next_fixed = fixed_successors(strategy.worker_orders, compute, shape, items)
        num_deps[next_fixed[next_fixed >= 0]] += 1  # an item follows one item at most in its worker's order
    first = np.flatnonzero((num_deps == 0) & (direction == FORWARD))
    sources = np.stack([first, n + batch[first]])

    weight_bytes = costs.per_stage("weight_bytes", S)
    stash_bytes = costs.per_stage("stash_bytes", S)
    stashes = stash_accounts(
        W, memory_limit, items, compute, stage,
        stash_bytes if (costs.has_sizes if limit_in_bytes is None else limit_in_bytes) else None,
        costs.input_grad_frees,
    )

    moves_in_gang = _moves_in_gangs(gang, gang_members, gang_collective, stage, direction,
                                    dataflow.input_bytes(act_bytes, stage_graph),
                                    dataflow.output_bytes(act_bytes, stage_graph))
    shards = weight_shards(strategy, stage, weight, W)
    sharded = np.zeros(S, dtype=bool)
    sharded[[s for s, _ in shards]] = True
    weight = dataflow.own_copies(stage, compute, weight, S, whole=(gang < 0) & ~sharded[stage])
    weight_shares = _weights_in_gangs(gang, gang_members, gang_collective, compute, weight, stage, W, S,
                                      weight_bytes, items, strategy.name)
    if shards:
        weight_shares = _sharded_rows(shards, gang, compute, weight, stage, W, S, weight_bytes, items,
                                      strategy.name, weight_shares, max_gathers)
    return Problem(
        shape=shape,
        items=items,
        stage_graph=stage_graph,
        batch=batch,
        stage=stage,
        direction=direction,
        worker_array=compute,
        weight_worker_array=weight,
        duration=duration,
        rank=rank,
        data_edges=data_edges,
        data_followed=data_followed,
        next_fixed=next_fixed,
        num_deps=num_deps,
        sources=sources,
        stashes=stashes,
        costs=costs,
        comm=costs.has_communication,
        activation_bytes=act_bytes,
        stash_bytes=stash_bytes,
        weight_bytes=weight_bytes.tolist(),
        gang=gang,
        gang_members=gang_members,
        gang_collective=gang_collective,
        gang_move_table=moves_in_gang,
        weight_share_table=weight_shares,
        weight_shards=shards,
        collective=collective_time,
        release=release_times(strategy.release, n, strategy.name),
    )


def followed_edges(data_edges: np.ndarray, n: int, comm: bool) -> Followed:
    """The dataflow's dependencies the engine follows (without communication
    costs, no stash edge: see ``Problem.data_followed``), stably by source."""
    kept = np.arange(data_edges.shape[1]) if comm else np.flatnonzero(data_edges[2] != EDGE_STASH)
    by_source = kept[np.argsort(data_edges[0].take(kept).astype(np.int32), kind="stable")]
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(data_edges[0].take(by_source), minlength=n), out=ptr[1:])
    table = np.take(data_edges, by_source, axis=1)
    return Followed(ptr, *table[1:], table=table)


# ---------------------------------------------------------------------- mapping
def map_workers(strategy: Strategy, shape: Shape, batch, stage, direction) -> tuple[np.ndarray, np.ndarray]:
    """Every item's compute and weight worker, checked.

    The strategy's ``map_arrays`` if it has one, else its mapping called once
    on arrays (:func:`_map_on_arrays`) where that gives what per-item calls
    give, else its mapping called per item.  ``map_arrays`` must agree with
    the mapping: they are compared on a sample of items."""
    W = shape.num_workers
    if strategy.map_arrays is not None:
        compute, weight = _as_workers(strategy.map_arrays(batch, stage, direction), len(batch), strategy, "map_arrays")
        _agrees_with_mapping(strategy, compute, weight, batch, stage, direction, W, given=True)
    else:
        found = _map_on_arrays(strategy, batch, stage, direction, W)
        compute, weight = found if found is not None else _map_per_item(strategy, batch, stage, direction, W)
    bad = np.flatnonzero((compute < 0) | (compute >= W) | (weight < 0) | (weight >= W))
    if len(bad):
        i = int(bad[0])
        work = Work(int(batch[i]), int(stage[i]), Direction(int(direction[i])))
        raise StrategyError(
            f"strategy {strategy.name!r} maps {work!r} to compute worker {compute[i]} and weight worker "
            f"{weight[i]}, but workers are numbered 0..{W - 1}; give the strategy the shape it is simulated with"
        )
    return compute, weight


SAMPLE = 256
"""Items on which a mapping evaluated on arrays is checked against per-item calls."""


def _sample(n: int) -> np.ndarray:
    """The items a vectorised form is checked on: the first, the last and up to SAMPLE fixed random ones."""
    if not n:
        return np.zeros(0, np.int64)
    rng = np.random.default_rng(0)
    return np.unique(np.concatenate([[0, n - 1], rng.integers(0, n, size=min(SAMPLE, n))]))


def _map_on_arrays(strategy: Strategy, batch, stage, direction, num_workers: int):
    """The mapping called once with a Work whose fields are whole arrays (a
    function such as ``lambda w: (w.stage % 4, w.stage % 4)`` computes every
    item at once), or None where that fails, gives no integers, or disagrees
    with per-item calls on a sample: a function that branches on its
    argument then runs per item, with the same result either way."""
    if len(batch) <= 2 * SAMPLE:
        return None  # checking the sample would cost as much as calling it per item
    try:
        with np.errstate(all="ignore"):
            result = strategy.mapping(Work(batch, stage, direction))
        compute, weight = _as_workers(result, len(batch), strategy, "mapping")
    except Exception:
        return None
    if not _agrees_with_mapping(strategy, compute, weight, batch, stage, direction, num_workers, given=False):
        return None
    return compute, weight


def _as_workers(result, n: int, strategy: Strategy, source: str) -> tuple[np.ndarray, np.ndarray]:
    """(compute, weight) arrays of integers from what ``source`` returned."""
    compute, weight = result
    arrays = []
    for role, value in (("compute", compute), ("weight", weight)):
        value = np.asarray(value)
        if value.dtype == bool or not np.issubdtype(value.dtype, np.integer):
            raise StrategyError(
                f"strategy {strategy.name!r}: {source} returned {role} workers of type {value.dtype}; "
                f"it must return integers"
            )
        arrays.append(np.broadcast_to(value, (n,)).astype(np.int64))
    return arrays[0], arrays[1]


def _agrees_with_mapping(strategy, compute, weight, batch, stage, direction, num_workers: int, given: bool) -> bool:
    """Whether per-item calls of the mapping give the same workers on a
    fixed sample of items (the first, the last and random ones).  With
    ``given`` (the strategy's own ``map_arrays``) a difference is an error."""
    n = len(batch)
    sample = _sample(n)
    expected = _map_per_item(strategy, batch[sample], stage[sample], direction[sample], num_workers)
    differ = np.flatnonzero((expected[0] != compute[sample]) | (expected[1] != weight[sample]))
    if len(differ) and given:
        i = int(sample[differ[0]])
        work = Work(int(batch[i]), int(stage[i]), Direction(int(direction[i])))
        raise StrategyError(
            f"strategy {strategy.name!r}: map_arrays gives {work!r} workers ({compute[i]}, {weight[i]}) but its "
            f"mapping gives ({expected[0][differ[0]]}, {expected[1][differ[0]]}); make the two agree"
        )
    return not len(differ)


def _map_per_item(strategy: Strategy, batch, stage, direction, num_workers: int) -> tuple[np.ndarray, np.ndarray]:
    compute = np.empty(len(batch), dtype=np.int64)
    weight = np.empty(len(batch), dtype=np.int64)
    mapping = strategy.mapping
    for i, work in enumerate(works(batch, stage, direction)):
        try:
            c, w = mapping(work)
        except Exception as error:
            raise StrategyError(
                f"strategy {strategy.name!r} failed on {work!r}: {type(error).__name__}: {error}"
            ) from error
        compute[i] = _worker_id(c, work, "compute", strategy, num_workers)
        weight[i] = _worker_id(w, work, "weight", strategy, num_workers)
    return compute, weight


def _gangs(strategy: Strategy, shape: Shape, batch, stage, direction, compute):
    """Which items run on a group of workers jointly (tensor parallelism).

    The strategy's ``gang_arrays`` if it has one (checked against ``gang``
    on a sample of items), else its ``gang`` called per item; each distinct
    answer is checked and numbered once, in the order items first give it."""
    if strategy.gang is None:
        return np.full(len(batch), -1, dtype=np.int64), (), ()
    if strategy.gang_arrays is not None:
        return _gangs_on_arrays(strategy, shape, batch, stage, direction, compute)
    W = shape.num_workers
    members: dict[tuple[tuple[int, ...], bool], int] = {}
    known: dict[tuple, tuple[tuple[int, ...], int]] = {}  # (workers, their types, collective) -> (group, gang)
    gang = [-1] * len(batch)
    for i, (work, worker) in enumerate(zip(works(batch, stage, direction), compute.tolist())):
        answer = _answer(strategy.gang(work))
        if answer is None:
            continue
        seen = known.get(answer)
        if seen is None:
            seen = known[answer] = _numbered(answer, members, work, strategy, W)
        group, gang[i] = seen
        if gang[i] >= 0 and worker not in group:
            raise _off_gang(strategy, work, group, worker, W)
    return np.array(gang, dtype=np.int64), tuple(g for g, _ in members), tuple(c for _, c in members)


def _answer(found) -> tuple | None:
    """What ``gang(work)`` returned, as (workers, their types, collective), or None."""
    found = Gang.of(found)
    if found is None:
        return None
    workers = tuple(found.workers)
    return workers, tuple(map(type, workers)), bool(found.collective)


def _same_gang(answer: tuple | None):
    """What an answer means, for comparing two: its workers as a set (None for
    one worker or none: no gang) and whether they all-reduce; types aside."""
    if answer is None or len(set(answer[0])) <= 1:
        return None
    return tuple(sorted({int(w) for w in answer[0]})), answer[2]


def _off_gang(strategy: Strategy, work: Work, group: tuple, worker: int, num_workers: int) -> StrategyError:
    return StrategyError(
        f"strategy {strategy.name!r} puts {work!r} on the gang {list(group)}, which must hold its "
        f"compute worker {worker} and only workers 0..{num_workers - 1}"
    )


def _gangs_on_arrays(strategy: Strategy, shape: Shape, batch, stage, direction, compute):
    """:func:`_gangs` from the strategy's ``gang_arrays``: the same gangs,
    numbered the same way, each distinct answer checked once and the items'
    compute workers checked on arrays."""
    W, n = shape.num_workers, len(batch)
    index, answers, collective = strategy.gang_arrays(batch, stage, direction)
    index = np.broadcast_to(np.asarray(index), (n,)).astype(np.int64)
    answers = [(tuple(m), tuple(map(type, m)), bool(c)) for m, c in zip(answers, collective)]
    if n and not -1 <= index.min() <= index.max() < len(answers):
        raise StrategyError(f"strategy {strategy.name!r}: gang_arrays gives indices from {index.min()} to "
                            f"{index.max()} into {len(answers)} gangs; give -1 or a gang's index")
    sample = _sample(n)
    for i, work in zip(sample, works(batch[sample], stage[sample], direction[sample])):
        given = answers[index[i]] if index[i] >= 0 else None
        if _same_gang(_answer(strategy.gang(work))) != _same_gang(given):
            raise StrategyError(f"strategy {strategy.name!r}: gang_arrays gives {work!r} the gang "
                                f"{given and list(given[0])} but gang gives {strategy.gang(work)!r}; make the two agree")
    members: dict[tuple[tuple[int, ...], bool], int] = {}
    number = np.full(len(answers) + 1, -1, np.int64)  # the last: one worker
    used, first = np.unique(index, return_index=True)
    for a, i in sorted(zip(used.tolist(), first.tolist()), key=lambda pair: pair[1]):
        if a >= 0:
            number[a] = _numbered(answers[a], members, Work(int(batch[i]), int(stage[i]), Direction(int(direction[i]))),
                                  strategy, W)[1]
    gang = number[index]
    held = np.array([g * W + m for (group, _), g in members.items() for m in group], dtype=np.int64)  # (gang, worker)
    bad = np.flatnonzero((gang >= 0) & ~np.isin(gang * W + compute, held))  # not a gang x worker table: W may be 10^6
    if len(bad):
        i = int(bad[0])
        group = next(group for (group, _), g in members.items() if g == gang[i])
        raise _off_gang(strategy, Work(int(batch[i]), int(stage[i]), Direction(int(direction[i]))), group,
                        int(compute[i]), W)
    return gang, tuple(g for g, _ in members), tuple(c for _, c in members)


def _numbered(answer: tuple, members: dict, work: Work, strategy: Strategy, num_workers: int):
    """A gang answer's workers, checked and sorted, and its number in
    ``members`` (-1 for one worker: no gang)."""
    workers, _, collective = answer
    if len(workers) <= 1:
        return (), -1
    group = tuple(sorted({_worker_id(m, work, "gang", strategy, num_workers) for m in workers}))
    return group, members.setdefault((group, collective), len(members))


def _moves_in_gangs(gang, gang_members, gang_collective, stage, direction, input_bytes, output_bytes) -> GangMoves:
    """What moves among the members of each gang item (``Problem.gang_move_table``):
    :func:`unisched.dataflow.gang_moves` once per gang and direction, its
    bytes per item's stage."""
    ganged = np.flatnonzero(gang >= 0)
    directions = int(direction.max(initial=0)) + 1
    combos, which = np.unique(gang[ganged] * directions + direction[ganged], return_inverse=True)
    data = {"input": 0, "output": 1}
    template = []  # per combo: (after, kind, src, dst, data, share) of its moves, those handed out first
    for combo in combos.tolist():
        g, d = divmod(combo, directions)
        planned = dataflow.gang_moves(Direction(d), gang_members[g], gang_collective[g])
        template.append([(m.after, TRANSFER_KINDS.index(m.kind), m.src, m.dst, data[m.data], m.share)
                         for after in (False, True) for m in planned if m.after is after])
    owner, row = _expanded(which.reshape(-1), template)
    after, kind, src, dst, datum, share = _template_columns(template, (bool, np.int64, np.int64, np.int64, np.int64,
                                                                       float))
    sizes = np.stack([np.asarray(input_bytes, dtype=float), np.asarray(output_bytes, dtype=float)])
    nbytes = sizes[datum[row], stage[ganged][owner]] * share[row]
    moved = nbytes > 0
    return GangMoves(ganged[owner][moved], after[row][moved], kind[row][moved], src[row][moved], dst[row][moved],
                     nbytes[moved])


def _weights_in_gangs(gang, gang_members, gang_collective, compute, weight, stage, num_workers: int,
                      num_stages: int, weight_bytes, items: Items, name: str) -> WeightShares:
    """The weights each member of each gang item computes with
    (``Problem.weight_share_table``): :func:`unisched.dataflow.gang_weights`
    once per gang, weight worker and the tensor-parallel gang that worker
    computes the stage with, its bytes per item's stage."""
    ganged = np.flatnonzero(gang >= 0)
    g, s = gang[ganged], stage[ganged]
    collective = np.asarray(gang_collective, dtype=bool)[g] if len(ganged) else np.zeros(0, bool)
    # (worker, stage) -> the tensor-parallel gang that worker computes the stage with (the last item's),
    # as sorted keys (worker * S + stage) and their gangs: W * S can be far more than the items
    at = (compute[ganged] * num_stages + s)[collective]
    keys, first_reversed = np.unique(at[::-1], return_index=True)
    gangs = g[collective][len(at) - 1 - first_reversed]
    wanted = weight[ganged] * num_stages + s
    found = np.minimum(np.searchsorted(keys, wanted), max(len(keys) - 1, 0))
    known = (keys[found] == wanted) if len(keys) else np.zeros(len(wanted), bool)
    weight_gang = np.where(collective & known, gangs[found] if len(keys) else -1, -1)
    _check_shards(ganged, g, weight_gang, gang_members, weight, items, name)
    G = len(gang_members)
    combos, which = np.unique((g * num_workers + weight[ganged]) * (G + 1) + weight_gang + 1, return_inverse=True)
    template = []  # per combo: (member, holder, share, fraction) per member
    for combo in combos.tolist():
        rest, wg = divmod(combo, G + 1)
        gi, w = divmod(rest, num_workers)
        template.append(dataflow.gang_weights(gang_members[gi], gang_collective[gi], w,
                                              gang_members[wg - 1] if wg else None))
    owner, row = _expanded(which.reshape(-1), template)
    member, holder, share, fraction = _template_columns(template, (np.int64, np.int64, np.int64, float))
    nbytes = np.asarray(weight_bytes, dtype=float)[s[owner]] * fraction[row]
    return WeightShares(ganged[owner], member[row], holder[row], share[row], nbytes)


def weight_shards(strategy: Strategy, stage: np.ndarray, weight: np.ndarray,
                  num_workers: int) -> dict[tuple[int, int], tuple[int, ...]]:
    """``strategy.weight_shards`` asked once per (stage, weight worker) of
    the step, checked: (stage, weight worker) -> the shards' holders, for
    the stages held in more than one shard."""
    if strategy.weight_shards is None:
        return {}
    found, sizes, position = {}, {}, {}
    for code in np.unique(stage * num_workers + weight).tolist():
        s, w = divmod(code, num_workers)
        answer = strategy.weight_shards(s, w)
        holders = (w,) if answer is None else _holders(answer, s, w, num_workers, strategy.name)
        said = f"strategy {strategy.name!r}: weight_shards holds stage {s}"
        if sizes.setdefault(s, (len(holders), w))[0] != len(holders):
            other, v = sizes[s]
            raise StrategyError(
                f"{said} in {len(holders)} shard(s) for weight worker {w} but in {other} for weight worker {v}; "
                "shard i of a stage is one slice of its weights, so give every weight worker of a stage shards of "
                "one size (None counts as one whole shard)")
        for i, h in enumerate(holders):
            if position.setdefault((s, h), (i, w))[0] != i:
                j, v = position[(s, h)]
                raise StrategyError(
                    f"{said} with worker {h} holding shard {i} for weight worker {w} but shard {j} for weight "
                    f"worker {v}; a worker holds one slice of a stage, so list it at one position in every group")
        if len(holders) > 1:
            found[(s, w)] = holders
    return found


def _holders(answer, stage: int, weight: int, num_workers: int, name: str) -> tuple[int, ...]:
    """What ``weight_shards(stage, weight)`` returned, as distinct worker ids that include the weight worker."""
    said = f"strategy {name!r}: weight_shards({stage}, {weight}) gave {answer!r}"
    try:
        holders = tuple(int(h) for h in answer)
        exact = all(int(h) == h and not isinstance(h, bool) for h in answer)
    except (TypeError, ValueError):
        raise StrategyError(f"{said}; give a sequence of worker ids, or None for a whole stage") from None
    if not holders or not exact or len(set(holders)) != len(holders):
        raise StrategyError(f"{said}; give one or more distinct worker ids (integers), or None for a whole stage")
    outside = [h for h in holders if not 0 <= h < num_workers]
    if outside:
        raise StrategyError(f"{said}, but workers are numbered 0..{num_workers - 1}")
    if weight not in holders:
        raise StrategyError(f"{said}, which leaves out the weight worker {weight}; the weight worker of a sharded "
                            "stage holds one of its shards")
    return holders


def _sharded_rows(shards: dict, gang, compute, weight, stage, num_workers: int, num_stages: int, weight_bytes,
                  items: Items, name: str, gang_rows: WeightShares, max_gathers: int | None) -> WeightShares:
    """``gang_rows`` and a row per shard for every item of a sharded stage
    (:func:`unisched.dataflow.sharded_weights`), in item order; a gang item
    of a sharded stage is refused."""
    W = num_workers
    pair = stage * W + weight
    codes = np.array(sorted(s * W + w for s, w in shards), dtype=np.int64)
    sharded = np.isin(pair, codes)
    ganged = np.flatnonzero(sharded & (gang >= 0))
    if len(ganged):
        i = int(ganged[0])
        raise StrategyError(f"strategy {name!r} runs {items.work(i)!r} on a gang, but its stage is held in shards "
                            f"(weight_shards); the simulator shards the weights of items run by one worker only")
    rows = np.flatnonzero(sharded)
    size = np.zeros(num_stages * W, np.int64)
    size[codes] = [len(shards[divmod(code, W)]) for code in codes.tolist()]
    count = int(size[pair[rows]].sum())
    if max_gathers is not None and count > max_gathers:
        raise ShapeError(
            f"strategy {name!r} holds stages in shards: its {len(rows):,} items of sharded stages gather "
            f"{count:,} shards (one per shard per item), more than the {max_gathers:,} the simulator takes "
            "(simulate() passes MAX_ITEMS of unisched/simulate/simulation.py); shard each stage over fewer workers "
            "(hybrid sharding: groups of a node, replicated across nodes), or simulate fewer micro-batches or stages")
    combos, which = np.unique(compute[rows] * (num_stages * W) + pair[rows], return_inverse=True)
    template = []
    for combo in combos.tolist():
        member, rest = divmod(combo, num_stages * W)
        template.append(dataflow.sharded_weights(member, shards[divmod(rest, W)]))
    owner, row = _expanded(which.reshape(-1), template)
    member, holder, share, fraction = _template_columns(template, (np.int64, np.int64, np.int64, float))
    nbytes = np.asarray(weight_bytes, dtype=float)[stage[rows][owner]] * fraction[row]
    ours = WeightShares(rows[owner], member[row], holder[row], share[row], nbytes)
    both = [np.concatenate([a, b]) for a, b in zip(gang_rows, ours)]
    by_item = np.argsort(both[0], kind="stable")
    return WeightShares(*(column[by_item] for column in both))


def _check_shards(ganged, gang, weight_gang, gang_members, weight, items: Items, name: str) -> None:
    """Refuse a tensor-parallel gang item whose shards the gang its weight
    worker holds the stage with does not hold (:func:`unisched.dataflow.shards_held`)."""
    sizes = np.array([len(m) for m in gang_members] + [-1], dtype=np.int64)  # the last: no weight gang
    bad = np.flatnonzero(~dataflow.shards_held(sizes[gang], sizes[weight_gang]))
    if len(bad):
        i = int(bad[0])
        members, holders = gang_members[gang[i]], gang_members[weight_gang[i]]
        raise StrategyError(
            f"strategy {name!r} runs {items.work(int(ganged[i]))!r} on the tensor-parallel gang {list(members)} "
            f"({len(members)} shards), but its weight worker {int(weight[ganged[i]])} holds the stage in "
            f"{len(holders)} shards (gang {list(holders)}); give a stage's tensor-parallel gangs one size"
        )


def _expanded(which: np.ndarray, template: list) -> tuple[np.ndarray, np.ndarray]:
    """Rows for items that each take the rows of template ``which[i]``, in
    item order: the item (an index into ``which``) and template row of each."""
    ptr = np.zeros(len(template) + 1, np.int64)
    np.cumsum([len(rows) for rows in template], out=ptr[1:])
    count = np.diff(ptr)[which]
    owner = np.repeat(np.arange(len(which)), count)
    return owner, np.repeat(ptr[which], count) + np.arange(len(owner)) - np.repeat(np.cumsum(count) - count, count)


def _template_columns(template: list, dtypes: tuple) -> list[np.ndarray]:
    """The rows of every template (in order) as columns of ``dtypes``."""
    rows = [row for rows in template for row in rows]
    return [np.array([row[j] for row in rows], dtype=dtype) for j, dtype in enumerate(dtypes)]


def _worker_id(value, work: Work, role: str, strategy: Strategy, num_workers: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or not 0 <= value < num_workers:
        raise StrategyError(
            f"strategy {strategy.name!r} returned {role} worker {value!r} ({type(value).__name__}) for {work!r}; "
            f"it must return integers in 0..{num_workers - 1}"
        )
    return int(value)
