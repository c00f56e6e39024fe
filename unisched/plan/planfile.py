"""The plan: what the planner proposes, and its versioned JSON file.

Format (``"format": "unisched-plan"``, ``"version": 2``)::

    {
      "format": "unisched-plan", "version": 2,
      "shape": {"num_workers": W, "num_stages": S, "num_batches": B},
      "split_backward": false,
      "costs": {...the fields of unisched.Costs...},
      "memory_limit": M or null, "max_stages_per_worker": K or null,
      "strategy": "cpsat mapping",        # what produced it
      "search": "cpsat",                  # which search ran: "cpsat" or "heuristic search"
      "objective": "latency",             # what it minimized: "latency" or "span"
      "objective_value": 68.0,            # that measure of the replay
      "latency": 68.0,                    # the simulator's replay
      "model_latency": 68.0,              # CP-SAT's objective, when a model ran
      "optimal": false,                   # true only when proven over every schedule
      "proven_for": "",                   # the class of schedules an optimality proof covers
      "lower_bound": 48.0, "bound_for": "any schedule", "gap": 0.42,
      "bounds": {"work": 48.0, "critical_path": 12.0, ...},
      "interrupted": false,               # the search was stopped by Ctrl-C
      "mapping": {"0F0": [compute, weight], "0B0": [...], ...},
      "orders": {"0": ["0F0", "0F1", ...], ...},
      "starts": {"0F0": 0.0, "0B0": 9.0, ...},   # each item's start in the replay
      "candidates": [{"strategy": ..., "latency": ..., ...}, ...]
    }

Work items are written as ``{stage}{F|B|I|W}{batch}``.  Loading checks the
format, the version (1 and 2 are read), that the mapping covers exactly the
shape's items, that every order lists exactly its worker's items, and that
the replay of the orders, with the start times as release times (no item
before its start), gives the file's latency and start times.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from unisched import dataflow
from unisched.errors import UniSchedError, read_json
from unisched.costs import Costs
from unisched.metrics import gap, stage_spans
from unisched.render import FORMATS
from unisched.simulate.simulation import Simulation, check_size
from unisched.strategy import Strategy
from unisched.work import Shape, Work, is_whole, positive_count

from unisched.plan.bounds import ANY_SCHEDULE, shape_bounds
from unisched.plan.mapping import class_breadth
from unisched.plan.problem import PlanInputError, PlanProblem
from unisched.plan.schedule import Schedule

FORMAT = "unisched-plan"
VERSION = 2
READABLE_VERSIONS = (1, 2)
"""Version 1 files (no start times, no claims' classes) are still read."""


class PlanFileError(UniSchedError, ValueError):
    """A plan file that cannot be read: malformed, another version, or another shape."""


@dataclass(eq=False)
class Plan:
    """A schedule the simulator replays exactly and the executor runs.

    ``latency`` is the simulator's replay of ``strategy()`` with ``costs``;
    ``lower_bound`` the best bound known, ``optimal`` whether the planner
    proved that no schedule of the searched kind is shorter.
    """

    schedule: Schedule
    strategy_name: str
    latency: float
    lower_bound: float
    bounds: Mapping[str, float]
    optimal: bool = False
    model_latency: float | None = None
    candidates: Sequence[Mapping[str, Any]] = field(default_factory=list)
    dropped: Sequence[Mapping[str, Any]] = field(default_factory=list)
    elapsed: float | None = None
    replay: Simulation | None = field(default=None, repr=False)
    """The simulator's run of ``schedule`` (made once: by the planner, by the loader's check, or here)."""
    objective: str = "latency"
    """What the search minimized: the step's ``"latency"`` or the longest worker busy ``"span"``."""
    objective_value: float | None = None
    """That measure of the replay (None: the latency)."""
    proven_for: str = ""
    """The class of schedules among which this plan is proven best ("" if none):
    :data:`ANY_SCHEDULE`, or a restricted class such as one mapping's orders."""
    bound_for: str = ""
    """The class of schedules ``lower_bound`` holds for ("": not stated, as in version 1 files)."""
    bound_classes: Mapping[str, str] = field(default_factory=dict)
    """The class each of ``bounds`` holds for."""
    interrupted: bool = False
    """Whether the search was stopped (Ctrl-C) before its time limit."""
    search: str = "cpsat"
    """Which search produced the plan."""

    @property
    def problem(self) -> PlanProblem:
        return self.schedule.problem

    @property
    def shape(self) -> Shape:
        return self.problem.shape

    @property
    def costs(self) -> Costs:
        return self.problem.costs

    @property
    def memory_limit(self) -> float | None:
        return self.problem.memory_limit

    @property
    def value(self) -> float:
        """The plan's objective: its latency, or its longest worker busy span."""
        return self.latency if self.objective_value is None else float(self.objective_value)

    @property
    def gap(self) -> float:
        return gap(self.value, self.lower_bound)

    @property
    def optimal_overall(self) -> bool:
        """Whether the plan is proven best among every schedule (not only a restricted class)."""
        return bool(self.optimal) and self.claimed_class() == ANY_SCHEDULE

    def claimed_class(self) -> str:
        """The class an optimality claim covers: ``proven_for``, or for a planner that did not
        say, :data:`ANY_SCHEDULE` only when a bound that holds for every schedule (critical
        path, work) meets the plan, else the planner's searched class."""
        if not self.optimal:
            return ""
        if self.proven_for:
            return self.proven_for
        general = max((self.bounds.get(k, 0.0) for k in ("critical_path", "work")), default=0.0)
        return ANY_SCHEDULE if self.value <= general * (1 + TOLERANCE) else "the planner's searched class"

    def unbeaten_in(self) -> str:
        """The widest restricted class, other than the one claimed, whose proven lower bound the
        plan meets: no schedule of it is shorter, though the plan lies outside it (replicated
        weights as short as the whole scheme's optimum); "" where there is none."""
        claimed = self.claimed_class()
        met = [name for key, name in self.bound_classes.items() if name not in (ANY_SCHEDULE, claimed)
               and self.bounds.get(key, 0.0) >= self.value * (1 - TOLERANCE)]
        return min(met, key=class_breadth, default="")

    def strategy(self) -> Strategy:
        return self.schedule.strategy(description=f"plan found by {self.strategy_name}")

    def simulate(self) -> Simulation:
        if self.replay is None:
            self.replay = self.schedule.simulate()
        return self.replay

    def worker_orders(self) -> dict[int, list[Work]]:
        return self.schedule.worker_orders()

    def starts(self) -> dict[str, float]:
        """Each item's start in the replay, by its name (``"2F0"``)."""
        t = self.simulate().timeline
        return {str(t.work(i)): float(t.start[i]) for i in range(len(t))}

    # ------------------------------------------------------------------ file
    def to_dict(self) -> dict:
        """The plan file's object.  It claims no more than was proven: ``"optimal"`` is
        true only for a proof over every schedule; a proof over a restricted class is
        written as ``"proven_for"`` beside ``"optimal": false``."""
        problem = self.problem
        schedule = self.schedule
        claimed = self.claimed_class()
        return {
            "format": FORMAT,
            "version": VERSION,
            "shape": dict(zip(Shape._fields, map(int, problem.shape))),
            "split_backward": problem.split_backward,
            "costs": problem.costs.to_dict(),
            **{name: getattr(problem, name) for name in PROBLEM_FIELDS if hasattr(problem, name)},
            "strategy": self.strategy_name,
            "search": self.search,
            "objective": self.objective,
            "objective_value": self.value,
            "latency": self.latency,
            "model_latency": self.model_latency,
            "optimal": claimed == ANY_SCHEDULE,
            "proven_for": claimed,
            "lower_bound": self.lower_bound,
            "bound_for": self.bound_for,
            "gap": self.gap,
            "bounds": dict(self.bounds),
            "bound_classes": dict(self.bound_classes),
            "interrupted": self.interrupted,
            "mapping": {
                str(schedule.work(i)): [int(c), int(w)] for i, (c, w) in enumerate(zip(schedule.compute, schedule.weight))
            },
            "orders": {str(w): [str(work) for work in works] for w, works in schedule.worker_orders().items()},
            "starts": self.starts(),
            "candidates": [dict(row) for row in self.candidates],
            "dropped": [dict(row) for row in self.dropped],
        }

    def save(self, path: str | Path) -> None:
        """Write the plan file to ``path`` ending in ``.json``, or draw the plan's replay to one
        ending in one of :data:`PLAN_DRAWINGS` (as :meth:`Simulation.save` does)."""
        if check_plan_path(path) != ".json":
            self.simulate().save(path)
            return
        try:
            Path(path).write_text(json.dumps(jsonable(self.to_dict()), indent=1) + "\n")
        except OSError as error:
            raise PlanFileError(f"cannot write plan file {str(path)!r}: {error.strerror or error}; name a file in a "
                                "folder that exists and that you may write to") from None

    def __repr__(self) -> str:
        W, S, B = self.shape
        claimed = self.claimed_class()
        proof = "" if not claimed else ", optimal" if claimed == ANY_SCHEDULE else f", optimal among {claimed}"
        return (f"<Plan {self.strategy_name} W={W} S={S} B={B}: latency {self.latency:g}, "
                f"lower bound {self.lower_bound:g}{proof}>")


PLAN_DRAWINGS = tuple(suffix for suffix in FORMATS if suffix != ".json")
"""Extensions :meth:`Plan.save` draws the plan's schedule to: :func:`unisched.render.save`'s, but
``.json``, which is the plan file (a Chrome trace of a plan: its replay's ``save``)."""


def check_plan_path(path, said: str | None = None) -> str:
    """What :meth:`Plan.save` writes to ``path``, by its extension (lower case): ``.json`` the
    plan file, one of :data:`PLAN_DRAWINGS` the plan drawn; else an error naming both (and the
    path as ``said``, e.g. the flag that gave it)."""
    suffix = Path(path).suffix.lower()
    if suffix != ".json" and suffix not in PLAN_DRAWINGS:
        shown = f"extension {suffix!r}" if suffix else "no extension"
        said = said or f"cannot save the plan to {str(path)!r}"
        raise PlanFileError(f"{said}: {shown}; write the plan file as .json or draw "
                            f"the plan as {', '.join(PLAN_DRAWINGS)} (a Chrome trace of it: unisched simulate --plan "
                            "plan.json --out trace.json)")
    return suffix


PROBLEM_FIELDS = ("memory_limit", "max_stages_per_worker", "memory_budget", "optimizer_bytes")
"""The limits of :class:`PlanProblem` a plan file keeps (those this version's problem has)."""


def load_plan(path: str | Path, shape: Shape | Sequence[int] | None = None, *, num_workers: int | None = None,
              num_stages: int | None = None) -> Plan:
    """Read a plan file; with ``shape``, also check that it was made for that
    shape; with ``num_workers`` (the world size) or ``num_stages`` (the
    model's stages), that it fits them.

    Nothing in the file is taken on trust: the plan is replayed, and a file
    whose latency, bounds or optimality claim disagree with its replay is
    refused."""
    path = Path(path)
    if shape is not None:
        if isinstance(shape, (str, bytes)) or np.ndim(shape) != 1 or len(shape) != 3:
            raise PlanInputError(f"load_plan: shape must be (W, S, B), got {shape!r}")
        shape = tuple(positive_count(f"shape's {name}", n, "load_plan: ") for name, n in zip("WSB", shape))
    num_workers = None if num_workers is None else positive_count("num_workers", num_workers, "load_plan: ")
    num_stages = None if num_stages is None else positive_count("num_stages", num_stages, "load_plan: ")
    data = read_json(path, "plan file", "write it with `unisched plan --out`", PlanFileError)
    plan = plan_from_dict(data, source=str(path))
    W, S, B = plan.shape
    if shape is not None and tuple(shape) != tuple(plan.shape):
        raise PlanFileError(
            f"plan file {path} is for W={W}, S={S}, B={B} but W={shape[0]}, S={shape[1]}, B={shape[2]} was asked "
            "for; plan again for this shape with `unisched plan --workers ... --stages ... --batches ...`"
        )
    if num_workers is not None and num_workers != W:
        raise PlanFileError(
            f"plan file {path} is for {W} workers but the world has {num_workers}; launch {W} processes, "
            f"or plan again with `unisched plan --workers {num_workers}`"
        )
    if num_stages is not None and num_stages != S:
        raise PlanFileError(
            f"plan file {path} is for a model of {S} stages but the model has {num_stages}; "
            f"plan again with `unisched plan --stages {num_stages}`"
        )
    return plan


def plan_from_dict(data: Any, source: str = "plan") -> Plan:
    """A plan from its JSON object, replayed and checked against what the object claims."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanFileError(f"{source} is not a unisched plan file (expected \"format\": \"{FORMAT}\")")
    if data.get("version") not in READABLE_VERSIONS:
        raise PlanFileError(
            f"{source} is a version {data.get('version')!r} plan file; this unisched reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}: plan again with this version"
        )
    for name in ("shape", "costs", "mapping", "orders"):
        if not isinstance(data.get(name), dict):
            raise PlanFileError(f"{source} is malformed: {name!r} must be a JSON object")
    split = _flag(data, "split_backward", source)
    shape = _shape(data["shape"], source)
    try:
        check_size(shape, split)
    except UniSchedError as error:
        raise PlanFileError(f"{source}: {error}") from None
    try:
        costs = Costs.from_dict(data["costs"]).check(shape.num_workers, shape.num_stages)
        problem = PlanProblem(shape, costs, split_backward=split, **_problem_fields(data))
    except UniSchedError as error:
        raise PlanFileError(f"{source} describes an impossible problem: {error}") from error
    except (TypeError, ValueError) as error:
        raise PlanFileError(f"{source} is malformed: bad costs or limits ({type(error).__name__}: {error})") from error
    name = data.get("strategy", "plan")
    if not isinstance(name, str):
        raise PlanFileError(f"{source} is malformed: 'strategy' must be a string, got {name!r}")
    claims = {key: _number(data, key, source, optional=key != "latency")
              for key in ("latency", "model_latency", "lower_bound")}
    bounds = _object(data, "bounds", source, "numbers")
    bounds = {str(k): _number(bounds, k, source, where="bounds") for k in bounds}
    bound_classes = _object(data, "bound_classes", source, "strings (the class of schedules each bound holds for)")
    bound_classes = {str(k): _text(bound_classes, k, source, "", where="bound_classes") for k in bound_classes}
    optimal = _flag(data, "optimal", source)
    texts = {key: _text(data, key, source, default) for key, default in
             (("objective", "latency"), ("proven_for", ""), ("bound_for", ""), ("search", "cpsat"))}
    if texts["objective"] not in OBJECTIVES:
        raise PlanFileError(f"{source} is malformed: 'objective' must be one of {', '.join(OBJECTIVES)}, "
                            f"got {texts['objective']!r}")
    candidates = _rows(data, "candidates", ("strategy", "source"), source, CANDIDATE_NUMBERS)
    dropped = _rows(data, "dropped", ("strategy", "reason"), source)
    schedule = _schedule(problem, data["mapping"], data["orders"], source, name)
    if data.get("version", 1) >= 2 and data.get("starts") is None:
        raise PlanFileError(f"{source} is a version {data['version']} plan file without its 'starts' (the planned "
                            "start times, which a replay of its orders keeps to); the file was edited: plan again")
    starts = _starts(problem, data.get("starts"), source)
    if starts is not None:
        schedule = replace(schedule, release=starts)  # replay at the planned times (Schedule.planned)
    replay = _replay(schedule, source, starts is not None)
    latency = float(replay.latency)
    value = objective_value(replay, texts["objective"])
    optimal = optimal or bool(texts["proven_for"])  # optimal within that class
    _check_claims(source, latency, claims["latency"], value, claims["lower_bound"] or 0.0, bounds, optimal)
    _check_shape_bounds(source, problem, bounds)
    if starts is not None:
        _check_starts(source, replay, starts)
    return Plan(
        schedule=schedule,
        strategy_name=name,
        latency=latency,
        lower_bound=claims["lower_bound"] or 0.0,
        bounds=bounds,
        optimal=optimal,
        model_latency=claims["model_latency"],
        candidates=candidates,
        dropped=dropped,
        replay=replay,
        objective=texts["objective"],
        objective_value=value,
        proven_for=texts["proven_for"],
        bound_for=texts["bound_for"],
        bound_classes=bound_classes,
        interrupted=_flag(data, "interrupted", source),
        search=texts["search"],
    )


OBJECTIVES = ("latency", "span")
"""What a plan may have minimized (:attr:`Plan.objective`)."""


def objective_value(sim: Simulation, objective: str) -> float:
    """A replay's latency, or its longest worker busy span (first item's start to last item's end)."""
    if objective == "latency":
        return float(sim.latency)
    return float(stage_spans(sim.timeline).max(initial=0.0))


def _problem_fields(data: Mapping) -> dict:
    """The limits the file gives that this version's :class:`PlanProblem` takes (lists as tuples)."""
    known = {f.name for f in fields(PlanProblem)}
    given = {}
    for name in PROBLEM_FIELDS + ("objective",):
        if name in known and data.get(name) is not None:
            value = data[name]
            given[name] = tuple(value) if isinstance(value, list) else value
    return given


def _text(data: Mapping, key: str, source: str, default: str, where: str = "") -> str:
    value = data.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        name = f"{where}.{key}" if where else key
        raise PlanFileError(f"{source} is malformed: {name!r} must be a string, got {value!r:.80}")
    return value


def _flag(data: Mapping, key: str, source: str) -> bool:
    """A true/false field (false when absent)."""
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise PlanFileError(f"{source} is malformed: {key!r} must be true or false, got {value!r:.80}")
    return value


def _object(data: Mapping, key: str, source: str, of: str) -> dict:
    """A JSON object field ({} when absent or null)."""
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PlanFileError(f"{source} is malformed: {key!r} must be a JSON object of {of}, got {value!r:.80}")
    return value


def _starts(problem: PlanProblem, starts: Any, source: str) -> np.ndarray | None:
    """The file's start times by item id (version 2), or None (version 1)."""
    if starts is None:
        return None
    if not isinstance(starts, dict):
        raise PlanFileError(f"{source} is malformed: 'starts' must be a JSON object of item: start time")
    times = np.full(problem.num_items, np.nan)
    for text, value in starts.items():
        times[_item(problem, text, source)] = _number(starts, text, source, where="starts")
    if np.isnan(times).any():
        first = problem.items.work(int(np.flatnonzero(np.isnan(times))[0]))
        raise PlanFileError(f"{source}: 'starts' lacks the start time of {first}; the file is damaged: plan again")
    return times


def _check_starts(source: str, replay: Simulation, starts: np.ndarray) -> None:
    """The orders must reproduce the start times the file keeps."""
    t = replay.timeline
    items = dataflow.Items(t.num_stages, t.num_batches, t.split_backward)
    ids = items.id(t.batch, t.stage, t.direction)
    slack = TOLERANCE * max(1.0, float(np.abs(starts).max(initial=0.0)))
    differ = np.flatnonzero(np.abs(t.start - starts[ids]) > slack)
    if len(differ):
        i = int(differ[0])
        raise PlanFileError(
            f"{source} says {t.work(i)} starts at {starts[ids[i]]:g} but its orders replay it at {t.start[i]:g} "
            f"({len(differ)} start time(s) differ); the file was edited or made with other costs: plan again"
        )


TOLERANCE = 1e-9
"""Relative difference allowed between a file's latency and its replay (float round-off)."""


def _replay(schedule: Schedule, source: str, timed: bool = False) -> Simulation:
    try:
        replay = schedule.simulate()
    except UniSchedError as error:
        cause = ("its orders and start times cannot run together under its limits" if timed
                 else "the file was edited or damaged, or its schedule needs the start times a version 2 file keeps")
        first = str(error).splitlines()[0].rstrip(".")
        raise PlanFileError(f"{source} cannot be replayed: {first}; {cause}: plan again") from None
    latency = float(replay.latency)
    if not (math.isfinite(latency) and latency >= 0):
        raise PlanFileError(f"{source} replays to latency {latency!r}; plan again")
    return replay


def _check_claims(source: str, latency: float, claimed: float, value: float, lower_bound: float,
                  bounds: Mapping[str, float], optimal: bool) -> None:
    """What the file says about its schedule must be what the replay shows (``value``: the
    replay's objective, which the bounds are bounds of)."""
    slack = TOLERANCE * max(1.0, abs(latency))
    if abs(claimed - latency) > slack:
        raise PlanFileError(
            f"{source} says its latency is {claimed:g} but its schedule replays to {latency:g}; the file was edited "
            "or made with other costs: plan again (`unisched plan ... --out`)"
        )
    for name, bound in (("lower_bound", lower_bound), *((f"bounds.{k}", v) for k, v in bounds.items())):
        if bound > value + slack:
            raise PlanFileError(
                f"{source} claims a lower bound {name} = {bound:g} above its own replayed value {value:g}, "
                "which no bound can be; the file was edited: plan again"
            )
    if optimal and lower_bound < value - slack:
        raise PlanFileError(
            f"{source} claims to be optimal but its lower bound {lower_bound:g} is below its value {value:g} "
            "(the planner claims optimality only when a bound reaches it); the file was edited: plan again"
        )


def _check_shape_bounds(source: str, problem: PlanProblem, bounds: Mapping[str, float]) -> None:
    """The work and critical-path bounds (the shape's and its costs' alone) are worked out again: a
    file that states more than its problem gives had its shape or costs edited after planning (and
    its optimality was proven for another problem).  Less is no false claim (an earlier unisched
    worked out some bounds more loosely).  A plan of one strategy's mapping keeps that mapping's
    memory-time bound under the same name, so that one is not compared."""
    again = shape_bounds(problem)
    for name in ("work", "critical_path"):
        bound = again.get(name)
        if bound is not None and name in bounds and bounds[name] > bound + TOLERANCE * max(1.0, abs(bound)):
            raise PlanFileError(
                f"{source} says its bound {name} is {bounds[name]:g} but its problem gives only {bound:g}; the "
                "file's shape or costs were edited after planning: plan again (`unisched plan ... --out`)"
            )


def _shape(fields: Mapping, source: str) -> Shape:
    if set(fields) != set(Shape._fields):
        raise PlanFileError(f"{source} is malformed: 'shape' must have exactly the fields {list(Shape._fields)}, "
                            f"got {sorted(fields)}")
    for key, value in fields.items():
        if not is_whole(value):
            raise PlanFileError(f"{source} is malformed: shape.{key} must be a positive integer, got {value!r}")
    return Shape(**{k: fields[k] for k in Shape._fields})


def _number(data: Mapping, key: str, source: str, optional: bool = False, where: str = "") -> float | None:
    value = data.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1e300 < value < 1e300:
        name = f"{where}.{key}" if where else key
        raise PlanFileError(f"{source} is malformed: {name!r} must be a finite number, got {value!r}")
    return float(value)


CANDIDATE_NUMBERS = ("latency", "bubble", "peak_activations", "traffic", "gap", "model_latency")
"""The numbers (or nulls) of a row of the candidates table."""


def _rows(data: Mapping, key: str, text_fields: Sequence[str], source: str, numbers: Sequence[str] = ()) -> list[dict]:
    """The table of candidates (or of dropped strategies): a list of JSON objects."""
    rows = data.get(key)
    if rows is None:
        return []
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise PlanFileError(f"{source} is malformed: {key!r} must be a list of JSON objects, got {rows!r:.80}")
    for row in rows:
        for name in text_fields:
            if not isinstance(row.get(name), str):
                raise PlanFileError(f"{source} is malformed: every row of {key!r} needs a string {name!r}, "
                                    f"got {row!r:.80}")
        for name in numbers:
            value = row.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not -1e300 < value < 1e300):
                raise PlanFileError(f"{source} is malformed: {key}[].{name} must be a finite number, got {value!r:.80}")
    return [dict(row) for row in rows]


def _schedule(problem: PlanProblem, mapping: Any, orders: Any, source: str, name: str) -> Schedule:
    W, S, B = problem.shape
    n = problem.num_items
    compute = np.full(n, -1, dtype=np.int64)
    weight = np.full(n, -1, dtype=np.int64)
    if not isinstance(mapping, dict) or not isinstance(orders, dict):
        raise PlanFileError(f"{source} is malformed: 'mapping' and 'orders' must be JSON objects")
    for text, pair in mapping.items():
        item = _item(problem, text, source)
        if not (isinstance(pair, list) and len(pair) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < W for v in pair)):
            raise PlanFileError(
                f"{source}: mapping of {text} must be [compute worker, weight worker] in 0..{W - 1}, got {pair!r}"
            )
        if compute[item] >= 0:
            raise PlanFileError(f"{source}: the mapping gives {text} twice (as another spelling of the same item)")
        compute[item], weight[item] = pair
    missing = np.flatnonzero(compute < 0)
    if len(missing):
        raise PlanFileError(
            f"{source} is for another shape: its mapping lacks {len(missing)} of the {n} work items of "
            f"W={W}, S={S}, B={B} (first: {Schedule(problem, compute, weight, {}).work(int(missing[0]))})"
        )
    parsed: dict[int, list[int]] = {}
    seen = np.zeros(n, dtype=bool)
    for key, texts in orders.items():
        try:
            w = int(key)
        except ValueError:
            raise PlanFileError(f"{source}: orders key {key!r} is not a worker number") from None
        if not 0 <= w < W:
            raise PlanFileError(f"{source}: orders names worker {key!r}, but workers are 0..{W - 1}")
        if not isinstance(texts, list):
            raise PlanFileError(f"{source}: the order of worker {key} must be a list of work items, got {texts!r:.80}")
        items = [_item(problem, t, source) for t in texts]
        for item in items:
            if compute[item] != w or seen[item]:
                raise PlanFileError(
                    f"{source}: worker {w}'s order lists {texts[items.index(item)]}, which the mapping gives to worker "
                    f"{compute[item]} or which is listed twice"
                )
            seen[item] = True
        parsed[w] = items
    if not seen.all():
        first = Schedule(problem, compute, weight, {}).work(int(np.flatnonzero(~seen)[0]))
        raise PlanFileError(f"{source}: {first} is in the mapping but in no worker's order")
    return Schedule(problem, compute, weight, parsed, name)


def _item(problem: PlanProblem, text: Any, source: str) -> int:
    W, S, B = problem.shape
    try:
        work = Work.parse(str(text))
        ok = 0 <= work.batch < B and 0 <= work.stage < S and work.direction in problem.dirs
    except (ValueError, IndexError):
        ok = False
    if not ok:
        raise PlanFileError(
            f"{source}: {text!r} is not a work item of W={W}, S={S}, B={B} (expected e.g. '0F0'); "
            "the file is for another shape or is damaged"
        )
    return int(problem.items.id(work.batch, work.stage, work.direction))


def jsonable(value):
    """Plain JSON values: numpy scalars as Python numbers, infinities as null."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


__all__ = ["ANY_SCHEDULE", "FORMAT", "PLAN_DRAWINGS", "Plan", "PlanFileError", "VERSION", "check_plan_path", "load_plan",
           "objective_value", "plan_from_dict"]
