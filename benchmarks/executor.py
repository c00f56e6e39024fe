"""The executor against PyTorch's own runtimes, side by side in one process group.

    python benchmarks/executor.py               # 2 ranks (this 2-core CPU machine), gloo
    python benchmarks/executor.py --ranks 4 --width 1024 --layers 2

Same stages (``--layers`` x (Linear(width, width) + ReLU) per stage, one
stage per rank), same batch (64 rows, 8 micro-batches), same SGD:

- unisched ``gpipe`` vs ``torch.distributed.pipelining.ScheduleGPipe``;
- unisched ``one_f_one_b`` vs ``Schedule1F1B``;
- unisched ``ddp`` (one micro-batch per rank) vs ``DistributedDataParallel``.

Rounds alternate between the systems so that a busy machine slows them
alike; step times are measured on rank 0 between barriers; a ratio is the
median over rounds of that round's ratio of median step times (a paired
comparison, robust to the load drifting between rounds).  Then, in more alternating rounds with recording on,
unisched's costs are calibrated from every other step and the simulator's
predicted latency is compared with the median measured latency of the steps
in between.  Ratios below 1.0 mean unisched is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import unisched
from unisched import policies
from unisched.execute import Trainer, calibrate_costs, predict
from unisched.execute.launch import check, run_local

ROWS = 64
MICRO_BATCHES = 8
LR = 0.01


def make_stages(num_stages: int, width: int, layers: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
        for _ in range(num_stages)
    ]


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def make_schedules(W: int) -> dict:
    """The three unisched schedules: pipelines of W stages over 8 micro-batches, ddp with one per rank."""
    shapes = {"gpipe": (W, MICRO_BATCHES), "one_f_one_b": (W, MICRO_BATCHES), "ddp": (W, W)}
    return {
        name: unisched.simulate(W, S, B, policies.get(name, num_workers=W, num_stages=S, num_batches=B))
        for name, (S, B) in shapes.items()
    }


# ---------------------------------------------------------------------- the systems
class Unisched:
    def __init__(self, timeline, W, width, layers):
        self.trainer = Trainer(make_stages(W, width, layers), timeline, nn.functional.mse_loss, sgd, record=False)

    def step(self, x, y):
        self.trainer.step(x, y)


class TorchPipeline:
    """torch.distributed.pipelining with one stage per rank."""

    def __init__(self, kind: str, W: int, width: int, layers: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.rank = dist.get_rank()
        self.module = make_stages(W, width, layers)[self.rank]
        stage = PipelineStage(self.module, self.rank, W, torch.device("cpu"))
        schedule = {"gpipe": ScheduleGPipe, "one_f_one_b": Schedule1F1B}[kind]
        self.schedule = schedule(stage, n_microbatches=MICRO_BATCHES, loss_fn=nn.functional.mse_loss)
        self.optimizer = sgd(self.module.parameters())
        self.last = self.rank == W - 1

    def step(self, x, y):
        if self.rank == 0:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=y, losses=[])
        else:
            self.schedule.step()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class TorchDDP:
    def __init__(self, W: int, width: int, layers: int):
        from torch.nn.parallel import DistributedDataParallel

        self.rank, self.world = dist.get_rank(), W
        self.model = DistributedDataParallel(nn.Sequential(*make_stages(W, width, layers)))
        self.optimizer = sgd(self.model.parameters())

    def step(self, x, y):
        rows = x.shape[0] // self.world
        part = slice(self.rank * rows, (self.rank + 1) * rows)
        nn.functional.mse_loss(self.model(x[part]), y[part]).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------- one rank
def _bench(rank: int, world: int, config: dict) -> dict | None:
    W, width, layers = world, config["width"], config["layers"]
    schedules = make_schedules(W)
    timelines = {name: schedule.timeline for name, schedule in schedules.items()}
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(ROWS, width, generator=g), torch.randn(ROWS, width, generator=g)
    systems = {
        "unisched gpipe": Unisched(timelines["gpipe"], W, width, layers),
        "torch ScheduleGPipe": TorchPipeline("gpipe", W, width, layers),
        "unisched one_f_one_b": Unisched(timelines["one_f_one_b"], W, width, layers),
        "torch Schedule1F1B": TorchPipeline("one_f_one_b", W, width, layers),
        "unisched ddp": Unisched(timelines["ddp"], W, width, layers),
        "torch DDP": TorchDDP(W, width, layers),
    }
    times: dict[str, list[list[float]]] = {name: [] for name in systems}
    for system in systems.values():
        system.step(x, y)
    for _ in range(config["rounds"]):
        for name, system in systems.items():
            times[name].append([])
            for _ in range(config["steps"]):
                dist.barrier()
                start = time.perf_counter()
                system.step(x, y)
                dist.barrier()
                times[name][-1].append(time.perf_counter() - start)

    calibration = {name: [] for name in schedules}
    held_out = {name: [] for name in schedules}
    for _ in range(config["rounds"]):
        for name in schedules:
            trainer = systems[f"unisched {name}"].trainer
            trainer.record = True
            for step in range(2 * config["steps"]):
                trainer.step(x, y)
                (calibration if step % 2 == 0 else held_out)[name].append(trainer.last_timeline)
            trainer.record = False
    predictions = {}
    if rank == 0:
        for name, schedule in schedules.items():
            costs = calibrate_costs(calibration[name])
            predicted = predict(schedule, costs).latency
            measured = statistics.median(t.latency for t in held_out[name])
            predictions[name] = {"predicted_ms": 1e3 * predicted, "measured_ms": 1e3 * measured,
                                 "error": abs(predicted - measured) / measured}
    if rank != 0:
        return None
    pairs = {"gpipe / ScheduleGPipe": ("unisched gpipe", "torch ScheduleGPipe"),
             "one_f_one_b / Schedule1F1B": ("unisched one_f_one_b", "torch Schedule1F1B"),
             "ddp / DDP": ("unisched ddp", "torch DDP")}
    ratios = {
        label: statistics.median(statistics.median(a) / statistics.median(b) for a, b in zip(times[ours], times[theirs]))
        for label, (ours, theirs) in pairs.items()
    }
    return {
        "step_ms": {name: 1e3 * statistics.median(t for rnd in rounds for t in rnd) for name, rounds in times.items()},
        "ratios": ratios,
        "prediction": predictions,
    }


# ---------------------------------------------------------------------- report
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="processes = pipeline stages (default 2)")
    parser.add_argument("--width", type=int, default=1024, help="Linear width (default 1024)")
    parser.add_argument("--layers", type=int, default=2, help="Linear+ReLU layers per stage (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per system per round (default 3)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds alternating the systems (default 10)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    W = args.ranks
    config = {"width": args.width, "layers": args.layers, "steps": args.steps, "rounds": args.rounds}
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    result = check(run_local(_bench, W, config, timeout=900, group_timeout=300))[0]
    ms = result["step_ms"]
    result["config"] = {"ranks": W, "width": args.width, "layers_per_stage": args.layers, "rows": ROWS,
                        "micro_batches": MICRO_BATCHES, "backend": "gloo", "threads_per_rank": 1, "cpus": os.cpu_count(),
                        "load_average_before_after": [load_before, os.getloadavg()[0]],
                        "seconds": time.perf_counter() - started}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    c = result["config"]
    print(f"{W} ranks (gloo, CPU, 1 thread each), stages of {args.layers} x Linear({args.width}) + ReLU, "
          f"{ROWS} rows in {MICRO_BATCHES} micro-batches ({c['seconds']:.0f} s; {c['cpus']} CPUs, load average "
          f"{c['load_average_before_after'][0]:.1f} before, {c['load_average_before_after'][1]:.1f} after)")
    print("\nmedian step time")
    for name, value in ms.items():
        print(f"  {name:<22} {value:8.1f} ms")
    print("\nratios (unisched / torch, median over rounds of each round's ratio; <= 1.0 is as fast or faster)")
    for name, value in result["ratios"].items():
        print(f"  {name:<28} {value:6.3f}")
    print("\nsimulated (costs calibrated on earlier steps) vs measured latency")
    for name, row in result["prediction"].items():
        print(f"  {name:<12} predicted {row['predicted_ms']:7.1f} ms  measured {row['measured_ms']:7.1f} ms  "
              f"error {row['error']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
