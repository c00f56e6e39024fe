"""``fast.warm_up`` compiles (or loads) the compiled greedy on a one-item
step built by hand, with the fields ``graph_of`` gives a real step."""

from __future__ import annotations

import numpy as np
import pytest

import unisched
from unisched.simulate import fast

pytestmark = pytest.mark.skipif(fast.compiled_schedule() is None, reason="numba is not installed")


def test_warm_up_runs_the_compiled_greedy_and_a_step_after_it():
    fast.warm_up()
    W, S, B = 4, 4, fast.COMPILED_FROM // 8 + 1
    strategy = unisched.policies.get("one_f_one_b", num_workers=W, num_stages=S, num_batches=B)
    timeline = unisched.simulate(W, S, B, strategy).timeline
    assert len(timeline.start) == 2 * S * B and np.all(np.asarray(timeline.start) >= 0)
