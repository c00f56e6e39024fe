"""A rank's backwards that follow each other run in one engine call (as a
plain loop's one ``backward``): the same weights as one process, fewer
autograd calls, and a recorded step that still gives each stage's backward
its own span."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from unisched import ComputeAndWeightWorkers, Direction, policies, simulate
from unisched.execute import Trainer, train_one_process

from test_execute import assert_every_rank_matches, run_ranks

W, S, B, ROWS, WIDTH = 2, 4, 4, 8, 6


def blocked(work):
    """Stages 0-1 on rank 0, 2-3 on rank 1: each rank's two backwards of a micro-batch follow each other."""
    return ComputeAndWeightWorkers(work.stage // 2, work.stage // 2)


def make_stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.2), nn.Tanh()) for _ in range(S)]


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _fused(rank: int, world: int, timeline) -> dict:
    calls = []
    backward = torch.autograd.backward

    def counted(*args, **kwargs):
        calls.append(1)
        return backward(*args, **kwargs)

    torch.autograd.backward = counted
    try:
        trainer = Trainer(make_stages(), timeline, nn.functional.mse_loss, sgd, record=True, timeout=60)
        losses = [trainer.step(*batch(step)) for step in range(2)]
    finally:
        torch.autograd.backward = backward
    out = {"losses": losses, "engine_calls_per_step": len(calls) / 2,
           "state": {k: v.numpy() for k, v in trainer.gather_state_dict().items()}}
    timeline = trainer.last_timeline
    if timeline is not None:
        out["spans"] = [(timeline.worker[i], timeline.work(i), timeline.start[i], timeline.end[i])
                        for i in range(len(timeline))]
    trainer.close()
    return out


def one_rank(work):
    return ComputeAndWeightWorkers(0, 0)


def breadth_first(world: int):
    """Every micro-batch through a stage before the next stage, forwards then backwards (gpipe's order on one rank)."""
    return simulate(world, S, B, policies.get("looped_bfs", num_workers=world, num_stages=S, num_batches=B)).timeline


# chains of 2 stages per rank, of all 4, and one run of every backward of the step
LAYOUTS = {"blocked": (W, lambda: simulate(W, S, B, blocked).timeline),
           "one rank": (1, lambda: simulate(1, S, B, one_rank).timeline),
           "breadth first": (1, lambda: breadth_first(1))}
CALLS_PER_STEP = {"blocked": B, "one rank": B, "breadth first": 1}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def fused(request):
    world, timeline = LAYOUTS[request.param]
    return request.param, run_ranks(_fused, world, timeline(), timeout=120)


def test_fused_backwards_train_as_one_process(fused):
    name, results = fused
    losses, reference = train_one_process(make_stages(), nn.functional.mse_loss, sgd, (batch(s) for s in range(2)),
                                          micro_batches=B)
    assert_every_rank_matches([r["state"] for r in results], reference, name)
    for r in results:
        assert r["losses"] == pytest.approx(losses, abs=1e-6)


def test_one_engine_call_runs_a_rank_s_consecutive_backwards(fused):
    """Each rank: one call per run of consecutive backwards (not one per stage)."""
    name, results = fused
    assert [r["engine_calls_per_step"] for r in results] == [CALLS_PER_STEP[name]] * len(results)


def test_each_fused_backward_keeps_its_own_span(fused):
    name, results = fused
    spans = results[0]["spans"]
    for rank in range(len(results)):
        mine = sorted((start, end, work) for worker, work, start, end in spans if worker == rank)
        assert len(mine) == 2 * S // len(results) * B and np.isfinite([s for s, _, _ in mine]).all()
        assert all(end >= start for start, end, _ in mine)
        assert all(b[0] >= a[1] - 1e-9 for a, b in zip(mine, mine[1:])), f"rank {rank}: spans overlap"
        backward = [(start, end) for start, end, w in mine if w.direction == Direction.BACKWARD]
        # one call per run: its members' spans tile it, each a share of its own
        runs = B if CALLS_PER_STEP[name] == B else 1
        per_run = len(backward) // runs
        for k in range(runs):
            run = backward[k * per_run:(k + 1) * per_run]
            assert all(end > start for start, end in run)  # a mark of its own where the engine began each member
            assert all(b[0] == pytest.approx(a[1], abs=1e-9) for a, b in zip(run, run[1:])), "a gap inside a call"
        if name == "blocked":  # a chain of one micro-batch: a later stage's backward ends where the earlier one's begins
            by_item = {(w.batch, w.stage): (start, end) for start, end, w in mine if w.direction == Direction.BACKWARD}
            chain = list(range(S // W * (rank + 1) - 1, S // W * rank - 1, -1))  # this rank's stages, last first
            for b in range(B):
                for later, earlier in zip(chain, chain[1:]):
                    assert by_item[(b, earlier)][0] == pytest.approx(by_item[(b, later)][1], abs=1e-9)


def forwards_away(work):
    """Every forward on rank 1, every backward on rank 0 (which recomputes
    each forward from its stash; stage 0's takes the micro-batch itself)."""
    return ComputeAndWeightWorkers(1 if work.direction == Direction.FORWARD else 0, 0)


def _one_stage(rank: int, world: int, timeline) -> dict:
    trainer = Trainer(make_stages()[:1], timeline, nn.functional.mse_loss, sgd, timeout=60)
    out = {"losses": [trainer.step(*batch(step)) for step in range(2)],
           "state": {k: v.numpy() for k, v in trainer.gather_state_dict().items()}}
    trainer.close()
    return out


def test_backwards_whose_forwards_ran_elsewhere_train_as_one_process():
    """A backward whose forward ran on another rank left no graph here: it
    recomputes the forward in its own call and joins no run (one stage: rank
    0's backwards follow each other, none waiting for a message)."""
    results = run_ranks(_one_stage, W, simulate(W, 1, B, forwards_away).timeline, timeout=120)
    losses, reference = train_one_process(make_stages()[:1], nn.functional.mse_loss, sgd,
                                          (batch(s) for s in range(2)), micro_batches=B)
    assert_every_rank_matches([r["state"] for r in results], reference, "forwards away")
    assert results[0]["losses"] == pytest.approx(losses, abs=1e-6)
