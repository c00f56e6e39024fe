"""``plan``: the answer to "which schedule should I run?", with proof of how good it is.

Three phases share one time limit:

1. family search: every registered strategy setting, simulated (fast);
2. CP-SAT order: the best mappings found keep their workers, CP-SAT picks the
   order of work on each worker (hinted with the simulated schedule);
3. CP-SAT mapping: workers and order together, warm-started from the best so
   far (skipped with ``strategy=``, which keeps that strategy's mapping).

Every candidate is replayed by the simulator with fixed orders, and the
plan is the candidate with the shortest replay, so it is never worse than the
best family member simulated.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Iterable, TextIO

import numpy as np

from unisched.errors import UniSchedError
from unisched.costs import Costs
from unisched.simulate.priorities import BackwardFirst
from unisched.simulate.simulation import Simulation
from unisched.strategy import Strategy
from unisched.work import ComputeAndWeightWorkers, Direction, Shape, Work

from unisched.plan.bounds import mapping_bounds, shape_bounds
from unisched.plan.family import FamilyResult, Member, measures, registry_members, search_family
from unisched.plan.mapping import incumbent_from, solve_mapping
from unisched.plan.order import Solved, check_mapping_memory, solve_order_staged
from unisched.plan.planfile import Plan
from unisched.plan.problem import PlanInputError, PlanProblem, TimedProblem
from unisched.plan.schedule import Schedule

ORDER_SHARE = 0.3
"""Share of the time limit given to CP-SAT orders of the best family mappings."""
ORDERED_MAPPINGS = 3
REPLAY_MARGIN = 0.03
"""Share of the time limit kept for replaying the candidates at the end."""


@dataclass(eq=False)
class Candidate:
    label: str
    source: str
    schedule: Schedule
    replay: Simulation
    model_latency: float | None = None
    proven: bool = False
    pareto: bool = False

    @property
    def latency(self) -> float:
        return float(self.replay.latency)


def plan(
    num_workers: int,
    num_stages: int,
    num_batches: int,
    costs: Costs | None = None,
    *,
    memory_limit: float | None = None,
    max_stages_per_worker: int | None = None,
    strategy: str | None = None,
    time_limit: float = 30.0,
    split_backward: bool = False,
    members: Iterable[tuple[str, Strategy | None, str]] | None = None,
    progress: TextIO | None = None,
    search_workers: int = 2,
    seed: int = 0,
) -> Plan:
    """Plan one training step of ``num_batches`` micro-batches over ``num_stages``
    stages on ``num_workers`` workers within ``time_limit`` seconds.

    ``strategy`` keeps that registered strategy's mapping and optimizes only
    the order of work; ``members`` replaces the registry with your own
    ``(label, Strategy, "")`` candidates.  Raises a ``UniSchedError`` saying
    what is needed when the limits make every schedule impossible.
    """
    if (isinstance(time_limit, bool) or not isinstance(time_limit, (int, float, np.number))
            or not 0 < time_limit < math.inf):
        raise PlanInputError(f"time_limit must be a positive number of seconds, got {time_limit!r}")
    begin = time.perf_counter()
    deadline = begin + float(time_limit) * (1 - REPLAY_MARGIN)
    shape = Shape(num_workers, num_stages, num_batches).check()
    check_plan_size(shape, split_backward)
    if costs is not None and not isinstance(costs, Costs):
        raise PlanInputError(f"costs must be a unisched.Costs, got {type(costs).__name__}")
    costs = (costs or Costs()).check(num_workers, num_stages)
    problem = PlanProblem(shape, costs, memory_limit, max_stages_per_worker, split_backward)
    timed = _timed(problem)
    if members is None:
        members = registry_members(problem, only=strategy)
    family = search_family(problem, members, progress=progress, memory_variants=strategy is None)

    candidates: list[Candidate] = []
    for member in family.feasible:
        candidate = _replayed(problem, member.label, "family", _schedule_of(problem, member))
        if candidate is not None:
            candidate.pareto = member.pareto
            candidates.append(candidate)

    fixed = strategy is not None
    if fixed:
        ordered = _ordering_targets(problem, timed, family.members, True, 1)
    else:
        built = search_family(problem, constructed_members(problem))
        for member in built.feasible:
            candidate = _replayed(problem, member.label, "constructed", _schedule_of(problem, member))
            if candidate is not None:
                candidates.append(candidate)
        ordered = _ordering_targets(problem, timed, family.feasible, False, ORDERED_MAPPINGS)
        ordered += _ordering_targets(problem, timed, built.members, False, len(built.members))
        ordered = _distinct(ordered)
    order_budget = (deadline - time.perf_counter()) * (1.0 if fixed else ORDER_SHARE)
    order_results: list[tuple[str, Solved]] = []
    for label, compute, weight, hint in ordered:
        left = deadline - time.perf_counter()
        budget = min(left, order_budget / max(len(ordered), 1))
        if budget <= 0.05:
            break
        _say(progress, f"CP-SAT order of {label} ({budget:.1f} s) ...")
        solved = solve_order_staged(timed, compute, weight, time_limit=budget, hint_starts=hint,
                                    num_workers=search_workers, seed=seed)
        order_results.append((label, solved))
        if solved.found:
            schedule = Schedule.from_starts(problem, compute, weight, solved.starts, name=f"{label}+cpsat")
            candidate = _replayed(problem, f"{label} + cpsat order", "cpsat-order", schedule,
                                  timed.ticks.time(solved.objective), solved.optimal)
            if candidate is not None:
                candidates.append(candidate)

    mapping_solved: Solved | None = None
    if not fixed and deadline - time.perf_counter() > 0.5:
        hint = _best_incumbent(timed, candidates)
        _say(progress, f"CP-SAT mapping search ({deadline - time.perf_counter():.1f} s) ...")
        mapping_solved = solve_mapping(timed, time_limit=deadline - time.perf_counter(), hint=hint,
                                       num_workers=search_workers, seed=seed, score=_scorer(problem))
        if mapping_solved.found:
            schedule = Schedule.from_starts(problem, mapping_solved.compute, mapping_solved.weight,
                                            mapping_solved.starts, name="cpsat")
            candidate = _replayed(problem, "cpsat mapping", "cpsat-mapping", schedule,
                                  timed.ticks.time(mapping_solved.objective),
                                  mapping_solved.optimal and mapping_solved.objective <= mapping_solved.bound)
            if candidate is not None:
                candidates.append(candidate)

    _say(progress, "")
    if not candidates:
        raise UniSchedError(_nothing_found(problem, family, order_results, strategy, time_limit))
    # on a tie, a named strategy beats a reordered one, which beats a new mapping
    rank = {"family": 0, "constructed": 1, "cpsat-order": 2, "cpsat-mapping": 3}
    best = min(enumerate(candidates), key=lambda ic: (round(ic[1].latency, 9), rank[ic[1].source], ic[0]))[1]

    if fixed:
        bounds = mapping_bounds(problem, best.schedule.compute)
        proven = [s for _, s in order_results if s.found]
        if proven:
            bounds["cpsat"] = timed.ticks.time(max(s.bound for s in proven))
    else:
        bounds = shape_bounds(problem)
        if mapping_solved is not None and mapping_solved.found and mapping_solved.bound > 0:
            bounds["cpsat"] = timed.ticks.time(mapping_solved.bound)
    lower = max(bounds.values())
    # a CP-SAT proof covers what its model searched: the fixed mapping (with strategy=),
    # or every mapping of the mapping model
    proof_source = "cpsat-order" if fixed else "cpsat-mapping"
    proofs = [c.latency for c in candidates if c.source == proof_source and c.proven
              and c.model_latency is not None and abs(c.latency - c.model_latency) < 1e-9]
    optimal = best.latency <= lower + 1e-9 or any(best.latency <= p + 1e-9 for p in proofs)
    if optimal:
        lower = max(lower, best.latency)
    rows = [_row(c, lower, c is best and optimal) for c in sorted(candidates, key=lambda c: c.latency)]
    dropped = [{"strategy": m.label, "reason": m.reason} for m in family.dropped]
    return Plan(
        schedule=best.schedule,
        strategy_name=best.label,
        latency=best.latency,
        lower_bound=float(lower),
        bounds=bounds,
        optimal=bool(optimal),
        model_latency=best.model_latency,
        candidates=rows,
        dropped=dropped,
        elapsed=time.perf_counter() - begin,
        replay=best.replay,
    )


MAX_PLAN_ITEMS = 20_000
"""The most work items :func:`plan` takes: its CP-SAT models have a few
variables per item and worker, and its family search simulates dozens of
strategies.  Larger steps are for :func:`unisched.simulate` and ``unisched compare``."""
MAX_PLAN_CELLS = 4_000_000
"""The most entries of the planner's per-item-and-worker and per-link-and-stage tables."""
MAX_TICKS = 2**53
"""The longest step, in the integer ticks CP-SAT works in."""


def check_plan_size(shape: Shape, split_backward: bool = False) -> None:
    """Refuse, before building anything, a step too large to plan."""
    W, S, B = shape
    items = S * B * (3 if split_backward else 2)
    cells = max(items * W, W * W * S)
    if items > MAX_PLAN_ITEMS or cells > MAX_PLAN_CELLS:
        what = (f"{items:,} work items (at most {MAX_PLAN_ITEMS:,}, unisched.plan.planner.MAX_PLAN_ITEMS)"
                if items > MAX_PLAN_ITEMS else
                f"{cells:,} table entries of items or links by workers (at most {MAX_PLAN_CELLS:,}, "
                "unisched.plan.planner.MAX_PLAN_CELLS)")
        raise PlanInputError(
            f"W={W}, S={S}, B={B} is too large to plan: {what}. Plan fewer micro-batches (a schedule found for "
            "a few times W micro-batches shows the pattern), or compare strategies on this shape with "
            "`unisched compare`"
        )


def _timed(problem: PlanProblem) -> TimedProblem:
    """The problem in CP-SAT's integer ticks, refused when its times do not fit them."""
    try:
        timed = TimedProblem.build(problem)
    except (OverflowError, ValueError) as error:
        raise PlanInputError(
            f"the costs do not fit the integer ticks CP-SAT counts time in ({error}): give the times in a "
            "coarser unit (e.g. milliseconds instead of microseconds)"
        ) from None
    n = problem.num_items
    horizon = (timed.duration.max(axis=1).astype(float).sum()
               + 2.0 * n * float(max(timed.comm.max(initial=0), timed.stash.max(initial=0)))
               + 2.0 * float(timed.fetch.max(initial=0)))
    if horizon >= MAX_TICKS:
        raise PlanInputError(
            f"the step is {horizon:.3g} ticks long at the planner's resolution of 1/{timed.ticks.scale} time unit, "
            f"more than CP-SAT's integers hold ({MAX_TICKS:.3g}): give the times in a coarser unit, or with "
            "fewer significant digits"
        )
    return timed


def _say(progress: TextIO | None, text: str) -> None:
    if progress is not None:
        progress.write(f"\r{text:<90}\r")
        progress.flush()


def _schedule_of(problem: PlanProblem, member: Member) -> Schedule:
    """A family member's simulated run as fixed workers and orders."""
    t = member.simulation.timeline
    rows = _rows_of(problem, t)
    if member.memory_limit is not None:
        problem = replace(problem, memory_limit=member.memory_limit)
    return Schedule.from_starts(problem, t.worker[rows], t.weight_worker[rows], t.start[rows], name=member.label)


def _replayed(problem: PlanProblem, label: str, source: str, schedule: Schedule,
              model_latency: float | None = None, proven: bool = False) -> Candidate | None:
    try:
        replay = schedule.simulate()
    except UniSchedError:
        return None
    return Candidate(label, source, schedule, replay, model_latency, proven)


def _ordering_targets(problem: PlanProblem, timed: TimedProblem, members: list[Member], fixed: bool,
                      limit: int):
    """(label, compute, weight, hint ticks) for the mappings whose order CP-SAT improves:
    the first ``limit`` distinct mappings of ``members`` that can run under the memory limit."""
    targets = []
    seen = set()
    for member in members:
        if member.strategy is None or len(targets) >= limit:
            continue
        if member.simulation is not None:
            t = member.simulation.timeline
            rows = _rows_of(problem, t)
            compute, weight = t.worker[rows], t.weight_worker[rows]
            hint = np.array([timed.ticks(x) for x in t.start[rows]], dtype=np.int64)
        elif fixed or member.reason.startswith("deadlock"):
            compute, weight = _map(problem, member.strategy)
            hint = None
        else:
            continue
        key = compute.tobytes() + weight.tobytes()
        if key in seen:
            continue
        seen.add(key)
        if fixed:
            check_mapping_memory(timed, compute)
        else:
            try:
                check_mapping_memory(timed, compute)
            except UniSchedError:
                continue
        targets.append((member.label, compute, weight, hint))
    return targets


def _distinct(targets):
    seen, kept = set(), []
    for target in targets:
        key = target[1].tobytes() + target[2].tobytes()
        if key not in seen:
            seen.add(key)
            kept.append(target)
    return kept


def constructed_members(problem: PlanProblem) -> list[tuple[str, Strategy, str]]:
    """Mappings built here rather than taken from the registry, as further starting points:
    stages dealt round-robin (always feasible), and, with as many workers as stages, micro-batches
    alternating between the pipeline and its reverse (every worker then keeps long-lived stashes of
    early stages for half the micro-batches and short-lived ones of late stages for the others)."""
    W, S, B = problem.shape
    priority = BackwardFirst(S, B)

    def member(label: str, compute_of) -> tuple[str, Strategy, str]:
        def map_arrays(batch, stage, direction):
            return compute_of(np.asarray(batch), np.asarray(stage)), np.asarray(stage) % W

        def mapping(work: Work) -> ComputeAndWeightWorkers:
            compute, weight = map_arrays(np.array([work.batch]), np.array([work.stage]), None)
            return ComputeAndWeightWorkers(int(compute[0]), int(weight[0]))

        return label, Strategy(mapping, name=label, priority=priority, map_arrays=map_arrays,
                               shape=problem.shape), ""

    members = [member("stages round-robin", lambda batch, stage: stage % W)]
    K = problem.max_stages_per_worker
    if W == S and W > 1 and B > 1 and (K is None or K >= 2):
        members.append(member("bidirectional", lambda batch, stage: np.where(batch % 2 == 0, stage, S - 1 - stage)))
    return members


def _rows_of(problem: PlanProblem, t) -> np.ndarray:
    """Timeline row of each of the problem's item ids."""
    rows = np.empty(problem.num_items, dtype=np.int64)
    rows[problem.items.id(t.batch, t.stage, t.direction)] = np.arange(len(t))
    return rows


def _map(problem: PlanProblem, strategy: Strategy) -> tuple[np.ndarray, np.ndarray]:
    batch, stage, direction = problem.items.arrays()
    if strategy.map_arrays is not None:
        compute, weight = strategy.map_arrays(batch, stage, direction)
        return np.asarray(compute, dtype=np.int64), np.asarray(weight, dtype=np.int64)
    pairs = [strategy(Work(int(b), int(s), Direction(int(d)))) for b, s, d in zip(batch, stage, direction)]
    return np.array([p[0] for p in pairs], dtype=np.int64), np.array([p[1] for p in pairs], dtype=np.int64)


def _scorer(problem: PlanProblem):
    """The replayed latency of a CP-SAT solution (what a plan reports)."""

    def score(compute, weight, starts) -> float:
        try:
            return float(Schedule.from_starts(problem, compute, weight, starts).simulate().latency)
        except UniSchedError:
            return float("inf")

    return score


def _best_incumbent(timed: TimedProblem, candidates: list[Candidate]):
    """The shortest candidate that fits the mapping model, as its warm start."""
    for candidate in sorted(candidates, key=lambda c: c.latency):
        t = candidate.replay.timeline
        starts = np.array([timed.ticks(x) for x in t.start[_rows_of(timed.problem, t)]], dtype=np.int64)
        incumbent = incumbent_from(timed, candidate.schedule.compute, candidate.schedule.weight, starts)
        if incumbent is not None:
            return incumbent
    return None


def _row(candidate: Candidate, lower: float, optimal: bool) -> dict:
    row = {"strategy": candidate.label, "source": candidate.source}
    row.update(measures(candidate.replay))
    row["gap"] = (candidate.latency - lower) / lower if lower > 0 else 0.0
    row["optimal"] = bool(optimal)
    row["pareto"] = bool(candidate.pareto)
    row["model_latency"] = candidate.model_latency
    return row


def _nothing_found(problem: PlanProblem, family: FamilyResult, order_results, strategy, time_limit) -> str:
    W, S, B = problem.shape
    reasons = "; ".join(f"{m.label}: {m.reason}" for m in family.dropped[:4])
    statuses = ", ".join(f"{label}: {s.status}" for label, s in order_results)
    what = f"strategy {strategy!r}" if strategy else "any strategy"
    return (
        f"no schedule found for {what} on W={W}, S={S}, B={B} within {time_limit:g} s"
        + (f" (dropped: {reasons})" if reasons else "")
        + (f" (CP-SAT: {statuses})" if statuses else "")
        + "; raise --time-limit or --memory-limit, or allow more stages per worker"
    )
