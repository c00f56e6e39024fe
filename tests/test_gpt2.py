"""A Hugging Face GPT-2 (tiny, random, built in code) split by split_model
and trained by the Trainer on 4 gloo ranks under gpipe, 1F1B, interleaved,
ZB-H1, FSDP, a Cuckoo-style mapping and a planned schedule, each matching
one process to 1e-5 after two steps."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import unisched  # noqa: E402
from unisched import policies, simulate  # noqa: E402
from unisched.execute import SplitError, Trainer, split_model, train_one_process  # noqa: E402
from unisched.execute.example import counting_tokens, gpt2_config, next_token_loss  # noqa: E402
from unisched.execute.launch import run_local  # noqa: E402

from test_execute import seed_cuckoo  # noqa: E402

VOCAB, POSITIONS, WIDTH, HEADS, LAYERS = 32, 8, 16, 2, 8
ROWS = 16
W = 4


def gpt2(layers: int = LAYERS, attention: str = "eager", tie: bool = True, head: bool = True) -> nn.Module:
    """A GPT-2 with tiny sizes and no dropout, the same on every call (seed 0)."""
    config = gpt2_config(layers, VOCAB, POSITIONS, WIDTH, HEADS, attention, tie_word_embeddings=tie)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config) if head else transformers.GPT2Model(config)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return counting_tokens(100 + step, ROWS, VOCAB, POSITIONS)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def chain(stages, x):
    for stage in stages:
        x = stage(x)
    return x


# ---------------------------------------------------------------------- the split, in one process
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_the_stages_compute_the_models_logits_and_gradients(attention):
    model = gpt2(attention=attention)
    stages = split_model(model, 4, tied="untie")
    x, y = batch(0)
    expected = model(x).logits
    assert (chain(stages, x) - expected).abs().max() < 1e-5
    assert stages.kind == "gpt2" and stages.blocks == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    names = [sorted({k.split(".")[1] if k.startswith("transformer.") else k.split(".")[0]
                     for k in s.state_dict()}) for s in stages]
    assert names == [["h", "wpe", "wte"], ["h"], ["h"], ["h", "lm_head", "ln_f"]]
    assert stages[0].get_submodule("transformer.h.1") is model.transformer.h[1]
    next_token_loss(chain(stages, x), y).backward()
    next_token_loss(model(x).logits, y).backward()
    block = "transformer.h.5.attn.c_attn.weight"
    assert torch.allclose(stages[2].get_parameter(block).grad, model.get_parameter(block).grad, atol=1e-6)


def test_gpt2_balance_and_refusals():
    model = gpt2()
    by_parameters = split_model(model, 3, tied="untie")
    first, last = by_parameters.weights[0], by_parameters.weights[-1]
    assert first > by_parameters.weights[1] and last > by_parameters.weights[1], "embeddings and head count"
    assert [len(r) for r in by_parameters.blocks] == [2, 3, 3], "the embeddings outweigh the head"
    assert [len(r) for r in split_model(model, 3, balance="uniform", tied="untie").blocks] == [3, 3, 2]
    assert len(split_model(model, 8, tied="untie")) == 8
    with pytest.raises(SplitError, match=r"cannot split the GPT-2 \(8 blocks in transformer.h\) into 9 stages"):
        split_model(model, 9)
    timed = split_model(model, 2, balance="time", example=batch(0)[0][:2], repeats=1, tied="untie")
    assert len(timed.weights) == LAYERS and min(timed.weights) > 0


def test_the_tied_head_is_untied_by_copy_or_refused():
    model = gpt2()
    with pytest.warns(UserWarning, match=r"lm_head.weight is transformer.wte.weight \(stages 0 and 3\)"):
        stages = split_model(model, 4)
    assert stages.untied == ["lm_head.weight"]
    assert stages[3].lm_head.weight is not stages[0].transformer.wte.weight
    assert torch.equal(stages[3].lm_head.weight, model.transformer.wte.weight)
    assert model.lm_head.weight is model.transformer.wte.weight, "the model keeps its tie"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert split_model(gpt2(), 1).untied == [], "on one stage the tie stays"
        assert split_model(gpt2(tie=False), 4).untied == []
    with pytest.raises(SplitError, match="tied weights fall into different stages: lm_head.weight is transformer.wte"):
        split_model(model, 4, tied="refuse")


def test_trained_stages_load_back_into_the_model_and_a_bare_gpt2_model_splits():
    stages = split_model(gpt2(tie=False), 4)
    _, state = train_one_process(stages, next_token_loss, optimizer, [batch(0)])
    fresh = gpt2(tie=False)
    fresh.load_state_dict(stages.model_state_dict(state))
    x = batch(1)[0]
    assert torch.allclose(fresh(x).logits, chain(stages, x), atol=1e-6)
    body = gpt2(head=False)
    assert torch.allclose(chain(split_model(body, 3), x), body(x).last_hidden_state, atol=1e-5)


# ---------------------------------------------------------------------- training on 4 gloo ranks
def cases(tmp_path_factory) -> list[tuple[str, int, object]]:
    """(name, stages, schedule) for 4 workers."""
    from unisched.plan import plan

    def registered(name: str, S: int, B: int):
        return simulate(W, S, B, policies.get(name, num_workers=W, num_stages=S, num_batches=B))

    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan(W, 4, 4, memory_limit=2, time_limit=2, search_workers=1).save(path)
    return [
        ("gpipe", 4, registered("gpipe", 4, 4)),
        ("one_f_one_b", 4, registered("one_f_one_b", 4, 8)),
        ("interleaved", 8, registered("interleaved", 8, 8)),
        ("zb_h1", 4, registered("zb_h1", 4, 8)),
        ("fsdp", 4, registered("fsdp", 4, 4)),
        ("cuckoo", 4, simulate(W, 4, 8, seed_cuckoo(W, 4, 8))),
        ("plan", 4, unisched.load_plan(path).simulate()),
    ]


def _train(rank: int, world: int, schedules):
    out = {}
    for name, S, timeline in schedules:
        trainer = Trainer(split_model(gpt2(), S, tied="untie"), timeline, next_token_loss, optimizer, timeout=60)
        for step in range(2):
            trainer.step(*batch(step))
        out[name] = {
            "state": {k: v.numpy() for k, v in trainer.gather_state_dict().items()},
            "loss": trainer.last_loss,
            "built": [s for s, stage in enumerate(trainer.stages) if stage is not None],
        }
        trainer.close()
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    schedules = [(name, S, schedule.timeline) for name, S, schedule in cases(tmp_path_factory)]
    results = run_local(_train, W, schedules, timeout=240)
    for r in results:
        assert r.error is None, f"rank {r.rank}: {r.error}"
    return {name: S for name, S, _ in schedules}, [r.value for r in results]


def reference(S: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    return train_one_process(split_model(gpt2(), S, tied="untie"), next_token_loss, optimizer,
                             (batch(step) for step in range(2)))


@pytest.mark.parametrize("name", ["gpipe", "one_f_one_b", "interleaved", "zb_h1", "fsdp", "cuckoo", "plan"])
def test_gpt2_trains_like_one_process(trained, name):
    stage_counts, ranks = trained
    losses, expected = reference(stage_counts[name])
    initial = {f"{s}.{k}": v for s, stage in enumerate(split_model(gpt2(), stage_counts[name], tied="untie"))
               for k, v in stage.state_dict().items()}
    assert max(float((expected[k] - initial[k]).abs().max()) for k in expected) > 1e-3, "training must move weights"
    for rank, rows in enumerate(ranks):
        state = rows[name]["state"]
        assert set(state) == set(expected)
        worst = max(float(np.abs(state[k] - expected[k].numpy()).max()) for k in expected)
        assert worst < 1e-5, f"{name}: rank {rank} differs by {worst:.2e}"
        assert abs(rows[name]["loss"] - losses[-1]) < 1e-5


def test_a_pipeline_rank_builds_only_its_own_stage(trained):
    _, ranks = trained
    assert [rows["gpipe"]["built"] for rows in ranks] == [[0], [1], [2], [3]]
    assert [rows["interleaved"]["built"] for rows in ranks] == [[0, 4], [1, 5], [2, 6], [3, 7]]
