"""What the Trainer's options cost and change, measured side by side in one run.

    python benchmarks/training.py               # 2 gloo ranks on this CPU machine
    python benchmarks/training.py --ranks 4

1. **Recording overhead.**  The same Trainer steps with ``record=True``
   (a measured Timeline every step), ``record=10`` (every 10th step) and
   ``record=False``, in short rounds that alternate between the three so a
   busy machine slows them alike.  Stages: ``--layers`` x (Linear(width) +
   ReLU) per stage, one stage per rank, 64 rows in 8 micro-batches, under
   gpipe and one_f_one_b.  A ratio is the median over rounds of that round's
   ratio of median step times (recorded / unrecorded); the target is <= 1.05.
2. **bf16 against fp32.**  A tiny GPT-2 (the test's configuration: 8 blocks
   of width 16, vocabulary 32, 8 positions) split into one stage per rank
   by ``unisched.split_model``, trained 20 steps under gpipe with AdamW, once
   with ``precision="fp32"`` and once with ``"bf16"`` (CPU autocast), same
   data; the loss curves side by side and the relative difference after 20
   steps (target <= 2%), with the median step times.
3. **One rank against a plain loop.**  One process runs 4 such stages with
   the Trainer (recorded and not) and with a plain gradient-accumulation
   loop over the same stages (8 micro-batches, then one SGD step), in
   alternating rounds: the one-GPU target (<= 1.05), measured on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import unisched
from unisched.execute import Trainer, example
from unisched.execute.launch import check, run_local

from executor import MODES, alternate, make_schedule, make_stages, median_ms, round_ratio  # benchmarks/executor.py

ROWS = 64
MICRO_BATCHES = 8
VOCAB, POSITIONS, WIDTH, HEADS, LAYERS = 32, 8, 16, 2, 8
GPT_ROWS = 16
GPT_STEPS = 20


# ---------------------------------------------------------------------- 1. recording
def _recording(config: dict) -> dict:
    W, width, layers = dist.get_world_size(), config["width"], config["layers"]
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(ROWS, width, generator=g), torch.randn(ROWS, width, generator=g)
    out = {}
    for name in ("gpipe", "one_f_one_b"):
        trainer = Trainer(make_stages(W, width, layers), make_schedule(name, W, W, MICRO_BATCHES),
                          nn.functional.mse_loss, lambda params: torch.optim.SGD(params, lr=0.01))
        recording = _time_recording_calls(trainer)
        trainer.step(x, y)

        def step(record):
            trainer.record = record
            trainer.step(x, y)

        times, _ = alternate({mode: (lambda r=record: step(r)) for mode, record in MODES.items()},
                             config["rounds"], config["steps"], dist.barrier)
        trainer.close()
        step_ms = {mode: median_ms(rounds) for mode, rounds in times.items()}
        spent = [sum(parts) for parts in zip(*recording.values())]
        out[name] = {
            "step_ms": step_ms,
            "ratio": {mode: round_ratio(rounds, times["record=False"])
                      for mode, rounds in times.items() if mode != "record=False"},
            "recording_calls_ms": {part: 1e3 * statistics.median(t) for part, t in recording.items()},
            "recording_share": statistics.median(spent) * 1e3 / step_ms["record=True"],
        }
    return out


def _time_recording_calls(trainer: Trainer) -> dict[str, list[float]]:
    """Per recorded step, the seconds this rank spent in what only a recorded
    step does: the barrier that starts it, gathering the notes to rank 0
    (packing them and posting the gather), and waiting for that gather where
    the next step begins (the time marks themselves are a perf_counter call
    per item)."""
    spent = {"barrier": [], "gather": [], "gather wait": []}
    collective, gather, settle = trainer._collective, trainer._gather_timeline, trainer._settle_gathering

    def timed_collective(run, what):
        start = time.perf_counter()
        value = collective(run, what)
        if what.startswith("the barrier"):
            spent["barrier"].append(time.perf_counter() - start)
        return value

    def timed_gather(st):
        start = time.perf_counter()
        gather(st)
        spent["gather"].append(time.perf_counter() - start)

    def timed_settle():
        outstanding, start = trainer._gathering is not None, time.perf_counter()
        settle()
        if outstanding:
            spent["gather wait"].append(time.perf_counter() - start)

    trainer._collective, trainer._gather_timeline = timed_collective, timed_gather
    trainer._settle_gathering = timed_settle
    return spent


# ---------------------------------------------------------------------- 2. bf16 against fp32
def gpt2() -> nn.Module:
    return example.gpt2(example.gpt2_config(LAYERS, VOCAB, POSITIONS, WIDTH, HEADS))


def gpt2_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return example.counting_tokens(100 + step, GPT_ROWS, VOCAB, POSITIONS)


def _precision() -> dict:
    import warnings

    W = dist.get_world_size()
    out = {}
    for precision in ("fp32", "bf16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stages = unisched.split_model(gpt2(), W, tied="untie")
        trainer = Trainer(stages, make_schedule("gpipe", W, W, 4), example.next_token_loss,
                          lambda params: torch.optim.AdamW(params, lr=1e-2), precision=precision, record=False)
        losses, seconds = [], []
        for step in range(GPT_STEPS):
            start = time.perf_counter()
            losses.append(trainer.step(*gpt2_batch(step)))
            seconds.append(time.perf_counter() - start)
        trainer.close()
        out[precision] = {"losses": losses, "step_ms": 1e3 * statistics.median(seconds[1:])}
    fp32, bf16 = out["fp32"]["losses"][-1], out["bf16"]["losses"][-1]
    out["relative_difference_after_20_steps"] = abs(bf16 - fp32) / fp32
    return out


# ---------------------------------------------------------------------- 3. one rank against a plain loop
def _world_of_one(rank: int, world: int, config: dict) -> dict:
    """One rank runs every stage (the one-GPU target, here on the CPU): the
    Trainer's step, recorded and not, against a plain gradient-accumulation
    loop over the same stages (each micro-batch forward and backward through
    all of them, then one SGD step)."""
    S, width, layers = 4, config["width"], config["layers"]
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(ROWS, width, generator=g), torch.randn(ROWS, width, generator=g)
    one = unisched.simulate(1, S, MICRO_BATCHES, lambda w: unisched.ComputeAndWeightWorkers(0, 0))
    trainer = Trainer(make_stages(S, width, layers), one, nn.functional.mse_loss,
                      lambda params: torch.optim.SGD(params, lr=0.01))
    plain = make_stages(S, width, layers)
    optimizer = torch.optim.SGD([p for stage in plain for p in stage.parameters()], lr=0.01)

    def loop():
        for xb, yb in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)):
            h = xb
            for stage in plain:
                h = stage(h)
            (nn.functional.mse_loss(h, yb) / MICRO_BATCHES).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def recorded():
        trainer.record = True
        trainer.step(x, y)

    def unrecorded():
        trainer.record = False
        trainer.step(x, y)

    systems = {"plain loop": loop, "record=True": recorded, "record=False": unrecorded}
    times, _ = alternate(systems, config["rounds"], config["steps"])
    trainer.close()
    return {
        "step_ms": {name: median_ms(rounds) for name, rounds in times.items()},
        "ratio": {name: round_ratio(rounds, times["plain loop"])
                  for name, rounds in times.items() if name != "plain loop"},
    }


def _bench(rank: int, world: int, config: dict) -> dict | None:
    result = {"recording": _recording(config)}
    if config["gpt2"]:
        result["precision"] = _precision()
    return result if rank == 0 else None


# ---------------------------------------------------------------------- report
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="processes = pipeline stages (default 2)")
    parser.add_argument("--width", type=int, default=1024, help="Linear width (default 1024)")
    parser.add_argument("--layers", type=int, default=2, help="Linear+ReLU layers per stage (default 2)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode per round (default 2)")
    parser.add_argument("--rounds", type=int, default=30, help="rounds alternating the modes (default 30)")
    parser.add_argument("--no-gpt2", action="store_true", help="skip the bf16 / fp32 GPT-2 comparison")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    config = {"width": args.width, "layers": args.layers, "steps": args.steps, "rounds": args.rounds,
              "gpt2": not args.no_gpt2}
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    result = check(run_local(_bench, args.ranks, config, timeout=1200, group_timeout=300))[0]
    result["world_of_one"] = check(run_local(_world_of_one, 1, config, timeout=1200, group_timeout=300))[0]
    result["config"] = {"ranks": args.ranks, "width": args.width, "layers_per_stage": args.layers, "rows": ROWS,
                        "micro_batches": MICRO_BATCHES, "backend": "gloo", "threads_per_rank": 1,
                        "cpus": os.cpu_count(), "load_average_before_after": [load_before, os.getloadavg()[0]],
                        "seconds": time.perf_counter() - started}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.ranks} gloo ranks, {args.layers} x Linear({args.width}) per stage, {ROWS} rows in "
          f"{MICRO_BATCHES} micro-batches; load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print("\nrecording overhead (median step; ratio to record=False, median over alternating rounds; target <= 1.05)")
    for name, row in result["recording"].items():
        ms = row["step_ms"]
        print(f"  {name:12s} " + "  ".join(f"{mode} {ms[mode]:7.2f} ms" for mode in ms)
              + "   " + "  ".join(f"{mode}: {ratio:.3f}" for mode, ratio in row["ratio"].items()))
        calls = row["recording_calls_ms"]
        print(f"  {'':12s} rank 0 in a recorded step: barrier {calls['barrier']:.2f} ms + gathering "
              f"{calls['gather']:.2f} ms + its wait {calls['gather wait']:.2f} ms = "
              f"{100 * row['recording_share']:.1f}% of the step")
    one = result["world_of_one"]
    print("\none rank running 4 stages against a plain gradient-accumulation loop over them (the one-GPU "
          "target, measured on this CPU; target <= 1.05)")
    print("  " + "  ".join(f"{name} {ms:7.2f} ms" for name, ms in one["step_ms"].items()) + "   "
          + "  ".join(f"{name}: {ratio:.3f}" for name, ratio in one["ratio"].items()))
    if "precision" in result:
        p = result["precision"]
        print(f"\nGPT-2 ({LAYERS} blocks, width {WIDTH}) split into {args.ranks} stages, gpipe, AdamW, {GPT_STEPS} steps")
        print("  step   fp32     bf16")
        for step in (0, 4, 9, 14, 19):
            print(f"  {step + 1:4d}  {p['fp32']['losses'][step]:.4f}  {p['bf16']['losses'][step]:.4f}")
        print(f"  after {GPT_STEPS} steps: |bf16 - fp32| / fp32 = {100 * p['relative_difference_after_20_steps']:.2f}% "
              f"(target <= 2%); step {p['fp32']['step_ms']:.1f} ms fp32, {p['bf16']['step_ms']:.1f} ms bf16")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
