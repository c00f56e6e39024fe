"""3D layouts on thousands of GPUs: how long simulating one step takes.

    python benchmarks/layouts.py [--repeat N]

A GPT-3-sized model (96 layers, hidden 12288, sequence 2048, micro-batch 1)
with 1F1B on DGX H100-like nodes (the ``dgx_h100`` preset):

1. TP 8 x PP 16 x DP 128 on 16,384 GPUs, 32 micro-batches per replica:
   wall time of ``simulate_layout`` (building the strategy and costs,
   simulating replica 0 by symmetry, its all-reduces over all replicas).
2. The same split with DP 8 on 1,024 GPUs, simulated both ways in this run,
   by symmetry and every replica, to show they agree to the last bit and
   what the symmetry saves.
"""

from __future__ import annotations

import argparse
import statistics
import time

from unisched import policies
from unisched.simulate.layout import Layout, Model, simulate_layout

MODEL = Model.transformer(layers=96, hidden=12288, sequence=2048)
TOPOLOGY = "dgx_h100"


def timed(layout: Layout, micro_batches: int, symmetry: bool = True):
    """(seconds, result) of one simulate_layout, strategy building included."""
    begin = time.perf_counter()
    pipeline = policies.get("one_f_one_b", num_workers=layout.pipeline, num_stages=layout.pipeline,
                            num_batches=micro_batches)
    result = simulate_layout(layout, TOPOLOGY, pipeline, MODEL, symmetry=symmetry)
    return time.perf_counter() - begin, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is shown")
    args = parser.parse_args()

    big = Layout(data=128, pipeline=16, tensor=8)
    runs = [timed(big, 32) for _ in range(args.repeat)]
    seconds = statistics.median(t for t, _ in runs)
    result = runs[0][1]
    print(f"{big} on {big.devices:,} GPUs, 32 micro-batches, 1F1B, {TOPOLOGY}:")
    print(f"  simulated in {seconds:.3f} s (median of {args.repeat}; target <= 10 s)")
    print(f"  step {result.step_time:.4f} s, bubble {result.simulation.bubble_fraction:.1%}, "
          f"memory per GPU {result.memory_per_gpu / 2**30:.1f} GiB")
    print(f"  {result.method}")

    small = Layout(data=8, pipeline=16, tensor=8)
    symmetric = statistics.median(timed(small, 32)[0] for _ in range(args.repeat))
    every_time, every = timed(small, 32, symmetry=False)
    _, one = timed(small, 32)
    same = one.step_time == every.step_time and one.memory_per_gpu == every.memory_per_gpu
    print(f"\n{small} on {small.devices:,} GPUs, both ways in this run:")
    print(f"  by symmetry   {symmetric:8.3f} s   step {one.step_time:.6f} s")
    print(f"  every replica {every_time:8.3f} s   step {every.step_time:.6f} s   "
          f"({every_time / symmetric:.1f}x the time; {'identical' if same else 'DIFFERENT'} step and memory)")


if __name__ == "__main__":
    main()
