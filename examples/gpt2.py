"""Train a Hugging Face GPT-2, split into pipeline stages by unisched.split_model, under any strategy or plan.

    torchrun --nproc-per-node 4 examples/gpt2.py --strategy one_f_one_b --check
    torchrun --nproc-per-node 4 examples/gpt2.py --strategy interleaved --layers 16
    torchrun --nproc-per-node 4 examples/gpt2.py --strategy cuckoo --balance time --timeline step.html
    torchrun --nproc-per-node 4 examples/gpt2.py --plan plan.json      # from `unisched plan --out plan.json`
    torchrun --nproc-per-node 4 examples/gpt2.py --steps 2000 --log-every 100 --checkpoint ckpt --checkpoint-every 500
    torchrun --nproc-per-node 4 examples/gpt2.py --steps 1000 --resume ckpt   # 1000 more from the latest checkpoint

The model is built in code from a GPT2Config (random weights, nothing is
downloaded; dropout off, so that a backward recomputed on another rank sees
the same forward) and learns counting sequences of tokens.  The heart of it::

    model = GPT2LMHeadModel(config)
    stages = unisched.split_model(model, S)                 # wte+wpe | blocks | ln_f+lm_head
    trainer = unisched.Trainer(stages, schedule, loss_fn, lambda p: torch.optim.AdamW(p, lr=3e-3))
    del model, stages                                       # each rank keeps only its own stages
    loss = trainer.step(token_ids, next_tokens)

GPT-2 ties lm_head to wte; on different stages the two cannot stay one
tensor, so the last stage holds a copy (``stages.ties``) and the Trainer
keeps the copies one weight: equal at the start, each given the sum of
their gradients before every optimizer step, as the tied model gets.

Every ``--log-every`` steps rank 0 prints the loss, step time, samples and
tokens per second and the model's TFLOP/s (6 x its parameters outside
the embeddings per token, as ``num_parameters(exclude_embeddings=True)``
counts them); ``--peak-tflops`` (the peak of all ranks together) adds the
model FLOPs utilisation.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
from typing import Sequence

import torch
from torch import nn

from unisched.errors import UniSchedError
from unisched.execute.arguments import (
    add_check_arguments,
    add_long_run_arguments,
    add_numerics_arguments,
    add_schedule_arguments,
    make_schedule,
    positive_float,
    positive_int,
)
from unisched.execute import example
from unisched.execute.example import (
    check_line,
    check_report,
    check_status,
    difference_from_one_process,
    next_token_loss,
    run_ranks,
    summary_line,
    train_steps,
    trainer_options,
)


def gpt2(args: argparse.Namespace, layers: int) -> nn.Module:
    """The same tiny GPT-2 on every call (seed 0)."""
    return example.gpt2(example.gpt2_config(layers, args.vocab, args.positions, args.width, args.heads, args.attention))


def flops_per_token(args: argparse.Namespace, layers: int) -> float:
    """Training FLOPs per token by the usual estimate (Kaplan et al. 2020):
    6 x the parameters outside the embeddings, as the model counts them
    (``num_parameters(exclude_embeddings=True)``); built on the meta
    device, so nothing is allocated."""
    with torch.device("meta"):
        model = gpt2(args, layers)
    return 6.0 * model.num_parameters(exclude_embeddings=True)


def data(args: argparse.Namespace, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (rows, positions) and the next token of each: counting with a stride, two batches in turn."""
    return example.counting_tokens(1000 + step % 2, rows, args.vocab, args.positions)


def split(args: argparse.Namespace, S: int, layers: int):
    """The stages of a fresh model.  Measured block times differ between
    ranks, so with ``--balance time`` rank 0 measures and the others take its
    weights: every rank must cut the model the same way."""
    import torch.distributed as dist

    import unisched

    balance = args.balance
    if balance == "time":
        weights: list = [None]
        if dist.get_rank() == 0:
            example = data(args, 0, args.rows_per_batch)[0]
            weights = [unisched.split_model(gpt2(args, layers), S, balance="time", example=example).weights]
        dist.broadcast_object_list(weights, src=0)
        balance = weights[0]
    return unisched.split_model(gpt2(args, layers), S, balance=balance)


def make_optimizer(args: argparse.Namespace):
    """The optimizer factory ``params -> Optimizer`` the Trainer calls on each rank."""
    if args.optimizer == "sgd":
        lr = 0.1 if args.lr is None else args.lr
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
    lr = 3e-3 if args.lr is None else args.lr
    return lambda params: torch.optim.AdamW(params, lr=lr)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_schedule_arguments(p)
    p.add_argument("--layers", type=positive_int, help="transformer blocks, at least one per stage (default 2 per stage)")
    p.add_argument("--width", type=positive_int, default=64, help="n_embd (default 64)")
    p.add_argument("--heads", type=positive_int, default=4, help="n_head (default 4)")
    p.add_argument("--vocab", type=positive_int, default=128, help="vocabulary size (default 128)")
    p.add_argument("--positions", type=positive_int, default=32, help="tokens per row (default 32)")
    p.add_argument("--attention", choices=("eager", "sdpa"), default="sdpa", help="attn_implementation (default sdpa)")
    p.add_argument("--balance", choices=("parameters", "uniform", "time"), default="parameters",
                   help="how split_model weighs blocks (default parameters)")
    p.add_argument("--rows-per-batch", type=positive_int, default=4, help="rows per micro-batch (default 4)")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="adamw (default) or sgd with momentum 0.9")
    p.add_argument("--lr", type=positive_float, help="learning rate (default 3e-3 for adamw, 0.1 for sgd)")
    p.add_argument("--timeout", type=positive_float, default=300.0, help="seconds any wait or step may take (default 300)")
    p.add_argument("--timeline", metavar="FILE", help="save the last measured step (.html, .png, .svg, .json, .txt)")
    p.add_argument("--json", action="store_true", help="rank 0 prints one JSON object")
    add_numerics_arguments(p)
    add_long_run_arguments(p, default_steps=10)
    add_check_arguments(p)
    p.add_argument("--peak-tflops", type=positive_float, metavar="TFLOPS",
                   help="peak TFLOP/s of all ranks together, to report the model FLOPs utilisation (MFU)")
    return p


def check_model(args: argparse.Namespace) -> None:
    """Refuse a model shape GPT-2 cannot build, before any rank starts."""
    if args.width % args.heads:
        raise UniSchedError(f"--width {args.width} is not a multiple of --heads {args.heads}: each head "
                            f"takes an equal share of the width")


def main(argv: Sequence[str] | None = None) -> int:
    return run_ranks(parser(), argv, train, check_model)


def train(args: argparse.Namespace, cleanup) -> int:
    """Split a fresh GPT-2, train it under the schedule, report on rank 0."""
    import torch.distributed as dist

    import unisched

    schedule, S, B = make_schedule(args, dist.get_world_size())
    layers = args.layers or 2 * S
    stages = split(args, S, layers)
    described, weights = repr(stages), stages.weights
    optimizer = make_optimizer(args)
    trainer = cleanup.enter_context(contextlib.closing(
        unisched.Trainer(stages, schedule, next_token_loss, optimizer, timeout=args.timeout, **trainer_options(args))))
    del stages  # the Trainer holds this rank's stages; the others' weights are freed
    batches = functools.partial(data, args)
    run = train_steps(trainer, batches, args, B * args.rows_per_batch, tokens_per_row=args.positions,
                      flops_per_token=flops_per_token(args, layers), peak_tflops=args.peak_tflops, quiet=args.json)
    report = {
        "strategy": getattr(schedule.strategy, "name", args.strategy) if not args.plan else f"plan {args.plan}",
        "shape": [trainer.world_size, S, B],
        "split": described,
        "layers": layers,
        **run.summary(),
    }
    if args.check:
        state = trainer.gather_state_dict()
        if trainer.rank == 0:
            # the same split (the same block weights) of a fresh model
            fresh = unisched.split_model(gpt2(args, layers), S, balance=weights)
            report.update(check_report(difference_from_one_process(
                args, state, fresh, next_token_loss, optimizer, batches, B, run.last_step), args.tolerance))
    if trainer.rank == 0 and args.timeline:
        trainer.last_timeline.save(args.timeline)
        report["timeline"] = args.timeline
    if trainer.rank == 0:
        show(args, report)
    return check_status(report)


def show(args, report: dict) -> None:
    if args.json:
        print(json.dumps(report))
        return
    W, S, B = report["shape"]
    print(f"{report['strategy']} on {W} ranks, {S} stages, {B} micro-batches: GPT-2 of {report['layers']} blocks, "
          f"{report['split']}")
    print(f"loss {report['losses'][0]:.4f} -> {report['losses'][-1]:.4f}, median step {report['step_ms_median']:.1f} ms")
    print(summary_line(report))
    if "check" in report:
        print(check_line(report["check"]))
    if "timeline" in report:
        print(f"measured timeline saved to {report['timeline']}")
    if report["checkpoints"]:
        print(f"checkpoints saved: {', '.join(report['checkpoints'])}")


if __name__ == "__main__":
    raise SystemExit(main())
