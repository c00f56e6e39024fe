"""Peak memory per rank: the executor against torch.distributed.pipelining.

    python benchmarks/memory.py                 # 2 ranks (this 2-core CPU machine), gloo
    python benchmarks/memory.py --width 2048 --layers 4 --json

Same stages (``--layers`` x Linear(width, width), ReLU between, one stage
per rank), same batch (32 rows, 4 micro-batches), same SGD (lr 1e-3), same
number of steps:

- unisched ``gpipe`` vs ``torch.distributed.pipelining.ScheduleGPipe``;
- unisched ``one_f_one_b`` vs ``Schedule1F1B``.

unisched's Trainer gets a stage factory, so a rank builds only the stages it
computes or holds; the torch ``PipelineStage`` is given only its own stage,
built the same way (:func:`unisched.execute.runtime.build_stages`).  Each
system runs in its own freshly launched processes, one per rank, so peaks
do not mix.  Per rank we record the resident set size (RSS) when the rank
starts (the launcher's forkserver has already imported torch), RSS after
set-up (before the first step), and the peak RSS of the process over the
whole run (``getrusage(RUSAGE_SELF).ru_maxrss``).  A forked process's peak
starts at its parent's RSS, so the peak is also reported as growth above the
RSS at start, which is where the two systems differ, and as growth above the
RSS after the schedule is simulated (the executor alone).  Ratios are
unisched / torch; below 1.0 means unisched used less.  For reference, the
simulator's predicted peak number of stashed micro-batch inputs per rank is
shown too (its byte sizes are not given here, so only the counts).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import unisched
from unisched import policies
from unisched.execute import Trainer
from unisched.execute.launch import run_local
from unisched.execute.runtime import build_stages
from unisched.memory import peak_activations

ROWS = 32
MICRO_BATCHES = 4
LR = 1e-3
MiB = 1024 * 1024
KINDS = {"gpipe": "ScheduleGPipe", "one_f_one_b": "Schedule1F1B"}


def make_stage(width: int, layers: int) -> nn.Module:
    """``layers`` Linear(width, width) with a ReLU between each two."""
    modules: list[nn.Module] = []
    for i in range(layers):
        if i:
            modules.append(nn.ReLU())
        modules.append(nn.Linear(width, width))
    return nn.Sequential(*modules)


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def make_schedule(kind: str, W: int, S: int, B: int):
    return unisched.simulate(W, S, B, policies.get(kind, num_workers=W, num_stages=S, num_batches=B))


def rss_now() -> int:
    """Current resident set size in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    """Peak resident set size of this process in bytes (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def batch(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(ROWS, width, generator=g), torch.randn(ROWS, width, generator=g)


# ---------------------------------------------------------------------- one rank, one system
def _unisched(rank: int, world: int, kind: str, config: dict) -> dict:
    start = rss_now()
    width, layers = config["width"], config["layers"]
    x, y = batch(width)
    schedule = make_schedule(kind, world, world, MICRO_BATCHES)
    scheduled = rss_now()
    trainer = Trainer(lambda s: make_stage(width, layers), schedule, nn.functional.mse_loss, sgd, record=False)
    built = [s for s, stage in enumerate(trainer.stages) if stage is not None]
    dist.barrier()
    after_setup = rss_now()
    for _ in range(config["steps"]):
        trainer.step(x, y)
    dist.barrier()
    return {"start": start, "scheduled": scheduled, "after_setup": after_setup, "peak": rss_peak(), "end": rss_now(),
            "stages_built": built}


def _torch(rank: int, world: int, kind: str, config: dict) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    start = rss_now()
    width, layers = config["width"], config["layers"]
    x, y = batch(width)
    module = build_stages(lambda s: make_stage(width, layers), world, only=[rank])[rank]
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule_cls = {"gpipe": ScheduleGPipe, "one_f_one_b": Schedule1F1B}[kind]
    schedule = schedule_cls(stage, n_microbatches=MICRO_BATCHES, loss_fn=nn.functional.mse_loss)
    optimizer = sgd(module.parameters())
    dist.barrier()
    after_setup = rss_now()
    for _ in range(config["steps"]):
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    dist.barrier()
    return {"start": start, "scheduled": start, "after_setup": after_setup, "peak": rss_peak(), "end": rss_now(),
            "stages_built": [rank]}


def measure(fn, world: int, kind: str, config: dict) -> list[dict]:
    """``fn`` on ``world`` freshly launched ranks; their measurements, or an error."""
    results = run_local(fn, world, kind, config, timeout=config["timeout"], group_timeout=300)
    failed = [r for r in results if r.error is not None]
    if failed:
        raise RuntimeError(f"{fn.__name__} {kind}: " + "; ".join(f"rank {r.rank}: {r.error}" for r in failed))
    return [r.value for r in results]


# ---------------------------------------------------------------------- report
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="processes = pipeline stages (default 2)")
    parser.add_argument("--width", type=int, default=4096, help="Linear width (default 4096)")
    parser.add_argument("--layers", type=int, default=2, help="Linear layers per stage (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per system (default 3)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch (default 300)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    W = args.ranks
    config = {"width": args.width, "layers": args.layers, "steps": args.steps, "timeout": args.timeout}
    started = time.perf_counter()
    runs: dict[str, dict] = {}
    for kind, torch_name in KINDS.items():
        runs[kind] = {
            "unisched": measure(_unisched, W, kind, config),
            "torch": measure(_torch, W, kind, config),
            "simulated_peak_stashes": peak_activations(make_schedule(kind, W, W, MICRO_BATCHES).timeline),
        }
    ratios = {
        kind: {
            "peak": [u["peak"] / t["peak"] for u, t in zip(run["unisched"], run["torch"])],
            "growth": [(u["peak"] - u["start"]) / max(t["peak"] - t["start"], 1)
                       for u, t in zip(run["unisched"], run["torch"])],
            "growth_after_schedule": [(u["peak"] - u["scheduled"]) / max(t["peak"] - t["scheduled"], 1)
                                      for u, t in zip(run["unisched"], run["torch"])],
        }
        for kind, run in runs.items()
    }
    stage_bytes = args.layers * (args.width * args.width + args.width) * 4
    result = {
        "runs": runs,
        "ratios": ratios,
        "config": {"ranks": W, "width": args.width, "layers_per_stage": args.layers, "rows": ROWS,
                   "micro_batches": MICRO_BATCHES, "steps": args.steps, "lr": LR, "backend": "gloo",
                   "stage_weight_bytes": stage_bytes, "cpus": os.cpu_count(),
                   "seconds": time.perf_counter() - started},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{W} ranks (gloo, CPU), stages of {args.layers} x Linear({args.width}, {args.width}) "
          f"({stage_bytes / MiB:.0f} MiB of weights each), {ROWS} rows in {MICRO_BATCHES} micro-batches, "
          f"SGD, {args.steps} steps ({result['config']['seconds']:.0f} s; {os.cpu_count()} CPUs)")
    print("\nRSS per rank in MiB: at start / after the schedule is simulated / after set-up / peak "
          "(growth = peak - start)")
    for kind, torch_name in KINDS.items():
        run = runs[kind]
        for system, label in (("unisched", f"unisched {kind}"), ("torch", f"torch {torch_name}")):
            for rank, m in enumerate(run[system]):
                print(f"  {label:<22} rank {rank}  {m['start'] / MiB:5.0f} / {m['scheduled'] / MiB:5.0f} / {m['after_setup'] / MiB:5.0f} / "
                      f"{m['peak'] / MiB:5.0f}   growth {(m['peak'] - m['start']) / MiB:5.0f}   "
                      f"stages built {m['stages_built']}")
    print("\nratios unisched / torch per rank: peak RSS; growth above start; growth above the RSS after the "
          "schedule is simulated\n(the executor alone); <= 1.0 is as small or smaller")
    for kind, torch_name in KINDS.items():
        for rank in range(W):
            print(f"  {kind + ' / ' + torch_name:<28} rank {rank}  peak {ratios[kind]['peak'][rank]:6.3f}   "
                  f"growth {ratios[kind]['growth'][rank]:6.3f}   "
                  f"executor growth {ratios[kind]['growth_after_schedule'][rank]:6.3f}")
    print("\nsimulator's predicted peak stashed micro-batch inputs per rank")
    for kind in KINDS:
        print(f"  {kind:<12} {runs[kind]['simulated_peak_stashes']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
