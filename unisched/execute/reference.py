"""The yardstick every distributed run is held to: the same stages, trained
in one process on the whole batch with the same loss and optimizer.

``Trainer.gather_state_dict()`` after some steps must equal what this gives;
tests, the examples and ``unisched run --check`` all compare against it.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import nn


def train_one_process(
    stages: Sequence[nn.Module],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``stages`` in place, one step per ``(inputs, targets)`` batch.

    Returns the losses and the weights as ``{"<stage>.<param name>": tensor}``,
    the form :meth:`Trainer.gather_state_dict` uses.  ``optimizer`` is a
    factory ``params -> Optimizer``, as the Trainer takes it.
    """
    # No container module is built here: EPL's scopes would capture it as part of the model.
    params = list({id(p): p for stage in stages for p in stage.parameters()}.values())
    opt = optimizer(params)
    losses = []
    for inputs, targets in batches:
        output = inputs
        for stage in stages:
            output = stage(output)
        loss = loss_fn(output, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {
        f"{s}.{name}": value.detach().clone() for s, stage in enumerate(stages) for name, value in stage.state_dict().items()
    }
