"""The data flow of one training step: what each work item reads, produces
and frees, and what moves between workers.

This module is the one place where the scheme's rules about data are
written.  The simulator's edges, transfers and memory
limits, the memory curves, the planner's CP-SAT data and the executor's
per-rank messages are all derived from it.

Items
    One step is the items ``Work(b, s, d)`` for every micro-batch b, stage s
    and direction d in ``directions(split_backward)``.  :class:`Items` numbers
    them batch-major, ``id = (b * S + s) * D + k`` with k the position of d:
    the one integer encoding every layer uses.

Dependencies (over a :class:`~unisched.work.StageGraph`, a chain by default)
    - F(s) needs F(p) for every predecessor p of s: their outputs are its inputs
      (an *activation* moves when the two run on different workers);
    - the first backward pass of s (B, or I with a split backward) needs the
      same pass of every successor t (a *gradient* of s's output moves), or,
      at a sink, F(s) itself;
    - it also needs F(s): the forward's input is *stashed* for it, and moves
      to the backward's worker when the two differ;
    - W(s) needs I(s) (the stash, and the output gradient, follow it).

What a move carries
    An activation is its consumer's input (``activation_bytes`` of the
    consumer, per predecessor); a gradient is the gradient of that input.  A
    stash follows a backward pass that runs on another worker than the pass
    it depends on (:func:`stash_needs`): the stage's inputs, from which that
    worker recomputes the forward (nothing at a source stage: its input is
    the micro-batch, which every worker has), and, for a weight pass away
    from its input pass, the output gradient unless that worker computed it.

Memory
    The input a forward stashes is held on the worker of the backward pass
    that frees it, from the forward's start to that pass's end.  A whole
    backward frees all of it; with a split backward, I frees the share
    ``input_grad_frees`` and W the rest (:func:`stash_shares`).

Weights
    An item whose weight worker differs from its compute worker fetches the
    stage's weights from the weight worker; the pass that produces a stage's
    weight gradient (B, or W with a split backward) returns that gradient to
    the weight worker.  A stage with several weight workers has replicas,
    whose gradients are all-reduced once every replica has them.  A stage
    held in shards (fully sharded, ZeRO-3) is fetched shard by shard from
    their holders and its gradient returned the same way
    (:func:`sharded_weights`): an all-gather and a reduce-scatter, moved as
    their point-to-point parts.

Ties
    A weight that several stages hold a copy of (``Costs.tied_weights``)
    ends the step with one more all-reduce: the copies' gradients summed
    among the workers that hold any copy (:func:`tie_holders`), once every
    copy's stage has its final gradient (after its replicas' all-reduce).

Gangs
    A gang of workers runs one item jointly (:func:`gang_moves`).  A
    tensor-parallel gang (``collective``) computes the whole micro-batch on
    every member, each with its shard of the weights; a gang that shares rows
    gives each member its share of the micro-batch and the whole stage.  The
    first member (the compute worker) receives and sends for the gang: it
    hands out the item's input (whole, or each member's rows) and, sharing
    rows, collects the members' results.  Each member fetches the share of
    the weights it computes with from where that share is held
    (:func:`weight_share`, :func:`share_holder`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, NamedTuple, Sequence

import networkx as nx
import numpy as np

from unisched.errors import ShapeError
from unisched.work import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    Direction,
    StageGraph,
    Work,
    as_stage_graph,
    directions,
)

# ---------------------------------------------------------------------- items
@dataclass(frozen=True)
class Items:
    """The work items of one step and their integer ids."""

    num_stages: int
    num_batches: int
    split_backward: bool = False

    @property
    def dirs(self) -> tuple[Direction, ...]:
        return directions(self.split_backward)

    @property
    def count(self) -> int:
        return self.num_batches * self.num_stages * len(self.dirs)

    def id(self, batch, stage, direction):
        """The id of ``Work(batch, stage, direction)``; works on ints and on arrays."""
        return (np.asarray(batch) * self.num_stages + np.asarray(stage)) * len(self.dirs) + self._position(direction)

    @cached_property
    def _positions(self) -> np.ndarray:
        """Direction code -> its position k in ``dirs`` (-1: not a pass of this step)."""
        table = np.full(len(Direction), -1, dtype=np.int64)
        table[list(self.dirs)] = np.arange(len(self.dirs))
        return table

    def _position(self, direction):
        code = np.asarray(direction, dtype=np.int64)
        known = (code >= 0) & (code < len(Direction))
        position = np.where(known, self._positions[np.where(known, code, 0)], -1)
        if np.any(position < 0):
            raise ShapeError(f"direction {direction!r} is not a pass of this step (split_backward={self.split_backward})")
        return position if np.ndim(position) else int(position)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(batch, stage, direction) of every id, in id order."""
        return self.columns(np.arange(self.count))

    def columns(self, ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(batch, stage, direction) of each of ``ids``: :meth:`work` on arrays."""
        D = len(self.dirs)
        ids = np.asarray(ids, dtype=np.int64)
        return ids // (self.num_stages * D), (ids // D) % self.num_stages, np.asarray(self.dirs, dtype=np.int64)[ids % D]

    def work(self, item: int) -> Work:
        D = len(self.dirs)
        batch, rest = divmod(int(item), self.num_stages * D)
        return Work(batch, rest // D, self.dirs[rest % D])

    def __iter__(self) -> Iterator[Work]:
        """Every item, in id order."""
        for b in range(self.num_batches):
            for s in range(self.num_stages):
                for d in self.dirs:
                    yield Work(b, s, d)


def all_work(num_stages: int, num_batches: int, *, split_backward: bool = False) -> Iterator[Work]:
    """Every work item of one step, batch-major: the order of their ids."""
    return iter(Items(num_stages, num_batches, split_backward))


def first_backward(split_backward: bool) -> Direction:
    """The backward pass that carries the gradient upstream (and reads the stash)."""
    return BACKWARD_INPUT if split_backward else BACKWARD


def gradient_pass(split_backward: bool) -> Direction:
    """The pass that produces a stage's weight gradient."""
    return BACKWARD_WEIGHT if split_backward else BACKWARD


# ---------------------------------------------------------------------- dependencies
class Flow(NamedTuple):
    """One dependency of an item: the item it waits for, and what that
    dependency carries when the two run on different workers."""

    source: Work
    kind: str | None
    """"activation", "gradient" or "stash" (see ``unisched.timeline.TRANSFER_KINDS``),
    or None: a source stage's stash, which moves nothing (:func:`stash_needs`)."""
    stage: int
    """The stage whose input size (activation, gradient) or stash size the data has."""


def flows(
    work: Work,
    num_stages: int,
    *,
    split_backward: bool = False,
    stage_graph: StageGraph | nx.DiGraph | None = None,
) -> tuple[Flow, ...]:
    """Every dependency of ``work`` and what it moves (see the module docstring)."""
    graph = as_stage_graph(num_stages, stage_graph)
    b, s, d = work.batch, work.stage, Direction(work.direction)
    if d is FORWARD:
        return tuple(Flow(Work(b, p, FORWARD), "activation", s) for p in graph.predecessors[s])
    if d is BACKWARD_WEIGHT:
        if not split_backward:
            raise ShapeError(f"{work!r} is a split-backward item but split_backward is off")
        return (Flow(Work(b, s, BACKWARD_INPUT), "stash", s),)
    if (d is BACKWARD_INPUT) != split_backward:
        raise ShapeError(f"{work!r} does not match split_backward={split_backward}")
    upstream = tuple(Flow(Work(b, t, d), "gradient", t) for t in graph.successors[s])
    return (*upstream, Flow(Work(b, s, FORWARD), "stash" if graph.predecessors[s] else None, s))


def dependencies(
    work: Work,
    num_stages: int,
    *,
    split_backward: bool = False,
    stage_graph: StageGraph | nx.DiGraph | None = None,
) -> tuple[Work, ...]:
    """The items that must finish before ``work`` can start."""
    return tuple(f.source for f in flows(work, num_stages, split_backward=split_backward, stage_graph=stage_graph))


EDGE_PRIMARY = 0
"""A dependency whose completion can trigger the item (its priority is used)."""
EDGE_STASH = 1
"""A backward's need for its forward's stashed input where a gradient from
downstream also leads to it: it never triggers the item, and without
communication costs it never binds."""

_KIND_CODE = {"activation": 0, "gradient": 1, "stash": 2}
"""Positions in ``unisched.timeline.TRANSFER_KINDS``."""


def edges(items: Items, graph: StageGraph) -> np.ndarray:
    """Every dependency of every item, vectorised: a (4, E) array of
    source id, destination id, edge kind (``EDGE_*``) and the code of what it
    moves (index into ``TRANSFER_KINDS``, or ``MOVES_NOTHING``: a source
    stage's stash, see :func:`stash_needs`), in the rules of :func:`flows`."""
    S, B, dirs = items.num_stages, items.num_batches, items.dirs
    D = len(dirs)
    k = {d: i for i, d in enumerate(dirs)}
    back = first_backward(items.split_backward)
    batches = np.arange(B)[:, None] * (S * D)
    pieces = []

    def add(src_stage, src_dir, dst_stage, dst_dir, kind, moves):
        src_stage, dst_stage = np.asarray(src_stage, dtype=np.int64), np.asarray(dst_stage, dtype=np.int64)
        if not src_stage.size:
            return
        src = batches + src_stage[None, :] * D + k[src_dir]
        dst = batches + dst_stage[None, :] * D + k[dst_dir]
        n = src.size
        code = MOVES_NOTHING if moves is None else _KIND_CODE[moves]
        pieces.append(np.stack([src.ravel(), dst.ravel(), np.full(n, kind), np.full(n, code)]))

    pairs = np.array(list(graph.graph.edges), dtype=np.int64).reshape(-1, 2)
    add(pairs[:, 0], FORWARD, pairs[:, 1], FORWARD, EDGE_PRIMARY, "activation")
    add(pairs[:, 1], back, pairs[:, 0], back, EDGE_PRIMARY, "gradient")
    stages = np.arange(S)
    has_inputs = np.array([bool(graph.predecessors[s]) for s in range(S)], dtype=bool)
    is_sink = np.array([not graph.successors[s] for s in range(S)], dtype=bool)
    for kind, chosen in ((EDGE_PRIMARY, is_sink), (EDGE_STASH, ~is_sink)):
        add(stages[chosen & has_inputs], FORWARD, stages[chosen & has_inputs], back, kind, "stash")
        add(stages[chosen & ~has_inputs], FORWARD, stages[chosen & ~has_inputs], back, kind, None)
    if items.split_backward:
        everything = np.arange(S)
        add(everything, BACKWARD_INPUT, everything, BACKWARD_WEIGHT, EDGE_PRIMARY, "stash")
    if not pieces:
        return np.zeros((4, 0), dtype=np.int64)
    return np.concatenate(pieces, axis=1).astype(np.int64, copy=False)


def depths(items: Items, graph: StageGraph) -> np.ndarray:
    """Each item's place in the dependencies: the number of items on the longest
    chain of :func:`edges` that ends at it.  Ordering by it breaks ties between
    items that start together (zero-time passes) without breaking a dependency."""
    one = Items(items.num_stages, 1, items.split_backward)
    src, dst = edges(one, graph)[:2]
    depth = np.zeros(one.count, dtype=np.int64)
    for _ in range(one.count):  # a chain has fewer links than items
        longer = np.zeros_like(depth)
        np.maximum.at(longer, dst, depth[src] + 1)
        if np.array_equal(np.maximum(depth, longer), depth):
            break
        depth = np.maximum(depth, longer)
    return np.tile(depth, items.num_batches)


def moved_stage(src_stage: np.ndarray, dst_stage: np.ndarray, moves: np.ndarray) -> np.ndarray:
    """The stage whose size the data of each edge has (vectorised :attr:`Flow.stage`):
    an activation is its consumer's input, a gradient or stash its producer's."""
    return np.where(moves == _KIND_CODE["activation"], dst_stage, src_stage)


def moved_data(items: Items, graph: StageGraph, edge_table: np.ndarray, compute: np.ndarray,
               activation_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What each dependency of ``edge_table`` (rows src, dst, kind, moves as
    :func:`edges` gives them) carries when ``compute`` (per item) puts its
    ends on different workers: (moved-data code, bytes).  An activation or
    gradient has its stage's input size; a stash carries what
    :func:`stash_needs` says, and ``MOVES_NOTHING`` when that is nothing."""
    src, dst, moves = edge_table[0], edge_table[1], edge_table[3].copy()
    _, stage, direction = items.arrays()
    act = np.asarray(activation_bytes, dtype=float)
    size = moved_stage(stage[src], stage[dst], moves)
    nbytes = np.where(moves == MOVES_NOTHING, 0.0, act[size])
    stash = moves == _KIND_CODE["stash"]
    nbytes[stash] = input_bytes(act, graph)[size[stash]]
    crossing = np.flatnonzero(stash & (direction[dst] == BACKWARD_WEIGHT) & (compute[src] != compute[dst]))
    if len(crossing):
        parts = input_bytes(act, graph), output_bytes(act, graph)

        def compute_of(work: Work) -> int:
            return int(compute[items.id(work.batch, work.stage, work.direction)])

        for e in crossing.tolist():
            work = items.work(int(dst[e]))
            needs = stash_needs(work, int(compute[dst[e]]), compute_of, graph)
            nbytes[e] = sum(part[work.stage] for part, needed in zip(parts, needs) if needed)
            if not any(needs):
                moves[e] = MOVES_NOTHING
    return moves, nbytes


# ---------------------------------------------------------------------- what moves
MOVES_NOTHING = -1
"""The moved-data code of a dependency that carries nothing between workers."""


def input_bytes(activation_bytes: np.ndarray, graph: StageGraph) -> np.ndarray:
    """Per stage: the bytes of its inputs, one activation per predecessor
    (0 at a source stage, whose input is the micro-batch)."""
    return np.asarray(activation_bytes, dtype=float) * np.array(
        [len(graph.predecessors[s]) for s in range(graph.num_stages)], dtype=float
    )


def output_bytes(activation_bytes: np.ndarray, graph: StageGraph) -> np.ndarray:
    """Per stage: the bytes of its output, its first consumer's input; at a
    sink, whose output goes to the loss, its own input size stands in."""
    act = np.asarray(activation_bytes, dtype=float)
    return np.array([act[graph.successors[s][0]] if graph.successors[s] else act[s] for s in range(graph.num_stages)])


def stash_needs(work: Work, worker: int, compute_of, graph: StageGraph) -> tuple[bool, bool]:
    """What the stash ``work`` (a backward pass) follows must carry to
    ``worker``, where it runs away from the pass it depends on:
    (the stage's inputs, its output gradient).  ``compute_of(Work)`` gives
    any item's compute worker.

    After a forward elsewhere the inputs, unless the stage is a source; a
    weight pass after its input pass elsewhere also needs them unless it ran
    the forward, and the output gradient unless it ran the input pass of
    every consumer (a sink's comes from the loss, recomputed there)."""
    forward, consumers = stash_sources(work, graph)
    has_inputs = forward is not None and compute_of(forward) != worker
    return has_inputs, any(compute_of(consumer) != worker for consumer in consumers)


def stash_sources(work: Work, graph: StageGraph) -> tuple[Work | None, tuple[Work, ...]]:
    """The passes whose workers decide what :func:`stash_needs` says the stash of ``work`` (a
    backward pass) carries: the forward, whose inputs it needs unless it ran there (None at a
    source stage); and for a weight pass the input passes of the stage's consumers, whose
    output gradient it needs unless it ran every one (none at a sink: the loss's gradient is
    recomputed where it runs)."""
    b, s = work.batch, work.stage
    forward = Work(b, s, FORWARD) if graph.predecessors[s] else None
    if Direction(work.direction) is not BACKWARD_WEIGHT:
        return forward, ()
    return forward, tuple(Work(b, t, BACKWARD_INPUT) for t in graph.successors[s])


# ---------------------------------------------------------------------- memory
def stash_shares(split_backward: bool, input_grad_frees: float) -> dict[Direction, float]:
    """What share of a forward's stash each backward pass frees."""
    if split_backward:
        return {BACKWARD_INPUT: float(input_grad_frees), BACKWARD_WEIGHT: 1.0 - float(input_grad_frees)}
    return {BACKWARD: 1.0}


def stash_share_array(direction: np.ndarray, split_backward: bool, input_grad_frees: float) -> np.ndarray:
    """Per item: the share of its (stage, batch)'s stash it frees (0 for a forward)."""
    table = np.zeros(len(Direction))
    for d, share in stash_shares(split_backward, input_grad_frees).items():
        table[d] = share
    return table[np.asarray(direction, dtype=np.int64)]


# ---------------------------------------------------------------------- weights
def own_copies(stage: np.ndarray, compute: np.ndarray, weight: np.ndarray, num_stages: int,
               whole: np.ndarray | None = None) -> np.ndarray:
    """Per item: the weight worker it computes with.  A worker that is a weight worker of a stage
    (for any of its items) holds a replica of it, and computes every item of that stage with its
    own copy, whichever weight worker the mapping names for the item; only a worker holding no
    replica fetches.  ``whole`` (per item; default all) marks the items whose stage each
    worker holds whole (not in shards, not for a gang), the only ones this applies to."""
    stage, compute, weight = (np.asarray(a, dtype=np.int64) for a in (stage, compute, weight))
    whole = np.ones(len(stage), dtype=bool) if whole is None else np.asarray(whole, dtype=bool)
    if not whole.any():
        return weight
    workers = int(max(compute.max(), weight.max())) + 1
    held = np.zeros((num_stages, workers), dtype=bool)
    held[stage[whole], weight[whole]] = True
    return np.where(whole & held[stage, compute], compute, weight)


def fetches_weights(compute: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Per item: whether it computes with weights fetched from another worker."""
    return np.asarray(compute) != np.asarray(weight)


def returns_gradient(direction: np.ndarray, compute: np.ndarray, weight: np.ndarray, split_backward: bool) -> np.ndarray:
    """Per item: whether it produces a weight gradient that goes back to another worker."""
    return (np.asarray(direction) == gradient_pass(split_backward)) & fetches_weights(compute, weight)


def replicas(stage: np.ndarray, weight: np.ndarray, num_stages: int) -> list[tuple[int, ...]]:
    """Per stage: its weight workers, sorted.  More than one means replicas
    that all-reduce the stage's gradient."""
    held: list[set[int]] = [set() for _ in range(num_stages)]
    for s, w in set(zip(np.asarray(stage).tolist(), np.asarray(weight).tolist())):
        held[s].add(w)
    return [tuple(sorted(h)) for h in held]


def tie_holders(stages: Sequence[int], holders: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The workers that all-reduce a tied weight's gradient: the holders
    (``holders[s]``, as :func:`replicas` gives them) of every stage in
    ``stages`` that has a copy, sorted.  One worker alone sums the copies in
    place and moves nothing."""
    return tuple(sorted(set().union(*(holders[s] for s in stages))))


# ---------------------------------------------------------------------- gangs
def weight_share(members: Sequence[int], collective: bool, worker: int) -> int:
    """Which share of its stage's weights ``worker`` computes with as a member
    of a gang: a tensor-parallel gang (``collective``) cuts them in
    ``len(members)`` shards, member i taking shard i; a gang that splits the
    micro-batch's rows, or a worker alone, uses the whole stage (share 0)."""
    return list(members).index(worker) if collective else 0


class GangMove(NamedTuple):
    """One transfer inside a gang for an item it runs."""

    kind: str
    """"activation" or "gradient" (see ``unisched.timeline.TRANSFER_KINDS``)."""
    src: int
    dst: int
    data: str
    """"input": the item's input (its stage's :func:`input_bytes`) or its
    gradient; "output": the stage's output (:func:`output_bytes`) or its gradient."""
    share: float
    """The fraction of that data that moves."""
    after: bool
    """False: handed out before the members compute; True: collected after."""


def gang_moves(direction: Direction, members: Sequence[int], collective: bool) -> tuple[GangMove, ...]:
    """What moves inside a gang that runs an item of ``direction`` (see the
    module docstring): the first member hands out what the item starts from
    (a forward's input, a backward's output gradient), whole to a
    tensor-parallel gang, a 1/n share of the rows otherwise; a gang that
    shares rows then collects the members' results (outputs, input
    gradients).  A weight pass starts from what its input pass left on each
    member and moves nothing."""
    direction = Direction(direction)
    first, others = int(members[0]), [int(m) for m in members[1:]]
    if direction is BACKWARD_WEIGHT or not others:
        return ()
    share = 1.0 if collective else 1.0 / len(members)
    kind = "activation" if direction is FORWARD else "gradient"
    start, result = ("input", "output") if direction is FORWARD else ("output", "input")
    moves = [GangMove(kind, first, m, start, share, False) for m in others]
    if not collective:
        moves += [GangMove(kind, m, first, result, share, True) for m in others]
    return tuple(moves)


def share_holder(weight_worker: int, share: int, weight_gang: Sequence[int] | None) -> int:
    """The worker that holds the weights of truth of ``share``: the member at
    that position of the tensor-parallel gang the weight worker computes the
    stage with, or the weight worker itself for a whole stage."""
    return weight_worker if weight_gang is None else int(weight_gang[share])


def shards_held(gang_size, weight_gang_size):
    """Whether every shard of a tensor-parallel gang of ``gang_size``
    members has a holder: the member at its position in the gang of
    ``weight_gang_size`` its weight worker computes the stage with, which
    must have as many members (their shares are the same slices of the
    stage); or, with no such gang (-1), the weight worker itself, which
    holds the whole stage.  Scalars or arrays alike."""
    weight_gang_size = np.asarray(weight_gang_size)
    return (weight_gang_size < 0) | (weight_gang_size == gang_size)


def gang_weights(members: Sequence[int], collective: bool, weight_worker: int,
                 weight_gang: Sequence[int] | None) -> tuple[tuple[int, int, int, float], ...]:
    """Per member of a gang: (member, the worker holding the share it computes
    with, that share, the fraction of the stage's weights it is)."""
    fraction = 1.0 / len(members) if collective else 1.0
    rows = []
    for member in members:
        share = weight_share(members, collective, member)
        rows.append((int(member), share_holder(weight_worker, share, weight_gang), share, fraction))
    return tuple(rows)


def sharded_weights(worker: int, holders: Sequence[int]) -> tuple[tuple[int, int, int, float], ...]:
    """The weights ``worker`` computes a stage with when the stage's weights
    of truth are cut into ``len(holders)`` equal shards, shard i held by
    ``holders[i]``: per shard, (worker, its holder, i, 1/k), in the form of
    :func:`gang_weights`.  The worker fetches every shard it does not hold
    and its gradient pass returns each such shard's gradient to the holder
    (:func:`returns_gradient`): when every worker gathers the stage, the
    fetches are an all-gather and the returns a reduce-scatter, moving the
    bytes NCCL's ring moves over each link, (k-1)/k of the stage in and out
    of every member."""
    fraction = shard_fraction(len(holders))
    return tuple((int(worker), int(holder), share, fraction) for share, holder in enumerate(holders))


def shard_fraction(holders):
    """The fraction of a stage's weights one shard is, for a stage held in
    ``holders`` equal shards (a count, or an array of counts)."""
    return 1.0 / np.asarray(holders, dtype=float) if np.ndim(holders) else 1.0 / holders


__all__ = [
    "EDGE_PRIMARY",
    "EDGE_STASH",
    "MOVES_NOTHING",
    "Flow",
    "GangMove",
    "Items",
    "all_work",
    "dependencies",
    "edges",
    "fetches_weights",
    "first_backward",
    "flows",
    "gang_moves",
    "gang_weights",
    "gradient_pass",
    "input_bytes",
    "moved_data",
    "moved_stage",
    "output_bytes",
    "own_copies",
    "replicas",
    "returns_gradient",
    "share_holder",
    "shard_fraction",
    "sharded_weights",
    "shards_held",
    "stash_needs",
    "stash_share_array",
    "stash_shares",
    "stash_sources",
    "weight_share",
]
