"""The paper's new pipelines, which move backward passes to workers with
spare activation memory.

In a pipeline the input of stage s is held about 2(S - s) + 1 steps, so the
early stages' workers run out of memory first.  The stash lives on the
backward's worker, so moving a backward moves its memory:

- Cuckoo: the backwards of early stages for early batches go to the mirror
  worker W - s - 1 (a late stage's worker, which holds little);
- Overflow: extra workers beyond one per stage take over the backwards of
  the early stages.
"""

from __future__ import annotations

import numpy as np

from unisched.policies._registry import Entry, Param, StrategyParameterError, require, require_count
from unisched.strategy import Strategy
from unisched.work import FORWARD, ComputeAndWeightWorkers, Shape, Work


def cuckoo(num_workers: int, num_stages: int, num_batches: int,
           stage_cutoff: int | None = None, batch_cutoff: int | None = None) -> Strategy:
    """GPipe, except B(s, b) with s < stage_cutoff and b < batch_cutoff runs on worker W - s - 1."""
    num_workers, num_stages, num_batches = shape = Shape(num_workers, num_stages, num_batches).check()
    require(num_workers == num_stages, "cuckoo",
            f"starts from GPipe's one stage per worker (W = S), got W={num_workers}, S={num_stages}; "
            f"set the number of workers to {num_stages}")
    stage_cutoff = num_stages // 2 + 2 if stage_cutoff is None else stage_cutoff
    batch_cutoff = max(0, num_batches // 2 - 2) if batch_cutoff is None else batch_cutoff
    for label, value in (("stage_cutoff", stage_cutoff), ("batch_cutoff", batch_cutoff)):
        if not isinstance(value, int) or value < 0:  # whatever the shape: a bad value, not a misfit
            raise StrategyParameterError(
                f"strategy 'cuckoo': {label} must be an integer >= 0 (0: no backward moves), got {value!r}")
    W = num_workers

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        if work.direction != FORWARD and work.stage < stage_cutoff and work.batch < batch_cutoff:
            return ComputeAndWeightWorkers(W - work.stage - 1, work.stage)
        return ComputeAndWeightWorkers(work.stage, work.stage)

    def map_arrays(batch, stage, direction):
        stage = np.asarray(stage)
        moved = (np.asarray(direction) != FORWARD) & (stage < stage_cutoff) & (np.asarray(batch) < batch_cutoff)
        return np.where(moved, W - stage - 1, stage), stage

    return Strategy(mapping, name="cuckoo", description=CUCKOO.description, shape=shape,
                    params={"stage_cutoff": stage_cutoff, "batch_cutoff": batch_cutoff}, map_arrays=map_arrays)


def overflow(num_workers: int, num_stages: int, num_batches: int, stages: int | None = None) -> Strategy:
    """GPipe on workers 0..S-1; B(s, b) for the first ``stages`` stages on extra worker S + (s mod E)."""
    num_workers, num_stages, num_batches = shape = Shape(num_workers, num_stages, num_batches).check()
    require_count(stages, "overflow", "stages")  # before the shape: a bad value on any
    extra = num_workers - num_stages
    require(extra >= 1, "overflow",
            f"needs extra workers beyond one per stage (W > S), got W={num_workers}, S={num_stages}; "
            f"use W = S + E with E >= 1 extra workers, e.g. W={num_stages + 1}")
    stages = min(extra, num_stages) if stages is None else stages
    require(stages <= num_stages, "overflow",
            f"stages (how many early stages overflow) must lie in 1..{num_stages}, got {stages!r}")

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        if work.direction != FORWARD and work.stage < stages:
            return ComputeAndWeightWorkers(num_stages + work.stage % extra, work.stage)
        return ComputeAndWeightWorkers(work.stage, work.stage)

    def map_arrays(batch, stage, direction):
        stage = np.asarray(stage)
        moved = (np.asarray(direction) != FORWARD) & (stage < stages)
        return np.where(moved, num_stages + stage % extra, stage), stage

    return Strategy(mapping, name="overflow", description=OVERFLOW.description, shape=shape,
                    params={"stages": stages}, map_arrays=map_arrays)


CUCKOO = Entry(
    name="cuckoo",
    factory=cuckoo,
    description="GPipe with the backwards of early stages and batches moved to the mirror worker W - s - 1",
    family="seed",
    constraints="W = S",
    params=(
        Param("stage_cutoff", None, "backwards of stages below this move (default S // 2 + 2)"),
        Param("batch_cutoff", None, "backwards of batches below this move (default B // 2 - 2, at least 0)"),
    ),
)
OVERFLOW = Entry(
    name="overflow",
    factory=overflow,
    description="GPipe on S workers; the W - S extra workers take the backwards of the early stages",
    family="seed",
    constraints="W > S",
    params=(Param("stages", None, "how many early stages' backwards overflow (default min(W - S, S))"),),
)

STRATEGIES = (CUCKOO, OVERFLOW)
