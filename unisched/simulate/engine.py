"""The tickless greedy, in O(J log J).

The reference rule: repeatedly take, among the items whose
dependencies are done, the one that can start soonest on its compute worker,
``max(time the worker is free, time its inputs are there)``, ties broken by
the priority rank of its trigger; run it there for its duration.  An item
with a release time (a fixed strategy's ``release``) is not ready before it.

Doing that by scanning the whole frontier costs O(J) a step.  Here every
candidate sits in one heap keyed by ``(start estimate, rank)``.  An estimate
is exact unless its worker got busier since it was pushed; such an item
moves to its worker's "late" heap (ordered by rank alone, since every late
item of a worker can start the moment the worker is free), and the worker's
best late item stands in the main heap.  Each item enters each heap at most
a constant number of times, so the whole run is O(J log J).

Memory limits: a forward whose stash would not fit on the worker that keeps
it waits, either until a release already scheduled there (pushed back with
that time) or, when none is, parked until a backward on that worker is
scheduled.  When nothing can run and work remains, that is a deadlock.

A gang item (tensor parallelism) needs all its workers free at once; it
never waits in a late heap but is pushed back to the time its busiest member
frees up.  With communication costs its members compute once the first
member's hand-out has reached them, and the item ends when its collected
results are back (:func:`unisched.dataflow.gang_moves`).

On a topology (:class:`unisched.topology.ClusterCosts`) a transfer books
every link of its route at once, for as long as its bytes take at the
route's bottleneck, in the first gap all of them share; a gang's
tensor-parallel collective books the links its members use at the end of
the item; and once every item is placed, the end-of-step all-reduces
(:func:`unisched.simulate.transfers.allreduce_groups`) book theirs, in the
order their stages become ready.  Workers compute while their transfers
are in flight.  Without a topology each ordered pair of workers is one link.

The engine works on integer item ids and flat lists prepared by
:mod:`unisched.simulate.problem`; it knows nothing of strategies or Work.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from heapq import heappop, heappush

import numpy as np

from unisched import network
from unisched.dataflow import EDGE_PRIMARY
from unisched.errors import DeadlockError
from unisched.simulate import transfers
from unisched.simulate.problem import Problem

INF = math.inf
_EPS = 1e-9


def run(p: Problem):
    """Schedule every item of ``p``; return (start, end, the transfers
    booked as :class:`transfers.Booked` columns, or None when communication
    is free)."""
    n, num_workers = p.num_items, p.num_workers
    worker, duration, rank = p.worker, p.duration.tolist(), p.rank.tolist()
    data = p.data_followed  # an item's data dependencies, then its successor in its worker's fixed order
    succ_ptr, succ_idx, succ_kind = data.ptr.tolist(), data.idx.tolist(), data.kind.tolist()
    next_fixed = p.next_fixed.tolist()
    remaining = p.num_deps.tolist()
    ready = p.release.tolist() if p.release is not None else [0.0] * n  # "not before" times
    trigger_time = [-INF] * n
    trigger_rank = [0] * n
    start = [0.0] * n
    end = [0.0] * n
    free = [0.0] * num_workers
    late = [[] for _ in range(num_workers)]
    heap: list[tuple[float, int, int]] = []

    memory = _Memory(p) if p.claims is not None else None
    comm = _Communication(p) if p.comm else None
    gang_of = p.gang.tolist()
    gangs = p.gang_members

    for item, virtual in p.sources.T.tolist():
        trigger_rank[item] = rank[virtual]
        heappush(heap, (ready[item], rank[virtual], item))

    scheduled = 0
    while heap:
        t, key, item = heappop(heap)
        if item < 0:  # a worker's best late item stands here
            w = -1 - item
            queue = late[w]
            if not queue or t != free[w] or queue[0][0] != key:
                continue  # stale: the worker or its queue changed since
            item = heappop(queue)[1]
            if queue:
                heappush(heap, (t, queue[0][0], -1 - w))
        else:
            w = worker[item]
            if gang_of[item] >= 0:  # a gang starts when all its workers are free
                gang_free = max(free[m] for m in gangs[gang_of[item]])
                if t < gang_free:
                    heappush(heap, (gang_free, key, item))
                    continue
            elif t < free[w]:  # the worker got busier: wait among its late items
                queue = late[w]
                heappush(queue, (key, item))
                if queue[0][1] == item:
                    heappush(heap, (free[w], key, -1 - w))
                continue

        if memory is not None:
            retry = memory.admit(item, t, key)
            if retry is not None:
                if retry < INF:
                    heappush(heap, (retry, key, item))
                continue

        if comm is None:
            begin = t
            finish = t + duration[item]
        elif gang_of[item] < 0:
            begin = comm.fetch_weights(item, t)
            finish = begin + duration[item]
        else:
            begin = comm.gang_start(item, t)
            finish = comm.collect(item, comm.gang_collective(item, begin + duration[item]))
        start[item] = begin
        end[item] = finish
        scheduled += 1
        for m in gangs[gang_of[item]] if gang_of[item] >= 0 else (w,):
            free[m] = finish
            if late[m]:
                heappush(heap, (finish, late[m][0][0], -1 - m))
        if memory is not None:
            for retry_item, retry_time in memory.on_scheduled(item, begin, finish):
                heappush(heap, (max(retry_time, ready[retry_item]), trigger_rank[retry_item], retry_item))
        if comm is not None:
            comm.on_finished(item, finish)

        item_rank = rank[item]
        last = succ_ptr[item + 1]
        for k in range(succ_ptr[item], last + 1 if next_fixed[item] >= 0 else last):
            if k < last:  # a data edge
                nxt = succ_idx[k]
                arrive = comm.move(k, item, nxt, finish) if comm is not None else finish
                primary = succ_kind[k] == EDGE_PRIMARY
            else:  # then the next item in its worker's fixed order: it moves nothing and triggers nothing
                nxt, arrive, primary = next_fixed[item], finish, False
            if arrive > ready[nxt]:
                ready[nxt] = arrive
            if primary and arrive > trigger_time[nxt]:
                trigger_time[nxt] = arrive
                trigger_rank[nxt] = item_rank
            remaining[nxt] -= 1
            if remaining[nxt] == 0:
                nxt_worker = worker[nxt]
                nxt_key = trigger_rank[nxt]
                at = ready[nxt]
                if at < free[nxt_worker] and gang_of[nxt] < 0:
                    queue = late[nxt_worker]
                    heappush(queue, (nxt_key, nxt))
                    if queue[0][1] == nxt:
                        heappush(heap, (free[nxt_worker], nxt_key, -1 - nxt_worker))
                else:
                    heappush(heap, (at, nxt_key, nxt))

    if scheduled < n:
        raise _deadlock(p, remaining, start, end, memory)
    if comm is not None:
        comm.finish_step(end)
    return start, end, (transfers.Booked.of_rows(comm.rows) if comm is not None else None)


class _Memory:
    """Stash accounting on the workers that keep them, against their limits."""

    def __init__(self, p: Problem):
        self.p = p
        self.live = [0.0] * p.num_workers
        self.releases = [[] for _ in range(p.num_workers)]  # heaps of (time, amount)
        self.parked = [dict() for _ in range(p.num_workers)]  # storage worker -> {compute worker: heap}
        self.holding = [dict() for _ in range(p.num_workers)]  # storage worker -> {item: amount}, for errors

    def _level(self, w: int, t: float) -> float:
        releases = self.releases[w]
        while releases and releases[0][0] <= t + _EPS:
            self.live[w] -= heappop(releases)[1]
        return self.live[w]

    def admit(self, item: int, t: float, key: int) -> float | None:
        """None if ``item`` may start at ``t``; else when to look again (INF: parked)."""
        claims = self.p.claims[item]
        if not claims:
            return None
        retry = t
        for w, amount in claims:
            need = self._level(w, t) + amount - self.p.limit[w]
            if need <= _EPS:
                continue
            freed, when = 0.0, INF
            for time, released in sorted(self.releases[w]):
                freed += released
                if freed >= need - _EPS:
                    when = time
                    break
            if when == INF:
                queue = self.parked[w].setdefault(self.p.worker[item], [])
                heappush(queue, (key, item))
                return INF
            retry = max(retry, when)
        return None if retry == t else retry

    def on_scheduled(self, item: int, begin: float, finish: float):
        """Book ``item``'s claims and releases; yield parked items to retry.

        The first parked forward of each compute worker is retried when a
        release is booked on its storage worker, and again each time one of
        them is admitted there (a release may make room for several)."""
        p = self.p
        for w, amount in p.claims[item] or ():
            self.live[w] += amount
            self.holding[w][item] = self.holding[w].get(item, 0.0) + amount
            yield from self._wake(w, begin)
        for w, amount, owner in p.releases_of[item] or ():
            heappush(self.releases[w], (finish, amount))
            left = self.holding[w].get(owner, 0.0) - amount
            if left > _EPS:
                self.holding[w][owner] = left
            else:
                self.holding[w].pop(owner, None)
            yield from self._wake(w, finish)

    def _wake(self, w: int, when: float):
        parked = self.parked[w]
        for compute_worker in list(parked):
            queue = parked[compute_worker]
            _, waiting = heappop(queue)
            if not queue:
                del parked[compute_worker]
            yield waiting, when


class _Communication:
    """Transfers over links that serialise, weight fetches and gradient returns."""

    def __init__(self, p: Problem):
        self.p = p
        self.links: dict[tuple[int, int], _Calendar] = {}
        self.moves = p.succ_moves
        self.rows: list[tuple] = []
        self.history = [[] for _ in range(p.num_workers)]  # start times, for prefetch
        self.resident = [set() for _ in range(p.num_workers)]
        self.grads_left = dict(p.gradient_returns)
        self.link_table = network.LinkTable(p.costs)
        topology = getattr(p.costs, "topology", None)
        self.cluster = _Cluster(p, topology) if topology is not None else None

    def _send(self, kind: str, src: int, dst: int, ready: float, nbytes: float, item: int) -> float:
        if self.cluster is not None:
            begin, arrive = self.cluster.send(src, dst, ready, nbytes)
            self.rows.append((kind, src, dst, begin, arrive, nbytes, item))
            return arrive
        latency, occupy = self.link_table.times(src, dst, nbytes)
        link = self.links.get((src, dst))
        if link is None:
            link = self.links[(src, dst)] = _Calendar()
        begin = link.book(ready, occupy)
        arrive = begin + latency + occupy
        self.rows.append((kind, src, dst, begin, arrive, nbytes, item))
        return arrive

    def move(self, edge: int, item: int, nxt: int, finish: float) -> float:
        src, dst = self.p.worker[item], self.p.worker[nxt]
        kinds, nbytes = self.moves
        if src == dst or kinds[edge] is None:
            return finish
        return self._send(kinds[edge], src, dst, finish, nbytes[edge], nxt)

    def _links(self, item: int):
        """(member, holder, share, bytes) of the weights ``item`` computes with."""
        p = self.p
        links = p.weight_shares.get(item)
        if links is None:
            return ((p.worker[item], p.weight_worker[item], 0, p.weight_bytes[p.stage_list[item]]),)
        return links

    def fetch_weights(self, item: int, t: float) -> float:
        """When every worker running ``item`` has the weights it computes
        with there (each member of a gang its share, a worker of a sharded
        stage every shard): at once for those it holds or kept from an
        earlier fetch, else when the fetch arrives, issued ``prefetch_depth``
        of the worker's items earlier."""
        p = self.p
        stage = p.stage_list[item]
        ready = t
        last = None
        for w, holder, share, nbytes in self._links(item):
            history = self.history[w]
            if w != last:  # one entry per item on each of its workers
                history.append(t)
                last = w
            if w == holder or (p.cache_weights and (stage, share) in self.resident[w]):
                continue
            depth = p.prefetch_depth
            issue = history[-1 - depth] if depth and len(history) > depth else (0.0 if depth else t)
            arrive = self._send("weights", holder, w, issue, nbytes, item)
            if p.cache_weights:
                self.resident[w].add((stage, share))
            if arrive > history[-1]:
                history[-1] = arrive
            ready = max(ready, arrive)
        return ready

    def gang_start(self, item: int, t: float) -> float:
        """When every member of a gang item has its share of the weights and
        what the first member hands out."""
        ready = self.fetch_weights(item, t)
        return max([ready] + [self._send(kind, src, dst, ready, nbytes, item) for kind, src, dst, nbytes in self.p.gang_moves[item][0]])

    def gang_collective(self, item: int, finish: float) -> float:
        """When ``item``'s gang has finished computing and its collective (the
        last ``p.collective[item]`` of its duration, ending at ``finish``):
        on a topology the collective waits for its links to be free."""
        if self.cluster is None or not self.p.collective[item]:
            return finish
        collective = float(self.p.collective[item])
        members = self.p.gang_members[self.p.gang[item]]
        return self.cluster.collective(members, finish - collective, collective) + collective

    def finish_step(self, end) -> None:
        """On a topology: book the end-of-step all-reduces, each once its
        stage is ready, in that order; then those of tied weights, each once
        its copies' stages are ready and reduced."""
        if self.cluster is None:
            return
        p = self.p
        returned = [(p.stage_list[row[6]], row[4]) for row in self.rows if row[0] == "weight_gradient"]
        stage, arrival = zip(*returned) if returned else ((), ())
        groups = transfers.allreduce_groups(p, np.asarray(end), stage, arrival)
        reduced = [(group.stage, self._book_allreduce(group)) for group in
                   sorted(groups, key=lambda g: (g.ready, g.stage, g.share))]
        reduced_stage, reduced_end = zip(*reduced) if reduced else ((), ())
        ties = transfers.tie_table(p, np.asarray(end), stage, arrival, reduced_stage, reduced_end).groups()
        for group in sorted(ties, key=lambda g: g.ready):
            self._book_allreduce(group)

    def _book_allreduce(self, group: transfers.AllReduce) -> float:
        """Book ``group``'s all-reduce on its workers' links from when it is ready; when it ends."""
        everyone = self.p.costs.everywhere(group.replicas, self.p.num_workers)
        duration = float(network.allreduce_time(self.p.costs, everyone, group.nbytes))
        begin = self.cluster.collective(everyone, group.ready, duration)
        self.rows += transfers.ring_rows(group, everyone, begin, begin + duration)
        return begin + duration

    def collect(self, item: int, finish: float) -> float:
        """When the first member of ``item``'s gang has collected the members' results."""
        sends = self.p.gang_moves[item][1]
        return max([finish] + [self._send(kind, src, dst, finish, nbytes, item) for kind, src, dst, nbytes in sends])

    def on_finished(self, item: int, finish: float) -> None:
        p = self.p
        if not p.returns_gradient[item]:
            return
        stage = p.stage_list[item]
        for w, owner, share, nbytes in self._links(item):
            if w == owner:
                continue
            if p.cache_weights:
                self.grads_left[(w, stage, share)] -= 1
                if self.grads_left[(w, stage, share)]:
                    continue
            self._send("weight_gradient", w, owner, finish, nbytes, item)


class _Cluster:
    """The links of a topology, each a :class:`_Calendar`.  With
    ``ClusterCosts.replicas`` > 1 the workers are replica 0 and the other
    replicas do the same at the same times on links of their own, so only
    replica 0's links are kept."""

    def __init__(self, p: Problem, topology):
        self.topology = topology
        self.num_workers = p.num_workers
        self.calendars: dict[tuple, _Calendar] = {}
        self.routes: dict[tuple[int, int], tuple] = {}
        self.groups: dict[tuple[int, ...], tuple] = {}

    def send(self, src: int, dst: int, ready: float, nbytes: float) -> tuple[float, float]:
        """(begin, arrival) of ``nbytes`` from src to dst, ready at ``ready``."""
        route = self.routes.get((src, dst))
        if route is None:
            route = self.routes[(src, dst)] = self.topology.route(src, dst)
        occupy = nbytes / route.bandwidth
        begin = self._book(route.links, ready, occupy)
        return begin, begin + route.latency + occupy

    def collective(self, members, ready: float, duration: float) -> float:
        """When a collective of ``duration`` among ``members`` begins, its
        links (those of replica 0) free for all of it."""
        key = tuple(members)
        links = self.groups.get(key)
        if links is None:
            links = self.groups[key] = self.topology.collective_links(members, self.num_workers)
        return self._book(links, ready, duration)

    def _book(self, links, ready: float, occupy: float) -> float:
        """Book ``occupy`` on every one of ``links`` in the first gap at or
        after ``ready`` that they all share; return its start."""
        if occupy <= 0 or not links:
            return ready
        calendars = [self.calendars.get(link) or self.calendars.setdefault(link, _Calendar()) for link in links]
        begin = ready
        while True:
            moved = max(c.gap(begin, occupy) for c in calendars)
            if moved == begin:
                break
            begin = moved
        for c in calendars:
            c.take(begin, occupy)
        return begin


class _Calendar:
    """When a link is busy: sorted, disjoint intervals.  A transfer takes the
    first gap long enough at or after the time it is ready, so one booked
    late for an early time (a prefetch) does not queue behind later ones."""

    def __init__(self):
        self.starts: list[float] = []
        self.ends: list[float] = []

    def book(self, ready: float, occupy: float) -> float:
        """Take the first gap of ``occupy`` at or after ``ready``; return its start."""
        if occupy <= 0:
            return ready
        begin, i = self._first_gap(ready, occupy)
        self.starts.insert(i, begin)
        self.ends.insert(i, begin + occupy)
        return begin

    def gap(self, ready: float, occupy: float) -> float:
        """The start of the first gap of ``occupy`` at or after ``ready`` (as :meth:`book`)."""
        return self._first_gap(ready, occupy)[0]

    def _first_gap(self, ready: float, occupy: float) -> tuple[float, int]:
        """The first gap's start, and where an interval starting there goes in the lists."""
        starts, ends = self.starts, self.ends
        i = bisect_right(ends, ready)
        begin = ready
        while i < len(starts) and starts[i] < begin + occupy:
            begin = max(begin, ends[i])
            i += 1
        return begin, i

    def take(self, begin: float, occupy: float) -> None:
        """Mark [begin, begin + occupy) busy (a gap :meth:`gap` found)."""
        i = bisect_right(self.ends, begin)
        self.starts.insert(i, begin)
        self.ends.insert(i, begin + occupy)


def _deadlock(p: Problem, remaining, start, end, memory: _Memory | None) -> DeadlockError:
    blocked: dict[int, str] = {}
    if memory is not None:
        for storage, parked in enumerate(memory.parked):
            for compute_worker, queue in parked.items():
                waiting = ", ".join(p.label(i) for _, i in sorted(queue)[:4])
                held = sorted(memory.holding[storage], key=lambda i: start[i])
                holds = ", ".join(p.label(i) for i in held[:8]) + (" ..." if len(held) > 8 else "")
                blocked.setdefault(compute_worker, "")
                blocked[compute_worker] += (
                    f"{waiting} wait(s) for activation memory on worker {storage} "
                    f"(limit {p.limit[storage]:g}, holding the stashes of {holds or 'nothing'}); "
                )
    waits_on_memory = bool(blocked)
    if not blocked:
        blocked = _stuck_heads(p, remaining)
    lines = "\n".join(f"  worker {w}: {text.rstrip('; ')}" for w, text in sorted(blocked.items()))
    if not waits_on_memory:
        hint = "check that each worker's fixed order respects the dependencies between work items"
    elif np.any(p.next_fixed >= 0):
        hint = ("raise the memory limit of the workers named (the strategy fixes each worker's order: "
                "no priority changes it)")
    else:
        hint = ("raise the memory limit of the workers named, or choose a priority that runs backwards earlier "
                "(simulate's priority=; the command's --priority where the strategy leaves its order to the "
                "simulator, not one with a priority of its own such as looped_bfs)")
    done = sum(1 for r in remaining if r <= 0)
    return DeadlockError(
        f"deadlock: no work item can make progress ({p.num_items - done} of {p.num_items} items never became "
        f"ready or could not start).\n{lines}\nTo fix: {hint}.",
        blocked,
    )


def _stuck_heads(p: Problem, remaining) -> dict[int, str]:
    """Per worker with work left, where nothing waits for memory (so every item whose dependencies
    ended has run): the first item left in its fixed order (else its first item left), and the
    items it still waits for."""
    unfinished = np.asarray(remaining) > 0
    orders = _orders(p)
    position = {item: k for order in orders for k, item in enumerate(order)}
    heads = [next(i for i in order if unfinished[i]) for order in orders if unfinished[order].any()]
    heads += [int(i) for i in np.flatnonzero(unfinished) if int(i) not in position]
    data = p.data_followed
    source = np.repeat(np.arange(p.num_items), np.diff(data.ptr))

    def said(item: int, worker: bool = False) -> str:
        at = [f"worker {p.worker[item]}"] if worker else []
        at += [f"position {position[item]} of its order"] if item in position else []
        return p.label(item) + (f" ({', '.join(at)})" if at else "")

    blocked: dict[int, str] = {}
    for item in heads:
        waits = ", ".join(said(int(u), worker=True) for u in source[data.idx == item] if unfinished[u])
        blocked.setdefault(int(p.worker[item]), f"{said(item)} waits for {waits or 'nothing left'}")
    return blocked


def _orders(p: Problem) -> list[list[int]]:
    """Each worker's fixed order as item ids (empty without fixed orders)."""
    followed = np.zeros(p.num_items, dtype=bool)
    followed[p.next_fixed[p.next_fixed >= 0]] = True
    orders = []
    for first in np.flatnonzero(~followed & (p.next_fixed >= 0)):
        order, item = [], int(first)
        while item >= 0:
            order.append(item)
            item = int(p.next_fixed[item])
        orders.append(order)
    return orders
