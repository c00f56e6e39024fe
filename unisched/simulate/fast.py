"""The same greedy as :mod:`unisched.simulate.engine`, compiled, for the
common case: free communication and no memory limit (fixed orders are fine:
they are only edges).  This is what makes a million work items take about a
second.

It is written in the subset of Python that numba compiles, and it is the
same algorithm, step for step, as ``engine.run`` without its memory and
communication hooks; the test suite checks that both give identical
timelines, compiled and interpreted.  Without numba installed the engine is
used instead.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

try:
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; this keeps the simulator usable without it
    numba = None


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
    late = [[(np.int64(0), np.int64(0))] for _ in range(num_workers)]
    for queue in late:
        queue.pop()
    heap = [(0.0, np.int64(0), np.int64(0))]
    heap.pop()
    for i in range(source_items.shape[0]):
        trigger_rank[source_items[i]] = source_keys[i]
        heapq.heappush(heap, (0.0, np.int64(source_keys[i]), np.int64(source_items[i])))

    while len(heap) > 0:
        t, key, item = heapq.heappop(heap)
        if item < 0:
            w = -1 - item
            queue = late[w]
            if len(queue) == 0 or t != free[w] or queue[0][0] != key:
                continue
            item = heapq.heappop(queue)[1]
            if len(queue) > 0:
                heapq.heappush(heap, (t, queue[0][0], np.int64(-1 - w)))
        else:
            w = worker[item]
            if t < free[w]:
                queue = late[w]
                heapq.heappush(queue, (key, item))
                if queue[0][1] == item:
                    heapq.heappush(heap, (free[w], key, np.int64(-1 - w)))
                continue

        finish = t + duration[item]
        start[item] = t
        end[item] = finish
        free[w] = finish
        if len(late[w]) > 0:
            heapq.heappush(heap, (finish, late[w][0][0], np.int64(-1 - w)))

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
                    queue = late[nxt_worker]
                    heapq.heappush(queue, (nxt_key, nxt))
                    if queue[0][1] == nxt:
                        heapq.heappush(heap, (free[nxt_worker], nxt_key, np.int64(-1 - nxt_worker)))
                else:
                    heapq.heappush(heap, (ready[nxt], nxt_key, nxt))
    return start, end


compiled_greedy = numba.njit(cache=True, nogil=True)(greedy) if numba is not None else None
