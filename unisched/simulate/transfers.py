"""The transfers a schedule implies.

With costs that make communication take time, the run (the compiled greedy
or the engine) books every transfer as it schedules (links serialise).  With free communication (the
paper's model) nothing a transfer does can change the schedule, so they are
derived here afterwards, in bulk, by the same rules: a data dependency whose
ends run on different workers moves an activation, gradient or stash; an item
whose weight worker is another worker fetches weights (once per worker and
stage when weights are cached) and returns its gradient; a gang's first
member hands out and collects (:func:`unisched.dataflow.gang_moves`), and
each member fetches the share of the weights it computes with.  The
end-of-step all-reduce among the holders of each share of a stage
(:func:`allreduce_groups`), and then of each tied weight's copies
(:func:`tie_table`), is added here, timed by the network model; on a
topology the run books them on the links their members use instead.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from unisched import dataflow, network
from unisched.simulate.problem import Problem, moves
from unisched.simulate.stashes import unique_codes
from unisched.timeline import TRANSFER_KINDS, Transfers

_CODE = {kind: code for code, kind in enumerate(TRANSFER_KINDS)}


class Booked(NamedTuple):
    """Transfer rows booked as a run schedules, as columns: kind (a code of
    ``TRANSFER_KINDS``), src, dst, start, end, bytes and the item served
    (the compiled greedy's form; the engine books a list of tuples)."""

    kind: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    start: np.ndarray
    end: np.ndarray
    nbytes: np.ndarray
    item: np.ndarray

    @classmethod
    def of_rows(cls, rows: list) -> "Booked":
        """The engine's rows ``(kind name, src, dst, start, end, bytes, item)`` as columns."""
        if not rows:
            return cls.joined()
        kind, src, dst, begin, finish, nbytes, item = zip(*rows)
        return cls(np.array([_CODE[k] for k in kind], dtype=np.int64), np.array(src, dtype=np.int64),
                   np.array(dst, dtype=np.int64), np.array(begin, dtype=float), np.array(finish, dtype=float),
                   np.array(nbytes, dtype=float), np.array(item, dtype=np.int64))

    @classmethod
    def joined(cls, *parts: "Booked") -> "Booked":
        """``parts`` one after another (none: no rows)."""
        if not parts:
            none_i, none_f = np.zeros(0, np.int64), np.zeros(0)
            return cls(none_i, none_i, none_i, none_f, none_f, none_f, none_i)
        return cls(*(np.concatenate(column) for column in zip(*parts)))

    def equals(self, other: "Booked") -> bool:
        """The same rows in the same order, column for column."""
        return all(np.array_equal(a, b) for a, b in zip(self, other))


def transfers(p: Problem, start: np.ndarray, end: np.ndarray, booked: Booked | None) -> Transfers:
    """Every transfer of a step: those ``booked`` by the run, or with free
    communication those derived from the timeline; then, off a topology,
    the end-of-step all-reduces."""
    tables = [_from_booked(p, booked)] if booked is not None else _derived(p, start, end)
    if getattr(p.costs, "topology", None) is None:  # on a topology the engine booked the all-reduces
        tables.append(_allreduce(p, end, tables))
    return Transfers(**_concat(*tables))


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


def _from_booked(p: Problem, booked: Booked) -> dict:
    table = _columns(*booked, p)
    return _serving_the_step(table, table["kind"] == _CODE["allreduce"])


def _serving_the_step(table: dict, rows) -> dict:
    """``table`` with its ``rows`` (all-reduces) marked as serving the whole
    step, not one item: batch and direction -1."""
    table["batch"][rows] = -1
    table["direction"][rows] = -1
    return table


def _derived(p: Problem, start: np.ndarray, end: np.ndarray) -> list[dict]:
    compute = p.worker_array
    edges = p.data_edges  # a fixed-order edge joins two items of one worker: it moves nothing
    moved = (compute[edges[0]] != compute[edges[1]])
    kinds, nbytes = moves(p, edges[:, moved])
    src, dst = edges[0, moved], edges[1, moved]
    some = kinds >= 0
    kinds, nbytes, src, dst = kinds[some], nbytes[some], src[some], dst[some]
    data = _columns(kinds, compute[src], compute[dst], end[src], end[src], nbytes, dst, p)

    item, member, holder, _, size = p.weight_links
    fetching = np.flatnonzero(dataflow.fetches_weights(member, holder))
    returning = np.flatnonzero(p.returning_links)
    if p.cache_weights:
        fetching = _first_per_group(fetching, p.weight_pieces, start[item])
        returning = _first_per_group(returning, p.weight_pieces, -end[item])
    fetches = _columns(
        np.full(len(fetching), _CODE["weights"]), holder[fetching], member[fetching],
        start[item[fetching]], start[item[fetching]], size[fetching], item[fetching], p,
    )
    returns = _columns(
        np.full(len(returning), _CODE["weight_gradient"]), member[returning], holder[returning],
        end[item[returning]], end[item[returning]], size[returning], item[returning], p,
    )
    moved = p.gang_move_table
    at = np.where(moved.after, end[moved.item], start[moved.item])
    gangs = _columns(moved.kind, moved.src, moved.dst, at, at, moved.nbytes, moved.item, p)
    return [data, fetches, returns, gangs]


def _first_per_group(rows: np.ndarray, piece, sort_key) -> np.ndarray:
    """Of ``rows``, the first by ``sort_key`` in each group of one ``piece``
    (a worker's share of a stage)."""
    if not len(rows):
        return rows
    order = np.lexsort((sort_key[rows], piece[rows]))
    rows = rows[order]
    group = piece[rows]
    keep = np.append(True, group[1:] != group[:-1])
    return rows[keep]


class AllReduce(NamedTuple):
    """One end-of-step all-reduce: a share of a stage held by several workers."""

    stage: int
    share: int
    replicas: list
    """The workers holding that share (in the step simulated)."""
    ready: float
    """When every replica has its gradient (its own backwards and returned ones)."""
    nbytes: float
    item: int
    """The stage's first gradient pass, which the transfer rows name."""


class AllReduces(NamedTuple):
    """Every :class:`AllReduce` of a step as arrays, by (stage, share):
    group g's replicas are ``replicas[ptr[g]:ptr[g + 1]]``, in worker order."""

    stage: np.ndarray
    share: np.ndarray
    ready: np.ndarray
    nbytes: np.ndarray
    item: np.ndarray
    ptr: np.ndarray
    replicas: np.ndarray

    def groups(self) -> list[AllReduce]:
        return [AllReduce(s, k, self.replicas[a:b].tolist(), r, n, i) for s, k, r, n, i, a, b in zip(
            self.stage.tolist(), self.share.tolist(), self.ready.tolist(), self.nbytes.tolist(), self.item.tolist(),
            self.ptr[:-1].tolist(), self.ptr[1:].tolist())]


def allreduce_groups(p: Problem, end: np.ndarray, returned_stage, returned_end) -> list[AllReduce]:
    """The :class:`AllReduce` of :func:`allreduce_table`, one by one."""
    return allreduce_table(p, end, returned_stage, returned_end).groups()


def _gradient_ready(p: Problem, end: np.ndarray, returned_stage, returned_end) -> np.ndarray:
    """Per stage, when its holders have all of its gradient: the end of its
    last gradient pass and the arrival of every gradient returned to a
    holder (``returned_*``: their stage and arrival)."""
    item = p.gradient_items
    ready = np.full(p.shape.num_stages, -np.inf)
    np.maximum.at(ready, p.stage[item], end[item])
    np.maximum.at(ready, np.asarray(returned_stage, dtype=np.int64), np.asarray(returned_end, dtype=float))
    return ready


def _first_gradient_pass(p: Problem) -> np.ndarray:
    """Per stage, its first gradient pass (an item), which transfer rows of its all-reduces name."""
    item = p.gradient_items
    first = np.full(p.shape.num_stages, -1)
    first[p.stage[item][::-1]] = item[::-1]
    return first


def _one_of_replicas(p: Problem) -> bool:
    """Whether the costs say the step is one of several data-parallel replicas,
    so that even a weight one worker holds is all-reduced (with the others')."""
    return getattr(p.costs, "replicas", 1) > 1


def _no_allreduces() -> AllReduces:
    none_i, none_f = np.zeros(0, np.int64), np.zeros(0)
    return AllReduces(none_i, none_i, none_f, none_f, none_i, np.zeros(1, np.int64), none_i)


def allreduce_table(p: Problem, end: np.ndarray, returned_stage, returned_end) -> AllReduces:
    """An all-reduce per share of a stage held by several workers (the
    holders of :meth:`Problem.weight_links`, whichever pass they serve: a
    holder that only lends weights to forwards takes the update as well), or
    by one when the costs say the step is one of several data-parallel
    replicas; ``returned_*`` are the stage and arrival of every weight
    gradient returned to a holder."""
    item, _, holder, share, size = p.weight_links
    stage = p.stage[item]
    S = p.shape.num_stages
    shares, holders = int(share.max(initial=0)) + 1, int(holder.max(initial=0)) + 1
    held, first = unique_codes((stage * shares + share) * holders + holder, S * shares * holders, return_index=True)
    group_of = held // holders  # stage * shares + share, one run per group
    opens = np.flatnonzero(np.append(True, group_of[1:] != group_of[:-1]))
    count = np.diff(np.append(opens, len(held)))
    kept = (count > 1) | _one_of_replicas(p)
    if not kept.any():
        return _no_allreduces()
    ready = _gradient_ready(p, end, returned_stage, returned_end)
    group_stage, group_share = np.divmod(group_of[opens][kept], shares)
    ptr = np.zeros(int(kept.sum()) + 1, dtype=np.int64)
    np.cumsum(count[kept], out=ptr[1:])
    return AllReduces(
        stage=group_stage, share=group_share, ready=ready[group_stage],
        nbytes=size[first[(opens + count - 1)[kept]]].astype(float),  # the size its last holder gives
        item=_first_gradient_pass(p)[group_stage], ptr=ptr, replicas=(held % holders)[np.repeat(kept, count)],
    )


def tie_table(p: Problem, end: np.ndarray, returned_stage, returned_end, reduced_stage, reduced_end) -> AllReduces:
    """An all-reduce per tied weight (``Costs.tied_weights``) whose copies
    several workers hold (:func:`unisched.dataflow.tie_holders`; or one, when
    the step is one of several data-parallel replicas), ready once every
    copy's stage has its gradient (:func:`_gradient_ready`) and its own
    all-reduces (``reduced_*``: their stage and end) are done.  Its stage is
    the first copy's, its share -1."""
    ties = p.costs.tied_weights
    if not ties:
        return _no_allreduces()
    item, _, holder, _, _ = p.weight_links
    holders = dataflow.replicas(p.stage[item], holder, p.shape.num_stages)
    ready = _gradient_ready(p, end, returned_stage, returned_end)
    np.maximum.at(ready, np.asarray(reduced_stage, dtype=np.int64), np.asarray(reduced_end, dtype=float))
    fewest = 1 if _one_of_replicas(p) else 2
    kept = [(tie, dataflow.tie_holders(tie.stages, holders)) for tie in ties]
    kept = [(tie, members) for tie, members in kept if len(members) >= fewest]
    if not kept:
        return _no_allreduces()
    ptr = np.zeros(len(kept) + 1, dtype=np.int64)
    np.cumsum([len(members) for _, members in kept], out=ptr[1:])
    first_stage = np.array([tie.stages[0] for tie, _ in kept], dtype=np.int64)
    return AllReduces(
        stage=first_stage, share=np.full(len(kept), -1, np.int64),
        ready=np.array([ready[list(tie.stages)].max() for tie, _ in kept]),
        nbytes=np.array([tie.nbytes for tie, _ in kept]), item=_first_gradient_pass(p)[first_stage], ptr=ptr,
        replicas=np.array([m for _, members in kept for m in members], dtype=np.int64),
    )


def ring_rows(group: AllReduce, everyone: list, begin: float, finish: float) -> list:
    """Transfer rows of an all-reduce among ``everyone`` (the replicas
    simulated and any others like them): :func:`ring_hops` of the simulated ones."""
    src, dst, nbytes = ring_hops(np.array([0, len(group.replicas)]), np.asarray(group.replicas, dtype=np.int64),
                                 np.array([len(everyone)]), np.array([group.nbytes], dtype=float))
    return [("allreduce", s, d, begin, finish, b, group.item) for s, d, b in zip(src.tolist(), dst.tolist(),
                                                                                 nbytes.tolist())]


def ring_hops(ptr: np.ndarray, replicas: np.ndarray, ring_sizes: np.ndarray, nbytes: np.ndarray):
    """(src, dst, bytes) of the transfer rows of ring all-reduces: one per hop
    of each ring among its simulated replicas (group g's are
    ``replicas[ptr[g]:ptr[g + 1]]``), each carrying 2(n-1)/n of the buffer,
    n the ring's size (``ring_sizes``: the replicas and any others like them)."""
    count = np.diff(ptr)
    nxt = np.arange(1, len(replicas) + 1)
    nxt[ptr[1:][count > 0] - 1] = ptr[:-1][count > 0]  # the last replica sends to the first
    n = np.asarray(ring_sizes, dtype=float)
    return replicas, replicas[nxt], np.repeat(2 * (n - 1) / n * nbytes, count)


def _allreduce(p: Problem, end: np.ndarray, moved: list[dict]) -> dict:
    """The all-reduces of :func:`allreduce_table` after the transfers
    ``moved``, each starting when its stage is ready and taking the network
    model's time, then those of :func:`tie_table`."""
    returned = [table["kind"] == _CODE["weight_gradient"] for table in moved]
    returned_stage = np.concatenate([table["stage"][r] for table, r in zip(moved, returned)])
    returned_end = np.concatenate([table["end"][r] for table, r in zip(moved, returned)])
    stages = allreduce_table(p, end, returned_stage, returned_end)
    stage_rows, stage_end = _ring_table(p, stages)
    ties = tie_table(p, end, returned_stage, returned_end, stages.stage, stage_end)
    return _concat(stage_rows, _ring_table(p, ties)[0])


def _ring_table(p: Problem, t: AllReduces) -> tuple[dict, np.ndarray]:
    """Transfer rows of the all-reduces ``t``, each from its ready time for
    the network model's time, and each one's end."""
    duration = np.array([network.ring_allreduce_time(p.costs, t.replicas[a:b], n)
                         for a, b, n in zip(t.ptr[:-1].tolist(), t.ptr[1:].tolist(), t.nbytes.tolist())], dtype=float)
    count = np.diff(t.ptr)
    src, dst, nbytes = ring_hops(t.ptr, t.replicas, count, t.nbytes)
    every = np.repeat(np.arange(len(count)), count)
    table = _columns(np.full(len(src), _CODE["allreduce"]), src, dst, t.ready[every],
                     (t.ready + duration)[every], nbytes, t.item[every], p)
    return _serving_the_step(table, slice(None)), t.ready + duration
