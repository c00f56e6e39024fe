"""A schedule as the planner hands it on: each item's workers and each worker's
order, and the strategy the simulator replays it as (under the stash limits
its mapping leaves each worker: :meth:`PlanProblem.stash_limits`).

A CP-SAT solution also keeps its planned start times as release times
(:meth:`Schedule.planned`): the simulator starts no item before its release,
so the replay keeps the planned times instead of running each item as early
as its order allows (which, under a memory limit, may claim a stash's room
on another worker sooner than planned and deadlock)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np

from unisched.dataflow import depths
from unisched.simulate import simulate
from unisched.simulate.simulation import Simulation
from unisched.strategy import Strategy, fixed_strategy
from unisched.work import Work

from unisched.plan.problem import PlanProblem, TimedProblem


@dataclass(frozen=True, eq=False)
class Schedule:
    """Workers per item (the simulator's item ids) and each worker's sequence of item ids."""

    problem: PlanProblem
    compute: np.ndarray
    weight: np.ndarray
    orders: Mapping[int, Sequence[int]]
    name: str = "cpsat"
    release: np.ndarray | None = None
    """Per item id: the earliest time the replay may start it (None: as early as its order allows)."""

    @classmethod
    def planned(cls, timed: TimedProblem, compute, weight, starts, name: str = "cpsat") -> "Schedule":
        """A CP-SAT solution: orders read off its start ticks, which (in time units) are also its
        release times, so that its replay keeps the planned times."""
        release = np.asarray(starts, dtype=float) / timed.ticks.scale
        return cls.from_starts(timed.problem, compute, weight, starts, name, release=release)

    def as_soon_as_possible(self) -> "Schedule":
        """The same orders without release times: each item as early as its order allows."""
        return replace(self, release=None)

    @classmethod
    def from_starts(cls, problem: PlanProblem, compute, weight, starts, name: str = "cpsat",
                    release=None) -> "Schedule":
        """Orders read off start times; items starting together (zero-time passes) go in
        the order of their dependencies (:func:`unisched.dataflow.depths`), then by id."""
        compute = np.asarray(compute, dtype=np.int64)
        starts = np.asarray(starts, dtype=float)
        depth = depths(problem.items, problem.stage_graph)
        orders = {}
        for w in range(problem.shape.num_workers):
            rows = np.flatnonzero(compute == w)
            orders[w] = rows[np.lexsort((rows, depth[rows], starts[rows]))].tolist()
        release = None if release is None else np.asarray(release, dtype=float)
        return cls(problem, compute, np.asarray(weight, dtype=np.int64), orders, name, release)

    def work(self, item: int) -> Work:
        return self.problem.items.work(item)

    def worker_orders(self) -> dict[int, list[Work]]:
        return {w: [self.work(i) for i in order] for w, order in self.orders.items()}

    def memory_limit(self):
        """The stash limit of each worker under this mapping (one number when all agree; None: none)."""
        return self.problem.stash_limits(self.compute, self.weight)

    def strategy(self, description: str = "") -> Strategy:
        """The strategy the simulator and the executor replay this schedule as."""
        problem = self.problem
        return fixed_strategy(
            problem.shape,
            self.compute,
            self.weight,
            self.worker_orders(),
            split_backward=problem.split_backward,
            stage_graph=problem.stage_graph,
            memory_limit=self.memory_limit(),
            release=self.release,
            name=self.name,
            description=description or "a plan: fixed workers and a fixed order of work on each worker",
        )

    def simulate(self) -> Simulation:
        W, S, B = self.problem.shape
        return simulate(W, S, B, self.strategy(), costs=self.problem.costs, memory_limit=self.memory_limit(),
                        split_backward=self.problem.split_backward)
