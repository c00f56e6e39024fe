"""Memory in bytes, as a rank of the executor holds it: weights of truth,
their optimizer state and their gradients until the optimizer step, fetched
weights while needed and the copies a weight worker serves them from
until they have arrived, stashes until their backward, a backward's workspace while it
runs (none for the pass that starts a fetched stage's gradient, which
holds that gradient from its start until it is sent back), and a returned
gradient's buffer from the item during which it is sent to the end of
the item during which it arrives."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import pytest

from unisched import Costs, policies, simulate
from unisched.memory import MEMORY_KINDS, memory_curves
from unisched.strategy import Gang, Strategy
from unisched.errors import ShapeError
from unisched.work import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, ComputeAndWeightWorkers, Work


def run(name: str, W: int, S: int, B: int, costs: Costs):
    return simulate(W, S, B, policies.get(name, num_workers=W, num_stages=S, num_batches=B), costs=costs).timeline


def peaks(t, kind: str = "total") -> list[float]:
    return [c.peak for c in memory_curves(t, kind, "bytes")]


def test_a_pipeline_rank_holds_weights_stashes_and_its_gradients_until_the_optimizer_step():
    t = run("gpipe", 2, 2, 2, Costs(activation_bytes=[10, 20], weight_bytes=[100, 200]))
    assert peaks(t, "weights") == [100, 200]
    assert peaks(t, "activations") == [2 * 10, 1 * 20]
    assert peaks(t, "weight_gradients") == [100, 200]
    # rank 0: micro-batch 1's stash is still held when B(0, 0) ends and the gradient appears;
    # rank 1: F(1, 1) runs after B(1, 0), its stash beside the gradient
    assert peaks(t) == [100 + 10 + 100, 200 + 20 + 200]
    assert t.worker_stats()["peak_memory_bytes"] == [210, 420]
    end = t.latency
    for w, curve in enumerate(memory_curves(t, "total")):
        assert curve.at(end) == [200, 400][w], "weights and gradients meet at the optimizer step"


def test_the_kinds_add_up_to_the_total():
    costs = Costs(activation_bytes=3, weight_bytes=[50, 70, 90], bandwidth=40.0, cache_weights=True)
    t = run("fsdp", 3, 3, 3, costs)
    times = np.unique(np.concatenate([c.times for c in memory_curves(t, "total")]))
    for w, total in enumerate(memory_curves(t, "total")):
        parts = [memory_curves(t, kind)[w] for kind in MEMORY_KINDS]
        for moment in times:
            assert total.at(moment) == pytest.approx(sum(p.at(moment) for p in parts))


def test_a_fetched_stages_gradient_accumulates_from_its_first_backwards_start_until_sent():
    sharded = lambda w: ComputeAndWeightWorkers(w.batch % 2, w.stage % 2)  # noqa: E731
    costs = Costs(activation_bytes=1, weight_bytes=8.0, bandwidth=4.0, cache_weights=True)
    t = simulate(2, 2, 4, sharded, costs=costs).timeline
    sent = [r for r in t.transfers if r.kind == "weight_gradient"]
    assert len(sent) == 2, "one return per worker and fetched stage"
    expected = np.zeros(2)
    for r in sent:
        backwards = [t.start[i] for i in range(len(t))
                     if t.worker[i] == r.src and t.stage[i] == r.work.stage and t.direction[i] == BACKWARD]
        assert len(backwards) == 2 and r.work.batch >= 2, "accumulated over two backwards, sent after the last"
        expected[r.src] += r.nbytes * (r.end - min(backwards))
    held = [float(np.sum(c.values[:-1] * np.diff(c.times))) for c in memory_curves(t, "gradients")]
    assert held == pytest.approx(expected.tolist()) and expected.sum() > 0


def test_a_returned_gradient_arrives_in_a_buffer_then_joins_the_weight_workers_gradient():
    costs = Costs(activation_bytes=1, weight_bytes=8.0, bandwidth=4.0, cache_weights=True)
    t = run("fsdp", 2, 2, 2, costs)
    curves = memory_curves(t, "weight_gradients")
    for r in (r for r in t.transfers if r.kind == "weight_gradient"):
        middle = (r.start + r.end) / 2
        assert curves[r.dst].at(middle) >= r.nbytes, "the buffer it arrives in"
        assert curves[r.dst].at(r.end) >= 8.0, "the weight worker's gradient from then on"
    assert peaks(t, "weights") == [8.0, 8.0]


def test_a_weight_worker_holds_the_copies_it_serves_from_the_steps_start_until_they_have_arrived():
    costs = Costs(activation_bytes=1, weight_bytes=[8.0, 12.0, 16.0], bandwidth=4.0, cache_weights=True)
    t = run("fsdp", 3, 3, 3, costs)
    served = [r for r in t.transfers if r.kind == "weights" and r.src == 2]
    assert [r.nbytes for r in served] == [16.0, 16.0] and min(r.start for r in served) > 0, "fetched late"
    arrived = max(r.end for r in served)
    running = next(i for i in range(len(t)) if t.worker[i] == 2 and t.start[i] <= arrived < t.end[i])
    fetched = memory_curves(t, "fetched")[2]
    assert fetched.at(min(r.start for r in served) / 2) >= 32.0, "served first in worker 2's program"
    let_go = t.end[running]
    assert fetched.at(np.nextafter(let_go, -np.inf)) - fetched.at(let_go) == 32.0, "after the item running then"


def test_a_fetched_stages_gradient_is_made_beside_the_fetched_weights():
    costs = Costs(activation_bytes=1, weight_bytes=[8.0, 12.0], bandwidth=4.0, cache_weights=True)
    t = run("fsdp", 2, 2, 2, costs)
    row = next(i for i in range(len(t)) if t.work(i) == Work(0, 1, BACKWARD))
    assert t.worker[row] == 0 and t.weight_worker[row] == 1, "worker 0 computes with stage 1's weights fetched"
    middle = (t.start[row] + t.end[row]) / 2
    assert memory_curves(t, "fetched")[0].at(middle) == 12.0
    assert memory_curves(t, "gradients")[0].at(middle) == 12.0, "the gradient the pass makes, beside them"


def test_a_weight_worker_posts_and_takes_in_a_returned_gradient_between_its_items():
    sharded = lambda w: ComputeAndWeightWorkers(w.batch % 2, w.stage % 2)  # noqa: E731
    costs = Costs(backward=3, activation_bytes=1, weight_bytes=[8.0, 12.0], bandwidth=5.0, cache_weights=True)
    t = simulate(2, 2, 4, sharded, costs=costs).timeline
    r = next(r for r in t.transfers if r.kind == "weight_gradient" and r.dst == 1)
    items = [i for i in range(len(t)) if t.worker[i] == 1]
    sent_in = next(i for i in items if t.start[i] < r.start < t.end[i])
    arrives_in = next(i for i in items if t.start[i] < r.end < t.end[i])
    own = 12.0  # worker 1's gradient of stage 1, held since its first backward of it
    held = memory_curves(t, "weight_gradients")[1]
    assert held.at(t.start[sent_in] - 0.1) == own
    assert held.at((t.start[sent_in] + r.start) / 2) == own + 12.0, "the receive is posted before the item"
    assert held.at((r.end + t.end[arrives_in]) / 2) == own + 12.0, "arrived, taken in once the item ends"
    assert held.at(t.end[arrives_in]) == own


def test_a_gradient_returned_as_the_weight_worker_starts_an_item_is_taken_in_after_it():
    t = run("fsdp", 2, 2, 2, Costs(activation_bytes=1, weight_bytes=[8.0, 12.0]))
    r = next(r for r in t.transfers if r.kind == "weight_gradient" and r.dst == 1)
    row = next(i for i in range(len(t)) if t.worker[i] == 1 and t.start[i] == r.end)
    assert r.start == r.end and t.end[row] > r.end, "sent at once, as worker 1 begins an item"
    held = memory_curves(t, "weight_gradients")[1]
    assert held.at((t.start[row] + t.end[row]) / 2) == 12.0 + 12.0, "its own gradient of stage 1, and the buffer"
    assert held.at(t.end[row]) == 12.0


def test_the_pass_that_starts_a_fetched_stages_gradient_holds_it_in_place_of_a_workspace():
    costs = Costs(activation_bytes=1, weight_bytes=[8.0, 12.0], backward_workspace_bytes=[7.0, 9.0])
    t = run("fsdp", 2, 2, 2, costs)
    workspace = memory_curves(t, "workspace")[0]
    for work, expected in ((Work(0, 1, BACKWARD), 0.0), (Work(0, 0, BACKWARD), 7.0)):
        row = next(i for i in range(len(t)) if t.work(i) == work)
        assert t.worker[row] == 0 and workspace.at((t.start[row] + t.end[row]) / 2) == expected, work


def test_a_gang_member_without_a_found_maker_leaves_the_other_workspaces_alone():
    """Stage 1 run by a tensor-parallel gang of workers 1 and 0, its weights on
    worker 2: member 0's returned gradient has no pass of its own in the
    timeline (a gang's pass is recorded under its first member), and that must
    not take the workspace from whichever row comes last."""
    costs = Costs(activation_bytes=1, weight_bytes=[2.0, 3.0, 4.0], backward_workspace_bytes=[5.0, 7.0, 9.0])
    strategy = Strategy(mapping=lambda w: ComputeAndWeightWorkers(w.stage, 2 if w.stage == 1 else w.stage),
                        gang=lambda w: Gang((1, 0), collective=True) if w.stage == 1 else None)
    t = simulate(3, 3, 2, strategy, costs=costs).timeline
    workspace = memory_curves(t, "workspace")
    for i in np.flatnonzero((t.direction == BACKWARD) & (t.stage != 1)):
        assert workspace[t.worker[i]].at((t.start[i] + t.end[i]) / 2) == [5.0, 7.0, 9.0][t.stage[i]], t.work(i)


def test_units_count_buffers_and_bytes_need_sizes():
    t = run("one_f_one_b", 2, 2, 4, Costs())
    assert [c.peak for c in memory_curves(t, "weight_gradients", "units")] == [1, 1]
    assert peaks(t) == [0, 0], "without sizes nothing is counted in bytes"
    with pytest.raises(ValueError, match="kind must be 'total' or one of"):
        memory_curves(t, "parameters")


def test_a_backward_holds_its_workspace_while_it_runs_and_weight_workers_their_optimizer_state():
    costs = Costs(activation_bytes=[10, 20], weight_bytes=[100, 200], backward_workspace_bytes=[7, 9],
                  optimizer_bytes=[50, 60])
    t = run("gpipe", 2, 2, 2, costs)
    workspace = memory_curves(t, "workspace")
    for i in range(len(t)):
        middle = (t.start[i] + t.end[i]) / 2
        expected = 0 if t.direction[i] == FORWARD else [7, 9][t.stage[i]]
        assert workspace[t.worker[i]].at(middle) == expected
    optimizer = memory_curves(t, "optimizer")
    assert [c.at(0.0) for c in optimizer] == [50, 60] and [c.at(t.latency) for c in optimizer] == [50, 60]
    # rank 0 peaks in B(0, 1): weights, optimizer state, micro-batch 1's stash, the gradient since B(0, 0)
    # and the workspace; rank 1 in B(1, 1) likewise
    assert peaks(t) == [100 + 50 + 10 + 100 + 7, 200 + 60 + 20 + 200 + 9]
    assert t.worker_stats()["peak_memory_bytes"] == [267, 489]


def test_a_split_backward_holds_the_workspace_in_each_half_and_a_measured_step_counts_none():
    t = run("zb_h1", 2, 2, 4, Costs(activation_bytes=1, weight_bytes=10, backward_workspace_bytes=[3, 5]))
    workspace = memory_curves(t, "workspace")
    halves = np.flatnonzero(np.isin(t.direction, [BACKWARD_INPUT, BACKWARD_WEIGHT]))
    assert len(halves) == 2 * 2 * 4
    for i in halves:
        assert workspace[t.worker[i]].at((t.start[i] + t.end[i]) / 2) == [3, 5][t.stage[i]]
    measured = dataclasses.replace(t, costs=None)
    assert peaks(measured, "workspace") == [0, 0] and peaks(measured, "optimizer") == [0, 0]
    assert [c.peak for c in memory_curves(t, "workspace", "units")] == [0, 0]


def test_workspace_and_optimizer_costs_are_checked_and_saved():
    with pytest.raises(ShapeError, match="Costs.backward_workspace_bytes must be a finite non-negative"):
        Costs(backward_workspace_bytes=-1)
    with pytest.raises(ShapeError, match="Costs.optimizer_bytes has 2 entries but the model has 3 stages"):
        Costs(optimizer_bytes=[1, 2]).check(2, 3)
    costs = Costs(backward_workspace_bytes=[1, 2], optimizer_bytes=4.0)
    assert Costs.from_dict(costs.to_dict()) == costs


def _memory_sizes(rank: int, world: int):
    from torch import nn

    from unisched.execute import Trainer

    torch.manual_seed(0)
    stages = [nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 4), nn.ReLU(), nn.Linear(4, 2))]
    schedule = simulate(2, 2, 2, policies.get("fsdp", num_workers=2, num_stages=2, num_batches=2))
    trainer = Trainer(stages, schedule, nn.functional.mse_loss, lambda ps: torch.optim.Adam(ps, lr=1e-3),
                      record=False, timeout=60)
    before = trainer.memory_sizes()
    trainer.step(torch.randn(4, 8), torch.randn(4, 2))
    after = trainer.memory_sizes()
    trainer.close()
    return before, after


def test_the_trainer_gives_each_stages_largest_parameter_and_optimizer_state():
    from unisched.execute.launch import run_local

    results = run_local(_memory_sizes, 2, timeout=120)
    for r in results:
        assert r.error is None, r.error
        before, after = r.value
        # stage 0: Linear(8, 16), a 16 x 8 weight of 512 bytes and 16 biases; stage 1: 4 x 16 (256 bytes) + 4
        # and 2 x 4 + 2; Adam keeps two moments per parameter and a 4-byte step count
        assert before == {"backward_workspace_bytes": [512.0, 256.0], "optimizer_bytes": [0.0, 0.0]}
        assert after["optimizer_bytes"] == [2 * (512 + 64) + 2 * 4, 2 * (256 + 16 + 32 + 8) + 4 * 4]
