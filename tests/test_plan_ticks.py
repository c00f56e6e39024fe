"""The planner's integer ticks: the scale and a table's ticks, read once per distinct time,
are those worked out by hand for every value (checked on tables that repeat a few times many
times over)."""

import math

import numpy as np
import pytest

from unisched.plan import encode_costs
from unisched.plan.problem import PlanInputError, PlanProblem, Ticks, TimedProblem
from unisched.work import Shape


def repeated_table(values, W=6, S=5, seed=0):
    """A W x W x S table (a transfer table's shape) holding only ``values``, each many times, zero
    on the diagonal, placed at random so that a wrong map back shows."""
    rng = np.random.default_rng(seed)
    table = rng.choice(np.asarray(values, dtype=float), size=(W, W, S))
    table[np.arange(W), np.arange(W)] = 0.0
    return table


@pytest.mark.parametrize("values, scale", [
    ([0.5, 0.25, 1 / 3], 12),  # thirds, halves and quarters: 12 ticks a unit
    ([1.0, 2.0, 3.0], 1),
    ([0.75, 1.5, 0.2], 20),
    ([math.pi, 2.0], round(1000 / 2.0)),  # no fraction with a denominator up to 1000: 1/1000 of the shortest
])
def test_ticks_of_a_repeated_table_are_those_of_every_value(values, scale):
    table = repeated_table(values)
    ticks = Ticks.for_times(table)
    assert ticks.scale == scale
    converted = ticks.table(table)
    assert converted.shape == table.shape and converted.dtype == np.int64
    expected = np.array([int(round(t * scale)) for t in table.ravel()]).reshape(table.shape)
    assert np.array_equal(converted, expected)


def test_a_table_is_mapped_back_place_by_place():
    """Distinct times at known places come back at those places (a map back that sorted the
    table, or read it in another order, fails here)."""
    ticks = Ticks(4)
    table = np.array([[0.0, 2.5, 0.25], [0.25, 0.0, 2.5], [1.0, 1.0, 0.0]])
    assert ticks.table(table).tolist() == [[0, 10, 1], [1, 0, 10], [4, 4, 0]]
    assert ticks.table(np.zeros((0, 3))).shape == (0, 3)


def test_timed_problem_tables_in_ticks():
    """TimedProblem.build's tables: comm 1/3 and fetch 3/4 give 12 ticks a unit, every
    off-diagonal entry the same."""
    problem = PlanProblem(Shape(3, 3, 2), encode_costs(comm=1 / 3, fetch=0.75))
    timed = TimedProblem.build(problem)
    assert timed.ticks.scale == 12
    off = ~np.eye(3, dtype=bool)
    assert np.all(timed.comm[off] == 4) and np.all(timed.comm[~off] == 0)
    assert np.all(timed.fetch[off] == 9)
    assert timed.duration.dtype == np.int64 and set(np.unique(timed.duration).tolist()) == {12, 24}


def test_times_too_long_for_ticks_are_refused():
    with pytest.raises(PlanInputError, match="coarser unit"):
        TimedProblem.build(PlanProblem(Shape(2, 2, 2), encode_costs(comm=1e300)))
