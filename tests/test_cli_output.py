"""What the command line prints and writes: throughput and bounds that compare across strategies,
text that reads without colour, plans drawn and replayed, your own strategy function, and the
README's Trainer snippet on every rank."""

from __future__ import annotations

import json

import pytest

import unisched
from unisched.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------- throughput and the bound
def test_throughput_counts_each_micro_batch_once_whatever_the_backward():
    """zb_h1 splits its backward into two items; its throughput gains only what its latency gains."""
    W = S = 4
    B = 8
    one_f_one_b = unisched.simulate(W, S, B, unisched.policies.get("one_f_one_b", W, S, B))
    zb_h1 = unisched.simulate(W, S, B, unisched.policies.get("zb_h1", W, S, B))
    assert zb_h1.batch_throughput == pytest.approx(B / zb_h1.latency)
    ratio = zb_h1.batch_throughput / one_f_one_b.batch_throughput
    assert ratio == pytest.approx(one_f_one_b.latency / zb_h1.latency)  # 33 / 27, not 1.83
    assert "micro-batches/time" in zb_h1.summary() and "micro-batches/time" in zb_h1.to_text(color=False)


def test_simulate_json_reports_the_batch_throughput(capsys):
    code, out, _ = run(capsys, "simulate", "--strategy", "zb_h1", "--json")
    result = json.loads(out)
    assert code == 0 and result["batch_throughput"] == pytest.approx(8 / 27)


def test_compare_measures_every_row_against_one_bound(capsys):
    """With two micro-batches a split backward has a shorter critical path: each strategy's own
    bound differs, but the gaps compare rows against the one shape bound."""
    code, out, _ = run(capsys, "compare", "-W", "4", "-S", "4", "-B", "2", "--strategies", "one_f_one_b,zb_h1",
                       "--json")
    assert code == 0
    data = json.loads(out)
    rows = {row["strategy"]: row for row in data["results"]}
    assert rows["one_f_one_b"]["lower_bound"] != rows["zb_h1"]["lower_bound"]  # their own bounds differ
    bound = data["bound"]
    assert bound == 8 and all(bound <= row["lower_bound"] for row in rows.values())  # the split backward's path
    for row in rows.values():
        assert row["gap"] == pytest.approx(row["latency"] / bound - 1)
        assert row["batch_throughput"] == pytest.approx(2 / row["latency"])
    # the faster strategy is the closer one to the bound (each row's own bound said the opposite)
    assert rows["zb_h1"]["latency"] < rows["one_f_one_b"]["latency"]
    assert rows["zb_h1"]["gap"] < rows["one_f_one_b"]["gap"]
    assert rows["zb_h1"]["own_gap"] > rows["one_f_one_b"]["own_gap"]
    code, out, _ = run(capsys, "compare", "-W", "4", "-S", "4", "-B", "2", "--strategies", "one_f_one_b,zb_h1")
    assert "batches/time" in out and f"latency above {bound:g}, the shape's lower bound" in out
