"""The same greedy as :mod:`unisched.simulate.engine`, compiled, for the
common case: free communication, no memory limit and no gangs (fixed orders
are fine: they are only edges).  This is what makes a million work items
take about a second.

It is written in the subset of Python that numba compiles, and it is the
same algorithm, step for step, as ``engine.run`` without its memory,
communication and gang hooks; the test suite checks that both give identical
timelines, compiled and interpreted.  The heaps are flat arrays here (the
main heap of ``(time, key, entry)`` triples, and one region of a shared
array per worker for its late items) because that is what compiles to fast
code.  Without numba installed the engine is used instead.

numba (and what it imports: about a second and 80 MiB) is loaded on the
first step large enough to use it (:data:`COMPILED_FROM`), so a training
process that simulates its own few hundred items never loads it.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

COMPILED_FROM = 4096
"""Steps with fewer items run on the Python engine, in a few milliseconds."""


def greedy(worker, duration, rank, succ_ptr, succ_idx, succ_primary, num_deps, source_items, source_keys,
           num_workers):
    """Start and end time of every item; items never scheduled keep start -1."""
    n = worker.shape[0]
    remaining = num_deps.copy()
    ready = np.zeros(n)
    trigger_time = np.full(n, -math.inf)
    trigger_rank = np.zeros(n, dtype=np.int64)
    start = np.full(n, -1.0)
    end = np.zeros(n)
    free = np.zeros(num_workers)

    capacity = 4 * n + num_workers + 16
    heap_t = np.empty(capacity)
    heap_k = np.empty(capacity, dtype=np.int64)
    heap_e = np.empty(capacity, dtype=np.int64)
    size = 0

    per_worker = np.bincount(worker, minlength=num_workers)
    late_base = np.zeros(num_workers, dtype=np.int64)
    late_base[1:] = np.cumsum(per_worker)[:-1]
    late_size = np.zeros(num_workers, dtype=np.int64)
    late_k = np.empty(n, dtype=np.int64)
    late_e = np.empty(n, dtype=np.int64)

    for i in range(source_items.shape[0]):
        trigger_rank[source_items[i]] = source_keys[i]
        size = _push(heap_t, heap_k, heap_e, size, 0.0, source_keys[i], source_items[i])

    while size > 0:
        t, key, item = heap_t[0], heap_k[0], heap_e[0]
        size = _pop(heap_t, heap_k, heap_e, size)
        if item < 0:
            w = -1 - item
            base = late_base[w]
            if late_size[w] == 0 or t != free[w] or late_k[base] != key:
                continue
            item = late_e[base]
            late_size[w] = _late_pop(late_k, late_e, base, late_size[w])
            if late_size[w] > 0:
                size = _push(heap_t, heap_k, heap_e, size, t, late_k[base], -1 - w)
        else:
            w = worker[item]
            if t < free[w]:
                base = late_base[w]
                late_size[w] = _late_push(late_k, late_e, base, late_size[w], key, item)
                if late_e[base] == item:
                    size = _push(heap_t, heap_k, heap_e, size, free[w], key, -1 - w)
                continue

        finish = t + duration[item]
        start[item] = t
        end[item] = finish
        free[w] = finish
        if late_size[w] > 0:
            size = _push(heap_t, heap_k, heap_e, size, finish, late_k[late_base[w]], -1 - w)

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


def _late_push(lk, le, base, size, k, e):
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


@cache
def compiled_greedy():
    """:func:`greedy` compiled by numba (on first use), or None without numba."""
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency; this keeps the simulator usable without it
        return None
    global _before, _push, _pop, _late_push, _late_pop
    jit = numba.njit(cache=True, nogil=True)
    _before, _push, _pop, _late_push, _late_pop = (jit(f) for f in (_before, _push, _pop, _late_push, _late_pop))
    return jit(greedy)
