"""Looped pipelines: more stages than workers per batch.

Workers form G groups of R; batch b goes to group (b mod G) and within the
group stage s runs on member s mod R, so each worker computes S / R stages of
every batch it sees: h(s, b) = (R b mod W) + (s mod R).  The fully sharded
variant keeps stage s's weights on h(s, s) only, and fetches them.  The
breadth-first looped pipeline (PyTorch's LoopedBFS) puts stage s on worker
s mod W and runs each stage for all micro-batches before the next.
"""

from __future__ import annotations

import numpy as np

from unisched.policies._orders import KeyPriority
from unisched.policies._registry import Entry, Param, divisors, require, require_count
from unisched.policies.pipeline import stage_modulo_workers
from unisched.strategy import Strategy
from unisched.work import FORWARD, ComputeAndWeightWorkers, Shape, Work


def looped(num_workers: int, num_stages: int, num_batches: int, group_size: int | None = None) -> Strategy:
    """G = W / R groups of R workers; batch b on group b mod G, stage s on its member s mod R."""
    shape, R = _looped_shape("looped", num_workers, num_stages, num_batches, group_size)
    h = _h(R, num_workers)

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        worker = h(work.stage, work.batch)
        return ComputeAndWeightWorkers(worker, worker)

    def map_arrays(batch, stage, direction):
        worker = h(np.asarray(stage), np.asarray(batch))
        return worker, worker

    return Strategy(mapping, name="looped", description=LOOPED.description, shape=shape,
                    params={"group_size": R}, map_arrays=map_arrays)


def fully_sharded_looped(num_workers: int, num_stages: int, num_batches: int,
                         group_size: int | None = None) -> Strategy:
    """Looped PP's compute workers; stage s's weights only on h(s, s)."""
    shape, R = _looped_shape("fully_sharded_looped", num_workers, num_stages, num_batches, group_size)
    h = _h(R, num_workers)

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        return ComputeAndWeightWorkers(h(work.stage, work.batch), h(work.stage, work.stage))

    def map_arrays(batch, stage, direction):
        stage = np.asarray(stage)
        return h(stage, np.asarray(batch)), h(stage, stage)

    return Strategy(mapping, name="fully_sharded_looped", description=FULLY_SHARDED_LOOPED.description,
                    shape=shape, params={"group_size": R}, map_arrays=map_arrays)


def looped_bfs(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """Stage s on worker s mod W; every forward before any backward, lowest stage first forward,
    highest stage first backward."""
    num_workers, num_stages, num_batches = shape = Shape(num_workers, num_stages, num_batches).check()
    require(num_stages % num_workers == 0, "looped_bfs",
            f"puts stages s, s + W, ... on worker s, so S must be a multiple of W; got S={num_stages}, "
            f"W={num_workers}")

    mapping, map_arrays = stage_modulo_workers(num_workers)

    def keys(batch, stage, direction):
        leads_to_backward = (direction != FORWARD) | (stage == num_stages - 1)
        # a trigger at stage t leads to stage t + 1 forward, or t - 1 backward;
        # the last forward leads to the last stage's backward.
        target = np.where(leads_to_backward, np.where(direction == FORWARD, num_stages, stage), stage)
        return leads_to_backward.astype(np.int64), np.where(leads_to_backward, -target, target), batch

    priority = KeyPriority(keys, "breadth first: all forwards by stage, then all backwards from the last stage")
    return Strategy(mapping, name="looped_bfs", description=LOOPED_BFS.description, priority=priority,
                    shape=shape, map_arrays=map_arrays)


def _h(R: int, W: int):
    def h(stage, batch):
        return (R * batch) % W + stage % R

    return h


def _looped_shape(name: str, W: int, S: int, B: int, group_size: int | None) -> tuple[Shape, int]:
    W, S, B = shape = Shape(W, S, B).check()
    require_count(group_size, name, "group_size")
    R = group_size if group_size is not None else max(d for d in divisors(W) if d <= S)
    require(W % R == 0, name,
            f"W={W} workers cannot form groups of group_size={R}; use a divisor of {W}: "
            f"{', '.join(map(str, divisors(W)))}")
    require(R <= S, name,
            f"a group of {R} workers needs at least {R} stages, got S={S}; use group_size <= {S}")
    return shape, R


def _looped_grid(shape: Shape):
    for R in divisors(shape.num_workers):
        if R <= shape.num_stages:
            yield {"group_size": R}


_GROUP_SIZE = Param("group_size", None,
                    "R, workers per group (G = W / R groups); default: the largest divisor of W that is <= S")

LOOPED = Entry(
    name="looped",
    factory=looped,
    description="looped pipeline: G groups of R workers, batch b on group b mod G, stage s on member s mod R",
    family="looped",
    constraints="W = G R, R <= S",
    params=(_GROUP_SIZE,),
    grid=_looped_grid,
)
FULLY_SHARDED_LOOPED = Entry(
    name="fully_sharded_looped",
    factory=fully_sharded_looped,
    description="looped pipeline with stage s's weights only on worker h(s, s), fetched by the others",
    family="looped",
    constraints="W = G R, R <= S",
    params=(_GROUP_SIZE,),
    grid=_looped_grid,
)
LOOPED_BFS = Entry(
    name="looped_bfs",
    factory=looped_bfs,
    description="breadth-first looped pipeline: stage s on worker s mod W, each stage for all micro-batches in turn",
    family="looped",
    constraints="S a multiple of W",
)

STRATEGIES = (LOOPED, FULLY_SHARDED_LOOPED, LOOPED_BFS)
