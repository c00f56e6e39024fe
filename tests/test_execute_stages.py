"""Stages built by a factory: each rank builds only the stages it computes
or holds the weights of, each under its own seed, and a factory that builds
a stage differently on two ranks stops every rank, naming both."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unisched
from unisched import policies, simulate
from unisched.execute import Trainer, build_stages, train_one_process

from test_execute import WIDTH, assert_every_rank_matches, batch, largest_change, optimizer, run_ranks, state_of

W = S = 2
B = 2


def factory(stage: int) -> nn.Module:
    """A stage drawn from the random state the Trainer seeds for it."""
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


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

    def uneven(stage: int) -> nn.Module:
        width = WIDTH + 1 if rank == 1 and stage == 0 else WIDTH
        return nn.Sequential(nn.Linear(WIDTH, width), nn.Tanh(), nn.Linear(width, WIDTH))

    try:
        Trainer(uneven, schedule("ddp"), nn.functional.mse_loss, optimizer, timeout=30)
        out["uneven"] = "no error"
    except Exception as error:
        out["uneven"] = f"{type(error).__name__}: {error}"
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
