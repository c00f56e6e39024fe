"""The memory model's flat arrays against plain numpy: ``unique_codes``
against ``np.unique``, and which items release what (``release_ptr``)
against counting the backward passes one by one."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from unisched.dataflow import Items
from unisched.simulate.stashes import stash_accounts, unique_codes
from unisched.work import FORWARD


@pytest.mark.parametrize("span", [1, 7, 300, 1 << 20])  # counting, and sorting for a span far above the codes
@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)))
def test_unique_codes_is_np_unique(span, flags):
    rng = np.random.default_rng(span)
    codes = rng.integers(0, span, size=200)
    index, inverse, counts = flags
    got = unique_codes(codes, span, return_index=index, return_inverse=inverse, return_counts=counts)
    expected = np.unique(codes, return_index=index, return_inverse=inverse, return_counts=counts)
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert len(got) == len(expected) == 1 + sum(flags)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e.reshape(-1))


@pytest.mark.parametrize("split", [False, True])
def test_each_backward_pass_releases_once(split):
    S, B, W = 5, 3, 4
    items = Items(S, B, split)
    batch, stage, direction = items.arrays()
    compute = (stage % W).astype(np.int64)
    accounts = stash_accounts(W, 10.0, items, compute, stage, None, 0.5)
    assert accounts.release_ptr[0] == 0
    np.testing.assert_array_equal(np.diff(accounts.release_ptr), direction != FORWARD)
