"""Planner benchmark: proofs of optimality and a mapping better than any fixed-stage one.

Prints figures measured in this run:

1. ``--strategy gpipe``, S = W = 4, B = 8, F = 1, B = 2: the best order under a
   memory limit of 2 activations (target: proven 51 within 10 s) and without
   (proven 33);
2. S = W = 4, B = 16, ``--comm 1 --fetch 2 --memory-limit 4
   --max-stages-per-worker 2``: the best fixed-stage mapping's optimum (84),
   and what the full planner finds within 60 s (target: at least 10% shorter),
   never worse than the best family member it simulated.

Run: ``python benchmarks/planner.py`` (``--quick`` shortens the 60 s search;
``--large`` adds a W = S = 8, B = 32 problem with the same limits).

``--zero-bubble`` prints instead the zero-bubble paper's bubble-rate table
(every setting of its Tables 5 and 6, ``zero_bubble_table.json``) side by
side with unisched: the paper's 1F1B, ZB-H1, ZB-H2, ZB-1p and ZB-2p; the
simulated 1F1B, ZB-H1 and ZB-H2 from the same profiled times (target: within
0.002 of the paper's); and the planner's plans with memory p and 2p
activations, one stage per worker, for the span objective the paper
measures (targets: at or below ZB-1p and ZB-2p), each searched for
``--plan-seconds`` (default 60; 0 skips the planner).  ``--rows 4-6`` plans
only those rows (numbered from 1 as in the paper's table; ``--rows 3``: the
first three), ``--memory p`` or ``2p`` only that column, and ``--progress``
shows the search's progress lines on stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

from unisched.errors import UniSchedError
from unisched.metrics import bubble_rate
from unisched.plan import PlanProblem, encode_costs, plan
from unisched.plan.family import stages_held
from unisched.plan.order import solve_order
from unisched.plan.problem import TimedProblem
from unisched.plan.search import search
from unisched.work import Shape


def proofs() -> None:
    print("1. gpipe mapping, W = S = 4, B = 8, forward 1, backward 2: best order")
    for limit in (2, None):
        begin = time.perf_counter()
        result = plan(4, 4, 8, memory_limit=limit, strategy="gpipe", time_limit=10)
        elapsed = time.perf_counter() - begin
        family = min(r["latency"] for r in result.candidates if r["source"] == "family")
        print(f"   memory limit {limit if limit else 'none':>4}: latency {result.latency:g} "
              f"({'proven optimal' if result.optimal else 'not proven'}; lower bound {result.lower_bound:g}) "
              f"in {elapsed:.2f} s; greedy simulation of gpipe gives {family:g}")


def mapping(search_seconds: float) -> None:
    print("\n2. W = S = 4, B = 16, comm 1, fetch 2, memory limit 4, at most 2 stages per worker")
    costs = encode_costs(comm=1, fetch=2)
    problem = PlanProblem(Shape(4, 4, 16), costs, memory_limit=4, max_stages_per_worker=2)
    timed = TimedProblem.build(problem)
    begin = time.perf_counter()
    fixed = solve_order(timed, timed.stage, timed.stage, time_limit=30)
    print(f"   fixed-stage mapping (worker = stage), best order: {fixed.objective} "
          f"({'proven optimal' if fixed.optimal else 'not proven'}) in {time.perf_counter() - begin:.2f} s")
    begin = time.perf_counter()
    result = plan(4, 4, 16, costs, memory_limit=4, max_stages_per_worker=2, time_limit=search_seconds)
    elapsed = time.perf_counter() - begin
    family = [r for r in result.candidates if r["source"] == "family"]
    best_family = min(family, key=lambda r: r["latency"])
    gain = 1 - result.latency / fixed.objective
    print(f"   planner ({search_seconds:g} s limit, {elapsed:.1f} s wall): {result.strategy_name}, latency "
          f"{result.latency:g} (replayed by the simulator), {gain:.1%} shorter than {fixed.objective}")
    print(f"   best family member simulated: {best_family['strategy']} at {best_family['latency']:g}; "
          f"plan never worse: {result.latency <= best_family['latency']}")
    print("   lower bounds: " + ", ".join(f"{k} {v:g}" for k, v in result.bounds.items())
          + f"; gap {result.gap:.1%}")
    sim = result.simulate()
    stats = sim.worker_stats()
    print(f"   peak activations per worker {stats['max_activation_storage']}, "
          f"stages held per worker {stages_held(sim).tolist()}")


def large(search_seconds: float) -> None:
    print(f"\n3. W = S = 8, B = 32, comm 1, fetch 2, memory limit 4, at most 2 stages per worker ({search_seconds:g} s)")
    costs = encode_costs(comm=1, fetch=2)
    begin = time.perf_counter()
    result = plan(8, 8, 32, costs, memory_limit=4, max_stages_per_worker=2, time_limit=search_seconds,
                  search="cpsat")  # 512 items: plan() would pick the heuristic search from 500 on
    elapsed = time.perf_counter() - begin
    family = min((r for r in result.candidates if r["source"] == "family"), key=lambda r: r["latency"])
    print(f"   planner ({elapsed:.1f} s wall): {result.strategy_name}, latency {result.latency:g}; best family member "
          f"{family['strategy']} at {family['latency']:g} ({1 - result.latency / family['latency']:.1%} shorter); "
          f"lower bound {result.lower_bound:g}")


def zero_bubble(plan_seconds: float, rows: slice = slice(None), memories: tuple[str, ...] = ("p", "2p"),
                progress: bool = False) -> None:
    import zero_bubble_table as table

    print("The zero-bubble paper's bubble rates (Qi et al., ICLR 2024, Table 5) from its profiled times (Table 6)")
    print(f"{'setting':<17} | {'paper: 1F1B  ZB-H1  ZB-H2  ZB-1p  ZB-2p':<40}| {'simulated: 1F1B  ZB-H1  ZB-H2':<31}"
          f"| planned: memory p        memory 2p")
    worst = 0.0
    for setting in table.settings()[rows]:
        paper = "  ".join(f"{setting.paper[c]:.4f}" for c in ("1F1B", "ZB-H1", "ZB-H2", "ZB-1p", "ZB-2p"))
        ours = [table.simulated(setting, c) for c in table.OURS]
        worst = max(worst, *(abs(v - setting.paper[c]) for v, c in zip(ours, table.OURS)))
        planned = "  ".join(_planned(table, setting, MEMORIES[memory] * setting.p, plan_seconds, progress)
                            if memory in memories else "-" for memory in MEMORIES)
        print(f"{setting.label:<17} | {paper:<40}| {'  '.join(f'{v:.4f}' for v in ours):<31}| {planned}"
              f"   (load {_load()})", flush=True)
    print(f"largest difference, simulated against the paper's 1F1B, ZB-H1, ZB-H2: {worst:.5f} (target 0.002)")


MEMORIES = {"p": 1, "2p": 2}
"""The planned columns: the activation memory limit in multiples of p (the paper's ZB-1p and ZB-2p)."""


def _load() -> str:
    """The machine's load average over the last minute (the planned times depend on it)."""
    try:
        with open("/proc/loadavg") as file:
            return file.read().split()[0]
    except OSError:
        return "?"


def _planned(table, setting, memory: int, seconds: float, progress: bool = False) -> str:
    """The planner's plan for one setting and memory limit: its bubble rate, what it is, and the
    seconds from the problem's construction to the plan."""
    if seconds <= 0:
        return "-"
    p, m = setting.p, setting.m
    begin = time.perf_counter()
    problem = PlanProblem(Shape(p, p, m), table.costs(setting), memory, max_stages_per_worker=1,
                          split_backward=True, objective="span")
    try:
        # what `unisched plan` runs on steps this large (--search auto): the heuristic search
        result = search(problem, time_limit=seconds, progress=sys.stderr if progress else None)
    except UniSchedError as error:
        return f"none ({str(error).splitlines()[0].split(' (')[0]})"
    elapsed = time.perf_counter() - begin  # the plan, replay included; measuring its bubble rate is not
    rate = bubble_rate(result.simulate().timeline)
    return f"{rate:.4f} ({result.strategy_name}, {elapsed:.1f} s)"


def _rows(text: str) -> slice:
    """``--rows``: "A-B" (rows A to B, numbered from 1) or "N" (the first N rows)."""
    try:
        first, _, last = text.partition("-")
        first, last = (int(first), int(last)) if last else (1, int(first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rows {text!r}: give A-B (rows A to B, from 1) or N (the first N)")
    if not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"--rows {text!r}: rows are numbered from 1, and A must not exceed B")
    return slice(first - 1, last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="search 15 s instead of 60 s in part 2")
    parser.add_argument("--large", action="store_true", help="also plan W = S = 8, B = 32 for 60 s")
    parser.add_argument("--zero-bubble", action="store_true",
                        help="only the zero-bubble paper's bubble-rate table, side by side with unisched")
    parser.add_argument("--plan-seconds", type=float, default=60.0,
                        help="with --zero-bubble: search time per plan (default 60; 0 skips the planner)")
    parser.add_argument("--rows", type=_rows, default=slice(None),
                        help="with --zero-bubble: only rows A-B of the table (from 1), or its first N rows")
    parser.add_argument("--memory", choices=list(MEMORIES), action="append",
                        help="with --zero-bubble: plan only with this memory limit (repeatable; default both)")
    parser.add_argument("--progress", action="store_true", help="with --zero-bubble: the search's progress on stderr")
    args = parser.parse_args()
    if args.zero_bubble:
        zero_bubble(args.plan_seconds, args.rows, tuple(args.memory or MEMORIES), args.progress)
        return
    proofs()
    mapping(15.0 if args.quick else 60.0)
    if args.large:
        large(60.0)


if __name__ == "__main__":
    main()
