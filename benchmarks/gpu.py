"""The Trainer's step on one GPU against a plain gradient-accumulation loop, side by side in one run.

    python benchmarks/gpu.py                 # needs CUDA; NCCL, world size 1
    python benchmarks/gpu.py --json
    python benchmarks/gpu.py --device cpu --widths 256 --rounds 2   # the same comparison on the CPU (gloo)

One process (NCCL, world size 1) runs 4 stages of ``--layers`` x
(Linear(width) + ReLU), 256 rows in 8 micro-batches, SGD:

(``--rows``: more rows per step, so that the GPU, not the host, sets the pace)

- **plain loop**: each micro-batch forward through the 4 stages, its loss
  divided by 8 and backward, then one optimizer step; the step's loss is
  read back once (``float(sum)``), as the Trainer returns it;
- **the Trainer** with the 4 stages on one worker, ordered as ``looped_bfs``
  (every micro-batch's forward through a stage before the next stage, as
  gpipe) and as ``looped`` (one micro-batch forward and backward at a time,
  as the plain loop), with
  ``record=True`` (a measured Timeline from CUDA events every step),
  ``record=10`` and ``record=False``.

Systems alternate in short rounds; each step is timed on the host clock
from a synchronized GPU to a synchronized GPU.  A ratio is the median over
rounds of that round's median step over the plain loop's.  The target
is <= 1.05, recorded and unrecorded.  ``host ms`` is the time
until ``step`` returns before the final synchronization: when it is below
the step time the GPU, not Python, sets the pace.

The same at a width so small that the GPU does almost nothing (``--tiny``)
gives the Python cost per item: (Trainer step - plain step) / 64 items.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

from unisched.execute import Trainer
from unisched.execute.launch import check, run_local

from executor import MODES, alternate, make_schedule, make_stages, median_ms, round_ratio  # benchmarks/executor.py

STAGES, ROWS, MICRO_BATCHES = 4, 256, 8
SCHEDULES = ("looped_bfs", "looped")  # on one worker: every forward first (as gpipe), or one micro-batch at a time


def _systems(width: int, layers: int, device: torch.device, rows: int = ROWS) -> tuple[dict, list[Trainer]]:
    """name -> one step of that system, on the same data."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, width, generator=g).to(device)
    y = torch.randn(rows, width, generator=g).to(device)
    plain = [stage.to(device) for stage in make_stages(STAGES, width, layers)]
    optimizer = torch.optim.SGD([p for stage in plain for p in stage.parameters()], lr=1e-3)

    def loop():
        total = torch.zeros((), device=device)
        for xb, yb in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)):
            h = xb
            for stage in plain:
                h = stage(h)
            loss = nn.functional.mse_loss(h, yb) / MICRO_BATCHES
            loss.backward()
            total += loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(total)

    systems, trainers = {"plain loop": loop}, []
    for name in SCHEDULES:
        trainer = Trainer(make_stages(STAGES, width, layers), make_schedule(name, 1, STAGES, MICRO_BATCHES),
                          nn.functional.mse_loss, lambda params: torch.optim.SGD(params, lr=1e-3))
        trainers.append(trainer)
        for mode, record in MODES.items():
            def step(trainer=trainer, record=record):
                trainer.record = record
                return trainer.step(x, y)
            systems[f"{name} {mode}"] = step
    return systems, trainers


def _measure(systems: dict, rounds: int, steps: int, synchronize) -> dict:
    # three warm-up steps each: allocator, cuBLAS handles, the Trainer's first-step agreement
    times, host = alternate(systems, rounds, steps, synchronize, warmup=3)
    base = times["plain loop"]
    return {
        "step_ms": {n: median_ms(rs) for n, rs in times.items()},
        "host_ms": {n: median_ms(rs) for n, rs in host.items()},
        "ratio": {n: round_ratio(rs, base) for n, rs in times.items() if n != "plain loop"},
    }


def _bench(rank: int, world: int, config: dict) -> dict:
    if config["device"] == "cuda":
        device, synchronize = torch.device("cuda", torch.cuda.current_device()), torch.cuda.synchronize
        name = torch.cuda.get_device_name(device)
    else:
        device, synchronize, name = torch.device("cpu"), lambda: None, f"CPU ({torch.get_num_threads()} threads)"
    torch.backends.cuda.matmul.allow_tf32 = config["tf32"]
    out = {"device": name, "torch": torch.__version__}
    for width in config["widths"]:
        systems, trainers = _systems(width, config["layers"], device, config["rows"])
        out[f"width {width}"] = _measure(systems, config["rounds"], config["steps"], synchronize)
        trainer = trainers[0]
        trainer.record = True
        trainer.step(*[torch.randn(config["rows"], width, device=device) for _ in range(2)])
        timeline = trainer.last_timeline
        out[f"width {width}"]["looped_bfs busy ms (recorded timeline)"] = 1e3 * float((timeline.end - timeline.start).sum())
        out[f"width {width}"]["looped_bfs makespan ms (recorded timeline)"] = 1e3 * float(timeline.end.max() - timeline.start.min())
        for t in trainers:
            t.close()
    return out


def _diagnose(rank: int, world: int, config: dict) -> str:
    """Where the host waits for the GPU inside a step (CUDA's sync debug mode,
    with the Python stack of each wait), and where a host-bound step's time
    goes (cProfile over ``--rounds`` steps of each Trainer system)."""
    import cProfile
    import io
    import pstats
    import traceback
    import warnings

    device = torch.device("cuda", torch.cuda.current_device())
    systems, trainers = _systems(config["widths"][-1], config["layers"], device, config["rows"])
    for run in systems.values():
        run()
        run()
    torch.cuda.synchronize()
    report = io.StringIO()
    seen = []
    shown = warnings.showwarning
    warnings.showwarning = lambda message, *rest: seen.append(
        (str(message).splitlines()[0], traceback.format_stack(limit=8)[:-1]))
    for name, run in systems.items():
        seen.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            run()
            torch.cuda.set_sync_debug_mode("default")
        print(f"== {name}: {len(seen)} synchronizing calls in one step", file=report)
        for message, stack in seen[:6]:
            print("  " + message, file=report)
            print("".join("    " + line for frame in stack[-4:] for line in frame.splitlines(True)), file=report)
    warnings.showwarning = shown
    for name, run in systems.items():
        if name.endswith("record=True") or name.endswith("record=False"):
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(config["rounds"]):
                run()
            profiler.disable()
            print(f"== cProfile, {config['rounds']} steps of {name}", file=report)
            pstats.Stats(profiler, stream=report).sort_stats("tottime").print_stats(18)
    for t in trainers:
        t.close()
    return report.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[4096, 1024], help="Linear widths (default 4096 1024)")
    parser.add_argument("--tiny", action="store_true", help="also width 64: the Python cost per item")
    parser.add_argument("--rows", type=int, default=ROWS,
                        help=f"rows per step, split in {MICRO_BATCHES} micro-batches (default {ROWS})")
    parser.add_argument("--layers", type=int, default=2, help="Linear+ReLU layers per stage (default 2)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds alternating the systems (default 10)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per system per round (default 5)")
    parser.add_argument("--tf32", action="store_true", help="allow TF32 matrix products (default: full fp32)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (NCCL; the default) or cpu (gloo: a dry run of the same comparison)")
    parser.add_argument("--diagnose", action="store_true",
                        help="instead: where a step waits for the GPU, and a profile of the host's time "
                             "(at the last width, --rounds steps)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no GPU here: --device cpu runs the same comparison on the CPU")
    widths = args.widths + ([64] if args.tiny else [])
    config = {"widths": widths, "rows": args.rows, "layers": args.layers, "rounds": args.rounds, "steps": args.steps,
              "tf32": args.tf32, "device": args.device}
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.diagnose:
        if args.device != "cuda":
            parser.error("--diagnose needs CUDA")
        print(check(run_local(_diagnose, 1, config, backend=backend, timeout=1200, group_timeout=300))[0])
        return 0
    result = check(run_local(_bench, 1, config, backend=backend, timeout=1200, group_timeout=300))[0]
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['device']}, torch {result['torch']}: 4 stages of {args.layers} x Linear(width), {args.rows} rows "
          f"in {MICRO_BATCHES} micro-batches, {backend} world size 1, {'TF32' if args.tf32 else 'fp32'}")
    for width in widths:
        row = result[f"width {width}"]
        print(f"\nwidth {width}  (recorded looped_bfs timeline: {row['looped_bfs busy ms (recorded timeline)']:.2f} ms of work in "
              f"{row['looped_bfs makespan ms (recorded timeline)']:.2f} ms)")
        print(f"  {'system':26s} {'step ms':>8s} {'host ms':>8s} {'ratio':>6s}")
        for name, ms in row["step_ms"].items():
            ratio = row["ratio"].get(name)
            print(f"  {name:26s} {ms:8.2f} {row['host_ms'][name]:8.2f} {'' if ratio is None else f'{ratio:6.3f}'}")
        if width == 64:
            plain = row["step_ms"]["plain loop"]
            items = 2 * STAGES * MICRO_BATCHES
            print("  Python per item: " + "  ".join(
                f"{name} {1e3 * (ms - plain) / items:.0f} us" for name, ms in row["step_ms"].items() if name != "plain loop"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
