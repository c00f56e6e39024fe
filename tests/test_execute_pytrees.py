"""Tuples, lists and dicts of tensors between stages: integer token ids,
boolean masks and floating tensors that need no gradient travel forward
only, inputs and targets are split leaf by leaf, and every strategy trains
like one process running the same stages by hand; an output that departs
from the structure agreed at the shape probe stops every rank, naming the
stage and the field."""

from __future__ import annotations

import time

import networkx as nx
import numpy as np
import pytest
import torch
from torch import nn

from unisched import ComputeAndWeightWorkers, Direction, Work, policies, simulate
from unisched.errors import ShapeError
from unisched.execute import ExecutionError, Trainer
from unisched.execute.launch import run_local
from unisched.strategy import Gang, Strategy

from test_execute import assert_every_rank_matches, largest_change, optimizer, run_ranks, state_of

W = S = 3
B = 4
ROWS, LENGTH, WIDTH, VOCAB, CLASSES = 8, 5, 6, 11, 3


# ---------------------------------------------------------------------- models
class Embed(nn.Module):
    """Source stage: token ids and a mask in, the masked embeddings out,
    with the ids, the mask and the lengths (floating, no gradient) passed on."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)

    def forward(self, tokens, mask):
        assert tokens.dtype == torch.int64 and mask.dtype == torch.bool
        return self.embed(tokens) * mask.unsqueeze(-1), tokens, mask, mask.sum(1).float()


class Mix(nn.Module):
    """Middle stage: uses the ids (a position-like embedding) and the mask."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.position = nn.Embedding(VOCAB, WIDTH)

    def forward(self, h, tokens, mask, lengths):
        h = torch.tanh(self.linear(h) + self.position((tokens * 3) % VOCAB)) * mask.unsqueeze(-1)
        return h, tokens, mask, lengths


class Head(nn.Module):
    """Sink: a masked mean, scored; returns a dict with an integer count."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, CLASSES)

    def forward(self, h, tokens, mask, lengths):
        pooled = h.sum(1) / lengths.clamp(min=1).unsqueeze(-1)
        return {"score": self.linear(pooled), "count": mask.sum(1)}


class DictEmbed(Embed):
    def forward(self, batch):
        h, tokens, mask, _ = super().forward(batch["tokens"], batch["mask"])
        return {"h": h, "tokens": tokens, "mask": mask}


class DictMix(Mix):
    def forward(self, value):
        lengths = value["mask"].sum(1).float()
        h, _, mask, _ = super().forward(value["h"], value["tokens"], value["mask"], lengths)
        return {"h": h, "mask": mask}


class DictHead(Head):
    def forward(self, value):
        return super().forward(value["h"], None, value["mask"], value["mask"].sum(1).float())["score"]


class Leg(nn.Module):
    """One of two legs of a DAG: (ids, mask) in, (embeddings, mask) out."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)

    def forward(self, tokens, mask):
        return torch.tanh(self.embed(tokens)) * mask.unsqueeze(-1), mask


class Join(nn.Module):
    """The legs' head: takes both legs' tuples, unpacked one after the other."""

    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(WIDTH, CLASSES), nn.Linear(WIDTH, CLASSES)

    def forward(self, h0, mask0, h1, mask1):
        assert mask0.dtype == mask1.dtype == torch.bool
        return {"score": self.left(h0.sum(1)) - self.right(h1.sum(1)), "count": mask0.sum(1)}


MODELS = {
    "tuple": ((Embed, Mix, Head), lambda stages, x: stages[2](*stages[1](*stages[0](*x)))),
    "dict": ((DictEmbed, DictMix, DictHead), lambda stages, x: stages[2](stages[1](stages[0](x)))),
    "legs": ((Leg, Leg, Join), lambda stages, x: stages[2](*stages[0](*x), *stages[1](*x))),
}


def make_stages(model: str) -> list[nn.Module]:
    stages = []
    for s, kind in enumerate(MODELS[model][0]):
        torch.manual_seed(100 + s)
        stages.append(kind())
    return stages


def batch(model: str, step: int):
    """Inputs (a tuple, or a dict for the dict model) and targets (a dict) of ROWS rows."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    mask = torch.rand(ROWS, LENGTH, generator=g) > 0.3
    targets = {"y": torch.randn(ROWS, CLASSES, generator=g), "weight": torch.rand(ROWS, generator=g) + 0.5}
    inputs = {"tokens": tokens, "mask": mask} if model == "dict" else (tokens, mask)
    return inputs, targets


def loss_fn(output, target):
    score = output["score"] if isinstance(output, dict) else output
    per_row = ((score - target["y"]) ** 2).mean(1) * target["weight"]
    if isinstance(output, dict):
        per_row = per_row * (output["count"] > 0)
    return per_row.mean()


def one_process(model: str, steps: int = 2) -> dict[str, torch.Tensor]:
    """The same stages composed by hand in one process, on the whole batch."""
    stages = make_stages(model)
    run = MODELS[model][1]
    opt = optimizer([p for stage in stages for p in stage.parameters()])
    for step in range(steps):
        inputs, targets = batch(model, step)
        loss = loss_fn(run(stages, inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {f"{s}.{k}": v.detach().clone() for s, stage in enumerate(stages) for k, v in stage.state_dict().items()}


@pytest.mark.parametrize("model", list(MODELS))
def test_the_one_process_reference_calls_stages_as_the_trainer_does(model):
    """train_one_process unpacks tuples into arguments, so it gives what the
    hand-composed reference gives for every model here."""
    from unisched.execute import train_one_process

    graph = nx.DiGraph([(0, 2), (1, 2)]) if model == "legs" else None
    _, state = train_one_process(make_stages(model), loss_fn, optimizer, (batch(model, step) for step in range(2)),
                                 stage_graph=graph)
    expected = one_process(model)
    assert state.keys() == expected.keys()
    assert all(torch.allclose(state[k], expected[k], atol=1e-6) for k in expected)


# ---------------------------------------------------------------------- schedules
def backward_away(w: Work) -> ComputeAndWeightWorkers:
    """GPipe, but the backward of stages 1 and 2 on even micro-batches runs on
    the next worker: it gets the stash and recomputes the forward there."""
    if w.direction == Direction.BACKWARD and w.stage > 0 and w.batch % 2 == 0:
        return ComputeAndWeightWorkers((w.stage + 1) % W, w.stage)
    return ComputeAndWeightWorkers(w.stage, w.stage)


def scattered_halves(w: Work) -> ComputeAndWeightWorkers:
    """A split backward whose input and weight passes wander away from their forward and from each other."""
    worker = w.stage
    if w.direction == Direction.BACKWARD_INPUT and w.batch % 2 == 0:
        worker = (w.stage + 1) % W
    if w.direction == Direction.BACKWARD_WEIGHT and w.batch % 3 == 0:
        worker = (w.stage + 2) % W
    return ComputeAndWeightWorkers(worker, w.stage)


def head_backward_away(w: Work) -> ComputeAndWeightWorkers:
    """Legs and head on their own workers, the head's backward of micro-batch b on worker b mod 2."""
    if w.stage == 2 and w.direction == Direction.BACKWARD:
        return ComputeAndWeightWorkers(w.batch % 2, 2)
    return ComputeAndWeightWorkers(w.stage, w.stage)


def gang_on_stage_1(collective: bool) -> Strategy:
    return Strategy(mapping=lambda w: ComputeAndWeightWorkers(w.stage, w.stage),
                    gang=lambda w: Gang((1, 2), collective) if w.stage == 1 else None)


def schedule_for(name: str):
    if name in ("gpipe", "one_f_one_b", "zb_h1"):
        return simulate(W, S, B, policies.get(name, num_workers=W, num_stages=S, num_batches=B))
    if name == "backward_away":
        return simulate(W, S, B, backward_away)
    if name == "scattered_halves":
        return simulate(W, S, B, scattered_halves, split_backward=True)
    if name == "head_backward_away":
        return simulate(W, S, B, head_backward_away, stage_graph=nx.DiGraph([(0, 2), (1, 2)]))
    return simulate(W, S, B, gang_on_stage_1(name == "tensor_parallel_gang"))


STRATEGIES = ["gpipe", "one_f_one_b", "zb_h1", "backward_away", "scattered_halves",
              "rows_gang", "tensor_parallel_gang"]
CASES = [(model, name) for model in ("tuple", "dict") for name in STRATEGIES] + [("legs", "head_backward_away")]


# ---------------------------------------------------------------------- real runs on gloo
def _train_cases(rank: int, world: int, timelines: dict):
    out = {}
    for model, name in CASES:
        trainer = Trainer(make_stages(model), timelines[name], loss_fn, optimizer, timeout=30)
        for step in range(2):
            trainer.step(*batch(model, step))
        row = {"state": {k: v.numpy() for k, v in trainer.gather_state_dict().items()}, "loss": trainer.last_loss}
        if rank == 0:
            t = trainer.last_timeline
            row["bytes"] = sorted({(tr.kind, tr.nbytes) for tr in t.transfers if tr.kind in ("activation", "gradient")})
            row["activation_bytes"] = list(t.activation_bytes)
        out[(model, name)] = row
        trainer.close()
    return out


@pytest.fixture(scope="module")
def trained():
    timelines = {name: schedule_for(name).timeline for name in {name for _, name in CASES}}
    return run_ranks(_train_cases, W, timelines, timeout=300)


@pytest.mark.parametrize("model,name", CASES)
def test_pytrees_between_stages_train_like_one_process(trained, model, name):
    reference = one_process(model)
    initial = state_of(make_stages(model))
    for s in range(S):
        assert largest_change(reference, initial, f"{s}.") > 1e-2, f"training must move the weights of stage {s}"
    assert_every_rank_matches([rows[(model, name)]["state"] for rows in trained], reference, f"{model} {name}")
    assert len({rows[(model, name)]["loss"] for rows in trained}) == 1


def test_only_tensors_that_need_a_gradient_send_one_back(trained):
    rows = ROWS // B
    hidden = rows * LENGTH * WIDTH * 4
    ids, mask, lengths = rows * LENGTH * 8, rows * LENGTH, rows * 4
    assert trained[0][("tuple", "gpipe")]["bytes"] == [("activation", hidden + ids + mask + lengths),
                                                       ("gradient", hidden)]
    assert trained[0][("dict", "gpipe")]["bytes"] == sorted([("activation", hidden + ids + mask),
                                                             ("activation", hidden + mask), ("gradient", hidden)])
    assert trained[0][("tuple", "gpipe")]["activation_bytes"] == [ids + mask] + [hidden + ids + mask + lengths] * 2


# ---------------------------------------------------------------------- bad values
class Departing(nn.Module):
    """Stage 1 of the dict model, whose output departs from what the probe
    saw from its ``at``-th call on (call 1 is the probe, calls 2 to 5 the
    micro-batches of step 1)."""

    def __init__(self, how: str, at: int):
        super().__init__()
        torch.manual_seed(101)
        self.inner, self.how, self.at, self.calls = DictMix(), how, at, 0

    def forward(self, value):
        self.calls += 1
        out = self.inner(value)
        if self.calls < self.at:
            return out
        if self.how == "shape":
            out["mask"] = torch.cat([out["mask"], out["mask"][:, :1]], 1)
        elif self.how == "field":
            out["extra"] = out["h"]
        elif self.how == "none":
            out["mask"] = None
        elif self.how == "text":
            return "not a tensor"
        return out


def _departing_run(rank: int, world: int, schedule, how: str, at: int):
    stages = make_stages("dict")
    stages[1] = Departing(how, at)
    trainer = Trainer(stages, schedule, loss_fn, optimizer, timeout=4)
    start = time.monotonic()
    try:
        trainer.step(*batch("dict", 0))
        return {"error": None}
    except ExecutionError as error:
        return {"error": str(error), "seconds": time.monotonic() - start}


DEPARTURES = {
    "shape": (4, "stage 1 output['mask']: shape (2, 6) but (2, 5) was agreed by the shape probe"),
    "field": (3, "stage 1 output has fields ['h'], ['mask'], ['extra'] but ['h'], ['mask'] were agreed "
                 "by the shape probe (new: ['extra'], missing: none)"),
    "none": (5, "stage 1 output['mask'] is a NoneType, not a tensor"),
    "text": (1, "stage 1 output is a str, not a tensor; a stage takes and returns a tensor, or a tuple, list or "
                "dict of tensors (on rank 1)"),
}


@pytest.mark.parametrize("how", list(DEPARTURES))
def test_an_output_that_departs_from_the_probe_stops_every_rank_naming_stage_and_field(how):
    at, expected = DEPARTURES[how]
    start = time.monotonic()
    schedule = schedule_for("gpipe").timeline
    results = run_local(_departing_run, W, schedule, how, at, timeout=60)
    assert time.monotonic() - start < 60
    for r in results:
        assert r.error is None, r.error
        error = r.value["error"]
        assert error is not None and expected in error, (r.rank, error)
        assert r.value["seconds"] < 4 + 5
    if how != "text":
        item = f"1F{at - 2}"
        assert results[1].value["error"].startswith(f"rank 1 raised ShapeError: {expected}")
        assert results[1].value["error"].endswith(f"at {item} in step 1")
        assert all(f"because rank 1 raised ShapeError: {expected}" in r.value["error"] for r in results if r.rank != 1)
    else:  # the probe's failure: every rank heard it from rank 1, and none is blamed for it
        assert all(r.value["error"] == f"the shape probe of step 1 failed: {expected}" for r in results)


def _bad_batches(rank: int, world: int, schedule):
    trainer = Trainer(make_stages("tuple"), schedule, loss_fn, optimizer, timeout=10)
    tokens, mask = batch("tuple", 0)[0]
    targets = batch("tuple", 0)[1]
    seen = {}
    for label, inputs, target in (
        ("rows", {"tokens": tokens, "mask": mask[:6]}, targets),
        ("text", (tokens, "mask"), targets),
        ("scalar", (tokens, mask), {"y": targets["y"], "weight": torch.tensor(1.0)}),
        ("indivisible", (tokens[:6], mask[:6]), targets),
        ("fewer targets", (tokens, mask), {key: value[:4] for key, value in targets.items()}),
    ):
        try:
            trainer.step(inputs, target)
            seen[label] = None
        except ShapeError as error:
            seen[label] = str(error)
    seen["steps counted"] = trainer.training_state()["step"]  # a refused batch is no step (dropout seeds follow it)
    seen["after"] = trainer.step(*batch("tuple", 0))
    trainer.close()
    return seen


def test_a_batch_that_cannot_be_split_is_refused_naming_the_field():
    results = run_local(_bad_batches, W, schedule_for("gpipe").timeline, timeout=60)
    for r in results:
        assert r.error is None, r.error
        seen = r.value
        assert "inputs['mask'] has 6 rows but inputs['tokens'] has 8" in seen["rows"]
        assert "inputs[1] is a str, not a tensor" in seen["text"]
        assert "targets['weight'] is a scalar tensor" in seen["scalar"]
        assert "inputs has 6 rows, which the schedule's 4 micro-batches do not divide" in seen["indivisible"]
        assert "targets has 4 rows but inputs has 8" in seen["fewer targets"]
        assert seen["steps counted"] == 0
        assert np.isfinite(seen["after"])
