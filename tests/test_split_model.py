"""split_model: a balanced contiguous partition, stages that compute what the
model computes under its own parameter names, the pipelining tracer for other
models, and clear refusals (too many stages, a cut the Trainer cannot pass,
tied weights across stages when asked to refuse); tied weights otherwise
recorded as ties, which keep the split model training as the tied one."""

from __future__ import annotations

import itertools
import pickle
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.pipelining import SplitPoint

import unisched
from unisched.execute import ModelStages, SplitError, build_stages, split_model, train_one_process
from unisched.execute.split import balanced_partition
from unisched.execute.ties import Tie


# ---------------------------------------------------------------------- the partition
def brute_force(weights: list[int], parts: int) -> int:
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        largest = max(sum(weights[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
        best = largest if best is None else min(best, largest)
    return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=9), st.data())
def test_partition_minimises_the_heaviest_stage(weights, data):
    parts = data.draw(st.integers(1, len(weights)))
    ranges = balanced_partition(weights, parts)
    assert len(ranges) == parts and all(len(r) for r in ranges)
    assert [i for r in ranges for i in r] == list(range(len(weights)))
    assert max(sum(weights[i] for i in r) for r in ranges) == brute_force(weights, parts)


def test_partition_balances_the_rest_and_gives_earlier_stages_the_extra():
    assert [len(r) for r in balanced_partition([1] * 10, 4)] == [3, 3, 2, 2]
    assert [len(r) for r in balanced_partition([1] * 8, 4)] == [2, 2, 2, 2]
    # a heavy first and last block stand alone; the light middle is shared
    assert balanced_partition([5, 1, 1, 1, 1, 1, 5], 3) == [range(0, 1), range(1, 6), range(6, 7)]
    assert balanced_partition([0.1, 0.2, 0.3], 1) == [range(0, 3)]


def test_partition_refuses_more_parts_than_blocks_and_bad_weights():
    with pytest.raises(SplitError, match="cannot cut 3 blocks into 4 non-empty stages; ask for at most 3"):
        balanced_partition([1, 1, 1], 4)
    with pytest.raises(SplitError, match="finite and not negative"):
        balanced_partition([1, -1, 1], 2)


# ---------------------------------------------------------------------- nn.Sequential
def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def chain(stages, x):
    for stage in stages:
        x = stage(x)
    return x


def test_a_sequential_splits_by_parameter_count_under_its_own_names():
    model = mlp()
    stages = split_model(model, 3)
    assert isinstance(stages, ModelStages) and stages.kind == "sequential"
    assert stages.weights == [20, 0, 40, 0, 72, 0, 18]
    # the heaviest block (72) stands alone; layers without parameters join the earlier stage
    assert stages.blocks == [range(0, 4), range(4, 6), range(6, 7)]
    assert [list(s.state_dict()) for s in stages] == [
        ["0.weight", "0.bias", "2.weight", "2.bias"], ["4.weight", "4.bias"], ["6.weight", "6.bias"]]
    assert stages[0][0] is model[0], "stages share the model's layers"
    x = torch.randn(5, 4)
    assert torch.equal(chain(stages, x), model(x))


def test_uniform_given_and_timed_weights():
    model = mlp()
    assert [len(r) for r in split_model(model, 3, balance="uniform").blocks] == [3, 2, 2]
    given_ = split_model(model, 2, balance=[1, 0, 1, 0, 1, 0, 5])
    assert given_.blocks == [range(0, 6), range(6, 7)] and given_.stage_weights == [3, 5]
    timed = split_model(model, 2, balance="time", example=torch.randn(16, 4), repeats=1)
    assert len(timed.weights) == 7 and all(w > 0 for w in timed.weights)
    assert all(p.grad is None for p in model.parameters()), "timing leaves no gradients behind"
    with pytest.raises(SplitError, match="gives 2 weights but the nn.Sequential .* has 7 blocks"):
        split_model(model, 2, balance=[1, 2])
    with pytest.raises(SplitError, match="pass example="):
        split_model(model, 2, balance="time")
    with pytest.raises(SplitError, match=r"block 0 failed on the example \(RuntimeError: mat1 and mat2"):
        split_model(model, 2, balance="time", example=torch.randn(16, 5), repeats=1)
    with pytest.raises(SplitError, match="balance must be one of parameters, uniform, time"):
        split_model(model, 2, balance="layers")


def test_more_stages_than_blocks_is_refused_with_the_count():
    with pytest.raises(SplitError, match=r"cannot split the nn.Sequential \(7 layers\) into 8 stages: it has 7 blocks"):
        split_model(mlp(), 8)
    with pytest.raises(SplitError, match="at least 1"):
        split_model(mlp(), 0)


def test_the_result_is_a_list_and_a_factory():
    stages = split_model(mlp(), 3)
    assert stages(1) is stages[1]
    assert build_stages(stages, 3) == list(stages)
    with pytest.raises(SplitError, match="stage 3 was asked for, but the model was split into 3 stages"):
        stages(3)
    again = pickle.loads(pickle.dumps(stages))
    assert isinstance(again, ModelStages) and again.blocks == stages.blocks and again(2) is again[2]
    state = {f"{s}.{k}": v for s, stage in enumerate(stages) for k, v in stage.state_dict().items()}
    assert stages.model_state_dict(state).keys() == mlp().state_dict().keys()
    assert unisched.split_model is split_model and unisched.SplitError is SplitError


# ---------------------------------------------------------------------- tied weights
def tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    embed, head = nn.Embedding(10, 6), nn.Linear(6, 10, bias=False)
    head.weight = embed.weight
    return nn.Sequential(embed, nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), head)


def test_tied_weights_across_stages_are_recorded_copies_untied_or_refused():
    model = tied_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stages = split_model(model, 2, balance="uniform")
    assert stages.ties == [Tie("0.weight", ((0, "0.weight"), (1, "4.weight")))] and stages.untied == []
    assert "tied 0.weight (0.weight of stage 0, 4.weight of stage 1)" in repr(stages)
    copy, original = stages[1][-1].weight, stages[0][0].weight
    assert copy is not original and torch.equal(copy, original)
    assert original is model[0].weight and model[4].weight is model[0].weight, "the model itself stays tied"
    assert stages[1][0].weight is model[3].weight, "other parameters are still shared with the model"
    x = torch.randint(0, 10, (3, 5))
    assert torch.equal(chain(stages, x), model(x))
    assert pickle.loads(pickle.dumps(stages)).ties == stages.ties
    untied = split_model(tied_model(), 2, balance="uniform", tied="untie")
    assert untied.untied == ["4.weight"] and untied.ties == []
    assert split_model(tied_model(), 1).ties == [], "a tie inside one stage stays"
    with pytest.raises(SplitError, match=r"tied weights fall into different stages: 4.weight is 0.weight"):
        split_model(tied_model(), 2, balance="uniform", tied="refuse")


def test_recorded_ties_train_the_split_model_as_the_tied_model_in_one_process():
    def loss_fn(out, y):
        return nn.functional.cross_entropy(out.reshape(-1, 10), y.reshape(-1))

    def sgd(params):
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)

    torch.manual_seed(1)
    batches = [(torch.randint(0, 10, (4, 5)), torch.randint(0, 10, (4, 5))) for _ in range(3)]
    whole = split_model(tied_model(), 1)
    expected_losses, expected = train_one_process(whole, loss_fn, sgd, batches, clip_grad_norm=0.3)
    expected = whole.model_state_dict(expected)
    for tied, equal in (("share", True), ("untie", False)):
        stages = split_model(tied_model(), 3, balance="uniform", tied=tied)
        losses, state = train_one_process(stages, loss_fn, sgd, batches, clip_grad_norm=0.3)
        state = stages.model_state_dict(state)
        worst = max(float((state[k] - expected[k]).abs().max()) for k in expected)
        assert (worst < 1e-6) == equal, f"tied={tied}: {worst:.2e} from the tied model"
    assert losses[0] == expected_losses[0] and losses[-1] != expected_losses[-1]


# ---------------------------------------------------------------------- traced models
class Residual(nn.Module):
    """An embedding, a ModuleList of residual blocks and a head: not a Sequential."""

    def __init__(self, blocks: int = 6, tie: bool = False):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(blocks))
        self.head = nn.Linear(8, 16, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x) * 2
        for layer in self.layers:
            h = torch.relu(layer(h)) + h
        return self.head(h)


# torch.export warns about its own deprecations while tracing
traced = pytest.mark.filterwarnings("ignore::FutureWarning")


@traced
def test_another_model_is_traced_by_pipelining_and_cut_between_blocks():
    torch.manual_seed(0)
    model = Residual()
    x = torch.randint(0, 16, (2, 5))
    stages = split_model(model, 3, example=x)
    assert stages.kind == "traced" and stages.blocks == [range(0, 2), range(2, 4), range(4, 6)]
    assert [sorted(s.state_dict())[0] for s in stages] == ["embed.weight", "layers.2.bias", "head.weight"]
    out = chain(stages, x)
    assert torch.equal(out, model(x))
    out.sum().backward()
    model(x).sum().backward()
    assert torch.allclose(stages[1].get_parameter("layers.2.weight").grad, model.layers[2].weight.grad)
    assert "forward" not in model.layers[2].__dict__, "the tracer's split marks are taken off the model"
    again = split_model(model, 2, example=x, balance="time", repeats=1)
    assert len(again) == 2 and len(again.weights) == 6
    explicit = split_model(model, 2, example=x, split_spec={"layers.5": SplitPoint.BEGINNING})
    assert sorted(explicit[1].state_dict()) == ["head.weight", "layers.5.bias", "layers.5.weight"]


@traced
def test_a_traced_models_arguments_are_checked_before_the_trace():
    model = Residual()
    x = torch.randint(0, 16, (2, 5))
    with pytest.raises(SplitError, match="split_spec= asks for a trace.*pass example="):
        split_model(model, 2, split_spec={"layers.5": SplitPoint.BEGINNING})
    with pytest.raises(SplitError, match="split_spec names 'nope', which is not a submodule of Residual"):
        split_model(model, 2, example=x, split_spec={"nope": SplitPoint.BEGINNING})
    with pytest.raises(SplitError, match=r"split_spec\['layers.5'\] must be a torch.distributed.pipelining.SplitPoint"):
        split_model(model, 2, example=x, split_spec={"layers.5": "beginning"})
    with pytest.raises(SplitError, match="the example does not run through Residual's forward"):
        split_model(model, 2, example=torch.randn(2, 5, 3))

    normed = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    frozen = nn.Module()
    frozen.blocks, frozen.forward = nn.ModuleList([normed, nn.Linear(4, 4)]), lambda x: frozen.blocks[1](normed(x))
    normed[1].eval()  # a frozen BatchNorm in a model that trains
    statistics = normed[1].running_mean.clone()
    split_model(frozen, 2, example=torch.randn(8, 4))
    assert torch.equal(normed[1].running_mean, statistics)
    assert frozen.training and normed.training and not normed[1].training and normed[2].training


def test_split_model_refuses_weights_that_are_not_numbers_and_arguments_it_would_ignore():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    for balance in (["a", "b", "c"], ("parameters",), 5):
        with pytest.raises(SplitError, match="one weight \\(a number\\) per block"):
            split_model(model, 2, balance=balance)
    with pytest.raises(SplitError, match="blocks= names the blocks of a traced model.*drop blocks="):
        split_model(model, 2, blocks="nope")
    for repeats in (0, -1, 1.5):
        with pytest.raises(SplitError, match="repeats must be a whole number of at least 1"):
            split_model(model, 2, repeats=repeats)


@traced
def test_the_models_own_pipe_split_calls_are_used():
    from torch.distributed.pipelining import pipe_split

    class Marked(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            x = self.a(x)
            pipe_split()
            return self.b(x)

    model = Marked()
    x = torch.randn(3, 4)
    stages = split_model(model, 2, example=x, split_spec={})
    assert torch.allclose(chain(stages, x), model(x))
    with pytest.raises(SplitError, match="has 2 stages but 3 were asked for"):
        split_model(model, 3, example=x, split_spec={})


@traced
def test_a_trace_the_trainer_cannot_run_is_refused():
    class Skip(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

        def forward(self, x):
            first = self.layers[0](x)
            h = first
            for layer in self.layers[1:]:
                h = layer(h)
            return h + first

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x, scale):
            return self.layers[1](self.layers[0](x) * scale)

    with pytest.raises(SplitError, match="stage 1 of the traced Skip takes 2 values .* skip connection"):
        split_model(Skip(), 2, example=torch.randn(2, 8))
    with pytest.raises(SplitError, match="TwoInputs takes 2 inputs"):
        split_model(TwoInputs(), 2, example=(torch.randn(2, 8), torch.randn(2, 8)))
    with pytest.raises(SplitError, match="pass example="):
        split_model(Residual(), 2)
    with pytest.raises(SplitError, match=r"cannot split Residual \(6 blocks in layers\) into 7 stages"):
        split_model(Residual(), 7, example=torch.randint(0, 16, (2, 5)))
    with pytest.raises(SplitError, match="tied weights fall into different stages: head.weight is embed.weight"):
        split_model(Residual(tie=True), 2, example=torch.randint(0, 16, (2, 5)), tied="refuse")


@traced
def test_a_traced_models_tie_is_recorded_over_the_tracers_copies():
    torch.manual_seed(0)
    model = Residual(tie=True)
    x = torch.randint(0, 16, (2, 5))
    stages = split_model(model, 2, example=x)
    assert stages.ties == [Tie("embed.weight", ((0, "embed.weight"), (1, "head.weight")))]
    first, last = stages[0].get_parameter("embed.weight"), stages[1].get_parameter("head.weight")
    assert first is not last and torch.equal(first, last)
    assert torch.allclose(chain(stages, x), model(x))


# ---------------------------------------------------------------------- a model on the meta device, loaded from its state dict
def test_a_gpt2_on_the_meta_device_splits_and_loads_from_the_models_state_dict():
    transformers = pytest.importorskip("transformers")
    from unisched.execute.stages import build_stages, stages_from_state_dict

    from unisched.execute.example import gpt2_config

    config = gpt2_config(layers=4, vocab=32, positions=8, width=16, heads=2)
    torch.manual_seed(0)
    real = transformers.GPT2LMHeadModel(config)
    with torch.device("meta"):
        empty = transformers.GPT2LMHeadModel(config)
    stages = split_model(empty, 3, tied="untie")
    assert all(p.is_meta for stage in stages for p in stage.parameters())
    loaded = build_stages(stages_from_state_dict(stages, stages.stage_state_dict(real.state_dict())), 3, only=[2])
    assert loaded[:2] == [None, None], "only the stage asked for is built"
    assert torch.equal(loaded[2].get_submodule("lm_head").weight, real.lm_head.weight)
    x = torch.randint(0, 32, (2, 8))
    built = build_stages(stages_from_state_dict(stages, stages.stage_state_dict(real.state_dict())), 3)
    assert torch.allclose(chain(built, x), real(x).logits, atol=1e-6)
    with pytest.raises(SplitError, match="has no transformer.h.3.ln_1.weight, a weight of stage 2"):
        stages.stage_state_dict({k: v for k, v in real.state_dict().items() if "h.3.ln_1" not in k})
    with torch.device("meta"):
        shared = split_model(transformers.GPT2LMHeadModel(config), 3)  # the tied head kept: loading from a state dict keeps the tie for the Trainer
    assert shared.ties and stages_from_state_dict(shared, shared.stage_state_dict(real.state_dict())).ties == shared.ties
    with torch.device("meta"):
        uninitialized = split_model(transformers.GPT2LMHeadModel(config), 3, tied="untie")
    with pytest.raises(unisched.UniSchedError, match="its submodule transformer.h.0.attn.c_attn .* no reset_parameters"):
        build_stages(uninitialized, 3, only=[0])


def test_huge_block_weights_still_give_non_empty_parts():
    """Squares of weights near 1e160 overflowed to inf and the partition came back as empty ranges."""
    from unisched.execute.split import balanced_partition

    parts = balanced_partition([1e160, 1, 1, 1], 2)
    assert all(len(part) for part in parts) and parts[0].start == 0 and parts[-1].stop == 4
    assert balanced_partition([4e300, 1e300, 1e300, 1e300], 2) == balanced_partition([4, 1, 1, 1], 2)
