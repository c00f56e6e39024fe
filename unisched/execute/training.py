"""The numerics of a training step beyond the schedule, shared by the Trainer
and the one-process reference so that both compute the same thing.

- **Precision.** ``"fp32"``, ``"bf16"`` or ``"fp16"``: forwards and the loss
  run under ``torch.autocast`` in the compute dtype while the weights of
  truth and the optimizer state stay fp32, and every value one stage passes
  to another has its floating tensors cast to the compute dtype
  (:func:`to_compute_dtype`), so activations and their gradients travel in it.
- **Loss scaling** for fp16 (:class:`LossScale`): torch's GradScaler rule
  (skip the step and back off when a gradient is not finite, grow after a
  run of good steps), decided from a verdict every rank shares.
- **Dropout.** The forward of stage s on micro-batch b in step k runs under
  the RNG seed :func:`micro_batch_seeds` ``(seed, k, S, B)[s][b]``, which depends on
  nothing else (not the schedule, not the rank), so a forward recomputed on
  another rank draws the same masks, and one process can draw them too.
- **Options** (:func:`check_options`): what the Trainer refuses before it
  talks to any other rank, with the field named; the one-process reference
  refuses the options it shares the same way (:func:`check_training_options`).
"""

from __future__ import annotations

import contextlib
import math
from numbers import Real
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from unisched.errors import ShapeError
from unisched.execute.stages import is_factory
from unisched.work import is_whole

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Precision name -> the compute dtype autocast runs in (None: no autocast)."""

LOSS_SCALE_DEFAULTS = {"init_scale": 2.0 ** 16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
"""fp16 loss scaling, in ``torch.amp.GradScaler``'s names and with its defaults."""


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` on ``device``'s type in ``dtype``, or nothing for fp32."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def to_compute_dtype(value: Any, dtype: torch.dtype | None) -> Any:
    """``value`` (a tensor pytree one stage passes to another) with its
    floating tensors in ``dtype``; integer ids and masks as they are."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    return tree_map(lambda t: to_compute_dtype(t, dtype) if isinstance(t, torch.Tensor) else t, value)


def scalar_loss(loss: Any, batch: int) -> torch.Tensor:
    """What ``loss_fn`` returned for micro-batch ``batch``, as a 0-d tensor
    (fp32 when autocast made it a half-precision one); anything else is refused."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ShapeError(f"loss_fn must return a scalar tensor, got {_shown(loss)} for micro-batch {batch}; "
                         f"reduce it (e.g. .mean())")
    loss = loss.reshape(())
    return loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss


_MASK = (1 << 64) - 1


def stage_norm_squared(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """One stage's share of the global gradient norm: the square of its
    gradients' L2 norm (torch's ``get_total_norm``), in float64."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    return torch.nn.utils.get_total_norm(grads, 2.0).double() ** 2  # on the gradients' device: no wait


def global_norm(per_stage: torch.Tensor) -> float:
    """The global L2 norm from every stage's :func:`stage_norm_squared`, in
    stage order: the Trainer and one process (``train_one_process``) sum the
    same numbers in the same order, so both clip alike to the last bit, where
    bf16's rounding and Adam's normalised steps would magnify any difference
    (7.5e-3 after four steps of the GPT-2 example)."""
    return math.sqrt(float(per_stage.cpu().sum()))


def _splitmix(state, part):
    """One round of splitmix64: ``part`` mixed into ``state`` (Python ints or numpy uint64 arrays)."""
    import numpy as np

    if isinstance(state, int):
        state = ((state ^ part) * 0x9E3779B97F4A7C15) & _MASK
        state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & _MASK
        return state ^ (state >> 31)
    state = (state ^ part) * np.uint64(0x9E3779B97F4A7C15)
    state = (state ^ (state >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    state = (state ^ (state >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return state ^ (state >> np.uint64(31))


def micro_batch_seeds(seed: int, step: int, num_stages: int, num_batches: int) -> list[list[int]]:
    """The RNG seed of stage s's forward on micro-batch b in step ``step``
    (counted from 0), for every stage and micro-batch at once
    (``[stage][batch]``): a splitmix64 mix of the four numbers, the same on
    every rank and in every schedule.  (The Trainer draws them once a step:
    the seed and step are mixed as Python ints, the stages and micro-batches
    as one array.)"""
    import numpy as np

    state = _splitmix(_splitmix(0, int(seed) & _MASK), int(step) & _MASK)
    per_stage = np.array([_splitmix(state, s) for s in range(num_stages)], dtype=np.uint64)[:, None]
    seeds = _splitmix(per_stage, np.arange(num_batches, dtype=np.uint64)[None, :])
    return (seeds & np.uint64((1 << 63) - 1)).tolist()


def generators(device: torch.device) -> list[torch.Generator]:
    """The default generators a stage on ``device`` draws from: the CPU's,
    and the GPU's when ``device`` is one."""
    if device.type != "cuda":
        return [torch.default_generator]
    if not torch.cuda.is_initialized():
        torch.cuda.init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [torch.default_generator, torch.cuda.default_generators[index]]


def seed_rng(generators: Sequence[torch.Generator], seed: int) -> None:
    """Seed ``generators`` (:func:`generators` of a device) with ``seed``.
    Not ``torch.manual_seed`` nor ``torch.cuda.manual_seed``: before CUDA
    starts, those queue a seeding with the caller's stack formatted (about a
    millisecond a call), and the Trainer seeds once per forward."""
    for generator in generators:
        generator.manual_seed(seed)


class LossScale:
    """Dynamic loss scaling for fp16, as ``torch.amp.GradScaler`` does it:
    the loss is multiplied by ``scale`` before the backward and the
    gradients divided by it before the optimizer step; a step whose
    gradients hold an inf or a NaN anywhere is skipped and the scale
    multiplied by ``backoff_factor``; after ``growth_interval`` good steps in
    a row it is multiplied by ``growth_factor``.  Disabled (scale 1, never
    skips) for fp32 and bf16."""

    def __init__(self, enabled: bool, init_scale: float, growth_factor: float, backoff_factor: float,
                 growth_interval: int):
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.good_steps = 0

    def update(self, found_inf: bool) -> None:
        """After an update step: back off if it found an inf or NaN, grow after enough good ones."""
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def settings(self) -> dict:
        """How it scales (not where it stands): the same on every rank."""
        return {"enabled": self.enabled, "scale": self.scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}

    def state(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "enabled": self.enabled}

    def load(self, state: dict) -> None:
        """Continue from :meth:`state` of a scaler in force (fp16); one switched off on either side
        (a run resumed in another precision) leaves this one as it starts: a disabled scaler's scale
        stays 1, an enabled one starts at its initial scale."""
        # a state saved before scalers said whether they were on: an fp32 or bf16 one stood at 1 and never grew
        saved_enabled = state.get("enabled", float(state["scale"]) != 1.0 or int(state["good_steps"]) != 0)
        if self.enabled and saved_enabled:
            self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


def loss_scale(precision: str, options: dict | None) -> LossScale:
    """The :class:`LossScale` for ``precision``, GradScaler's defaults overridden by ``options``."""
    return LossScale(precision == "fp16", **{**LOSS_SCALE_DEFAULTS, **(options or {})})


# ---------------------------------------------------------------------- options
def check_options(stages, loss_fn, optimizer, *, timeout, lookahead, record, **training) -> None:
    """Refuse a Trainer option that cannot work, naming it and what to pass
    instead: the ``training`` options of :func:`check_training_options`,
    then how the Trainer runs.  Pure: every rank given the same options
    raises the same error."""
    check_training_options(stages, loss_fn, optimizer, **training)
    if not _positive(timeout):
        raise ShapeError(f"timeout must be a positive, finite number of seconds, got {_shown(timeout)}")
    if not is_whole(lookahead, 0):
        raise ShapeError(f"lookahead must be a whole number of items >= 0 (how early a receive is posted), "
                         f"got {_shown(lookahead)}")
    if not isinstance(record, bool) and not is_whole(record):
        raise ShapeError(f"record must be True, False or a whole number N >= 1 (record every N-th step), "
                         f"got {_shown(record)}")


def check_training_options(stages, loss_fn, optimizer, *, seed, precision, clip_grad_norm, scheduler, accumulate,
                           loss_scale_options) -> None:
    """Refuse an option of what is trained and how (the ones the Trainer and
    the one-process reference share), naming it and what to pass instead."""
    _check_stages(stages)
    for name, value in (("loss_fn", loss_fn), ("optimizer", optimizer)):
        if not callable(value):
            raise ShapeError(f"{name} must be callable, got {_shown(value)}"
                             + ("; pass a factory: lambda params: torch.optim.SGD(params, lr=0.1)"
                                if name == "optimizer" else "; pass loss_fn(output, target) -> scalar tensor"))
    if not is_whole(seed, None):
        raise ShapeError(f"seed must be a whole number, got {_shown(seed)}")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ShapeError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}, got {_shown(precision)}")
    if clip_grad_norm is not None and not _positive(clip_grad_norm):
        raise ShapeError(f"clip_grad_norm must be a positive, finite number (the largest global L2 norm of the "
                         f"gradients) or None for no clipping, got {_shown(clip_grad_norm)}")
    if scheduler is not None and not callable(scheduler):
        raise ShapeError(f"scheduler must be a factory optimizer -> LRScheduler (e.g. lambda opt: "
                         f"torch.optim.lr_scheduler.StepLR(opt, 10)) or None, got {_shown(scheduler)}")
    if not is_whole(accumulate):
        raise ShapeError(f"accumulate must be a whole number >= 1 (steps whose gradients add up before one "
                         f"optimizer step), got {_shown(accumulate)}")
    _check_loss_scale(precision, loss_scale_options)


def check_optimizer(made: Any) -> None:
    """What the optimizer factory returned must step its parameters and keep its state as torch's do."""
    if not (callable(getattr(made, "step", None)) and hasattr(made, "param_groups") and hasattr(made, "state")):
        forgot = " (does it end without a return?)" if made is None else ""
        raise ShapeError(f"the optimizer factory returned {_shown(made)}{forgot}, which is not an optimizer (step(), "
                         f"param_groups and state); return a torch.optim.Optimizer built on the parameters it is given")


def check_scheduler(made: Any) -> None:
    """What the scheduler factory returned must step."""
    if not callable(getattr(made, "step", None)):
        raise ShapeError(f"the scheduler factory returned {_shown(made)}, which has no step(); return a "
                         f"torch.optim.lr_scheduler.LRScheduler built on the optimizer it is given")


def _check_stages(stages) -> None:
    if is_factory(stages):
        return
    if isinstance(stages, (str, bytes)) or not hasattr(stages, "__len__") or not hasattr(stages, "__getitem__"):
        raise ShapeError(f"stages must be a list of torch.nn.Module (one per stage) or a factory "
                         f"stage -> nn.Module, got {_shown(stages)}")
    for s, stage in enumerate(stages):
        if not isinstance(stage, nn.Module):
            raise ShapeError(f"stages[{s}] is of type {type(stage).__name__}, not a torch.nn.Module; pass one "
                             f"nn.Module per stage, or a factory stage -> nn.Module")


def _check_loss_scale(precision: str, options) -> None:
    if options is None:
        return
    if precision != "fp16":
        raise ShapeError(f"loss_scale applies to precision='fp16' only (precision is {precision!r}); drop it")
    if not isinstance(options, dict) or set(options) - set(LOSS_SCALE_DEFAULTS):
        raise ShapeError(f"loss_scale must be a dict with keys among {sorted(LOSS_SCALE_DEFAULTS)}, "
                         f"got {_shown(options)}")
    merged = {**LOSS_SCALE_DEFAULTS, **options}
    if not (_positive(merged["init_scale"]) and _positive(merged["growth_factor"]) and merged["growth_factor"] >= 1
            and _positive(merged["backoff_factor"]) and merged["backoff_factor"] < 1
            and is_whole(merged["growth_interval"])):
        raise ShapeError(f"loss_scale {options!r}: init_scale must be > 0, growth_factor >= 1, 0 < "
                         f"backoff_factor < 1 and growth_interval a whole number >= 1")


def _positive(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _shown(value) -> str:
    text = repr(value)
    if len(text) <= 60:
        return text
    kind = type(value).__name__
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{'an' if kind[0].lower() in 'aeiou' else 'a'} {kind}"


def caught(check: Callable[[], None]) -> Exception | None:
    """The error ``check()`` raises, or None."""
    try:
        check()
    except Exception as error:
        return error
    return None


def step_scheduler(scheduler, loss: float) -> None:
    """Step an LR scheduler after an optimizer step; one that adapts to the
    loss (``ReduceLROnPlateau``) is given the step's loss."""
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(loss)
    else:
        scheduler.step()
