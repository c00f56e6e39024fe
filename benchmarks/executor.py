"""The executor against PyTorch's own runtimes, side by side in one process group.

    python benchmarks/executor.py                       # the GPT-2 split, 2 ranks (this 2-core CPU machine), gloo
    python benchmarks/executor.py --model gpt2 --ranks 4
    python benchmarks/executor.py --model linear --ranks 4 --width 1024 --layers 2
    python benchmarks/executor.py --profile one_f_one_b  # cProfile of unisched's steps, per rank
    python benchmarks/executor.py --settle-within 0      # also with a waiting thread for every gloo send
    python benchmarks/executor.py --all-reduce-losses    # also with the losses all-reduced, not broadcast

``--model gpt2`` (default): the tiny random GPT-2 of ``examples/gpt2.py``
(width 64, 4 heads, vocabulary 128, 32 positions; 2 blocks per rank),
split by :func:`unisched.split_model`, 4 rows per micro-batch, 8
micro-batches, SGD.  Against torch.distributed.pipelining on the same
stages (``PipelineStage`` per stage a rank holds):

- unisched ``gpipe`` vs ``ScheduleGPipe`` (one stage per rank);
- unisched ``one_f_one_b`` vs ``Schedule1F1B`` (one stage per rank);
- unisched ``interleaved`` and ``ScheduleInterleaved1F1B`` (torch's order,
  rebuilt by :mod:`unisched.policies.torch_interop`) vs torch's
  ``ScheduleInterleaved1F1B`` (two stages per rank, stage s on rank s mod W);
- unisched ``ScheduleZBVZeroBubble`` (torch's order) vs torch's
  ``ScheduleZBVZeroBubble`` (two stages per rank in a V, split backward).

``--model linear``: stages of ``--layers`` x (Linear(width, width) + ReLU),
one per rank, 64 rows in 8 micro-batches: ``gpipe``, ``one_f_one_b`` and
``ddp`` (one micro-batch per rank) vs ``ScheduleGPipe``, ``Schedule1F1B``
and ``DistributedDataParallel``.

Rounds alternate between the systems so that a busy machine slows them
alike; step times are measured on rank 0 between barriers; a ratio is the
median over rounds of that round's ratio of median step times (a paired
comparison, robust to the load drifting between rounds).  Then, in more
alternating rounds with recording on, unisched's costs are calibrated from
every other step and the simulator's predicted latency is compared with the
median measured latency of the steps in between.  Ratios below 1.0 mean
unisched is faster.  With ``--profile NAME`` each rank instead runs
unisched's NAME steps, then torch's matching schedule's, under cProfile
and reports their hot spots (file:function, share of the profiled time).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import unisched
from unisched import policies
from unisched.execute import Trainer, calibrate_costs, predict, runtime
from unisched.execute.launch import check, run_local

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import gpt2 as gpt2_example  # noqa: E402

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


def make_schedule(name: str, W: int, S: int, B: int):
    return unisched.simulate(W, S, B, policies.get(name, num_workers=W, num_stages=S, num_batches=B))


# ---------------------------------------------------------------------- timing, shared by the benchmarks
MODES = {"record=True": True, "record=10": 10, "record=False": False}
"""The recording settings the benchmarks compare: every step, every tenth step, none."""


def alternate(systems: dict, rounds: int, steps: int, sync=lambda: None, warmup: int = 1) -> tuple[dict, dict]:
    """Each system's step times in seconds, the systems taking turns for
    ``rounds`` rounds of ``steps`` steps each, every step timed from a
    ``sync`` to a ``sync``, after ``warmup`` untimed steps of each:
    ``{name: [[a round's steps], ...]}``; and the same for the time until
    each step returned (before its closing sync)."""
    for run in systems.values():
        for _ in range(warmup):
            run()
    times = {name: [] for name in systems}
    returned = {name: [] for name in systems}
    for _ in range(rounds):
        for name, run in systems.items():
            times[name].append([])
            returned[name].append([])
            for _ in range(steps):
                sync()
                start = time.perf_counter()
                run()
                back = time.perf_counter()
                sync()
                times[name][-1].append(time.perf_counter() - start)
                returned[name][-1].append(back - start)
    return times, returned


def median_ms(rounds: list[list[float]]) -> float:
    """The median of every step of every round, in milliseconds."""
    return 1e3 * statistics.median(t for steps in rounds for t in steps)


def round_ratio(rounds: list[list[float]], base: list[list[float]]) -> float:
    """The median over rounds of each round's median step over ``base``'s in that round."""
    return statistics.median(statistics.median(a) / statistics.median(b) for a, b in zip(rounds, base))


# ---------------------------------------------------------------------- the models
class Case(NamedTuple):
    """One comparison: unisched's strategy ``ours`` against torch's ``theirs``
    on ``S`` stages of ``B`` micro-batches (``ddp``: one per rank)."""

    ours: str
    theirs: str
    stages_per_rank: int


LINEAR_CASES = [Case("gpipe", "ScheduleGPipe", 1), Case("one_f_one_b", "Schedule1F1B", 1), Case("ddp", "DDP", 1)]
GPT2_CASES = [
    Case("gpipe", "ScheduleGPipe", 1),
    Case("one_f_one_b", "Schedule1F1B", 1),
    Case("interleaved", "ScheduleInterleaved1F1B", 2),
    Case("ScheduleInterleaved1F1B", "ScheduleInterleaved1F1B", 2),
    Case("ScheduleZBVZeroBubble", "ScheduleZBVZeroBubble", 2),
]
CASES = {"gpt2": GPT2_CASES, "linear": LINEAR_CASES}
GPT2 = {"width": 64, "heads": 4, "vocab": 128, "positions": 32, "rows_per_batch": 4, "attention": "sdpa"}


class Workload:
    """Stages, batch and loss of one model, built the same way on every rank."""

    def __init__(self, model: str, config: dict, W: int):
        self.model, self.config, self.W = model, config, W
        cases = CASES[model]
        only = config.get("only")
        self.cases = [c for c in cases if c.ours in only] if only else cases

    def stages(self, S: int):
        if self.model == "linear":
            return make_stages(S, self.config["width"], self.config["layers"])
        args = SimpleNamespace(**GPT2)
        # untied: torch's runtime keeps no ties, so both sides train the same model
        return unisched.split_model(gpt2_example.gpt2(args, 2 * self.W), S, tied="untie")

    def batch(self):
        if self.model == "linear":
            g = torch.Generator().manual_seed(7)
            width = self.config["width"]
            return torch.randn(ROWS, width, generator=g), torch.randn(ROWS, width, generator=g)
        ids, targets = gpt2_example.data(SimpleNamespace(**GPT2), 0, GPT2["rows_per_batch"] * MICRO_BATCHES)
        return ids.contiguous(), targets.contiguous()  # torch 2.11's PipelineStage refuses strided micro-batches

    def loss_fn(self):
        return nn.functional.mse_loss if self.model == "linear" else gpt2_example.next_token_loss

    def shape(self, case: Case) -> tuple[int, int, int]:
        S = case.stages_per_rank * self.W
        return (self.W, S, self.W) if case.ours == "ddp" else (self.W, S, MICRO_BATCHES)

    def describe(self) -> str:
        if self.model == "linear":
            c = self.config
            return f"stages of {c['layers']} x Linear({c['width']}) + ReLU, {ROWS} rows in {MICRO_BATCHES} micro-batches"
        g = GPT2
        return (f"GPT-2 of {2 * self.W} blocks (width {g['width']}, {g['heads']} heads, vocabulary {g['vocab']}, "
                f"{g['positions']} positions), {g['rows_per_batch']} rows in each of {MICRO_BATCHES} micro-batches")


# ---------------------------------------------------------------------- the systems
class Unisched:
    """unisched's Trainer; a variant waits on gloo sends within ``settle_within`` items
    (``runtime.SETTLE_WITHIN``, read once as the Trainer sets up), or all-reduces the losses where
    one rank computes them all and would broadcast them (``all_reduce_losses``)."""

    def __init__(self, work: Workload, case: Case, settle_within: int | None = None, all_reduce_losses: bool = False):
        W, S, B = work.shape(case)
        self.schedule = make_schedule(case.ours, W, S, B)
        kept = runtime.SETTLE_WITHIN
        if settle_within is not None:
            runtime.SETTLE_WITHIN = settle_within
        try:
            self.trainer = Trainer(work.stages(S), self.schedule, work.loss_fn(), sgd, record=False)
        finally:
            runtime.SETTLE_WITHIN = kept
        if all_reduce_losses:  # no source rank: Trainer._post_losses all-reduces
            self.trainer._loss_source = {forward_only: None for forward_only in self.trainer._loss_source}

    def step(self, x, y):
        self.trainer.step(x, y)


def local_stages(kind: str, rank: int, W: int, S: int) -> list[int]:
    """The stages torch's schedule ``kind`` puts on ``rank``."""
    if S == W:
        return [rank]
    if kind == "ScheduleZBVZeroBubble":
        return [rank, 2 * W - 1 - rank]
    return list(range(rank, S, W))


class TorchPipeline:
    """torch.distributed.pipelining: a PipelineStage per stage the rank holds."""

    def __init__(self, work: Workload, case: Case):
        from torch.distributed import pipelining

        self.rank = dist.get_rank()
        W, S, B = work.shape(case)
        modules = work.stages(S)
        self.held = local_stages(case.theirs, self.rank, W, S)
        # a group of its own, as the Trainer has, connected by a collective before its first
        # point-to-point transfer (on gloo in torch 2.11 one before fails: "Pair is not connected")
        group = dist.new_group()
        dist.barrier(group=group)
        stages = [pipelining.PipelineStage(modules[s], s, S, torch.device("cpu"), group=group) for s in self.held]
        cls = getattr(pipelining, case.theirs)
        self.schedule = cls(stages if len(stages) > 1 else stages[0], n_microbatches=B, loss_fn=work.loss_fn())
        self.optimizer = sgd([p for s in self.held for p in modules[s].parameters()])
        self.first, self.last = 0 in self.held, S - 1 in self.held

    def step(self, x, y):
        if self.first and self.last:
            self.schedule.step(x, target=y, losses=[])
        elif self.first:
            self.schedule.step(x)
        elif self.last:
            self.schedule.step(target=y, losses=[])
        else:
            self.schedule.step()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class TorchDDP:
    def __init__(self, work: Workload, case: Case):
        from torch.nn.parallel import DistributedDataParallel

        self.rank, self.world = dist.get_rank(), work.W
        self.model = DistributedDataParallel(nn.Sequential(*work.stages(work.W)))
        self.optimizer = sgd(self.model.parameters())

    def step(self, x, y):
        rows = x.shape[0] // self.world
        part = slice(self.rank * rows, (self.rank + 1) * rows)
        nn.functional.mse_loss(self.model(x[part]), y[part]).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def theirs(work: Workload, case: Case):
    return TorchDDP(work, case) if case.theirs == "DDP" else TorchPipeline(work, case)


# ---------------------------------------------------------------------- one rank
def variants(config: dict) -> list[tuple[str, dict]]:
    """(name suffix, Unisched options) of each run of unisched: the default, then the variants asked for."""
    return ([("", {})] + [(f" settle {k}", {"settle_within": k}) for k in config["settle_within"]]
            + ([(" losses all-reduced", {"all_reduce_losses": True})] if config["all_reduce_losses"] else []))


def _bench(rank: int, world: int, model: str, config: dict) -> dict | None:
    work = Workload(model, config, world)
    x, y = work.batch()
    systems = {}
    for case in work.cases:
        for variant, options in variants(config):
            systems[f"unisched {case.ours}{variant}"] = Unisched(work, case, **options)
        if f"torch {case.theirs}" not in systems:  # two of ours may share a counterpart: build it once
            systems[f"torch {case.theirs}"] = theirs(work, case)
    times, _ = alternate({name: (lambda s=system: s.step(x, y)) for name, system in systems.items()},
                         config["rounds"], config["steps"], dist.barrier)

    calibration = {case.ours: [] for case in work.cases}
    held_out = {case.ours: [] for case in work.cases}
    for _ in range(config["prediction_rounds"]):
        for case in work.cases:
            trainer = systems[f"unisched {case.ours}"].trainer
            trainer.record = True
            for step in range(2 * config["steps"]):
                trainer.step(x, y)
                (calibration if step % 2 == 0 else held_out)[case.ours].append(trainer.last_timeline)
            trainer.record = False
    if rank != 0:
        return None
    predictions = {}
    for case in work.cases if config["prediction_rounds"] else []:
        costs = calibrate_costs(calibration[case.ours])
        predicted = predict(systems[f"unisched {case.ours}"].schedule, costs).latency
        measured = statistics.median(t.latency for t in held_out[case.ours])
        predictions[case.ours] = {"predicted_ms": 1e3 * predicted, "measured_ms": 1e3 * measured,
                                  "error": abs(predicted - measured) / measured}
    ratios = {f"{case.ours}{variant} / {case.theirs}": round_ratio(times[f"unisched {case.ours}{variant}"],
                                                                   times[f"torch {case.theirs}"])
              for case in work.cases for variant, _ in variants(config)}
    return {
        "step_ms": {name: median_ms(rounds) for name, rounds in times.items()},
        "ratios": ratios,
        "prediction": predictions,
    }


def _profile(rank: int, world: int, model: str, config: dict, name: str) -> dict:
    """unisched's ``name`` steps, then torch's matching schedule's, under
    cProfile on this rank: the functions that take the most time of their
    own, and unisched's functions by time including what they call, as
    shares of the profiled time."""
    work = Workload(model, config, world)
    case = next((c for c in work.cases if c.ours == name), None) or Case(name, "", 1)
    x, y = work.batch()
    out = {"rank": rank}
    systems = {"unisched": Unisched(work, case)}
    if case.theirs:
        systems["torch"] = theirs(work, case)
    for label, system in systems.items():
        system.step(x, y)
        profiler = cProfile.Profile()
        dist.barrier()
        start = time.perf_counter()
        profiler.enable()
        for _ in range(config["rounds"] * config["steps"]):
            system.step(x, y)
        profiler.disable()
        out[label] = _hot_spots(profiler, time.perf_counter() - start, config)
    return out


def _hot_spots(profiler: cProfile.Profile, total: float, config: dict) -> dict:
    steps = config["rounds"] * config["steps"]

    def where(key) -> str:
        file, _, function = key
        return f"{os.path.relpath(file) if file.startswith(os.getcwd()) else os.path.basename(file)}:{function}"

    rows = [(where(key), tt, ct, calls) for key, (_, calls, tt, ct, _) in pstats.Stats(profiler).stats.items()]
    own = sorted(rows, key=lambda r: -r[1])[:config["top"]]
    ours = sorted((r for r in rows if "unisched/" in r[0]), key=lambda r: -r[2])[:config["top"]]
    return {"step_ms": 1e3 * total / steps,
            "own": [(w, tt / total, calls // steps) for w, tt, _, calls in own],
            "cumulative": [(w, ct / total, calls // steps) for w, _, ct, calls in ours]}


# ---------------------------------------------------------------------- report
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("gpt2", "linear"), default="gpt2", help="gpt2 (default) or linear")
    parser.add_argument("--ranks", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--width", type=int, default=1024, help="Linear width (default 1024)")
    parser.add_argument("--layers", type=int, default=2, help="Linear+ReLU layers per stage (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per system per round (default 3)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds alternating the systems (default 10)")
    parser.add_argument("--prediction-rounds", type=int, default=3,
                        help="rounds of recorded steps for the simulator's prediction (default 3; 0: none)")
    parser.add_argument("--profile", metavar="STRATEGY", help="profile unisched's STRATEGY on every rank instead")
    parser.add_argument("--top", type=int, default=15, help="functions listed per rank with --profile (default 15)")
    parser.add_argument("--only", nargs="+", metavar="STRATEGY",
                        help="only these of unisched's strategies, each with its torch counterpart")
    parser.add_argument("--settle-within", nargs="+", type=int, default=[], metavar="K",
                        help="also run unisched with SETTLE_WITHIN = K (0: a waiting thread for every gloo send), "
                             "side by side with the default")
    parser.add_argument("--all-reduce-losses", action="store_true",
                        help="also run unisched with the losses all-reduced where one rank computes them all and "
                             "broadcasts them by default, side by side with the default")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    W = args.ranks
    known = [c.ours for c in CASES[args.model]]
    if args.only and set(args.only) - set(known):
        parser.error(f"--only takes {', '.join(known)} for --model {args.model}; "
                     f"not {', '.join(sorted(set(args.only) - set(known)))}")
    config = {"width": args.width, "layers": args.layers, "steps": args.steps, "rounds": args.rounds,
              "prediction_rounds": args.prediction_rounds, "top": args.top, "only": args.only,
              "settle_within": args.settle_within, "all_reduce_losses": args.all_reduce_losses}
    work = Workload(args.model, config, W)
    if args.profile:
        return show_profile(check(run_local(_profile, W, args.model, config, args.profile, timeout=900,
                                            group_timeout=300)), args)
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    result = check(run_local(_bench, W, args.model, config, timeout=1800, group_timeout=300))[0]
    result["config"] = {"model": work.describe(), "ranks": W, "micro_batches": MICRO_BATCHES, "backend": "gloo",
                        "threads_per_rank": 1, "cpus": os.cpu_count(),
                        "load_average_before_after": [load_before, os.getloadavg()[0]],
                        "seconds": time.perf_counter() - started}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    c = result["config"]
    print(f"{W} ranks (gloo, CPU, 1 thread each), {c['model']} ({c['seconds']:.0f} s; {c['cpus']} CPUs, load "
          f"average {c['load_average_before_after'][0]:.1f} before, {c['load_average_before_after'][1]:.1f} after)")
    print("\nmedian step time")
    for name, value in result["step_ms"].items():
        print(f"  {name:<44} {value:8.1f} ms")
    print("\nratios (unisched / torch, median over rounds of each round's ratio; <= 1.0 is as fast or faster)")
    for name, value in result["ratios"].items():
        print(f"  {name:<60} {value:6.3f}")
    if result["prediction"]:
        print("\nsimulated (costs calibrated on earlier steps) vs measured latency")
        for name, row in result["prediction"].items():
            print(f"  {name:<24} predicted {row['predicted_ms']:7.1f} ms  measured {row['measured_ms']:7.1f} ms  "
                  f"error {row['error']:.1%}")
    return 0


def show_profile(ranks: list[dict], args) -> int:
    if args.json:
        print(json.dumps(ranks, indent=2))
        return 0
    for r in ranks:
        for label in ("unisched", "torch"):
            if label not in r:
                continue
            p = r[label]
            print(f"rank {r['rank']}: {label} ({args.profile}), {p['step_ms']:.1f} ms per profiled step")
            print("  own time (share of the profiled time, calls per step)")
            for where, share, calls in p["own"]:
                print(f"    {share:6.1%}  {calls:6d}  {where}")
            if p["cumulative"]:
                print("  unisched functions, time including callees")
                for where, share, calls in p["cumulative"]:
                    print(f"    {share:6.1%}  {calls:6d}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
