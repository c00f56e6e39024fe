"""Train a small MLP or transformer under any registered strategy (or a plan file).

Launch one process per worker::

    torchrun --nproc-per-node 4 examples/train.py --strategy gpipe
    torchrun --nproc-per-node 4 -m unisched.execute.example --strategy zb_h1 --model transformer
    unisched run --nproc 4 --strategy one_f_one_b --check

Every rank builds the same stages (same seed), the same schedule and the same
synthetic data; the Trainer does the rest.  Rank 0 prints the loss per step,
the measured step next to the simulator's prediction with costs calibrated
from the first steps, and, with ``--check``, the largest difference between
the trained weights and one process training the same stages on the whole
batch.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Callable, Sequence

import torch
from torch import nn

from unisched.execute.arguments import MODELS, add_training_arguments, check_training_arguments, make_schedule


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


def build(model: str, num_stages: int, width: int = 64, seed: int = 0):
    """Stages, loss function and a data maker ``step -> (inputs, targets)`` for a full batch of ``rows``
    (two batches in turn, so that the loss visibly falls within a few steps)."""
    torch.manual_seed(seed)
    if model == "mlp":
        stages = mlp_stages(num_stages, width)
        teacher = torch.randn(width, 10, generator=torch.Generator().manual_seed(seed + 1))

        def data(step: int, rows: int):
            g = torch.Generator().manual_seed(1000 + step % 2)
            x = torch.randn(rows, width, generator=g)
            return x, (x @ teacher).argmax(dim=1)

        return stages, nn.functional.cross_entropy, data
    if model == "transformer":
        stages = transformer_stages(num_stages, width=max(4, width // 4 * 4) if width != 64 else 32)

        def data(step: int, rows: int):
            g = torch.Generator().manual_seed(1000 + step % 2)
            start = torch.randint(0, 16, (rows, 1), generator=g)
            stride = torch.randint(1, 4, (rows, 1), generator=g)
            tokens = (start + stride * torch.arange(13)) % 16
            return tokens[:, :-1], tokens[:, 1:]

        def loss(logits, targets):
            return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

        return stages, loss, data
    raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")


# ---------------------------------------------------------------------- the run
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    import torch.distributed as dist

    import unisched

    try:
        check_training_arguments(args)
    except unisched.UniSchedError as error:
        p.error(str(error))
    from unisched.execute import Trainer

    trainer = None
    try:
        if not dist.is_initialized():
            from unisched.execute.runtime import ensure_process_group

            ensure_process_group(args.timeout)
        workers = dist.get_world_size()
        schedule, S, B = make_schedule(args, workers)
        stages, loss_fn, data = build(args.model, S, args.model_width)
        trainer = Trainer(stages, schedule, loss_fn, lambda p: torch.optim.SGD(p, lr=args.lr), timeout=args.timeout)
        report = _train(args, trainer, schedule, data, B)
        if args.check:
            state = trainer.gather_state_dict()
            if trainer.rank == 0:
                difference = _check(args, state, S, B, data)
                report["max_difference_vs_one_process"] = difference
                report["check"] = {"max_difference": difference, "tolerance": args.tolerance,
                                   "passed": difference <= args.tolerance}
        if trainer.rank == 0:
            _print(args, report, schedule)
        dist.barrier()
        return 0 if report.get("check", {}).get("passed", True) else 1
    except unisched.UniSchedError as error:
        print(f"rank {dist.get_rank() if dist.is_initialized() else '?'}: error: {error}", file=sys.stderr)
        return 2
    finally:
        if trainer is not None:
            trainer.close()
            del trainer
        if dist.is_initialized():
            dist.destroy_process_group()


def _train(args, trainer, schedule, data, B: int) -> dict:
    from unisched.execute import calibrate_costs, predict

    losses, seconds, timelines = train_steps(trainer, data, args.steps, B * args.rows_per_batch, quiet=args.json)
    report = {
        "strategy": getattr(schedule.strategy, "name", str(args.strategy)),
        "model": args.model,
        "shape": [trainer.world_size, trainer.program.num_stages, B],
        "losses": losses,
        "step_ms_median": median_ms(seconds),
    }
    if trainer.rank == 0 and len(timelines) >= 3:
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


def train_steps(trainer, data: Callable[[int, int], tuple], steps: int, rows: int,
                quiet: bool = False) -> tuple[list[float], list[float], list]:
    """``steps`` training steps on ``data(step, rows)``: each step's loss,
    seconds and measured timeline (None off rank 0); rank 0 prints each
    step unless ``quiet``.  The training loop of every example."""
    losses, seconds, timelines = [], [], []
    for step in range(steps):
        x, y = data(step, rows)
        start = time.perf_counter()
        losses.append(trainer.step(x, y))
        seconds.append(time.perf_counter() - start)
        timelines.append(trainer.last_timeline)
        if trainer.rank == 0 and not quiet:
            print(f"step {step}: loss {losses[-1]:.4f}  {seconds[-1] * 1e3:.1f} ms", flush=True)
    return losses, seconds, timelines


def median_ms(seconds: Sequence[float]) -> float:
    """The median step in milliseconds, leaving out the first (a warm-up) when there are others."""
    kept = sorted(seconds[1:] or seconds)
    return 1e3 * kept[len(kept) // 2]


def _check(args, state: dict, S: int, B: int, data) -> float:
    """Largest |difference| between the trained weights and one process doing the same on the whole batch."""
    from unisched.execute import train_one_process

    stages, loss_fn, _ = build(args.model, S, args.model_width)
    batches = (data(step, B * args.rows_per_batch) for step in range(args.steps))
    _, reference = train_one_process(stages, loss_fn, lambda params: torch.optim.SGD(params, lr=args.lr), batches)
    return max(float((state[k] - reference[k]).abs().max()) for k in reference)


def _print(args, report: dict, schedule) -> None:
    if args.json:
        print(json.dumps(report))
        return
    W, S, B = report["shape"]
    print(f"{report['strategy']} on {W} ranks, {S} stages, {B} micro-batches ({report['model']}): "
          f"loss {report['losses'][0]:.4f} -> {report['losses'][-1]:.4f}, median step {report['step_ms_median']:.1f} ms")
    if "measured_ms" in report:
        print(f"measured step latency {report['measured_ms']:.1f} ms, simulator with calibrated costs "
              f"{report['predicted_ms']:.1f} ms (error {report['prediction_error']:.1%})")
    if "check" in report:
        check = report["check"]
        verdict = "passed" if check["passed"] else "FAILED"
        print(f"check {verdict}: largest difference from one process {check['max_difference']:.2e} "
              f"(tolerance {check['tolerance']:g})")
    if "timeline" in report:
        print(f"measured timeline saved to {report['timeline']}")
    if not math.isfinite(report["losses"][-1]):
        print("the loss is not finite", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
