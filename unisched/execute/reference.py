"""The yardstick every distributed run is held to: the same stages, trained
in one process on the whole batch with the same loss and optimizer.

``Trainer.gather_state_dict()`` after some steps must equal what this gives;
tests, the examples and ``unisched run --check`` all compare against it.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import networkx as nx
import torch
from torch import nn

from unisched.execute.program import loss_stage, topological_order
from unisched.execute.runtime import stage_arguments
from unisched.work import StageGraph, as_stage_graph


def train_one_process(
    stages: Sequence[nn.Module],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    stage_graph: StageGraph | nx.DiGraph | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``stages`` in place, one step per ``(inputs, targets)`` batch.

    Returns the losses and the weights as ``{"<stage>.<param name>": tensor}``,
    the form :meth:`Trainer.gather_state_dict` uses.  ``optimizer`` is a
    factory ``params -> Optimizer``, as the Trainer takes it.  With a
    ``stage_graph`` (a chain by default) the stages run in topological order
    as the Trainer calls them: each on its predecessors' outputs in stage
    order, a source on the inputs, a tuple or list unpacked into positional
    arguments (:func:`~unisched.execute.runtime.stage_arguments`); the loss
    takes the one sink's output.
    """
    # No container module is built here: EPL's scopes would capture it as part of the model.
    params = list({id(p): p for stage in stages for p in stage.parameters()}.values())
    graph = as_stage_graph(len(stages), stage_graph)
    order, last = topological_order(graph), loss_stage(graph)
    opt = optimizer(params)
    losses = []
    for inputs, targets in batches:
        outputs: dict[int, torch.Tensor] = {}
        for s in order:
            outputs[s] = stages[s](*stage_arguments([outputs[p] for p in graph.predecessors[s]] or [inputs]))
        loss = loss_fn(outputs[last], targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {
        f"{s}.{name}": value.detach().clone() for s, stage in enumerate(stages) for name, value in stage.state_dict().items()
    }
