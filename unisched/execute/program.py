"""Compile a schedule into one instruction list per rank, and check it.

A schedule says which worker runs each work item and in what order (the
Timeline's per-worker order) and whose weights it uses (the mapping's weight
worker).  Everything a rank must do follows from that, as in DESIGN.md §1:

- ``2F0``: run a work item (stage 2, forward, micro-batch 0; ``B``, ``I``,
  ``W`` for a backward and its input- and weight-gradient halves);
- a message is named after the item that consumes it, the same on both ends:
  ``2F0>2`` on rank 1 sends the input of 2F0 (the output of 1F0) to rank 2,
  and ``2F0<1`` on rank 2 posts its receive; ``1B0>1`` / ``1B0<2`` carry the
  gradient 1B0 starts from (2B0's input gradient), ``I`` the same for a split
  backward;
- ``1X0>3`` / ``1X0<0``: the stash, stage 1's input of micro-batch 0, sent to
  the rank that runs its backward elsewhere (it recomputes the forward);
- ``1V0>3`` / ``1V0<2``: the output gradient a weight-gradient pass needs when
  it runs on another rank than its input-gradient pass;
- ``2w>3`` / ``2w<1``: serve / fetch stage 2's weights;
- ``2r>1`` / ``2r<3``: return stage 2's accumulated gradient to its weight
  worker / accept it there;
- ``2R[0,1]``: post the all-reduce of stage 2's gradient among its replicas
  0 and 1 (as soon as this rank's gradient of stage 2 is final, so that it
  overlaps the rest of the backward; awaited at the end);
- ``2O``: step the optimizer of stage 2 (on its weight workers).

Sends are posted right after the work that produces them; receives are
posted ahead of use (weights at the start, activations a few items early),
in the order the sender sends on that pair of ranks, which is what NCCL
needs to match them.  :func:`validate` replays every rank's list against the
others and reports the ranks and actions of any deadlock before a single
byte moves.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from unisched.errors import DeadlockError, UniSchedError
from unisched.timeline import Timeline
from unisched.work import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Direction, Work


class ProgramError(UniSchedError, ValueError):
    """A schedule that cannot be compiled into programs for these ranks and stages."""


COMPUTE_OPS = "FBIW"
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
    or gradient).  ``key`` names the value on both ends: ``("x", s, b)`` stage
    s's input of micro-batch b, ``("g", s, b)`` the gradient of stage s's
    output, ``("w", s)`` weights, ``("r", s)`` a returned gradient.
    ``seq`` is its position among the messages ``src`` sends to ``dst``."""

    index: int
    letter: str
    src: int
    dst: int
    stage: int
    batch: int
    key: tuple
    seq: int = 0

    @property
    def kind(self) -> str:
        return MESSAGE_KINDS[self.letter]


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


_TEXT = re.compile(r"^(\d+)([FBIWXVwrRO])(\d*)(?:([<>])(\d+))?(?:\[([\d,]*)\])?$")


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

    ``replicas[s]``: the weight workers of stage s (they hold its weights of
    truth; several means replicas, all-reduced).  ``keep_graph``: items whose
    forward keeps its autograd graph for a backward on the same rank.
    """

    num_ranks: int
    num_stages: int
    num_batches: int
    split_backward: bool
    actions: list[list[Action]]
    messages: list[Message]
    replicas: list[tuple[int, ...]]
    weight_worker: dict[Work, int]
    compute_worker: dict[Work, int]
    uses: list[dict[tuple, int]] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions))

    def compute_order(self, rank: int) -> list[Work]:
        return [a.work for a in self.actions[rank] if a.is_compute]

    def loss_rank(self, batch: int) -> int:
        """The rank that evaluates the loss of micro-batch ``batch``."""
        last = BACKWARD_INPUT if self.split_backward else BACKWARD
        return self.compute_worker[Work(batch, self.num_stages - 1, last)]

    def groups(self) -> list[tuple[int, ...]]:
        """Distinct replica sets with more than one member, in a fixed order."""
        return sorted({g for g in self.replicas if len(g) > 1})


# ---------------------------------------------------------------------- compile
def compile_program(
    timeline: Timeline,
    *,
    num_stages: int | None = None,
    world_size: int | None = None,
    lookahead: int = 1,
) -> Program:
    """Turn a schedule's Timeline into per-rank programs, checked by :func:`validate`.

    ``num_stages`` and ``world_size`` are what the caller has (stage modules,
    processes); a schedule made for other numbers is an error that says so.
    """
    W, S, B = timeline.shape
    if world_size is not None and world_size != W:
        raise ProgramError(
            f"the schedule is for {W} workers but the world has {world_size} ranks; "
            f"launch {W} processes (torchrun --nproc-per-node {W}) or simulate the strategy for {world_size} workers"
        )
    if num_stages is not None and num_stages != S:
        raise ProgramError(
            f"the schedule has {S} stages but {num_stages} stage modules were given; "
            f"pass one nn.Module per stage or simulate with num_stages={num_stages}"
        )
    split = bool(timeline.split_backward)
    orders = [timeline.worker_order(w) for w in range(W)]
    compute, weight = _mapping(timeline, split)

    replicas = [tuple(sorted({weight[w] for w in compute if w.stage == s})) for s in range(S)]
    builder = _Builder(W)
    builder.replicas = replicas
    for rank, stage, source in _fetches(orders, weight, replicas):
        builder.message("w", source, rank, stage, -1, ("w", stage))
    for rank in range(W):
        returns = _returns(orders[rank], rank, weight, replicas, split)
        for work in orders[rank]:
            for letter, dst, key in _sends_after(work, rank, compute, S, split):
                builder.message(letter, rank, dst, key[1], key[2], key)
            if work in returns:
                builder.message("r", rank, returns[work], work.stage, -1, ("r", work.stage))
        builder.returns[rank] = returns
    returned = {m.stage for m in builder.messages if m.letter == "r"}
    builder.reduces = _reduce_points(orders, replicas, split, returned)
    for rank in range(W):
        builder.emit_rank(rank, orders[rank], compute, S, split, lookahead)
    for rank in range(W):
        for s in builder.reduces[rank].get(len(orders[rank]), []):
            builder.programs[rank].append(Action("R", s, group=replicas[s]))
        for s in range(S):
            if rank in replicas[s]:
                builder.programs[rank].append(Action("O", s))

    program = Program(
        num_ranks=W,
        num_stages=S,
        num_batches=B,
        split_backward=split,
        actions=[builder.programs[r] for r in range(W)],
        messages=builder.messages,
        replicas=replicas,
        weight_worker=weight,
        compute_worker=compute,
    )
    program.uses = [_uses(program, r) for r in range(W)]
    validate(program)
    return program


def _mapping(timeline: Timeline, split: bool) -> tuple[dict[Work, int], dict[Work, int]]:
    """Compute and weight worker of every item, after checking each appears once."""
    W, S, B = timeline.shape
    compute: dict[Work, int] = {}
    weight: dict[Work, int] = {}
    for i in range(len(timeline)):
        work = timeline.work(i)
        if work in compute:
            raise ProgramError(f"work item {work} appears twice in the schedule (workers {compute[work]} and {timeline.worker[i]})")
        compute[work] = int(timeline.worker[i])
        weight[work] = int(timeline.weight_worker[i])
        if not (0 <= compute[work] < W and 0 <= weight[work] < W):
            raise ProgramError(f"work item {work} is mapped to workers outside 0..{W - 1}")
    dirs = (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT) if split else (FORWARD, BACKWARD)
    expected = [Work(b, s, d) for b in range(B) for s in range(S) for d in dirs]
    missing = [w for w in expected if w not in compute]
    if missing:
        raise ProgramError(
            f"the schedule leaves out {len(missing)} work item(s), e.g. {missing[0]}; every forward and backward "
            f"of every (stage, micro-batch) must run once"
        )
    unexpected = sorted(set(compute) - set(expected), key=lambda w: (w.batch, w.stage, int(w.direction)))
    if unexpected:
        names = "/".join(Direction(d).name for d in dirs)
        raise ProgramError(
            f"the schedule has {len(unexpected)} work item(s) outside its {S} stage(s) x {B} micro-batch(es) x "
            f"{names}, e.g. {unexpected[0]} (split_backward={split}); remove them"
        )
    return compute, weight


def _fetches(orders, weight, replicas) -> Iterable[tuple[int, int, int]]:
    """(rank, stage, source): a rank that computes a stage it holds no replica
    of fetches its weights once, from the weight worker of its first item."""
    for rank, order in enumerate(orders):
        seen = set()
        for work in order:
            if work.stage in seen or rank in replicas[work.stage]:
                continue
            seen.add(work.stage)
            yield rank, work.stage, weight[work]


def _returns(order, rank, weight, replicas, split) -> dict[Work, int]:
    """Last gradient-producing item of each stage this rank holds no replica
    of -> the weight worker (of that item) its accumulated gradient returns to."""
    grads = BACKWARD_WEIGHT if split else BACKWARD
    last = {}
    for work in order:
        if work.direction == grads and rank not in replicas[work.stage]:
            last[work.stage] = work
    return {work: weight[work] for work in last.values()}


def _reduce_points(orders, replicas, split, returned: set[int]) -> list[dict[int, list[int]]]:
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
    grads = BACKWARD_WEIGHT if split else BACKWARD
    points: list[dict[int, list[int]]] = [defaultdict(list) for _ in orders]
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for s, group in enumerate(replicas):
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


def _sends_after(work: Work, rank: int, compute, S: int, split: bool) -> list[tuple[str, int, tuple]]:
    """What ``work`` sends when it finishes on ``rank``: (letter, dst, key)."""
    b, s, d = work.batch, work.stage, Direction(work.direction)
    back = BACKWARD_INPUT if split else BACKWARD
    sends = []
    if d is FORWARD:
        if s + 1 < S and compute[Work(b, s + 1, FORWARD)] != rank:
            sends.append(("F", compute[Work(b, s + 1, FORWARD)], ("x", s + 1, b)))
        backward_rank = compute[Work(b, s, back)]
        if s > 0 and backward_rank != rank:
            sends.append(("X", backward_rank, ("x", s, b)))
    elif d is back:
        if s > 0 and compute[Work(b, s - 1, back)] != rank:
            sends.append((d.letter, compute[Work(b, s - 1, back)], ("g", s - 1, b)))
        if split:
            weight_rank = compute[Work(b, s, BACKWARD_WEIGHT)]
            if weight_rank != rank:
                if s > 0 and compute[Work(b, s, FORWARD)] != weight_rank:
                    sends.append(("X", weight_rank, ("x", s, b)))
                if s + 1 < S and compute[Work(b, s + 1, BACKWARD_INPUT)] != weight_rank:
                    sends.append(("V", weight_rank, ("g", s, b)))
    return sends


def inputs_of(work: Work, rank: int, compute, S: int, split: bool) -> list[tuple]:
    """Keys of the values ``work`` reads on ``rank`` (whether local or received):
    ``("x", s, b)`` stage s's input, ``("g", s, b)`` the gradient of its output."""
    b, s, d = work.batch, work.stage, Direction(work.direction)
    back = BACKWARD_INPUT if split else BACKWARD
    if d is FORWARD:
        return [("x", s, b)] if s > 0 else []
    if d is back:
        keys = []
        if s > 0 and compute[Work(b, s, FORWARD)] != rank:
            keys.append(("x", s, b))
        if s + 1 < S:
            keys.append(("g", s, b))
        return keys
    if compute[Work(b, s, BACKWARD_INPUT)] == rank:
        return []
    keys = [("x", s, b)] if s > 0 else []
    if s + 1 < S:
        keys.append(("g", s, b))
    return keys


class _Builder:
    def __init__(self, num_ranks: int):
        self.messages: list[Message] = []
        self.by_dst_key: dict[tuple[int, tuple], Message] = {}
        self.by_send: dict[tuple, Message] = {}
        self.channel_count: dict[tuple[int, int], int] = defaultdict(int)
        self.programs: dict[int, list[Action]] = {r: [] for r in range(num_ranks)}
        self.returns: dict[int, dict[Work, int]] = {}
        self.reduces: list[dict[int, list[int]]] = []
        self.replicas: list[tuple[int, ...]] = []

    def message(self, letter, src, dst, stage, batch, key) -> Message:
        """Messages are created in the order their sender posts them, so
        ``seq`` is the sender's order on the (src, dst) pair."""
        seq = self.channel_count[(src, dst)]
        self.channel_count[(src, dst)] += 1
        msg = Message(len(self.messages), letter, src, dst, stage, batch, key, seq)
        self.messages.append(msg)
        if letter not in "wr":
            self.by_dst_key[(dst, key)] = msg
        self.by_send[(src, dst, letter, key)] = msg
        return msg

    def emit_rank(self, rank, order, compute, S, split, lookahead):
        """Lay out one rank's list: serves and fetches first, then each item
        with its receives posted ``lookahead`` items ahead and its sends
        right after, then the remaining receives (returned gradients)."""
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
            keys = inputs_of(work, rank, compute, S, split)
            return [self.by_dst_key[(rank, k)] for k in keys if (rank, k) in self.by_dst_key]

        returns = self.returns.get(rank, {})
        reduces = self.reduces[rank]
        for s in reduces.get(-1, []):
            acts.append(Action("R", s, group=self.replicas[s]))
        for i, work in enumerate(order):
            for ahead in order[i : i + 1 + lookahead]:
                for msg in inbound_of(ahead):
                    post(msg)
            acts.append(Action(Direction(work.direction).letter, work.stage, work.batch))
            for letter, dst, key in _sends_after(work, rank, compute, S, split):
                msg = self.by_send[(rank, dst, letter, key)]
                acts.append(Action(letter + ">", msg.stage, msg.batch, dst, msg.index))
            if work in returns:
                msg = self.by_send[(rank, returns[work], "r", ("r", work.stage))]
                acts.append(Action("r>", msg.stage, -1, msg.dst, msg.index))
            for s in reduces.get(i, []):
                acts.append(Action("R", s, group=self.replicas[s]))
        for src, queue in channels.items():
            if cursor[src] < len(queue):
                post(queue[-1])


def _uses(program: Program, rank: int) -> dict[tuple, int]:
    """How many actions on ``rank`` read each value, so the runtime can free it after the last."""
    compute, S, split = program.compute_worker, program.num_stages, program.split_backward
    counts: dict[tuple, int] = defaultdict(int)
    for action in program.actions[rank]:
        if action.is_compute:
            for key in inputs_of(action.work, rank, compute, S, split):
                counts[key] += 1
        elif action.is_send and action.op[0] in "FBIXV":
            counts[program.messages[action.message].key] += 1
    return dict(counts)


# ---------------------------------------------------------------------- validate
def validate(program: Program) -> None:
    """Replay the programs: receives and sends are posted without blocking;
    an item waits until every message it reads has been sent; an all-reduce
    waits for every member of its group; the tail waits for every message
    to the rank.  If no rank can move and some have actions left, that is a
    deadlock: raise with every stuck rank, the action it is stuck at and
    whom it waits for.  Also check that every item finds its inputs."""
    _check_local_inputs(program)
    W = program.num_ranks
    position = [0] * W
    sent: set[int] = set()
    inbound = {(m.dst, m.key): m for m in program.messages if m.letter not in "wr"}
    weights = {(m.dst, m.stage): m for m in program.messages if m.letter == "w"}
    to_rank: dict[int, list[Message]] = defaultdict(list)
    for m in program.messages:
        to_rank[m.dst].append(m)
    reached: dict[int, set[int]] = defaultdict(set)
    waiting: dict[int, str] = {}

    def blocker(rank: int, action: Action) -> str | None:
        if action.is_compute:
            needed = [weights.get((rank, action.stage))]
            for key in inputs_of(action.work, rank, program.compute_worker, program.num_stages, program.split_backward):
                needed.append(inbound.get((rank, key)))
            for msg in needed:
                if msg is not None and msg.index not in sent:
                    return f"{msg.kind} {_message_text(msg)} from rank {msg.src}"
        elif action.op == "R":
            for msg in to_rank[rank]:
                if msg.letter == "r" and msg.stage == action.stage and msg.index not in sent:
                    return f"{msg.kind} {_message_text(msg)} from rank {msg.src}"
            reached[action.stage].add(rank)
        elif action.op == "O":
            for msg in to_rank[rank]:
                if msg.index not in sent:
                    return f"{msg.kind} {_message_text(msg)} from rank {msg.src}"
            group = program.replicas[action.stage]
            missing = [r for r in group if len(group) > 1 and r not in reached[action.stage]]
            if missing:
                return f"ranks {missing} to join the all-reduce of stage {action.stage}"
        return None

    progress = True
    while progress:
        progress = False
        for rank in range(W):
            acts = program.actions[rank]
            while position[rank] < len(acts):
                action = acts[position[rank]]
                reason = blocker(rank, action)
                if reason is not None:
                    waiting[rank] = reason
                    break
                waiting.pop(rank, None)
                if action.is_send:
                    sent.add(action.message)
                position[rank] += 1
                progress = True
    stuck = [r for r in range(W) if position[r] < len(program.actions[r])]
    if stuck:
        blocked = {
            r: f"rank {r} is stuck at {program.actions[r][position[r]]}, waiting for {waiting[r]}" for r in stuck
        }
        raise DeadlockError(
            "the schedule would deadlock:\n  " + "\n  ".join(blocked.values()) + "\n" + _grid(program, position),
            blocked,
        )


def _check_local_inputs(program: Program) -> None:
    """Every value an item reads locally must have been produced earlier on that rank."""
    compute, S, split = program.compute_worker, program.num_stages, program.split_backward
    received = {(m.dst, m.key) for m in program.messages}
    for rank, acts in enumerate(program.actions):
        done: set[Work] = set()
        produced: set[tuple] = set()
        for position, action in enumerate(acts):
            if not action.is_compute:
                continue
            work = action.work
            for key in inputs_of(work, rank, compute, S, split):
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
            if work.direction == BACKWARD_WEIGHT:
                first = Work(work.batch, work.stage, BACKWARD_INPUT)
                if compute[first] == rank and first not in done:
                    raise ProgramError(f"rank {rank} runs {action} before {first}; reorder worker {rank}'s items")
            done.add(work)
            b, s, d = work.batch, work.stage, Direction(work.direction)
            if d is FORWARD and s + 1 < S:
                produced.add(("x", s + 1, b))
            if d is FORWARD:
                produced.add(("x", s, b))
            if d in (BACKWARD, BACKWARD_INPUT) and s > 0:
                produced.add(("g", s - 1, b))
            if d is BACKWARD_INPUT:
                produced.add(("x", s, b))
                produced.add(("g", s, b))


def _key_text(key: tuple) -> str:
    if key[0] == "x":
        return f"the input of stage {key[1]} for micro-batch {key[2]}"
    return f"the output gradient of stage {key[1]} for micro-batch {key[2]}"


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
    "compile_program",
    "describe",
    "parse_action",
    "validate",
]
