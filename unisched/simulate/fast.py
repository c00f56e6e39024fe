"""The greedy of :mod:`unisched.simulate.engine`, compiled by numba.

It covers every step without communication costs and without gangs: any
mapping, priority, per-stage costs and worker speeds (they are only the
durations), fixed per-worker orders (they are only edges), split backwards,
and memory limits with parking.  That is what makes a million work items
take about a second, 1F1B and zero bubble included.

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
  :class:`~unisched.simulate.stashes.StashAccounts`).

Without numba installed the engine is used instead.  numba (and what it
imports: about a second and 80 MiB) is loaded on the first step large
enough to use it (:data:`COMPILED_FROM`), so a training process that
simulates its own few hundred items never loads it.
"""

from __future__ import annotations

import math
from functools import cache
import numpy as np

from unisched.dataflow import EDGE_PRIMARY
from unisched.simulate.stashes import StashAccounts, region_starts

COMPILED_FROM = 4096
"""Steps with fewer items run on the Python engine, in a few milliseconds."""

_EPS = 1e-9
"""The engine's tolerance on memory levels and release times."""


def covers(problem) -> bool:
    """Whether the compiled greedy runs this problem (else the engine does)."""
    return not problem.comm and not problem.gang_members


def stash_accounts(problem) -> StashAccounts:
    """``problem``'s memory model as flat arrays (empty without a limit)."""
    n, W = problem.num_items, problem.num_workers
    if problem.claims is None:
        none_i, none_f = np.zeros(0, np.int64), np.zeros(0)
        return StashAccounts(none_f, np.zeros(n + 1, np.int64), none_i, none_f, none_i, np.zeros(W + 1, np.int64),
                             none_i, np.zeros(n + 1, np.int64), none_i, none_f, none_i, np.zeros(W, np.int64))
    claim_ptr, (claim_worker, claim_amount) = _csr(problem.claims, n, 2)
    release_ptr, (release_worker, release_amount, release_owner) = _csr(problem.releases_of, n, 3)
    claim_worker, release_worker = claim_worker.astype(np.int64), release_worker.astype(np.int64)
    claimant = np.repeat(problem.worker_array, np.diff(claim_ptr))
    pairs, claim_pair, per_pair = np.unique(claim_worker * W + claimant, return_inverse=True, return_counts=True)
    pair_ptr = np.zeros(W + 1, np.int64)
    np.cumsum(np.bincount(pairs // W, minlength=W), out=pair_ptr[1:])
    return StashAccounts(
        limit=np.asarray(problem.limit, dtype=float),
        claim_ptr=claim_ptr,
        claim_worker=claim_worker,
        claim_amount=claim_amount,
        claim_pair=claim_pair.astype(np.int64).reshape(-1),
        pair_ptr=pair_ptr,
        pair_base=region_starts(per_pair),
        release_ptr=release_ptr,
        release_worker=release_worker,
        release_amount=release_amount,
        release_owner=release_owner.astype(np.int64),
        release_base=region_starts(np.bincount(release_worker, minlength=W)),
    )


def _csr(rows: list, n: int, width: int) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """Per-item tuples of ``width``-tuples (or None) as a pointer array and columns."""
    counts = np.fromiter((len(r) if r else 0 for r in rows), dtype=np.int64, count=n)
    ptr = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=ptr[1:])
    flat = np.array([entry for r in rows if r for entry in r], dtype=float).reshape(-1, width)
    return ptr, tuple(flat.T.copy())


def run(problem):
    """Start and end time of every item of ``problem`` (compiled, or None
    without numba); items never scheduled (a deadlock) keep start -1."""
    kernel = compiled_schedule()
    if kernel is None:
        return None
    a = stash_accounts(problem)
    return kernel(problem.worker_array, problem.duration, problem.rank, problem.succ_ptr, problem.succ_idx,
                  problem.succ_kind == EDGE_PRIMARY, problem.num_deps, problem.sources[0],
                  problem.rank[problem.sources[1]], problem.num_workers, a.limit, a.claim_ptr, a.claim_worker,
                  a.claim_amount, a.claim_pair, a.pair_ptr, a.pair_base, a.release_ptr, a.release_worker,
                  a.release_amount, a.release_base)


def greedy(worker, duration, rank, succ_ptr, succ_idx, succ_primary, num_deps, source_items, source_keys,
           num_workers):
    """:func:`schedule` without a memory limit."""
    n = worker.shape[0]
    none_i, none_f = np.zeros(0, np.int64), np.zeros(0)
    return schedule(worker, duration, rank, succ_ptr, succ_idx, succ_primary, num_deps, source_items, source_keys,
                    num_workers, none_f, np.zeros(n + 1, np.int64), none_i, none_f, none_i,
                    np.zeros(num_workers + 1, np.int64), none_i, np.zeros(n + 1, np.int64), none_i, none_f,
                    np.zeros(num_workers, np.int64))


# ---------------------------------------------------------------------- the greedy
def schedule(worker, duration, rank, succ_ptr, succ_idx, succ_primary, num_deps, source_items, source_keys,
             num_workers, limit, claim_ptr, claim_worker, claim_amount, claim_pair, pair_ptr, pair_base,
             release_ptr, release_worker, release_amount, release_base):
    """Start and end time of every item; items never scheduled keep start -1.

    ``engine.run`` step for step; the memory arguments are those of
    :class:`~unisched.simulate.stashes.StashAccounts` (``limit`` empty: no limit)."""
    n = worker.shape[0]
    remaining = num_deps.copy()
    ready = np.zeros(n)
    trigger_time = np.full(n, -math.inf)
    trigger_rank = np.zeros(n, dtype=np.int64)
    start = np.full(n, -1.0)
    end = np.zeros(n)
    free = np.zeros(num_workers)

    # the main heap, and the slack one step may push onto it at most
    most_pairs = 0
    for w in range(num_workers):
        most_pairs = max(most_pairs, pair_ptr[w + 1] - pair_ptr[w])
    most_out, most_memory = 0, 0
    for i in range(n):
        most_out = max(most_out, succ_ptr[i + 1] - succ_ptr[i])
        most_memory = max(most_memory, claim_ptr[i + 1] - claim_ptr[i] + release_ptr[i + 1] - release_ptr[i])
    slack = 4 + most_out + most_memory * most_pairs
    capacity = 2 * n + num_workers + slack
    heap_t = np.empty(capacity)
    heap_k = np.empty(capacity, dtype=np.int64)
    heap_e = np.empty(capacity, dtype=np.int64)
    size = 0

    # each worker's late items
    late_base = _regions(worker, num_workers)
    late_size = np.zeros(num_workers, dtype=np.int64)
    late_k = np.empty(n, dtype=np.int64)
    late_e = np.empty(n, dtype=np.int64)

    # memory: levels, booked releases per worker, parked forwards per (storage, compute worker)
    memory = limit.shape[0] > 0
    live = np.zeros(num_workers)
    release_size = np.zeros(num_workers, dtype=np.int64)
    release_t = np.empty(release_worker.shape[0])
    release_a = np.empty(release_worker.shape[0])
    scratch_t = np.empty(release_worker.shape[0])
    scratch_a = np.empty(release_worker.shape[0])
    park_size = np.zeros(pair_base.shape[0], dtype=np.int64)
    park_k = np.empty(claim_pair.shape[0], dtype=np.int64)
    park_e = np.empty(claim_pair.shape[0], dtype=np.int64)
    woken = np.empty(max(most_pairs, 1), dtype=np.int64)

    for i in range(source_items.shape[0]):
        trigger_rank[source_items[i]] = source_keys[i]
        size = _push(heap_t, heap_k, heap_e, size, 0.0, source_keys[i], source_items[i])

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
            late_size[w] = _late_pop(late_k, late_e, base, late_size[w])
            if late_size[w] > 0:
                size = _push(heap_t, heap_k, heap_e, size, t, late_k[base], -1 - w)
        else:
            w = worker[item]
            if t < free[w]:  # the worker got busier: wait among its late items
                base = late_base[w]
                late_size[w] = _late_push(late_k, late_e, base, late_size[w], key, item)
                if late_e[base] == item:
                    size = _push(heap_t, heap_k, heap_e, size, free[w], key, -1 - w)
                continue

        if memory:
            retry = _admit(item, t, key, worker, limit, claim_ptr, claim_worker, claim_amount, claim_pair, pair_base,
                           live, release_base, release_size, release_t, release_a, scratch_t, scratch_a,
                           park_size, park_k, park_e)
            if retry != t:
                if retry < math.inf:
                    size = _push(heap_t, heap_k, heap_e, size, retry, key, item)
                continue

        finish = t + duration[item]
        start[item] = t
        end[item] = finish
        free[w] = finish
        if late_size[w] > 0:
            size = _push(heap_t, heap_k, heap_e, size, finish, late_k[late_base[w]], -1 - w)
        if memory:  # book the item's claims and releases; retry forwards parked where they land
            for c in range(claim_ptr[item], claim_ptr[item + 1]):
                holder = claim_worker[c]
                live[holder] += claim_amount[c]
                count = _wake(holder, pair_ptr, pair_base, park_size, park_k, park_e, woken)
                for j in range(count):
                    other = woken[j]
                    size = _push(heap_t, heap_k, heap_e, size, max(t, ready[other]), trigger_rank[other], other)
            for r in range(release_ptr[item], release_ptr[item + 1]):
                holder = release_worker[r]
                release_size[holder] = _pair_push(release_t, release_a, release_base[holder], release_size[holder],
                                                  finish, release_amount[r])
                count = _wake(holder, pair_ptr, pair_base, park_size, park_k, park_e, woken)
                for j in range(count):
                    other = woken[j]
                    size = _push(heap_t, heap_k, heap_e, size, max(finish, ready[other]), trigger_rank[other],
                                 other)

        item_rank = rank[item]
        for k in range(succ_ptr[item], succ_ptr[item + 1]):
            nxt = succ_idx[k]
            if finish > ready[nxt]:
                ready[nxt] = finish
            if succ_primary[k] and finish > trigger_time[nxt]:
                trigger_time[nxt] = finish
                trigger_rank[nxt] = item_rank
            remaining[nxt] -= 1
            if remaining[nxt] == 0:
                nxt_worker = worker[nxt]
                nxt_key = trigger_rank[nxt]
                if ready[nxt] < free[nxt_worker]:
                    base = late_base[nxt_worker]
                    late_size[nxt_worker] = _late_push(late_k, late_e, base, late_size[nxt_worker], nxt_key, nxt)
                    if late_e[base] == nxt:
                        size = _push(heap_t, heap_k, heap_e, size, free[nxt_worker], nxt_key, -1 - nxt_worker)
                else:
                    size = _push(heap_t, heap_k, heap_e, size, ready[nxt], nxt_key, nxt)
    return start, end


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
def _level(w, t, live, release_base, release_size, release_t, release_a):
    """Worker w's live stashes at ``t``, after the releases booked up to then."""
    base = release_base[w]
    while release_size[w] > 0 and release_t[base] <= t + _EPS:
        live[w] -= release_a[base]
        release_size[w] = _pair_pop(release_t, release_a, base, release_size[w])
    return live[w]


def _admit(item, t, key, worker, limit, claim_ptr, claim_worker, claim_amount, claim_pair, pair_base,
           live, release_base, release_size, release_t, release_a, scratch_t, scratch_a, park_size, park_k, park_e):
    """``t`` if ``item`` may start at ``t``; else when to look again (inf: parked)."""
    retry = t
    for c in range(claim_ptr[item], claim_ptr[item + 1]):
        w = claim_worker[c]
        need = _level(w, t, live, release_base, release_size, release_t, release_a) + claim_amount[c] - limit[w]
        if need <= _EPS:
            continue
        when = _when_freed(need, release_base[w], release_size[w], release_t, release_a, scratch_t, scratch_a)
        if when == math.inf:
            pair = claim_pair[c]
            park_size[pair] = _late_push(park_k, park_e, pair_base[pair], park_size[pair], key, item)
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
        count = _pair_pop(scratch_t, scratch_a, 0, count)
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
            park_size[pair] = _late_pop(park_k, park_e, base, park_size[pair])
    return count


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


def _late_push(lk, le, base, size, k, e):
    """Push onto a heap of (int, int) pairs in the region starting at ``base``."""
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


def _late_pop(lk, le, base, size):
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


def _pair_push(at, aa, base, size, t, a):
    """Push onto a heap of (float, float) pairs in the region starting at ``base``."""
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        pt, pa = at[base + parent], aa[base + parent]
        if t > pt or (t == pt and a >= pa):
            break
        at[base + i], aa[base + i] = pt, pa
        i = parent
    at[base + i], aa[base + i] = t, a
    return size + 1


def _pair_pop(at, aa, base, size):
    size -= 1
    t, a = at[base + size], aa[base + size]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        c = base + child
        if child + 1 < size and (at[c + 1] < at[c] or (at[c + 1] == at[c] and aa[c + 1] < aa[c])):
            child += 1
            c += 1
        if at[c] > t or (at[c] == t and aa[c] >= a):
            break
        at[base + i], aa[base + i] = at[c], aa[c]
        i = child
    if size > 0:
        at[base + i], aa[base + i] = t, a
    return size


_HELPERS = ("_regions", "_level", "_admit", "_when_freed", "_wake", "_before", "_push", "_pop", "_grown",
            "_late_push", "_late_pop", "_pair_push", "_pair_pop", "schedule")


@cache
def compiled_schedule():
    """:func:`schedule` compiled by numba (on first use), or None without numba."""
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency; this keeps the simulator usable without it
        return None
    jit = numba.njit(cache=True, nogil=True)
    for name in _HELPERS:  # callees first: a compiled function calls the compiled ones
        globals()[name] = jit(globals()[name])
    return globals()["schedule"]


@cache
def compiled_greedy():
    """:func:`greedy` compiled by numba (on first use), or None without numba."""
    if compiled_schedule() is None:  # pragma: no cover - see compiled_schedule
        return None
    import numba

    return numba.njit(cache=True, nogil=True)(greedy)
