"""Zero-bubble pipelines: the backward is split into an input-gradient pass
(I, on the critical path) and a weight-gradient pass (W, which can wait), and
the W passes fill what would be bubbles.

These schedules are hand-made orders, not tie-breaks, so each strategy here
fixes every worker's sequence (``Strategy.worker_orders``).  ZB-H1, ZB-H2 and
ZB-V are designed, as in their paper, on a grid where F, I and W each take
one slot, by one rule: run an I as soon as it is ready; else a forward if
the worker is under its in-flight cap and memory budget; else a W.  The
schedules differ only in placement, cap and budget:

- ZB-H1: one stage per worker, stage s's worker admits S - s forwards ahead
  of their I passes within 1F1B's budget of S stashes (an I frees half);
- ZB-H2: the cap is 2(S - s) - 1 and the budget 2S - 1 - s, about twice
  1F1B's memory, enough to fill the warm-up bubble as well;
- ZB-V: two stages per worker in a V (stage s and 2W - 1 - s on worker s),
  later stages first, within 1F1B's budget (2W half-size stashes).

DualPipeV uses the same V placement and follows DeepSeek's phase order.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from unisched.policies._orders import Progress, Rule, unit_time_orders
from unisched.policies._registry import Entry, require
from unisched.policies.pipeline import stage_modulo_workers
from unisched.strategy import Strategy
from unisched.work import BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, ComputeAndWeightWorkers, Shape, Work

DESIGN_INPUT_GRAD_FREES = 0.5
"""Share of a stash the I pass frees, as the schedules were designed (the
simulated memory uses ``Costs.input_grad_frees``)."""


def zb_h1(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """One stage per worker, W passes delayed into the cool-down, 1F1B's memory."""
    shape = _pipeline_shape("zb_h1", num_workers, num_stages, num_batches)
    p = num_workers
    rule = zero_bubble_rule(cap=[p - s for s in range(p)], budget=[float(p)] * p)
    orders = unit_time_orders(p, p, num_batches, _stage_worker, rule, name="zb_h1")
    return _split_strategy("zb_h1", ZB_H1.description, shape, *stage_modulo_workers(p), orders)


def zb_h2(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """One stage per worker, extra warm-up forwards, about twice 1F1B's memory."""
    shape = _pipeline_shape("zb_h2", num_workers, num_stages, num_batches)
    p = num_workers
    rule = zero_bubble_rule(cap=[2 * (p - s) - 1 for s in range(p)], budget=[float(2 * p - 1 - s) for s in range(p)])
    orders = unit_time_orders(p, p, num_batches, _stage_worker, rule, name="zb_h2")
    return _split_strategy("zb_h2", ZB_H2.description, shape, *stage_modulo_workers(p), orders)


def zbv(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """V-shaped placement (stage s and 2W - 1 - s on worker s), zero-bubble order, 1F1B's memory."""
    shape = _v_shape("zbv", num_workers, num_stages, num_batches)
    p = num_workers
    rule = zero_bubble_rule(cap=None, budget=[float(2 * p)] * p, later_stages_first=True)
    mapping, map_arrays, worker_of = _v_mapping(p)
    orders = unit_time_orders(p, 2 * p, num_batches, lambda w: worker_of(w.stage), rule, name="zbv")
    return _split_strategy("zbv", ZBV.description, shape, mapping, map_arrays, orders)


def dualpipe_v(num_workers: int, num_stages: int, num_batches: int) -> Strategy:
    """V-shaped placement in DualPipeV's eight-phase order, its overlapped
    forward-backward pairs run one after the other."""
    shape = _dualpipe_v_shape(Shape(num_workers, num_stages, num_batches))
    mapping, map_arrays, _ = _v_mapping(num_workers)
    orders = {rank: dualpipe_v_order(num_workers, rank, num_batches) for rank in range(num_workers)}
    return _split_strategy("dualpipe_v", DUALPIPE_V.description, shape, mapping, map_arrays, orders)


def zero_bubble_rule(cap: list[int] | None, budget: list[float], later_stages_first: bool = False) -> Rule:
    """The design rule shared by ZB-H1, ZB-H2 and ZB-V (see the module docstring)."""
    key: Callable[[Work], tuple] = (lambda w: (-w.stage, w.batch)) if later_stages_first else (lambda w: (w.batch, w.stage))

    def rule(worker: int, ready: list[Work], progress: Progress) -> Work | None:
        inputs = [w for w in ready if w.direction == BACKWARD_INPUT]
        if inputs:
            return min(inputs, key=key)
        forwards = [w for w in ready if w.direction == FORWARD]
        ahead = progress.forwards[worker] - progress.inputs_done[worker]
        held = ahead + (1 - DESIGN_INPUT_GRAD_FREES) * len(progress.owed_weights[worker])
        if forwards and (cap is None or ahead < cap[worker]) and held + 1 <= budget[worker] + 1e-9:
            return min(forwards, key=key)
        weights = [w for w in ready if w.direction == BACKWARD_WEIGHT]
        return min(weights, key=key) if weights else None

    return rule


def dualpipe_v_order(num_workers: int, rank: int, num_batches: int) -> list[Work]:
    """Rank ``rank``'s sequence in DualPipeV.

    Chunk 0 of a rank is stage ``rank`` (the way down), chunk 1 stage
    ``2W - 1 - rank`` (the way back).  A backward "with zero bubble" runs its
    I pass now and queues its W pass; a weight step runs the oldest queued W;
    other backwards run I and W together.
    """
    p, r = num_workers, rank
    stage = (r, 2 * p - 1 - r)
    forwards, backwards = [0, 0], [0, 0]
    queued: list[Work] = []
    order: list[Work] = []

    def forward(chunk: int) -> None:
        order.append(Work(forwards[chunk], stage[chunk], FORWARD))
        forwards[chunk] += 1

    def backward(chunk: int, zero_bubble: bool = False) -> None:
        batch = backwards[chunk]
        backwards[chunk] += 1
        order.append(Work(batch, stage[chunk], BACKWARD_INPUT))
        weight = Work(batch, stage[chunk], BACKWARD_WEIGHT)
        queued.append(weight) if zero_bubble else order.append(weight)

    def weight() -> None:
        order.append(queued.pop(0))

    for _ in range((p - r - 1) * 2):
        forward(0)
    for _ in range(r + 1):
        forward(0)
        forward(1)
    for _ in range(p - r - 1):
        backward(1, zero_bubble=True)
        weight()
        forward(1)
    for _ in range(num_batches - 2 * p + r + 1):
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(p - r - 1):
        backward(1)
        forward(1)
        backward(0)
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
    return order


# ---------------------------------------------------------------------- helpers
def _split_strategy(name, description, shape, mapping, map_arrays, orders) -> Strategy:
    return Strategy(mapping, name=name, description=description, split_backward=True,
                    worker_orders=orders, shape=shape, map_arrays=map_arrays)


def _stage_worker(work: Work) -> int:
    return work.stage


def _v_mapping(p: int):
    def worker_of(stage: int) -> int:
        return stage if stage < p else 2 * p - 1 - stage

    def mapping(work: Work) -> ComputeAndWeightWorkers:
        worker = worker_of(work.stage)
        return ComputeAndWeightWorkers(worker, worker)

    def map_arrays(batch, stage, direction):
        stage = np.asarray(stage)
        worker = np.where(stage < p, stage, 2 * p - 1 - stage)
        return worker, worker

    return mapping, map_arrays, worker_of


def _dualpipe_v_shape(shape: Shape) -> Shape:
    _v_shape("dualpipe_v", *shape)
    require(shape.num_batches >= 2 * shape.num_workers, "dualpipe_v",
            f"needs at least 2W = {2 * shape.num_workers} micro-batches, got B={shape.num_batches}")
    return shape


def _pipeline_shape(name: str, W: int, S: int, B: int) -> Shape:
    shape = Shape(W, S, B).check()
    require(W == S, name, f"needs one stage per worker (W = S), got W={W}, S={S}; set the number of workers to {S}")
    return shape


def _v_shape(name: str, W: int, S: int, B: int) -> Shape:
    shape = Shape(W, S, B).check()
    require(S == 2 * W, name,
            f"places two stages per worker in a V (stage s and 2W - 1 - s on worker s), so S must be 2W; "
            f"got W={W}, S={S}: use an even number of stages and W = S / 2 workers")
    return shape


ZB_H1 = Entry(
    name="zb_h1",
    factory=zb_h1,
    description="zero bubble H1: split backward, W passes delayed into the cool-down, 1F1B's activation memory",
    family="zero bubble",
    constraints="W = S",
    check=lambda shape: _pipeline_shape("zb_h1", *shape),
)
ZB_H2 = Entry(
    name="zb_h2",
    factory=zb_h2,
    description="zero bubble H2: split backward, extra warm-up forwards, about twice 1F1B's activation memory",
    family="zero bubble",
    constraints="W = S",
    check=lambda shape: _pipeline_shape("zb_h2", *shape),
)
ZBV = Entry(
    name="zbv",
    factory=zbv,
    description="zero bubble V: stages s and 2W-1-s on worker s, split backward, 1F1B's activation memory",
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
