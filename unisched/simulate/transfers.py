"""The transfers a schedule implies.

With costs that make communication take time, the engine books every
transfer as it schedules (links serialise).  With free communication (the
paper's model) nothing a transfer does can change the schedule, so they are
derived here afterwards, in bulk, by the same rules: a data dependency whose
ends run on different workers moves an activation, gradient or stash; an item
whose weight worker is another worker fetches weights (once per worker and
stage when weights are cached) and returns its gradient.  The end-of-step
all-reduce among a stage's replicas is added here in both cases.
"""

from __future__ import annotations

import numpy as np

from unisched import dataflow, network
from unisched.simulate.problem import EDGE_SEQUENCE, Problem, moves
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
    compute, weight = p.worker_array, p.weight_worker_array
    src, dst, kind, what = p.edges
    moved = (kind != EDGE_SEQUENCE) & (compute[src] != compute[dst])
    src, dst = src[moved], dst[moved]
    kinds, nbytes = moves(p, src, dst, what[moved])
    data = _columns(kinds, compute[src], compute[dst], end[src], end[src], nbytes, dst, p)

    weight_bytes = np.asarray(p.weight_bytes)
    fetching = np.flatnonzero(dataflow.fetches_weights(compute, weight))
    returning = np.flatnonzero(np.asarray(p.returns_gradient))
    if p.cache_weights:
        fetching = _first_per_group(fetching, compute, p.stage, start)
        returning = _first_per_group(returning, compute, p.stage, -end)
    fetches = _columns(
        np.full(len(fetching), _CODE["weights"]), weight[fetching], compute[fetching],
        start[fetching], start[fetching], weight_bytes[p.stage[fetching]], fetching, p,
    )
    returns = _columns(
        np.full(len(returning), _CODE["weight_gradient"]), compute[returning], weight[returning],
        end[returning], end[returning], weight_bytes[p.stage[returning]], returning, p,
    )
    return _concat(data, fetches, returns)


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
    """A ring all-reduce per stage held by several weight workers, once every
    replica has its stage's gradient (its own backwards and returned ones)."""
    last_backward = p.direction == dataflow.gradient_pass(p.split_backward)
    held = dataflow.replicas(p.stage[last_backward], p.weight_worker_array[last_backward], p.shape.num_stages)
    rows = []
    for s, replicas in enumerate(held):
        if len(replicas) < 2:
            continue
        on_stage = last_backward & (p.stage == s)
        returned = (moved["kind"] == _CODE["weight_gradient"]) & (moved["stage"] == s)
        ready = max(end[on_stage].max(), moved["end"][returned].max(initial=0.0))
        n = len(replicas)
        nbytes = 2 * (n - 1) / n * p.weight_bytes[s]
        finish = ready + float(network.ring_allreduce_time(p.costs, replicas, p.weight_bytes[s]))
        some_item = int(np.flatnonzero(on_stage)[0])
        for i, r in enumerate(replicas):
            rows.append((_CODE["allreduce"], int(r), int(replicas[(i + 1) % n]), ready, finish, nbytes, some_item))
    if not rows:
        return _columns([], [], [], [], [], [], [], p)
    table = _columns(*zip(*rows), p)
    table["batch"] = np.full(len(rows), -1)
    table["direction"] = np.full(len(rows), -1)
    return table
