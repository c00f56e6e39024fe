"""Lower bounds reported beside every answer, so a plan says how good it is.

- critical path: one micro-batch's forwards then backwards along the longest
  path of the stage graph, on the fastest worker;
- work / W: all work spread perfectly over all workers;
- memory-time: the input of (stage s, batch b) lives at least from F(s, b)'s
  start to its backward's end, i.e. through the forwards and backwards of
  every stage downstream of s; W workers holding M each give at most W M of "live memory" per
  unit of time (the paper's throughput bound rho <= M / S, made exact);
- CP-SAT's own bound, when a model ran.

For a fixed mapping the same ideas apply per worker: its own work, and the
memory-time of the stashes it keeps against its own limit.
"""

from __future__ import annotations

import numpy as np

from unisched import dataflow
from unisched.plan.problem import PlanProblem
from unisched.simulate.simulation import downstream_paths
from unisched.work import BACKWARD_WEIGHT, FORWARD


def shape_bounds(problem: PlanProblem) -> dict[str, float]:
    """Bounds no mapping or order can beat."""
    W, S, B = problem.shape
    costs = problem.costs
    durations = costs.durations(S)
    speeds = costs.speeds(W)
    per_stage = sum(durations[d] for d in problem.dirs)
    bounds = {
        "critical_path": float(_downstream(problem).max() / speeds.max()),
        "work": float(B * per_stage.sum() / speeds.sum()),
    }
    if problem.memory_limit:
        live = _live_time(problem) / speeds.max()
        bounds["memory_time"] = float(B * (live * problem.stash_sizes).sum() / (W * problem.memory_limit))
    return bounds


def mapping_bounds(problem: PlanProblem, compute: np.ndarray) -> dict[str, float]:
    """Bounds for one fixed mapping (``compute`` over the simulator's item ids)."""
    W, S, B = problem.shape
    costs = problem.costs
    batch, stage, direction = problem.items.arrays()
    speeds = costs.speeds(W)
    seconds = costs.item_time(stage, direction, compute, S, W)
    bounds = shape_bounds(problem)
    bounds["busiest_worker"] = float(np.bincount(compute, weights=seconds, minlength=W).max())
    if problem.memory_limit:
        keeper = direction == dataflow.first_backward(problem.split_backward)
        live = _live_time(problem) / speeds.max()
        held = np.bincount(compute[keeper], weights=(live * problem.stash_sizes)[stage[keeper]], minlength=W)
        bounds["memory_time"] = float(held.max() / problem.memory_limit)
    return bounds


def _live_time(problem: PlanProblem) -> np.ndarray:
    """Shortest time a stash of each stage is held (forward start to releasing backward end)."""
    later = _downstream(problem)
    if problem.split_backward:
        durations = problem.costs.durations(problem.shape.num_stages)
        later = later + (1.0 - problem.costs.input_grad_frees) * durations[BACKWARD_WEIGHT]
    return later


def _downstream(problem: PlanProblem) -> np.ndarray:
    """Per stage: :func:`unisched.simulate.simulation.downstream_paths` with
    the forward and the first backward pass."""
    durations = problem.costs.durations(problem.shape.num_stages)
    first = dataflow.first_backward(problem.split_backward)
    return downstream_paths(problem.stage_graph, durations[FORWARD], durations[first])
