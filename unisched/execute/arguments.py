"""The options of a training run and the schedule they name, shared by
``unisched run`` (which checks them before it launches anything) and the
program every rank runs (:mod:`unisched.execute.example`).  Nothing here
imports torch, so ``unisched run --help`` and a refused option answer at once."""

from __future__ import annotations

import argparse
from pathlib import Path

from unisched.flags import STRATEGY_HELP, check_writable, named

MODELS = ("mlp", "transformer")
MODEL_WIDTHS = {"mlp": 64, "transformer": 32}
"""Each model's hidden width when ``--model-width`` is not given."""
TRANSFORMER_HEADS = 4
"""The example transformer's attention heads, among which its width is split."""
LR_SCHEDULES = ("constant", "cosine")
DEFAULT_STRATEGY = "gpipe"
TIMELINE_FORMATS = (".html", ".png", ".svg", ".json", ".txt")
DEFAULT_TOLERANCE = 1e-5
CHECK_FAILED = "rank 0: check failed"
"""The line a run's rank 0 writes to stderr when ``--check`` fails, so that ``unisched run``
tells it from a rank that failed to train (the report on stdout says how far)."""


def add_schedule_arguments(p: argparse.ArgumentParser) -> None:
    """The options :func:`check_training_arguments` and :func:`make_schedule` read."""
    p.add_argument("--strategy", type=named, help=f"{STRATEGY_HELP} (default {DEFAULT_STRATEGY})")
    p.add_argument("--param", action="append", default=[], metavar="K=V", help="a strategy parameter, e.g. group_size=2")
    p.add_argument("--plan", type=named, metavar="FILE", help="a plan file from `unisched plan --out` instead of a strategy")
    p.add_argument("--stages", "-S", type=positive_int, help="pipeline stages (default: what the strategy needs)")
    p.add_argument("--batches", "-B", type=positive_int, help="micro-batches (default: twice the workers, or as many or four times as many where "
                                                        "the strategy needs)")


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    add_schedule_arguments(p)
    p.add_argument("--model", choices=MODELS, default="mlp", help="what to train (default mlp)")
    p.add_argument("--rows-per-batch", type=positive_int, default=8, help="rows per micro-batch (default 8)")
    p.add_argument("--model-width", type=positive_int,
                   help=f"hidden width of the model (default {MODEL_WIDTHS['mlp']} for the mlp, "
                   f"{MODEL_WIDTHS['transformer']} for the transformer, whose width must be a multiple of its "
                   f"{TRANSFORMER_HEADS} attention heads)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="sgd (default) or adam")
    p.add_argument("--lr", type=positive_float, help="learning rate (default 0.2 for sgd, 0.01 for adam)")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="seconds any wait or step may take (default 120)")
    add_numerics_arguments(p)
    add_long_run_arguments(p, default_steps=10)
    add_check_arguments(p)
    p.add_argument("--timeline", type=named, metavar="FILE", help=f"save the last measured step ({', '.join(TIMELINE_FORMATS)})")
    p.add_argument("--json", action="store_true", help="rank 0 prints one JSON object")


def add_check_arguments(p: argparse.ArgumentParser) -> None:
    """``--check`` against one process and its ``--tolerance``."""
    p.add_argument("--check", action="store_true",
                   help="compare the trained weights with one process; fail (exit 1) beyond --tolerance")
    p.add_argument("--tolerance", type=positive_float, default=DEFAULT_TOLERANCE,
                   help=f"largest difference --check accepts (default {DEFAULT_TOLERANCE:g})")


def add_numerics_arguments(p: argparse.ArgumentParser) -> None:
    """The Trainer's numerics: precision, clipping, the learning-rate schedule."""
    numerics = p.add_argument_group("numerics")
    numerics.add_argument("--precision", metavar="NAME",
                          help="fp32 (default), bf16 (autocast, fp32 weights and optimizer state) or fp16 (with "
                               "loss scaling)")
    numerics.add_argument("--clip-grad-norm", type=positive_float, metavar="NORM",
                          help="clip the gradients of all stages together to this global norm")
    numerics.add_argument("--lr-schedule", choices=LR_SCHEDULES,
                          help="constant (default) or cosine: decay to 0 over all the run's steps, after the warm-up")
    numerics.add_argument("--warmup-steps", type=whole_number, metavar="N",
                          help="raise the learning rate linearly over the first N steps (default 0: none)")


def add_long_run_arguments(p: argparse.ArgumentParser, default_steps: int) -> None:
    """How long a run trains, what it logs, where it keeps checkpoints and
    what it resumes from: the options both examples take."""
    run = p.add_argument_group("long runs")
    run.add_argument("--steps", type=positive_int, default=default_steps,
                     help=f"training steps this run takes (default {default_steps}; after --resume, steps more)")
    run.add_argument("--log-every", type=positive_int, metavar="N",
                     help="print loss, step time and throughput every N steps (default: about ten lines a run)")
    run.add_argument("--checkpoint", type=named, metavar="DIR", help="save checkpoints to DIR/step-N (after the last step, and "
                                                         "every --checkpoint-every steps)")
    run.add_argument("--checkpoint-every", type=positive_int, metavar="N", help="save a checkpoint every N steps")
    run.add_argument("--resume", type=named, metavar="PATH", help="continue from a checkpoint, or the latest in a --checkpoint "
                                                      "directory: the weights, optimizer state and step count")


def check_numerics_arguments(args: argparse.Namespace) -> None:
    """Refuse a precision the Trainer does not know, before anything starts."""
    if args.precision is not None:
        from unisched.execute.training import PRECISIONS
        import unisched

        if args.precision not in PRECISIONS:
            raise unisched.UniSchedError(f"--precision {args.precision}: choose one of {', '.join(PRECISIONS)}")


def check_long_run_arguments(args: argparse.Namespace) -> None:
    """Refuse long-run options that cannot work, before anything starts."""
    from unisched.execute.checkpoint_files import CheckpointError, latest_checkpoint, step_checkpoints

    if args.checkpoint_every is not None and not args.checkpoint:
        raise CheckpointError("--checkpoint-every needs --checkpoint DIR, the directory to save them in")
    resumed = latest_checkpoint(args.resume) if args.resume else None  # refuses a path without one
    if args.checkpoint and Path(args.checkpoint).exists() and not Path(args.checkpoint).is_dir():
        raise CheckpointError(f"--checkpoint {args.checkpoint} is a file; name a directory to save checkpoints in")
    # a run saving among another's checkpoints would replace them one by one, and a later --resume take either
    earlier = step_checkpoints(args.checkpoint) if args.checkpoint else []
    if earlier and not (resumed and resumed.parent.resolve() == Path(args.checkpoint).resolve()):
        raise CheckpointError(f"--checkpoint {args.checkpoint} already holds another run's checkpoints (the latest "
                              f"{earlier[-1].name}); continue that run with --resume {args.checkpoint}, or save this "
                              f"one in another directory")
    steps = [path.resolve() for path in earlier]  # by step number
    at = steps.index(resumed.resolve()) if resumed and resumed.resolve() in steps else len(steps)
    later = [path.name for path in earlier[at + 1:]]
    if later:
        raise CheckpointError(f"--checkpoint {args.checkpoint} holds checkpoints after the resumed {resumed.name} "
                              f"({', '.join(later)}): this run would save among them and a later --resume take the "
                              f"latest of either; move them out of the directory, or save this run in another")
    if args.checkpoint:
        check_writable(args.checkpoint, f"--checkpoint {args.checkpoint}", folder=True)


def check_model_width(args: argparse.Namespace) -> None:
    """Fill in the model's own width where ``--model-width`` is not given; refuse a transformer
    width its attention heads cannot share."""
    import unisched

    if args.model_width is None:
        args.model_width = MODEL_WIDTHS[args.model]
    elif args.model == "transformer" and args.model_width % TRANSFORMER_HEADS:
        below = args.model_width // TRANSFORMER_HEADS * TRANSFORMER_HEADS
        nearest = " or ".join(str(w) for w in (below, below + TRANSFORMER_HEADS) if w > 0)
        raise unisched.UniSchedError(
            f"--model-width {args.model_width}: the transformer splits its width among {TRANSFORMER_HEADS} attention "
            f"heads; give a multiple of {TRANSFORMER_HEADS}, e.g. {nearest}")


def log_interval(args: argparse.Namespace) -> int:
    """Steps between two log lines: ``--log-every``, else about ten lines a run."""
    return args.log_every or max(1, args.steps // 10)


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    return _whole(text, 1, "a positive whole number")


def whole_number(text: str) -> int:
    """An argparse type: a whole number of at least 0."""
    return _whole(text, 0, "a whole number (0 or more)")


def _whole(text: str, least: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text}")
    return value


def check_training_arguments(args: argparse.Namespace) -> None:
    """Refuse options that contradict each other, then fill in the default
    strategy and move the parameters of ``NAME(K=V, ...)`` to ``--param``.
    A plan file fixes the strategy, its parameters and the shape, so
    ``--plan`` excludes ``--strategy``, ``--param``, ``-S`` and ``-B``."""
    import unisched

    check_numerics_arguments(args)
    check_long_run_arguments(args)
    if args.timeline and Path(args.timeline).suffix.lower() not in TIMELINE_FORMATS:
        raise unisched.UniSchedError(
            f"--timeline {args.timeline}: the measured step is saved as {', '.join(TIMELINE_FORMATS)}; "
            f"name the file with one of these"
        )
    if args.timeline:
        check_writable(args.timeline, f"--timeline {args.timeline}")
    if args.plan:
        given = [flag for flag, value in (("--strategy", args.strategy), ("--param", args.param or None),
                                          ("--stages", args.stages), ("--batches", args.batches)) if value is not None]
        if given:
            raise unisched.UniSchedError(
                f"--plan fixes the strategy, its parameters and the shape; drop {', '.join(given)} or drop --plan"
            )
    else:
        if args.strategy is None:
            args.strategy = DEFAULT_STRATEGY
        from unisched.plan.command import is_user_strategy, load_user_function
        from unisched.policies.grammar import parse_params, strategy_spec

        args.strategy, params = strategy_spec(args.strategy, parse_params(args.param))
        args.param = [f"{k}={v}" for k, v in params.items()]
        if is_user_strategy(args.strategy):
            load_user_function(args.strategy)  # a missing module or function is refused here


def pick_shape(name: str, workers: int, stages: int | None, batches: int | None, params: dict) -> tuple[int, int]:
    """(S, B) for strategy ``name`` on ``workers``: the given values, else the
    first of a few natural choices that the strategy's constraints accept."""
    from unisched import policies
    from unisched.errors import ShapeError
    from unisched.simulate.simulation import check_size
    from unisched.work import Shape

    stage_options = [stages] if stages is not None else [workers, 2 * workers, max(1, workers // 2)]
    batch_options = [batches] if batches is not None else [2 * workers, workers, 4 * workers]
    for S in stage_options:
        for B in batch_options:
            try:
                check_size(Shape(workers, S, B))  # before building a strategy that large
            except ShapeError:
                continue
            if policies.fits(name, Shape(workers, S, B), params):
                return S, B
    return stage_options[0], batch_options[0]


def make_schedule(args, workers: int):
    """The Simulation (or plan) every rank runs, and its (S, B).  Your own
    strategy (``MODULE:FUNCTION``) runs on S = ``--stages`` (default: the
    workers) and B = ``--batches`` (default: twice the workers)."""
    import unisched
    from unisched import policies

    if args.plan:
        plan = unisched.load_plan(args.plan)
        if plan.shape.num_workers != workers:
            raise unisched.ShapeError(
                f"plan {args.plan} is for {plan.shape.num_workers} workers; launch that many processes, not {workers}"
            )
        return plan.simulate(), plan.shape.num_stages, plan.shape.num_batches
    from unisched.plan.command import is_user_strategy, user_strategy
    from unisched.policies.grammar import label_of, parse_params

    from unisched.simulate.simulation import check_size

    params = parse_params(args.param)
    name = args.strategy or DEFAULT_STRATEGY
    if is_user_strategy(name):
        S = args.stages or workers
        B = args.batches or 2 * workers
        check_size(unisched.Shape(workers, S, B))
        strategy = user_strategy(name, (workers, S, B), params, label=label_of(name, params))
    else:
        S, B = pick_shape(name, workers, args.stages, args.batches, params)
        check_size(unisched.Shape(workers, S, B))  # before building a strategy too large to simulate
        strategy = policies.get(name, num_workers=workers, num_stages=S, num_batches=B, **params)
    return unisched.simulate(workers, S, B, strategy), S, B
