"""Pipeline parallelism: stage s lives on one worker and every micro-batch
flows through the workers in turn.

GPipe, 1F1B and the interleaved (virtual-stage) pipeline share that idea.
GPipe is the bare mapping, run greedily.  1F1B and the interleaved pipeline
are defined, as their papers define them, by the order of work on each
worker: 1F1B runs S - s warm-up forwards on stage s's worker, then one
backward and one forward in turn, then the drain; the interleaved pipeline
gives each worker v stages s, s + W, ... in Megatron-LM's order.  A fixed
order holds under any costs.  (GPipe's mapping with backward-first
priority and a limit of S - s stashes runs the same order when every stage
costs the same; with unequal stages that greedy rule runs two forwards,
then two backwards, whenever the next forward is late.)
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from unisched.policies._orders import fixed_orders, warmup_steady_orders
from unisched.policies._registry import TIE_BREAK, Entry, Param, require, require_count
from unisched.simulate.priorities import priority_by_name
from unisched.strategy import Strategy, WorkerOrders
from unisched.work import ComputeAndWeightWorkers, Shape, Work

GPIPE_PRIORITIES = ("oldest_batch_first", "oldest_stage_first")
"""The tie-breaks the family search tries for gpipe; its ``priority`` takes any of the simulator's
(:data:`unisched.simulate.priorities.BUILTIN_PRIORITIES`, as ``--priority`` does)."""


def gpipe(num_workers: int, num_stages: int, num_batches: int, priority: str = "oldest_batch_first") -> Strategy:
    """Stage s on worker s, holding its own weights."""
    num_workers, num_stages, num_batches = shape = Shape(num_workers, num_stages, num_batches).check()
    _one_stage_per_worker("gpipe", shape)
    mapping, map_arrays = stage_modulo_workers(num_workers)
    return Strategy(
        mapping,
        name="gpipe",
        description=GPIPE.description,
        priority=priority_by_name(priority, num_stages, num_batches),
        shape=shape,
        params={"priority": priority},
        map_arrays=map_arrays,
    )


def one_f_one_b(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """GPipe's mapping in 1F1B's order: S - s warm-up forwards on stage s's
    worker, then one backward one forward; it holds at most S - s stashes."""
    num_workers, num_stages, num_batches = shape = Shape(num_workers, num_stages, num_batches).check()
    _one_stage_per_worker("one_f_one_b", shape)
    mapping, map_arrays = stage_modulo_workers(num_workers)
    s = np.arange(num_workers)
    orders = fixed_orders(shape, False, warmup_steady_orders(s, num_batches, warmup=num_stages - s))
    return Strategy(
        mapping,
        name="one_f_one_b",
        description=ONE_F_ONE_B.description,
        memory_limit=[float(num_stages - s) for s in range(num_workers)],
        worker_orders=orders,
        shape=shape,
        map_arrays=map_arrays,
    )


def interleaved(num_workers: int, num_stages: int, num_batches: int, virtual_stages: int | None = None) -> Strategy:
    """v = S / W stages per worker (stage s on worker s mod W), in Megatron-LM's interleaved 1F1B order."""
    num_workers, num_stages, num_batches = shape = Shape(num_workers, num_stages, num_batches).check()
    require_count(virtual_stages, "interleaved", "virtual_stages")  # before the shape: a bad value on any
    v = num_stages // num_workers
    require(num_stages % num_workers == 0 and v >= 1, "interleaved",
            f"needs S = v * W stages (v virtual stages per worker), got S={num_stages}, W={num_workers}; "
            f"use a number of stages that is a multiple of {num_workers}")
    if virtual_stages is not None:
        require(virtual_stages == v, "interleaved",
                f"virtual_stages={virtual_stages} with W={num_workers} workers needs S={virtual_stages * num_workers} "
                f"stages, got S={num_stages}; change the stages or drop virtual_stages")
    require(num_batches % num_workers == 0, "interleaved",
            f"Megatron's interleaved order takes micro-batches in rounds of W={num_workers}; got B={num_batches}, "
            f"use a multiple of {num_workers}")

    mapping, map_arrays = stage_modulo_workers(num_workers)
    return Strategy(
        mapping,
        name="interleaved",
        description=INTERLEAVED.description,
        worker_orders=megatron_interleaved_orders(num_workers, v, num_batches),
        shape=shape,
        params={"virtual_stages": v},
        map_arrays=map_arrays,
    )


def megatron_interleaved_orders(num_workers: int, virtual: int, num_batches: int) -> WorkerOrders:
    """Each worker's sequence in Megatron-LM's interleaved 1F1B.

    Forwards go in rounds of W micro-batches per model chunk (chunk 0 for
    micro-batches 0..W-1, then chunk 1 for the same, ...), backwards the
    same way from the last chunk down; rank r first runs (W - r - 1) * 2 +
    (v - 1) * W warm-up forwards (W - r - 1 when v = 1: plain 1F1B), then
    alternates one forward and one backward, then drains its backwards.
    """
    p, v = num_workers, virtual
    ranks = np.arange(p)
    stages = ranks[:, None] + p * np.arange(v)  # rank r holds r, r + W, ...
    return fixed_orders(Shape(p, p * v, num_batches), False, warmup_steady_orders(
        stages, num_batches, 1 + _megatron_warmup(p, v, ranks), per_round=p))


def _megatron_warmup(p: int, v: int, rank):
    """Forwards rank ``rank`` (or each of an array of ranks) runs before its first forward-backward pair."""
    return p - rank - 1 if v == 1 else (p - rank - 1) * 2 + (v - 1) * p


def stage_modulo_workers(num_workers: int):
    """Stage s on worker s mod W, which also holds its weights: the mapping
    and its vectorised form."""

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        worker = work.stage % num_workers
        return ComputeAndWeightWorkers(worker, worker)

    def map_arrays(batch, stage, direction):
        worker = np.asarray(stage) % num_workers
        return worker, worker

    return mapping, map_arrays


def _one_stage_per_worker(name: str, shape: Shape) -> None:
    require(shape.num_workers == shape.num_stages, name,
            f"needs one stage per worker (W = S), got W={shape.num_workers}, S={shape.num_stages}; "
            f"set the number of workers to {shape.num_stages} (or use 'looped' or 'interleaved' for S > W)")


def _gpipe_grid(shape: Shape):
    for priority in GPIPE_PRIORITIES:
        yield {"priority": priority}


GPIPE = Entry(
    name="gpipe",
    factory=gpipe,
    description="pipeline parallel: stage s on worker s, micro-batches flow through the workers",
    family="pipeline",
    constraints="W = S",
    params=(replace(TIE_BREAK, default="oldest_batch_first",
                    help="tie-break: oldest_batch_first (the seed's default), oldest_stage_first (fill-drain) "
                    "or backward_first"),),
    grid=_gpipe_grid,
)
ONE_F_ONE_B = Entry(
    name="one_f_one_b",
    factory=one_f_one_b,
    description="1F1B: GPipe's mapping, S - s warm-up forwards on stage s's worker, then one backward one forward",
    family="pipeline",
    constraints="W = S",
)
INTERLEAVED = Entry(
    name="interleaved",
    factory=interleaved,
    description="interleaved 1F1B (Megatron): v = S/W stages per worker, stage s on worker s mod W, fixed order",
    family="pipeline",
    constraints="S = v W, B a multiple of W",
    params=(Param("virtual_stages", None, "stages per worker v; must equal S / W (default: S / W)"),),
)

STRATEGIES = (GPIPE, ONE_F_ONE_B, INTERLEAVED)
