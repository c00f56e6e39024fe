"""Zero-bubble pipelines: the backward is split into an input-gradient pass
(I, on the critical path) and a weight-gradient pass (W, which can wait), and
the W passes fill what would be bubbles.

These schedules are hand-made orders, not tie-breaks, so each strategy here
fixes every worker's sequence (``Strategy.worker_orders``), built from the
structure their papers give them, never from timings, so that they hold
under any costs:

- ZB-H1: 1F1B's S - s warm-up forwards on stage s's worker, then I, W, F
  in turn, each W pass s micro-batches after its I; every worker keeps S
  micro-batches in flight, 1F1B's peak;
- ZB-H2: 2(S - s) - 1 warm-up forwards and each W pass 2s micro-batches
  after its I: 2S - 1 in flight, about twice 1F1B's memory, which fills the
  warm-up bubble as well;
- ZB-V: two stages per worker in a V (stage s and 2W - 1 - s on worker s),
  in the phases of the paper's V schedule (warm-up forwards of the first
  chunk, then of both, then F-I-W of both chunks, then the drain with the W
  passes last), at 1F1B's memory.

DualPipeV uses the same V placement and follows DeepSeek's phase order.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from unisched.policies._orders import Columns, OrderWriter, fixed_orders, warmup_steady_orders
from unisched.policies._registry import Entry, require
from unisched.policies.pipeline import stage_modulo_workers
from unisched.strategy import Strategy, works
from unisched.work import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, ComputeAndWeightWorkers, Shape, Work


def zb_h1(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """One stage per worker, 1F1B's warm-up, W passes s micro-batches late on worker s."""
    shape = _pipeline_shape("zb_h1", num_workers, num_stages, num_batches)
    p, s = num_workers, np.arange(num_workers)
    return _split_strategy("zb_h1", ZB_H1.description, shape, *stage_modulo_workers(p),
                           warmup_steady_orders(s, num_batches, warmup=p - s, weight_lag=s))


def zb_h2(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """One stage per worker, 2(S - s) - 1 warm-up forwards, W passes 2s micro-batches late."""
    shape = _pipeline_shape("zb_h2", num_workers, num_stages, num_batches)
    p, s = num_workers, np.arange(num_workers)
    return _split_strategy("zb_h2", ZB_H2.description, shape, *stage_modulo_workers(p),
                           warmup_steady_orders(s, num_batches, warmup=2 * (p - s) - 1, weight_lag=2 * s))


def zbv(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """V-shaped placement (stage s and 2W - 1 - s on worker s) in the ZB-V schedule's phases."""
    shape = _v_shape("zbv", num_workers, num_stages, num_batches)
    return _split_strategy("zbv", ZBV.description, shape, *_v_mapping(num_workers),
                           lambda rank: zbv_columns(num_workers, rank, num_batches))


def zbv_order(num_workers: int, rank: int, num_batches: int) -> list[Work]:
    """Rank ``rank``'s sequence in ZB-V (:func:`zbv_columns`), as Work."""
    return works(*zbv_columns(num_workers, rank, num_batches))


def zbv_columns(num_workers: int, rank: int, num_batches: int) -> Columns:
    """Rank ``rank``'s sequence in ZB-V, as arrays.

    Chunk 0 of a rank is stage ``rank`` (the way down), chunk 1 stage
    ``2W - 1 - rank`` (the way back).  The schedule is laid out for
    n = max(2W - 1, B) micro-batches; the passes of those that do not exist
    are left out.  Phases: 2(W - r) - 1 chunk-0 forwards; r pairs of chunk-1
    and chunk-0 forwards; W - r rounds of a chunk-1 forward and its
    backward; the steady rounds (F0, B0, F1, B1) while forwards remain; the
    drain: r rounds of chunk-0 and chunk-1 I passes, W - r rounds of a
    chunk-0 I pass and the oldest chunk-0 W pass; the W passes still owed.
    A backward in the first phases runs I and W together.
    """
    p, r, m = num_workers, rank, num_batches
    n = max(2 * p - 1, m)
    order = OrderWriter((r, 2 * p - 1 - r))
    F, I, W = FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT
    order.rounds(2 * (p - r) - 1, (0, F))
    order.rounds(r, (1, F), (0, F))
    order.rounds(p - r, (1, F), (1, I), (1, W))
    order.rounds(n - order.count(0, F), (0, F), (0, I), (0, W), (1, F), (1, I), (1, W))  # while forwards remain
    order.rounds(order.count(0, F) - order.count(1, F), (0, I), (0, W), (1, F), (1, I), (1, W))
    order.rounds(r, (0, I), (1, I))
    order.rounds(p - r, (0, I), (0, W))
    order.rounds(order.count(1, I) - order.count(1, W), (1, W))
    order.rounds(order.count(0, I) - order.count(0, W), (0, W))
    batch, stage, direction = order.columns()
    exists = batch < m
    return batch[exists], stage[exists], direction[exists]


def dualpipe_v(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """V-shaped placement in DualPipeV's eight-phase order, its overlapped
    forward-backward pairs run one after the other."""
    shape = _dualpipe_v_shape(Shape(num_workers, num_stages, num_batches))
    return _split_strategy("dualpipe_v", DUALPIPE_V.description, shape, *_v_mapping(num_workers),
                           lambda rank: dualpipe_v_columns(num_workers, rank, num_batches))


def dualpipe_v_order(num_workers: int, rank: int, num_batches: int) -> list[Work]:
    """Rank ``rank``'s sequence in DualPipeV (:func:`dualpipe_v_columns`), as Work."""
    return works(*dualpipe_v_columns(num_workers, rank, num_batches))


def dualpipe_v_columns(num_workers: int, rank: int, num_batches: int) -> Columns:
    """Rank ``rank``'s sequence in DualPipeV, as arrays.

    Chunk 0 of a rank is stage ``rank`` (the way down), chunk 1 stage
    ``2W - 1 - rank`` (the way back).  A backward "with zero bubble" runs its
    I pass now and queues its W pass; a weight step runs the oldest queued W;
    other backwards run I and W together.  (A chunk's W passes come in the
    order of its I passes either way, so each takes the chunk's next
    micro-batch.)
    """
    p, r = num_workers, rank
    order = OrderWriter((r, 2 * p - 1 - r))
    F, I, W = FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT
    queued: list[int] = []  # the chunks of the W passes queued, oldest first

    def backward(chunk: int, zero_bubble: bool) -> None:
        order.next(chunk, I)
        queued.append(chunk) if zero_bubble else order.next(chunk, W)

    def weight() -> None:
        order.next(queued.pop(0), W)

    order.rounds((p - r - 1) * 2, (0, F))
    order.rounds(r + 1, (0, F), (1, F))
    for _ in range(p - r - 1):
        backward(1, zero_bubble=True)
        weight()
        order.next(1, F)
    order.rounds(num_batches - 2 * p + r + 1, (0, F), (1, I), (1, W), (1, F), (0, I), (0, W))
    order.rounds(p - r - 1, (1, I), (1, W), (1, F), (0, I), (0, W))
    zero_bubble = False
    steps = r + 1
    for i in range(steps):
        if i == steps // 2 and r % 2 == 1:
            zero_bubble = True
        backward(1, zero_bubble)
        if i == steps // 2 and r % 2 == 0:
            zero_bubble = True
        backward(0, zero_bubble)
    for _ in range(p - r - 1):
        weight()
        backward(0, zero_bubble=True)
    while queued:
        weight()
    return order.columns()


# ---------------------------------------------------------------------- helpers
def _split_strategy(name, description, shape, mapping, map_arrays,
                    order: Callable[[int], Columns] | Columns) -> Strategy:
    """A strategy with a split backward in which worker w follows ``order(w)``
    (or row w of ``order``, every worker's at once)."""
    return Strategy(mapping, name=name, description=description, split_backward=True,
                    worker_orders=fixed_orders(shape, True, order), shape=shape, map_arrays=map_arrays)


def _v_mapping(p: int):
    """(mapping, map_arrays) of the V placement: stage s and 2p - 1 - s on worker s."""
    def worker_of(stage: int) -> int:
        return stage if stage < p else 2 * p - 1 - stage

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        worker = worker_of(work.stage)
        return ComputeAndWeightWorkers(worker, worker)

    def map_arrays(batch, stage, direction):
        stage = np.asarray(stage)
        worker = np.where(stage < p, stage, 2 * p - 1 - stage)
        return worker, worker

    return mapping, map_arrays


def _dualpipe_v_shape(shape: Shape) -> Shape:
    _v_shape("dualpipe_v", *shape)
    require(shape.num_batches >= 2 * shape.num_workers, "dualpipe_v",
            f"needs at least 2W = {2 * shape.num_workers} micro-batches, got B={shape.num_batches}")
    return shape


def _pipeline_shape(name: str, W: int, S: int, B: int) -> Shape:
    W, S, B = shape = Shape(W, S, B).check()
    require(W == S, name, f"needs one stage per worker (W = S), got W={W}, S={S}; set the number of workers to {S}")
    return shape


def _v_shape(name: str, W: int, S: int, B: int) -> Shape:
    W, S, B = shape = Shape(W, S, B).check()
    require(S == 2 * W, name,
            f"places two stages per worker in a V (stage s and 2W - 1 - s on worker s), so S must be 2W; "
            f"got W={W}, S={S}: use an even number of stages and W = S / 2 workers")
    return shape


ZB_H1 = Entry(
    name="zb_h1",
    factory=zb_h1,
    description="zero bubble H1: split backward, 1F1B's warm-up, each W pass s micro-batches after its I on worker s; "
                "1F1B's activation memory",
    family="zero bubble",
    constraints="W = S",
    check=lambda shape: _pipeline_shape("zb_h1", *shape),
)
ZB_H2 = Entry(
    name="zb_h2",
    factory=zb_h2,
    description="zero bubble H2: split backward, 2(S-s)-1 warm-up forwards, each W pass 2s micro-batches after its I; "
                "about twice 1F1B's activation memory",
    family="zero bubble",
    constraints="W = S",
    check=lambda shape: _pipeline_shape("zb_h2", *shape),
)
ZBV = Entry(
    name="zbv",
    factory=zbv,
    description="zero bubble V: stages s and 2W-1-s on worker s, split backward, the ZB-V phase order, "
                "1F1B's activation memory",
    family="zero bubble",
    constraints="S = 2W",
    check=lambda shape: _v_shape("zbv", *shape),
)
DUALPIPE_V = Entry(
    name="dualpipe_v",
    factory=dualpipe_v,
    description="DualPipeV: V placement in DeepSeek's phase order; its overlapped F&B pairs run back to back",
    family="zero bubble",
    constraints="S = 2W, B >= 2W",
    check=_dualpipe_v_shape,
)

STRATEGIES = (ZB_H1, ZB_H2, ZBV, DUALPIPE_V)
