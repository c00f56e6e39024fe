"""Planner benchmark: the integer ticks of the p = 32 zero-bubble tables, value by value and by
distinct value, side by side in one run.

``TimedProblem.build`` turns the planner's tables (durations, and W x W x S transfer tables:
98,304 values for p = 32) into CP-SAT's integer ticks.  This times, on the zero-bubble table's
p = 32 rows (``zero_bubble_table.json``), the reduction as first written (``fractions.Fraction``
on every value, ``np.vectorize`` to convert) against ``Ticks.for_times`` and ``Ticks.table``
(each distinct time once, mapped back), checks the two give the same scale and ticks, and
prints the ratio.

Run: ``python benchmarks/planner_ticks.py`` (``--repeat N``: the best of N timings).
"""

from __future__ import annotations

import argparse
import math
import time
from fractions import Fraction

import numpy as np

import zero_bubble_table as table
from unisched.plan.problem import PlanProblem, Ticks, seconds_tables
from unisched.work import Shape


def tables(setting) -> list[np.ndarray]:
    """The tables ``TimedProblem.build`` converts for a setting: durations, comm, fetch, stash."""
    p, m = setting.p, setting.m
    return seconds_tables(PlanProblem(Shape(p, p, m), table.costs(setting), p, max_stages_per_worker=1,
                                      split_backward=True, objective="span"))


def value_by_value(parts: list[np.ndarray]) -> tuple[int, list[np.ndarray]]:
    """The reduction as first written: a Fraction per value, then a Python call per value."""
    positive = [float(t) for t in np.concatenate([a.ravel() for a in parts]) if t > 0]
    scale = 1
    for t in positive:
        fraction = Fraction(t).limit_denominator(1000)
        if abs(float(fraction) - t) > 1e-9 * max(1.0, t):
            scale = max(1, int(round(1000 / min(positive))))
            break
        scale = scale * fraction.denominator // math.gcd(scale, fraction.denominator)
    scale = min(scale, 10**6)
    to_ticks = np.vectorize(lambda t: int(round(float(t) * scale)), otypes=[np.int64])
    return scale, [to_ticks(a) for a in parts]


def distinct(parts: list[np.ndarray]) -> tuple[int, list[np.ndarray]]:
    """What ``TimedProblem.build`` runs: ``Ticks.for_times`` and ``Ticks.table``."""
    ticks = Ticks.for_times(np.concatenate([a.ravel() for a in parts]))
    return ticks.scale, [ticks.table(a) for a in parts]


def best_of(repeat: int, run, parts):
    seconds, result = math.inf, None
    for _ in range(repeat):
        begin = time.perf_counter()
        result = run(parts)
        seconds = min(seconds, time.perf_counter() - begin)
    return seconds, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="timings per method (the best counts)")
    args = parser.parse_args()
    print(f"{'setting':<18} {'values':>8} {'distinct':>8} {'scale':>6} {'value by value':>15} "
          f"{'distinct values':>16} {'ratio':>7}  same ticks")
    for setting in table.settings():
        if setting.p != 32:
            continue
        parts = tables(setting)
        values = np.concatenate([a.ravel() for a in parts])
        slow, (scale, old) = best_of(args.repeat, value_by_value, parts)
        fast, (new_scale, new) = best_of(args.repeat, distinct, parts)
        same = scale == new_scale and all(np.array_equal(a, b) for a, b in zip(old, new))
        print(f"{setting.label:<18} {values.size:>8,} {np.unique(values).size:>8} {new_scale:>6} "
              f"{slow:>13.3f} s {fast:>14.4f} s {slow / fast:>6.0f}x  {same}", flush=True)
        if not same:
            raise SystemExit(f"{setting.label}: the two reductions disagree")
    with open("/proc/loadavg") as file:
        print(f"load average {file.read().split()[0]}")


if __name__ == "__main__":
    main()
