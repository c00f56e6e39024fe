"""Simulator speed: unisched's heap-based greedy against a plain frontier scan
of the same greedy (the seed notebook's algorithm: every step looks at every
batch's frontier item), side by side in one run.

    python benchmarks/simulator.py [--repeat N] [--skip-million]

Prints work items per second for GPipe and looped PP at W = S = 64, B = 128,
the speed-up over the frontier scan (after checking that both produce the
same timeline), and the time and peak memory of one million work items
(W = S = 64, B = 8192), measured in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

import unisched
from unisched import BACKWARD, FORWARD, ComputeAndWeightWorkers, Strategy, Work


# ---------------------------------------------------------------------- strategies
def gpipe(W: int) -> Strategy:
    return Strategy(
        lambda w: ComputeAndWeightWorkers(w.stage % W, w.stage % W),
        name="gpipe",
        map_arrays=lambda b, s, d: (s % W, s % W),
    )


def looped(W: int, R: int) -> Strategy:
    def h(stage, batch):
        return (R * batch) % W + stage % R

    return Strategy(
        lambda w: ComputeAndWeightWorkers(h(w.stage, w.batch), h(w.stage, w.batch)),
        name=f"looped(R={R})",
        map_arrays=lambda b, s, d: (h(s, b), h(s, b)),
    )


def strategies(W: int):
    return [gpipe(W), looped(W, 8)]


# ---------------------------------------------------------------------- the frontier scan
def frontier_scan(W: int, S: int, B: int, mapping, priority):
    """The reference greedy as the seed runs it: every step looks at every
    batch's frontier item, asking the strategy where its successor would run."""
    free = [0.0] * W
    frontier = {b: (Work(b, -1, FORWARD), 0.0) for b in range(B)}
    times = {}
    while frontier:
        best = None
        for done, done_at in frontier.values():
            nxt = _successor(done, S)
            worker = mapping(nxt).compute_worker
            start = max(free[worker], done_at)
            key = (start, priority(done))
            if best is None or key < best[0]:
                best = (key, nxt, worker)
        (start, _), nxt, worker = best
        finish = start + (1.0 if nxt.direction == FORWARD else 2.0)
        free[worker] = finish
        times[nxt] = (start, finish)
        if nxt.direction == BACKWARD and nxt.stage == 0:
            del frontier[nxt.batch]
        else:
            frontier[nxt.batch] = (nxt, finish)
    return times


def _successor(work: Work, S: int) -> Work:
    if work.direction == FORWARD:
        return Work(work.batch, work.stage + 1, FORWARD) if work.stage + 1 < S else Work(work.batch, S - 1, BACKWARD)
    return Work(work.batch, work.stage - 1, BACKWARD)


def oldest_batch_first(work: Work):
    return (work.batch, int(work.direction), work.stage)


# ---------------------------------------------------------------------- measuring
def best_of(repeat: int, fn):
    best, result = float("inf"), None
    for _ in range(repeat):
        began = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - began)
    return best, result


def compare(W: int, S: int, B: int, repeat: int) -> list[dict]:
    rows = []
    for strategy in strategies(W):
        ours, sim = best_of(repeat, lambda: unisched.simulate(W, S, B, strategy))
        theirs, times = best_of(1, lambda: frontier_scan(W, S, B, strategy.mapping, oldest_batch_first))
        index = sim.timeline.index()
        same = all(
            (sim.timeline.start[index[w]], sim.timeline.end[index[w]]) == times[w] for w in index
        )
        items = len(sim.timeline)
        rows.append(
            {
                "strategy": strategy.name,
                "shape": [W, S, B],
                "items": items,
                "latency": sim.latency,
                "unisched_s": ours,
                "frontier_scan_s": theirs,
                "unisched_items_per_s": items / ours,
                "frontier_scan_items_per_s": items / theirs,
                "speedup": theirs / ours,
                "same_timeline": same,
            }
        )
    return rows


def million(strategy_name: str) -> dict:
    """One million work items, in this process (run it in a fresh one)."""
    W, S, B = 64, 64, 8192
    strategy = {s.name: s for s in strategies(W)}[strategy_name]
    from unisched.simulate import fast

    fast.compiled_greedy()  # load the compiled greedy from its cache first (numba loads on first use)
    began = time.perf_counter()
    sim = unisched.simulate(W, S, B, strategy)
    elapsed = time.perf_counter() - began
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"strategy": strategy_name, "items": len(sim.timeline), "seconds": elapsed, "peak_rss_mb": peak_mb,
            "items_per_s": len(sim.timeline) / elapsed, "latency": sim.latency}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="runs of unisched per case; the best counts")
    parser.add_argument("--skip-million", action="store_true", help="leave out the one-million-item runs")
    parser.add_argument("--million", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.million:
        print(json.dumps(million(args.million)))
        return

    from unisched.simulate import fast

    fast.compiled_greedy()  # compile (or load) the greedy before timing (numba loads on first use)
    print("W = S = 64, B = 128 (16384 work items), default costs; unisched best of", args.repeat)
    print(f"{'strategy':<14}{'unisched items/s':>18}{'frontier items/s':>18}{'speed-up':>10}  same timeline")
    for row in compare(64, 64, 128, args.repeat):
        print(
            f"{row['strategy']:<14}{row['unisched_items_per_s']:>18,.0f}{row['frontier_scan_items_per_s']:>18,.0f}"
            f"{row['speedup']:>9.0f}x  {row['same_timeline']}"
        )
    if args.skip_million:
        return
    print("\nW = S = 64, B = 8192 (1,048,576 work items), each in a fresh process:")
    for name in ("gpipe", "looped(R=8)"):
        out = subprocess.run(
            [sys.executable, __file__, "--million", name], check=True, capture_output=True, text=True
        ).stdout
        row = json.loads(out)
        print(
            f"{row['strategy']:<14}{row['seconds']:>8.2f} s  {row['items_per_s']:>12,.0f} items/s  "
            f"peak RSS {row['peak_rss_mb']:,.0f} MB (whole process, Python and libraries included)"
        )


if __name__ == "__main__":
    np.seterr(all="raise")
    main()
