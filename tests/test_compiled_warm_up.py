"""``fast.warm_up`` compiles (or loads) the compiled greedy on a one-item
step built by hand, with the fields ``graph_of`` gives a real step."""

from __future__ import annotations

import numpy as np
import pytest

import unisched
from unisched.simulate import fast

pytestmark = pytest.mark.skipif(fast.compiled_schedule() is None, reason="numba is not installed")


def test_warm_up_compiles_the_one_signature_a_real_step_runs(monkeypatch):
    """After ``warm_up`` a real compiled step compiles nothing more: the
    hand-built step has the signature ``graph_of`` and its siblings give."""
    fast.warm_up()
    kernel = fast.compiled_schedule()
    compiled = list(kernel.signatures)
    assert compiled
    ran = []
    monkeypatch.setattr(fast, "run", lambda problem, run=fast.run: ran.append(run(problem)) or ran[-1])
    W, S, B = 4, 4, fast.COMPILED_FROM // 8 + 1
    strategy = unisched.policies.get("one_f_one_b", num_workers=W, num_stages=S, num_batches=B)
    timeline = unisched.simulate(W, S, B, strategy).timeline
    assert len(ran) == 1 and ran[0] is not None  # the compiled greedy ran the step
    assert list(kernel.signatures) == compiled
    assert len(timeline.start) == 2 * S * B and np.all(np.asarray(timeline.start) >= 0)
