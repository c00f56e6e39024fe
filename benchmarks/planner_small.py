"""Planner benchmark, small problems: how far the plan is from the best schedule.

For a grid of small steps (W, S <= 4 workers and stages, B <= 8 micro-batches;
forward 1, backward 2, or a split backward I 1, W 1; communication 0 or 1;
memory limit 1, 2 or none) this runs ``plan()`` at the command's default time
limit and prints, per case, the plan's replayed latency, the best lower bound
it proves (and for which class of schedules), and the gap between the two.

``--reference SECONDS`` also plans every case (with ``--all``, every step) for
that long (a long CP-SAT run) and prints the gap of the default run to that reference, the best
schedule known: where the long run proves its schedule optimal, the reference
is the optimum of the class it names.

``--all`` plans instead every step of the sweep the planner was first
measured on: W, S in {2, 3, 4}, B in {2, 4, 8}, memory limit 1, 2 or none,
communication 0 or 1 (162 steps; ``--split`` adds each with a split
backward), and ends with a summary: how many plans are proven optimal (and
for which class), how many equal the proven optimum of a restricted class
they lie outside of (replicated weights, say), how many lie within 2% of
their own lower bound, and the largest gap among the rest.

Run: ``python benchmarks/planner_small.py`` (``--quick``: the first cases only;
``--cases 0,3``: those rows, a row given twice planned twice; ``--time-limit``: another search time).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import NamedTuple

from unisched.errors import UniSchedError
from unisched.plan import encode_costs, plan
from unisched.plan.bounds import ANY_SCHEDULE
from unisched.plan.mapping import EVERY, PAIRED, WHOLE_SCHEME
from unisched.plan.command import DEFAULT_TIME_LIMIT


class Case(NamedTuple):
    """One small step: shape, memory limit (None: none), communication time, split backward."""

    workers: int
    stages: int
    batches: int
    memory: float | None
    comm: float
    split: bool = False

    def label(self) -> str:
        memory = "none" if self.memory is None else f"{self.memory:g}"
        return (f"W={self.workers} S={self.stages} B={self.batches} mem {memory:<4} comm {self.comm:g}"
                + (" split" if self.split else ""))

    def costs(self):
        if self.split:
            return encode_costs(backward_input=1, backward_weight=1, comm=self.comm)
        return encode_costs(comm=self.comm)


GRID = [
    Case(2, 2, 2, 1, 1),
    Case(2, 4, 4, 2, 1),
    Case(2, 4, 8, 2, 1),
    Case(3, 4, 8, 2, 1),
    Case(2, 3, 8, 2, 0, split=True),
    Case(4, 4, 8, 2, 0),
    Case(4, 4, 8, 1, 1),
    Case(3, 3, 8, 1, 0),
    Case(3, 3, 8, 2, 1),
    Case(4, 4, 8, None, 1),
    Case(4, 4, 8, 2, 1, split=True),
    Case(2, 2, 8, 1, 1),
    Case(3, 2, 4, 1, 1, split=True),
    Case(4, 3, 8, 2, 1),
    Case(4, 4, 4, 1, 1),
    Case(2, 4, 8, None, 1),
]


def sweep(split: bool) -> list[Case]:
    """Every step of the sweep (``--all``), with split-backward twins when ``split``."""
    cases = [Case(W, S, B, memory, comm) for W in (2, 3, 4) for S in (2, 3, 4) for B in (2, 4, 8)
             for memory in (1, 2, None) for comm in (0, 1)]
    return cases + [case._replace(split=True) for case in cases] if split else cases


def run(case: Case, seconds: float):
    """The plan of one case within ``seconds``, checked to replay to its latency, and its wall time."""
    begin = time.perf_counter()
    result = plan(case.workers, case.stages, case.batches, case.costs(), memory_limit=case.memory,
                  split_backward=case.split, time_limit=seconds)
    replayed = result.simulate().latency
    if replayed != result.latency:
        raise SystemExit(f"{case.label()}: the plan says {result.latency:g} but replays to {replayed:g}")
    for key, bound in result.bounds.items():
        if result.bound_classes[key] == ANY_SCHEDULE and bound > replayed + 1e-9:
            raise SystemExit(f"{case.label()}: the bound {key} {bound:g} for any schedule exceeds the plan's "
                             f"{replayed:g}")
    return result, time.perf_counter() - begin


def short_class(name: str) -> str:
    """A few words for the class of schedules a bound holds for."""
    return {ANY_SCHEDULE: "any", EVERY: "every", PAIRED: "paired", WHOLE_SCHEME: "whole"}.get(name, name[:24])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                        help=f"search time per case (default {DEFAULT_TIME_LIMIT:g}, the command's default)")
    parser.add_argument("--reference", type=float, default=0.0,
                        help="also plan each case this many seconds, as the reference (0: no reference)")
    parser.add_argument("--quick", action="store_true", help="only the first four cases")
    parser.add_argument("--cases", default=None, help="comma-separated row numbers of the grid (with --all: of the sweep)")
    parser.add_argument("--all", action="store_true", help="the 162 steps of the sweep instead of the grid")
    parser.add_argument("--split", action="store_true", help="with --all: each step with a split backward too")
    args = parser.parse_args()
    if args.split and not args.all:
        parser.error("--split goes with --all (the grid has its split-backward cases already)")
    if args.quick and args.all:
        parser.error("--quick is for the grid; with --all, name the steps with --cases")
    if args.all:
        steps = sweep(args.split)
        numbers = [int(x) for x in args.cases.split(",")] if args.cases else range(len(steps))
        summarize([(k, steps[k]) for k in numbers], args.time_limit, args.reference)
        return
    rows = list(range(len(GRID)))
    if args.cases:
        rows = [int(x) for x in args.cases.split(",")]
    elif args.quick:
        rows = rows[:4]
    print(f"plan() at {args.time_limit:g} s per case" + (f"; reference: {args.reference:g} s" if args.reference else ""))
    print(f"{'#':>2} {'case':<38} {'plan':>6} {'bound':>6} {'gap':>6}  {'bound holds for':<20} {'wall':>5}"
          + ("    ref  bound  proven        above" if args.reference else "") + "  found by")
    worst = 0.0
    for k in rows:
        case = GRID[k]
        try:
            result, wall = run(case, args.time_limit)
        except UniSchedError as error:
            print(f"{k:>2} {case.label():<38} no plan: {str(error).splitlines()[0][:100]}", flush=True)
            worst = math.inf
            continue
        gap = result.gap
        line = (f"{k:>2} {case.label():<38} {result.latency:>6g} {result.lower_bound:>6g} {gap:>6.1%}  "
                f"{short_class(result.bound_for):<20} {wall:>5.1f}")
        if args.reference:
            columns, to_ref = reference_columns(case, result, args.reference)
            worst = max(worst, to_ref)
            line += columns
        print(f"{line}  {result.strategy_name[:40]}", flush=True)
    if args.reference:
        print(f"largest gap to the reference: {worst:.1%} (target 2%)")


def reference_columns(case: Case, result, seconds: float) -> tuple[str, float]:
    """A ``seconds`` plan of ``case`` beside ``result``: the best latency known, the long plan's
    bound, whether it proved its latency (and for which class), and how far ``result`` lies above
    the best known; with that gap."""
    long, _ = run(case, seconds)
    best = min(long.latency, result.latency)
    above = result.latency / best - 1
    proven = "proven " + short_class(long.proven_for) if long.optimal else ""
    return f"  {best:>5g} {long.lower_bound:>5g} {proven:<12} {above:>6.1%}", above


def summarize(cases: list[tuple[int, Case]], seconds: float, reference: float = 0.0) -> None:
    """Plan every (step number, case) (one line each; with ``reference`` seconds, a long plan of it
    too, the best known), then count the proofs and the gaps to the plans' own bounds."""
    print(f"plan() at {seconds:g} s per step, {len(cases)} steps"
          + (f"; reference: {reference:g} s (best known, whether the long run proved it, gap to it)"
             if reference else ""))
    worst = 0.0
    proven: dict[str, int] = {}
    met: dict[str, int] = {}
    close, failed, gaps = 0, 0, []
    for k, case in cases:
        try:
            result, wall = run(case, seconds)
        except UniSchedError as error:
            print(f"{k:>3} {case.label():<38} no plan: {str(error).splitlines()[0][:100]}", flush=True)
            failed += 1
            continue
        gap = result.gap
        mark = "optimal" if result.optimal else ""
        line = (f"{k:>3} {case.label():<38} {result.latency:>6g} {result.lower_bound:>6g} {gap:>6.1%}  "
                f"{short_class(result.bound_for):<8} {wall:>5.1f}  {mark:<7}")
        if reference:
            columns, to_ref = reference_columns(case, result, reference)
            worst = max(worst, to_ref)
            line += columns
        print(line.rstrip(), flush=True)
        if result.optimal:
            key = short_class(result.proven_for)
            proven[key] = proven.get(key, 0) + 1
        elif gap <= 0.02:
            close += 1
        elif unbeaten := result.unbeaten_in():  # outside a class whose proven optimum it equals (replicas, say)
            met[short_class(unbeaten)] = met.get(short_class(unbeaten), 0) + 1
        else:
            gaps.append((gap, k))
    classes = ", ".join(f"{n} for {name}" for name, n in sorted(proven.items()))
    print(f"proven optimal: {sum(proven.values())} of {len(cases)}" + (f" ({classes})" if classes else "") + "; "
          + "".join(f"as short as the proven optimum of the {name} class, and outside it: {n}; "
                    for name, n in sorted(met.items()))
          + f"unproven within 2% of their bound: {close}; further: {len(gaps)}"
          + (f" (largest gap {max(gaps)[0]:.1%}, step {max(gaps)[1]})" if gaps else "")
          + (f"; no plan: {failed}" if failed else ""))
    if reference:
        print(f"largest gap to the reference: {worst:.1%} (target 2%)")


if __name__ == "__main__":
    main()
