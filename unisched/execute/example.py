"""Train a small MLP or transformer under any registered strategy (or a plan file).

Launch one process per worker::

    torchrun --nproc-per-node 4 examples/train.py --strategy gpipe
    torchrun --nproc-per-node 4 -m unisched.execute.example --strategy zb_h1 --model transformer
    unisched run --nproc 4 --strategy one_f_one_b --check

Every rank builds the same stages (same seed), the same schedule and the same
synthetic data; the Trainer does the rest.  Rank 0 prints the loss, step
time and throughput every ``--log-every`` steps, the measured step next to
the simulator's prediction with costs calibrated from the first steps, and,
with ``--check``, the largest difference between the trained weights and one
process training the same stages on the same micro-batches for as many steps.
``--checkpoint DIR`` saves checkpoints there, ``--resume DIR`` continues from
the latest exactly (the data of step k is the same in every run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from unisched.execute.arguments import (
    CHECK_FAILED,
    MODEL_WIDTHS,
    MODELS,
    TRANSFORMER_HEADS,
    add_training_arguments,
    check_model_width,
    check_training_arguments,
    log_interval,
    make_schedule,
)


# ---------------------------------------------------------------------- models
def mlp_stages(num_stages: int, width: int = 64, classes: int = 10) -> list[nn.Module]:
    """S stages of Linear + ReLU; the last maps to ``classes`` logits."""
    stages = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(num_stages - 1)]
    stages.append(nn.Linear(width, classes))
    return stages


class _Block(nn.Module):
    """A transformer stage: optional token embedding in front, optional head behind."""

    def __init__(self, width: int, heads: int, vocab: int, seq: int, first: bool, last: bool):
        super().__init__()
        self.embed = nn.Embedding(vocab, width) if first else None
        self.position = nn.Parameter(torch.randn(seq, width) * 0.02) if first else None
        self.layer = nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x) + self.position[: x.shape[1]]
        x = self.layer(x)
        return self.head(x) if self.head is not None else x


def transformer_stages(num_stages: int, width: int = 32, heads: int = 4, vocab: int = 16, seq: int = 12) -> list[nn.Module]:
    """S transformer layers, the first embedding tokens, the last predicting the next one (dropout off,
    so a backward on another rank recomputes exactly the same forward)."""
    return [_Block(width, heads, vocab, seq, s == 0, s == num_stages - 1) for s in range(num_stages)]


def build(model: str, num_stages: int, width: int | None = None, seed: int = 0):
    """Stages, loss function and a data maker ``step -> (inputs, targets)`` for a full batch of ``rows``
    (two batches in turn, so that the loss visibly falls within a few steps); ``width`` is the
    hidden width (default: the model's own, ``MODEL_WIDTHS``)."""
    torch.manual_seed(seed)
    width = MODEL_WIDTHS.get(model) if width is None else width
    if model == "mlp":
        stages = mlp_stages(num_stages, width)
        teacher = torch.randn(width, 10, generator=torch.Generator().manual_seed(seed + 1))

        def data(step: int, rows: int):
            g = torch.Generator().manual_seed(1000 + step % 2)
            x = torch.randn(rows, width, generator=g)
            return x, (x @ teacher).argmax(dim=1)

        return stages, nn.functional.cross_entropy, data
    if model == "transformer":
        stages = transformer_stages(num_stages, width=width, heads=TRANSFORMER_HEADS)

        def data(step: int, rows: int):
            return counting_tokens(1000 + step % 2, rows, vocab=16, positions=12)

        return stages, next_token_loss, data
    raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")


def counting_tokens(seed: int, rows: int, vocab: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (rows, positions) and the next token of each: sequences
    counting from a random start with a stride of 1 to 3, modulo ``vocab``."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (rows, 1), generator=g)
    stride = torch.randint(1, 4, (rows, 1), generator=g)
    tokens = (start + stride * torch.arange(positions + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (rows, positions, vocab) against the next tokens (rows, positions)."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt2_config(layers: int, vocab: int, positions: int, width: int, heads: int, attention: str = "sdpa",
                **options):
    """A Hugging Face GPT2Config of these sizes with dropout off, so that a
    backward recomputed on another rank sees the same forward (``options``:
    more GPT2Config fields, e.g. ``tie_word_embeddings``)."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=vocab, n_positions=positions, n_embd=width, n_layer=layers, n_head=heads,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                      attn_implementation=attention, **options)


def gpt2(config) -> nn.Module:
    """A GPT2LMHeadModel of ``config`` with random weights, the same on every call (seed 0)."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


TOKENS_PER_ROW = {"mlp": None, "transformer": 12}
"""What a row of each model's data is in tokens (None: not tokens)."""


def trainer_options(args: argparse.Namespace) -> dict:
    """The Trainer's numerics options the run names (precision, clipping,
    the LR schedule over all its steps); ``train_one_process`` takes the same."""
    options = {}
    if args.precision is not None:
        options["precision"] = args.precision
    if args.clip_grad_norm is not None:
        options["clip_grad_norm"] = args.clip_grad_norm
    if args.lr_schedule == "cosine" or args.warmup_steps:
        options["scheduler"] = lr_schedule(args.lr_schedule or "constant", args.warmup_steps or 0,
                                           first_step(args) + args.steps)
    return options


def lr_schedule(name: str, warmup: int, total: int) -> Callable:
    """A scheduler factory: the learning rate rises linearly over ``warmup``
    steps, then stays (``constant``) or follows a cosine down to 0 at step ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if name == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def first_step(args: argparse.Namespace) -> int:
    """Steps taken before this run: those of the checkpoint ``--resume`` names, else 0."""
    if not args.resume:
        return 0
    from unisched.execute.checkpoint import latest_checkpoint, saved_extra

    found = latest_checkpoint(args.resume)
    return _saved_step(found, saved_extra(found))


def make_optimizer(args: argparse.Namespace) -> Callable:
    """The optimizer factory ``params -> Optimizer`` the Trainer calls on each rank."""
    if args.optimizer == "adam":
        lr = 0.01 if args.lr is None else args.lr
        return lambda params: torch.optim.Adam(params, lr=lr)
    lr = 0.2 if args.lr is None else args.lr
    return lambda params: torch.optim.SGD(params, lr=lr)


# ---------------------------------------------------------------------- the run
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    return run_ranks(parser(), argv, _run, check_model_width)


def run_ranks(p: argparse.ArgumentParser, argv: Sequence[str] | None,
              train: Callable[[argparse.Namespace, contextlib.ExitStack], int],
              check: Callable[[argparse.Namespace], None] | None = None) -> int:
    """The frame of every example: refuse bad options (argparse's error,
    exit 2; ``check`` raises a UniSchedError for the example's own), join the
    process group, run ``train(args, cleanup)`` (it
    enters its Trainer into ``cleanup``, which closes it), print a
    UniSchedError as one line naming the rank (exit 2), and leave the
    process group.  Returns ``train``'s exit status."""
    args = p.parse_args(argv)
    import torch.distributed as dist

    import unisched
    from unisched.execute.process_group import ensure_process_group

    try:
        check_training_arguments(args)
        if check is not None:
            check(args)
    except unisched.UniSchedError as error:
        p.error(str(error))
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(lambda: dist.destroy_process_group() if dist.is_initialized() else None)
        try:
            if not dist.is_initialized():
                ensure_process_group(args.timeout)
            status = train(args, cleanup)
            dist.barrier()
            return status
        except unisched.UniSchedError as error:
            rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
            sys.stderr.write(f"rank {rank}: error: {error}\n")  # one write: ranks' lines do not run together
            sys.stderr.flush()
            return 2


def _run(args: argparse.Namespace, cleanup: contextlib.ExitStack) -> int:
    """Train the model ``--model`` names, report on rank 0; 1 if ``--check`` failed."""
    import torch.distributed as dist

    from unisched.execute import Trainer

    schedule, S, B = make_schedule(args, dist.get_world_size())
    stages, loss_fn, data = build(args.model, S, args.model_width)
    trainer = cleanup.enter_context(contextlib.closing(
        Trainer(stages, schedule, loss_fn, make_optimizer(args), timeout=args.timeout, **trainer_options(args))))
    report = _train(args, trainer, schedule, data, B)
    if args.check:
        state = trainer.gather_state_dict()
        if trainer.rank == 0:
            fresh, _, _ = build(args.model, S, args.model_width)
            difference = difference_from_one_process(args, state, fresh, loss_fn, make_optimizer(args), data, B,
                                                     report["steps"])
            report.update(check_report(difference, args.tolerance))
    if trainer.rank == 0:
        _print(args, report, schedule)
    return check_status(report)


def check_report(difference: float, tolerance: float) -> dict:
    """What ``--check`` adds to a run's report: the largest difference from one process, and
    whether it is within ``tolerance``."""
    return {"check": {"max_difference": difference, "tolerance": tolerance, "passed": difference <= tolerance}}


def check_status(report: dict) -> int:
    """The exit status of a run whose report (on rank 0) may hold a ``--check``: 1 where it
    failed, said on stderr too (:data:`~unisched.execute.arguments.CHECK_FAILED`)."""
    if report.get("check", {}).get("passed", True):
        return 0
    sys.stderr.write(CHECK_FAILED + "\n")
    return 1


def check_line(check: dict) -> str:
    """``check passed: largest difference from one process 3.1e-08 (tolerance 1e-05)``."""
    verdict = "passed" if check["passed"] else "FAILED"
    return (f"check {verdict}: largest difference from one process {check['max_difference']:.2e} "
            f"(tolerance {check['tolerance']:g})")


def _train(args, trainer, schedule, data, B: int) -> dict:
    from unisched.execute import calibrate_costs, predict
    from unisched.execute.measure import UnmeasuredBandwidth

    run = train_steps(trainer, data, args, B * args.rows_per_batch, tokens_per_row=TOKENS_PER_ROW[args.model],
                      quiet=args.json)
    timelines = run.timelines
    report = {
        "strategy": getattr(schedule.strategy, "name", str(args.strategy)),
        "model": args.model,
        "shape": [trainer.world_size, trainer.program.num_stages, B],
        **run.summary(),
    }
    if trainer.rank == 0 and len(timelines) >= 3:
        with warnings.catch_warnings():  # it predicts the schedule measured: what that moves is priced
            warnings.simplefilter("ignore", UnmeasuredBandwidth)
            costs = calibrate_costs(timelines[1 : len(timelines) // 2 + 1])
        measured = [t.latency for t in timelines[len(timelines) // 2 + 1 :]]
        predicted = predict(schedule, costs).latency
        report["measured_ms"] = 1e3 * sorted(measured)[len(measured) // 2]
        report["predicted_ms"] = 1e3 * predicted
        report["prediction_error"] = abs(predicted - report["measured_ms"] / 1e3) / (report["measured_ms"] / 1e3)
    if trainer.rank == 0 and args.timeline:
        trainer.last_timeline.save(args.timeline)
        report["timeline"] = args.timeline
    return report


@dataclass
class RunLog:
    """What a run's steps gave: per step the loss, seconds and measured
    timeline (None off rank 0), one entry per log line, the checkpoints saved."""

    first_step: int
    rows: int
    tokens_per_row: int | None = None
    flops_per_token: float | None = None
    peak_tflops: float | None = None
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    timelines: list = field(default_factory=list)
    log: list[dict] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)

    @property
    def last_step(self) -> int:
        """Steps taken in all, counting those before a resume."""
        return self.first_step + len(self.losses)

    def entry(self, since: int) -> dict:
        """The log line for the steps from index ``since`` of this run to now:
        their mean loss and step time, and what they processed per second."""
        losses, seconds = self.losses[since:], self.seconds[since:]
        entry = {"step": self.last_step, "loss": sum(losses) / len(losses),
                 "step_ms": 1e3 * sum(seconds) / len(seconds), **self.throughput(seconds)}
        self.log.append(entry)
        return entry

    def throughput(self, seconds: Sequence[float]) -> dict:
        """Samples per second over steps that took ``seconds``; for a model of
        tokens, tokens per second; for one that says its FLOPs per token, the
        model TFLOP/s, and their share of ``peak_tflops`` (all ranks) when given."""
        samples = self.rows * len(seconds) / sum(seconds)
        out = {"samples_per_s": samples}
        if self.tokens_per_row:
            out["tokens_per_s"] = samples * self.tokens_per_row
            if self.flops_per_token:
                out["model_tflops"] = out["tokens_per_s"] * self.flops_per_token / 1e12
                if self.peak_tflops:
                    out["mfu"] = out["model_tflops"] / self.peak_tflops
        return out

    def summary(self) -> dict:
        """The run as the examples report it (the throughput leaves out the first step, a warm-up)."""
        return {"first_step": self.first_step, "steps": self.last_step, "losses": self.losses,
                "step_ms_median": median_ms(self.seconds), **self.throughput(self.seconds[1:] or self.seconds),
                "log": self.log, "checkpoints": self.checkpoints}


def train_steps(trainer, data: Callable[[int, int], tuple], args: argparse.Namespace, rows: int, *,
                tokens_per_row: int | None = None, flops_per_token: float | None = None,
                peak_tflops: float | None = None, quiet: bool = False) -> RunLog:
    """The training loop of every example: continue from ``args.resume``,
    take ``args.steps`` steps on ``data(step, rows)`` (``step`` counts from
    the start of training, so a resumed run sees the data the unbroken one
    would), log every :func:`~unisched.execute.arguments.log_interval`
    steps (rank 0 prints unless ``quiet``), save a checkpoint every
    ``args.checkpoint_every`` steps and after the last."""
    first = _resume(trainer, args, rows) if args.resume else 0
    run = RunLog(first, rows, tokens_per_row, flops_per_token, peak_tflops)
    every, logged = log_interval(args), 0
    end = run.first_step + args.steps
    settings = training_settings(args, end)
    for step in range(run.first_step, end):
        x, y = data(step, rows)
        start = time.perf_counter()
        run.losses.append(trainer.step(x, y))
        run.seconds.append(time.perf_counter() - start)
        # read on rank 0 only: elsewhere it is None, and reading it would wait for the step's gather
        run.timelines.append(trainer.last_timeline if trainer.rank == 0 else None)
        done = step + 1
        if done % every == 0 or done == end:
            entry = run.entry(logged)
            logged = len(run.losses)
            if trainer.rank == 0 and not quiet:
                print(log_line(entry, end), flush=True)
        if args.checkpoint and (done == end or (args.checkpoint_every and done % args.checkpoint_every == 0)):
            run.checkpoints.append(str(_save(trainer, args.checkpoint, done, rows, settings)))
    return run


def log_line(entry: dict, end: int) -> str:
    """One line of a run's log: ``step 20/100 loss 1.2345 12.3 ms/step 650 samples/s 7800 tokens/s``."""
    width = len(str(end))
    line = (f"step {entry['step']:>{width}}/{end}  loss {entry['loss']:.4f}  {entry['step_ms']:.1f} ms/step  "
            f"{entry['samples_per_s']:.0f} samples/s")
    if "tokens_per_s" in entry:
        line += f"  {entry['tokens_per_s']:.0f} tokens/s"
    if "mfu" in entry:
        line += f"  {entry['model_tflops']:.3g} TFLOP/s  MFU {entry['mfu']:.1%}"
    elif "model_tflops" in entry:
        line += f"  {entry['model_tflops']:.3g} TFLOP/s"
    return line


def _resume(trainer, args: argparse.Namespace, rows: int) -> int:
    """Load the latest checkpoint at ``args.resume``; the number of steps it
    follows.  With ``--check`` the run will replay those steps from the start
    on batches of this run's ``rows`` at this run's learning rate, so a
    checkpoint whose steps took other batches or another rate is refused (the
    check would fail however right the run), alike on every rank: each reads
    the checkpoint's ``extra``."""
    from unisched.execute.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, saved_layout

    found = latest_checkpoint(args.resume)
    stages, trained_with = saved_layout(found)  # refused here in the command's terms, alike on every rank
    if stages != trainer.program.num_stages:
        raise CheckpointError(f"checkpoint {found} holds {stages} stage{'s' * (stages != 1)} but this run has {trainer.program.num_stages}: "
                              f"resume with -S {stages} (and the model flags it was trained with)")
    if trained_with is not None and trained_with.lower() != args.optimizer:  # --optimizer names the class
        raise CheckpointError(f"checkpoint {found} was trained with {trained_with}, this run with --optimizer "
                              f"{args.optimizer}: resume with --optimizer {trained_with.lower()}")
    optimizer = trainer.optimizer
    chosen = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups] if optimizer is not None else []
    extra = load_checkpoint(trainer, found) or {}
    first = _saved_step(found, extra)
    _learning_rates_from_flags(trainer, chosen, first)
    if not args.check:
        return first
    saved = extra.get("rows")
    if saved is not None and saved != rows:
        raise CheckpointError(
            f"--check replays the steps before checkpoint {found} on this run's batches of {rows} rows, but they "
            f"trained on {saved}: resume with the -B and --rows-per-batch they had to check, or drop --check"
        )
    theirs, ours = extra.get("training", extra.get("learning_rate")), training_settings(args, first + args.steps)
    # keys a checkpoint of an earlier version does not keep are not compared
    differ = [] if theirs is None else [key for key in sorted(set(theirs) | RATE_KEYS) if theirs.get(key) != ours.get(key)]
    if differ:
        def said(settings: dict, key: str) -> str:
            return "default" if settings.get(key) is None and key in settings else str(settings.get(key, "none"))

        told = "; ".join(f"{key} {said(theirs, key)} there, {said(ours, key)} here" for key in differ)
        raise CheckpointError(
            f"--check replays the steps before checkpoint {found} as this run trains, but they trained otherwise "
            f"({told}): resume with the --lr, --lr-schedule, --warmup-steps, --precision and --clip-grad-norm they "
            f"had (a cosine that ended at the checkpoint cannot be extended and checked), or drop --check"
        )
    return first


RATE_KEYS = {"optimizer", "lr", "schedule", "warmup", "ends_at"}
"""The keys of :func:`training_settings` that say the learning rate (every checkpoint keeps them)."""


def training_settings(args: argparse.Namespace, end: int) -> dict:
    """What decides how a run trains at every step, as a checkpoint's ``extra`` keeps it: the
    optimizer and ``--lr`` (None: the example's default for it), the schedule and its warm-up,
    for a cosine the step it ends at (this run's last, counting those before), the precision
    and the clipping norm (None: fp32, no clipping)."""
    schedule = args.lr_schedule or "constant"
    settings = {"optimizer": args.optimizer, "lr": args.lr, "schedule": schedule, "warmup": args.warmup_steps or 0,
                "precision": args.precision or "fp32", "clip_grad_norm": args.clip_grad_norm}
    if schedule == "cosine":
        settings["ends_at"] = end
    return settings


def _learning_rates_from_flags(trainer, chosen: list[float], first: int) -> None:
    """After a resume, the learning rate follows this run's flags (``--lr``, ``--lr-schedule``,
    ``--warmup-steps``) at step ``first``, not the checkpoint's last rate: ``chosen`` is each
    parameter group's rate as the run's optimizer factory set it.  The checkpoint restored the
    optimizer's hyper-parameters too, so a run resumed after a cosine schedule ended would
    otherwise train at rate 0, and ``--lr`` would be ignored.  The examples' schedules are
    :func:`lr_schedule`'s LambdaLR; a checkpoint without a schedule's state starts this run's
    schedule at ``first``."""
    optimizer, scheduler = trainer.optimizer, trainer.scheduler
    if optimizer is None:
        return
    rates = chosen
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        if scheduler.last_epoch == 0:  # the checkpoint held no schedule
            scheduler.last_epoch = first
        scheduler.base_lrs = list(chosen)
        rates = [base * factor(scheduler.last_epoch) for base, factor in zip(chosen, scheduler.lr_lambdas)]
    elif scheduler is not None:
        return  # a schedule of another kind keeps what the checkpoint restored
    for group, base, rate in zip(optimizer.param_groups, chosen, rates):
        group["lr"] = rate
        if "initial_lr" in group:
            group["initial_lr"] = base


def _saved_step(path, extra: dict | None) -> int:
    from unisched.execute.checkpoint import CheckpointError

    step = (extra or {}).get("step")
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"checkpoint {path} does not say how many steps it follows (it was saved without "
                              f"extra={{'step': N}}); resume from one a run's --checkpoint saved")
    return step


def _save(trainer, directory: str, step: int, rows: int, settings: dict):
    from unisched.execute.checkpoint import save_checkpoint, step_checkpoint

    return save_checkpoint(trainer, step_checkpoint(directory, step),
                           extra={"step": step, "rows": rows, "training": settings})


def median_ms(seconds: Sequence[float]) -> float:
    """The median step in milliseconds, leaving out the first (a warm-up) when there are others."""
    kept = sorted(seconds[1:] or seconds)
    return 1e3 * kept[len(kept) // 2]


def difference_from_one_process(args: argparse.Namespace, state: dict, stages, loss_fn, optimizer, data,
                                B: int, steps: int) -> float:
    """Largest |difference| between the trained weights ``state`` and one
    process training ``stages`` (fresh, built as the run's were) on each of
    ``steps`` steps' batches from the start, with the run's options.  The one
    process accumulates the run's ``B`` micro-batches, a computation that knows
    nothing of the schedule but rounds as the run does: rounding depends on
    which rows a matmul sums (1e-2 under bf16 on the whole batch, against
    3e-8 micro-batched), and Adam's normalised steps magnify even fp32's
    (3e-5 after two steps of the GPT-2 example, against 0)."""
    from unisched.execute import train_one_process

    batches = (data(step, B * args.rows_per_batch) for step in range(steps))
    _, reference = train_one_process(stages, loss_fn, optimizer, batches, micro_batches=B, **trainer_options(args))
    return max(float((state[k] - reference[k]).abs().max()) for k in reference)


def _print(args, report: dict, schedule) -> None:
    if args.json:
        print(json.dumps(report))
        return
    W, S, B = report["shape"]
    print(f"{report['strategy']} on {W} ranks, {S} stages, {B} micro-batches ({report['model']}): "
          f"loss {report['losses'][0]:.4f} -> {report['losses'][-1]:.4f}, median step {report['step_ms_median']:.1f} ms")
    print(summary_line(report))
    if "measured_ms" in report:
        print(f"measured step latency {report['measured_ms']:.1f} ms, simulator with calibrated costs "
              f"{report['predicted_ms']:.1f} ms (error {report['prediction_error']:.1%})")
    if "check" in report:
        print(check_line(report["check"]))
    if "timeline" in report:
        print(f"measured timeline saved to {report['timeline']}")
    if report["checkpoints"]:
        print(f"checkpoints saved: {', '.join(report['checkpoints'])}")
    if not math.isfinite(report["losses"][-1]):
        print("the loss is not finite", file=sys.stderr)


def summary_line(report: dict) -> str:
    """The run's steps and throughput, in one line."""
    resumed = f" (resumed after step {report['first_step']})" if report["first_step"] else ""
    line = f"steps {report['steps']}{resumed}: {report['samples_per_s']:.0f} samples/s"
    if "tokens_per_s" in report:
        line += f", {report['tokens_per_s']:.0f} tokens/s"
    if "model_tflops" in report:
        line += f", {report['model_tflops']:.3g} model TFLOP/s"
    if "mfu" in report:
        line += f" (MFU {report['mfu']:.1%})"
    return line + (" after the first step" if report["steps"] - report["first_step"] > 1 else " (its only step)")


if __name__ == "__main__":
    raise SystemExit(main())
