"""Stage modules for the runtime: built from a factory on the ranks that
need them, each under its own seed, and checked before any rank trains."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from unisched.errors import ShapeError


def is_factory(stages) -> bool:
    return callable(stages) and not isinstance(stages, nn.Module)


def build_stages(factory: Callable[[int], nn.Module], num_stages: int, seed: int = 0,
                 only: Sequence[int] | None = None) -> list[nn.Module | None]:
    """Call ``factory(s)`` for each stage (or those in ``only``; None for the
    others), each under the seed ``seed * 100_003 + s`` with the CPU random
    state restored after, so a stage is initialized the same on whichever
    rank builds it, and the same as in a one-process reference built here."""
    wanted = set(range(num_stages) if only is None else only)
    stages: list[nn.Module | None] = []
    for s in range(num_stages):
        if s not in wanted:
            stages.append(None)
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 100_003 + s)
            stages.append(factory(s))
    return stages


def materialize(stages, num_stages: int, mine: Sequence[int], seed: int) -> list[nn.Module | None]:
    """The stage modules: as given, or the factory's for the stages this rank needs."""
    stages = build_stages(stages, num_stages, seed, only=mine) if is_factory(stages) else list(stages)
    _check_stages([stages[s] for s in mine], mine)
    return stages


def _check_stages(stages, indices) -> None:
    for s, stage in zip(indices, stages):
        if not isinstance(stage, nn.Module):
            raise TypeError(f"stage {s} is a {type(stage).__name__}; Trainer needs one torch.nn.Module per stage")
        dtypes = {p.dtype for p in stage.parameters()}
        if len(dtypes) > 1:
            raise ShapeError(f"stage {s} mixes parameter dtypes {sorted(map(str, dtypes))}; use one dtype per stage")
