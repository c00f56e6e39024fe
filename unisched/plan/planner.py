"""``plan``: the answer to "which schedule should I run?", with proof of how good it is.

Three phases share one time limit:

1. family search: every registered strategy setting, simulated (fast); under
   a memory limit, then the pooled step's lower bound
   (:mod:`unisched.plan.pooled`), which holds for every schedule;
2. CP-SAT order: the best mappings found keep their workers, CP-SAT picks the
   order of work on each worker;
3. CP-SAT mapping: workers and order together, warm-started from the best so
   far (skipped with ``strategy=``, which keeps that strategy's mapping); on
   small problems over the whole scheme (a backward may run away from its
   forward), else with one worker per (stage, micro-batch).

Every candidate is replayed by the simulator with fixed orders (a CP-SAT
solution both with its planned starts as release times, which keeps the
planned times, and from its orders alone; the better replay counts), and the
plan is the candidate with the best replay (of the chosen objective), so it is
never worse than the best family member simulated.  The search stops early
once the best meets a lower bound, and on Ctrl-C, answering with the best so
far.  Every claim names the class of schedules it is proven for
(``Plan.proven_for``, ``Plan.bound_for``): a bound or optimum of a restricted
model is never stated as one over every schedule.

On a cluster topology (:class:`unisched.topology.ClusterCosts`) the family search and every
replay run on the topology, transfers queueing on the links they share; the CP-SAT models take
each pair of workers' transfer time without contention (docs/planning.md, "On a cluster topology").

On steps too large for the CP-SAT models (:func:`uses_heuristic`), :func:`plan`
runs the heuristic search of :mod:`unisched.plan.search` instead.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, TextIO

import numpy as np

from unisched.dataflow import Items
from unisched.errors import UniSchedError
from unisched.metrics import gap
from unisched.costs import Costs
from unisched.simulate.simulation import Simulation
from unisched.strategy import Strategy, as_strategy
from unisched.work import Shape, Work

from unisched.plan.bounds import ANY_SCHEDULE, every_ramp, mapping_bounds, ramp, shape_bounds
from unisched.plan.family import (FamilyResult, Member, constructed_members, held_in_shards, measures,
                                  registry_members, search_family, unplannable)
from unisched.plan.mapping import (EVERY, PAIRED, WHOLE_SCHEME, claimable, class_breadth, every_schedule_applies,
                                   fits, incumbent_from, proven_class, solve_mapping,
                                   whole_scheme_by_default)
from unisched.plan.order import PORTFOLIO, Solved, check_mapping_memory, order_class, solve_order_staged
from unisched.plan.planfile import Plan, objective_value
from unisched.plan.pooled import pooled_bound
from unisched.plan.problem import (PlanInputError, PlanProblem, TimedProblem, check_plan_size, check_time_limit,
                                   exact_links, mapping_of, rows_of, seconds_tables, split_from)
from unisched.plan.schedule import Schedule
from unisched.plan.search import SEARCH_FROM_ITEMS, Mapped, construct, rules, search as heuristic_search

ORDER_SHARE = 0.3
"""Share of the time limit given to CP-SAT orders of the best family mappings."""
ORDERED_MAPPINGS = 3
"""How many of the best family mappings CP-SAT reorders."""
CONSTRUCTED_RULES = 8
"""How many rules of the list scheduler build orders for a mapping whose greedy replay deadlocks."""
REPLAY_MARGIN = 0.03
"""Share of the time limit kept for replaying the candidates at the end."""
PAIRED_SHARE = 0.25
"""Share of the mapping search's time for the paired model under memory limits, when the whole scheme is
searched after it (what each share gave: docs/planner-measurements.md)."""
UNLIMITED_PAIRED_SHARE = 0.2
"""The same without memory limits, where the whole-scheme model finds and proves good schedules by
itself (W = 2, S = 4, B = 8, comm 1: 49 proven in 2.3 s instead of 5.4 s at a share of 0.5)."""
PERIODIC_SHARE = 0.3
"""Share of the whole-scheme search's time for its periodic run (:data:`MAPPING_PERIOD`), which
comes first; the unrestricted run after it starts from the best found."""
WHOLE_SHARE = 0.5
"""Share of the time left for the whole scheme's unrestricted run when the every-schedule model runs
after it (which then has the rest, and whatever that run's proof leaves): on the thirteen hardest
small steps, two runs each, it gave 552 and 554 in all against 566 and 566 with the whole scheme
taking all it needed (W = 3, S = 3, B = 8, memory 2, comm 1, split: 29 against 32; W = S = 4, B =
8, memory 1, comm 1, split: 67 against 75; docs/planner-measurements.md)."""
MAPPING_PERIOD = 2
"""The periodic run places micro-batch b as b - 2.  On the hard small cases of
``benchmarks/planner_small.py`` it found shorter plans than the same time spent on the
unrestricted model alone (docs/planner-measurements.md)."""
POOLED_SHARE = 0.15
"""Most of the time limit the pooled step (:mod:`unisched.plan.pooled`) may take for its bound under
a memory limit (docs/planning.md, "Bounds")."""
SEARCH_WORKERS = len(PORTFOLIO) + 1
"""CP-SAT's search workers per solve: the searches of :data:`unisched.plan.order.PORTFOLIO`
and one for neighbourhoods.  More share the two cores of the machine measured more thinly and lose
the small steps' proofs (docs/planner-measurements.md)."""
SEARCHES = ("auto", "cpsat", "heuristic")
"""Which search :func:`plan` runs: :func:`uses_heuristic` says which ``auto`` picks."""
SCHEMES = ("auto", "whole", "paired")
"""Which class the mapping search covers: the whole scheme, one worker per (stage, micro-batch),
or the whole scheme on small problems only (:func:`unisched.plan.mapping.whole_scheme_by_default`),
followed there by every schedule's model with at least half the time left (``auto``)."""


@dataclass(eq=False)
class Candidate:
    label: str
    source: str
    schedule: Schedule
    replay: Simulation
    model_latency: float | None = None
    pareto: bool = False
    searched: str = ""
    """The class of schedules the CP-SAT mapping model that found it searched ("" for other sources)."""

    @property
    def latency(self) -> float:
        return float(self.replay.latency)

    def value(self, objective: str) -> float:
        """The candidate's replayed objective: its latency, or its longest worker busy span."""
        return objective_value(self.replay, objective)


def plan(
    num_workers: int,
    num_stages: int,
    num_batches: int,
    costs: Costs | None = None,
    *,
    memory_limit: float | list[float] | None = None,
    max_stages_per_worker: int | None = None,
    strategy: str | Strategy | Callable[[Work], Any] | None = None,
    time_limit: float = 30.0,
    split_backward: bool | None = None,
    members: Iterable[tuple[str, Strategy | None, str]] | None = None,
    progress: TextIO | None = None,
    search_workers: int = SEARCH_WORKERS,
    seed: int = 0,
    memory_budget: float | list[float] | None = None,
    optimizer_bytes: float | list[float] = 0.0,
    objective: str = "latency",
    scheme: str = "auto",
    search: str = "auto",
) -> Plan:
    """Plan one training step of ``num_batches`` micro-batches over ``num_stages``
    stages on ``num_workers`` workers within ``time_limit`` seconds.

    ``strategy`` keeps a strategy's mapping and optimizes only the order of
    work: a registered one by its label (``"looped(group_size=2)"``), or your
    own (a :class:`~unisched.Strategy`, or a function ``Work ->
    ComputeAndWeightWorkers``); ``members`` replaces the registry with your own
    ``(label, Strategy, "")`` candidates.  The backward is split when asked or
    when the costs give ``backward_input``/``backward_weight``.  Memory:
    ``memory_limit`` caps stashes, ``memory_budget`` a worker's bytes of
    weights, ``optimizer_bytes`` and stashes (one number, or one per worker).
    ``objective``: "latency" or "span" (the longest worker busy span);
    ``scheme``: one of :data:`SCHEMES`.  ``search``: one of :data:`SEARCHES`,
    the CP-SAT models (the phases above) or the heuristic search of
    :mod:`unisched.plan.search` (which ignores ``scheme`` and ``search_workers``);
    see :func:`uses_heuristic`.  Raises a ``UniSchedError`` saying what is
    needed when the limits make every schedule impossible.
    """
    check_time_limit(time_limit)
    if scheme not in SCHEMES:
        raise PlanInputError(f"scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    if search not in SEARCHES:
        raise PlanInputError(f"search must be one of {', '.join(SEARCHES)}, got {search!r}")
    if strategy is not None and scheme != "auto":
        raise PlanInputError(f"scheme={scheme!r} (--scheme) chooses the class the mapping search covers, and with a "
                             "strategy there is no mapping search: its mapping is kept and only the order of work is "
                             "searched; drop one of the two")
    begin = time.perf_counter()
    num_workers, num_stages, num_batches = shape = Shape(num_workers, num_stages, num_batches).check()
    if costs is not None and not isinstance(costs, Costs):
        raise PlanInputError(f"costs must be a unisched.Costs, got {type(costs).__name__}")
    costs = (costs or Costs()).check(num_workers, num_stages)
    _check_one_replica(costs)
    split = split_from(costs, split_backward)
    heuristic = uses_heuristic(search, shape, split)
    check_plan_size(shape, split, heuristic)
    problem = PlanProblem(shape, costs, memory_limit, max_stages_per_worker, split, memory_budget,
                          optimizer_bytes, objective)
    _check_some_time(problem)
    members = _checked_members(members)
    if members is None and strategy is not None:
        strategy, members = _strategy_members(problem, strategy)
    _refuse_shards(members)
    if heuristic:
        if progress is not None:
            progress.write(f"search: heuristic (list scheduling and local search, unisched.plan.search) for "
                           f"{problem.num_items:,} work items, {time_limit:g} s\n")
        return heuristic_search(problem, time_limit=time_limit, members=members, progress=progress, seed=seed)
    whole = whole_scheme_by_default(shape) if scheme == "auto" else scheme == "whole"
    run = _Search(problem, _timed(problem), begin + float(time_limit) * (1 - REPLAY_MARGIN), progress,
                  search_workers, seed, strategy is not None)
    family = FamilyResult()
    try:
        family = run.family(members if members is not None else registry_members(problem), whole)
        if strategy is None:
            run.pooled()
        run.orders(run.targets(family))
        if strategy is None:
            run.mapping(EVERY if scheme == "auto" and whole and every_schedule_applies(run.timed)
                        else WHOLE_SCHEME if whole else PAIRED)
    except KeyboardInterrupt:
        run.interrupted = True
    _say(progress, "")
    if not run.candidates:
        if run.interrupted:
            raise UniSchedError("interrupted before any schedule was found: let the search run longer")
        raise UniSchedError(_nothing_found(problem, family, run.order_results, strategy, time_limit))
    return run.answer(family, time.perf_counter() - begin)


def _strategy_members(problem: PlanProblem, strategy) -> tuple[str, list[tuple[str, Strategy | None, str]]]:
    """``plan(strategy=...)`` as (its label, the one member to plan): a registered strategy by
    its label, or your own Strategy or mapping function."""
    if isinstance(strategy, str):
        if ":" in strategy:
            raise PlanInputError(
                f"strategy {strategy!r} names your own code, which only the command loads (unisched plan "
                "--strategy MODULE:FUNCTION); from Python pass the Strategy or the function itself as strategy=")
        return strategy, list(registry_members(problem, only=strategy))
    if not isinstance(strategy, Strategy) and not callable(strategy):
        raise PlanInputError(f"strategy must be a registered strategy's label, a unisched.Strategy or a function "
                             f"Work -> ComputeAndWeightWorkers, got {strategy!r}")
    label = strategy.name if isinstance(strategy, Strategy) and strategy.name else getattr(strategy, "__name__", "")
    label = label if label and label != "<lambda>" else "your strategy"
    strategy = as_strategy(strategy, name=label)
    strategy.check_shape(problem.shape, "planned")
    return label, [(label, strategy, "")]


def _checked_members(members) -> list[tuple[str, Strategy | None, str]] | None:
    """``plan(members=...)`` as a list of (label, Strategy or None, why it is None) triples, or a
    PlanInputError saying what it must be."""
    if members is None:
        return None
    what = ("members must be (label, Strategy, '') triples, or (label, None, why it cannot run), as "
            "unisched.plan.family.registry_members gives them")
    if isinstance(members, (str, bytes)) or not isinstance(members, Iterable):
        raise PlanInputError(f"{what}; got {members!r}")
    checked = []
    for member in members:
        if not (isinstance(member, (tuple, list)) and len(member) == 3 and isinstance(member[0], str)
                and (member[1] is None or isinstance(member[1], Strategy)) and isinstance(member[2], str)):
            raise PlanInputError(f"{what}; got {member!r}")
        checked.append(tuple(member))
    return checked


def _refuse_shards(members) -> None:
    """Refuse, before any search, a strategy given to plan that holds weights in shards."""
    for label, strategy, _ in members or ():
        if strategy is not None and held_in_shards(strategy):
            raise PlanInputError(f"cannot plan strategy {label!r}: {held_in_shards(strategy)}, or plan it without "
                                 "its shards")


def _check_one_replica(costs: Costs) -> None:
    """Refuse costs of one replica among several (``ClusterCosts.replicas``): the CP-SAT models
    plan a step on its own workers and know nothing of the all-reduces with the other replicas."""
    replicas = getattr(costs, "replicas", 1)
    if replicas != 1:
        raise PlanInputError(
            f"ClusterCosts.replicas is {replicas}: the planner plans the whole step on its workers and "
            "leaves out all-reduces with other replicas; plan with replicas=1 (give every device as a worker), "
            "or compare layouts with unisched.simulate.layout.simulate_layout"
        )


def _check_some_time(problem: PlanProblem) -> None:
    """Refuse a step in which nothing takes time, passes or transfers: every schedule of it takes
    none, and ties at time 0 leave the replays of fixed orders nothing to go by."""
    if not any(np.any(times) for times in seconds_tables(problem)):
        raise PlanInputError("nothing in the step takes time (every pass and transfer 0), so every schedule "
                             "takes none: give the passes' times (--forward, --backward, or a costs file)")


def uses_heuristic(search: str, shape: Shape, split_backward: bool) -> bool:
    """Whether :func:`plan` runs the heuristic search: when asked, or with ``search="auto"`` from
    :data:`unisched.plan.search.SEARCH_FROM_ITEMS` work items on, where the CP-SAT models do not finish."""
    if search != "auto":
        return search == "heuristic"
    W, S, B = shape
    return Items(S, B, split_backward).count >= SEARCH_FROM_ITEMS


@dataclass(eq=False)
class _Search:
    """The state of one planning run: the candidates so far, the bounds they are judged
    against, and whether to go on (time left, no Ctrl-C, no candidate meeting a bound)."""

    problem: PlanProblem
    timed: TimedProblem
    deadline: float
    progress: TextIO | None
    search_workers: int
    seed: int
    fixed: bool
    candidates: list[Candidate] = field(default_factory=list)
    dropped: list[dict] = field(default_factory=list)
    order_results: list[tuple[str, Solved]] = field(default_factory=list)
    built: FamilyResult = field(default_factory=FamilyResult)
    proofs: list[tuple[str, str, float]] = field(default_factory=list)
    """(key in ``Plan.bounds``, class of schedules, CP-SAT's lower bound for it) of every model run
    whose bound holds."""
    pooled_bound: float = 0.0
    """The pooled step's lower bound (:meth:`pooled`), for every schedule; 0 where it did not run."""
    shape_bounds: dict[str, float] = field(init=False)
    """The bounds of the problem's shape, for every schedule (:func:`unisched.plan.bounds.shape_bounds`)."""
    ramp_bound: float = field(init=False)
    """:func:`unisched.plan.bounds.ramp`, for the whole scheme's schedules (:data:`WHOLE_SCHEME`); 0
    with the span objective, which it does not bound."""
    replica_ramp: float = field(init=False)
    """:func:`unisched.plan.bounds.every_ramp`, for every schedule a plan can hold (:data:`EVERY`,
    every candidate among them); 0 with the span objective."""
    interrupted: bool = False
    mapped: dict[bytes, tuple[Schedule, Simulation] | None] = field(default_factory=dict)
    """CP-SAT mapping solutions replayed (:meth:`replay_mapped`), by their compute, weight and starts."""

    def __post_init__(self):
        self.shape_bounds = shape_bounds(self.problem)
        self.ramp_bound = self.timed.ticks.time(ramp(self.timed))
        self.replica_ramp = self.timed.ticks.time(every_ramp(self.timed))

    # ------------------------------------------------------------------ phases
    def family(self, members, whole: bool) -> FamilyResult:
        """Simulate the named strategies (under the least stash limit when workers' limits differ)
        and the constructed mappings (those of the whole scheme with ``whole``)."""
        problem = self.problem
        searched = problem
        if np.ndim(problem.memory_limit):
            least = float(min(problem.memory_limit))
            try:
                searched = replace(problem, memory_limit=least)
            except PlanInputError:  # the least room holds no micro-batch; CP-SAT keeps each worker's own
                reason = (f"not simulated: named strategies run under the least of the workers' memory limits, "
                          f"{least:g}, which holds no micro-batch")
                return search_family(problem, [(label, None, reason) for label, _, _ in members])
        family = search_family(searched, members, progress=self.progress,
                               memory_variants=not self.fixed and problem.memory_limit is None)
        for member in family.feasible:
            self.add(member.label, "family", member.schedule(problem), pareto=member.pareto)
        if not self.fixed:
            self.built = search_family(searched, constructed_members(problem, whole))
            for member in self.built.feasible:
                self.add(member.label, "constructed", member.schedule(problem))
        return family

    def pooled(self) -> None:
        """CP-SAT's bound on the pooled step (:func:`unisched.plan.pooled.pooled_bound`), for every
        schedule, for the latency and under a memory limit only (without one, 5 s of it did not
        reach the work bound on the small steps measured: docs/planner-measurements.md)."""
        problem = self.problem
        if not problem.memory_limited or problem.objective != "latency" or self.done():
            return
        best = self.best()
        seconds = POOLED_SHARE * (self.deadline - time.perf_counter())
        _say(self.progress, f"CP-SAT bound of the pooled step ({seconds:.1f} s) ...")
        upper = None if best is None else int(math.ceil(best.latency * self.timed.ticks.scale - 1e-6))
        solved = pooled_bound(self.timed, time_limit=seconds, seed=self.seed,
                              lower=self._ticks_below(self.floor()), upper=upper)
        self.interrupted |= solved.interrupted
        self.pooled_bound = self.timed.ticks.time(solved.bound)
        _say(self.progress, f"CP-SAT bound of the pooled step: {self.pooled_bound:g}"
                            + (" (its optimum)" if solved.optimal else ""))

    def floor(self) -> float:
        """The strongest lower bound known for every schedule of the problem's objective."""
        proven = [bound for _, name, bound in self.proofs if name == ANY_SCHEDULE]
        return max(max(self.shape_bounds.values()), self.pooled_bound, *proven)

    def held_floor(self) -> float:
        """The strongest lower bound known for every schedule a plan can hold (:data:`EVERY`):
        :meth:`floor` and the replica ramp."""
        return max(self.floor(), self.replica_ramp)

    def targets(self, family: FamilyResult):
        """The mappings whose order CP-SAT improves (nothing once a bound is met)."""
        if self.done():
            return []
        if self.fixed:
            return _ordering_targets(self.problem, self.timed, family.members, True, 1)
        built = self.built.members
        return _distinct(_ordering_targets(self.problem, self.timed, family.feasible, False, ORDERED_MAPPINGS)
                         + _ordering_targets(self.problem, self.timed, built, False, len(built)))

    def orders(self, targets) -> None:
        """CP-SAT orders of fixed mappings, each stopping at its mapping's lower bound; a mapping
        whose greedy replay deadlocks starts from a memory-aware list schedule (:meth:`construct`)."""
        budget = (self.deadline - time.perf_counter()) * (1.0 if self.fixed else ORDER_SHARE)
        for label, compute, weight, hint in targets:
            if hint is None:
                hint = self.construct(label, compute, weight)
            left = self.deadline - time.perf_counter()
            share = min(left, budget / max(len(targets), 1))
            if share <= 0.05 or self.done():
                break
            _say(self.progress, f"CP-SAT order of {label} ({share:.1f} s) ...")
            bound = max(max(mapping_bounds(self.problem, compute, weight).values()), self.held_floor(),
                        self._ramp_for(compute, weight))
            solved = solve_order_staged(self.timed, compute, weight, time_limit=share, hint_starts=hint,
                                        num_workers=self.search_workers, seed=self.seed,
                                        lower_bound=self._ticks_below(bound), asap_replay=False,
                                        report=self._reporter(f"CP-SAT order of {label}"))
            self.order_results.append((label, solved))
            self.interrupted |= solved.interrupted
            if self.fixed and solved.bound > 0:
                self.proofs.append(("cpsat_order", order_class(label), self.timed.ticks.time(solved.bound)))
            if solved.found:
                schedule = Schedule.planned(self.timed, compute, weight, solved.starts, name=f"{label}+cpsat")
                self.add(f"{label} + cpsat order", "cpsat-order", schedule, self.timed.ticks.time(solved.objective))

    def _reporter(self, what: str, bounded: bool = True):
        """A line of progress per better solution a CP-SAT run finds (None: no progress wanted),
        with the model's bound only where it is a bound (``bounded``).  A staged search runs
        several models one after another, each finding its own first solutions: only those
        better than every one reported are told, with the seconds since the run began."""
        if self.progress is None:
            return None
        time_of = self.timed.ticks.time
        begin, best = time.perf_counter(), [math.inf]

        def report(objective: float, bound: float | None, seconds: float) -> None:
            if objective >= best[0]:
                return
            best[0] = objective
            proven = "" if bound is None or not bounded else f", bound {time_of(bound):g}"
            _say(self.progress, f"{what}: {time_of(objective):g}{proven} after {time.perf_counter() - begin:.1f} s")
        return report

    def construct(self, label: str, compute: np.ndarray, weight: np.ndarray) -> np.ndarray | None:
        """Orders for a mapping from the list scheduler of :func:`unisched.plan.search.construct`
        under its first few rules: the best that replays is a candidate, and its start ticks the
        order search's hint (None: none replays)."""
        problem, timed = self.problem, self.timed
        mapped = Mapped.build(timed, compute, weight, label)
        held = set(zip(np.asarray(compute).tolist(), timed.stage.tolist()))
        several = len(held) > len({w for w, _ in held})
        best = None
        for rule in rules(problem.split_backward, several)[:CONSTRUCTED_RULES]:
            orders = construct(mapped, rule) if time.perf_counter() < self.deadline else None
            if orders is None:
                continue
            schedule = Schedule(problem, np.asarray(compute), np.asarray(weight),
                                {w: order.tolist() for w, order in enumerate(orders)}, name=label)
            try:
                replay = schedule.simulate()
            except UniSchedError:
                continue
            candidate = Candidate(f"{label} + list schedule", "constructed", schedule, replay)
            if best is None or candidate.value(problem.objective) < best.value(problem.objective):
                best = candidate
        if best is None:
            return None
        self.candidates.append(best)
        return _start_ticks(timed, best.replay.timeline)

    def mapping(self, widest: str) -> None:
        """CP-SAT over mappings and orders up to the class ``widest`` (one of
        :data:`unisched.plan.mapping.SCHEMES`), each run warm-started from the best candidate that
        fits its class.

        Over the whole scheme, the paired model runs first (small, good schedules fast).  Solutions
        replay with their planned starts as release times, so no model needs ``asap_replay``'s
        restriction: the proofs and solutions are of the unrestricted classes.  The whole scheme
        is searched with periodic mappings first (:data:`MAPPING_PERIOD`; no proof comes of it),
        then without.  Up to :data:`EVERY` (on small problems where the every-schedule model
        applies: :func:`unisched.plan.mapping.every_schedule_applies`), that run has
        :data:`WHOLE_SHARE` of the time left, and the rest (more where the whole scheme's proof came
        early, or a bound for the whole scheme alone was met before) goes to the every-schedule
        model, to lift the proof to every schedule a plan can hold or find a shorter schedule
        outside the whole scheme."""
        runs = [(PAIRED, 1.0, 0)]  # (class searched, share of the time left, period)
        if widest != PAIRED:
            paired = PAIRED_SHARE if self.problem.memory_limited else UNLIMITED_PAIRED_SHARE
            runs = [(PAIRED, paired, 0), (WHOLE_SCHEME, WHOLE_SHARE if widest == EVERY else 1.0, 0)]
            if self.problem.shape.num_batches >= 2 * MAPPING_PERIOD:
                runs.insert(1, (WHOLE_SCHEME, PERIODIC_SHARE, MAPPING_PERIOD))
        if widest == EVERY:
            runs.append((EVERY, 1.0, 0))
        for scheme, share, period in runs:
            left = self.deadline - time.perf_counter()
            if left > 0.5 and not self.done(widest=scheme == EVERY):
                self._map(scheme, left * share, period)

    def _map(self, scheme: str, seconds: float, period: int = 0) -> None:
        key = BOUND_KEYS[scheme]
        hint = _best_incumbent(self.timed, self.candidates, scheme)
        restricted = f", micro-batches placed alike every {period}" if period else ""
        _say(self.progress, f"CP-SAT mapping search over {scheme}{restricted} ({seconds:.1f} s) ...")
        objective = self.problem.objective
        exact = exact_links(self.timed)  # else the model takes the worst link, and its bound proves nothing

        def score(compute, weight, starts) -> float:  # what a plan reports of the solution
            found = self.replay_mapped(compute, weight, starts)
            return float("inf") if found is None else objective_value(found[1], objective)

        solved = solve_mapping(self.timed, time_limit=seconds, hint=hint, num_workers=self.search_workers,
                               seed=self.seed, score=score, scheme=scheme, asap_replay=False, period=period,
                               lower_bound=self._ticks_below(max(self.held_floor(),
                                                                 0 if scheme == EVERY else self.ramp_bound)),
                               report=self._reporter(f"CP-SAT mapping ({key.removeprefix('cpsat_')})",
                                                     bounded=exact))
        self.interrupted |= solved.interrupted
        if exact and solved.bound > 0 \
                and (solved.found or solved.status == "INFEASIBLE"):
            self.proofs.append((key, proven_class(self.timed, scheme), self.timed.ticks.time(solved.bound)))
        found = self.replay_mapped(solved.compute, solved.weight, solved.starts) if solved.found else None
        if found is not None:  # one the replay cannot follow is left out silently
            tag = key.removeprefix("cpsat_").replace("_", " ")
            self.candidates.append(Candidate(f"cpsat mapping ({tag})", "cpsat-mapping", *found,
                                             self.timed.ticks.time(solved.objective), False, scheme))

    def replay_mapped(self, compute, weight, starts) -> tuple[Schedule, Simulation] | None:
        """A CP-SAT mapping solution replayed (:func:`replayed`), or None where it does not run;
        each distinct solution once, whichever run reports it (CP-SAT reports a hint again as its
        first solution, once per LNS round) and whether it scores it or keeps it."""
        key = b"".join(np.ascontiguousarray(a, dtype=np.int64).tobytes() for a in (compute, weight, starts))
        if key not in self.mapped:
            try:
                self.mapped[key] = replayed(Schedule.planned(self.timed, compute, weight, starts, name="cpsat"),
                                            self.problem.objective)
            except UniSchedError:
                self.mapped[key] = None
        return self.mapped[key]

    # ------------------------------------------------------------------ candidates and bounds
    def add(self, label: str, source: str, schedule: Schedule, model_latency: float | None = None,
            pareto: bool = False, searched: str = "") -> None:
        """Replay a schedule (:func:`replayed`) and keep it; one that cannot run under the plan's
        limits is dropped, saying why (a CP-SAT schedule that the replay cannot follow is left out
        silently)."""
        try:
            schedule, replay = replayed(schedule, self.problem.objective)
        except UniSchedError as error:
            if source in ("family", "constructed"):
                self.dropped.append({"strategy": label, "reason": str(error).splitlines()[0]})
            return
        self.candidates.append(Candidate(label, source, schedule, replay, model_latency, pareto, searched))

    def best(self) -> Candidate | None:
        """The candidate with the best replayed objective; on a tie, a named strategy beats a
        reordered one, which beats a new mapping."""
        if not self.candidates:
            return None
        rank = {"family": 0, "constructed": 1, "cpsat-order": 2, "cpsat-mapping": 3}
        objective = self.problem.objective
        return min(enumerate(self.candidates),
                   key=lambda ic: (round(ic[1].value(objective), 9), round(ic[1].latency, 9), rank[ic[1].source],
                                   ic[0]))[1]

    def bounds(self, value: float) -> tuple[dict[str, float], dict[str, str]]:
        """Every lower bound known and the class of schedules each holds for, as far as each
        says something of a plan of ``value`` (the best replay: :func:`claimable`)."""
        problem = self.problem
        bounds = dict(self.shape_bounds)
        if self.pooled_bound:
            bounds["cpsat_pooled"] = self.pooled_bound
        classes = {k: ANY_SCHEDULE for k in bounds}
        bounds["replica_ramp"], classes["replica_ramp"] = self.replica_ramp, EVERY
        bounds["ramp"], classes["ramp"] = self.ramp_bound, WHOLE_SCHEME
        if self.fixed:
            best = self.best()
            mapping = mapping_bounds(problem, best.schedule.compute, best.schedule.weight)
            name = order_class(best.label.split(" + ")[0])
            for key, bound in mapping.items():
                if bound > bounds.get(key, -math.inf):
                    bounds[key], classes[key] = bound, name
        for key, name, bound in self.proofs:
            if bound > bounds.get(key, -math.inf):
                bounds[key], classes[key] = bound, name
        return claimable(bounds, classes, value)

    def contains(self, name: str, candidate: Candidate) -> bool:
        """Whether a candidate lies in a class of schedules, so that a bound for the class bounds it."""
        schedule = candidate.schedule
        if name in (ANY_SCHEDULE, EVERY) or name.startswith("orders of"):
            return True  # with a fixed strategy every candidate has its mapping; no plan holds shards or gangs
        if name == PAIRED:
            return fits(self.timed, schedule.compute, schedule.weight, PAIRED)
        if not fits(self.timed, schedule.compute, schedule.weight, WHOLE_SCHEME):
            return False
        return name == WHOLE_SCHEME or candidate.searched == name \
            or fits(self.timed, schedule.compute, schedule.weight, PAIRED)

    def done(self, widest: bool = False) -> bool:
        """Whether to stop searching: Ctrl-C, the time limit, or a candidate meeting a lower bound
        (``widest``: one for every schedule a plan can hold, not the whole scheme's ramp)."""
        if self.interrupted or time.perf_counter() >= self.deadline:
            return True
        best = self.best()
        if best is None:
            return False
        bound = self.held_floor()  # every candidate is a schedule a plan can hold
        if self.fixed:
            bound = max(bound, *mapping_bounds(self.problem, best.schedule.compute, best.schedule.weight).values())
        if not widest:
            bound = max(bound, self._ramp_for(best.schedule.compute, best.schedule.weight))
        return best.value(self.problem.objective) <= bound + 1e-9

    def _ramp_for(self, compute, weight) -> float:
        """The ramp bound where a mapping lies in the whole scheme (it holds for those alone)."""
        return self.ramp_bound if self.ramp_bound and fits(self.timed, compute, weight, WHOLE_SCHEME) else 0.0

    def _ticks_below(self, bound: float) -> int:
        """A lower bound in CP-SAT's ticks, rounded down (never stronger than proven)."""
        return max(0, int(math.floor(bound * self.timed.ticks.scale + 1e-6)))

    # ------------------------------------------------------------------ the answer
    def answer(self, family: FamilyResult, elapsed: float) -> Plan:
        """The best candidate as a Plan, with the bounds and the claims of what is proven."""
        objective = self.problem.objective
        best = self.best()
        value = best.value(objective)
        bounds, classes = self.bounds(value)
        relevant = [k for k in bounds if self.contains(classes[k], best)]  # "work" always is
        meeting = [k for k in relevant if bounds[k] >= value - 1e-9]
        if meeting:
            key = min(meeting, key=lambda k: class_breadth(classes[k]))
            proven_for = classes[key]
        else:
            key = max(relevant, key=lambda k: (bounds[k], -class_breadth(classes[k])))
            proven_for = ""
        lower, bound_for = bounds[key], classes[key]
        optimal = bool(proven_for)
        rows = [_row(c, lower, c is best and optimal, objective)
                for c in sorted(self.candidates, key=lambda c: (c.value(objective), c.latency))]
        dropped = [{"strategy": m.label, "reason": m.reason} for m in family.dropped] + self.dropped
        return Plan(
            schedule=best.schedule,
            strategy_name=best.label,
            latency=best.latency,
            lower_bound=float(lower),
            bounds=bounds,
            optimal=optimal,
            model_latency=best.model_latency,
            candidates=rows,
            dropped=dropped,
            elapsed=elapsed,
            replay=best.replay,
            objective=objective,
            objective_value=value,
            proven_for=proven_for,
            bound_for=bound_for,
            bound_classes=classes,
            interrupted=self.interrupted,
        )


BOUND_KEYS = {PAIRED: "cpsat_paired", WHOLE_SCHEME: "cpsat_whole_scheme", EVERY: "cpsat_every_schedule"}
"""Each mapping model's bound, by the class it searches, in :attr:`Plan.bounds`."""

MAX_TICKS = 2**53
"""The longest step, in the integer ticks CP-SAT works in."""


def _timed(problem: PlanProblem) -> TimedProblem:
    """The problem in CP-SAT's integer ticks, refused when the step is too long for CP-SAT's integers."""
    timed = TimedProblem.build(problem)
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


def _ordering_targets(problem: PlanProblem, timed: TimedProblem, members: list[Member], fixed: bool,
                      limit: int):
    """(label, compute, weight, hint ticks) for the mappings whose order CP-SAT improves:
    the first ``limit`` distinct mappings of ``members`` that can run under the memory limits
    (a strategy whose fixed order needs another backward than the plan's, or that holds weights in
    shards, is not one of them)."""
    targets = []
    seen = set()
    for member in members:
        strategy = member.strategy
        if strategy is None or len(targets) >= limit:
            continue
        if unplannable(strategy, problem.split_backward):
            continue
        if member.simulation is not None:
            t = member.simulation.timeline
            rows = rows_of(problem, t)
            compute, weight = t.worker[rows], t.weight_worker[rows]
            hint = _start_ticks(timed, t)
        elif fixed or member.reason.startswith("deadlock"):
            compute, weight = mapping_of(problem, strategy)
            hint = None
        else:
            continue
        key = compute.tobytes() + weight.tobytes()
        if key in seen:
            continue
        seen.add(key)
        if fixed:
            check_mapping_memory(timed, compute, weight)
        else:
            try:
                check_mapping_memory(timed, compute, weight)
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


def replayed(schedule: Schedule, objective: str) -> tuple[Schedule, Simulation]:
    """The better replay of a schedule with release times (its planned starts) and of its orders
    alone (each item as early as its order allows: never later, but under a memory limit it may
    claim room sooner than planned and deadlock), and the schedule that gives it; on a tie, the
    orders alone.  Raises the replay's UniSchedError when neither runs."""
    versions = [schedule.as_soon_as_possible(), schedule] if schedule.release is not None else [schedule]
    best, failure = None, None
    for version in versions:
        try:
            replay = version.simulate()
        except UniSchedError as error:
            failure = failure or error
            continue
        if best is None or objective_value(replay, objective) < objective_value(best[1], objective) - 1e-9:
            best = version, replay
    if best is None:
        raise failure
    return best


def _start_ticks(timed: TimedProblem, t) -> np.ndarray:
    """A replay's start times in CP-SAT's ticks, by item id (a hint or warm start)."""
    return timed.ticks.table(t.start[rows_of(timed.problem, t)])


def _best_incumbent(timed: TimedProblem, candidates: list[Candidate], scheme: str):
    """The shortest candidate that fits the mapping model's class ``scheme``, as its warm start."""
    for candidate in sorted(candidates, key=lambda c: c.latency):
        starts = _start_ticks(timed, candidate.replay.timeline)
        incumbent = incumbent_from(timed, candidate.schedule.compute, candidate.schedule.weight, starts, scheme)
        if incumbent is not None:
            return incumbent
    return None


def _row(candidate: Candidate, lower: float, optimal: bool, objective: str) -> dict:
    row = {"strategy": candidate.label, "source": candidate.source}
    row.update(measures(candidate.replay))
    value = candidate.value(objective)
    if objective != "latency":
        row[objective] = value
    row["gap"] = gap(value, lower)
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
        + "; raise time_limit or memory_limit (--time-limit, --memory-limit), or allow more stages per worker"
    )
