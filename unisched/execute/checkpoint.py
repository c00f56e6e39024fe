"""Checkpoints of a Trainer with torch.distributed.checkpoint (DCP).

A checkpoint is keyed by stage, never by rank, so it loads into any
strategy and world size whose stages are the same modules:

- ``stages.{s}.{name}``: stage ``s``'s state dict (parameters and
  buffers) as the ranks that hold its weights of truth have it (the host
  copies where they are offloaded); the member holding share ``i`` > 0 of a
  tensor-parallel stage writes ``stages.{s}:{i}.{name}``;
- ``optim.{s}.{name}.{field}``: the optimizer state of that parameter
  (``exp_avg``, ``momentum_buffer``, ...), mapped from the optimizer by the
  parameter objects, so the factory may group parameters as it likes;
- ``trainer.*``: what every rank has alike: the optimizer's class and
  hyper-parameters (its learning rate after a scheduler moved it), the LR
  scheduler's state, the Trainer's own training state when it offers one,
  and ``extra``, what the caller asks to keep (the examples: the step);
  each is one byte tensor written by ``torch.save`` and read back with the
  weights-only unpickler.

Replicas of a stage write the same keys and DCP keeps one copy.  On load
each rank reads only the keys of the stages it holds, so a stage may now
live on another rank, or on several.  Every rank first checks the
checkpoint against its stages (keys, shapes, dtypes, the optimizer class)
and the ranks agree on the verdicts before anyone reads a tensor: a
checkpoint of another model fails on every rank with the same message.

Nothing is written half: the ranks write ``DIR.partial`` (DCP writes its
``.metadata`` last, when every rank has written its data), and rank 0
renames it to ``DIR`` once DCP has finished; a ``DIR`` without
``.metadata`` is not a checkpoint.
"""

from __future__ import annotations

import io
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException as DCPFailure  # a BaseException, not an Exception
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from unisched.errors import first_line
from unisched.execute.agreement import all_gather_json
from unisched.execute.checkpoint_files import (
    CheckpointError,
    is_checkpoint,
    latest_checkpoint,
    partial_checkpoint,
    step_checkpoint,
)

__all__ = ["CheckpointError", "checkpoint_state_dict", "latest_checkpoint", "load_checkpoint", "read_checkpoint",
           "save_checkpoint", "saved_extra", "step_checkpoint"]
PACKED = "@"
"""Marks an optimizer state field that is not a tensor (stored by :func:`pack`)."""


# ---------------------------------------------------------------------- keys
def weight_key(stage: int, share: int, name: str) -> str:
    """The key of entry ``name`` of ``stage``'s state dict (``share`` of a tensor-parallel stage)."""
    return f"stages.{_where(stage, share)}.{name}"


def optimizer_key(stage: int, share: int, name: str, field: str) -> str:
    """The key of ``field`` of the optimizer state of parameter ``name`` of ``stage``."""
    return f"optim.{_where(stage, share)}.{name}.{field}"


def _where(stage: int, share: int) -> str:
    return f"{stage}" if share == 0 else f"{stage}:{share}"


def _stage_of(key: str) -> str | None:
    """``"3"`` or ``"3:1"`` for a weight key, None for any other."""
    if not key.startswith("stages."):
        return None
    return key[len("stages."):].partition(".")[0]


# ---------------------------------------------------------------------- saving
def save_checkpoint(trainer, path: str | Path, extra: dict | None = None) -> Path:
    """Write ``trainer``'s weights of truth, optimizer and scheduler state
    (every rank calls it, between steps) to the directory ``path``; ``extra``
    (the same on every rank) comes back from :func:`load_checkpoint`."""
    if not callable(getattr(trainer, "training_state", None)):
        raise TypeError(f"save_checkpoint() needs a unisched Trainer, got {type(trainer).__name__}")
    if not isinstance(path, (str, os.PathLike)) or not str(path).strip():
        raise CheckpointError(f"save_checkpoint() needs a directory to save in, got {path!r}")
    path = Path(path)
    accumulated = trainer.training_state()["accumulated"]
    if accumulated:  # the same count on every rank: all refuse alike
        raise CheckpointError(
            f"cannot save checkpoint {path} after {accumulated} of {trainer.accumulate} accumulated steps: their "
            f"gradients would not be in it, and it could not be loaded; save right after an optimizer step"
        )
    if extra is not None:  # the same on every rank: all refuse alike, before anything is written
        try:
            unpack(pack(dict(extra)))
        except Exception as error:
            raise CheckpointError(f"extra= cannot be kept in a checkpoint: {first_line(error)}; give numbers, "
                                  "strings, tensors, and lists, tuples and dicts of them") from None
    partial = partial_checkpoint(path)
    problem = None
    if trainer.rank == 0:
        problem = _attempt(lambda: _refuse_to_replace(path), f"cannot write {path}") or _attempt(
            lambda: _fresh_directory(partial), f"cannot write {partial}")
    _agree(trainer, problem)
    state = _state_to_save(trainer, extra)
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(partial), process_group=trainer.control_group)
    except (Exception, DCPFailure) as error:
        raise CheckpointError(f"saving checkpoint {path} failed: {first_line(error)}") from error
    problem = None
    if trainer.rank == 0:
        problem = _attempt(lambda: _replace(partial, path), f"cannot move {partial} to {path}")
    _agree(trainer, problem)
    return path


def _state_to_save(trainer, extra: dict | None) -> dict[str, Any]:
    """This rank's share of the checkpoint: the stages it holds, their
    optimizer state, and what every rank has alike."""
    state: dict[str, Any] = {}
    for s, share in held_stages(trainer):
        state.update({weight_key(s, share, name): t.detach() for name, t in stage_state(trainer, s).items()})
    optimizer = trainer.optimizer
    objects: dict[str, Any] = {}
    if optimizer is not None:
        for (s, share, name), param in truth_parameters(trainer).items():
            for field, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value):
                    state[optimizer_key(s, share, name, field)] = value.detach()
                else:
                    state[optimizer_key(s, share, name, field + PACKED)] = pack(value)
        objects["optimizer_class"] = type(optimizer).__name__
        objects["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    if trainer.scheduler is not None:
        objects["scheduler"] = trainer.scheduler.state_dict()
    # the scheduler's state is kept above, by the ranks that have one: a rank
    # without an optimizer has none, and DCP keeps one rank's copy
    objects["training_state"] = {k: v for k, v in trainer.training_state().items() if k != "scheduler"}
    if extra is not None:
        objects["extra"] = dict(extra)
    state.update({f"trainer.{name}": pack(value) for name, value in objects.items()})
    return state


def pack(value: Any) -> torch.Tensor:
    """``value`` (numbers, strings, tensors, and lists, tuples and dicts of
    them) as a byte tensor: DCP stores it as one entry, not one per field."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def unpack(data: torch.Tensor) -> Any:
    """The value :func:`pack` stored, read with torch's weights-only unpickler (no code runs)."""
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


def _refuse_to_replace(path: Path) -> None:
    """Raise an OSError (for :func:`_attempt`, on rank 0) where ``path`` may not become a checkpoint:
    a checkpoint there is replaced once the new one is written, and so is an empty directory;
    anything else is the user's."""
    if path.is_dir() and not is_checkpoint(path) and any(path.iterdir()):
        raise OSError("the directory holds files that are not a checkpoint, which saving would delete; name a new "
                      "directory (or an empty one, or an older checkpoint to replace)")
    if path.exists() and not path.is_dir():
        raise OSError("it is a file; name a directory")


def _fresh_directory(partial: Path) -> None:
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)


def _replace(partial: Path, path: Path) -> None:
    """Put the finished ``partial`` in ``path``'s place (an older checkpoint
    there goes only once the new one is in place)."""
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.rename(old)
    partial.rename(path)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------- what a rank holds
def held_stages(trainer) -> list[tuple[int, int]]:
    """(stage, share) of every stage whose weights of truth this rank holds."""
    program = trainer.program
    return [(s, program.shares[s][trainer.rank]) for s in range(program.num_stages)
            if trainer.rank in program.replicas[s]]


def stage_state(trainer, s: int) -> dict[str, torch.Tensor]:
    """Stage ``s``'s state dict with its weights of truth: the stage's own
    tensors, or the host copies of the parameters where they are offloaded."""
    stage: nn.Module = trainer.stages[s]
    state = stage.state_dict(keep_vars=True)
    host = trainer.host_weights.get(s)
    if host is None:
        return {name: t.detach() for name, t in state.items()}
    copies = {id(p): h for p, h in zip(_trainable(stage), host)}
    return {name: copies.get(id(t), t).detach() for name, t in state.items()}


def truth_parameters(trainer) -> dict[tuple[int, int, str], torch.Tensor]:
    """``(stage, share, name) -> parameter`` for every weight of truth this
    rank's optimizer steps (offloaded ones: their host copies)."""
    out = {}
    for s, share in held_stages(trainer):
        named = [(name, p) for name, p in trainer.stages[s].named_parameters() if p.requires_grad]
        truth = trainer.host_weights.get(s, [p for _, p in named])
        out.update({(s, share, name): t for (name, _), t in zip(named, truth)})
    return out


def _trainable(stage: nn.Module) -> list[nn.Parameter]:
    return [p for p in stage.parameters() if p.requires_grad]


# ---------------------------------------------------------------------- loading
def load_checkpoint(trainer, path: str | Path, optimizer: bool = True) -> dict | None:
    """Load the checkpoint at ``path`` into ``trainer`` (every rank calls
    it, between steps): the weights of the stages each rank holds, with
    their optimizer state, the optimizer's hyper-parameters, the scheduler
    and training state unless ``optimizer=False`` (weights only, e.g. to
    fine-tune with a new optimizer).  Returns the ``extra`` it was saved with."""
    path = Path(path)
    metadata, problem = None, None
    objects: dict[str, Any] = {}
    try:
        metadata = read_metadata(path)
        objects = _read_objects(path, metadata)
        problem = _mismatch(trainer, metadata, objects, optimizer)
    except CheckpointError as error:
        problem = str(error)
    _agree(trainer, problem)
    destination = _destination(trainer, metadata, optimizer)
    try:
        dcp.load(destination, storage_reader=dcp.FileSystemReader(path), process_group=trainer.control_group)
    except (Exception, DCPFailure) as error:
        raise CheckpointError(f"loading checkpoint {path} failed: {first_line(error)}") from error
    if optimizer:
        _restore_optimizer(trainer, destination, objects)
    return objects.get("trainer.extra")


def saved_layout(path: str | Path) -> tuple[int, str | None]:
    """How many stages the checkpoint at ``path`` holds and its optimizer's class name (None: it
    keeps none), read by this rank alone: for a command to name the flags that load it."""
    path = Path(path)
    metadata = read_metadata(path)
    return len(_stored_stages(metadata)), _read_objects(path, metadata).get("trainer.optimizer_class")


def _stored_stages(metadata: Metadata) -> list[int]:
    """The stages a checkpoint holds weights of, in order."""
    return sorted({int(where.partition(":")[0]) for key in metadata.state_dict_metadata
                   if (where := _stage_of(key)) is not None})


def read_metadata(path: str | Path) -> Metadata:
    """The checkpoint's DCP metadata: every key, with its shape and dtype."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: it does not exist; give a directory save_checkpoint wrote "
                              f"(or the directory of step-N checkpoints to --resume)")
    if not is_checkpoint(path):
        partial = partial_checkpoint(path)
        hint = f" ({partial} is an unfinished one)" if partial.exists() else ""
        raise CheckpointError(f"no checkpoint at {path}: it has no .metadata{hint}; give a directory "
                              f"save_checkpoint wrote (or the directory of step-N checkpoints to --resume)")
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except (Exception, DCPFailure) as error:
        raise CheckpointError(f"cannot read checkpoint {path}: {first_line(error)}") from error


def _read_objects(path: Path, metadata: Metadata) -> dict[str, Any]:
    """The ``trainer.*`` entries, read by this rank alone (they are small)."""
    wanted = {key: _room(md) for key, md in metadata.state_dict_metadata.items() if key.startswith("trainer.")}
    _load_alone(path, wanted)
    return {key: unpack(value) for key, value in wanted.items()}


def _load_alone(path: Path, destination: dict[str, torch.Tensor]) -> None:
    """DCP's load of ``destination`` in this process only (whether or not a process group runs)."""
    if not destination:
        return
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(destination, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    except (Exception, DCPFailure) as error:
        raise CheckpointError(f"cannot read checkpoint {path}: {first_line(error)}") from error


def _mismatch(trainer, metadata: Metadata, objects: dict, optimizer: bool) -> str | None:
    """Why this rank cannot load the checkpoint, naming the stage and key, or None."""
    saved = metadata.state_dict_metadata
    stored = _stored_stages(metadata)
    S = trainer.program.num_stages
    hint = "; load a checkpoint of the same model (the same stages, parameter names and shapes)"
    if stored != list(range(S)):
        return f"the checkpoint holds stages {_span(stored)} but this Trainer has {S} stages (0..{S - 1}){hint}"
    for s, share in held_stages(trainer):
        prefix = f"stages.{_where(s, share)}."
        theirs = {key[len(prefix):]: md for key, md in saved.items() if key.startswith(prefix)}
        mine = stage_state(trainer, s)
        if not theirs:
            return (f"stage {s} is tensor-parallel share {share} here, which the checkpoint does not hold "
                    f"(it holds stage {s} as {_shares_of(saved, s)}){hint}")
        missing = [name for name in mine if name not in theirs]
        if missing:
            return f"stage {s} has {missing[0]!r}, which the checkpoint's stage {s} lacks{hint}"
        extra = [name for name in theirs if name not in mine]
        if extra:
            return f"the checkpoint's stage {s} has {extra[0]!r}, which this model's stage {s} lacks{hint}"
        for name, tensor in mine.items():
            md = theirs[name]
            if not isinstance(md, TensorStorageMetadata):
                return f"the checkpoint's stage {s} {name!r} is not a tensor{hint}"
            if tuple(md.size) != tuple(tensor.shape) or md.properties.dtype != tensor.dtype:
                return (f"stage {s} {name!r}: the checkpoint has {tuple(md.size)} {md.properties.dtype}, this model "
                        f"{tuple(tensor.shape)} {tensor.dtype}{hint}")
    ours, theirs = type(trainer.optimizer).__name__, objects.get("trainer.optimizer_class")
    if optimizer and trainer.optimizer is not None and theirs is not None and ours != theirs:
        return (f"the checkpoint's optimizer is {theirs} but this Trainer's is {ours}; build the Trainer with "
                f"{theirs}, or load the weights alone (load_checkpoint(..., optimizer=False))")
    groups = objects.get("trainer.param_groups")
    if optimizer and trainer.optimizer is not None and groups is not None \
            and len(groups) != len(trainer.optimizer.param_groups):
        return (f"the checkpoint's optimizer has {len(groups)} parameter groups but this Trainer's has "
                f"{len(trainer.optimizer.param_groups)}; build the optimizer the same way, or load the weights "
                f"alone (load_checkpoint(..., optimizer=False))")
    return None


def _destination(trainer, metadata: Metadata, optimizer: bool) -> dict[str, torch.Tensor]:
    """What this rank reads: its stages' tensors (DCP copies into them, so
    they load in place) and room for their optimizer state."""
    out = {}
    for s, share in held_stages(trainer):
        out.update({weight_key(s, share, name): t for name, t in stage_state(trainer, s).items()})
    if optimizer and trainer.optimizer is not None:
        prefixes = {optimizer_key(s, share, name, ""): param for (s, share, name), param in truth_parameters(trainer).items()}
        for key, md in metadata.state_dict_metadata.items():
            if key.rpartition(".")[0] + "." in prefixes:
                out[key] = _room(md)
    return out


def _restore_optimizer(trainer, loaded: dict[str, Any], objects: dict[str, Any]) -> None:
    """Optimizer state by parameter, its hyper-parameters, the scheduler and
    the Trainer's training state, through their own ``load_state_dict``."""
    optimizer = trainer.optimizer
    if optimizer is not None:
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        state: dict[int, dict] = {}
        for (s, share, name), param in truth_parameters(trainer).items():
            prefix = optimizer_key(s, share, name, "")
            fields = {_field(key[len(prefix):], value) for key, value in loaded.items()
                      if key.startswith(prefix) and "." not in key[len(prefix):]}
            fields = dict(fields)
            if fields and id(param) in index:
                state[index[id(param)]] = fields
        saved = optimizer.state_dict()
        groups = objects.get("trainer.param_groups") or [{} for _ in saved["param_groups"]]
        saved["param_groups"] = [{**g, **{k: v for k, v in theirs.items() if k != "params"}}
                                 for g, theirs in zip(saved["param_groups"], groups)]
        saved["state"] = state
        optimizer.load_state_dict(saved)
    training = objects.get("trainer.training_state")
    if training is not None:
        trainer.load_training_state({**training, "scheduler": objects.get("trainer.scheduler")})


# ---------------------------------------------------------------------- one process
def checkpoint_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights in one process (no process group needed) as
    a plain state dict ``{"<stage>.<name>": tensor}``, the form of
    ``Trainer.gather_state_dict`` (of a tensor-parallel stage, share 0)."""
    path = Path(path)
    weights = {key: _room(md) for key, md in read_metadata(path).state_dict_metadata.items()
               if (where := _stage_of(key)) is not None and ":" not in where}
    _load_alone(path, weights)
    return {key[len("stages."):]: tensor for key, tensor in weights.items()}


def saved_extra(path: str | Path) -> dict | None:
    """The ``extra`` a checkpoint was saved with, read in one process."""
    path = Path(path)
    wanted = {key: _room(md) for key, md in read_metadata(path).state_dict_metadata.items() if key == "trainer.extra"}
    _load_alone(path, wanted)
    return unpack(wanted["trainer.extra"]) if wanted else None


def read_checkpoint(path: str | Path, objects: bool = True) -> dict[str, Any]:
    """Every entry of the checkpoint by its key (weights, optimizer state
    and, with ``objects``, the ``trainer.*`` entries), in one process."""
    path = Path(path)
    metadata = read_metadata(path)
    out = {key: _room(md) for key, md in metadata.state_dict_metadata.items()
           if objects or not key.startswith("trainer.")}
    _load_alone(path, out)
    return {key: unpack(value) if key.startswith("trainer.") or key.endswith(PACKED) else value
            for key, value in out.items()}


def _room(md: TensorStorageMetadata) -> torch.Tensor:
    """Where DCP loads an entry: a tensor of its shape and dtype."""
    return torch.empty(md.size, dtype=md.properties.dtype)


def _field(name: str, value: torch.Tensor) -> tuple[str, Any]:
    """An optimizer state field as the optimizer keeps it (a packed one unpacked)."""
    return (name[: -len(PACKED)], unpack(value)) if name.endswith(PACKED) else (name, value)


# ---------------------------------------------------------------------- every rank agrees

def _agree(trainer, problem: str | None) -> None:
    """Every rank learns every rank's problem; all raise the first one together, or none does."""
    texts = [problem]
    if trainer.world_size > 1:
        texts = all_gather_json(problem, trainer.control_group, trainer.world_size)
    for rank, text in enumerate(texts):
        if text:
            raise CheckpointError(f"rank {rank}: {text}" if trainer.world_size > 1 else text)


def _attempt(action, what: str) -> str | None:
    try:
        action()
    except OSError as error:
        return f"{what}: {error.strerror or error}"
    return None


def _span(stages: list[int]) -> str:
    if not stages:
        return "none"
    return f"{stages[0]}..{stages[-1]}" if stages == list(range(stages[0], stages[-1] + 1)) else str(stages)


def _shares_of(saved, s: int) -> str:
    shares = sorted({w for key in saved if (w := _stage_of(key)) is not None and w.partition(":")[0] == str(s)})
    return ", ".join(shares) or "nothing"
