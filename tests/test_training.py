"""Training as people train: gradient clipping by the global norm, LR
schedulers, gradient accumulation, evaluation, dropout, BatchNorm buffers,
bf16 and fp16 precision, and a run resumed from its training state, on 3
gloo ranks under pipelines, replicas and fetched weights, each against the
one-process reference given the same options."""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from unisched import ComputeAndWeightWorkers, policies, simulate
from unisched.errors import ShapeError
from unisched.execute import ProgramError, Trainer, train_one_process
from unisched.execute.checkpoint import CheckpointError, save_checkpoint
from unisched.execute.checkpoint_files import partial_checkpoint
from unisched.execute.launch import run_local
from unisched.execute.training import micro_batch_seeds
from unisched.strategy import Gang, Strategy

from test_execute import assert_every_rank_matches, largest_change, run_ranks, state_of
from test_execute_pytrees import backward_away, scattered_halves  # a backward, and split halves, away from their forward

W = S = 3
B = 4
ROWS, WIDTH = 12, 8


# ---------------------------------------------------------------------- models
class InfGradient(torch.autograd.Function):
    """The identity, whose gradient is infinite: a weight gradient that overflows."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class Poisonable(nn.Module):
    """Linear + Tanh whose weight gradient is infinite while ``poison`` is set
    (the gradient of its input stays finite, so only this stage's rank sees it)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.poison = False

    def forward(self, x):
        weight = InfGradient.apply(self.linear.weight) if self.poison else self.linear.weight
        return torch.tanh(nn.functional.linear(x, weight, self.linear.bias))


def make_stages(kind: str = "plain") -> list[nn.Module]:
    torch.manual_seed(0)
    if kind == "poison":
        return [Poisonable() for _ in range(S)]
    middle = {"plain": [], "dropout": [nn.Dropout(0.5)], "batchnorm": [nn.BatchNorm1d(WIDTH)]}
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), *copy.deepcopy(middle[kind]), nn.Tanh()) for _ in range(S)]


def batch(step: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, WIDTH, generator=g) * 2, torch.randn(rows, WIDTH, generator=g)


def momentum_sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def loss_fn(output, target):
    return nn.functional.mse_loss(output, target)


# ---------------------------------------------------------------------- schedules
def schedules() -> dict:
    """Name -> (Timeline, micro-batches)."""
    made = {name: simulate(W, S, B, policies.get(name, num_workers=W, num_stages=S, num_batches=B))
            for name in ("gpipe", "one_f_one_b")}
    made.update({name: simulate(W, S, W, policies.get(name, num_workers=W, num_stages=S, num_batches=W))
                 for name in ("ddp", "fsdp")})
    made["backward_away"] = simulate(W, S, B, backward_away)
    made["tensor_parallel_gang"] = simulate(W, S, B, Strategy(
        mapping=lambda w: ComputeAndWeightWorkers(w.stage, w.stage),
        gang=lambda w: Gang((1, 2), collective=True) if w.stage == 1 else None))
    made["scattered_halves"] = simulate(W, S, B, scattered_halves, split_backward=True)
    return {name: (sim.timeline, sim.timeline.num_batches) for name, sim in made.items()}


# (label, schedule, model, Trainer and reference options, steps)
CASES = [
    *[(f"clip {name}", name, "plain", {"clip_grad_norm": 0.05}, 2)
      for name in ("gpipe", "ddp", "fsdp", "tensor_parallel_gang")],
    ("scheduler gpipe", "gpipe", "plain", {"scheduler": halving}, 3),
    *[(f"accumulate {name}", name, "plain", {"accumulate": 2}, 4) for name in ("one_f_one_b", "ddp", "fsdp")],
    *[(f"dropout {name}", name, "dropout", {}, 2)
      for name in ("gpipe", "one_f_one_b", "backward_away", "scattered_halves")],
    *[(f"batchnorm {name}", name, "batchnorm", {}, 2) for name in ("gpipe", "backward_away")],
    ("everything one_f_one_b", "one_f_one_b", "dropout",
     {"clip_grad_norm": 0.05, "scheduler": halving, "accumulate": 2}, 4),
]


def _train(stages, timeline, options: dict, steps: int):
    trainer = Trainer(stages, timeline, loss_fn, momentum_sgd, timeout=30, **options)
    losses = [trainer.step(*batch(step)) for step in range(steps)]
    return trainer, losses


def _as_numpy(state: dict) -> dict:
    return {k: v.numpy() for k, v in state.items()}


def _cases(rank: int, world: int, timelines: dict):
    out = {}
    for label, name, model, options, steps in CASES:
        trainer, losses = _train(make_stages(model), timelines[name][0], options, steps)
        out[label] = {"state": _as_numpy(trainer.gather_state_dict()), "losses": losses,
                      "norm": trainer.last_grad_norm,
                      "lr": None if trainer.optimizer is None else trainer.optimizer.param_groups[0]["lr"]}
        trainer.close()
    out["replicated batchnorm"] = _replicated_batchnorm(rank, timelines["ddp"][0])
    out["evaluate"] = _evaluate(timelines["backward_away"][0])
    out["precision"] = _precision(timelines["gpipe"][0])
    out["fp16"] = _fp16_skips(timelines["gpipe"][0])
    out["resume"] = _resume(timelines["one_f_one_b"][0])
    out["record every 2"] = _record_every(timelines["gpipe"][0])
    return out


def _record_every(gpipe):
    trainer = Trainer(make_stages(), gpipe, loss_fn, momentum_sgd, timeout=30, record=2)
    seen = []
    for step in range(3):
        trainer.step(*batch(step))
        timeline = trainer.last_timeline
        seen.append(None if timeline is None else (timeline.source, len(timeline)))
    trainer.close()
    return seen


def _replicated_batchnorm(rank: int, ddp):
    trainer, _ = _train(make_stages("batchnorm"), ddp, {}, 1)
    own = {f"{s}.{k}": v.clone().numpy() for s in range(S) for k, v in trainer.stages[s].state_dict().items()}
    gathered = _as_numpy(trainer.gather_state_dict())
    trainer.close()
    return {"own": own, "gathered": gathered}


def _evaluate(schedule):
    stages = make_stages("batchnorm")
    trainer, _ = _train(stages, schedule, {}, 1)
    before = _as_numpy(trainer.gather_state_dict())
    optimizer_before = copy.deepcopy(trainer.optimizer.state_dict())
    x, y = batch(7, rows=2 * ROWS)  # another batch shape than training's: probed once, then remembered
    losses = [trainer.evaluate(x, y) for _ in range(2)]
    unchanged = all(np.array_equal(v, before[k]) for k, v in _as_numpy(trainer.gather_state_dict()).items())
    momentum = [s["momentum_buffer"] for s in trainer.optimizer.state_dict()["state"].values()]
    same_optimizer = all(torch.equal(a, s["momentum_buffer"])
                         for a, s in zip(momentum, optimizer_before["state"].values()))
    no_grads = all(p.grad is None for stage in trainer.stages if stage is not None for p in stage.parameters())
    training = all(m.training for stage in trainer.stages if stage is not None for m in stage.modules())
    trainer.step(*batch(1))  # evaluating did not advance the step: this is step 2 of the reference
    result = {"before": before, "losses": losses, "unchanged": unchanged, "same_optimizer": same_optimizer,
              "no_grads": no_grads, "training": training, "after": _as_numpy(trainer.gather_state_dict())}
    trainer.close()
    return result


def _precision(gpipe):
    out = {}
    for precision in ("fp32", "bf16"):
        trainer = Trainer(make_stages("plain"), gpipe, loss_fn, momentum_sgd, timeout=30, precision=precision)
        losses = [trainer.step(*batch(0)) for _ in range(4)]
        out[precision] = {"losses": losses, "state": _as_numpy(trainer.gather_state_dict())}
        timeline = trainer.last_timeline
        if timeline is not None:
            out[precision]["bytes"] = sorted({(t.kind, t.nbytes) for t in timeline.transfers
                                              if t.kind in ("activation", "gradient")})
        trainer.close()
    return out


def _fp16_skips(gpipe):
    stages = make_stages("poison")
    trainer = Trainer(stages, gpipe, loss_fn, momentum_sgd, timeout=30, precision="fp16",
                      loss_scale={"init_scale": 1024.0, "growth_interval": 1})
    initial = _as_numpy(trainer.gather_state_dict())
    seen = []
    for step, poison in enumerate((True, False, False)):
        stages[0].poison = poison
        loss = trainer.step(*batch(step))
        seen.append({"loss": loss, "skipped": trainer.last_step_skipped, "state": trainer.training_state(),
                     "weights": _as_numpy(trainer.gather_state_dict())})
    loss = trainer.step(*nan_batch(3))  # a NaN loss under fp16 is an overflow like any other: skipped
    seen.append({"loss": loss, "skipped": trainer.last_step_skipped, "state": trainer.training_state(),
                 "weights": _as_numpy(trainer.gather_state_dict())})
    trainer.close()
    return {"initial": initial, "steps": seen}


def nan_batch(step: int):
    """Step ``step``'s batch with one input NaN: its micro-batch's loss is NaN."""
    x, y = batch(step)
    x = x.clone()
    x[0, 0] = float("nan")
    return x, y


def _resume(schedule):
    options = {"scheduler": halving}
    whole, _ = _train(make_stages("dropout"), schedule, options, 4)
    expected = _as_numpy(whole.gather_state_dict())
    whole.close()
    first, _ = _train(make_stages("dropout"), schedule, options, 2)
    weights, state = first.gather_state_dict(), first.training_state()
    optimizer = None if first.optimizer is None else first.optimizer.state_dict()
    first.close()
    stages = make_stages("dropout")
    for s, stage in enumerate(stages):
        stage.load_state_dict({k.split(".", 1)[1]: v for k, v in weights.items() if k.startswith(f"{s}.")})
    second = Trainer(stages, schedule, loss_fn, momentum_sgd, timeout=30, **options)
    if optimizer is not None:
        second.optimizer.load_state_dict(optimizer)
    second.load_training_state(state)
    for step in (2, 3):
        second.step(*batch(step))
    resumed = _as_numpy(second.gather_state_dict())
    second.close()
    accumulating = Trainer(make_stages("plain"), schedule, loss_fn, momentum_sgd, timeout=30, accumulate=2)
    accumulating.step(*batch(0))
    try:
        accumulating.load_training_state(accumulating.training_state())
        refused = None
    except ShapeError as error:
        refused = str(error)
    with tempfile.TemporaryDirectory() as folder:
        target = Path(folder) / "mid-accumulation"
        try:
            save_checkpoint(accumulating, target)
            save_refused = None
        except CheckpointError as error:
            save_refused = str(error)
        written = target.exists() or partial_checkpoint(target).exists()
    accumulating.close()
    return {"expected": expected, "resumed": resumed, "state": state, "refused": refused,
            "save refused": save_refused, "written": written}


@pytest.fixture(scope="module")
def trained():
    return run_ranks(_cases, W, schedules(), timeout=300)


def reference(model: str, steps: int, micro_batches: int, batches=None, stages=None, **options):
    stages = make_stages(model) if stages is None else stages
    batches = (batch(step) for step in range(steps)) if batches is None else batches
    return train_one_process(stages, loss_fn, momentum_sgd, batches, micro_batches=micro_batches, **options)


# ---------------------------------------------------------------------- matching one process
@pytest.mark.parametrize("label,name,model,options,steps", CASES)
def test_options_train_like_one_process(trained, label, name, model, options, steps):
    micro_batches = schedules()[name][1]
    losses, expected = reference(model, steps, micro_batches, **options)
    assert largest_change(expected, state_of(make_stages(model))) > 5e-3, "training must move the weights"
    assert_every_rank_matches([rows[label]["state"] for rows in trained], expected, label)
    for rows in trained:
        assert np.allclose(rows[label]["losses"], losses, atol=1e-5), label
    if "clip_grad_norm" in options:
        _, unclipped = reference(model, steps, micro_batches, **{k: v for k, v in options.items() if k != "clip_grad_norm"})
        assert largest_change(unclipped, expected) > 1e-3, "the clipping must bite"
        norms = {rows[label]["norm"] for rows in trained}
        assert len(norms) == 1 and norms.pop() > options["clip_grad_norm"]
    if "scheduler" in options:
        lrs = {rows[label]["lr"] for rows in trained}
        assert lrs == {0.2 * 0.5 ** (steps // options.get("accumulate", 1))}


def test_dropout_masks_come_from_the_seed_not_the_schedule(trained):
    """Another seed gives other masks (so the match above is not luck), and the
    derivation separates steps, stages and micro-batches."""
    _, seeded = reference("dropout", 2, B)
    _, other = reference("dropout", 2, B, seed=1)
    assert largest_change(other, seeded) > 1e-2
    seeds = {x for k in range(3) for row in micro_batch_seeds(0, k, 3, 4) for x in row}
    assert len(seeds) == 36 and all(0 <= x < 2 ** 63 for x in seeds)


def test_accumulating_two_steps_equals_one_step_on_both_batches(trained):
    """accumulate=2 over batches 0 and 1 is one step on their union (mean of the two means)."""
    _, accumulated = reference("plain", 2, B, accumulate=2)
    union = torch.cat([batch(0)[0], batch(1)[0]]), torch.cat([batch(0)[1], batch(1)[1]])
    _, together = reference("plain", 1, 2 * B, batches=[union])
    for key, value in together.items():
        assert torch.allclose(accumulated[key], value, atol=1e-6), key


# ---------------------------------------------------------------------- buffers
def test_replicas_average_batchnorm_statistics_at_the_end_of_a_step(trained):
    """ddp on 3 ranks, one micro-batch each: every rank ends the step with the
    mean of the running statistics the three micro-batches give alone."""
    x, _ = batch(0)
    runs = []
    for b, rows in enumerate(x.chunk(W)):
        stages = make_stages("batchnorm")
        value = rows
        for s, stage in enumerate(stages):
            torch.manual_seed(micro_batch_seeds(0, 0, S, B)[s][b])
            value = stage(value)
        runs.append(state_of(stages))
    for rank, rows in enumerate(trained):
        own = rows["replicated batchnorm"]["own"]
        for key in [k for k in own if "running" in k]:
            expected = torch.stack([run[key] for run in runs]).mean(0)
            assert np.abs(own[key] - expected.numpy()).max() < 1e-6, (rank, key)
            assert not torch.allclose(runs[0][key], runs[1][key]), "the replicas' statistics must differ before"
        tracked = [k for k in own if k.endswith("num_batches_tracked")]
        assert tracked and all(int(own[k]) == 1 for k in tracked)
    # the weights still follow one process (BatchNorm normalizes with each micro-batch's statistics)
    _, expected = reference("batchnorm", 1, W)
    weights = {k: v for k, v in expected.items() if "running" not in k and "tracked" not in k}
    for rows in trained:
        for key, value in weights.items():
            assert np.abs(rows["replicated batchnorm"]["gathered"][key] - value.numpy()).max() < 1e-5, key


# ---------------------------------------------------------------------- evaluate
def test_evaluate_is_forward_only_and_touches_nothing(trained):
    stages = make_stages("batchnorm")
    train_one_process(stages, loss_fn, momentum_sgd, [batch(0)], micro_batches=B)
    for stage in stages:
        stage.eval()
    x, y = batch(7, rows=2 * ROWS)
    with torch.no_grad():
        value = x
        for stage in stages:
            value = stage(value)
        expected = float(loss_fn(value, y))
    for rows in trained:
        seen = rows["evaluate"]
        assert seen["losses"][0] == seen["losses"][1] and abs(seen["losses"][0] - expected) < 1e-5
        assert seen["unchanged"] and seen["same_optimizer"] and seen["no_grads"] and seen["training"]
    assert len({rows["evaluate"]["losses"][0] for rows in trained}) == 1
    _, two_steps = reference("batchnorm", 2, B)
    assert_every_rank_matches([rows["evaluate"]["after"] for rows in trained], two_steps, "step after evaluate")


# ---------------------------------------------------------------------- precision
def test_bf16_trains_close_to_fp32_and_sends_bf16(trained):
    for rows in trained:
        fp32, bf16 = rows["precision"]["fp32"]["losses"], rows["precision"]["bf16"]["losses"]
        assert fp32[-1] < 0.9 * fp32[0] and bf16[-1] < 0.9 * bf16[0]
        assert all(abs(a - b) / a < 0.02 for a, b in zip(fp32, bf16)), (fp32, bf16)
    _, expected = reference("plain", 4, B, batches=[batch(0)] * 4, precision="bf16")
    _, fp32_reference = reference("plain", 4, B, batches=[batch(0)] * 4)
    for rows in trained:
        state = rows["precision"]["bf16"]["state"]
        # bf16 computes other numbers than fp32, and the same as one process in bf16
        assert max(np.abs(state[k] - fp32_reference[k].numpy()).max() for k in state) > 1e-4
        assert max(np.abs(state[k] - expected[k].numpy()).max() for k in state) < 1e-5
    rows_per = ROWS // B
    full = rows_per * WIDTH * 4
    assert trained[0]["precision"]["fp32"]["bytes"] == [("activation", full), ("gradient", full)]
    assert trained[0]["precision"]["bf16"]["bytes"] == [("activation", full // 2), ("gradient", full // 2)]


def test_fp16_skips_a_step_with_an_infinite_gradient_on_every_rank(trained):
    """Only rank 0's stage 0 gets an infinite gradient in step 1: every rank
    skips that step and halves the scale, then steps and grows it back, as
    torch's GradScaler does in one process; a NaN loss in step 4 is skipped
    alike (it raised NonFiniteLossError)."""
    def batches(stages):
        for step, poison in enumerate((True, False, False)):
            stages[0].poison = poison
            yield batch(step)
        yield nan_batch(3)

    stages = make_stages("poison")
    _, expected = train_one_process(stages, loss_fn, momentum_sgd, batches(stages), micro_batches=B,
                                    precision="fp16", loss_scale={"init_scale": 1024.0, "growth_interval": 1})
    for rank, rows in enumerate(trained):
        seen = rows["fp16"]["steps"]
        assert [s["skipped"] for s in seen] == [True, False, False, True], rank
        assert [s["state"]["loss_scale"]["scale"] for s in seen] == [512.0, 1024.0, 2048.0, 1024.0], rank
        assert all(np.array_equal(v, rows["fp16"]["initial"][k]) for k, v in seen[0]["weights"].items())
        assert all(np.array_equal(v, seen[2]["weights"][k]) for k, v in seen[3]["weights"].items())
        assert all(np.isfinite(s["loss"]) for s in seen[:3]) and np.isnan(seen[3]["loss"])
        final = seen[-1]["weights"]
        assert max(np.abs(final[k] - expected[k].numpy()).max() for k in expected) < 1e-3
        assert largest_change({k: torch.from_numpy(v) for k, v in final.items()},
                              {k: torch.from_numpy(v) for k, v in rows["fp16"]["initial"].items()}) > 1e-2


# ---------------------------------------------------------------------- resuming
def test_a_resumed_run_continues_exactly(trained):
    for rank, rows in enumerate(trained):
        seen = rows["resume"]
        assert seen["state"]["step"] == 2 and seen["state"]["accumulated"] == 0
        for key, value in seen["expected"].items():
            assert np.abs(seen["resumed"][key] - value).max() < 1e-6, (rank, key)
        assert "after 1 of 2 accumulated steps" in seen["refused"]
        assert "cannot save checkpoint" in seen["save refused"] and "after 1 of 2 accumulated steps" in seen["save refused"]
        assert not seen["written"]


# ---------------------------------------------------------------------- recording
def test_record_n_measures_every_nth_step_on_rank_0(trained):
    every = S * B * 2
    assert trained[0]["record every 2"] == [None, ("measured", every), ("measured", every)]
    assert all(rows["record every 2"] == [None, None, None] for rows in trained[1:])


# ---------------------------------------------------------------------- bad options
def _refusals(rank: int, world: int, schedule):
    from torch.distributed.distributed_c10d import _world

    groups_before = len(_world.pg_map)
    seen = {}
    made = {
        "stages": lambda: Trainer([1, 2], schedule, loss_fn, momentum_sgd, timeout=10),
        "timeout nan": lambda: Trainer(make_stages()[:2], schedule, loss_fn, momentum_sgd, timeout=float("nan")),
        "timeout 0": lambda: Trainer(make_stages()[:2], schedule, loss_fn, momentum_sgd, timeout=0),
        "timeout -1": lambda: Trainer(make_stages()[:2], schedule, loss_fn, momentum_sgd, timeout=-1),
        "lookahead": lambda: Trainer(make_stages()[:2], schedule, loss_fn, momentum_sgd, lookahead="2"),
        "precision": lambda: Trainer(make_stages()[:2], schedule, loss_fn, momentum_sgd, precision="fp8"),
        "clip 0": lambda: Trainer(make_stages()[:2], schedule, loss_fn, momentum_sgd, clip_grad_norm=0),
        "clip nan": lambda: Trainer(make_stages()[:2], schedule, loss_fn, momentum_sgd, clip_grad_norm=float("nan")),
        "scheduler": lambda: Trainer(make_stages()[:2], schedule, loss_fn, momentum_sgd, scheduler=3),
        "scheduler result": lambda: Trainer(make_stages()[:2], schedule, loss_fn, momentum_sgd, scheduler=lambda o: 3),
        "accumulate": lambda: Trainer(make_stages()[:2], schedule, loss_fn, momentum_sgd, accumulate=0),
        "loss_scale": lambda: Trainer(make_stages()[:2], schedule, loss_fn, momentum_sgd, loss_scale={"x": 1}),
        "optimizer result": lambda: Trainer(make_stages()[:2], schedule, loss_fn, lambda params: 42),
        "optimizer none": lambda: Trainer(make_stages()[:2], schedule, loss_fn, lambda params: None),
        "device": lambda: Trainer(make_stages()[:2], schedule, loss_fn, momentum_sgd, device="tpu:x"),
    }
    if not torch.cuda.is_available():
        made["cuda"] = lambda: Trainer(make_stages()[:2], schedule, loss_fn, momentum_sgd, device="cuda")
    start = time.monotonic()
    for label, make in made.items():
        try:
            make()
            seen[label] = None
        except (ShapeError, ProgramError) as error:
            seen[label] = f"{type(error).__name__}: {error}"
    seen["seconds"] = time.monotonic() - start
    seen["groups_left"] = len(_world.pg_map) - groups_before
    return seen


REFUSALS = {
    "stages": "stages[0] is of type int, not a torch.nn.Module",
    "timeout nan": "timeout must be a positive, finite number of seconds, got nan",
    "timeout 0": "timeout must be a positive, finite number of seconds, got 0",
    "timeout -1": "timeout must be a positive, finite number of seconds, got -1",
    "lookahead": "lookahead must be a whole number of items >= 0 (how early a receive is posted), got '2'",
    "precision": "precision must be one of 'fp32', 'bf16', 'fp16', got 'fp8'",
    "clip 0": "clip_grad_norm must be a positive, finite number",
    "clip nan": "clip_grad_norm must be a positive, finite number",
    "scheduler": "scheduler must be a factory optimizer -> LRScheduler",
    "scheduler result": "the scheduler factory returned 3, which has no step()",
    "accumulate": "accumulate must be a whole number >= 1",
    "loss_scale": "loss_scale applies to precision='fp16' only",
    "optimizer result": "the optimizer factory returned 42, which is not an optimizer",
    "optimizer none": "the optimizer factory returned None (does it end without a return?), which is not an optimizer",
    "device": "device='tpu:x' is not a device torch knows",
}
if not torch.cuda.is_available():
    REFUSALS["cuda"] = "device='cuda' but this torch sees no CUDA device"


def _replicas_built_apart(rank: int, world: int, schedule):
    stages = make_stages()
    torch.manual_seed(100 + rank)  # each rank draws its own weights for the first stage
    stages[0] = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    stages[0][1].running_mean.fill_(float(rank))
    stages[0][3].requires_grad_(False)  # a frozen layer: replicas must agree on it too
    trainer = Trainer(stages, schedule, loss_fn, momentum_sgd, timeout=30)
    built = {k: v.detach().clone() for k, v in trainer.stages[0].state_dict().items()}
    trainer.step(*batch(0))
    after = {k: v.detach().clone() for k, v in trainer.stages[0].state_dict().items()}
    trainer.close()
    return {"built": built, "after": after}


def test_replicas_built_apart_start_from_the_lowest_ranks_weights():
    results = run_local(_replicas_built_apart, W, schedules()["ddp"][0], timeout=90)
    torch.manual_seed(100)
    expected = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))
    for r in results:
        assert r.error is None, r.error
        built, after = r.value["built"], r.value["after"]
        for key in ("0.weight", "0.bias", "3.weight", "3.bias"):
            assert torch.equal(built[key], expected.state_dict()[key]), (r.rank, key)
        assert torch.equal(built["1.running_mean"], torch.zeros(WIDTH))  # rank 0's buffer
        for key in after:  # and they train alike
            assert torch.equal(after[key], results[0].value["after"][key]), (r.rank, key)


def test_bad_options_are_refused_alike_on_every_rank():
    results = run_local(_refusals, 2, simulate(2, 2, 2, policies.get("gpipe", num_workers=2, num_stages=2,
                                                                     num_batches=2)).timeline, timeout=90)
    for r in results:
        assert r.error is None, r.error
        for label, expected in REFUSALS.items():
            assert r.value[label] is not None and expected in r.value[label], (label, r.value[label])
            assert "Traceback" not in r.value[label]
        assert r.value["groups_left"] == 0 and r.value["seconds"] < 30
    assert {k: v for k, v in results[0].value.items() if k != "seconds"} == \
        {k: v for k, v in results[1].value.items() if k != "seconds"}


def test_the_one_process_reference_refuses_the_options_it_shares_by_name():
    stages, batches = make_stages(), [batch(0)]
    for options, expected in (({"accumulate": 0}, "accumulate must be a whole number >= 1"),
                              ({"precision": "fp8"}, "precision must be one of"),
                              ({"loss_scale": {"init_scale": 8.0}}, "loss_scale applies to precision='fp16' only")):
        with pytest.raises(ShapeError, match=expected):
            train_one_process(stages, loss_fn, momentum_sgd, batches, **options)
    with pytest.raises(ShapeError, match="optimizer must be callable"):
        train_one_process(stages, loss_fn, None, batches)


def test_a_loss_that_is_not_a_scalar_is_refused_by_its_shape_not_its_values():
    """A per-row loss (no reduction) is named by its shape: its thousands of values were printed."""
    from unisched.execute.training import scalar_loss

    with pytest.raises(ShapeError) as refused:
        scalar_loss(torch.zeros(100, 100), 3)
    assert str(refused.value) == ("loss_fn must return a scalar tensor, got a tensor of shape (100, 100) for "
                                  "micro-batch 3; reduce it (e.g. .mean())")


def test_one_process_refuses_targets_with_fewer_rows_as_the_trainer_does():
    """The reference splits a batch by the Trainer's rule (``split_batch``): 16 input rows with 4
    target rows trained silently there too, each target broadcast over 4 rows."""
    stages = [nn.Linear(3, 1)]
    mse = lambda out, target: ((out - target) ** 2).mean()  # noqa: E731
    with pytest.raises(ShapeError, match="targets has 4 rows but inputs has 16"):
        train_one_process(stages, mse, momentum_sgd, [(torch.randn(16, 3), torch.randn(4, 1))], micro_batches=4)
    per_token = train_one_process(stages, lambda out, target: ((out - target.reshape(-1, 2).mean(1, keepdim=True)) ** 2)
                                  .mean(), momentum_sgd, [(torch.randn(16, 3), torch.randn(32))], micro_batches=4)
    assert np.isfinite(per_token[0][0]), "a whole multiple of the rows (two targets a row, flattened) passes"


def test_a_loss_scale_resumed_in_another_precision_starts_as_that_precision_does():
    """An fp16 checkpoint resumed in fp32 or bf16 scaled the loss by the saved 65536 without
    unscaling the gradients (the loss blew up); an fp32 one resumed in fp16 ran unscaled."""
    from unisched.execute.training import loss_scale

    fp16 = loss_scale("fp16", None)
    fp16.update(found_inf=True)
    saved = fp16.state()
    for precision in ("fp32", "bf16"):
        resumed = loss_scale(precision, None)
        resumed.load(saved)
        assert resumed.scale == 1.0
    resumed = loss_scale("fp16", None)
    resumed.load(loss_scale("fp32", None).state())
    assert resumed.scale == 2.0 ** 16
    resumed.load(saved)
    assert (resumed.scale, resumed.good_steps) == (2.0 ** 15, 0)
