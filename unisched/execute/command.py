"""``unisched run``: train under a strategy or a plan file for real, through torchrun.

    unisched run -W 4 --strategy gpipe --check
    unisched run -W 4 --plan plan.json --model transformer --timeline step.html
    unisched run -W 4 --strategy "looped(group_size=2)" --program   # print the compiled programs, start nothing
    unisched run -W 4 --strategy looped --dry-run                   # print the torchrun command
    unisched run -W 2 --strategy mine.py:schedule                   # your own strategy function or factory
    unisched run -W 4 --steps 1000 --log-every 50 --checkpoint ckpt --checkpoint-every 200
    unisched run -W 4 --steps 500 --resume ckpt                     # 500 more, from the latest checkpoint

It checks everything it can before it starts a process (the options, the
strategy on this shape or your own strategy's module and function, a plan
file against the number of processes, a checkpoint to resume from), then
launches ``torchrun ... -m unisched.execute.example`` (the same program as
``examples/train.py``); several nodes take ``--nnodes``, ``--node-rank``
and ``--rdzv-endpoint`` exactly as torchrun does.  A rank's error is
printed as one line and the run exits with status 2 (the whole log is kept
in a file the message names); a ``--check`` beyond its tolerance exits
with status 1.  Ctrl-C or SIGTERM stops every rank (torchrun is told to
stop them) and exits with 128 plus the signal's number.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading

from unisched.errors import UniSchedError
from unisched.execute.arguments import (CHECK_FAILED, add_training_arguments, check_model_width, check_training_arguments,
                                        make_schedule, positive_int)

DEFAULT_NPROC = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a registered strategy or a plan file for real: one process per worker under torchrun, "
        "NCCL on GPUs, gloo on CPU. Trains a small MLP or transformer and reports the loss, step time and "
        "throughput every --log-every steps, the measured step against the simulator's prediction, and (with "
        "--check) the difference from one process; --checkpoint saves checkpoints and --resume continues from one."
    )
    launch = parser.add_argument_group("launch")
    launch.add_argument("--workers", "-W", "--nproc", "-n", dest="nproc", type=positive_int,
                        help=f"processes (workers) per node (default: the plan's workers, else {DEFAULT_NPROC})")
    launch.add_argument("--nnodes", default="1", help="nodes, as torchrun takes it: N or MIN:MAX (default 1)")
    launch.add_argument("--node-rank", type=int, help="this node's rank, 0 to N-1 (several nodes)")
    launch.add_argument("--rdzv-endpoint", help="host:port of the rendezvous (several nodes)")
    launch.add_argument("--program", action="store_true", help="print every rank's compiled program and exit")
    launch.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
    add_training_arguments(parser)


def run(args: argparse.Namespace) -> int:
    check_training_arguments(args)
    check_model_width(args)
    _check_nodes(args)
    workers = _workers(args)
    if args.program:
        return _print_program(args, workers)
    command = torchrun_command(args, workers)
    world = _world_size(args, workers)
    if world is not None:
        make_schedule(args, world)  # refuses a strategy that does not fit, or a plan for another world size
    if args.dry_run:
        print(shlex.join(command))  # --json here is the training's option, passed on
        return 0
    return _launch(command)


RANK_ERROR = re.compile(r"^rank (?P<rank>\S+): error: (?P<message>.*)$", re.MULTILINE)
"""A rank's error line (:mod:`unisched.execute.example` writes them)."""
NAMED_RANK = re.compile(r"rank (?P<rank>\d+)\b")
"""An error message that begins by naming the rank it is about."""
BLAMED_RANK = re.compile(r"because rank (?P<rank>\d+)\b")
"""A rank that stopped says which one it stopped for: ``rank 2 stopped at ... because rank 0 ...``."""
KILLED_RANK = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(?P<rank>\d+).*?"
                         r"exitcode\s*:\s*(?P<code>-?\d+).*?traceback\s*:\s*(?P<why>[^\n]*)", re.S)
"""torchrun's report of the first rank to fail: a negative exit code is the signal that killed it."""


STOP_GRACE = 45.0
"""Seconds torchrun has to stop its ranks once told to, before it is killed: longer than the
30 s torchrun itself gives its ranks after SIGTERM before it kills them, so it can."""


class _Stopped(Exception):
    """The run was told to stop (Ctrl-C, SIGTERM); its argument is the signal."""


def _launch(command: list[str]) -> int:
    """Run torchrun; the ranks' output passes through.  On a failure the
    first rank's error is printed as one line and the whole log is kept.
    Ctrl-C or SIGTERM stops every rank: torchrun is told to stop them (SIGTERM)
    and given :data:`STOP_GRACE` seconds, then killed (signals are caught only
    on the main thread, where Python delivers them)."""

    def stop(signum, frame):
        raise _Stopped(signal.Signals(signum))

    catching = threading.current_thread() is threading.main_thread()
    stops, previous = (signal.SIGINT, signal.SIGTERM), {}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        for signum in stops if catching else ():
            previous[signum] = signal.signal(signum, stop)
        _, stderr = process.communicate()
    except _Stopped as why:
        for signum in stops:
            signal.signal(signum, signal.SIG_IGN)
        received = why.args[0]
        print(f"unisched run: {received.name}: telling every rank to stop (at most {STOP_GRACE:g} s) ...",
              file=sys.stderr, flush=True)
        stderr, killed = _stop(process)
        log = _keep_log(stderr)
        how = "torchrun did not stop in time and was killed" if killed else "every rank stopped"
        print(f"unisched run: stopped by {received.name}; {how} (the whole log is in {log})", file=sys.stderr)
        return 128 + received.value
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if process.returncode == 0:
        sys.stderr.write(stderr)
        return 0
    return _failed(stderr, process.returncode, as_json="--json" in command)


def _failed(stderr: str, returncode: int, as_json: bool) -> int:
    """Report a run that ended with ``returncode``: the first rank's error as one line (one JSON
    object when the ranks were asked for JSON), the whole log kept in a file; a failed
    ``--check`` quietly, since rank 0's report on stdout says how far from one process."""
    found = RANK_ERROR.search(stderr)
    if found is None and CHECK_FAILED in stderr.splitlines():
        return 1
    log = _keep_log(stderr)
    rank, said = None, f"training failed (exit status {returncode})"
    if found is not None:
        said = found.group("message")
        # the rank that failed: the one the message blames or names (a peer may report it), else its reporter
        leading = NAMED_RANK.match(said)
        culprit = (BLAMED_RANK.search(said) or leading or found).group("rank")
        rank = int(culprit) if culprit.isdigit() else None
        if leading is None:
            said = f"rank {found.group('rank')}: {said}"
    killed = KILLED_RANK.search(stderr)
    if killed is not None and int(killed.group("code")) < 0:  # a rank killed by a signal is the cause of the rest
        dead = f"rank {killed.group('rank')} was killed ({killed.group('why').strip()})"
        said = f"{dead}; then {said}" if found is not None else f"{dead}, and torchrun stopped the others"
        rank = int(killed.group("rank"))
    if as_json:
        print(json.dumps({"error": said, "details": [f"the whole log is in {log}"], "type": "TrainingFailed",
                          "rank": rank}), file=sys.stderr)
    elif found is None and killed is None:
        print(f"unisched run: {said}; the whole log is in {log}", file=sys.stderr)
    else:
        print(f"unisched run: error: {said} (the whole log is in {log})", file=sys.stderr)
    return returncode if found is None else 2


def _keep_log(text: str) -> str:
    """Write the ranks' and torchrun's stderr to a file; its name."""
    with tempfile.NamedTemporaryFile("w", prefix="unisched-run-", suffix=".log", delete=False) as log:
        log.write(text)
    return log.name


def _stop(process: subprocess.Popen) -> tuple[str, bool]:
    """Tell torchrun to stop its ranks and wait for it, killing it after :data:`STOP_GRACE` s;
    what it wrote to stderr, and whether it was killed."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.communicate(timeout=STOP_GRACE)[1], False
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()[1], True


def _check_nodes(args: argparse.Namespace) -> None:
    """Refuse a node count or node rank torchrun would refuse only after starting: ``--nnodes`` is
    N or MIN:MAX with 1 <= MIN <= MAX, and ``--node-rank`` lies in 0..N-1 and needs several nodes."""
    nnodes = str(args.nnodes).strip()
    low, _, high = nnodes.partition(":")
    bounds = (low, high or low)
    if not all(part.isdigit() for part in bounds) or not 1 <= int(bounds[0]) <= int(bounds[1]):
        raise UniSchedError(f"--nnodes {args.nnodes!r}: give a number of nodes N >= 1, or a range MIN:MAX "
                            "with 1 <= MIN <= MAX, as torchrun takes it")
    if args.node_rank is None:
        return
    if nnodes == "1":
        raise UniSchedError(f"--node-rank {args.node_rank} is for runs on several nodes; give --nnodes too, "
                            "or drop --node-rank")
    if not 0 <= args.node_rank < int(bounds[1]):
        raise UniSchedError(f"--node-rank {args.node_rank}: a node's rank lies in 0..{int(bounds[1]) - 1} "
                            f"for --nnodes {nnodes}")


def torchrun_command(args: argparse.Namespace, workers: int) -> list[str]:
    nnodes = str(args.nnodes).strip()
    if nnodes != "1" and not args.rdzv_endpoint:
        raise UniSchedError(
            f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT, the same on every node (a host every node reaches)"
        )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(workers), "--nnodes", nnodes]
    if nnodes == "1" and not args.rdzv_endpoint:
        command.append("--standalone")
    else:
        command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint]
        if args.node_rank is not None:
            command += ["--node-rank", str(args.node_rank)]
    command += ["-m", "unisched.execute.example", *training_arguments(args)]
    return command


def training_arguments(args: argparse.Namespace) -> list[str]:
    """The example's own options, as given: every option of
    :func:`add_training_arguments`, so that none stays behind."""
    example = argparse.ArgumentParser(add_help=False)
    add_training_arguments(example)
    out: list[str] = []
    for action in example._actions:
        flag, value = action.option_strings[0], getattr(args, action.dest)
        if action.nargs == 0:
            out += [flag] if value else []
        elif isinstance(value, list):
            out += [part for item in value for part in (flag, str(item))]
        elif value is not None:
            out += [flag, str(value)]
    return out


def _workers(args: argparse.Namespace) -> int:
    if args.nproc is not None:
        return args.nproc
    if args.plan:
        from unisched.plan import load_plan

        return load_plan(args.plan).shape.num_workers
    return DEFAULT_NPROC


def _world_size(args: argparse.Namespace, workers: int) -> int | None:
    """How many ranks the run has, when ``--nnodes`` says it (not a range)."""
    nnodes = str(args.nnodes).strip()
    return workers * int(nnodes) if nnodes.isdigit() else None


def _print_program(args: argparse.Namespace, workers: int) -> int:
    from unisched.execute.program import compile_program, describe

    schedule, S, B = make_schedule(args, workers)
    program = compile_program(schedule.timeline, num_stages=S, world_size=workers,
                              stage_graph=getattr(schedule, "stage_graph", None))
    if args.json:
        print(json.dumps({"workers": workers, "stages": S, "batches": B,
                          "ranks": [[str(a) for a in actions] for actions in program.actions]}))
        return 0
    print(f"{schedule.strategy.name}: W={workers} S={S} B={B}")
    print(describe(program))
    print(program)
    return 0
