"""The error family: every error unisched raises for bad input is a
:class:`UniSchedError`, with a message that names the offending work item,
worker, stage or file and says what to change."""

from __future__ import annotations

import json
from pathlib import Path


class UniSchedError(Exception):
    """Base class of every error unisched raises on purpose."""


class ShapeError(UniSchedError, ValueError):
    """A shape, cost or parameter that cannot describe a training step."""


class StrategyError(UniSchedError):
    """A strategy returned something that is not a valid pair of workers, or raised."""


class DeadlockError(UniSchedError):
    """No work item can make progress: memory limits (or a fixed order) block
    every worker that still has work.  ``blocked`` maps each stuck worker to a
    description of what it waits for and what it holds."""

    def __init__(self, message: str, blocked: dict[int, str] | None = None):
        super().__init__(message)
        self.blocked = dict(blocked or {})


class SplitError(UniSchedError, ValueError):
    """A model that cannot be split as asked: into pipeline stages (too many for its blocks, a
    layout the Trainer cannot run, weights shared between stages: ``unisched.split_model``) or
    over the devices of ``epl.split`` (a layer whose features do not divide, nothing to shard)."""


class TimelineError(UniSchedError, ValueError):
    """A Timeline that is not a valid step: an item missing or run twice, a
    dependency broken, two items at once on one worker, or more activation
    memory than allowed.  ``items`` and ``workers`` name the offenders."""

    def __init__(self, message: str, items=(), workers=()):
        super().__init__(message)
        self.items = list(items)
        self.workers = list(workers)


def first_line(error: BaseException) -> str:
    """The first line of an error's message (at most 300 characters), or its type's name: for one-line reports."""
    text = str(error).strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def read_json(path, what: str, fix: str, error: type[UniSchedError]):
    """The JSON the file at ``path`` holds, or ``error`` naming it as ``what`` (e.g. "costs file"):
    that it cannot be read, or that it is not JSON, and then ``fix``, what to write instead."""
    try:
        return json.loads(Path(path).read_text())
    except OSError as failure:
        raise error(f"cannot read {what} {path}: {failure}") from failure
    except (ValueError, RecursionError) as failure:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise error(f"{what} {path} is not valid JSON: {failure}; {fix}") from failure
