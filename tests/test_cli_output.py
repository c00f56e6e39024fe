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


# ---------------------------------------------------------------------- colour
def mirrored(w):
    """Even micro-batches run stage s on worker s, odd ones on worker 3 - s: workers 0 and 3 run
    the same stages at the same times, on different micro-batches (as the demo plan does)."""
    worker = w.stage if w.batch % 2 == 0 else 3 - w.stage
    return unisched.ComputeAndWeightWorkers(worker, worker)


def rows_of(text):
    from unisched.render.text import ANSI

    return {line.split("|")[0]: ANSI.sub("", line.split("|", 1)[1]) for line in text.splitlines()
            if line.startswith("w") and "|" in line}


def test_rows_that_differ_only_in_micro_batches_read_differently_without_colour():
    sim = unisched.simulate(4, 4, 8, mirrored)
    coloured = rows_of(sim.to_text(color=True))
    assert coloured["w0"] == coloured["w3"]  # the colours alone tell these rows apart
    plain = rows_of(sim.to_text(color=False))
    assert plain["w0"] != plain["w3"]
    assert "0F0" in plain["w0"] and "0F1" in plain["w3"]


@pytest.mark.parametrize("flags, painted", [
    (["--color", "always"], True), (["--color", "never"], False), (["--no-color"], False), (["--color", "auto"], False),
    ([], False),
])
def test_simulate_color_flag(capsys, flags, painted):
    code, out, _ = run(capsys, "simulate", "--strategy", "gpipe", *flags)
    assert code == 0 and ("\x1b[" in out) == painted
    if not painted:
        assert "0F0" in out and "color=True" not in out


def test_color_auto_means_a_terminal_without_no_color(capsys, monkeypatch):
    import sys

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert "\x1b[" in run(capsys, "simulate", "--strategy", "gpipe")[1]
    monkeypatch.setenv("NO_COLOR", "1")
    assert "\x1b[" not in run(capsys, "simulate", "--strategy", "gpipe")[1]
    assert "\x1b[" not in run(capsys)[1]  # the demo too
    assert "\x1b[" in run(capsys, "simulate", "--strategy", "gpipe", "--color", "always")[1]


def test_color_is_offered_by_every_verb_that_draws(capsys):
    for verb in ("simulate", "plan"):
        with pytest.raises(SystemExit):
            main([verb, "--help"])
        out = capsys.readouterr().out
        assert "--color {auto,always,never}" in out and "NO_COLOR" in out
    with pytest.raises(SystemExit) as exit:
        main(["simulate", "--strategy", "gpipe", "--color", "sometimes"])
    assert exit.value.code == 2 and "invalid choice" in capsys.readouterr().err
