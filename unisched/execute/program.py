"""Compile a schedule into one instruction list per rank, and check it.

A schedule says which worker runs each work item and in what order (the
Timeline's per-worker order) and whose weights it uses (the mapping's weight
worker).  What each item reads and what moves between ranks is not decided
here: it is :func:`unisched.dataflow.flows` over the schedule's stage graph,
turned into messages:

- ``2F0``: run a work item (stage 2, forward, micro-batch 0; ``B``, ``I``,
  ``W`` for a backward and its input- and weight-gradient halves);
- an *activation* dependency between ranks is a message named after the
  item that consumes it, the same on both ends: ``2F0>2`` on rank 1 sends
  the input of 2F0 (the output of 1F0) to rank 2, and ``2F0<1`` on rank 2
  posts its receive.  A stage's output goes once to each rank that needs it,
  named after the first of its consumers there (in stage order);
- a *gradient* dependency: ``1B0>1`` / ``1B0<2`` carry the gradient 1B0
  starts from (2B0's gradient of its input from stage 1), ``I`` the same for
  a split backward; a stage with several consumers gets one from each, and
  its output gradient is their sum;
- a *stash* dependency: ``1X0>3`` / ``1X0<0``: stage 1's inputs of
  micro-batch 0 (one message per predecessor stage; a source stage's input
  is the micro-batch, which every rank has), sent to the rank that runs its
  backward elsewhere (it recomputes the forward); ``1V0>3`` / ``1V0<2``: the
  output gradient a weight-gradient pass needs when it runs on another rank
  than its input-gradient pass (what that rank does not already hold);
- ``2w>3`` / ``2w<1``: serve / fetch stage 2's weights;
- ``2r>1`` / ``2r<3``: return stage 2's accumulated gradient to its weight
  worker / accept it there;
- ``2R[0,1]``: post the all-reduce of stage 2's gradient among its replicas
  0 and 1 (as soon as this rank's gradient of stage 2 is final, so that it
  overlaps the rest of the backward; awaited at the end);
- ``2O``: step the optimizer of stage 2 (on its weight workers).

Sends are posted right after the work that produces them; receives are
posted ahead of use (weights at the start, activations a few items early;
a returned gradient where the simulator starts its return, before the
weight worker's item running then, so that neither the sender's copy nor
the buffer waits for the weight worker's last item), in the order the
sender sends on that pair of ranks, which is what NCCL needs to match them.  :func:`validate` replays every rank's list against the
others and reports the ranks and actions of any deadlock before a single
byte moves.

An item run by a gang of workers is in every member's list, at the same
place; its first member (the compute worker) receives and sends for it, and
each member computes with the share of the weights
:func:`unisched.dataflow.weight_share` gives it.  A weight worker from the
number of ranks on is a rank's host memory (``world_size + rank``).  What
cannot run is refused by name: a stage graph with several sinks (the loss
needs one output), a gang with a split backward or whose backward runs on
another gang, weights held in shards (``Timeline.weight_shards``).
"""

from __future__ import annotations

import bisect
import math
import re
from collections import defaultdict
from itertools import takewhile
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import networkx as nx
import numpy as np

from unisched.dataflow import (
    Flow,
    Items,
    first_backward,
    flows,
    gradient_pass,
    returns_gradient,
    share_holder,
    shards_held,
    stash_needs,
    weight_share,
)
from unisched.errors import DeadlockError, UniSchedError
from unisched.strategy import Gang
from unisched.timeline import Timeline
from unisched.work import BACKWARD, BACKWARD_WEIGHT, FORWARD, Direction, StageGraph, Work, as_stage_graph


class ProgramError(UniSchedError, ValueError):
    """A schedule that cannot be compiled into programs for these ranks and stages."""


COMPUTE_OPS = "".join(d.letter for d in Direction)
"""Letters of the compute actions: one per :class:`~unisched.Direction`."""
MESSAGE_KINDS = {
    "F": "activation",
    "B": "gradient",
    "I": "gradient",
    "X": "stash",
    "V": "stash",
    "w": "weights",
    "r": "weight_gradient",
}
"""Letter of a message in the text form -> the Timeline transfer kind it is."""


@dataclass(frozen=True)
class Message:
    """One point-to-point transfer of one tensor (or one stage's flat weights
    or gradient).  ``key`` names the value on the receiving rank, ``value``
    what the sender reads (see :func:`output`, :func:`stashed`,
    :func:`gradient`; ``("w", s)`` weights, ``("r", s)`` a returned
    gradient).  ``stage`` and ``batch`` name the item it feeds.  ``seq`` is
    its position among the messages ``src`` sends to ``dst``."""

    index: int
    letter: str
    src: int
    dst: int
    stage: int
    batch: int
    key: tuple
    seq: int = 0
    value: tuple = ()

    @property
    def kind(self) -> str:
        return MESSAGE_KINDS[self.letter]


# ---------------------------------------------------------------------- values
def output(stage: int, batch: int) -> tuple:
    """Stage ``stage``'s output for micro-batch ``batch`` (an input of each of its consumers)."""
    return ("y", stage, batch)


def stashed(stage: int, batch: int, predecessor: int) -> tuple:
    """Stage ``stage``'s input from ``predecessor``, received as a stash by a backward that runs away from the forward."""
    return ("x", stage, batch, predecessor)


def gradient(stage: int, batch: int, consumer: int | None = None) -> tuple:
    """The gradient of stage ``stage``'s output: ``consumer``'s share, or (None) their sum."""
    return ("g", stage, batch) if consumer is None else ("g", stage, batch, consumer)


def value_stage(key: tuple) -> int:
    """The stage whose output a value is shaped like (to size a receive buffer)."""
    return key[3] if key[0] == "x" else key[1]


class Reads(NamedTuple):
    """What a work item reads on its rank: the stage's inputs (empty where
    the rank kept the forward's graph, or for a source stage, whose input is
    the micro-batch) and the gradients of its output that it sums (empty at
    the loss, or where the graph with the gradient was kept)."""

    inputs: tuple[tuple, ...] = ()
    gradients: tuple[tuple, ...] = ()

    @property
    def keys(self) -> tuple[tuple, ...]:
        return self.inputs + self.gradients


@dataclass(frozen=True)
class Action:
    """One instruction of a rank's program; ``str(action)`` is its text form."""

    op: str
    stage: int
    batch: int = -1
    peer: int = -1
    message: int = -1
    group: tuple[int, ...] = ()

    @property
    def is_compute(self) -> bool:
        return self.op in COMPUTE_OPS

    @property
    def is_send(self) -> bool:
        return self.op.endswith(">")

    @property
    def is_recv(self) -> bool:
        return self.op.endswith("<")

    @property
    def work(self) -> Work | None:
        if self.is_compute:
            return Work(self.batch, self.stage, Direction.from_letter(self.op))
        return None

    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.stage}{self.op}{self.batch}"
        letter = self.op[0]
        batch = "" if self.batch < 0 else str(self.batch)
        if self.is_send or self.is_recv:
            return f"{self.stage}{letter}{batch}{self.op[1]}{self.peer}"
        if self.op == "R":
            return f"{self.stage}R[{','.join(map(str, self.group))}]"
        return f"{self.stage}{self.op}"


_TEXT = re.compile(rf"^(\d+)([{COMPUTE_OPS}XVwrRO])(\d*)(?:([<>])(\d+))?(?:\[([\d,]*)\])?$")


def parse_action(text: str) -> Action:
    """Inverse of ``str(action)`` (message ids are not part of the text)."""
    match = _TEXT.match(text.strip())
    if not match:
        raise ProgramError(f"cannot parse action {text!r}; expected e.g. '2F0', '1F0>2', '2w<1', '2R[0,1]', '2O'")
    stage, letter, batch, arrow, peer, group = match.groups()
    batch_no = int(batch) if batch else -1
    if arrow:
        return Action(letter + arrow, int(stage), batch_no, int(peer))
    if letter == "R":
        return Action("R", int(stage), group=tuple(int(g) for g in group.split(",") if g))
    return Action(letter, int(stage), batch_no)


@dataclass
class Program:
    """Every rank's instruction list, and what the runtime needs around it.

    ``replicas[s]``: the ranks that hold stage s's weights of truth;
    ``shares[s]`` says which share each holds (0: the whole stage, i: shard
    i of a tensor-parallel gang); holders of one share are replicas that
    all-reduce it.  ``offloaded``: (rank, stage) pairs whose weights of
    truth the rank keeps in host memory (a schedule's host worker).
    ``gangs``: the items several ranks run jointly (their first member
    receives and sends for the gang).  ``stage_graph``: which stage feeds
    which; its one sink computes the loss.
    """

    num_ranks: int
    num_stages: int
    num_batches: int
    split_backward: bool
    actions: list[list[Action]]
    messages: list[Message]
    weight_worker: dict[Work, int]
    compute_worker: dict[Work, int]
    uses: list[dict[tuple, int]] = field(default_factory=list)
    stage_graph: StageGraph | None = None
    gangs: dict[Work, Gang] = field(default_factory=dict)
    shares: list[dict[int, int]] = field(default_factory=list)
    offloaded: set[tuple[int, int]] = field(default_factory=set)
    _flows_memo: dict = field(default_factory=dict, repr=False, compare=False)
    _reads_memo: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        self.stage_graph = as_stage_graph(self.num_stages, self.stage_graph)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions))

    def compute_order(self, rank: int) -> list[Work]:
        return [a.work for a in self.actions[rank] if a.is_compute]

    @property
    def loss_stage(self) -> int:
        """The stage whose output the loss takes: the stage graph's one sink."""
        return loss_stage(self.stage_graph)

    def loss_rank(self, batch: int, forward_only: bool = False) -> int:
        """The rank that evaluates the loss of micro-batch ``batch``: the one
        that runs the loss stage's first backward pass (its forward, in a
        step of forwards only), the first member of a gang."""
        direction = FORWARD if forward_only else first_backward(self.split_backward)
        return self.compute_worker[Work(batch, self.loss_stage, direction)]

    @property
    def replicas(self) -> list[tuple[int, ...]]:
        """Per stage, the ranks that hold its weights of truth (any share)."""
        return [tuple(sorted(shares)) for shares in self.shares]

    def members(self, work: Work) -> tuple[int, ...]:
        """The ranks that run ``work``: its gang, or its compute worker alone."""
        gang = self.gangs.get(work)
        return tuple(gang.workers) if gang is not None else (self.compute_worker[work],)

    def reduce_group(self, rank: int, stage: int) -> tuple[int, ...]:
        """The holders of the same share of ``stage`` as ``rank``: the replicas it all-reduces with."""
        shares = self.shares[stage]
        return tuple(sorted(h for h, share in shares.items() if share == shares[rank]))

    def reads(self, work: Work, rank: int) -> Reads:
        """What ``work`` reads on ``rank`` (whether local or received); a gang
        member other than the first gets everything from the gang."""
        if rank != self.compute_worker[work]:
            return Reads()
        reads = self._reads_memo.get((work, rank))
        if reads is None:
            reads = self._reads_memo[(work, rank)] = _reads(work, rank, self.flows(work), self.compute_worker,
                                                            self.stage_graph)
        return reads

    def flows(self, work: Work) -> tuple[Flow, ...]:
        """``work``'s dependencies and what each moves (:func:`unisched.dataflow.flows` over the stage graph)."""
        found = self._flows_memo.get(work)
        if found is None:
            found = self._flows_memo[work] = flows(
                work, self.num_stages, split_backward=self.split_backward, stage_graph=self.stage_graph
            )
        return found

    def groups(self) -> list[tuple[int, ...]]:
        """Distinct replica sets with more than one member, in a fixed order."""
        return sorted({g for s, shares in enumerate(self.shares) for r in shares
                       if len(g := self.reduce_group(r, s)) > 1})

    def gang_groups(self) -> list[tuple[int, ...]]:
        """Distinct gangs, in a fixed order."""
        return sorted({tuple(g.workers) for g in self.gangs.values()})


def loss_stage(graph: StageGraph) -> int:
    """The one sink of ``graph``; a graph with several cannot be trained with one loss."""
    if len(graph.sinks) != 1:
        raise ProgramError(
            f"the stage graph has {len(graph.sinks)} sinks, stages {list(graph.sinks)}, but the loss takes one "
            f"output; add a stage that joins them (it receives their outputs as its inputs, in stage order)"
        )
    return graph.sinks[0]


def topological_order(graph: StageGraph) -> list[int]:
    """The stages in an order where each comes after its predecessors (smallest first among the ready)."""
    return list(nx.lexicographical_topological_sort(graph.graph))


# ---------------------------------------------------------------------- compile
def compile_program(
    timeline: Timeline,
    *,
    num_stages: int | None = None,
    world_size: int | None = None,
    lookahead: int = 1,
    stage_graph: StageGraph | nx.DiGraph | None = None,
) -> Program:
    """Turn a schedule's Timeline into per-rank programs, checked by :func:`validate`.

    ``num_stages`` and ``world_size`` are what the caller has (stage modules,
    processes); a schedule made for other numbers is an error that says so.
    ``stage_graph``: the schedule's (e.g. a Simulation's), by default the
    Timeline's own; neither means a chain.
    """
    W, S, B = timeline.shape
    ranks = _ranks(timeline, world_size)
    if num_stages is not None and num_stages != S:
        raise ProgramError(
            f"the schedule has {S} stages but {num_stages} stage modules were given; "
            f"pass one nn.Module per stage or simulate with num_stages={num_stages}"
        )
    graph = schedule_graph(timeline, stage_graph)
    loss_stage(graph)
    if timeline.weight_shards:
        (stage, weight), holders = next(iter(sorted(timeline.weight_shards.items())))
        raise ProgramError(
            f"the schedule holds stage {stage}'s weights in shards on workers {list(holders)} (weight_shards, "
            f"weight worker {weight}), but the runtime keeps each stage whole on its weight worker; run it without "
            "weight_shards (e.g. fsdp with shard=false fetches whole stages) and simulate the sharded form"
        )
    split = bool(timeline.split_backward)
    compute, weight = _mapping(timeline, split)
    gangs = _gangs(timeline, compute, split, ranks)
    per_worker = timeline.per_worker().worker_orders()
    orders = [per_worker[r] for r in range(ranks)]
    weights = _Weights(compute, weight, gangs, ranks, S)

    builder = _Builder(ranks)
    program = Program(
        num_ranks=ranks,
        num_stages=S,
        num_batches=B,
        split_backward=split,
        actions=[builder.programs[r] for r in range(ranks)],
        messages=builder.messages,
        weight_worker=weights.weight,
        compute_worker=compute,
        stage_graph=graph,
        gangs=gangs,
        shares=weights.shares,
        offloaded=weights.offloaded,
    )
    builder.reduce_group = program.reduce_group
    routes = _Routes(program)
    for rank, stage, source in _fetches(orders, weights):
        builder.message("w", source, rank, stage, -1, ("w", stage))
    for rank in range(ranks):
        returns = _returns(orders[rank], rank, weights, split)
        for work in orders[rank]:
            sends = routes.sends_after(work) if compute[work] == rank else []
            builder.sends[(rank, work)] = [builder.message(*send) for send in sends]
            if work in returns:
                builder.sends[(rank, work)].append(
                    builder.message("r", rank, returns[work], work.stage, -1, ("r", work.stage)))
    returned = {m.stage for m in builder.messages if m.letter == "r"}
    builder.reduces = _reduce_points(orders, program, split, returned)
    builder.accepts = _accept_points(timeline, orders, builder.messages, ranks)
    for rank in range(ranks):
        builder.emit_rank(rank, orders[rank], program.reads, lookahead)
    for rank in range(ranks):
        for s in builder.reduces[rank].get(len(orders[rank]), []):
            builder.programs[rank].append(Action("R", s, group=program.reduce_group(rank, s)))
        for s in range(S):
            if rank in weights.shares[s]:
                builder.programs[rank].append(Action("O", s))
    program.uses = [_uses(program, r) for r in range(ranks)]
    validate(program)
    return program


def _ranks(timeline: Timeline, world_size: int | None) -> int:
    """How many ranks run the schedule.  Workers from ``world_size`` on may
    only hold weights: worker ``world_size + d`` is rank d's host memory
    (weights of truth offloaded there), so a schedule may have up to twice
    as many workers as ranks."""
    W = timeline.num_workers
    if world_size is None or world_size == W:
        return W
    busy = set(timeline.occupancy()[1].tolist())
    if world_size < W <= 2 * world_size and max(busy, default=0) < world_size:
        return world_size
    hosts = ""
    if W > world_size:
        hosts = (f" (workers {world_size}.. may only hold weights, as rank d's host memory {world_size} + d, "
                 f"but worker {max(busy)} computes)") if W <= 2 * world_size else ""
    raise ProgramError(
        f"the schedule is for {W} workers but the world has {world_size} rank{'s' * (world_size != 1)}{hosts}; "
        f"launch {W} processes (torchrun --nproc-per-node {W}) or simulate the strategy for {world_size} "
        f"worker{'s' * (world_size != 1)}"
    )


def schedule_timeline(schedule) -> tuple[Timeline, str, StageGraph | None]:
    """Accept a Simulation, anything with ``.simulate()`` (a plan), or a
    Timeline: its timeline, label and stage graph (None: the Timeline's own,
    which :func:`compile_program` reads)."""
    if hasattr(schedule, "simulate") and not hasattr(schedule, "timeline"):
        schedule = schedule.simulate()
    if isinstance(schedule, Timeline):
        return schedule, schedule.label, None
    timeline = getattr(schedule, "timeline", None)
    if not isinstance(timeline, Timeline):
        raise TypeError(
            f"schedule must be a unisched.Simulation, a plan with .simulate(), or a Timeline; got {type(schedule).__name__}"
        )
    strategy = getattr(schedule, "strategy", None)
    return timeline, getattr(strategy, "name", "") or timeline.label, getattr(schedule, "stage_graph", None)


def schedule_graph(timeline: Timeline, stage_graph: StageGraph | nx.DiGraph | None = None) -> StageGraph:
    """The stage graph a schedule was made for: ``stage_graph`` or the
    Timeline's own (they must agree when both are given); a chain when neither says."""
    S = timeline.num_stages
    own = getattr(timeline, "stage_graph", None)
    graph = as_stage_graph(S, stage_graph if stage_graph is not None else own)
    if stage_graph is not None and own is not None:
        theirs = as_stage_graph(S, own)
        if set(theirs.graph.edges) != set(graph.graph.edges):
            raise ProgramError(
                f"the timeline was made for the stage graph {sorted(theirs.graph.edges)} but stage_graph= gives "
                f"{sorted(graph.graph.edges)}; pass the schedule that made the timeline, or no stage_graph"
            )
    return graph


def _gangs(timeline: Timeline, compute: dict[Work, int], split: bool, ranks: int) -> dict[Work, Gang]:
    """The items a gang of ranks runs jointly.  Its first member is the
    item's compute worker, and the forward and the backward of a micro-batch
    run on one gang (it keeps the forward's graph for the backward, so a
    split backward or a backward elsewhere is refused by name)."""
    found: dict[Work, Gang] = {}
    for row in np.flatnonzero(timeline.gang >= 0).tolist():
        index = int(timeline.gang[row])
        members = tuple(timeline.gang_members[index])
        work = timeline.work(row)
        if members[0] != compute[work] or max(members) >= ranks:
            raise ProgramError(
                f"work item {work} runs on the gang of workers {list(members)}, whose first member must be its "
                f"compute worker {compute[work]} and every member one of the {ranks} ranks; list the gang that way"
            )
        found[work] = Gang(members, bool(timeline.gang_collective[index]))
    if found and split:
        first = min(found, key=lambda w: (w.batch, w.stage, int(w.direction)))
        raise ProgramError(
            f"work item {first} runs on the gang of workers {list(found[first].workers)}, but the schedule splits "
            f"its backwards into input and weight passes; a gang runs each backward in one pass, so schedule it "
            f"without split_backward"
        )
    for work, gang in found.items():
        if work.direction != FORWARD:
            continue
        back = Work(work.batch, work.stage, BACKWARD)
        if found.get(back) != gang:
            where = found[back].workers if back in found else (compute[back],)
            raise ProgramError(
                f"work item {work} runs on the gang of workers {list(gang.workers)} but its backward {back} on "
                f"{list(where)}; a gang keeps the forward's graph for its backward, so map both to the same gang"
            )
    return found


class _Weights:
    """Who holds the weights each rank computes with.

    A weight worker from the ranks' number on is the host memory of rank
    ``worker - ranks``: that rank holds the weights of truth there
    (``offloaded``).  A member of a tensor-parallel gang computes with its
    shard (:func:`unisched.dataflow.weight_share`), whose truth is held by
    the member at that position of the gang the weight worker runs the stage
    with (:func:`unisched.dataflow.share_holder`)."""

    def __init__(self, compute: dict[Work, int], weight: dict[Work, int], gangs: dict[Work, Gang], ranks: int,
                 num_stages: int):
        self.gangs = gangs
        self.weight = {work: _as_rank(worker, ranks) for work, worker in weight.items()}
        self.tensor_parallel = {
            (compute[work], work.stage): tuple(gang.workers) for work, gang in gangs.items() if gang.collective
        }
        self.shares: list[dict[int, int]] = [{} for _ in range(num_stages)]
        self.offloaded: set[tuple[int, int]] = set()
        self._held_by: dict[tuple[Work, int], tuple[int, int]] = {}
        on_device: set[tuple[int, int]] = set()
        for work in compute:
            for rank in gangs[work].workers if work in gangs else (compute[work],):
                holder, share = self._held_by[(work, rank)] = self._holder(work, rank)
                (self.offloaded if weight[work] >= ranks else on_device).add((holder, work.stage))
                if self.shares[work.stage].setdefault(holder, share) != share:
                    raise ProgramError(
                        f"rank {holder} would hold two shares of stage {work.stage}'s weights (for {work} on rank "
                        f"{rank}); give each tensor-parallel gang of a stage the same size and its own weight worker"
                    )
        mixed = self.offloaded & on_device
        if mixed:
            rank, stage = min(mixed)
            raise ProgramError(
                f"stage {stage}'s weights are held both by rank {rank} and by its host memory (worker "
                f"{rank + ranks}); give each stage's weights one place per rank"
            )

    def holder(self, work: Work, rank: int) -> tuple[int, int]:
        """(rank holding the weights of truth, share) that ``rank`` computes ``work`` with."""
        return self._held_by[(work, rank)]

    def holds(self, rank: int, work: Work) -> bool:
        """Whether ``rank`` holds the share of the weights it computes ``work`` with."""
        return self.shares[work.stage].get(rank, -1) == self.holder(work, rank)[1]

    def _holder(self, work: Work, rank: int) -> tuple[int, int]:
        worker, gang = self.weight[work], self.gangs.get(work)
        collective = gang is not None and gang.collective
        share = weight_share(gang.workers if gang is not None else (rank,), collective, rank)
        weight_gang = self.tensor_parallel.get((worker, work.stage)) if collective else None
        # a weight worker holding the whole stage (no gang) could serve the shards in a simulation;
        # here each rank holds one share of a stage, so the shards need a gang of holders
        if collective and (weight_gang is None or not shards_held(len(gang.workers), len(weight_gang))):
            raise ProgramError(
                f"work item {work} runs tensor-parallel on the gang {list(gang.workers)}, but its weight worker "
                f"{worker} runs stage {work.stage} on no gang of {len(gang.workers)}, so no rank holds shard {share} "
                f"of its weights; make the weight worker one that computes the stage with such a gang"
            )
        return share_holder(worker, share, weight_gang), share


def _mapping(timeline: Timeline, split: bool) -> tuple[dict[Work, int], dict[Work, int]]:
    """Compute and weight worker of every item, after checking each appears once."""
    _, S, B = timeline.shape
    compute: dict[Work, int] = {}
    weight: dict[Work, int] = {}
    for i in range(len(timeline)):
        work = timeline.work(i)
        if work in compute:
            raise ProgramError(f"work item {work} appears twice in the schedule (workers {compute[work]} and {timeline.worker[i]})")
        compute[work] = int(timeline.worker[i])
        weight[work] = int(timeline.weight_worker[i])
    missing = [w for w in Items(S, B, split) if w not in compute]
    if missing:
        raise ProgramError(
            f"the schedule leaves out {len(missing)} work item(s), e.g. {missing[0]}; every forward and backward "
            f"of every (stage, micro-batch) must run once"
        )
    return compute, weight


def _fetches(orders, weights: _Weights) -> Iterable[tuple[int, int, int]]:
    """(rank, stage, source): a rank that computes a stage without holding
    its share of the weights fetches them once, from the holder for its first item."""
    for rank, order in enumerate(orders):
        seen = set()
        for work in order:
            if work.stage in seen or weights.holds(rank, work):
                continue
            seen.add(work.stage)
            yield rank, work.stage, weights.holder(work, rank)[0]


def _returns(order, rank, weights: _Weights, split) -> dict[Work, int]:
    """Last item of each stage that returns a weight gradient
    (:func:`unisched.dataflow.returns_gradient`) from a rank that holds no
    replica of its share -> the holder its accumulated gradient goes to.
    A rank holding a replica computes with its own copy and all-reduces instead."""
    last = {}
    for work in order:
        if not weights.holds(rank, work) and returns_gradient(work.direction, rank, weights.holder(work, rank)[0], split):
            last[work.stage] = work
    return {work: weights.holder(work, rank)[0] for work in last.values()}


def _accept_points(timeline: Timeline, orders, messages: Sequence[Message], ranks: int) -> list[dict[int, list[Message]]]:
    """Where each weight worker posts the receive of a returned gradient:
    per rank, compute position -> the ``r`` messages to post before that
    item (``len(order)``: after the last).

    Where the simulator starts the return (the Timeline's
    ``weight_gradient`` transfer from that rank for that stage, the last if
    several): before the first item of the receiving rank that is still
    running then, so that the sender's copy and the receive buffer both
    live no longer than the transfer.  A Timeline without that transfer
    posts it after the receiving rank's last item."""
    tr = timeline.transfers
    rows = np.flatnonzero(tr.of_kind("weight_gradient"))
    sent_at: dict[tuple[int, int, int], float] = {}
    for src, dst, stage, start in zip(tr.src[rows].tolist(), tr.dst[rows].tolist(), tr.stage[rows].tolist(),
                                      tr.start[rows].tolist()):
        key = (_as_rank(src, ranks), _as_rank(dst, ranks), stage)
        sent_at[key] = max(sent_at.get(key, -np.inf), start)
    ends = _item_ends(timeline)
    points: list[dict[int, list[Message]]] = [defaultdict(list) for _ in orders]
    for m in messages:
        if m.letter != "r":
            continue
        order = orders[m.dst]
        at = sent_at.get((m.src, m.dst, m.stage))
        position = len(order) if at is None else sum(1 for _ in takewhile(lambda w: ends[w] <= at, order))
        points[m.dst][position].append(m)
    return points


def _as_rank(worker: int, ranks: int) -> int:
    """The rank a worker is: itself, or for a host worker the rank whose host memory it is."""
    return worker - ranks if worker >= ranks else worker


def _item_ends(timeline: Timeline) -> dict[Work, float]:
    return {timeline.work(i): float(end) for i, end in enumerate(timeline.end.tolist())}


def _reduce_points(orders, program: Program, split, returned: set[int]) -> list[dict[int, list[int]]]:
    """Where each replica posts each stage's gradient all-reduce: per rank,
    compute position -> stages to all-reduce right after that item (-1:
    before the first, len(order): at the end).

    The members of a replica set must post their all-reduces in one order;
    it is the order in which the stages' gradients become final across the
    set.  A rank posts a stage's all-reduce as soon as its own last
    gradient pass of that stage is done (so the reduction overlaps the rest
    of its backward) and every stage before it in that order is posted.
    Stages that receive returned gradients are all-reduced at the end, after
    the returns arrive."""
    grads = gradient_pass(split)
    points: list[dict[int, list[int]]] = [defaultdict(list) for _ in orders]
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for s, shares in enumerate(program.shares):
        for group in {program.reduce_group(r, s) for r in shares}:
            if len(group) > 1:
                groups[group].append(s)
    for group, stages in groups.items():
        last = {r: {} for r in group}
        for r in group:
            for i, work in enumerate(orders[r]):
                if work.direction == grads and work.stage in stages:
                    last[r][work.stage] = i
        canonical = sorted(stages, key=lambda s: (max(last[r].get(s, -1) for r in group), s))
        for r in group:
            position = -1
            for s in canonical:
                position = len(orders[r]) if s in returned else max(position, last[r].get(s, -1))
                points[r][position].append(s)
    return points


# ---------------------------------------------------------------------- data flow -> messages
_KIND_ORDER = {"activation": 0, "gradient": 1, "stash": 2, None: 3}


class _Routes:
    """The messages one mapping's data flow implies: every dependency
    (:func:`unisched.dataflow.flows` over the stage graph) whose two items run
    on different ranks becomes the messages that carry its data, posted after
    the item it waits for."""

    def __init__(self, program: Program):
        self.graph, self.compute = program.stage_graph, program.compute_worker
        self.waiting: dict[Work, list] = defaultdict(list)
        for work in Items(program.num_stages, program.num_batches, program.split_backward):
            for flow in program.flows(work):
                self.waiting[flow.source].append((work, flow))
        for waiting in self.waiting.values():
            waiting.sort(key=lambda pair: (_KIND_ORDER[pair[1].kind], pair[0].stage, int(pair[0].direction)))

    def sends_after(self, work: Work) -> list[tuple]:
        """(letter, src, dst, stage, batch, key, value) of each message ``work`` sends when it is done."""
        rank, b = self.compute[work], work.batch
        sends, reached = [], set()
        for consumer, flow in self.waiting[work]:
            dst, s = self.compute[consumer], consumer.stage
            if dst == rank or flow.kind is None:
                continue
            if flow.kind == "activation":
                if dst not in reached:
                    reached.add(dst)
                    sends.append(("F", rank, dst, s, b, output(work.stage, b), output(work.stage, b)))
            elif flow.kind == "gradient":
                key = gradient(s, b, work.stage)
                sends.append((Direction(consumer.direction).letter, rank, dst, s, b, key, key))
            elif work.direction == FORWARD:
                sends.extend(("X", rank, dst, s, b, stashed(s, b, p), output(p, b)) for p in self.graph.predecessors[s])
            else:
                sends.extend(self._follow_input_pass(work, dst))
        return sends

    def _follow_input_pass(self, work: Work, dst: int) -> list[tuple]:
        """The stash and output gradient a weight pass on ``dst`` takes from
        its input pass ``work``, less what ``dst`` already holds
        (:func:`unisched.dataflow.stash_needs`)."""
        rank, s, b = self.compute[work], work.stage, work.batch
        needs_inputs, needs_gradient = stash_needs(Work(b, s, BACKWARD_WEIGHT), dst, self.compute.__getitem__, self.graph)
        sends = []
        if needs_inputs:
            forward_here = self.compute[Work(b, s, FORWARD)] == rank
            for p in self.graph.predecessors[s]:
                sends.append(("X", rank, dst, s, b, stashed(s, b, p), output(p, b) if forward_here else stashed(s, b, p)))
        if needs_gradient:
            sends.append(("V", rank, dst, s, b, gradient(s, b), gradient(s, b)))
        return sends


def _reads(work: Work, rank: int, dependencies: Sequence[Flow], compute, graph: StageGraph) -> Reads:
    """What ``work`` reads on ``rank``, from its ``dependencies``
    (:func:`unisched.dataflow.flows`): its predecessors' outputs, its
    consumers' gradients and, where it runs away from the item that holds
    them, the stash."""
    b, s = work.batch, work.stage
    inputs: list[tuple] = []
    gradients: list[tuple] = []
    for flow in dependencies:
        source = flow.source
        if flow.kind == "activation":
            inputs.append(output(source.stage, b))
        elif flow.kind == "gradient":
            gradients.append(gradient(s, b, source.stage))
        elif flow.kind is None or compute[source] == rank:
            continue
        elif source.direction == FORWARD:
            inputs.extend(stashed(s, b, p) for p in graph.predecessors[s])
        else:
            needs_inputs, needs_gradient = stash_needs(work, rank, compute.__getitem__, graph)
            inputs.extend(stashed(s, b, p) if needs_inputs else output(p, b) for p in graph.predecessors[s])
            if not needs_gradient:
                gradients.extend(gradient(s, b, t) for t in graph.successors[s])
            else:
                gradients.append(gradient(s, b))
    return Reads(tuple(inputs), tuple(gradients))


def _produces(work: Work, graph: StageGraph, split: bool) -> set[tuple]:
    """The values ``work`` leaves on its rank: a forward its output; the first
    backward pass its gradient for each predecessor and, when a weight pass
    follows, the output gradient it summed."""
    b, s = work.batch, work.stage
    if work.direction == FORWARD:
        return {output(s, b)}
    if work.direction != first_backward(split):
        return set()
    made = {gradient(p, b, s) for p in graph.predecessors[s]}
    if split and graph.successors[s]:
        made.add(gradient(s, b))
    return made


class _Builder:
    def __init__(self, num_ranks: int):
        self.messages: list[Message] = []
        self.by_dst_key: dict[tuple[int, tuple], Message] = {}
        self.sends: dict[tuple[int, Work], list[Message]] = {}
        self.channel_count: dict[tuple[int, int], int] = defaultdict(int)
        self.programs: dict[int, list[Action]] = {r: [] for r in range(num_ranks)}
        self.reduces: list[dict[int, list[int]]] = []
        self.accepts: list[dict[int, list[Message]]] = []
        self.reduce_group = None

    def message(self, letter, src, dst, stage, batch, key, value=None) -> Message:
        """Messages are created in the order their sender posts them, so
        ``seq`` is the sender's order on the (src, dst) pair."""
        seq = self.channel_count[(src, dst)]
        self.channel_count[(src, dst)] += 1
        msg = Message(len(self.messages), letter, src, dst, stage, batch, key, seq, key if value is None else value)
        self.messages.append(msg)
        if letter not in "wr":
            self.by_dst_key[(dst, key)] = msg
        return msg

    def emit_rank(self, rank, order, reads, lookahead):
        """Lay out one rank's list: serves and fetches first, then each item
        with its receives posted ``lookahead`` items ahead and its sends
        right after, a returned gradient's receive where its return starts
        (``accepts``), then the remaining receives."""
        acts = self.programs[rank]
        channels: dict[int, list[Message]] = defaultdict(list)
        for m in self.messages:
            if m.dst == rank:
                channels[m.src].append(m)
        posted: set[int] = set()
        cursor = defaultdict(int)

        def post(msg: Message):
            queue = channels[msg.src]
            while msg.index not in posted:
                head = queue[cursor[msg.src]]
                cursor[msg.src] += 1
                posted.add(head.index)
                acts.append(Action(head.letter + "<", head.stage, head.batch, head.src, head.index))

        for m in self.messages:
            if m.src == rank and m.letter == "w":
                acts.append(Action("w>", m.stage, -1, m.dst, m.index))
        for m in self.messages:
            if m.dst == rank and m.letter == "w":
                post(m)

        def inbound_of(work: Work) -> list[Message]:
            return [self.by_dst_key[(rank, k)] for k in reads(work, rank).keys if (rank, k) in self.by_dst_key]

        reduces, accepts = self.reduces[rank], self.accepts[rank]
        for s in reduces.get(-1, []):
            acts.append(Action("R", s, group=self.reduce_group(rank, s)))
        for i, work in enumerate(order):
            for msg in accepts.get(i, []):
                post(msg)
            for ahead in order[i : i + 1 + lookahead]:
                for msg in inbound_of(ahead):
                    post(msg)
            acts.append(Action(Direction(work.direction).letter, work.stage, work.batch))
            for msg in self.sends[(rank, work)]:
                acts.append(Action(msg.letter + ">", msg.stage, msg.batch, msg.dst, msg.index))
            for s in reduces.get(i, []):
                acts.append(Action("R", s, group=self.reduce_group(rank, s)))
        for msg in accepts.get(len(order), []):
            post(msg)
        for src, queue in channels.items():
            if cursor[src] < len(queue):
                post(queue[-1])


def _uses(program: Program, rank: int) -> dict[tuple, int]:
    """How many actions on ``rank`` read each value, so the runtime can free it after the last."""
    counts: dict[tuple, int] = defaultdict(int)
    for action in program.actions[rank]:
        if action.is_compute:
            for key in program.reads(action.work, rank).keys:
                counts[key] += 1
        elif action.is_send and action.op[0] in "FBIXV":
            counts[program.messages[action.message].value] += 1
    return dict(counts)


# ---------------------------------------------------------------------- validate
def validate(program: Program) -> None:
    """Replay the programs (:func:`_replay`).  If no rank can move and some
    have actions left, that is a deadlock: raise with every stuck rank, the
    action it is stuck at and whom it waits for.  Also check that every
    item finds its inputs."""
    _check_local_inputs(program)
    position, waiting = _replay(program)
    stuck = [r for r in range(program.num_ranks) if position[r] < len(program.actions[r])]
    if stuck:
        blocked = {
            r: f"rank {r} is stuck at {program.actions[r][position[r]]}, waiting for {waiting[r]}" for r in stuck
        }
        raise DeadlockError(
            "the schedule would deadlock:\n  " + "\n  ".join(blocked.values()) + "\n" + _grid(program, position),
            blocked,
        )


def _replay(program: Program, passed: Callable[[int, int, Action, list[Message]], None] | None = None
            ) -> tuple[list[int], dict[int, str]]:
    """Replay every rank's list against the others: receives and sends are
    posted without blocking; an item waits until every message it reads has
    been sent; an all-reduce waits for the returned gradients of its stage
    and for every member of its group; the tail waits for every message to
    the rank.  ``passed(rank, index, action, waited)`` hears of each action
    as its rank passes it, with the messages it waited for.  Returns where
    each rank stopped (the length of its list if it finished) and, for a
    rank that did not, what it waits for."""
    W = program.num_ranks
    position = [0] * W
    sent: set[int] = set()
    inbound = {(m.dst, m.key): m for m in program.messages if m.letter not in "wr"}
    weights = {(m.dst, m.stage): m for m in program.messages if m.letter == "w"}
    to_rank: dict[int, list[Message]] = defaultdict(list)
    for m in program.messages:
        to_rank[m.dst].append(m)
    reached: dict[int, set[int]] = defaultdict(set)
    joined: dict[Work, set[int]] = defaultdict(set)
    waiting: dict[int, str] = {}

    def unsent(messages: Iterable[Message | None]) -> tuple[str | None, list[Message]]:
        waited = [m for m in messages if m is not None]
        for msg in waited:
            if msg.index not in sent:
                return f"{msg.kind} {_message_text(msg)} from rank {msg.src}", []
        return None, waited

    def blocker(rank: int, action: Action) -> tuple[str | None, list[Message]]:
        """Why ``action`` cannot run yet (None if it can), and the messages it waits for."""
        if action.is_compute:
            keys = program.reads(action.work, rank).keys
            reason, waited = unsent([weights.get((rank, action.stage)), *(inbound.get((rank, k)) for k in keys)])
            if reason is None and action.work in program.gangs:
                members = program.gangs[action.work].workers
                joined[action.work].add(rank)
                missing = [m for m in members if m not in joined[action.work]]
                if missing:
                    return f"ranks {missing} to join the gang item {action}", []
            return reason, waited
        if action.op == "R":
            reason, waited = unsent(m for m in to_rank[rank] if m.letter == "r" and m.stage == action.stage)
            if reason is None:
                reached[action.stage].add(rank)
            return reason, waited
        if action.op == "O":
            reason, waited = unsent(to_rank[rank])
            group = program.reduce_group(rank, action.stage)
            missing = [r for r in group if len(group) > 1 and r not in reached[action.stage]]
            if reason is None and missing:
                return f"ranks {missing} to join the all-reduce of stage {action.stage}", []
            return reason, waited
        return None, []

    progress = True
    while progress:
        progress = False
        for rank in range(W):
            acts = program.actions[rank]
            while position[rank] < len(acts):
                action = acts[position[rank]]
                reason, waited = blocker(rank, action)
                if reason is not None:
                    waiting[rank] = reason
                    break
                waiting.pop(rank, None)
                if action.is_send:
                    sent.add(action.message)
                if passed is not None:
                    passed(rank, position[rank], action, waited)
                position[rank] += 1
                progress = True
    return position, waiting


# ---------------------------------------------------------------------- when transfers are posted and settled
def post_points(program: Program, rank: int, lookahead: int) -> dict[int, int]:
    """Per receive of ``rank``'s list to post later than the list has it,
    the action index to post it at (before that action): a weight fetch
    ``lookahead`` items before the rank's first item of its stage (the
    simulator's prefetch, so its buffer is not held from the step's start),
    or earlier where a later receive from the same rank is posted earlier
    (receives are posted in the order their sender sends, which NCCL needs)."""
    actions = program.actions[rank]
    computes = [i for i, a in enumerate(actions) if a.is_compute]
    due = {}
    for i, action in enumerate(actions):
        if action.op == "w<":
            first = next((k for k, c in enumerate(computes) if actions[c].stage == action.stage), None)
            if first is not None:
                due[i] = max(i, computes[max(first - lookahead, 0)])
    by_source: dict[int, list[int]] = defaultdict(list)
    for i, action in enumerate(actions):
        if action.is_recv:
            by_source[program.messages[action.message].src].append(i)
    post_at = {}
    for indices in by_source.values():
        later = math.inf
        for i in reversed(indices):
            later = min(due.get(i, i), later)
            if later > i:
                post_at[i] = later
    return post_at


def settle_points(program: Program, lookahead: int, within: int) -> list[dict[int, list[int]]]:
    """Per rank, per index of one of its items: the sends (message indices)
    it can wait on right after that item, waiting for nothing but the
    transfer itself, which had the item's time to finish.

    A send qualifies after the first item of its sender that certainly
    begins after the receiver posted the matching receive (where
    :func:`post_points` puts it): the item waits for a message that the
    receiver sent after posting it, or that a rank sent after hearing so,
    and so on (vector clocks over :func:`_replay`).  Only sends that
    qualify within ``within`` items of their sender are listed.  Gloo marks
    a transfer complete only once it is waited on, and waiting on a send
    whose receive is not yet posted could deadlock a schedule that needs the
    sender to move on first; the runtime waits on the unlisted ones in a
    waiting thread."""
    W = program.num_ranks
    clock = [[-1] * W for _ in range(W)]  # clock[r][q]: the furthest action of rank q that rank r knows of
    at_send: dict[int, list[int]] = {}
    send_index: dict[int, int] = {}
    computes: list[list[int]] = [[] for _ in range(W)]
    knows: list[list[list[int]]] = [[] for _ in range(W)]  # per rank and item: its clock as the item begins

    def passed(rank: int, index: int, action: Action, waited: list[Message]) -> None:
        own = clock[rank]
        own[rank] = index
        for msg in waited:
            own[:] = map(max, own, at_send[msg.index])
        if action.is_send:
            at_send[action.message], send_index[action.message] = list(own), index
        elif action.is_compute:
            computes[rank].append(index)
            knows[rank].append(list(own))

    _replay(program, passed)
    receive_at: dict[int, int] = {}
    for rank in range(W):
        posted = post_points(program, rank, lookahead)
        for i, action in enumerate(program.actions[rank]):
            if action.is_recv:
                receive_at[action.message] = posted.get(i, i)
    points: list[dict[int, list[int]]] = [defaultdict(list) for _ in range(W)]
    for msg in program.messages:
        if msg.index not in send_index:
            continue
        items = computes[msg.src]
        first = bisect.bisect_right(items, send_index[msg.index])
        for k in range(first, min(first + within, len(items))):
            if knows[msg.src][k][msg.dst] >= receive_at[msg.index]:
                points[msg.src][items[k]].append(msg.index)
                break
    return [dict(p) for p in points]


def _check_local_inputs(program: Program) -> None:
    """Every value an item reads locally, and every item it depends on that
    runs on the same rank, must come earlier on that rank."""
    compute, graph, split = program.compute_worker, program.stage_graph, program.split_backward
    received = {(m.dst, m.key) for m in program.messages}
    for rank, acts in enumerate(program.actions):
        done: set[Work] = set()
        produced: set[tuple] = set()
        for position, action in enumerate(acts):
            if not action.is_compute:
                continue
            work = action.work
            for key in program.reads(work, rank).keys:
                if (rank, key) not in received and key not in produced:
                    raise ProgramError(
                        f"rank {rank} runs {action} (position {position}) before it has {_key_text(key)}, which "
                        f"this rank produces later; reorder worker {rank}'s items so dependencies come first\n"
                        + _grid(program, {rank: position})
                    )
            if work.direction != FORWARD:
                forward = Work(work.batch, work.stage, FORWARD)
                if compute[forward] == rank and forward not in done:
                    raise ProgramError(
                        f"rank {rank} runs {action} (position {position}) before its forward {forward}; "
                        f"reorder worker {rank}'s items\n" + _grid(program, {rank: position})
                    )
            for flow in program.flows(work):
                if compute[flow.source] == rank and flow.source not in done:
                    raise ProgramError(
                        f"rank {rank} runs {action} (position {position}) before {flow.source}, whose "
                        f"{flow.kind or 'completion'} it needs; reorder worker {rank}'s items\n" + _grid(program, {rank: position})
                    )
            done.add(work)
            produced |= _produces(work, graph, split)


def _key_text(key: tuple) -> str:
    kind, stage, batch = key[:3]
    if kind == "y":
        return f"the output of stage {stage} for micro-batch {batch}"
    if kind == "x":
        return f"stage {stage}'s input from stage {key[3]} for micro-batch {batch}"
    if len(key) == 4:
        return f"stage {key[3]}'s gradient of stage {stage}'s output for micro-batch {batch}"
    return f"the output gradient of stage {stage} for micro-batch {batch}"


def _message_text(msg: Message) -> str:
    batch = "" if msg.batch < 0 else str(msg.batch)
    return f"{msg.stage}{msg.letter}{batch}"


def _grid(program: Program, marks: Mapping[int, int] | Sequence[int]) -> str:
    """Every rank's program, the marked position of each in brackets."""
    marks = dict(enumerate(marks)) if isinstance(marks, (list, tuple)) else dict(marks)
    lines = []
    for rank, acts in enumerate(program.actions):
        cells = [f"[{a}]" if marks.get(rank) == i else str(a) for i, a in enumerate(acts)]
        lines.append(f"  rank {rank}: " + " ".join(cells))
    return "\n".join(lines)


def describe(program: Program) -> str:
    """A short summary: per rank, how many items, messages and stages of truth."""
    lines = []
    for rank, acts in enumerate(program.actions):
        items = sum(a.is_compute for a in acts)
        sends = sum(a.is_send for a in acts)
        recvs = sum(a.is_recv for a in acts)
        held = [s for s, group in enumerate(program.replicas) if rank in group]
        lines.append(f"rank {rank}: {items} items, {sends} sends, {recvs} receives, weights of stages {held}")
    return "\n".join(lines)


__all__ = [
    "Action",
    "Message",
    "Program",
    "ProgramError",
    "Reads",
    "compile_program",
    "describe",
    "loss_stage",
    "parse_action",
    "post_points",
    "schedule_graph",
    "schedule_timeline",
    "settle_points",
    "topological_order",
    "validate",
]
