"""Tensor (intra-operator) parallelism for ``epl.split``, Megatron-style.

A pair of Linear layers ``A`` (column-parallel: each device keeps a slice of
A's output features) and ``B`` (row-parallel: the matching slice of B's input
features) with only element-wise layers between them needs one all-reduce in
the forward and one in the backward.  Any other Linear is column-parallel
with its output gathered, so a split module takes and returns whole
tensors, as the runtime's tensor-parallel gangs expect.  For a classifier
too large to gather, :class:`ClassParallelLinear` and
:func:`sharded_cross_entropy` keep the logits sharded over the classes (a
max and two sums all-reduced over the group); ``epl.Trainer`` does not use
them (it computes the loss on gathered logits).

The layers are made *from* full ``nn.Linear`` layers: every process builds
the whole model with the same seed, then keeps its shard, so a split model
starts exactly where the unsplit one does.  Each sharded parameter keeps its
name, and :func:`shard_dims` says along which dimension it was cut, so whole
tensors can be gathered back.

The gradient convention: a tensor that every device of the group holds whole
("replicated") also has the same gradient on every device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from unisched.errors import SplitError


@dataclass(frozen=True)
class Group:
    """A tensor-parallel group: the process group, its ranks, and our place in it."""

    process_group: object
    ranks: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def single(cls) -> "Group":
        """A group of one device: every collective is the identity."""
        return cls(None, (0,), 0)


# ---------------------------------------------------------------------- collectives with gradients
def _all_reduce(tensor: torch.Tensor, group: Group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group.size == 1:
        return tensor
    tensor = tensor.contiguous()
    dist.all_reduce(tensor, op=op, group=group.process_group)
    return tensor


def _all_gather(tensor: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    if group.size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(group.size)]
    dist.all_gather(parts, tensor.contiguous(), group=group.process_group)
    return torch.cat(parts, dim=dim)


def _own_slice(tensor: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    size = tensor.shape[dim]
    if size % group.size:
        raise SplitError(
            f"a tensor of size {size} along dimension {dim} cannot be cut into {group.size} equal parts; "
            f"make it a multiple of {group.size}"
        )
    return tensor.chunk(group.size, dim=dim)[group.index].contiguous()


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; the backward sums the group's partial input gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """Sums the group's partial outputs; the (replicated) gradient passes through."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    """Concatenates the group's slices along ``dim``; the gradient (replicated)
    is cut back to our slice."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.group, ctx.dim), None, None


class _Scatter(torch.autograd.Function):
    """Keeps our slice of a replicated tensor; the slices' gradients are gathered
    so that the input's gradient is replicated again."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _own_slice(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.group, ctx.dim), None, None


def copy_to_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _CopyToGroup.apply(x, group) if group.size > 1 else x


def reduce_from_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _ReduceFromGroup.apply(x, group) if group.size > 1 else x


def gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return _Gather.apply(x, group, dim) if group.size > 1 else x


def scatter(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return _Scatter.apply(x, group, dim) if group.size > 1 else x


# ---------------------------------------------------------------------- layers
def _check_divides(tensor: torch.Tensor, devices: int, dim: int, what: str) -> None:
    if tensor.shape[dim] % devices:
        raise SplitError(
            f"{what} has {tensor.shape[dim]} {'output' if dim == 0 else 'input'} features, which cannot be split "
            f"over {devices} devices; use a multiple of {devices} or a different split(device_count)"
        )


def _cut(tensor: torch.Tensor, group: Group, dim: int, what: str) -> nn.Parameter:
    _check_divides(tensor, group.size, dim, what)
    shard = nn.Parameter(tensor.detach().chunk(group.size, dim=dim)[group.index].clone())
    # Megatron's mark of a parameter split over the group (not a copy), which
    # the Trainer's global gradient norm counts on every shard
    shard.tensor_model_parallel = group.size > 1
    return shard


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + a`` with A's output features (rows) split over the group.

    The output is our slice of the features, or the whole (gathered) output
    with ``gather_output``.
    """

    def __init__(self, linear: nn.Linear, group: Group, gather_output: bool = True, what: str = "Linear"):
        super().__init__()
        self.group = group
        self.gather_output = gather_output
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _cut(linear.weight, group, 0, what)
        self.bias = None if linear.bias is None else _cut(linear.bias, group, 0, what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_group(x, self.group), self.weight, self.bias)
        return gather(y, self.group, -1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}/{self.group.size}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``y = x B^T + b`` with B's input features (columns) split over the group;
    the input is already our slice (a column-parallel layer's output)."""

    def __init__(self, linear: nn.Linear, group: Group, what: str = "Linear"):
        super().__init__()
        self.group = group
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _cut(linear.weight, group, 1, what)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_group(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}/{self.group.size}, out_features={self.out_features}"


class ClassParallelLinear(ColumnParallelLinear):
    """A classifier sharded over its classes: the output is our slice of the
    logits, meant for :func:`sharded_cross_entropy`."""

    def __init__(self, linear: nn.Linear, group: Group, what: str = "classifier"):
        super().__init__(linear, group, gather_output=False, what=what)

    @property
    def class_offset(self) -> int:
        return self.group.index * (self.out_features // self.group.size)


# ---------------------------------------------------------------------- distributed softmax cross-entropy
class _ShardedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, offset):
        local = logits.shape[-1]
        row_max = _all_reduce(logits.detach().max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        total = _all_reduce(exp.sum(dim=-1), group)
        mine = (target >= offset) & (target < offset + local)
        index = (target - offset).clamp(0, local - 1)
        picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * mine
        picked = _all_reduce(picked, group)
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, mine)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, index, mine = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(len(index), device=index.device)
        grad_logits[rows, index] -= mine.to(grad_logits.dtype)
        return grad_logits * (grad / len(index)), None, None, None


def sharded_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, group: Group, offset: int) -> torch.Tensor:
    """Mean softmax cross-entropy over classes sharded across ``group``;
    ``offset`` is the first class of our shard.  Equals
    ``F.cross_entropy(full_logits, target)`` without forming the full logits."""
    if group.size == 1:
        return F.cross_entropy(logits_shard, target)
    return _ShardedCrossEntropy.apply(logits_shard, target, group, offset)


# ---------------------------------------------------------------------- splitting a module
ELEMENTWISE = (
    nn.ReLU, nn.GELU, nn.Tanh, nn.Sigmoid, nn.SiLU, nn.Identity, nn.LeakyReLU, nn.ELU, nn.Softplus, nn.Mish,
    nn.Hardtanh, nn.ReLU6, nn.Dropout,
)


COLUMN = "column"
COLUMN_PAIRED = "column (paired)"
ROW = "row"
CLASS = "class"


@dataclass(frozen=True)
class Sharding:
    """How :func:`split_module` cut one layer, by its name inside the TaskGraph."""

    name: str
    style: str


def split_plan(module: nn.Module, *, classifier: bool = False) -> list[Sharding]:
    """How :func:`split_module` will cut ``module``'s Linear layers, by name.

    In every ``nn.Sequential``, a Linear followed (through element-wise layers
    only) by another Linear becomes a column/row-parallel pair.  Any other
    Linear becomes column-parallel with a gathered output, except, with
    ``classifier``, the module's last layer when it is not paired: it is
    sharded over classes (its output is a logits shard).  Pure, so processes
    outside the group can tell which parameters are sharded.
    """
    plan: list[Sharding] = []
    last = _last_layer_name(module) if classifier else None

    def visit(parent: nn.Module, prefix: str) -> None:
        children = list(parent.named_children())
        styles: dict[str, str] = {}
        if isinstance(parent, nn.Sequential):
            pending = None
            for child_name, child in children:
                if isinstance(child, nn.Linear):
                    if pending is not None:
                        styles[pending], styles[child_name] = COLUMN_PAIRED, ROW
                        pending = None
                    else:
                        pending = child_name
                elif not isinstance(child, ELEMENTWISE):
                    pending = None
        for child_name, child in children:
            full = f"{prefix}.{child_name}" if prefix else child_name
            if isinstance(child, nn.Linear):
                plan.append(Sharding(full, styles.get(child_name) or (CLASS if full == last else COLUMN)))
            else:
                visit(child, full)

    if isinstance(module, nn.Linear):
        return [Sharding("", CLASS if classifier else COLUMN)]
    visit(module, "")
    return plan


def check_split(module: nn.Module, devices: int, where: str) -> None:
    """Refuse what :func:`split_module` could not cut over ``devices`` devices, before any
    process group: a module with no Linear layer to shard, a layer whose features do not divide.
    A module a trainer has split already (in place) passes."""
    if any(isinstance(m, ColumnParallelLinear | RowParallelLinear) for m in module.modules()):
        return
    plan = split_plan(module)
    if devices > 1 and not plan:
        raise SplitError(
            f"{where} has no nn.Linear layer to split over {devices} devices (epl.split shards Linear layers; "
            "every device would compute the whole of it): annotate it with epl.replicate instead"
        )
    for sharding in plan:
        linear = module.get_submodule(sharding.name)
        what = f"layer {sharding.name!r}" if sharding.name else "the Linear module"
        _check_divides(linear.weight, devices, 1 if sharding.style == ROW else 0, f"{what} of {where}")


def split_module(
    module: nn.Module,
    group: Group,
    plan: list[Sharding],
    build: Callable = lambda make: make(),
) -> nn.Module:
    """Replace ``module``'s Linear layers by tensor-parallel ones as ``plan``
    says, in place; returns the module (a new one if ``module`` is itself a
    Linear).  ``build`` wraps module construction (the trainer uses it to keep
    these modules out of TaskGraphs)."""

    def convert(name: str, linear: nn.Linear, style: str) -> nn.Module:
        what = f"layer {name!r}" if name else "the Linear module"
        if style == COLUMN_PAIRED:
            return build(lambda: ColumnParallelLinear(linear, group, gather_output=False, what=what))
        if style == ROW:
            return build(lambda: RowParallelLinear(linear, group, what=what))
        if style == CLASS:
            return build(lambda: ClassParallelLinear(linear, group, what=what))
        return build(lambda: ColumnParallelLinear(linear, group, gather_output=True, what=what))

    for sharding in plan:
        if not sharding.name:
            return convert("", module, sharding.style)
        parent_name, _, child_name = sharding.name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child_name, convert(sharding.name, getattr(parent, child_name), sharding.style))
    return module


def shard_dims(plan: list[Sharding]) -> dict[str, int]:
    """``parameter name -> dimension it is cut along`` for a plan's layers."""
    dims: dict[str, int] = {}
    for sharding in plan:
        prefix = f"{sharding.name}." if sharding.name else ""
        if sharding.style == ROW:
            dims[prefix + "weight"] = 1
        else:
            dims[prefix + "weight"] = 0
            dims[prefix + "bias"] = 0
    return dims


def _last_layer_name(module: nn.Module) -> str | None:
    """The name of the Linear that produces ``module``'s output, when the
    structure shows it (the last child of nested Sequentials)."""
    name, current = "", module
    while isinstance(current, nn.Sequential) and len(current):
        child_name = list(current._modules)[-1]
        name = f"{name}.{child_name}" if name else child_name
        current = current._modules[child_name]
    return name if isinstance(current, nn.Linear) and name else None
