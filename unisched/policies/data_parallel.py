"""Data parallelism: one micro-batch per worker, every stage on it.

DDP replicates every stage's weights on every worker (weight worker = compute
worker = b); FSDP / ZeRO-3 shards them.  By default a stage is the unit:
stage s lives whole on worker s mod W, so each worker fetches the stages it
does not hold before using them (what the runtime runs).  With
``shard=True`` every stage is cut into W shards, one per worker, as
PyTorch's FSDP and DeepSpeed's ZeRO-3 hold a layer: a worker gathers the
other W - 1 shards of each stage before using it (the step's all-gathers)
and sends each shard's gradient back to its holder (the reduce-scatters).
"""

from __future__ import annotations

import numpy as np

from unisched.policies._registry import Entry, Param, require
from unisched.strategy import Strategy
from unisched.work import ComputeAndWeightWorkers, Shape, Work


def ddp(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """Distributed data parallel: worker b computes batch b with its own replica."""
    num_workers, num_stages, num_batches = shape = Shape(num_workers, num_stages, num_batches).check()
    require(num_workers == num_batches, "ddp",
            f"needs one micro-batch per worker (W = B), got W={num_workers}, B={num_batches}; "
            f"set the number of micro-batches to {num_workers}")

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        return ComputeAndWeightWorkers(work.batch, work.batch)

    def map_arrays(batch, stage, direction):
        batch = np.asarray(batch)
        return batch, batch

    return Strategy(mapping, name="ddp", description=DDP.description, shape=shape, map_arrays=map_arrays)


def fsdp(num_workers: int, num_stages: int, num_batches: int, shard: bool = False) -> Strategy:
    """Fully sharded data parallel: worker b computes batch b, stage s's
    weights live on s mod W, or (``shard``) in W shards, one on each worker."""
    num_workers, num_stages, num_batches = shape = Shape(num_workers, num_stages, num_batches).check()
    require(num_workers == num_batches, "fsdp",
            f"needs one micro-batch per worker (W = B), got W={num_workers}, B={num_batches}; "
            f"set the number of micro-batches to {num_workers}")

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        return ComputeAndWeightWorkers(work.batch, work.stage % num_workers)

    def map_arrays(batch, stage, direction):
        return np.asarray(batch), np.asarray(stage) % num_workers

    everyone = tuple(range(num_workers))
    return Strategy(mapping, name="fsdp", description=FSDP.description, shape=shape, map_arrays=map_arrays,
                    params={"shard": True} if shard else {},
                    weight_shards=(lambda stage, weight: everyone) if shard else None)


DDP = Entry(
    name="ddp",
    factory=ddp,
    description="data parallel: worker b runs every stage of batch b on its own weight replica",
    family="data parallel",
    constraints="W = B",
)
FSDP = Entry(
    name="fsdp",
    factory=fsdp,
    description="fully sharded data parallel (ZeRO-3): worker b runs batch b, fetching stage s from worker s mod W",
    family="data parallel",
    constraints="W = B",
    params=(Param("shard", False, "cut every stage into W shards, one per worker, gathered before use and its "
                  "gradient reduce-scattered (simulated only); false: stage s whole on worker s mod W", type=bool),),
)

STRATEGIES = (DDP, FSDP)
