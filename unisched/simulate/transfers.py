"""The transfers a schedule implies.

With costs that make communication take time, the engine books every
transfer as it schedules (links serialise).  With free communication (the
paper's model) nothing a transfer does can change the schedule, so they are
derived here afterwards, in bulk, by the same rules: a data dependency whose
ends run on different workers moves an activation, gradient or stash; an item
whose weight worker is another worker fetches weights (once per worker and
stage when weights are cached) and returns its gradient; a gang's first
member hands out and collects (:func:`unisched.dataflow.gang_moves`), and
each member fetches the share of the weights it computes with.  The
end-of-step all-reduce among the holders of each share of a stage is added
here in both cases.
"""

from __future__ import annotations

import numpy as np

from unisched import dataflow, network
from unisched.simulate.problem import Problem, moves
from unisched.timeline import TRANSFER_KINDS, Transfers

_CODE = {kind: code for code, kind in enumerate(TRANSFER_KINDS)}


def transfers(p: Problem, start: np.ndarray, end: np.ndarray, booked: list | None) -> Transfers:
    columns = _from_booked(p, booked) if booked is not None else _derived(p, start, end)
    columns = _concat(columns, _allreduce(p, end, columns))
    return Transfers(**columns)


def _columns(kind, src, dst, begin, finish, nbytes, item, p: Problem) -> dict:
    item = np.asarray(item, dtype=np.int64)
    return {
        "kind": np.asarray(kind, dtype=np.int8),
        "src": np.asarray(src, dtype=np.int64),
        "dst": np.asarray(dst, dtype=np.int64),
        "start": np.asarray(begin, dtype=float),
        "end": np.asarray(finish, dtype=float),
        "nbytes": np.asarray(nbytes, dtype=float),
        "batch": p.batch[item] if len(item) else np.zeros(0, np.int64),
        "stage": p.stage[item] if len(item) else np.zeros(0, np.int64),
        "direction": p.direction[item] if len(item) else np.zeros(0, np.int64),
    }


def _concat(*tables: dict) -> dict:
    return {name: np.concatenate([t[name] for t in tables]) for name in tables[0]}


def _from_booked(p: Problem, rows: list) -> dict:
    if not rows:
        return _columns([], [], [], [], [], [], [], p)
    kind, src, dst, begin, finish, nbytes, item = zip(*rows)
    return _columns([_CODE[k] for k in kind], src, dst, begin, finish, nbytes, item, p)


def _derived(p: Problem, start: np.ndarray, end: np.ndarray) -> dict:
    compute = p.worker_array
    moved = (compute[p.edges[0]] != compute[p.edges[1]])
    kinds, nbytes = moves(p, p.edges[:, moved])
    src, dst = p.edges[0, moved], p.edges[1, moved]
    some = kinds >= 0
    kinds, nbytes, src, dst = kinds[some], nbytes[some], src[some], dst[some]
    data = _columns(kinds, compute[src], compute[dst], end[src], end[src], nbytes, dst, p)

    item, member, holder, _, size = p.weight_links
    fetching = np.flatnonzero(dataflow.fetches_weights(member, holder))
    returning = np.flatnonzero(p.returning_links)
    if p.cache_weights:
        fetching = _first_per_group(fetching, member, p.stage[item], start[item])
        returning = _first_per_group(returning, member, p.stage[item], -end[item])
    fetches = _columns(
        np.full(len(fetching), _CODE["weights"]), holder[fetching], member[fetching],
        start[item[fetching]], start[item[fetching]], size[fetching], item[fetching], p,
    )
    returns = _columns(
        np.full(len(returning), _CODE["weight_gradient"]), member[returning], holder[returning],
        end[item[returning]], end[item[returning]], size[returning], item[returning], p,
    )
    handed = [(_CODE[kind], src, dst, start[i] if not after else end[i], nbytes, i)
              for i, phases in p.gang_moves.items() for after, phase in enumerate(phases)
              for kind, src, dst, nbytes in phase]
    if handed:
        code, src, dst, at, nbytes, items = zip(*handed)
        gangs = _columns(code, src, dst, at, at, nbytes, items, p)
    else:
        gangs = _columns([], [], [], [], [], [], [], p)
    return _concat(data, fetches, returns, gangs)


def _first_per_group(rows: np.ndarray, compute, stage, sort_key) -> np.ndarray:
    """Of ``rows``, the first by ``sort_key`` in each (worker, stage) group."""
    if not len(rows):
        return rows
    order = np.lexsort((sort_key[rows], stage[rows], compute[rows]))
    rows = rows[order]
    group = compute[rows] * (int(stage.max()) + 1) + stage[rows]
    keep = np.append(True, group[1:] != group[:-1])
    return rows[keep]


def _allreduce(p: Problem, end: np.ndarray, moved: dict) -> dict:
    """A ring all-reduce per share of a stage held by several workers (the
    holders of :meth:`Problem.weight_links`), once every replica has its
    gradient (its own backwards and returned ones)."""
    item, _, holder, share, size = p.weight_links
    last = p.direction[item] == dataflow.gradient_pass(p.split_backward)
    item, holder, share, size = item[last], holder[last], share[last], size[last]
    stage = p.stage[item]
    shares, holders = int(share.max(initial=0)) + 1, int(holder.max(initial=0)) + 1
    held, first = np.unique((stage * shares + share) * holders + holder, return_index=True)
    groups: dict[tuple[int, int], list[int]] = {}
    for c in held.tolist():
        groups.setdefault(divmod(c // holders, shares), []).append(c % holders)
    S = p.shape.num_stages
    ready = np.full(S, -np.inf)
    np.maximum.at(ready, stage, end[item])
    returned = moved["kind"] == _CODE["weight_gradient"]
    np.maximum.at(ready, moved["stage"][returned], moved["end"][returned])
    some_item = np.full(S, -1)
    some_item[stage[::-1]] = item[::-1]  # the first gradient pass of each stage
    nbytes_of = {divmod(c // holders, shares): float(size[row]) for c, row in zip(held.tolist(), first.tolist())}
    rows = []
    for (s, k), replicas in sorted(groups.items()):
        n = len(replicas)
        if n < 2:
            continue
        nbytes = 2 * (n - 1) / n * nbytes_of[(s, k)]
        finish = ready[s] + float(network.ring_allreduce_time(p.costs, replicas, nbytes_of[(s, k)]))
        for i, r in enumerate(replicas):
            rows.append((_CODE["allreduce"], int(r), int(replicas[(i + 1) % n]), ready[s], finish, nbytes,
                         int(some_item[s])))
    if not rows:
        return _columns([], [], [], [], [], [], [], p)
    table = _columns(*zip(*rows), p)
    table["batch"] = np.full(len(rows), -1)
    table["direction"] = np.full(len(rows), -1)
    return table
