"""Weights that several stages share: one tensor, a copy per stage.

A GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``; split into
pipeline stages, the first and the last stage both use it, usually on
different ranks.  As DeepSpeed's ``TiedLayerSpec`` and Megatron's embedding
group do, each stage keeps its own copy and the copies act as one weight:

* they start equal (the Trainer sends the first copy to the others when it
  is built);
* after the backward of a step, before clipping and the optimizer step, the
  gradient of every copy becomes the sum of the copies' gradients -- the
  gradient the one tensor gets in the model -- by an all-reduce among the
  ranks that hold a copy's weights of truth (a local sum where one rank
  holds them all);
* the global gradient norm counts the weight once (its first copy).

The simulator times that all-reduce from ``Costs.tied_weights``
(:func:`tied_weights` gives them; ``Trainer.calibrate`` fills them in).

Equal weights, equal gradients and the same optimizer keep the copies (and
their optimizer states) equal.  A :class:`Tie` names the copies by stage and
parameter name; ``split_model`` records the ties it finds in
``ModelStages.ties``.  This module is the rule's one place: the Trainer
and the one-process reference (one rank holding every copy) both keep the
ties with a :class:`TiedGradients`.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist

from unisched.costs import TiedWeight
from unisched.dataflow import tie_holders
from unisched.errors import ShapeError


class Tie(NamedTuple):
    """One weight held by several stages: ``copies`` are ``(stage, parameter
    name)`` pairs in stage order, ``name`` the weight's name in the model."""

    name: str
    copies: tuple[tuple[int, str], ...]

    def __str__(self) -> str:
        held = ", ".join(f"{n} of stage {s}" for s, n in self.copies)
        return f"{self.name} ({held})"


def as_ties(ties: Iterable) -> tuple[Tie, ...]:
    """``ties`` as :class:`Tie` values (a ``(name, [(stage, name), ...])``
    pair is taken as one), each with copies in at least two places."""
    out = []
    for tie in ties:
        try:
            tie = Tie(str(tie[0]), tuple((int(s), str(n)) for s, n in tie[1]))
        except (TypeError, ValueError, IndexError):
            raise ShapeError(f"a tie is a Tie(name, copies) with copies ((stage, parameter name), ...), "
                             f"got {tie!r}") from None
        if len(set(tie.copies)) < 2:
            raise ShapeError(f"the tie {tie} names {len(set(tie.copies))} copy; a tie needs copies in at least two "
                             f"places (a weight used twice inside one stage stays one tensor)")
        out.append(tie)
    return tuple(out)


def check_ties(ties: Iterable, specs: Sequence[Mapping[str, tuple] | None]) -> tuple[Tie, ...]:
    """``ties`` (:func:`as_ties`) checked against the stages' ``{name:
    (shape, dtype)}`` (``specs[s]``): each copy a weight of its stage, all
    of one shape and dtype.  Pure: every rank that knows every stage's
    specs gives the same verdict."""
    checked = []
    for tie in as_ties(ties):
        shapes = set()
        for s, name in tie.copies:
            if not 0 <= s < len(specs):
                raise ShapeError(f"the tie {tie} names stage {s}, but there are {len(specs)} stages")
            spec = specs[s] or {}
            if name not in spec:
                raise ShapeError(f"the tie {tie}: stage {s} has no weight {name!r}; name the copy as the stage's "
                                 f"named_parameters() do")
            shapes.add((tuple(spec[name][0]), str(spec[name][1])))
        if len(shapes) > 1:
            raise ShapeError(f"the copies of the tie {tie} differ in shape or dtype ({sorted(shapes)}); "
                             f"tie only copies of one weight")
        checked.append(tie)
    return tuple(checked)


def tied_weights(ties: Iterable[Tie], specs: Sequence[Mapping[str, tuple]]) -> tuple[TiedWeight, ...]:
    """``ties`` as the simulator's ``Costs.tied_weights``: the stages that
    hold a copy and the weight's bytes (from its first copy's ``(shape,
    dtype)`` in ``specs``); a tie whose copies all lie in one stage moves
    nothing and is left out."""
    out = []
    for tie in ties:
        stages = sorted({s for s, _ in tie.copies})
        if len(stages) > 1:
            shape, dtype = specs[tie.copies[0][0]][tie.copies[0][1]]
            out.append(TiedWeight(tuple(stages), float(math.prod(shape) * dtype.itemsize)))
    return tuple(out)


def counted_elsewhere(ties: Iterable[Tie]) -> set[tuple[int, str]]:
    """The copies a gradient norm leaves out: all but each weight's first."""
    return {copy for tie in ties for copy in tie.copies[1:]}


class TiedGradients:
    """The Trainer's side of the ties: per tie, the ranks that hold a copy's
    weights of truth (``holders[s]`` of each copy's stage), and a process
    group among them, made on every rank in one order.

    ``truth(stage, name)`` gives this rank's weight of truth of a copy it
    holds (a host copy where offloaded), ``grad_param(stage, name)`` the
    parameter whose ``.grad`` holds the copy's gradient at the optimizer step
    (on ``device``, where the collectives run)."""

    def __init__(self, ties: Sequence[Tie], holders: Sequence[Sequence[int]], rank: int, device, timeout):
        self.ties = tuple(ties)
        self.rank, self.device = rank, device
        self._first = [min(h) for h in holders]
        self._members = [tie_holders([s for s, _ in tie.copies], holders) for tie in self.ties]
        made = {}
        for members in self._members:
            if len(members) > 1 and members not in made:
                made[members] = dist.new_group(list(members), timeout=timeout)
        self._groups = made
        self._mine = [[(s, n) for s, n in tie.copies if rank in holders[s]] for tie in self.ties]
        self.counted_elsewhere = counted_elsewhere(self.ties)

    def synchronize(self, truth: Callable[[int, str], torch.Tensor]) -> None:
        """Give every copy the value of the first copy's first holder."""
        for tie, members, mine in zip(self.ties, self._members, self._mine):
            if not mine:
                continue
            source_stage = tie.copies[0][0]
            source = self._first[source_stage]
            value = truth(*tie.copies[0]).detach().to(self.device, copy=True) if self.rank == source else \
                torch.empty_like(truth(*mine[0]), device=self.device)
            if len(members) > 1:
                dist.broadcast(value, src=source, group=self._groups[members])
            with torch.no_grad():
                for copy in mine:
                    truth(*copy).copy_(value.to(truth(*copy).device))

    def reduce(self, grad_param: Callable[[int, str], torch.Tensor]) -> None:
        """Give every copy this rank holds the sum of all copies' gradients:
        each copy's gradient comes in once, from its stage's first holder
        (replicas hold equal gradients by now), summed by an all-reduce
        among the tie's ranks."""
        for members, mine in zip(self._members, self._mine):
            if not mine:
                continue
            params = [grad_param(s, n) for s, n in mine]
            counted = [p.grad for (s, _), p in zip(mine, params) if self._first[s] == self.rank]
            total = _sum(counted, params[0])
            if len(members) > 1:
                dist.all_reduce(total, group=self._groups[members])
            for p in params:
                _set_grad(p, total)

    def close(self) -> None:
        """Release the ties' process groups (every rank calls it)."""
        groups, self._groups = list(self._groups.values()), {}
        if dist.is_initialized():
            for group in groups:
                dist.destroy_process_group(group)


def _sum(grads: Sequence[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    total = torch.zeros_like(like)
    for g in grads:
        if g is not None:
            total.add_(g)
    return total


def _set_grad(p: torch.Tensor, total: torch.Tensor) -> None:
    """``p.grad = total``, in place where it exists (a replicated stage's
    gradients are views of one flat buffer), else a copy of its own."""
    if p.grad is None:
        p.grad = total.clone()
    else:
        p.grad.copy_(total)
