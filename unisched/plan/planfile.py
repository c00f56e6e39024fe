"""The plan: what the planner proposes, and its versioned JSON file.

Format (``"format": "unisched-plan"``, ``"version": 1``)::

    {
      "format": "unisched-plan", "version": 1,
      "shape": {"num_workers": W, "num_stages": S, "num_batches": B},
      "split_backward": false,
      "costs": {...the fields of unisched.Costs...},
      "memory_limit": M or null, "max_stages_per_worker": K or null,
      "strategy": "cpsat mapping",        # what produced it
      "latency": 68.0,                    # the simulator's replay
      "model_latency": 68.0,              # CP-SAT's objective, when a model ran
      "optimal": false, "lower_bound": 48.0,
      "bounds": {"work": 48.0, "critical_path": 12.0, ...},
      "mapping": {"0F0": [compute, weight], "0B0": [...], ...},
      "orders": {"0": ["0F0", "0F1", ...], ...},
      "candidates": [{"strategy": ..., "latency": ..., ...}, ...]
    }

Work items are written as ``{stage}{F|B|I|W}{batch}``.  Loading checks the
format, the version, that the mapping covers exactly the shape's items and
that every order lists exactly its worker's items.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from unisched.errors import UniSchedError
from unisched.costs import Costs
from unisched.simulate.simulation import Simulation
from unisched.strategy import Strategy
from unisched.work import Shape, Work

from unisched.plan.problem import PlanProblem
from unisched.plan.schedule import Schedule

FORMAT = "unisched-plan"
VERSION = 1


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
    def gap(self) -> float:
        return (self.latency - self.lower_bound) / self.lower_bound if self.lower_bound > 0 else 0.0

    def strategy(self) -> Strategy:
        return self.schedule.strategy(description=f"plan found by {self.strategy_name}")

    def simulate(self) -> Simulation:
        return self.schedule.simulate()

    def worker_orders(self) -> dict[int, list[Work]]:
        return self.schedule.worker_orders()

    # ------------------------------------------------------------------ file
    def to_dict(self) -> dict:
        problem = self.problem
        schedule = self.schedule
        return {
            "format": FORMAT,
            "version": VERSION,
            "shape": dict(zip(Shape._fields, map(int, problem.shape))),
            "split_backward": problem.split_backward,
            "costs": problem.costs.to_dict(),
            "memory_limit": problem.memory_limit,
            "max_stages_per_worker": problem.max_stages_per_worker,
            "strategy": self.strategy_name,
            "latency": self.latency,
            "model_latency": self.model_latency,
            "optimal": self.optimal,
            "lower_bound": self.lower_bound,
            "bounds": dict(self.bounds),
            "mapping": {
                str(schedule.work(i)): [int(c), int(w)] for i, (c, w) in enumerate(zip(schedule.compute, schedule.weight))
            },
            "orders": {str(w): [str(work) for work in works] for w, works in schedule.worker_orders().items()},
            "candidates": [dict(row) for row in self.candidates],
            "dropped": [dict(row) for row in self.dropped],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(jsonable(self.to_dict()), indent=1) + "\n")

    def __repr__(self) -> str:
        W, S, B = self.shape
        return (f"<Plan {self.strategy_name} W={W} S={S} B={B}: latency {self.latency:g}, "
                f"lower bound {self.lower_bound:g}{', optimal' if self.optimal else ''}>")


def load_plan(path: str | Path, shape: Shape | Sequence[int] | None = None) -> Plan:
    """Read a plan file; with ``shape``, also check that it was made for that shape."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise PlanFileError(f"cannot read plan file {path}: {error}") from error
    except json.JSONDecodeError as error:
        raise PlanFileError(f"plan file {path} is not valid JSON: {error}; write it with `unisched plan --out`") from error
    plan = plan_from_dict(data, source=str(path))
    if shape is not None and tuple(shape) != tuple(plan.shape):
        W, S, B = plan.shape
        raise PlanFileError(
            f"plan file {path} is for W={W}, S={S}, B={B} but W={shape[0]}, S={shape[1]}, B={shape[2]} was asked "
            "for; plan again for this shape with `unisched plan --workers ... --stages ... --batches ...`"
        )
    return plan


def plan_from_dict(data: Any, source: str = "plan") -> Plan:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanFileError(f"{source} is not a unisched plan file (expected \"format\": \"{FORMAT}\")")
    if data.get("version") != VERSION:
        raise PlanFileError(
            f"{source} is a version {data.get('version')!r} plan file; this unisched reads version {VERSION}: "
            "plan again with this version"
        )
    for name in ("shape", "costs", "mapping", "orders"):
        if not isinstance(data.get(name), dict):
            raise PlanFileError(f"{source} is malformed: {name!r} must be a JSON object")
    try:
        shape = Shape(**{k: int(v) for k, v in data["shape"].items()})
        problem = PlanProblem(
            shape,
            Costs.from_dict(data["costs"]),
            memory_limit=data.get("memory_limit"),
            max_stages_per_worker=data.get("max_stages_per_worker"),
            split_backward=bool(data.get("split_backward", False)),
        )
        mapping, orders = data["mapping"], data["orders"]
        latency = float(data["latency"])
        lower_bound = float(data.get("lower_bound") or 0.0)
    except (KeyError, TypeError, ValueError) as error:
        if isinstance(error, UniSchedError):
            raise PlanFileError(f"{source} describes an impossible problem: {error}") from error
        raise PlanFileError(f"{source} is malformed: missing or bad field ({type(error).__name__}: {error})") from error
    schedule = _schedule(problem, mapping, orders, source, data.get("strategy", "plan"))
    return Plan(
        schedule=schedule,
        strategy_name=str(data.get("strategy", "plan")),
        latency=latency,
        lower_bound=lower_bound,
        bounds={k: float(v) for k, v in (data.get("bounds") or {}).items()},
        optimal=bool(data.get("optimal", False)),
        model_latency=data.get("model_latency"),
        candidates=list(data.get("candidates") or []),
        dropped=list(data.get("dropped") or []),
    )


def _schedule(problem: PlanProblem, mapping: Any, orders: Any, source: str, name: str) -> Schedule:
    W, S, B = problem.shape
    n = problem.num_items
    compute = np.full(n, -1, dtype=np.int64)
    weight = np.full(n, -1, dtype=np.int64)
    if not isinstance(mapping, dict) or not isinstance(orders, dict):
        raise PlanFileError(f"{source} is malformed: 'mapping' and 'orders' must be JSON objects")
    for text, pair in mapping.items():
        item = _item(problem, text, source)
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, int) and 0 <= v < W for v in pair)):
            raise PlanFileError(f"{source}: mapping of {text} must be [compute worker, weight worker] in 0..{W - 1}, got {pair!r}")
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
        if not 0 <= w < W or not isinstance(texts, list):
            raise PlanFileError(f"{source}: orders names worker {key!r}, but workers are 0..{W - 1}")
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


__all__ = ["FORMAT", "Plan", "PlanFileError", "VERSION", "load_plan", "plan_from_dict"]
