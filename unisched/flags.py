"""The command-line flags that several verbs share, declared and read in one
place: the shape (``-W -S -B``), the costs (``--forward --backward
--backward-input --backward-weight --costs --comm --fetch``), a per-worker number list
such as ``--memory-limit``, and what ``--strategy`` accepts.

``unisched simulate`` and ``compare`` (:mod:`unisched.cli`) and ``unisched
plan`` (:mod:`unisched.plan.command`) declare these with the functions here,
so a flag reads and fails the same way under every verb.  Nothing here
imports torch or numpy.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

from unisched.errors import UniSchedError

STRATEGY_HELP = (
    "NAME or NAME(key=value, ...), e.g. looped(group_size=2) (see `unisched strategies`), or your own "
    "MODULE:FUNCTION or path/to/file.py:FUNCTION (a Work -> workers function or a factory)"
)
"""What ``--strategy`` accepts, for its help."""

COST_FLAGS = ("forward", "backward", "backward_input", "backward_weight")
"""The per-stage time flags (``--forward`` ...), by their ``args`` names."""


def named(text: str) -> str:
    """The argparse ``type`` of a flag that names something (a file, a directory, a strategy, a
    priority): an empty value, as an unset shell variable gives, is refused rather than read as
    the flag left out."""
    if not text.strip():
        raise argparse.ArgumentTypeError("was given an empty value (an unset shell variable?): give one, or leave "
                                         "the flag out")
    return text


DEMO_SHAPE = (4, 4, 8)
"""(W, S, B) of a verb given no shape."""


def add_shape_arguments(parser: argparse.ArgumentParser):
    """``--workers/-W``, ``--stages/-S``, ``--batches/-B`` in a "shape" group,
    defaulting as :func:`shape_of` reads them; returns the group."""
    W, S, B = DEMO_SHAPE
    shape = parser.add_argument_group("shape")
    shape.add_argument("--workers", "-W", type=int, help=f"workers (default {W})")
    shape.add_argument("--stages", "-S", type=int,
                       help=f"pipeline stages (default: the workers when -W is given, else {S})")
    shape.add_argument("--batches", "-B", type=int,
                       help=f"micro-batches (default: twice the workers when -W is given, as unisched run has it, "
                            f"else {B})")
    return shape


def shape_of(args: argparse.Namespace) -> tuple[int, int, int]:
    """(W, S, B) from the shape flags: :data:`DEMO_SHAPE` where not given,
    except that with ``-W`` given the stages follow the workers and the
    micro-batches are twice the workers (``unisched run``'s defaults)."""
    W = DEMO_SHAPE[0] if args.workers is None else args.workers
    S = args.stages if args.stages is not None else (W if args.workers is not None else DEMO_SHAPE[1])
    B = args.batches if args.batches is not None else (2 * W if args.workers is not None else DEMO_SHAPE[2])
    return W, S, B


def add_cost_arguments(parser: argparse.ArgumentParser):
    """The per-stage times and ``--costs FILE`` in a "costs" group; returns the
    group (for a verb's own cost flags)."""
    costs = parser.add_argument_group("costs (default: forward 1, backward 2, free communication)")
    costs.add_argument("--forward", type=float, help="forward time of a stage")
    costs.add_argument("--backward", type=float, help="backward time of a stage")
    costs.add_argument("--backward-input", type=float, help="input-gradient time (splits the backward)")
    costs.add_argument("--backward-weight", type=float, help="weight-gradient time (splits the backward)")
    costs.add_argument("--costs", type=named, metavar="FILE", help="a JSON costs file (unisched.Costs fields), e.g. from "
                       "calibration; time flags given beside it replace its times")
    costs.add_argument("--comm", type=float,
                       help="time to move an activation or gradient between workers (a weight fetch and each "
                       "ring step of an all-reduce pay it too; with --comm or --fetch, weights are fetched from the "
                       "step's start and kept, as plan models them); not with --costs, which gives the links")
    costs.add_argument("--fetch", type=float, help="time to fetch a stage's weights from another worker")
    return costs


def add_memory_limit_argument(parser, note: str = "") -> None:
    """``--memory-limit``: one number, or one per worker (``note`` adds what the verb does with several)."""
    parser.add_argument(
        "--memory-limit",
        help="activations a worker may hold (stashes; bytes when the costs give activation_bytes): "
        f"one number, or one per worker separated by commas{note}",
    )


def cost_values(args: argparse.Namespace, flags=COST_FLAGS, error: type[UniSchedError] = UniSchedError) -> dict:
    """The cost flags given, by name, each checked to be a finite number >= 0."""
    given = {flag: getattr(args, flag, None) for flag in flags}
    for flag, value in given.items():
        if value is not None and not (value >= 0 and math.isfinite(value)):
            raise error(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {value:g}")
    return {flag: value for flag, value in given.items() if value is not None}


def splits_backward(args: argparse.Namespace) -> bool:
    """Whether the flags split the backward (they give one of its halves)."""
    return getattr(args, "backward_input", None) is not None or getattr(args, "backward_weight", None) is not None


def numbers(flag: str, text: str | None, count: int, what: str,
            error: type[UniSchedError] = UniSchedError) -> float | tuple[float, ...] | None:
    """A flag's one number >= 0, or ``count`` of them separated by commas (one
    per worker or stage); several equal ones read as one."""
    if text is None:
        return None
    try:
        values = [float(v) for v in str(text).split(",")]
    except ValueError:
        raise error(f"{flag} takes a number or comma-separated numbers, got {text!r}") from None
    if not all(v >= 0 and math.isfinite(v) for v in values):
        raise error(f"{flag} must be finite numbers >= 0, got {text!r}")
    if len(values) > 1 and len(values) != count:
        raise error(f"{flag} gives {len(values)} numbers but there are {count} {what}: give one, or {count}")
    return values[0] if len(set(values)) == 1 else tuple(values)


def check_writable(path, said: str, folder: bool = False) -> None:
    """Refuse, before a verb runs rather than when it writes, a place nothing can be written:
    ``path`` a file in a folder that exists (not a folder itself), or with ``folder`` a folder
    (its nearest existing folder must take new files); a file is made there and removed to tell.
    ``said`` names the flag and path in the message."""
    target = Path(path).absolute()
    if not folder and target.is_dir():
        raise UniSchedError(f"{said} is a folder; name a file in it (e.g. {Path(path) / ('out' + target.suffix)})")
    where = target if folder else target.parent
    while folder and not where.exists():
        where = where.parent
    if not folder and not where.is_dir():
        raise UniSchedError(f"{said}: there is no folder {str(Path(path).parent)!r} to write it in; create it "
                            "first, or name a file in a folder that exists")
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as error:
        made = "a folder" if folder else "a file in a folder"
        raise UniSchedError(f"{said}: cannot write there ({error.strerror or error}); name {made} you may "
                            "write to") from None
    if not folder and target.exists() and not os.access(target, os.W_OK):
        raise UniSchedError(f"{said}: this user may not write over it; name another file")
