"""Simulator speed: unisched's heap-based greedy against a plain frontier scan
of the same greedy (the seed notebook's algorithm: every step looks at every
batch's frontier item), side by side in one run.

    python benchmarks/simulator.py [--repeat N] [--skip-million] [--only NAME ...]

Prints, at W = S = 64, B = 128 (16,384 items, 24,576 with a split backward;
W = 32 where S = 2W, W = B = 128 for ddp and fsdp), work items per second of every named
strategy with its own priority, memory limit and orders, of GPipe written as
the seed's plain function, and of the frontier scan on GPipe's mapping
(after checking that it and unisched produce the same timeline); the speed
ratio of each against the scan; and which engine ran it (compiled or the
Python engine).  Then, each in a fresh process, the time and peak memory of
about one million work items for every named strategy and torch's schedule
classes: building the strategy (its fixed orders) and simulating it, timed
apart (wall clock), and the CPU time of both together (the process's own,
which a machine shared with other jobs slows less than the wall clock).

The network cases (``--only network``, or all of them by default) put
strategies on cluster topologies (transfers sharing NVLink ports and
NICs, all-reduces across replicas, tensor-parallel gangs whose collectives
wait for their links) and gangs that share rows over links between pairs
of workers, and time the compiled greedy and the Python engine on the same
steps, side by side, after checking that their timelines and transfers
are identical; then (unless ``--skip-million``) simulate each of them at
about a million work items (16 times the micro-batches) in a fresh
process: the time of ``simulate()``, the CPU time and the peak memory.
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
from unisched import BACKWARD, FORWARD, ComputeAndWeightWorkers, Costs, Strategy, Work
from unisched.simulate import engine, fast
from unisched.simulate.layout import tensor_parallel
from unisched.simulate.priorities import OldestBatchFirst
from unisched.simulate.problem import build as build_problem
from unisched.strategy import Gang
from unisched.topology import ClusterCosts
from unisched.work import Shape, as_stage_graph


# ---------------------------------------------------------------------- the cases
def seed_lambda(w: Work) -> ComputeAndWeightWorkers:
    """The seed notebook's own style: a plain function, nothing vectorised."""
    return ComputeAndWeightWorkers(w.stage, w.stage)


SPLIT = ("zb_h1", "zb_h2", "zbv", "dualpipe_v", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble",
         "ScheduleDualPipeV")
"""Strategies with a split backward: three passes per (stage, micro-batch)."""


def shape_of(name: str, million: bool) -> tuple[int, int, int]:
    """(W, S, B) for strategy ``name``: W = S = 64, B = 128 where it fits
    (W = 32 where S = 2W, W = B = 128 for data parallelism, W = 80 for the
    overflow's extra workers); with ``million``, about 1,048,576 items."""
    if name in ("ddp", "fsdp"):
        return (1024, 512, 1024) if million else (128, 64, 128)
    B = (1 << 20) // ((3 if name in SPLIT else 2) * 64) // 32 * 32 if million else 128
    halved = ("interleaved", "zbv", "dualpipe_v", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
              "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
    W = 32 if name in halved else 80 if name == "overflow" else 64
    return W, 64, B


def build(name: str, million: bool = False) -> tuple[tuple[int, int, int], Strategy | object]:
    """The shape and the strategy of case ``name``."""
    W, S, B = shape_of("gpipe" if name == "seed lambda" else name, million)
    if name == "seed lambda":
        return (W, S, B), seed_lambda
    return (W, S, B), unisched.policies.get(name, num_workers=W, num_stages=S, num_batches=B)


def names() -> list[str]:
    return [e["name"] for e in unisched.policies.catalog()] + ["seed lambda"]


def aliases() -> list[str]:
    """torch's schedule classes (timed in the million-item part only)."""
    return list(unisched.policies.aliases())


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


def engine_used(fn):
    """Run ``fn``; return its result and which engine scheduled it."""
    calls = []
    python_run = engine.run

    def counted(problem):
        calls.append(problem.num_items)
        return python_run(problem)

    engine.run = counted
    try:
        result = fn()
    finally:
        engine.run = python_run
    return result, ("python engine" if calls else "compiled")


def frontier_baseline(W: int, S: int, B: int) -> dict:
    """The frontier scan on GPipe's mapping, checked against unisched's timeline."""
    mapping = lambda w: ComputeAndWeightWorkers(w.stage % W, w.stage % W)  # noqa: E731
    seconds, times = best_of(1, lambda: frontier_scan(W, S, B, mapping, oldest_batch_first))
    t = unisched.simulate(W, S, B, mapping).timeline
    index = t.index()
    same = len(index) == len(times) and all((t.start[index[w]], t.end[index[w]]) == times[w] for w in index)
    return {"seconds": seconds, "items_per_s": len(times) / seconds, "same_timeline": same}


def compare(repeat: int, only: list[str]) -> tuple[dict, list[dict]]:
    """Each strategy's best of ``repeat`` simulations, the strategies taking
    turns (one simulation of each per round), so that what one leaves behind
    (the allocator's state, the caches) falls on all of them alike."""
    baseline = frontier_baseline(64, 64, 128)
    built = {name: build(name) for name in only}
    best = dict.fromkeys(only, float("inf"))
    for _ in range(repeat):
        for name, ((W, S, B), strategy) in built.items():
            began = time.perf_counter()
            unisched.simulate(W, S, B, strategy)
            best[name] = min(best[name], time.perf_counter() - began)
    rows = []
    for name, ((W, S, B), strategy) in built.items():
        seconds = best[name]
        sim, path = engine_used(lambda: unisched.simulate(W, S, B, strategy))
        items = len(sim.timeline)
        rows.append({
            "strategy": name, "shape": [W, S, B], "items": items, "latency": sim.latency, "seconds": seconds,
            "items_per_s": items / seconds, "vs_frontier_scan": items / seconds / baseline["items_per_s"],
            "engine": path,
        })
    return baseline, rows


# ---------------------------------------------------------------------- networks: compiled against the engine
def network_cases(B: int = 2048) -> dict:
    """name -> (shape, strategy, costs): steps with transfers that take time,
    of about 65,000 items each (``B`` = 2048; 16 times more with 32768),
    but the sharded one: 8,192 items gathering 57,344 shards (B / 8 stages
    of 16 micro-batches)."""
    seconds = dict(forward=1e-3, backward=2e-3, activation_bytes=2e7, weight_bytes=4e8)
    one_f_one_b = unisched.policies.get("one_f_one_b", num_workers=16, num_stages=16, num_batches=B)
    zb_h1 = unisched.policies.get("zb_h1", num_workers=16, num_stages=16, num_batches=B // 2)
    pipeline = unisched.policies.get("one_f_one_b", num_workers=8, num_stages=8, num_batches=2 * B)
    gangs = tensor_parallel(pipeline, 2)
    shared_rows = gangs.with_(gang=lambda w: Gang(gangs.gang(w).workers, False), name="1F1B, gangs of 2 sharing rows")
    node = {w: tuple(range(w - w % 8, w - w % 8 + 8)) for w in range(16)}  # each stage in 8 shards per node
    hybrid = unisched.policies.get("ddp", num_workers=16, num_stages=B // 8, num_batches=16).with_(
        weight_shards=lambda stage, weight: node[weight], name="FSDP, 8 shards a node x 2 nodes")
    return {
        "1F1B on dgx_h100, 2 replicas": ((16, 16, B), one_f_one_b,
                                         ClusterCosts(**seconds, topology="dgx_h100", replicas=2)),
        "ZB-H1 on p4d (shared NICs)": ((16, 16, B // 2), zb_h1,
                                       ClusterCosts(**seconds, prefetch_depth=1, topology="p4d_24xlarge")),
        "1F1B x TP 2 on dgx_h100": ((16, 8, 2 * B), gangs,
                                    ClusterCosts(**seconds, topology="dgx_h100", replicas=2)),
        "1F1B x 2 sharing rows, pair links": ((16, 8, 2 * B), shared_rows,
                                              Costs(**seconds, bandwidth=5e10, latency=5e-6)),
        "FSDP 8 shards a node, 2 dgx_h100": ((16, B // 8, 16), hybrid,
                                             ClusterCosts(**seconds, prefetch_depth=1, topology="dgx_h100")),
    }


def compiled_against_engine(repeat: int) -> list[dict]:
    """Each network case's items per second on the compiled greedy and on
    the Python engine (best of ``repeat``, the two taking turns on the same
    step), after checking that both give the same timeline and transfers;
    and of the whole ``simulate()`` (building the step, the compiled greedy,
    the Timeline and its transfers)."""
    rows = []
    for name, ((W, S, B), strategy, costs) in network_cases().items():
        priority = strategy.priority or OldestBatchFirst(S, B)
        problem = build_problem(Shape(W, S, B), strategy, priority, costs, strategy.memory_limit,
                                strategy.split_backward, as_stage_graph(S, None), False)  # its own limit counts stashes
        best = {"compiled": float("inf"), "python engine": float("inf"), "simulate": float("inf")}
        whole = lambda: unisched.simulate(W, S, B, strategy, costs=costs)  # noqa: E731
        for _ in range(repeat):
            for path, run in (("compiled", fast.run), ("python engine", engine.run), ("simulate", None)):
                began = time.perf_counter()
                result = run(problem) if run is not None else whole()
                best[path] = min(best[path], time.perf_counter() - began)
                if path == "compiled":
                    compiled = result
                elif path == "python engine":
                    python = result
        same = (np.array_equal(compiled[0], python[0]) and np.array_equal(compiled[1], python[1])
                and compiled[2].equals(python[2]))
        rows.append({"case": name, "shape": [W, S, B], "items": problem.num_items, "transfers": len(python[2].kind),
                     "compiled_items_per_s": problem.num_items / best["compiled"],
                     "engine_items_per_s": problem.num_items / best["python engine"],
                     "simulate_items_per_s": problem.num_items / best["simulate"],
                     "speedup": best["python engine"] / best["compiled"], "same_timeline": same})
    return rows


def million_network(name: str) -> dict:
    """Network case ``name`` at about a million work items, simulated in this process (run it in a fresh one)."""
    fast.warm_up()
    began, began_cpu = time.perf_counter(), time.process_time()
    (W, S, B), strategy, costs = network_cases(MILLION_B)[name]
    built = time.perf_counter()
    sim, path = engine_used(lambda: unisched.simulate(W, S, B, strategy, costs=costs))
    done, done_cpu = time.perf_counter(), time.process_time()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"strategy": name, "shape": [W, S, B], "items": len(sim.timeline), "transfers": len(sim.transfers),
            "build_s": built - began, "simulate_s": done - built, "cpu_s": done_cpu - began_cpu,
            "peak_rss_mb": peak_mb, "engine": path}


MILLION_B = 32768
"""``network_cases``' B for about a million items (16 x 16 x 32768 x 2 for 1F1B)."""


def million(name: str) -> dict:
    """About one million work items of ``name``, in this process (run it in a fresh one)."""
    fast.warm_up()  # load the compiled greedy from its cache first (numba loads on first use)
    began, began_cpu = time.perf_counter(), time.process_time()
    (W, S, B), strategy = build(name, million=True)
    built = time.perf_counter()
    sim, path = engine_used(lambda: unisched.simulate(W, S, B, strategy))
    done, done_cpu = time.perf_counter(), time.process_time()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"strategy": name, "shape": [W, S, B], "items": len(sim.timeline), "build_s": built - began,
            "simulate_s": done - built, "cpu_s": done_cpu - began_cpu, "peak_rss_mb": peak_mb, "engine": path}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="runs of unisched per case; the best counts")
    parser.add_argument("--skip-million", action="store_true", help="leave out the one-million-item runs")
    parser.add_argument("--only", nargs="+", choices=names() + aliases() + ["network"], metavar="NAME",
                        help="only these cases (network: the network cases)")
    parser.add_argument("--million", help=argparse.SUPPRESS)
    parser.add_argument("--million-network", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.million:
        print(json.dumps(million(args.million)))
        return
    if args.million_network:
        print(json.dumps(million_network(args.million_network)))
        return
    only = args.only or names()
    table = [name for name in only if name in names()]

    fast.warm_up()  # compile (or load) the greedy before timing (numba loads on first use)
    if not args.only or "network" in args.only:
        print_network(args.repeat)
        if not args.skip_million:
            print_million_network()
    if not table:
        return
    baseline, rows = compare(args.repeat, table)
    print(f"W = S = 64, B = 128 or as noted, default costs; unisched best of {args.repeat} (strategies taking turns); frontier scan on GPipe's "
          f"mapping at W = S = 64, B = 128: {baseline['seconds']:.2f} s, {baseline['items_per_s']:,.0f} items/s, "
          f"same timeline as unisched: {baseline['same_timeline']}")
    print(f"{'strategy':<22}{'W,S,B':>12}{'items/s':>12}{'ms':>9}{'vs scan':>9}  engine")
    for row in rows:
        print(f"{row['strategy']:<22}{','.join(map(str, row['shape'])):>12}{row['items_per_s']:>12,.0f}"
              f"{1e3 * row['seconds']:>9.1f}{row['vs_frontier_scan']:>8.0f}x  {row['engine']}")
    if args.skip_million:
        return
    print("\nabout 1,048,576 work items, each in a fresh process (peak RSS: whole process, Python and libraries):")
    print(f"{'strategy':<30}{'W,S,B':>14}{'items':>11}{'build s':>9}{'simulate s':>12}{'cpu s':>7}{'peak MB':>9}"
          "  engine")
    for name in [n for n in only if n != "network"] + ([] if args.only else aliases()):
        out = subprocess.run([sys.executable, __file__, "--million", name], check=True, capture_output=True,
                             text=True).stdout
        row = json.loads(out)
        print(f"{row['strategy']:<30}{','.join(map(str, row['shape'])):>14}{row['items']:>11,}{row['build_s']:>9.2f}"
              f"{row['simulate_s']:>12.2f}{row['cpu_s']:>7.2f}{row['peak_rss_mb']:>9,.0f}  {row['engine']}")


def print_million_network() -> None:
    print("the network cases at about a million work items (B x 16), each in a fresh process (peak RSS: whole "
          "process):")
    print(f"{'case':<36}{'W,S,B':>14}{'items':>11}{'transfers':>11}{'simulate s':>12}{'cpu s':>7}{'peak MB':>9}"
          "  engine")
    for name in network_cases():
        out = subprocess.run([sys.executable, __file__, "--million-network", name], check=True, capture_output=True,
                             text=True).stdout
        row = json.loads(out)
        print(f"{row['strategy']:<36}{','.join(map(str, row['shape'])):>14}{row['items']:>11,}{row['transfers']:>11,}"
              f"{row['simulate_s']:>12.2f}{row['cpu_s']:>7.2f}{row['peak_rss_mb']:>9,.0f}  {row['engine']}")
    print()


def print_network(repeat: int) -> None:
    print(f"steps with transfers, the compiled greedy against the Python engine on the same step, and the whole "
          f"simulate(), best of {repeat} (taking turns):")
    print(f"{'case':<36}{'W,S,B':>12}{'items':>8}{'transfers':>11}{'compiled/s':>12}{'engine/s':>10}{'speedup':>9}"
          f"{'simulate()/s':>14}  same timeline")
    for row in compiled_against_engine(repeat):
        print(f"{row['case']:<36}{','.join(map(str, row['shape'])):>12}{row['items']:>8,}{row['transfers']:>11,}"
              f"{row['compiled_items_per_s']:>12,.0f}{row['engine_items_per_s']:>10,.0f}{row['speedup']:>8.1f}x"
              f"{row['simulate_items_per_s']:>14,.0f}  {row['same_timeline']}")
    print()


if __name__ == "__main__":
    np.seterr(all="raise")
    main()
