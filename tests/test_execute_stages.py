"""Stages built by a factory: each rank builds only the stages it computes
or holds the weights of, each under its own seed, and a factory that builds
a stage differently on two ranks stops every rank, naming both.  Stages on
the meta device are initialized under the same seeds, or loaded from a state
dict; a count that differs from the schedule's, a module that cannot be
initialized and a state dict that does not fit are refused, naming them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unisched
from unisched import policies, simulate
from unisched.errors import ShapeError
from unisched.execute import Trainer, build_stages, split_model, train_one_process
from unisched.execute.stages import materialize, materialize_stage, stages_from_state_dict

from test_execute import WIDTH, assert_every_rank_matches, batch, largest_change, optimizer, run_ranks, state_of

W = S = 2
B = 2


def factory(stage: int) -> nn.Module:
    """A stage drawn from the random state the Trainer seeds for it."""
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


def on_meta(stage: int) -> nn.Module:
    """The factory's stage with shapes only: the Trainer initializes it."""
    with torch.device("meta"):
        return factory(stage)


def schedule(name: str):
    return simulate(W, S, B, policies.get(name, num_workers=W, num_stages=S, num_batches=B))


def reference() -> dict[str, torch.Tensor]:
    batches = (batch(step) for step in range(2))
    return train_one_process(build_stages(factory, S), nn.functional.mse_loss, optimizer, batches)[1]


def _train(rank: int, world: int):
    out = {}
    for name in ("gpipe", "fsdp"):
        built: list[int] = []

        def counting(stage: int) -> nn.Module:
            built.append(stage)
            return factory(stage)

        trainer = Trainer(counting, schedule(name), nn.functional.mse_loss, optimizer, timeout=30)
        for step in range(2):
            trainer.step(*batch(step))
        out[name] = {
            "built": built,
            "none": [s for s, stage in enumerate(trainer.stages) if stage is None],
            "state": {k: v.numpy() for k, v in trainer.gather_state_dict().items()},
            "weight_bytes": trainer.weight_bytes,
        }
        trainer.close()
    saved = state_of(build_stages(factory, S, seed=3))
    for name, stages in (("meta", on_meta), ("loaded", stages_from_state_dict([on_meta(s) for s in range(S)], saved))):
        trainer = Trainer(stages, schedule("gpipe"), nn.functional.mse_loss, optimizer, timeout=30)
        for step in range(2):
            trainer.step(*batch(step))
        out[name] = {"state": {k: v.numpy() for k, v in trainer.gather_state_dict().items()},
                     "none": [s for s, stage in enumerate(trainer.stages) if stage is None]}
        trainer.close()

    def uneven(stage: int) -> nn.Module:
        width = WIDTH + 1 if rank == 1 and stage == 0 else WIDTH
        return nn.Sequential(nn.Linear(WIDTH, width), nn.Tanh(), nn.Linear(width, WIDTH))

    try:
        Trainer(uneven, schedule("ddp"), nn.functional.mse_loss, optimizer, timeout=30)
        out["uneven"] = "no error"
    except Exception as error:
        out["uneven"] = f"{type(error).__name__}: {error}"
    three = split_model(nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(3)]), 3)
    try:
        Trainer(three, schedule("gpipe"), nn.functional.mse_loss, optimizer, timeout=30)
        out["too_many"] = "no error"
    except Exception as error:
        out["too_many"] = f"{type(error).__name__}: {error}"
    return out


@pytest.fixture(scope="module")
def trained():
    return run_ranks(_train, W, timeout=180)


def test_a_pipeline_rank_builds_only_its_stage(trained):
    for rank, result in enumerate(trained):
        assert result["gpipe"]["built"] == [rank]
        assert result["gpipe"]["none"] == [s for s in range(S) if s != rank]


def test_a_rank_that_fetches_weights_builds_the_stages_it_computes(trained):
    for rank, result in enumerate(trained):
        assert result["fsdp"]["built"] == list(range(S)), "fsdp computes every stage on every rank"


@pytest.mark.parametrize("name", ["gpipe", "fsdp"])
def test_seeded_factory_stages_train_like_one_process(trained, name):
    expected = reference()
    assert largest_change(expected, state_of(build_stages(factory, S))) > 1e-3, "training must move weights"
    assert_every_rank_matches([result[name]["state"] for result in trained], expected, name)
    for result in trained:
        per_stage = 2 * (WIDTH * WIDTH + WIDTH) * 4 / 2
        assert result[name]["weight_bytes"] == [per_stage] * S, "every rank knows every stage's size"


def test_build_stages_seeds_each_stage_alone():
    whole = build_stages(factory, 3, seed=7)
    only_last = build_stages(factory, 3, seed=7, only=[2])
    assert only_last[:2] == [None, None]
    assert torch.equal(whole[-1][0].weight, only_last[-1][0].weight)
    assert not torch.equal(whole[0][0].weight, whole[1][0].weight)
    assert not torch.equal(build_stages(factory, 3, seed=8)[2][0].weight, whole[2][0].weight)


def test_a_factory_that_builds_a_stage_differently_on_two_ranks_stops_every_rank(trained):
    for rank, result in enumerate(trained):
        message = result["uneven"]
        assert message.startswith("ProgramError: rank "), f"rank {rank}: {message}"
        assert "stage 0 has parameters of shapes" in message and "build the stages the same way" in message
    assert unisched.Trainer is Trainer


# ---------------------------------------------------------------------- the meta device and state dicts
def test_a_stage_on_the_meta_device_is_initialized_as_the_factory_builds_it():
    real = build_stages(factory, 3, seed=5)
    meta = build_stages(on_meta, 3, seed=5)
    for s in range(3):
        assert not any(p.is_meta for p in meta[s].parameters())
        for (name, a), (_, b) in zip(real[s].state_dict().items(), meta[s].state_dict().items()):
            assert torch.equal(a, b), f"stage {s} {name}"
    listed = materialize([on_meta(s) for s in range(3)], 3, mine=[1], seed=5)
    assert torch.equal(listed[1][0].weight, real[1][0].weight)
    assert listed[0][0].weight.is_meta, "a stage this rank does not need stays on the meta device"


def test_meta_and_loaded_stages_train_like_one_process(trained):
    expected = reference()
    for result in trained:
        assert result["meta"]["none"] == [s for s in range(S) if s != trained.index(result)]
    assert_every_rank_matches([result["meta"]["state"] for result in trained], expected, "meta")
    loaded = train_one_process(build_stages(factory, S, seed=3), nn.functional.mse_loss, optimizer,
                               (batch(step) for step in range(2)))[1]
    assert largest_change(loaded, expected) > 1e-3, "the state dict's weights are not the seed-0 ones"
    assert_every_rank_matches([result["loaded"]["state"] for result in trained], loaded, "loaded")


def test_a_meta_submodule_without_reset_parameters_is_named():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(WIDTH))

        def forward(self, x):
            return x * self.gain

    with torch.device("meta"):
        stage = nn.Sequential(nn.Linear(WIDTH, WIDTH), Scale())
    with pytest.raises(ShapeError, match=r"stage 1 is on the meta device, but its submodule 1 \(Scale, holding gain\) "
                                         r"has no reset_parameters"):
        materialize_stage(stage, 1)


def test_a_state_dict_that_does_not_fit_names_the_stage_and_key():
    saved = state_of(build_stages(factory, S))
    stages = [on_meta(s) for s in range(S)]
    missing = {k: v for k, v in saved.items() if k != "1.0.bias"}
    with pytest.raises(ShapeError, match=r"no '1\.0\.bias' for stage 1"):
        stages_from_state_dict(stages, missing)(1)
    extra = {**saved, "0.2.weight": torch.zeros(1)}
    with pytest.raises(ShapeError, match=r"'0\.2\.weight' is not a weight of stage 0"):
        stages_from_state_dict(stages, extra)(0)
    wrong = {**saved, "0.0.weight": torch.zeros(WIDTH, WIDTH + 1)}
    with pytest.raises(ShapeError, match=rf"'0\.0\.weight' has shape \({WIDTH}, {WIDTH + 1}\) but stage 0's"):
        stages_from_state_dict(stages, wrong)(0)
    with pytest.raises(ShapeError, match="keys of stage 2 .* but there are 2 stages"):
        stages_from_state_dict(stages, {**saved, "2.0.weight": torch.zeros(1)})
    with pytest.raises(ShapeError, match="'weight' is not '<stage>.<name>'"):
        stages_from_state_dict(stages, {"weight": torch.zeros(1)})
    loaded = stages_from_state_dict(stages, saved)
    assert len(loaded) == S
    assert torch.equal(loaded(1)[0].weight, saved["1.0.weight"])
    assert loaded(1)[0].weight.data_ptr() != saved["1.0.weight"].data_ptr(), "training must not write into the dict"


def test_a_split_into_more_stages_than_the_schedule_stops_every_rank(trained):
    for rank, result in enumerate(trained):
        assert "the schedule has 2 stages but the ModelStages has 3" in result["too_many"], f"rank {rank}"


def test_more_or_fewer_stages_than_the_schedule_are_refused_where_countable():
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(3)])
    with pytest.raises(ShapeError, match="the schedule has 2 stages but the ModelStages has 3"):
        materialize(split_model(model, 3), 2, mine=[0], seed=0)
    with pytest.raises(ShapeError, match="the schedule has 2 stages but the list of stage modules has 1"):
        materialize([factory(0)], 2, mine=[0], seed=0)
    saved = state_of(build_stages(factory, 3))
    with pytest.raises(ShapeError, match="the schedule has 2 stages but the StateDictStages has 3"):
        materialize(stages_from_state_dict([on_meta(s) for s in range(3)], saved), 2, mine=[0], seed=0)
    assert materialize(factory, 2, mine=[1], seed=0)[0] is None, "a plain factory cannot be counted"
