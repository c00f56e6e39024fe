"""Where a run's checkpoints live on disk: one directory per saved step,
``DIR/step-00000020``, finished once DCP's ``.metadata`` is in it.  Nothing
here imports torch, so ``unisched run`` checks ``--resume`` before it
launches anything."""

from __future__ import annotations

import re
from pathlib import Path

from unisched.errors import UniSchedError

STEP_DIRECTORY = re.compile(r"^step-(\d+)$")


class CheckpointError(UniSchedError):
    """A checkpoint that cannot be written, found, or loaded into this Trainer."""


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a finished checkpoint (DCP writes ``.metadata`` last)."""
    return (Path(path) / ".metadata").is_file()


def partial_checkpoint(path: str | Path) -> Path:
    """Where the ranks write the checkpoint bound for ``path`` until it is finished."""
    path = Path(path)
    return path.with_name(path.name + ".partial")


def step_checkpoint(directory: str | Path, step: int) -> Path:
    """Where the checkpoint after ``step`` steps goes in ``directory``."""
    return Path(directory) / f"step-{step:08d}"


def step_checkpoints(directory: str | Path) -> list[Path]:
    """The finished ``step-N`` checkpoints in ``directory``, by N."""
    directory = Path(directory)
    found = sorted((int(m.group(1)), child) for child in (directory.iterdir() if directory.is_dir() else [])
                   if (m := STEP_DIRECTORY.match(child.name)) and is_checkpoint(child))
    return [child for _, child in found]


def latest_checkpoint(path: str | Path) -> Path:
    """``path`` if it is a checkpoint, else the finished ``step-N`` checkpoint
    in it with the largest N."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    if not path.exists():
        raise CheckpointError(f"no checkpoint in {path}: it does not exist; give what --checkpoint (or "
                              f"save_checkpoint) wrote")
    found = step_checkpoints(path)
    if not found:
        raise CheckpointError(f"no checkpoint in {path}: neither a checkpoint itself nor a directory of finished "
                              f"step-N checkpoints; give what --checkpoint (or save_checkpoint) wrote")
    return found[-1]
