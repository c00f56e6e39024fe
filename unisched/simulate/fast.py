"""The greedy of :mod:`unisched.simulate.engine`, compiled by numba.

It covers every step the engine runs: any mapping, priority, per-stage
costs and worker speeds (they are only the durations), fixed per-worker
orders (each item's successor in its worker's order, followed after its
edges) and release times (an item's first ready time), split backwards,
memory limits with parking, gangs (tensor parallelism, or gangs sharing
the rows of a micro-batch), and transfers that take time: over links
between pairs of workers, or over a cluster topology whose transfers share
NVLink ports and NICs (latency, bandwidth, weight fetches with prefetch and
caching, gradient returns, what a gang hands out and collects, its
collective waiting for its links, and the end-of-step all-reduces booked on
theirs).  That is what makes a million work items take one to two seconds,
1F1B and zero bubble included, on a topology too; with tensor-parallel
gangs about six (benchmarks/simulator.py, docs/topology.md).

It is the same algorithm, step for step, as ``engine.run``; the tests check
that both give identical timelines, item for item.  What differs is the
shape of the data, because that is what compiles to fast code:

- the main heap of ``(time, key, entry)`` triples is three flat arrays
  that grow when needed;
- each worker's late items (a heap of ``(key, item)``), the releases booked
  on each worker (a heap of ``(time, amount)``) and the forwards parked on
  a storage worker for each compute worker (a heap of ``(key, item)``) live
  in one region of a shared array each, sized by how many such entries can
  be there at once (each item is in at most one of them at a time);
- what each item claims and releases is in flat arrays (CSR by item,
  :class:`~unisched.simulate.stashes.StashAccounts`);
- every transfer that may happen has its route known before the run
  (:class:`Links`): a route books one calendar (a link between a pair of
  workers) or, on a topology, each link it crosses (CSR lists of calendar
  ids), in the first gap all of them share; each calendar (sorted busy
  intervals) is a region with one slot per booking it may take, the
  collectives of gangs and the end-of-step all-reduces included;
- the end-of-step all-reduces on a topology need the step's end times:
  they are booked after the run (:func:`book_in_order`) on the calendars
  the step left, in the engine's order.

Without numba installed the engine is used instead.  numba (and what it
imports: about a second and 80 MiB) is loaded on the first step large
enough to use it (:data:`COMPILED_FROM`), so a training process that
simulates its own few hundred items never loads it.
"""

from __future__ import annotations

import math
from functools import cache
from typing import NamedTuple

import numpy as np

from unisched import network
from unisched.dataflow import EDGE_PRIMARY, fetches_weights
from unisched.simulate.problem import moves
from unisched.simulate import transfers
from unisched.simulate.stashes import StashAccounts, unique_codes
from unisched.timeline import TRANSFER_KINDS

COMPILED_FROM = 4096
"""Steps with fewer items run on the Python engine, in a few milliseconds."""

_EPS = 1e-9
"""The engine's tolerance on memory levels and release times."""


class Graph(NamedTuple):
    """The items, their durations and ranks, and the dependencies followed (CSR by source)."""

    worker: np.ndarray
    duration: np.ndarray
    rank: np.ndarray
    succ_ptr: np.ndarray
    succ_idx: np.ndarray
    succ_primary: np.ndarray
    """Per edge: whether it triggers its target (its rank becomes the target's key)."""
    next_fixed: np.ndarray
    """Per item: the next item in its worker's fixed order (-1: none), followed
    after the item's edges; it moves nothing and triggers nothing."""
    num_deps: np.ndarray
    source_items: np.ndarray
    source_keys: np.ndarray
    num_workers: int
    gang: np.ndarray
    """Per item: its gang (-1: run by one worker); the members of gang g are
    ``gang_member[gang_ptr[g]:gang_ptr[g + 1]]``."""
    gang_ptr: np.ndarray
    gang_member: np.ndarray
    release: np.ndarray
    """Per item: the earliest time it may start (zeros: any time)."""


class Routes(NamedTuple):
    """Where transfers go and what they book.  A route (one per ordered pair
    of workers a transfer may use) has its ends, latency and bandwidth, and
    books one or more calendars: without a topology each pair is one link
    with a calendar of its own; on a topology (``shared``) a route books
    every link it crosses at once, in the first gap they all share
    (``engine._Cluster``).  A calendar (busy intervals, sorted) has one slot
    per booking it may take."""

    shared: bool
    src: np.ndarray
    dst: np.ndarray
    latency: np.ndarray
    bandwidth: np.ndarray
    ptr: np.ndarray
    """Route r books calendars ``calendar[ptr[r]:ptr[r + 1]]``."""
    calendar: np.ndarray
    calendar_base: np.ndarray
    """Where each calendar's region starts; the last entry is the room of all of them."""


class Weights(NamedTuple):
    """The weights each item computes with and how they move: the workers
    computing item i and the pieces they compute with (its compute worker
    and the whole stage, each member of its gang and its share, or its
    worker and each shard of a sharded stage) are rows ``ptr[i]:ptr[i + 1]``
    (``Problem.weight_links``, by item), each worker's rows together."""

    ptr: np.ndarray
    member: np.ndarray
    nbytes: np.ndarray
    fetch_route: np.ndarray
    """Per row: the route its weights come over, -1 when the member holds them."""
    return_route: np.ndarray
    """Per row: the route its weight gradient goes back over, -1: none."""
    piece: np.ndarray
    """Per row: which (worker, stage, share) it is, numbered 0..len(grads_per_piece)-1."""
    prefetch_depth: int
    cache: bool
    grads_per_piece: np.ndarray
    """Per (worker, stage, share): how many of its rows return a gradient of
    that share (``Problem.gradient_returns``, counted on arrays)."""
    fetch_kind: int
    return_kind: int


class GangTraffic(NamedTuple):
    """What a gang item's first member hands out before the members compute
    (rows ``hand_ptr[i]:hand_ptr[i + 1]``: kind, route, bytes) and collects
    after (``Problem.gang_move_table``), and, on a topology, its collective."""

    hand_ptr: np.ndarray
    hand_kind: np.ndarray
    hand_route: np.ndarray
    hand_bytes: np.ndarray
    collect_ptr: np.ndarray
    collect_kind: np.ndarray
    collect_route: np.ndarray
    collect_bytes: np.ndarray
    collective: np.ndarray
    """Per item: the part of its duration that is its gang's collective (``Problem.collective``)."""
    calendar_ptr: np.ndarray
    """On a topology: gang g's collective books calendars ``calendar[calendar_ptr[g]:calendar_ptr[g + 1]]``."""
    calendar: np.ndarray


class Links(NamedTuple):
    """The network (``engine._Communication``), or all empty when
    communication is free: every transfer that may happen (an edge's, each
    weight fetch and gradient return, what a gang hands out and collects)
    has its route known in advance."""

    on: bool
    routes: Routes
    weights: Weights
    gangs: GangTraffic
    edge_kind: np.ndarray
    """Per edge of ``Graph``: the transfer kind it moves (a code of
    ``TRANSFER_KINDS``), -1: nothing (both ends on one worker)."""
    edge_bytes: np.ndarray
    edge_route: np.ndarray
    allreduce_ptr: np.ndarray
    """On a topology, per end-of-step all-reduce (``transfers.allreduce_table``,
    in its order, which is the stages' and shares' whatever the times): the
    calendars it books, ``allreduce_calendar[allreduce_ptr[g]:allreduce_ptr[g + 1]]``."""
    allreduce_calendar: np.ndarray


def graph_of(problem) -> Graph:
    """``problem``'s items and dependencies as a :class:`Graph`."""
    members = problem.gang_members
    gang_ptr = np.zeros(len(members) + 1, np.int64)
    np.cumsum([len(m) for m in members], out=gang_ptr[1:])
    followed = problem.data_followed
    return Graph(problem.worker_array, problem.duration, problem.rank, followed.ptr, followed.idx,
                 followed.kind == EDGE_PRIMARY, problem.next_fixed, problem.num_deps,
                 problem.sources[0], problem.rank[problem.sources[1]], problem.num_workers, problem.gang, gang_ptr,
                 np.array([m for group in members for m in group], dtype=np.int64),
                 problem.release if problem.release is not None else np.zeros(problem.num_items))


def stash_accounts(problem) -> StashAccounts:
    """``problem``'s memory model as flat arrays (empty without a limit)."""
    if problem.stashes is not None:
        return problem.stashes
    return no_stashes(problem.num_items, problem.num_workers)


def no_stashes(n: int, W: int) -> StashAccounts:
    """No memory limit: no claims, no releases."""
    none_i, none_f = np.zeros(0, np.int64), np.zeros(0)
    return StashAccounts(none_f, np.zeros(n + 1, np.int64), none_i, none_f, none_i, np.zeros(W + 1, np.int64),
                         none_i, np.zeros(n + 1, np.int64), none_i, none_f, none_i, np.zeros(W, np.int64))


def links_of(problem) -> Links:
    """``problem``'s network as :class:`Links` (off when communication is free)."""
    if not problem.comm:
        return no_links()
    n, W = problem.num_items, problem.num_workers
    worker = problem.worker_array
    table = problem.data_followed.table  # a fixed-order successor moves nothing
    kinds, nbytes = moves(problem, table)
    kinds = kinds.astype(np.int64)
    src_worker, dst_worker = worker[table[0]], worker[table[1]]
    kinds[src_worker == dst_worker] = -1
    item, member, holder, _, size = problem.weight_links
    returns, piece = problem.returning_links, problem.weight_pieces
    if len(problem.weight_share_table.item):  # rows of shared items come after the others': put them by item
        by_item = np.argsort(item, kind="stable")
        item, member, holder, size, returns, piece = (column[by_item] for column in (item, member, holder, size,
                                                                                     returns, piece))
    fetches = fetches_weights(member, holder)
    hand, collect = _gang_moves(problem, 0), _gang_moves(problem, 1)

    pair = np.concatenate([(src_worker * W + dst_worker)[kinds >= 0], (holder * W + member)[fetches],
                           (member * W + holder)[returns], hand[2] * W + hand[3], collect[2] * W + collect[3]])
    pairs, route, per_route = unique_codes(pair, W * W, return_inverse=True, return_counts=True)
    edge_route, fetch_route, return_route = np.full(len(kinds), -1), np.full(len(item), -1), np.full(len(item), -1)
    route = np.split(route.reshape(-1), np.cumsum([(kinds >= 0).sum(), fetches.sum(), returns.sum(), len(hand[2])]))
    edge_route[kinds >= 0], fetch_route[fetches], return_route[returns] = route[:3]
    latency, bandwidth = network.pair_links(problem.costs, pairs // W, pairs % W)
    calendars = _calendars_of(problem, pairs // W, pairs % W, per_route)
    routes = Routes(calendars.shared, pairs // W, pairs % W, latency, bandwidth, calendars.route_ptr,
                    calendars.route_calendar, calendars.base)
    weights = Weights(
        _ptr(item, n), member.astype(np.int64, copy=False), size.astype(float, copy=False), fetch_route, return_route,
        piece, int(problem.prefetch_depth), bool(problem.cache_weights),
        np.bincount(piece[returns], minlength=int(problem.weight_pieces.max(initial=-1)) + 1),
        TRANSFER_KINDS.index("weights"), TRANSFER_KINDS.index("weight_gradient"))
    gangs = GangTraffic(hand[0], hand[1], route[3], hand[4], collect[0], collect[1], route[4], collect[4],
                        np.asarray(problem.collective, dtype=float), calendars.gang_ptr, calendars.gang_calendar)
    return Links(True, routes, weights, gangs, kinds, np.asarray(nbytes, dtype=float), edge_route,
                 calendars.allreduce_ptr,
                 calendars.allreduce_calendar)


def _ptr(owner: np.ndarray, count: int) -> np.ndarray:
    """CSR pointers of rows sorted by ``owner`` (0..count-1)."""
    ptr = np.zeros(count + 1, np.int64)
    np.cumsum(np.bincount(owner, minlength=count), out=ptr[1:])
    return ptr


def _gang_moves(problem, after: int) -> tuple[np.ndarray, ...]:
    """(ptr by item, kind, src, dst, bytes) of what gang items' first members
    hand out (``after`` 0) or collect (1): the rows of ``Problem.gang_move_table``."""
    t = problem.gang_move_table
    rows = t.after == bool(after)
    return (_ptr(t.item[rows], problem.num_items), t.kind[rows].astype(np.int64), t.src[rows].astype(np.int64),
            t.dst[rows].astype(np.int64), t.nbytes[rows].astype(float))


class _Calendars(NamedTuple):
    """Which calendars each route, gang collective and end-of-step all-reduce books, and each calendar's region."""

    shared: bool
    route_ptr: np.ndarray
    route_calendar: np.ndarray
    gang_ptr: np.ndarray
    gang_calendar: np.ndarray
    allreduce_ptr: np.ndarray
    allreduce_calendar: np.ndarray
    base: np.ndarray


def _calendars_of(problem, src: np.ndarray, dst: np.ndarray, per_route: np.ndarray) -> _Calendars:
    """The calendars of routes src -> dst that carry ``per_route`` transfers
    each: one per route without a topology; on one, a calendar per link of
    the topology (``engine._Cluster``: a route's links, those of a gang's
    collective and of each all-reduce among replica 0's workers)."""
    topology = getattr(problem.costs, "topology", None)
    none = np.zeros(0, np.int64)
    if topology is None:
        ptr = np.arange(len(src) + 1, dtype=np.int64)
        return _Calendars(False, ptr, ptr[:-1], np.zeros(1, np.int64), none, np.zeros(1, np.int64), none,
                          _bases(per_route))
    index: dict[tuple, int] = {}  # a link of the topology -> its calendar

    def calendar(links) -> list[int]:
        return [index.setdefault(link, len(index)) for link in links]

    def collective(members) -> list[int]:
        """The calendars of a collective among ``members``: replica 0's links."""
        return calendar(topology.collective_links(members, problem.num_workers))

    routes = [calendar(topology.route(a, b).links) for a, b in zip(src.tolist(), dst.tolist())]
    gangs = [collective(members) for members in problem.gang_members]
    # which all-reduces a step has does not depend on its times, only when they are ready does;
    # the stages' first, then the tied weights'
    at_zero = np.zeros(problem.num_items), none, np.zeros(0)
    groups = transfers.allreduce_table(problem, *at_zero).groups() + \
        transfers.tie_table(problem, *at_zero, none, np.zeros(0)).groups()
    allreduces = [collective(problem.costs.everywhere(group.replicas, problem.num_workers)) for group in groups]
    route_ptr, route_calendar = _flat(routes)
    gang_ptr, gang_calendar = _flat(gangs)
    allreduce_ptr, allreduce_calendar = _flat(allreduces)
    timed = np.bincount(problem.gang[problem.collective != 0], minlength=len(gangs)) if len(gangs) else none
    room = (np.bincount(route_calendar, np.repeat(per_route, np.diff(route_ptr)), minlength=len(index))
            + np.bincount(gang_calendar, np.repeat(timed, np.diff(gang_ptr)), minlength=len(index))
            + np.bincount(allreduce_calendar, minlength=len(index)))
    return _Calendars(True, route_ptr, route_calendar, gang_ptr, gang_calendar, allreduce_ptr, allreduce_calendar,
                      _bases(room.astype(np.int64)))


def _flat(lists: list) -> tuple[np.ndarray, np.ndarray]:
    """Lists of integers as CSR (ptr, values)."""
    ptr = np.zeros(len(lists) + 1, np.int64)
    np.cumsum([len(values) for values in lists], out=ptr[1:])
    return ptr, np.array([v for values in lists for v in values], dtype=np.int64)


def _bases(room: np.ndarray) -> np.ndarray:
    """Where each region of ``room`` slots starts, and (last) the room of them all."""
    base = np.zeros(len(room) + 1, np.int64)
    np.cumsum(room, out=base[1:])
    return base


def no_links() -> Links:
    """Free communication."""
    none_i, none_f, one = np.zeros(0, np.int64), np.zeros(0), np.zeros(1, np.int64)
    routes = Routes(False, none_i, none_i, none_f, none_f, one, none_i, one)
    weights = Weights(one, none_i, none_f, none_i, none_i, none_i, 0, False, none_i, 0, 0)
    gangs = GangTraffic(one, none_i, none_i, none_f, one, none_i, none_i, none_f, none_f, one, none_i)
    return Links(False, routes, weights, gangs, none_i, none_f, none_i, one, none_i)


def run(problem):
    """Start and end time of every item of ``problem``, and the transfers
    booked as columns (:class:`~unisched.simulate.transfers.Booked`, as the
    Timeline takes them; None with free communication); or None without
    numba.  Items never scheduled (a deadlock) keep start -1."""
    kernel = compiled_schedule()
    if kernel is None:
        return None
    links = links_of(problem)
    start, end, rows, calendars = kernel(*(_contiguous(table) for table in (graph_of(problem),
                                                                             stash_accounts(problem), links)))
    if not links.on:
        return start, end, None
    booked = transfers.Booked(*rows)
    if links.routes.shared and start.min(initial=0.0) >= 0:
        booked = transfers.Booked.joined(booked, _allreduces(problem, links, calendars, end, booked))
    return start, end, booked


def _allreduces(problem, links: Links, calendars, end: np.ndarray, booked) -> "transfers.Booked":
    """The end-of-step all-reduces on a topology, each booked on the links
    its workers use once its stage is ready, in that order, after the step's
    transfers, then those of tied weights (``engine._Communication.finish_step``): their rows."""
    returned = booked.kind == links.weights.return_kind
    returned_stage, returned_end = problem.stage[booked.item[returned]], booked.end[returned]
    table = transfers.allreduce_table(problem, end, returned_stage, returned_end)
    order = np.lexsort((table.share, table.stage, table.ready))  # by (ready, stage, share), as the engine sorts
    stages, stage_end = _book_allreduces(problem, links, calendars, table, order, 0)
    ties = transfers.tie_table(problem, end, returned_stage, returned_end, table.stage[order], stage_end)
    tied, _ = _book_allreduces(problem, links, calendars, ties, np.argsort(ties.ready, kind="stable"),
                               len(table.stage))
    return transfers.Booked.joined(stages, tied)


def _book_allreduces(problem, links: Links, calendars, table, order: np.ndarray, first_group: int):
    """Book the all-reduces of ``table`` in ``order`` on their calendars
    (``links.allreduce_ptr``'s groups from ``first_group`` on): their rows,
    and each one's end, in that order."""
    count = np.diff(table.ptr)[order]
    replicas = np.concatenate([table.replicas[table.ptr[g]:table.ptr[g + 1]] for g in order.tolist()] or
                              [np.zeros(0, np.int64)])
    ptr = np.zeros(len(order) + 1, np.int64)
    np.cumsum(count, out=ptr[1:])
    everyone = [problem.costs.everywhere(replicas[a:b].tolist(), problem.num_workers)
                for a, b in zip(ptr[:-1].tolist(), ptr[1:].tolist())]
    nbytes = table.nbytes[order]
    duration = np.array([float(network.allreduce_time(problem.costs, e, b)) for e, b in zip(everyone, nbytes.tolist())],
                        dtype=float)
    groups = first_group + order.astype(np.int64)  # the table's groups are the calendars' (``_calendars_of``)
    begins = book_in_order(*calendars, links.routes.calendar_base, links.allreduce_ptr, links.allreduce_calendar,
                           groups, table.ready[order].astype(float), duration)
    src, dst, hop_bytes = transfers.ring_hops(ptr, replicas, np.array([len(e) for e in everyone]), nbytes)
    every = np.repeat(np.arange(len(order)), count)
    return transfers.Booked(np.full(len(src), TRANSFER_KINDS.index("allreduce"), np.int64), src, dst,
                            begins[every], (begins + duration)[every], hop_bytes,
                            table.item[order][every]), begins + duration


def _contiguous(table):
    """``table`` (and the tables in it) with every array contiguous, so that
    every call has the one signature numba compiled."""
    return type(table)(*(np.ascontiguousarray(v) if isinstance(v, np.ndarray) else
                         _contiguous(v) if isinstance(v, tuple) else v for v in table))


# ---------------------------------------------------------------------- the greedy
def schedule(graph, stashes, links):
    """Start and end time of every item (items never scheduled keep start
    -1), and the transfers booked as columns (kind, src, dst, start, end,
    bytes, item).  ``engine.run`` step for step."""
    worker, duration, rank, num_workers = graph.worker, graph.duration, graph.rank, graph.num_workers
    gang, gang_ptr, gang_member = graph.gang, graph.gang_ptr, graph.gang_member
    succ_ptr, succ_idx, succ_primary, next_fixed = graph.succ_ptr, graph.succ_idx, graph.succ_primary, graph.next_fixed
    n = worker.shape[0]
    remaining = graph.num_deps.copy()
    ready = graph.release.copy()  # "not before" times
    trigger_time = np.full(n, -math.inf)
    trigger_rank = np.zeros(n, dtype=np.int64)
    start = np.full(n, -1.0)
    end = np.zeros(n)
    free = np.zeros(num_workers)

    # the main heap, with room for what one step may push
    slack = _slack(succ_ptr, stashes.claim_ptr, stashes.release_ptr, stashes.pair_ptr, gang_ptr)
    capacity = 2 * n + num_workers + slack
    heap_t = np.empty(capacity)
    heap_k = np.empty(capacity, dtype=np.int64)
    heap_e = np.empty(capacity, dtype=np.int64)
    size = n - n  # an int64, not the literal 0 (one compiled version of the heap functions)

    # each worker's late items
    late_base = _regions(worker, num_workers)
    late_size = np.zeros(num_workers, dtype=np.int64)
    late_k = np.empty(n, dtype=np.int64)
    late_e = np.empty(n, dtype=np.int64)

    # memory: live stashes and booked releases (a heap of (time, amount)) per
    # worker, forwards parked per (storage, compute worker) pair (a heap of (key, item))
    memory = stashes.limit.shape[0] > 0
    limit, claim_ptr = stashes.limit, stashes.claim_ptr
    claim_worker, claim_amount = stashes.claim_worker, stashes.claim_amount
    claim_pair, pair_ptr, pair_base = stashes.claim_pair, stashes.pair_ptr, stashes.pair_base
    release_ptr, release_worker, release_amount = stashes.release_ptr, stashes.release_worker, stashes.release_amount
    release_base = stashes.release_base
    live = np.zeros(num_workers)
    release_size = np.zeros(num_workers, dtype=np.int64)
    release_t, release_a = np.empty(release_worker.shape[0]), np.empty(release_worker.shape[0])
    scratch_t, scratch_a = np.empty(release_worker.shape[0]), np.empty(release_worker.shape[0])
    park_size = np.zeros(pair_base.shape[0], dtype=np.int64)
    park_k, park_e = np.empty(claim_pair.shape[0], dtype=np.int64), np.empty(claim_pair.shape[0], dtype=np.int64)
    woken = np.empty(num_workers + 1, dtype=np.int64)
    parked = 0  # forwards parked for memory: while none is, no release needs to wake one

    # the network: the calendars, each worker's start times (for prefetch),
    # resident stages, gradients still to return, and the rows booked
    comm, routes, weights, gangs = links.on, links.routes, links.weights, links.gangs
    calendars = _calendars(routes)
    history, history_base, history_size = _histories(weights, num_workers)
    resident = np.zeros(weights.grads_per_piece.shape[0] if comm else 0, dtype=np.bool_)
    grads_left = weights.grads_per_piece.copy()
    rows = _rows(comm, _routed(links.edge_route) + _routed(weights.fetch_route) + _routed(weights.return_route)
                 + gangs.hand_route.shape[0] + gangs.collect_route.shape[0])
    booked = n - n

    for i in range(graph.source_items.shape[0]):
        trigger_rank[graph.source_items[i]] = graph.source_keys[i]
        source = graph.source_items[i]
        size = _push(heap_t, heap_k, heap_e, size, ready[source], graph.source_keys[i], source)

    while size > 0:
        if size + slack > heap_t.shape[0]:
            heap_t, heap_k, heap_e = _grown(heap_t, heap_k, heap_e, size)
        t, key, item = heap_t[0], heap_k[0], heap_e[0]
        size = _pop(heap_t, heap_k, heap_e, size)
        if item < 0:  # a worker's best late item stands here
            w = -1 - item
            base = late_base[w]
            if late_size[w] == 0 or t != free[w] or late_k[base] != key:
                continue  # stale: the worker or its queue changed since
            item = late_e[base]
            late_size[w] = _heap_pop(late_k, late_e, base, late_size[w])
            if late_size[w] > 0:
                size = _push(heap_t, heap_k, heap_e, size, t, late_k[base], -1 - w)
        else:
            w = worker[item]
            if gang[item] >= 0:  # a gang starts when all its workers are free
                gang_free = _latest_free(free, gang_member, gang_ptr[gang[item]], gang_ptr[gang[item] + 1])
                if t < gang_free:
                    size = _push(heap_t, heap_k, heap_e, size, gang_free, key, item)
                    continue
            elif t < free[w]:  # the worker got busier: wait among its late items
                base = late_base[w]
                late_size[w] = _heap_push(late_k, late_e, base, late_size[w], key, item)
                if late_e[base] == item:
                    size = _push(heap_t, heap_k, heap_e, size, free[w], key, -1 - w)
                continue

        if memory and claim_ptr[item] < claim_ptr[item + 1]:
            retry = _admit(item, t, key, limit, claim_ptr, claim_worker, claim_amount, claim_pair, pair_base, live,
                           release_base, release_size, release_t, release_a, scratch_t, scratch_a, park_size, park_k,
                           park_e)
            if retry != t:
                if retry < math.inf:
                    size = _push(heap_t, heap_k, heap_e, size, retry, key, item)
                else:
                    parked += 1
                continue

        begin, finish = t, t + duration[item]
        if comm:
            begin, booked = _begin(item, t, weights, gangs, routes, history, history_base, history_size, resident,
                                   calendars, rows, booked)
            finish, booked = _finish(item, begin + duration[item], gang[item], gangs, routes, calendars, rows, booked)
        start[item] = begin
        end[item] = finish
        if gang[item] < 0:
            free[w] = finish
            if late_size[w] > 0:
                size = _push(heap_t, heap_k, heap_e, size, finish, late_k[late_base[w]], -1 - w)
        else:
            for j in range(gang_ptr[gang[item]], gang_ptr[gang[item] + 1]):
                m = gang_member[j]
                free[m] = finish
                if late_size[m] > 0:
                    size = _push(heap_t, heap_k, heap_e, size, finish, late_k[late_base[m]], -1 - m)
        if memory:  # book the item's claims and releases; retry the forwards parked where they land
            for c in range(claim_ptr[item], claim_ptr[item + 1]):
                live[claim_worker[c]] += claim_amount[c]
                if parked == 0:
                    continue
                count = _wake(claim_worker[c], pair_ptr, pair_base, park_size, park_k, park_e, woken)
                parked -= count
                for j in range(count):
                    other = woken[j]
                    size = _push(heap_t, heap_k, heap_e, size, max(begin, ready[other]), trigger_rank[other], other)
            for r in range(release_ptr[item], release_ptr[item + 1]):
                holder = release_worker[r]
                release_size[holder] = _heap_push(release_t, release_a, release_base[holder], release_size[holder],
                                                  finish, release_amount[r])
                if parked == 0:
                    continue
                count = _wake(holder, pair_ptr, pair_base, park_size, park_k, park_e, woken)
                parked -= count
                for j in range(count):
                    other = woken[j]
                    size = _push(heap_t, heap_k, heap_e, size, max(finish, ready[other]), trigger_rank[other], other)
        if comm:
            booked = _return_gradients(item, finish, weights, routes, grads_left, calendars, rows, booked)

        item_rank = rank[item]
        last = succ_ptr[item + 1]
        for k in range(succ_ptr[item], last + 1 if next_fixed[item] >= 0 else last):  # then its fixed-order successor
            fixed = k == last
            nxt = next_fixed[item] if fixed else succ_idx[k]
            arrive = finish
            if comm and not fixed and links.edge_kind[k] >= 0:  # -1: same worker
                arrive, booked = _send(links.edge_route[k], links.edge_kind[k], finish, links.edge_bytes[k], nxt,
                                       routes, calendars, rows, booked)
            if arrive > ready[nxt]:
                ready[nxt] = arrive
            if not fixed and succ_primary[k] and arrive > trigger_time[nxt]:
                trigger_time[nxt] = arrive
                trigger_rank[nxt] = item_rank
            remaining[nxt] -= 1
            if remaining[nxt] == 0:
                nxt_worker = worker[nxt]
                nxt_key = trigger_rank[nxt]
                if ready[nxt] < free[nxt_worker] and gang[nxt] < 0:
                    base = late_base[nxt_worker]
                    late_size[nxt_worker] = _heap_push(late_k, late_e, base, late_size[nxt_worker], nxt_key, nxt)
                    if late_e[base] == nxt:
                        size = _push(heap_t, heap_k, heap_e, size, free[nxt_worker], nxt_key, -1 - nxt_worker)
                else:
                    size = _push(heap_t, heap_k, heap_e, size, ready[nxt], nxt_key, nxt)
    kind, src, dst, row_start, row_end, nbytes, row_item = rows
    return start, end, (kind[:booked], src[:booked], dst[:booked], row_start[:booked], row_end[:booked],
                        nbytes[:booked], row_item[:booked]), calendars


def _slack(succ_ptr, claim_ptr, release_ptr, pair_ptr, gang_ptr):
    """The most entries one step pushes onto the main heap: a late worker
    (twice, or once per member of a gang), a retry, the successors (and
    a fixed-order one), and a parked forward per compute worker for each
    claim and release."""
    most_pairs = 0
    for w in range(pair_ptr.shape[0] - 1):
        most_pairs = max(most_pairs, pair_ptr[w + 1] - pair_ptr[w])
    most_out, most_memory = 0, 0
    for i in range(succ_ptr.shape[0] - 1):
        most_out = max(most_out, succ_ptr[i + 1] - succ_ptr[i])
        most_memory = max(most_memory, claim_ptr[i + 1] - claim_ptr[i] + release_ptr[i + 1] - release_ptr[i])
    most_members = 1
    for g in range(gang_ptr.shape[0] - 1):
        most_members = max(most_members, gang_ptr[g + 1] - gang_ptr[g])
    return 5 + most_members + most_out + most_memory * most_pairs


def _latest_free(free, members, first, last):
    """When the last of ``members[first:last]`` is free."""
    latest = free[members[first]]
    for j in range(first + 1, last):
        latest = max(latest, free[members[j]])
    return latest


def _regions(owner, count):
    """Where each owner's region starts when each holds one slot per entry of ``owner``."""
    sizes = np.zeros(count, dtype=np.int64)
    for i in range(owner.shape[0]):
        sizes[owner[i]] += 1
    base = np.zeros(count, dtype=np.int64)
    for i in range(1, count):
        base[i] = base[i - 1] + sizes[i - 1]
    return base


# ---------------------------------------------------------------------- memory (engine._Memory)
def _level(w, t, live, base, release_size, release_t, release_a):
    """Worker w's live stashes at ``t``, after the releases booked up to then."""
    while release_size[w] > 0 and release_t[base] <= t + _EPS:
        live[w] -= release_a[base]
        release_size[w] = _heap_pop(release_t, release_a, base, release_size[w])
    return live[w]


def _admit(item, t, key, limit, claim_ptr, claim_worker, claim_amount, claim_pair, pair_base, live, release_base,
           release_size, release_t, release_a, scratch_t, scratch_a, park_size, park_k, park_e):
    """``t`` if ``item`` may start at ``t``; else when to look again (inf: parked)."""
    retry = t
    for c in range(claim_ptr[item], claim_ptr[item + 1]):
        w = claim_worker[c]
        need = _level(w, t, live, release_base[w], release_size, release_t, release_a) + claim_amount[c] - limit[w]
        if need <= _EPS:
            continue
        when = _when_freed(need, release_base[w], release_size[w], release_t, release_a, scratch_t, scratch_a)
        if when == math.inf:
            pair = claim_pair[c]
            park_size[pair] = _heap_push(park_k, park_e, pair_base[pair], park_size[pair], key, item)
            return math.inf
        retry = max(retry, when)
    return retry


def _when_freed(need, base, count, release_t, release_a, scratch_t, scratch_a):
    """The first booked release time by which ``need`` is freed (releases in
    time order, as the engine's ``sorted``), or inf."""
    for i in range(count):
        scratch_t[i] = release_t[base + i]
        scratch_a[i] = release_a[base + i]
    freed = 0.0
    while count > 0:
        time, released = scratch_t[0], scratch_a[0]
        count = _heap_pop(scratch_t, scratch_a, base - base, count)
        freed += released
        if freed >= need - _EPS:
            return time
    return math.inf


def _wake(w, pair_ptr, pair_base, park_size, park_k, park_e, woken):
    """Take the first parked forward of each compute worker waiting on w; how many."""
    count = 0
    for pair in range(pair_ptr[w], pair_ptr[w + 1]):
        if park_size[pair] > 0:
            base = pair_base[pair]
            woken[count] = park_e[base]
            count += 1
            park_size[pair] = _heap_pop(park_k, park_e, base, park_size[pair])
    return count


# ---------------------------------------------------------------------- network (engine._Communication)
def _calendars(routes):
    """Every calendar's busy intervals, sorted (starts, ends, and how many
    each holds): one region per calendar, a slot per booking it may take."""
    slots = routes.calendar_base[routes.calendar_base.shape[0] - 1]
    return np.empty(slots), np.empty(slots), np.zeros(routes.calendar_base.shape[0] - 1, dtype=np.int64)


def _histories(weights, num_workers):
    """Each worker's start times (a region per worker, a slot per weight row it computes)."""
    return (np.empty(weights.member.shape[0]), _regions(weights.member, num_workers),
            np.zeros(num_workers, np.int64))


def _routed(route):
    """How many transfers have a route (-1: none): each is booked once at most."""
    count = 0
    for r in route:
        count += r >= 0
    return count


def _rows(comm, slots):
    """Room for every transfer the step may book: kind, src, dst, start, end, bytes, item."""
    slots = slots if comm else 0
    return (np.empty(slots, dtype=np.int64), np.empty(slots, dtype=np.int64), np.empty(slots, dtype=np.int64),
            np.empty(slots), np.empty(slots), np.empty(slots), np.empty(slots, dtype=np.int64))


def _begin(item, t, weights, gangs, routes, history, history_base, history_size, resident, calendars, rows, booked):
    """When ``item``, taken at ``t``, begins computing: once each of its
    workers has its weights (``engine._Communication.fetch_weights``, each
    member of a gang its share, a worker of a sharded stage every shard)
    and what its gang's first member hands out has arrived
    (``gang_start``); and how many rows are booked."""
    ready = t
    last = -1
    for r in range(weights.ptr[item], weights.ptr[item + 1]):
        w = weights.member[r]
        if w != last:  # one entry per item on each of its workers
            history[history_base[w] + history_size[w]] = t
            history_size[w] += 1
            last = w
        if weights.fetch_route[r] >= 0:
            arrive, booked = _fetch(item, t, r, weights, routes, history, history_base[w], history_size[w],
                                    resident, calendars, rows, booked)
            ready = max(ready, arrive)
    begin = ready
    for h in range(gangs.hand_ptr[item], gangs.hand_ptr[item + 1]):
        arrive, booked = _send(gangs.hand_route[h], gangs.hand_kind[h], ready, gangs.hand_bytes[h], item, routes,
                               calendars, rows, booked)
        begin = max(begin, arrive)
    return begin, booked


def _finish(item, computed, gang, gangs, routes, calendars, rows, booked):
    """When ``item``, done computing at ``computed``, ends: on a topology its
    gang's collective (the last ``collective[item]`` of it) waits for the
    links its members use (``gang_collective``), then the first member
    collects the members' results (``collect``); and how many rows are booked."""
    finish = computed
    collective = gangs.collective[item]
    if routes.shared and collective != 0:
        first, last = gangs.calendar_ptr[gang], gangs.calendar_ptr[gang + 1]
        finish = _book_all(gangs.calendar, first, last, calendars, routes.calendar_base, computed - collective,
                           collective) + collective
    done = finish
    for h in range(gangs.collect_ptr[item], gangs.collect_ptr[item + 1]):
        arrive, booked = _send(gangs.collect_route[h], gangs.collect_kind[h], finish, gangs.collect_bytes[h], item,
                               routes, calendars, rows, booked)
        done = max(done, arrive)
    return done, booked


def _return_gradients(item, finish, weights, routes, grads_left, calendars, rows, booked):
    """Send ``item``'s weight gradients back to their holders (``on_finished``); how many rows are booked."""
    for r in range(weights.ptr[item], weights.ptr[item + 1]):
        if weights.return_route[r] >= 0 and _returns_now(weights.piece[r], weights, grads_left):
            _, booked = _send(weights.return_route[r], weights.return_kind, finish, weights.nbytes[r], item, routes,
                              calendars, rows, booked)
    return booked


def _send(route, kind, ready, nbytes, item, routes, calendars, rows, booked):
    """Book ``nbytes`` on ``route`` from ``ready``: when it arrives, and how many rows are booked."""
    latency, occupy = routes.latency[route], nbytes / routes.bandwidth[route]
    first, last = routes.ptr[route], routes.ptr[route + 1]
    if routes.shared:
        begin = _book_all(routes.calendar, first, last, calendars, routes.calendar_base, ready, occupy)
    elif occupy > 0:
        begin = _book(calendars, routes.calendar_base, routes.calendar[first], ready, occupy)
    else:
        begin = ready
    arrive = begin + latency + occupy
    rows[0][booked], rows[1][booked], rows[2][booked] = kind, routes.src[route], routes.dst[route]
    rows[3][booked], rows[4][booked], rows[5][booked], rows[6][booked] = begin, arrive, nbytes, item
    return arrive, booked + 1


def _book(calendars, bases, calendar, ready, occupy):
    """Take the first gap of ``occupy`` at or after ``ready`` on one calendar (engine._Calendar.book)."""
    starts, ends, sizes = calendars
    base, size = bases[calendar], sizes[calendar]
    i = _bisect_right(ends, base, base + size, ready) - base
    begin = ready
    while i < size and starts[base + i] < begin + occupy:
        begin = max(begin, ends[base + i])
        i += 1
    sizes[calendar] = _take(starts, ends, base, size, i, begin, occupy)
    return begin


def _book_all(ids, first, last, calendars, bases, ready, occupy):
    """Take ``occupy`` on every calendar of ``ids[first:last]`` in the first
    gap at or after ``ready`` that they all share; return its start
    (engine._Cluster._book)."""
    if occupy <= 0 or first == last:
        return ready
    starts, ends, sizes = calendars
    begin = ready
    while True:
        moved = begin
        for j in range(first, last):
            c = ids[j]
            moved = max(moved, _gap(starts, ends, bases[c], sizes[c], begin, occupy))
        if moved == begin:
            break
        begin = moved
    for j in range(first, last):
        c = ids[j]
        base, size = bases[c], sizes[c]
        sizes[c] = _take(starts, ends, base, size, _bisect_right(ends, base, base + size, begin) - base, begin,
                         occupy)
    return begin


def _gap(starts, ends, base, size, ready, occupy):
    """The start of a calendar's first gap of ``occupy`` at or after ``ready`` (engine._Calendar.gap)."""
    i = _bisect_right(ends, base, base + size, ready) - base
    begin = ready
    while i < size and starts[base + i] < begin + occupy:
        begin = max(begin, ends[base + i])
        i += 1
    return begin


def _take(starts, ends, base, size, i, begin, occupy):
    """Take [begin, begin + occupy), a gap before the calendar's interval i,
    and return how many intervals it then holds.  A taken span that touches
    its neighbours joins them: the calendar keeps the same free time in
    fewer intervals, so a queue of transfers on a link is one interval that
    the next booking skips at once instead of one per transfer."""
    end = begin + occupy
    left = i > 0 and ends[base + i - 1] == begin
    right = i < size and starts[base + i] == end
    if left and right:  # fills the gap between two intervals: they become one
        ends[base + i - 1] = ends[base + i]
        for j in range(i, size - 1):
            starts[base + j], ends[base + j] = starts[base + j + 1], ends[base + j + 1]
        return size - 1
    if left:
        ends[base + i - 1] = end
        return size
    if right:
        starts[base + i] = begin
        return size
    for j in range(size, i, -1):
        starts[base + j], ends[base + j] = starts[base + j - 1], ends[base + j - 1]
    starts[base + i], ends[base + i] = begin, end
    return size + 1


def book_in_order(starts, ends, sizes, bases, ptr, ids, groups, ready, duration):
    """Book collectives one after another on the calendars a step left:
    collective j takes ``duration[j]`` from ``ready[j]`` on the calendars of
    group ``groups[j]`` (``ids[ptr[g]:ptr[g + 1]]``); their starts."""
    calendars = (starts, ends, sizes)
    begins = np.empty(groups.shape[0])
    for j in range(groups.shape[0]):
        g = groups[j]
        begins[j] = _book_all(ids, ptr[g], ptr[g + 1], calendars, bases, ready[j], duration[j])
    return begins


def _bisect_right(values, lo, hi, x):
    """First index in ``values[lo:hi]`` (sorted) whose value is above ``x``."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if x < values[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _fetch(item, t, r, weights, routes, history, base, count, resident, calendars, rows, booked):
    """When the weights of row r of ``item``, held by another worker, are
    on its worker: at once if that worker keeps them from an earlier fetch, else when
    the fetch arrives, issued ``prefetch_depth`` items earlier
    (``engine._Communication.fetch_weights``)."""
    at = weights.piece[r]
    if weights.cache and resident[at]:
        return t, booked
    depth = weights.prefetch_depth
    issue = t
    if depth > 0:
        issue = history[base + count - 1 - depth] if count > depth else 0.0
    arrive, booked = _send(weights.fetch_route[r], weights.fetch_kind, issue, weights.nbytes[r], item, routes,
                           calendars, rows, booked)
    if weights.cache:
        resident[at] = True
    if arrive > history[base + count - 1]:
        history[base + count - 1] = arrive
    return max(t, arrive), booked


def _returns_now(at, weights, grads_left):
    """Whether a worker sends its weight gradient of piece ``at`` (a share
    of a stage) back now (with cached weights: only for the last of its
    items of that stage)."""
    if not weights.cache:
        return True
    grads_left[at] -= 1
    return grads_left[at] == 0


# ---------------------------------------------------------------------- flat heaps
def _before(t1, k1, e1, t2, k2, e2):
    """Tuple order of (time, key, entry)."""
    if t1 != t2:
        return t1 < t2
    if k1 != k2:
        return k1 < k2
    return e1 < e2


def _push(ht, hk, he, size, t, k, e):
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        if not _before(t, k, e, ht[parent], hk[parent], he[parent]):
            break
        ht[i], hk[i], he[i] = ht[parent], hk[parent], he[parent]
        i = parent
    ht[i], hk[i], he[i] = t, k, e
    return size + 1


def _pop(ht, hk, he, size):
    size -= 1
    t, k, e = ht[size], hk[size], he[size]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and _before(ht[child + 1], hk[child + 1], he[child + 1], ht[child], hk[child], he[child]):
            child += 1
        if not _before(ht[child], hk[child], he[child], t, k, e):
            break
        ht[i], hk[i], he[i] = ht[child], hk[child], he[child]
        i = child
    if size > 0:
        ht[i], hk[i], he[i] = t, k, e
    return size


def _grown(ht, hk, he, size):
    """The main heap's arrays with twice the room."""
    capacity = 2 * ht.shape[0]
    t, k, e = np.empty(capacity), np.empty(capacity, dtype=np.int64), np.empty(capacity, dtype=np.int64)
    t[:size], k[:size], e[:size] = ht[:size], hk[:size], he[:size]
    return t, k, e


def _heap_push(lk, le, base, size, k, e):
    """Push (k, e) onto a heap of pairs, smallest first, kept in two arrays from
    ``base`` on (integer pairs for late and parked items, times for releases:
    numba compiles one version for each; equal pairs may sit in either order)."""
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        pk, pe = lk[base + parent], le[base + parent]
        if k > pk or (k == pk and e > pe):
            break
        lk[base + i], le[base + i] = pk, pe
        i = parent
    lk[base + i], le[base + i] = k, e
    return size + 1


def _heap_pop(lk, le, base, size):
    size -= 1
    k, e = lk[base + size], le[base + size]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        c = base + child
        if child + 1 < size and (lk[c + 1] < lk[c] or (lk[c + 1] == lk[c] and le[c + 1] < le[c])):
            child += 1
            c += 1
        if lk[c] > k or (lk[c] == k and le[c] > e):
            break
        lk[base + i], le[base + i] = lk[c], le[c]
        i = child
    if size > 0:
        lk[base + i], le[base + i] = k, e
    return size


_HELPERS = ("_before", "_push", "_pop", "_grown", "_heap_push", "_heap_pop", "_regions",
            "_slack", "_latest_free", "_level", "_when_freed", "_admit", "_wake", "_calendars", "_histories",
            "_routed", "_rows",
            "_bisect_right", "_gap", "_take", "_book", "_book_all", "_send", "_fetch", "_returns_now", "_begin",
            "_finish", "_return_gradients", "book_in_order", "schedule")
"""What numba compiles, callees first (a compiled function calls the compiled ones)."""

_INLINED = ("_admit", "_level", "_wake")
"""Helpers numba inlines where they are called: they run once per item and
take tables a call copies."""

_UNCOUNTED = ("_before", "_push", "_pop", "_heap_push", "_heap_pop", "_latest_free", "_when_freed", "_bisect_right",
              "_gap", "_take", "_book", "_book_all", "_send", "_fetch", "_returns_now", "_begin", "_finish",
              "_return_gradients")
"""Helpers compiled without numba's reference counting (``_nrt=False``):
they allocate nothing and only read and write arrays their caller holds.
Counted, every array a call takes or takes from a table (the routes, the
rows booked, the calendars) cost an atomic increment and decrement: on a
network most of the compiled step's time, without one about a fifth."""


@cache
def compiled_schedule():
    """:func:`schedule` compiled by numba (on first use), or None without numba."""
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency; this keeps the simulator usable without it
        return None
    jit = numba.njit(cache=True, nogil=True)
    inline = numba.njit(cache=True, nogil=True, inline="always")
    uncounted = numba.njit(cache=True, nogil=True, _nrt=False)
    for name in _HELPERS:
        globals()[name] = (inline if name in _INLINED else uncounted if name in _UNCOUNTED else jit)(globals()[name])
    return globals()["schedule"]


def warm_up() -> None:
    """Compile :func:`schedule` now, or load it from numba's cache (a
    benchmark's first timed call should not pay for it): one item, no
    limit, free communication."""
    if compiled_schedule() is None:
        return
    one, none = np.zeros(1, np.int64), np.zeros(0, np.int64)
    graph = Graph(worker=one, duration=np.ones(1), rank=one, succ_ptr=np.zeros(2, np.int64), succ_idx=none,
                  succ_primary=np.zeros(0, bool), next_fixed=np.full(1, -1), num_deps=one, source_items=one,
                  source_keys=one, num_workers=1, gang=np.full(1, -1), gang_ptr=np.zeros(1, np.int64),
                  gang_member=none, release=np.zeros(1))
    schedule(*(_contiguous(table) for table in (graph, no_stashes(1, 1), no_links())))
    none = np.zeros(0, np.int64)
    book_in_order(np.zeros(0), np.zeros(0), none, np.zeros(1, np.int64), np.zeros(1, np.int64), none, none,
                  np.zeros(0), np.zeros(0))
