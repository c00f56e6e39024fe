"""Shared by the ``epl_*`` examples: small stand-ins for the seeds' ``model()``
placeholders, and a runner that shows the compiled strategy, trains on N
local gloo processes and compares with the same model trained in one process.
"""

from __future__ import annotations

import argparse
import copy
import os
from typing import Callable

import torch
from torch import nn

from unisched import epl
from unisched.execute import train_one_process
from unisched.execute.launch import check, run_local

Build = Callable[[int], tuple[torch.Tensor, torch.Tensor, nn.Module]]


def mlp(*sizes: int, last_activation: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_activation:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def train(rank: int, world: int, build: Build, steps: int) -> dict:
    torch.manual_seed(0)
    inputs, targets, loss_fn = build(world)
    trainer = epl.Trainer(loss_fn, lambda params: torch.optim.SGD(params, lr=0.2))
    losses = [trainer.step(inputs, targets) for _ in range(steps)]
    state = {name: tensor.numpy() for name, tensor in trainer.gather_state_dict().items()}
    measured = trainer.last_timeline
    return {"losses": losses, "state": state, "runtime": trainer.runtime,
            "measured": None if measured is None else measured.to_text(color=False)}


def reference(build: Build, world: int, steps: int) -> tuple[list[float], dict]:
    """The same model, built the same way, trained in one process on the whole batch."""
    torch.manual_seed(0)
    inputs, targets, loss_fn = build(world)
    env = epl.Env.get()
    with env.paused():
        stages = [copy.deepcopy(t.module()) for t in env.taskgraphs]
    return train_one_process(stages, loss_fn, lambda params: torch.optim.SGD(params, lr=0.2),
                             [(inputs, targets)] * steps)


def main(build: Build, world: int, doc: str) -> None:
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--world", type=int, default=world, help="number of local processes (devices)")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()

    os.environ["WORLD_SIZE"] = str(args.world)
    torch.manual_seed(0)
    build(args.world)
    simulation = epl.simulate(world_size=args.world)
    print(epl.placement(world_size=args.world).describe())
    print(simulation.summary())
    print(simulation.to_text(color=False))

    results = check(run_local(train, args.world, build, args.steps, timeout=300))
    expected_losses, expected_state = reference(build, args.world, args.steps)
    state = results[0]["state"]
    diff = max((torch.from_numpy(state[k]) - v).abs().max().item() for k, v in expected_state.items())
    print(f"runtime: {results[0]['runtime']}")
    if results[0]["measured"]:
        print("measured last step:")
        print(results[0]["measured"])
    print("losses on", args.world, "processes:", " ".join(f"{x:.6f}" for x in results[0]["losses"]))
    print("losses in one process:  ", " ".join(f"{x:.6f}" for x in expected_losses))
    print(f"largest weight difference after {args.steps} steps: {diff:.2e}")
