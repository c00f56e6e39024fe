"""Split layers equal their unsplit versions: plans in one process, numbers
on 2 gloo processes (one launch runs every check)."""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from unisched.epl.tensor_parallel import (
    CLASS,
    COLUMN,
    COLUMN_PAIRED,
    ROW,
    ColumnParallelLinear,
    Group,
    RowParallelLinear,
    Sharding,
    SplitError,
    shard_dims,
    sharded_cross_entropy,
    split_module,
    split_plan,
)
from unisched.execute.launch import run_local

TOLERANCE = 1e-5


# ---------------------------------------------------------------------- plans
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.ffn = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.0), nn.Linear(8, 4))
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x + self.ffn(self.norm(x)))


def test_pairs_through_elementwise_layers_only():
    plan = split_plan(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.LayerNorm(4), nn.Linear(4, 4)))
    assert plan == [Sharding("0", COLUMN_PAIRED), Sharding("2", ROW), Sharding("4", COLUMN)]


def test_last_unpaired_linear_is_the_class_sharded_classifier():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 10))
    assert split_plan(model, classifier=True) == [
        Sharding("0.0", COLUMN_PAIRED), Sharding("0.2", ROW), Sharding("2", CLASS),
    ]
    paired_last = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 10))
    assert [s.style for s in split_plan(paired_last, classifier=True)] == [COLUMN_PAIRED, ROW]
    assert split_plan(nn.Linear(4, 10), classifier=True) == [Sharding("", CLASS)]


def test_linear_layers_outside_sequentials_gather_their_output():
    plan = split_plan(Block())
    assert plan == [Sharding("ffn.0", COLUMN_PAIRED), Sharding("ffn.3", ROW), Sharding("proj", COLUMN)]
    assert shard_dims(plan) == {
        "ffn.0.weight": 0, "ffn.0.bias": 0, "ffn.3.weight": 1, "proj.weight": 0, "proj.bias": 0,
    }


def test_a_group_of_one_leaves_numbers_unchanged():
    torch.manual_seed(0)
    model = Block()
    reference = Block()
    reference.load_state_dict(model.state_dict())
    split = split_module(model, Group.single(), split_plan(model))
    assert isinstance(split.ffn[0], ColumnParallelLinear) and isinstance(split.ffn[3], RowParallelLinear)
    x = torch.randn(3, 4)
    torch.testing.assert_close(split(x), reference(x))


def test_features_that_do_not_divide_are_an_error():
    group = Group(None, (0, 1, 2), 0)
    with pytest.raises(SplitError, match=r"layer '0' has 8 output features.*3 devices"):
        split_module(nn.Sequential(nn.Linear(4, 8)), group, [Sharding("0", COLUMN)])


def test_split_parameters_carry_megatrons_mark_and_copies_do_not():
    """The Trainer's global gradient norm counts a marked parameter on every
    shard and an unmarked one on shard 0 only (a copy of the others')."""
    plan = split_plan(Block())
    split = split_module(Block(), Group(None, (0, 1), 1), plan)
    marked = {name for name, p in split.named_parameters() if getattr(p, "tensor_model_parallel", False)}
    assert marked == set(shard_dims(plan))
    alone = split_module(Block(), Group.single(), plan)
    assert not any(getattr(p, "tensor_model_parallel", False) for p in alone.parameters())


# ---------------------------------------------------------------------- numbers on two processes
def check_column_row_pair(group: Group) -> float:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 5))
    reference = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 5))
    reference.load_state_dict(model.state_dict())
    plan = split_plan(model)
    split_module(model, group, plan)
    x = torch.randn(4, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, expected = model(x), reference(x_ref)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    diffs = [(out - expected).abs().max(), (x.grad - x_ref.grad).abs().max()]
    dims = shard_dims(plan)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        whole = q.grad.chunk(group.size, dim=dims[name])[group.index] if name in dims else q.grad
        diffs.append((p.grad - whole).abs().max())
    return float(max(diffs))


def check_gathered_column(group: Group) -> float:
    torch.manual_seed(2)
    linear = nn.Linear(3, 6)
    layer = ColumnParallelLinear(linear, group, gather_output=True)
    x = torch.randn(5, 3, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, expected = layer(x), linear(x_ref)
    out.sum().backward()
    expected.sum().backward()
    weight_grad = linear.weight.grad.chunk(group.size)[group.index]
    return float(max((out - expected).abs().max(), (x.grad - x_ref.grad).abs().max(),
                     (layer.weight.grad - weight_grad).abs().max()))


def check_sharded_cross_entropy(group: Group) -> float:
    torch.manual_seed(3)
    logits = torch.randn(6, 10) * 4
    target = torch.randint(0, 10, (6,))
    shard = logits.chunk(group.size, dim=1)[group.index].clone().requires_grad_(True)
    whole = logits.clone().requires_grad_(True)
    loss = sharded_cross_entropy(shard, target, group, group.index * 5)
    expected = F.cross_entropy(whole, target)
    loss.backward()
    expected.backward()
    expected_shard_grad = whole.grad.chunk(group.size, dim=1)[group.index]
    return float(max((loss - expected).abs(), (shard.grad - expected_shard_grad).abs().max()))


def random_model(generator: torch.Generator) -> nn.Sequential:
    """A Sequential of Linear layers (even widths), element-wise layers and LayerNorms."""
    width = first_width = 2 * int(torch.randint(1, 5, (), generator=generator))
    layers: list[nn.Module] = []
    for _ in range(int(torch.randint(2, 7, (), generator=generator))):
        kind = int(torch.randint(0, 4, (), generator=generator))
        if kind <= 1:
            out = 2 * int(torch.randint(1, 6, (), generator=generator))
            layers.append(nn.Linear(width, out))
            width = out
        elif kind == 2:
            layers.append(nn.GELU() if torch.rand((), generator=generator) < 0.5 else nn.Tanh())
        else:
            layers.append(nn.LayerNorm(width))
    model = nn.Sequential(*layers, nn.Linear(width, 6))
    model.in_features = first_width
    return model


def check_random_models(group: Group) -> float:
    """Random layer sequences, with and without a class-sharded classifier."""
    generator = torch.Generator().manual_seed(4)
    diffs = []
    for _ in range(12):
        model = random_model(generator)
        torch.manual_seed(int(torch.randint(0, 10**6, (), generator=generator)))
        for layer in model:
            if isinstance(layer, nn.LayerNorm):
                nn.init.normal_(layer.weight)
        reference = copy.deepcopy(model)
        classifier = bool(torch.rand((), generator=generator) < 0.5)
        plan = split_plan(model, classifier=classifier)
        split_module(model, group, plan)
        x = torch.randn(5, model.in_features)
        target = torch.randint(0, 6, (5,))
        out = model(x)
        if classifier and plan[-1].style == CLASS:
            loss = sharded_cross_entropy(out, target, group, group.index * 3)
        else:
            loss = F.cross_entropy(out, target)
        expected = F.cross_entropy(reference(x), target)
        loss.backward()
        expected.backward()
        diffs.append((loss - expected).abs())
        dims = shard_dims(plan)
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
            whole = q.grad.chunk(group.size, dim=dims[name])[group.index] if name in dims else q.grad
            diffs.append((p.grad - whole).abs().max())
    return float(max(diffs))


CHECKS = [check_column_row_pair, check_gathered_column, check_sharded_cross_entropy, check_random_models]


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    group = Group(dist.new_group(list(range(world))), tuple(range(world)), rank)
    results = {}
    for check in CHECKS:
        try:
            results[check.__name__] = check(group)
        except Exception:
            results[check.__name__] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def two_ranks():
    outcome = run_local(_worker, 2, timeout=90)
    failed = [f"rank {r.rank}: {r.error}" for r in outcome if r.error is not None]
    if failed:
        pytest.fail("\n".join(failed))
    return [r.value for r in outcome]


@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_split_layers_equal_unsplit_on_two_ranks(two_ranks, check):
    for rank, results in enumerate(two_ranks):
        value = results[check]
        assert not isinstance(value, str), f"rank {rank}: {value}"
        assert value < TOLERANCE, f"rank {rank}: differs by {value}"
