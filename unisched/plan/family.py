"""Family search: every registered strategy and parameter setting that fits
the shape, simulated with the plan's costs and limits.

A member that cannot run (memory too small for its mapping, a deadlock, more
stages on a worker than allowed) is dropped with the reason.  The kept ones
are ranked by latency, and the Pareto front of latency, peak activation
memory and traffic is marked.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, TextIO

import numpy as np

from unisched.errors import UniSchedError
from unisched.policies.grammar import label_of, parse_label
from unisched.simulate import simulate
from unisched.simulate.simulation import Simulation
from unisched.simulate.priorities import BackwardFirst
from unisched.strategy import Strategy
from unisched.work import FORWARD, ComputeAndWeightWorkers, Work

from unisched.plan.problem import PlanProblem, rows_of
from unisched.plan.schedule import Schedule


NOT_SIMULATED = "not simulated: the time limit was spent on the members before it"


@dataclass(eq=False)
class Member:
    """One strategy setting and what simulating it gave (or why it was dropped)."""

    label: str
    strategy: Strategy | None
    simulation: Simulation | None = None
    reason: str = ""
    pareto: bool = False
    memory_limit: float | None = None
    """A limit this variant runs under that the problem does not impose (a memory/latency trade-off)."""

    @property
    def feasible(self) -> bool:
        return self.simulation is not None and not self.reason

    @property
    def latency(self) -> float:
        return self.simulation.latency if self.simulation is not None else float("inf")

    def measures(self) -> dict:
        return measures(self.simulation)

    def schedule(self, problem: PlanProblem) -> Schedule:
        """Its simulated run as fixed workers and per-worker orders (under its own memory limit, if any)."""
        t = self.simulation.timeline
        rows = rows_of(problem, t)
        if self.memory_limit is not None:
            problem = replace(problem, memory_limit=self.memory_limit)
        return Schedule.from_starts(problem, t.worker[rows], t.weight_worker[rows], t.start[rows], name=self.label)


@dataclass(eq=False)
class FamilyResult:
    members: list[Member] = field(default_factory=list)

    @property
    def feasible(self) -> list[Member]:
        return sorted((m for m in self.members if m.feasible), key=lambda m: m.latency)

    @property
    def dropped(self) -> list[Member]:
        return [m for m in self.members if not m.feasible]

    @property
    def best(self) -> Member | None:
        kept = self.feasible
        return kept[0] if kept else None


def measures(sim: Simulation) -> dict:
    """Latency, bubble, peak activations per worker (max) and number of transfers."""
    stats = sim.worker_stats()
    transfers = sim.timeline.transfers
    return {
        "latency": float(sim.latency),
        "bubble": float(sim.bubble_fraction),
        "peak_activations": float(max(stats["max_activation_storage"], default=0)),
        "traffic": int(len(transfers)),
    }


def registry_members(problem: PlanProblem, only: str | None = None) -> Iterable[tuple[str, Strategy | None, str]]:
    """(label, strategy, reason) for every registered setting that fits the shape."""
    from unisched import policies

    W, S, B = problem.shape
    if only is not None:
        name, params = parse_label(only)
        entry = policies.entry(name)
        yield label_of(entry.name, params), policies.get(entry.name, W, S, B, **params), ""
        return
    for name, params in policies.variants(W, S, B):
        label = label_of(name, params)
        try:
            yield label, policies.get(name, W, S, B, **params), ""
        except UniSchedError as error:
            yield label, None, str(error)


def constructed_members(problem: PlanProblem, whole: bool = False) -> list[tuple[str, Strategy, str]]:
    """Mappings built here rather than taken from the registry, as further starting points (with
    ``whole``, also those where a backward runs away from its forward: for the mapping search of
    the whole scheme):

    - stages dealt round-robin (always feasible);
    - with as many workers as stages, micro-batches alternating between the pipeline and its
      reverse (every worker then keeps long-lived stashes of early stages for half the
      micro-batches and short-lived ones of late stages for the others);
    - when a micro-batch's stashes need k > 1 workers
      (:meth:`~unisched.plan.problem.PlanProblem.stash_workers`: all of each stash, since the
      whole scheme's search keeps a split backward's I and W on one worker), its backward folded
      over k workers: micro-batch b runs every forward and the backward passes of its last stages
      on worker b mod W, and the rest of its backward passes in k - 1 more groups, each ``shift``
      workers on from the last (one gradient transfer per group, no activation transfer).  This
      is the shape of the shortest schedules the whole-scheme search finds on W = S = 4, B = 8,
      memory 2, comm 1, and seeding it there gives shorter plans within 10 s
      (docs/planner-measurements.md); the heuristic search of large steps, where it was
      not measured, does not ask for it."""
    W, S, B = problem.shape
    priority = BackwardFirst(S, B)

    def member(label: str, compute_of) -> tuple[str, Strategy, str]:
        def map_arrays(batch, stage, direction):
            return compute_of(np.asarray(batch), np.asarray(stage), np.asarray(direction)), np.asarray(stage) % W

        def mapping(work: Work) -> ComputeAndWeightWorkers:
            compute, weight = map_arrays(np.array([work.batch]), np.array([work.stage]),
                                         np.array([int(work.direction)]))
            return ComputeAndWeightWorkers(int(compute[0]), int(weight[0]))

        return label, Strategy(mapping, name=label, priority=priority, map_arrays=map_arrays,
                               shape=problem.shape), ""

    members = [member("stages round-robin", lambda batch, stage, direction: stage % W)]
    K = problem.max_stages_per_worker
    if W == S and W > 1 and B > 1 and (K is None or K >= 2):
        members.append(member("bidirectional",
                              lambda batch, stage, direction: np.where(batch % 2 == 0, stage, S - 1 - stage)))
    k = problem.stash_workers()
    if whole and k > 1 and (K is None or K >= S):
        for shift in range(1, W):
            def folded(batch, stage, direction, shift=shift):
                group = np.where(direction == FORWARD, 0, (S - 1 - stage) * k // S)  # 0: with the forwards
                return (batch + group * shift) % W
            members.append(member(f"backward folded over {k} workers (shift {shift})", folded))
    return members


def search_family(
    problem: PlanProblem,
    members: Iterable[tuple[str, Strategy | None, str]] | None = None,
    *,
    progress: TextIO | None = None,
    memory_variants: bool = False,
    deadline: float | None = None,
) -> FamilyResult:
    """Simulate each member with the problem's costs and limits; drop the ones that cannot run.

    With ``memory_variants`` and no memory limit in the problem, each member is
    also simulated under tighter limits (powers of two below its peak), which
    fills in the latency / memory Pareto front.  Past ``deadline`` (a
    ``time.perf_counter()`` value) the members left are dropped unsimulated,
    saying so; the first member is always simulated.
    """
    candidates = list(members if members is not None else registry_members(problem))
    result = FamilyResult()
    for index, (label, strategy, reason) in enumerate(candidates):
        if progress is not None:
            _progress(progress, index, len(candidates), label)
        if deadline is not None and index and time.perf_counter() > deadline and not reason:
            reason = NOT_SIMULATED
        member = Member(label, strategy, reason=reason)
        if strategy is not None and not reason:
            _evaluate(problem, member)
        result.members.append(member)
        if memory_variants and problem.memory_limit is None and member.feasible:
            result.members += _memory_variants(problem, member)
    if progress is not None:
        _progress(progress, len(candidates), len(candidates), "done")
        if _is_terminal(progress):
            progress.write("\n")
        progress.flush()
    _mark_pareto(result.feasible)
    return result


def _memory_variants(problem: PlanProblem, member: Member) -> list[Member]:
    """The member under tighter activation limits (1, 2, 4, ... stashes);
    none when the costs count memory in bytes, where such limits mean nothing."""
    if problem.costs.has_sizes:
        return []
    peak = member.measures()["peak_activations"]
    need = problem.min_memory_free()
    limits = [2.0 ** k for k in range(8) if need <= 2.0 ** k < peak]
    variants = []
    for limit in limits:
        variant = Member(f"{member.label} [memory {limit:g}]", member.strategy, memory_limit=limit)
        _evaluate(problem, variant)
        if variant.feasible and variant.measures()["peak_activations"] < peak:
            variants.append(variant)
    return variants


def other_backward(strategy: Strategy, split_backward: bool) -> str:
    """Why a strategy cannot serve a step with this backward form ("" if it can): its fixed
    order is written for the other one."""
    if strategy.worker_orders is None or strategy.split_backward == split_backward:
        return ""
    return "its fixed order needs " + ("a split backward (--backward-input/--backward-weight)"
                                       if strategy.split_backward else "an unsplit backward")


def held_in_shards(strategy: Strategy) -> str:
    """Why the planner cannot take a strategy that holds weights in shards
    ("" if it holds whole stages): its CP-SAT models, bounds and plan files
    know whole stages on one weight worker only."""
    if strategy.weight_shards is None:
        return ""
    return ("it holds weights in shards (weight_shards), which plans do not represent: the planner's models and plan "
            "files know whole stages on one weight worker; simulate it with `unisched simulate`")


def unplannable(strategy: Strategy, split_backward: bool) -> str:
    """Why the planner cannot take a strategy at all ("" if it can): weights
    held in shards, or a fixed order for the other backward form."""
    return held_in_shards(strategy) or other_backward(strategy, split_backward)


def _evaluate(problem: PlanProblem, member: Member) -> None:
    strategy = member.strategy
    W, S, B = problem.shape
    member.reason = unplannable(strategy, problem.split_backward)
    if member.reason:
        return
    user = problem.memory_limit if member.memory_limit is None else member.memory_limit
    # a strategy's own limit counts stashes; the problem's is in bytes when the costs give sizes, where
    # simulate takes it in place of the strategy's (none given: the strategy keeps its own, in stashes)
    limit = user if problem.costs.has_sizes else _limit(user, strategy.memory_limit)
    try:
        sim = simulate(W, S, B, strategy, costs=problem.costs, memory_limit=limit,
                       split_backward=problem.split_backward)
    except UniSchedError as error:
        member.reason = str(error).splitlines()[0]
        return
    K = problem.max_stages_per_worker
    if K is not None:
        held = stages_held(sim)
        worst = int(np.argmax(held))
        if held[worst] > K:
            member.reason = f"worker {worst} holds the weights of {held[worst]} stages, more than {K}"
            return
    member.simulation = sim


def stages_held(sim: Simulation) -> np.ndarray:
    """Stages whose weights each worker holds: those it owns and those it computes."""
    t = sim.timeline
    held = np.zeros((t.num_workers, t.num_stages), dtype=bool)
    held[t.worker, t.stage] = True
    held[t.weight_worker, t.stage] = True
    return held.sum(axis=1)


def _limit(user: float | None, own) -> float | None:
    if user is None:
        return own
    if own is None:
        return user
    return np.minimum(np.asarray(own, dtype=float), user).tolist() if np.ndim(own) else min(float(own), user)


def _mark_pareto(members: list[Member]) -> None:
    measures = [m.measures() for m in members]
    points = [(m.latency, x["peak_activations"], x["traffic"]) for m, x in zip(members, measures)]
    for m, p in zip(members, points):
        m.pareto = not any(q != p and all(a <= b for a, b in zip(q, p)) for q in points)


def _progress(stream: TextIO, done: int, total: int, label: str) -> None:
    """A bar redrawn in place on a terminal; elsewhere (a log, a pipe) one line at the start and one at the end."""
    if _is_terminal(stream):
        width = 24
        filled = int(width * done / max(total, 1))
        stream.write(f"\rfamily search [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:40]:<40}")
    elif done == 0:
        stream.write(f"family search: simulating {total} strategy settings ...\n")
    elif done == total:
        stream.write(f"family search: {total} strategy settings simulated\n")
    stream.flush()


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class ProgressLines:
    """Progress for a log, a pipe or beside ``--json``: what a terminal would redraw in
    place (text between carriage returns) becomes one line each, repeats dropped; with
    ``as_json`` each line is a JSON object ``{"progress": text}``, so that stderr stays
    JSON Lines (a failing command's ``{"error": ...}`` object comes last)."""

    def __init__(self, stream: TextIO, as_json: bool = False):
        self.stream = stream
        self.as_json = as_json
        self.last = ""

    def write(self, text: str) -> int:
        for piece in text.replace("\r", "\n").split("\n"):
            piece = piece.strip()
            if piece and piece != self.last:
                self.stream.write((json.dumps({"progress": piece}) if self.as_json else piece) + "\n")
                self.last = piece
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


def default_progress(json_output: bool = False) -> TextIO:
    """Progress on stderr: redrawn in place on an interactive terminal, else (off a
    terminal) as plain lines, or with ``--json`` as one JSON object per line."""
    if not json_output and sys.stderr.isatty():
        return sys.stderr
    return ProgressLines(sys.stderr, as_json=json_output)
