"""Data parallelism: one micro-batch per worker, every stage on it.

DDP replicates every stage's weights on every worker (weight worker = compute
worker = b); FSDP / ZeRO-3 shards them, stage s living on worker s mod W, so
each worker fetches the stages it does not hold before using them.
"""

from __future__ import annotations

import numpy as np

from unisched.policies._registry import Entry, require
from unisched.strategy import Strategy
from unisched.work import ComputeAndWeightWorkers, Shape, Work


def ddp(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """Distributed data parallel: worker b computes batch b with its own replica."""
    shape = Shape(num_workers, num_stages, num_batches).check()
    require(num_workers == num_batches, "ddp",
            f"needs one micro-batch per worker (W = B), got W={num_workers}, B={num_batches}; "
            f"set the number of micro-batches to {num_workers}")

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        return ComputeAndWeightWorkers(work.batch, work.batch)

    def map_arrays(batch, stage, direction):
        batch = np.asarray(batch)
        return batch, batch

    return Strategy(mapping, name="ddp", description=DDP.description, shape=shape, map_arrays=map_arrays)


def fsdp(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """Fully sharded data parallel: worker b computes batch b, stage s's weights live on s mod W."""
    shape = Shape(num_workers, num_stages, num_batches).check()
    require(num_workers == num_batches, "fsdp",
            f"needs one micro-batch per worker (W = B), got W={num_workers}, B={num_batches}; "
            f"set the number of micro-batches to {num_workers}")

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        return ComputeAndWeightWorkers(work.batch, work.stage % num_workers)

    def map_arrays(batch, stage, direction):
        return np.asarray(batch), np.asarray(stage) % num_workers

    return Strategy(mapping, name="fsdp", description=FSDP.description, shape=shape, map_arrays=map_arrays)


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
)

STRATEGIES = (DDP, FSDP)
