"""Stage modules for the runtime: built on the ranks that need them, each
identically whichever rank builds it, and checked before any rank trains.

A stage comes to the Trainer as a module, from a factory ``stage -> module``
(called only for the stages a rank computes or holds), or on the meta device
(shapes without storage).  Each is made real the same way on every rank:

* a factory runs under the stage's own seed (:func:`stage_seed`);
* a stage on the meta device gets storage (``to_empty``) and each submodule
  holding a meta tensor calls its ``reset_parameters()`` under that seed
  (:func:`materialize_stage`) -- the torch layers that define it (Linear,
  Conv, Embedding, LayerNorm, BatchNorm, ...) are supported; a submodule
  that holds parameters or buffers and has no ``reset_parameters`` is refused,
  naming the stage and the submodule;
* or its weights come from a state dict in the ``{"<stage>.<name>": tensor}``
  form of ``Trainer.gather_state_dict()`` (:func:`stages_from_state_dict`).

A list of stages, a ``ModelStages`` and :func:`stages_from_state_dict`'s
factory know how many stages they have and must have as many as the
schedule; a plain factory cannot tell, so a stage it cannot build shows only
when a rank asks for it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from unisched.errors import ShapeError

SEED_STRIDE = 100_003
"""Stage s of a run seeded ``seed`` draws from ``seed * SEED_STRIDE + s``."""


def is_factory(stages) -> bool:
    return callable(stages) and not isinstance(stages, nn.Module)


def stage_seed(seed: int, stage: int) -> int:
    """The seed stage ``stage`` is built and initialized under."""
    return seed * SEED_STRIDE + stage


@contextlib.contextmanager
def seeded(seed: int, stage: int):
    """Draw from stage ``stage``'s seed; the CPU random state is restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stage_seed(seed, stage))
        yield


# ---------------------------------------------------------------------- building
def build_stages(factory: Callable[[int], nn.Module], num_stages: int, seed: int = 0,
                 only: Sequence[int] | None = None) -> list[nn.Module | None]:
    """Call ``factory(s)`` for each stage (or those in ``only``; None for the
    others), each under its own seed (:func:`stage_seed`), and make stages on
    the meta device real (:func:`materialize_stage`), so a stage is the same
    on whichever rank builds it, and the same as in a one-process reference
    built here."""
    wanted = set(range(num_stages) if only is None else only)
    stages: list[nn.Module | None] = []
    for s in range(num_stages):
        if s not in wanted:
            stages.append(None)
            continue
        with seeded(seed, s):
            stage = factory(s)
        stages.append(materialize_stage(stage, s, seed) if isinstance(stage, nn.Module) else stage)
    return stages


def materialize(stages, num_stages: int, mine: Sequence[int], seed: int,
                device: torch.device | str = "cpu") -> list[nn.Module | None]:
    """The stage modules of a rank that needs stages ``mine``: the factory's
    for those, or the given list with those made real; checked first against
    the schedule's ``num_stages`` where the stages know how many they are."""
    _check_count(stages, num_stages)
    if is_factory(stages):
        stages = build_stages(stages, num_stages, seed, only=mine)
    else:
        stages = list(stages)
    _check_stages([stages[s] for s in mine], mine)
    for s in mine:
        stages[s] = materialize_stage(stages[s], s, seed, device)
        _check_dtypes(stages[s], s)
    return stages


def materialize_stage(stage: nn.Module, index: int, seed: int = 0, device: torch.device | str = "cpu") -> nn.Module:
    """``stage`` with every tensor on the meta device given storage on
    ``device`` and initialized by its submodule's ``reset_parameters()``,
    under the stage's seed; a stage without meta tensors is returned as it is."""
    owners = [(name, module) for name, module in stage.named_modules() if _holds_meta(module)]
    if not owners:
        return stage
    for name, module in owners:
        if not callable(getattr(module, "reset_parameters", None)):
            held = [n for n, _ in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))]
            raise ShapeError(
                f"stage {index} is on the meta device, but its submodule {name or '(the stage itself)'} "
                f"({type(module).__name__}, holding {', '.join(held)}) has no reset_parameters() to initialize "
                f"it; build that stage on a real device, give it a reset_parameters(), or load its weights "
                f"with unisched.stages_from_state_dict"
            )
    with seeded(seed, index):
        for _, module in owners:
            module.to_empty(device=device, recurse=False)
        for _, module in owners:
            module.reset_parameters()
    return stage


def _holds_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))


# ---------------------------------------------------------------------- from a state dict
class StateDictStages:
    """A stage factory that builds each stage as ``stages`` does (a list of
    modules, possibly on the meta device, or a factory) and loads its weights
    from ``state_dict`` (``{"<stage>.<name>": tensor}``, as
    ``Trainer.gather_state_dict()`` gives them).  ``len()`` is the number of
    stages when ``stages`` has one, so that the Trainer can check it; ``ties``
    are those of ``stages`` (a split model's shared weights stay shared)."""

    def __init__(self, stages, state_dict: Mapping[str, torch.Tensor]):
        self.stages = stages
        self.ties = list(getattr(stages, "ties", ()))
        self.per_stage: dict[int, dict[str, torch.Tensor]] = {}
        for key, tensor in state_dict.items():
            head, dot, name = str(key).partition(".")
            if not (head.isdigit() and dot and name):
                raise ShapeError(
                    f"state dict key {key!r} is not '<stage>.<name>'; give the form Trainer.gather_state_dict() "
                    f"returns (for a whole model split by split_model, prefix each of stage s's names with 's.')"
                )
            self.per_stage.setdefault(int(head), {})[name] = tensor
        if hasattr(stages, "__len__"):
            beyond = sorted(s for s in self.per_stage if s >= len(stages))
            if beyond:
                raise ShapeError(
                    f"the state dict has keys of stage {beyond[0]} ({_some(self.per_stage[beyond[0]])}) but there "
                    f"are {len(stages)} stages; load it into stages split as the state dict was"
                )

    def __len__(self) -> int:
        if not hasattr(self.stages, "__len__"):
            raise TypeError("the stages come from a plain factory, which does not say how many there are")
        return len(self.stages)

    def __call__(self, stage: int) -> nn.Module:
        module = self.stages(stage) if is_factory(self.stages) else self.stages[stage]
        if not isinstance(module, nn.Module):
            raise ShapeError(f"stage {stage} is a {type(module).__name__}; give one torch.nn.Module per stage")
        state = self.per_stage.get(stage, {})
        _check_state(module, state, stage)
        if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            _check_all_saved(module, stage)
            module.to_empty(device="cpu")
        with torch.no_grad():
            module.load_state_dict(state, strict=True)
        return module


def stages_from_state_dict(stages, state_dict: Mapping[str, torch.Tensor]) -> StateDictStages:
    """A factory for the Trainer building each stage as ``stages`` does (a list
    of modules, on the meta device to save memory, or a factory) with its
    weights loaded from ``state_dict`` ({"<stage>.<name>": tensor}, the form
    of ``Trainer.gather_state_dict()``).  A key missing or unexpected, or of
    another shape, stops the rank that builds the stage, naming both."""
    return StateDictStages(stages, state_dict)


def _check_state(module: nn.Module, state: Mapping[str, torch.Tensor], stage: int) -> None:
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing:
        raise ShapeError(f"the state dict has no '{stage}.{missing[0]}' for stage {stage} "
                         f"({len(missing)} of its {len(expected)} keys missing); give every weight of every stage")
    if unexpected:
        raise ShapeError(f"the state dict's '{stage}.{unexpected[0]}' is not a weight of stage {stage} "
                         f"(which has {_some(expected)}); load it into stages built as it was saved")
    for key, tensor in expected.items():
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise ShapeError(f"the state dict's '{stage}.{key}' has shape {tuple(state[key].shape)} but stage "
                             f"{stage}'s {key} has {tuple(tensor.shape)}; load it into stages built as it was saved")


def _check_all_saved(module: nn.Module, stage: int) -> None:
    """A meta stage's tensors all come from the state dict: a buffer left out
    of it (``persistent=False``) would stay uninitialized."""
    saved = set(module.state_dict())
    unsaved = [name for name, b in module.named_buffers() if b.is_meta and name not in saved]
    if unsaved:
        raise ShapeError(f"stage {stage} is on the meta device and its buffer {unsaved[0]} is not saved in a "
                         f"state dict (persistent=False), so loading cannot fill it; build that stage on a real device")


def _some(keys) -> str:
    keys = list(keys)
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


# ---------------------------------------------------------------------- checks
def _check_count(stages, num_stages: int) -> None:
    if not hasattr(stages, "__len__") or isinstance(stages, nn.Module):
        return
    try:
        count = len(stages)
    except TypeError:
        return
    if count != num_stages:
        given = "the list of stage modules" if not is_factory(stages) else f"the {type(stages).__name__}"
        raise ShapeError(
            f"the schedule has {num_stages} stages but {given} has {count}; split the model into {num_stages} stages "
            f"or simulate with num_stages={count}"
        )


def _check_stages(stages, indices) -> None:
    for s, stage in zip(indices, stages):
        if not isinstance(stage, nn.Module):
            raise TypeError(f"stage {s} is a {type(stage).__name__}; Trainer needs one torch.nn.Module per stage")


def _check_dtypes(stage: nn.Module, s: int) -> None:
    dtypes = {p.dtype for p in stage.parameters()}
    if len(dtypes) > 1:
        raise ShapeError(f"stage {s} mixes parameter dtypes {sorted(map(str, dtypes))}; use one dtype per stage")
