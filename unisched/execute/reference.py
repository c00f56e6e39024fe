"""The yardstick every distributed run is held to: the same stages, trained
in one process with the same loss and optimizer, each batch whole
(``micro_batches=1``) or in the run's micro-batches, accumulated.

``Trainer.gather_state_dict()`` after some steps must equal what this gives;
tests, the examples and ``unisched run --check`` all compare against it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import networkx as nx
import torch
from torch import nn
from torch.utils._pytree import tree_unflatten

from unisched.execute.program import loss_stage, topological_order
from unisched.execute.ties import Tie, TiedGradients, check_ties
from unisched.execute.training import (
    LOSS_SCALE_DEFAULTS,
    PRECISIONS,
    autocast,
    check_training_options,
    generators,
    global_norm,
    micro_batch_seeds,
    scalar_loss,
    seed_rng,
    stage_norm_squared,
    step_scheduler,
    to_compute_dtype,
)
from unisched.execute.values import split_batch, stage_arguments
from unisched.work import StageGraph, as_stage_graph


def train_one_process(
    stages: Sequence[nn.Module],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    batches: Iterable[tuple[Any, Any]],
    stage_graph: StageGraph | nx.DiGraph | None = None,
    *,
    micro_batches: int = 1,
    seed: int = 0,
    precision: str = "fp32",
    clip_grad_norm: float | None = None,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    accumulate: int = 1,
    loss_scale: dict | None = None,
    ties: Sequence[Tie] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``stages`` in place, one step per ``(inputs, targets)`` batch.

    Returns the losses and the weights as ``{"<stage>.<param name>": tensor}``,
    the form :meth:`Trainer.gather_state_dict` uses.  ``optimizer`` is a
    factory ``params -> Optimizer``, as the Trainer takes it.  With a
    ``stage_graph`` (a chain by default) the stages run in topological order
    as the Trainer calls them: each on its predecessors' outputs in stage
    order, a source on the inputs, a tuple or list unpacked into positional
    arguments (:func:`~unisched.execute.values.stage_arguments`); the loss
    takes the one sink's output.

    The Trainer's options mean the same here: each batch is split into
    ``micro_batches`` along the first dimension (the loss is their mean, a
    step's loss the mean of theirs), stage s runs micro-batch b of step k
    (from 0) under the RNG seed ``micro_batch_seeds(seed, k, S, B)[s][b]`` (so
    dropout draws the Trainer's masks when ``micro_batches`` is the
    schedule's), under ``precision``'s autocast with the values between
    stages cast to the compute dtype; every ``accumulate`` batches the
    gradients are clipped to ``clip_grad_norm`` and the optimizer and the
    ``scheduler`` step.  fp16 scales the loss with ``torch.amp.GradScaler``
    (``loss_scale`` its options), which skips a step whose gradients are not
    finite; the scheduler steps only when the optimizer did.

    ``ties`` (default: ``stages.ties``, which ``split_model`` records) are
    weights several stages hold a copy of, kept one weight as the Trainer
    keeps them (:mod:`unisched.execute.ties`): the copies start as the
    first, each takes the sum of their gradients before clipping, and the
    norm counts the weight once.
    """
    check_training_options(stages, loss_fn, optimizer, seed=seed, precision=precision, clip_grad_norm=clip_grad_norm,
                           scheduler=scheduler, accumulate=accumulate, loss_scale_options=loss_scale)
    # No container module is built here: EPL's scopes would capture it as part of the model.
    params = list({id(p): p for stage in stages for p in stage.parameters()}.values())
    ties = check_ties(getattr(stages, "ties", ()) if ties is None else ties,
                      [{n: (p.shape, p.dtype) for n, p in stage.named_parameters()} for stage in stages])
    copy_of = lambda s, name: stages[s].get_parameter(name)  # noqa: E731
    device = params[0].device if params else torch.device("cpu")
    tied = TiedGradients(ties, [[0]] * len(stages), 0, device, None)  # one rank holds every copy
    tied.synchronize(copy_of)
    skipped = {id(copy_of(*c)) for c in tied.counted_elsewhere}
    seen: set[int] = set()  # each stage's parameters that count in the norm, a shared one in its first stage
    counted = []
    for stage in stages:
        counted.append([p for p in stage.parameters() if id(p) not in skipped and id(p) not in seen])
        seen.update(id(p) for p in stage.parameters())
    graph = as_stage_graph(len(stages), stage_graph)
    order, last = topological_order(graph), loss_stage(graph)
    dtype = PRECISIONS[precision]
    opt = optimizer(params)
    lr_scheduler = scheduler(opt) if scheduler is not None else None
    scaler = torch.amp.GradScaler(device.type, **{**LOSS_SCALE_DEFAULTS, **(loss_scale or {})},
                                  enabled=precision == "fp16")
    losses = []
    rngs = generators(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for step, (inputs, targets) in enumerate(batches):
            micro_in, in_spec, micro_t, t_spec = split_batch(inputs, targets, micro_batches, device)
            total = 0.0
            seeds = micro_batch_seeds(seed, step, len(stages), micro_batches)
            for b in range(micro_batches):
                outputs: dict[int, Any] = {}
                for s in order:
                    seed_rng(rngs, seeds[s][b])
                    args = stage_arguments([outputs[p] for p in graph.predecessors[s]]
                                           or [tree_unflatten(list(micro_in[b]), in_spec)])
                    with autocast(device, dtype):
                        out = stages[s](*args)
                    outputs[s] = to_compute_dtype(out, dtype) if graph.successors[s] else out
                with autocast(device, dtype):
                    loss = scalar_loss(loss_fn(outputs[last], tree_unflatten(list(micro_t[b]), t_spec)), b)
                scaler.scale(loss / (micro_batches * accumulate)).backward()
                total += loss.item()
            losses.append(total / micro_batches)
            if (step + 1) % accumulate:
                continue
            tied.reduce(copy_of)
            scaler.unscale_(opt)
            if clip_grad_norm is not None:
                norm = global_norm(torch.stack([stage_norm_squared([p.grad for p in ps if p.grad is not None]).cpu()
                                                for ps in counted]))
                torch.nn.utils.clip_grads_with_norm_(params, clip_grad_norm, torch.tensor(norm, device=device))
            before = scaler.get_scale() if scaler.is_enabled() else None
            scaler.step(opt)
            scaler.update()
            if lr_scheduler is not None and (before is None or scaler.get_scale() >= before):
                step_scheduler(lr_scheduler, losses[-1])
            opt.zero_grad()
    return losses, {
        f"{s}.{name}": value.detach().clone() for s, stage in enumerate(stages) for name, value in stage.state_dict().items()
    }
