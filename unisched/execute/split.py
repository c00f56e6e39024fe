"""One model in, pipeline stages out.

``split_model(model, num_stages)`` cuts a model whose body is a sequence of
blocks into ``num_stages`` contiguous stages that the Trainer runs::

    stages = unisched.split_model(model, 4)                  # balanced by parameter count
    trainer = unisched.Trainer(stages, schedule, loss_fn, optimizer)

Three kinds of model are split:

* an ``nn.Sequential``: its children are the blocks; a stage is an
  ``nn.Sequential`` of consecutive children under their own names;
* a Hugging Face GPT-2 (``GPT2LMHeadModel`` or ``GPT2Model``): the
  transformer blocks ``h`` are the blocks, the first stage also embeds the
  token ids (``wte`` + ``wpe``), the last applies ``ln_f`` (and ``lm_head``);
  stages pass the hidden states;
* any other model, given ``example=`` (one micro-batch): traced by
  ``torch.distributed.pipelining.pipeline`` and cut at the beginning of
  chosen blocks of its longest ``ModuleList`` (or where ``split_spec=`` or the
  model's own ``pipe_split()`` calls say), provided the stages form a chain
  that passes one tensor, which is what the Trainer runs.

The partition is contiguous and minimises the heaviest stage, each stage
taking at least one block; the weight of a block is its parameter count
(``balance="parameters"``), 1 (``"uniform"``), its measured forward and
backward time on the example (``"time"``), or given by you (a list).

The result is a list of stage modules that is also a factory
``stage -> module``: the Trainer then keeps only the stages its rank uses.
Stage modules keep the model's parameter names (``stages.model_state_dict``
turns ``Trainer.gather_state_dict()`` back into the model's keys, and
``stages.stage_state_dict`` a model's state dict into the stages' keys, which
``stages_from_state_dict`` loads: split a model built on the meta device,
then load each rank's stages from a checkpoint).

A parameter shared by two stages (GPT-2 ties ``lm_head`` to ``wte``) cannot
be one tensor on two ranks.  By default (``tied="share"``) each later stage
gets its own copy and ``stages.ties`` records the copies
(:class:`unisched.execute.ties.Tie`): the Trainer keeps them one weight,
summing their gradients each step (:mod:`unisched.execute.ties`).
``tied="untie"`` trains the copies apart; ``tied="refuse"`` raises.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import OrderedDict
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from unisched.errors import SplitError, first_line
from unisched.execute.ties import Tie, as_ties
from unisched.work import is_whole

BALANCES = ("parameters", "uniform", "time")
TIED = ("share", "untie", "refuse")


# ---------------------------------------------------------------------- the result
class ModelStages(list):
    """The stages of a split model: a list of ``nn.Module`` and a factory.

    ``stages[s]`` or ``stages(s)`` is stage s.  Given to the Trainer, which
    takes any callable as a factory, a rank keeps only the stages it computes
    or holds; drop your own references to the model and to this list and the
    other stages' weights are freed.  The Trainer checks ``len(stages)``
    against the schedule's number of stages.

    ``blocks[s]`` is the range of block indices of stage s, ``weights`` the
    weight of each block used to balance them, ``kind`` which splitter made
    them ("sequential", "gpt2" or "traced"), ``ties`` the weights several
    stages hold a copy of, which the Trainer keeps one weight
    (:class:`~unisched.execute.ties.Tie`, ``tied="share"``), ``untied`` the
    names of copies trained apart (``tied="untie"``).
    """

    def __init__(self, modules: Iterable[nn.Module], *, kind: str, blocks: Sequence[range],
                 weights: Sequence[float], block_names: Sequence[str], untied: Sequence[str] = (),
                 ties: Sequence[Tie] = ()):
        super().__init__(modules)
        self.kind = kind
        self.blocks = list(blocks)
        self.weights = [float(w) for w in weights]
        self.block_names = list(block_names)
        self.untied = list(untied)
        self.ties = list(as_ties(ties))

    def __call__(self, stage: int) -> nn.Module:
        if not 0 <= stage < len(self):
            raise SplitError(
                f"stage {stage} was asked for, but the model was split into {len(self)} stages; "
                f"split it into as many stages as the schedule has"
            )
        return self[stage]

    @property
    def stage_weights(self) -> list[float]:
        """The summed block weight of each stage (the partition minimises the largest)."""
        return [float(sum(self.weights[i] for i in r)) for r in self.blocks]

    def model_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{"<stage>.<name>": tensor}`` (``Trainer.gather_state_dict()``,
        ``train_one_process``) as the model's own ``{name: tensor}``."""
        out: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            stage, _, name = key.partition(".")
            if name in out:
                raise SplitError(f"{name} comes from two stages; it is not one of this split's parameters")
            out[name] = value
        return out

    def stage_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's own ``{name: tensor}`` as ``{"<stage>.<name>": tensor}``
        for these stages (the inverse of :meth:`model_state_dict`; an untied
        copy takes the tensor saved under its own name), the form
        ``unisched.stages_from_state_dict`` loads, e.g. into stages split from
        a model built on the meta device."""
        out: dict[str, torch.Tensor] = {}
        for s, stage in enumerate(self):
            for name in stage.state_dict():
                if name not in state:
                    raise SplitError(f"the model's state dict has no {name}, a weight of stage {s}; "
                                     f"give the state dict of the model that was split")
                out[f"{s}.{name}"] = state[name]
        return out

    def __repr__(self) -> str:
        spans = ", ".join(f"{r.start}-{r.stop - 1}" if len(r) > 1 else f"{r.start}" for r in self.blocks)
        untied = f", untied {self.untied}" if self.untied else ""
        tied = f", tied {'; '.join(map(str, self.ties))}" if self.ties else ""
        return f"ModelStages({len(self)} {self.kind} stages of {len(self.weights)} blocks: {spans}{untied}{tied})"

    def __reduce__(self):
        return (_rebuild, (list(self), self.kind, self.blocks, self.weights, self.block_names, self.untied,
                           self.ties))


def _rebuild(modules, kind, blocks, weights, block_names, untied, ties=()) -> ModelStages:
    return ModelStages(modules, kind=kind, blocks=blocks, weights=weights, block_names=block_names, untied=untied,
                       ties=ties)


# ---------------------------------------------------------------------- the entry point
def split_model(
    model: nn.Module,
    num_stages: int,
    *,
    balance: str | Sequence[float] = "parameters",
    example: Any = None,
    blocks: str | None = None,
    split_spec: dict | None = None,
    tied: str = "share",
    repeats: int = 5,
) -> ModelStages:
    """Split ``model`` into ``num_stages`` pipeline stages, balanced by ``balance``.

    ``balance``: "parameters" (default), "uniform", "time" (each block's
    forward and backward measured on ``example``, the fastest of ``repeats``
    runs after a warm-up), or one weight per block.  ``example``: one
    micro-batch of input, needed to time blocks and to trace a model that is
    neither an ``nn.Sequential`` nor a GPT-2.  ``blocks``: the dotted name of
    the ``ModuleList`` (or ``Sequential``) whose children are the blocks of a
    traced model (default: the longest one).  ``split_spec``: for a traced
    model, ``torch.distributed.pipelining`` split points used as they are
    (``{}``: the ``pipe_split()`` calls in the model's forward) instead of a
    balanced partition.  ``tied``: what to do with a parameter several
    stages share: "share" (each later stage gets its own copy, recorded in
    ``ties``, which the Trainer and ``train_one_process`` keep one weight),
    "untie" (the copies train apart, named in ``untied``) or "refuse".
    """
    if not is_whole(num_stages):
        raise SplitError(f"num_stages must be a whole number of at least 1, got {num_stages!r}")
    if not isinstance(model, nn.Module):
        raise SplitError(f"split_model takes a torch.nn.Module, got {type(model).__name__}")
    if tied not in TIED:
        raise SplitError(f"tied must be one of {', '.join(TIED)}, got {tied!r}")
    if isinstance(balance, str) and balance not in BALANCES:
        raise SplitError(f"balance must be one of {', '.join(BALANCES)} or one weight per block, got {balance!r}")
    if not isinstance(balance, str):
        balance = _block_weights(balance)
    if balance == "time" and example is None:
        raise SplitError("balance='time' measures each block on an input: pass example= (one micro-batch)")
    if not is_whole(repeats):
        raise SplitError(f"repeats must be a whole number of at least 1 (timed runs of each block), got {repeats!r}")
    if split_spec is not None and not isinstance(split_spec, dict):
        raise SplitError(f"split_spec must be a dict {{module name: SplitPoint}}, got {type(split_spec).__name__}")
    num_stages = int(num_stages)
    traced = split_spec is not None or not (isinstance(model, nn.Sequential) or _gpt2_layout(model) is not None)
    if blocks is not None and not traced:
        raise SplitError(f"blocks= names the blocks of a traced model, but a {type(model).__name__} is split at "
                         f"its {'children' if isinstance(model, nn.Sequential) else 'transformer blocks'}; drop blocks=")
    if split_spec is None and isinstance(model, nn.Sequential):
        return _split_sequential(model, num_stages, balance, example, tied, repeats)
    gpt2 = _gpt2_layout(model)
    if split_spec is None and gpt2 is not None:
        return _split_gpt2(model, gpt2, num_stages, balance, example, tied, repeats)
    return _split_traced(model, num_stages, balance, example, blocks, split_spec, tied, repeats)


def _block_weights(balance) -> list[float]:
    """``balance`` given as one weight per block: numbers (checked finite and not negative by the
    partition)."""
    given = list(balance) if hasattr(balance, "__iter__") else []
    try:
        weights = [float(x) for x in given if not isinstance(x, (str, bytes, bool))]
    except TypeError:
        weights = []
    if not given or len(weights) != len(given):
        raise SplitError(f"balance must be one of {', '.join(BALANCES)} or one weight (a number) per block, "
                         f"got {balance!r}")
    return weights


# ---------------------------------------------------------------------- the partition
def balanced_partition(weights: Sequence[float], num_parts: int) -> list[range]:
    """Cut ``weights`` into ``num_parts`` contiguous, non-empty ranges whose
    largest sum is as small as possible.

    Among the partitions with that smallest maximum, the one with the least
    sum of squared part sums is taken (the rest balanced too); ties give the
    earlier parts the heavier share, as DeepSpeed's uniform partition does.
    Exact: two dynamic programmes over the prefix sums, O(parts n^2)."""
    w = np.asarray(list(weights), dtype=float)
    n = len(w)
    if num_parts < 1:
        raise SplitError(f"cannot cut into {num_parts} parts")
    if n < num_parts:
        raise SplitError(f"cannot cut {n} blocks into {num_parts} non-empty stages; ask for at most {n} stages")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise SplitError(f"block weights must be finite and not negative, got {w.tolist()}")
    if w.max() > 1e100:  # the partition does not change with the scale; the squares below must stay finite
        w = w / w.max()
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    span = prefix[:, None] - prefix[None, :]                    # span[i, m]: items m..i-1
    before = np.tril(np.ones((n + 1, n + 1), dtype=bool), k=-1)  # m < i: a non-empty part
    span = np.where(before, span, np.inf)

    largest = np.full(n + 1, np.inf)
    largest[0] = 0.0
    for _ in range(num_parts):
        largest = np.min(np.maximum(largest[None, :], span), axis=1)
    bottleneck = largest[n]
    fits = span <= bottleneck + 1e-9 * max(1.0, abs(bottleneck))

    squares = np.where(fits, span * span, np.inf)
    cost = [np.full(n + 1, np.inf)]
    cost[0][0] = 0.0
    for _ in range(num_parts):
        cost.append(np.min(cost[-1][None, :] + squares, axis=1))
    bounds = [n]
    for j in range(num_parts, 0, -1):
        i = bounds[-1]
        options = cost[j - 1] + squares[i]
        best = options.min()
        tolerance = 1e-12 * max(1.0, abs(best))
        bounds.append(int(np.flatnonzero(options <= best + tolerance).max()))
    bounds.reverse()
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _weights(balance, count: int, parameters: Callable[[], list[float]], times: Callable[[], list[float]],
             what: str) -> list[float]:
    if isinstance(balance, str):
        if balance == "uniform":
            return [1.0] * count
        if balance == "parameters":
            return parameters()
        return times()
    weights = [float(x) for x in balance]
    if len(weights) != count:
        raise SplitError(f"balance gives {len(weights)} weights but {what} has {count} blocks; give one per block")
    return weights


def _check_count(num_stages: int, count: int, what: str) -> None:
    if num_stages > count:
        raise SplitError(
            f"cannot split {what} into {num_stages} stages: it has {count} blocks and every stage takes at "
            f"least one; ask for at most {count} stages, or use a model with more blocks"
        )


# ---------------------------------------------------------------------- nn.Sequential
def _split_sequential(model: nn.Sequential, num_stages, balance, example, tied, repeats) -> ModelStages:
    children = list(model.named_children())
    what = f"the nn.Sequential ({len(children)} layers)"
    _check_count(num_stages, len(children), what)

    def build(parts: Sequence[range]) -> list[nn.Module]:
        return [nn.Sequential(OrderedDict(children[i] for i in r)) for r in parts]

    singles = [range(i, i + 1) for i in range(len(children))]
    weights = _weights(balance, len(children), lambda: [_count(m) for _, m in children],
                       lambda: _time_chain(build(singles), example, repeats), what)
    parts = balanced_partition(weights, num_stages)
    stages, untied, ties = _copy_shared(build(parts), model, tied)
    return ModelStages(stages, kind="sequential", blocks=parts, weights=weights,
                       block_names=[name for name, _ in children], untied=untied, ties=ties)


# ---------------------------------------------------------------------- GPT-2
class _GPT2Layout:
    """Where a GPT-2's parts live: ``prefix`` is "transformer." in a
    ``GPT2LMHeadModel`` and "" in a ``GPT2Model``."""

    def __init__(self, prefix: str, body: nn.Module, head: nn.Module | None):
        self.prefix, self.body, self.head = prefix, body, head


def _gpt2_layout(model: nn.Module) -> _GPT2Layout | None:
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "gpt2":
        return None
    body, prefix = (model.transformer, "transformer.") if hasattr(model, "transformer") else (model, "")
    if not all(hasattr(body, name) for name in ("wte", "wpe", "drop", "h", "ln_f")):
        return None
    if getattr(config, "add_cross_attention", False):
        raise SplitError("this GPT-2 has cross-attention layers, which take a second input; "
                         "split_model passes one tensor between stages")
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if attention not in ("eager", "sdpa"):
        raise SplitError(f"the GPT-2 uses attn_implementation={attention!r}; split_model gives its blocks an "
                         f"explicit causal mask, which 'eager' and 'sdpa' take: build it with one of those")
    head = None
    if prefix:
        children = {name for name, _ in model.named_children()}
        if children != {"transformer", "lm_head"}:
            return None  # a classifier or a double-headed model: its head is not a plain layer on the hidden states
        head = model.lm_head
    return _GPT2Layout(prefix, body, head)


class GPT2Stage(nn.Module):
    """Blocks ``blocks`` of a GPT-2, under the model's own parameter names.

    The first stage takes token ids of shape (rows, positions) and embeds them
    (``wte`` + ``wpe``, dropout); every stage runs its blocks with a causal
    mask; the last applies ``ln_f`` and, for a language model, ``lm_head``,
    returning logits.  Other stages return hidden states (rows, positions,
    width)."""

    def __init__(self, layout: _GPT2Layout, blocks: range, first: bool, last: bool):
        super().__init__()
        body = layout.body
        names = {}
        if first:
            names.update({f"{layout.prefix}{n}": getattr(body, n) for n in ("wte", "wpe", "drop")})
        names.update({f"{layout.prefix}h.{i}": body.h[i] for i in blocks})
        if last:
            names[f"{layout.prefix}ln_f"] = body.ln_f
            if layout.head is not None:
                names["lm_head"] = layout.head
        for name, module in names.items():
            _place(self, name, module)
        self.first, self.last = first, last
        self.prefix = layout.prefix
        self.block_names = [f"{layout.prefix}h.{i}" for i in blocks]
        self.has_head = last and layout.head is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        get = self.get_submodule
        if self.first:
            positions = torch.arange(x.shape[-1], device=x.device)
            x = get(self.prefix + "wte")(x) + get(self.prefix + "wpe")(positions)
            x = get(self.prefix + "drop")(x)
        mask = _causal_mask(x)
        for name in self.block_names:
            x = _first_tensor(get(name)(x, attention_mask=mask))
        if self.last:
            x = get(self.prefix + "ln_f")(x)
            if self.has_head:
                x = get("lm_head")(x)
        return x


def _split_gpt2(model: nn.Module, layout: _GPT2Layout, num_stages, balance, example, tied, repeats) -> ModelStages:
    count = len(layout.body.h)
    what = f"the GPT-2 ({count} blocks in {layout.prefix}h)"
    _check_count(num_stages, count, what)

    def build(parts: Sequence[range]) -> list[nn.Module]:
        return [GPT2Stage(layout, r, s == 0, s == len(parts) - 1) for s, r in enumerate(parts)]

    def parameters() -> list[float]:
        weights = [_count(block) for block in layout.body.h]
        weights[0] += _count(layout.body.wte, layout.body.wpe)
        weights[-1] += _count(layout.body.ln_f, *([layout.head] if layout.head is not None else []))
        return weights

    singles = [range(i, i + 1) for i in range(count)]
    weights = _weights(balance, count, parameters, lambda: _time_chain(build(singles), example, repeats), what)
    parts = balanced_partition(weights, num_stages)
    stages, untied, ties = _copy_shared(build(parts), model, tied)
    return ModelStages(stages, kind="gpt2", blocks=parts, weights=weights,
                       block_names=[f"{layout.prefix}h.{i}" for i in range(count)], untied=untied, ties=ties)


def _causal_mask(x: torch.Tensor) -> torch.Tensor:
    """The additive causal mask (1, 1, positions, positions) GPT-2's eager and sdpa attention take."""
    n = x.shape[-2]
    low = torch.finfo(x.dtype).min
    return torch.full((n, n), low, dtype=x.dtype, device=x.device).triu(1)[None, None]


def _first_tensor(output: Any) -> torch.Tensor:
    """A block's output, or the first element of the tuple older ``transformers`` blocks return."""
    return output[0] if isinstance(output, (tuple, list)) else output


# ---------------------------------------------------------------------- any other model: the pipelining tracer
def _split_traced(model: nn.Module, num_stages, balance, example, blocks, split_spec, tied, repeats) -> ModelStages:
    why = ("split_spec= asks" if split_spec is not None
           else f"{type(model).__name__} is neither an nn.Sequential nor a GPT-2, so split_model asks")
    if example is None:
        raise SplitError(f"{why} for a trace by torch.distributed.pipelining; pass example= (one micro-batch of "
                         f"input, of the size the Trainer will use) for the trace")
    from torch.distributed.pipelining import SplitPoint, pipeline

    for name, point in (split_spec or {}).items():
        try:
            model.get_submodule(name)
        except AttributeError:
            raise SplitError(f"split_spec names {name!r}, which is not a submodule of {type(model).__name__}; "
                             f"name one as model.named_modules() does") from None
        if not isinstance(point, SplitPoint):
            raise SplitError(f"split_spec[{name!r}] must be a torch.distributed.pipelining.SplitPoint "
                             f"(SplitPoint.BEGINNING or SplitPoint.END), got {point!r}")
    args = example if isinstance(example, tuple) else (example,)
    weights: list[float] = []
    parts: list[range] = []
    names: list[str] = []
    if split_spec is None:
        name, container = _find_blocks(model, blocks)
        children = list(container.named_children())
        names = [f"{name}.{child}" for child, _ in children]
        what = f"{type(model).__name__} ({len(children)} blocks in {name})"
        _check_count(num_stages, len(children), what)
    _check_example(model, args)
    if split_spec is None:
        weights = _weights(balance, len(children), lambda: [_count(m) for _, m in children],
                           lambda: _time_blocks(model, [m for _, m in children], args, repeats), what)
        parts = balanced_partition(weights, num_stages)
        split_spec = {names[r.start]: SplitPoint.BEGINNING for r in parts[1:]}
    try:
        with _annotations_undone(model, split_spec or {}):
            pipe = pipeline(model, mb_args=args, split_spec=split_spec or None)
    except Exception as error:
        raise SplitError(
            f"torch.distributed.pipelining could not trace {type(model).__name__}: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}; make its forward traceable by torch.export, "
            f"or give split_model an nn.Sequential of its blocks"
        ) from error
    if pipe.num_stages != num_stages:
        raise SplitError(
            f"the trace of {type(model).__name__} has {pipe.num_stages} stages but {num_stages} were asked for; "
            f"give split points (split_spec= or pipe_split() calls) for {num_stages - 1} cuts"
        )
    _check_chain(pipe, type(model).__name__)
    stages = [pipe.get_stage_module(s) for s in range(num_stages)]
    if not parts:
        parts = [range(s, s + 1) for s in range(num_stages)]
        weights = [float(_count(stage)) for stage in stages]
    untied, ties = _tie_policy(tied, _ties_by_name(stages, model))
    return ModelStages(stages, kind="traced", blocks=parts, weights=weights, block_names=names, untied=untied,
                       ties=ties)


def _check_example(model: nn.Module, args: tuple) -> None:
    """Refuse an example the model's forward does not take, found by running it (the trace's own
    error is buried in torch's logging): in eval mode and on a forked CPU random state, so every
    module's mode and statistics and the caller's random state stay as they were."""
    modes = {module: module.training for module in model.modules()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model.eval()
            model(*args)
    except Exception as error:
        raise SplitError(f"the example does not run through {type(model).__name__}'s forward: "
                         f"{type(error).__name__}: {first_line(error)}; pass one micro-batch the model takes "
                         "(a tuple for several arguments)") from error
    finally:
        for module, training in modes.items():
            module.training = training


@contextlib.contextmanager
def _annotations_undone(model: nn.Module, split_spec: dict):
    """``pipeline()`` marks split points by replacing the ``forward`` of the
    modules named in ``split_spec`` and leaves them so (a second trace would
    recurse); put the model's own back afterwards."""
    saved = []
    for name in split_spec:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        saved.append((module, {k: module.__dict__[k] for k in ("forward", "_orig_forward") if k in module.__dict__}))
    try:
        yield
    finally:
        for module, own in saved:
            for key in ("forward", "_orig_forward"):
                module.__dict__.pop(key, None)
            module.__dict__.update(own)


def _find_blocks(model: nn.Module, name: str | None) -> tuple[str, nn.Module]:
    """The named container of blocks, or the one with the most children (ties: the most parameters)."""
    if name is not None:
        try:
            container = model.get_submodule(name)
        except AttributeError:
            raise SplitError(f"{type(model).__name__} has no submodule {name!r} to take blocks from") from None
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or not len(container):
            raise SplitError(f"{name} is a {type(container).__name__}; blocks= names a non-empty ModuleList or Sequential")
        return name, container
    found = [(len(m), _count(m), n, m) for n, m in model.named_modules()
             if n and isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m)]
    if not found:
        raise SplitError(
            f"{type(model).__name__} has no ModuleList or Sequential of blocks to split between; "
            f"name one with blocks=, or give split_spec="
        )
    _, _, name, container = max(found, key=lambda row: (row[0], row[1]))
    return name, container


def _check_chain(pipe, label: str) -> None:
    """The traced stages must form the chain the Trainer runs: stage 0 takes
    the one micro-batch tensor, stage s > 0 takes only stage s-1's output, and
    the last stage's output is the model's."""
    graph = pipe.split_gm.graph
    inputs = [node for node in graph.nodes if node.op == "placeholder"]
    calls = [node for node in graph.nodes if node.op == "call_module"]
    if len(inputs) != 1:
        raise SplitError(
            f"{label} takes {len(inputs)} inputs ({', '.join(n.name for n in inputs)}); the Trainer gives the first "
            f"stage one micro-batch tensor: wrap the model so that its forward takes one"
        )
    for s, node in enumerate(calls):
        expected = inputs[0] if s == 0 else calls[s - 1]
        if len(node.args) != 1 or node.args[0] is not expected or node.kwargs:
            takes = ", ".join(str(a) for a in node.args) or "nothing"
            raise SplitError(
                f"stage {s} of the traced {label} takes {len(node.args) + len(node.kwargs)} values ({takes}), "
                f"but the Trainer passes one tensor from each stage to the next; a tensor that lives across the "
                f"cut (a mask, positions, a skip connection) must be recomputed inside each stage: choose other "
                f"split points, or describe the model as an nn.Sequential of blocks that take and return one tensor"
            )
    output = next(node for node in graph.nodes if node.op == "output")
    result = output.args[0]
    result = result[0] if isinstance(result, (tuple, list)) and len(result) == 1 else result
    if result is not calls[-1]:
        raise SplitError(
            f"the traced {label} returns {result}, not its last stage's output alone; the Trainer's loss takes "
            f"one tensor: wrap the model so that its forward returns one"
        )


# ---------------------------------------------------------------------- tied weights
def _copy_shared(stages: list[nn.Module], model: nn.Module,
                 tied: str) -> tuple[list[nn.Module], list[str], list[Tie]]:
    """Give each later stage its own copy of a parameter an earlier stage
    holds (or refuse): the copy starts equal and shares every other
    parameter with the model.  Returns the stages, the copies trained apart
    (``"untie"``) and the ties (``"share"``)."""
    ties = _ties_by_identity(stages, model)
    untied, kept = _tie_policy(tied, ties)
    later: dict[int, set[str]] = {}
    for tie in ties:
        for s, name in tie.copies[1:]:
            later.setdefault(s, set()).add(name)
    for s, names in sorted(later.items()):
        shared = {id(stages[s].get_parameter(name)) for name in names}
        memo = {id(t): t for t in (*stages[s].parameters(), *stages[s].buffers()) if id(t) not in shared}
        stages[s] = copy.deepcopy(stages[s], memo)
    return stages, untied, kept


def _ties_by_identity(stages: Sequence[nn.Module], model: nn.Module) -> list[Tie]:
    """Parameters several stage modules hold as one tensor: a tie per
    tensor, its copies named as each stage names it (a tensor used twice
    inside one stage counts once there)."""
    names = _model_names(model)
    holders: dict[int, list[tuple[int, str]]] = {}
    for s, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            holders.setdefault(id(p), []).append((s, name))
    return [Tie(names.get(i, copies[0][1]), tuple(copies)) for i, copies in holders.items() if len(copies) > 1]


def _ties_by_name(stages: Sequence[nn.Module], model: nn.Module) -> list[Tie]:
    """Tied parameters the tracer handed to several stages, each its own
    copy under one of the model's names for the tensor."""
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    ties = []
    for group in aliases.values():
        if len(group) < 2:
            continue
        copies = []
        for s, stage in enumerate(stages):
            own = [name for name, _ in stage.named_parameters() if name in group]
            if own:
                copies.append((s, own[0]))
        if len(copies) > 1:
            ties.append(Tie(group[0], tuple(copies)))
    return ties


def _tie_policy(tied: str, ties: list[Tie]) -> tuple[list[str], list[Tie]]:
    """What ``tied`` makes of the ties found: ``(untied names, ties kept)``."""
    if not ties:
        return [], []
    if tied == "refuse":
        described = "; ".join(f"{n} is {tie.name} (stages {tie.copies[0][0]} and {s})"
                              for tie in ties for s, n in tie.copies[1:])
        raise SplitError(
            f"tied weights fall into different stages: {described}. Pass tied='share' (the default: each stage "
            f"keeps a copy and the Trainer sums their gradients, so they stay one weight), tied='untie' (the "
            f"copies train apart), or untie the model yourself"
        )
    if tied == "untie":
        return sorted(n for tie in ties for _, n in tie.copies[1:]), []
    return [], ties


def _model_names(model: nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


# ---------------------------------------------------------------------- measuring blocks
def _count(*modules: nn.Module) -> float:
    unique = {id(p): p for m in modules for p in m.parameters()}
    return float(sum(p.numel() for p in unique.values()))


def _time_chain(stages: Sequence[nn.Module], example, repeats: int) -> list[float]:
    """Forward + backward seconds of each one-block stage, chained on ``example``
    (the fastest of ``repeats`` runs after one warm-up); no ``.grad`` is touched."""
    x = example[0] if isinstance(example, tuple) else example
    times = []
    for i, stage in enumerate(stages):
        try:
            times.append(_time_call(stage, (x,), {}, repeats))
            with torch.no_grad():
                x = stage(x)
        except Exception as error:
            raise _untimed(f"block {i}", error) from error
    return times


def _untimed(what: str, error: Exception) -> SplitError:
    """Why balance='time' could not time a block: it failed on the example."""
    return SplitError(f"balance='time': {what} failed on the example ({type(error).__name__}: {first_line(error)}); "
                      f"pass example= one micro-batch of the model's input, as the Trainer will be given it")


def _time_blocks(model: nn.Module, blocks: Sequence[nn.Module], args: tuple, repeats: int) -> list[float]:
    """Each block's forward + backward seconds on the inputs it sees in a forward of the whole model."""
    seen: dict[int, tuple] = {}

    def capture(module, a, kw):
        seen.setdefault(id(module), (_detach(a), _detach(kw)))

    handles = [block.register_forward_pre_hook(capture, with_kwargs=True) for block in blocks]
    try:
        with torch.no_grad():
            model(*args)
    except Exception as error:
        raise _untimed("the model", error) from error
    finally:
        for handle in handles:
            handle.remove()
    times = []
    for i, block in enumerate(blocks):
        if id(block) not in seen:
            raise SplitError(f"block {i} did not run in a forward of the model on the example; it cannot be timed")
        try:
            times.append(_time_call(block, *seen[id(block)], repeats))
        except Exception as error:
            raise _untimed(f"block {i}", error) from error
    return times


def _time_call(module: nn.Module, args: tuple, kwargs: dict, repeats: int) -> float:
    """The fastest of ``repeats`` forward and backward passes of ``module``
    (gradients of its parameters and floating inputs, taken without touching
    ``.grad``), in seconds: the least disturbed by other work on the machine."""
    params = [p for p in module.parameters() if p.requires_grad]
    spent = []
    for attempt in range(max(1, int(repeats)) + 1):
        leaves: list[torch.Tensor] = []
        a, kw = _leaf(args, leaves), _leaf(kwargs, leaves)
        start = time.perf_counter()
        out = _first_tensor(module(*a, **kw))
        if out.requires_grad:
            torch.autograd.grad(out, params + leaves, torch.ones_like(out), allow_unused=True)
        if attempt:
            spent.append(time.perf_counter() - start)
    return min(spent)


def _detach(value):
    return tree_map_only(torch.Tensor, torch.Tensor.detach, value)


def _leaf(value, leaves: list):
    """Fresh leaves for the floating tensors in ``value`` that need their
    gradient (collected in ``leaves``), so a backward reaches the block's input."""

    def fresh(tensor: torch.Tensor) -> torch.Tensor:
        leaf = tensor.detach().requires_grad_(tensor.is_floating_point())
        if leaf.requires_grad:
            leaves.append(leaf)
        return leaf

    return tree_map_only(torch.Tensor, fresh, value)


def _place(root: nn.Module, dotted: str, module: nn.Module) -> None:
    """Register ``module`` under ``root`` at the dotted path, making plain containers on the way."""
    *path, leaf = dotted.split(".")
    node = root
    for part in path:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    node.add_module(leaf, module)
