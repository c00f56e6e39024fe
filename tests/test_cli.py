"""The `unisched` command: every verb answers, --json is pure JSON, errors are one line."""

import json
import subprocess
import sys

import pytest

from unisched.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_no_arguments_is_a_demo(capsys):
    code, out, _ = run(capsys)
    assert code == 0
    assert "one_f_one_b" in out and "latency" in out and "w0|" in out


def test_strategies_lists_the_registry(capsys):
    from unisched import policies

    code, out, _ = run(capsys, "strategies")
    assert code == 0
    for name in policies.names():
        assert name in out
    code, out, _ = run(capsys, "strategies", "--json")
    assert [entry["name"] for entry in json.loads(out)] == policies.names()


def test_simulate_json_has_the_results_and_nothing_else(capsys):
    code, out, _ = run(capsys, "simulate", "--strategy", "gpipe", "-W", "4", "-S", "4", "-B", "8", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["latency"] == 33 and result["lower_bound"] == 24
    assert result["worker_stats"]["max_activation_storage"] == [8, 7, 4, 1]
    assert {"throughput", "bubble_fraction"} <= set(result)


def test_simulate_with_costs_priority_limit_and_file(capsys, tmp_path):
    out_file = tmp_path / "gpipe.json"
    code, out, _ = run(
        capsys, "simulate", "--strategy", "gpipe", "--priority", "backward_first", "--memory-limit", "4,3,2,1",
        "--forward", "1", "--backward", "3", "--out", str(out_file), "--no-color",
    )
    assert code == 0 and "w3|" in out
    trace = json.loads(out_file.read_text())
    assert sum(1 for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("tid") == 1) == 4 * 8 * 2


def test_split_backward_from_the_flags(capsys):
    code, out, _ = run(
        capsys, "simulate", "--strategy", "zb_h1", "--backward-input", "1", "--backward-weight", "1", "--json"
    )
    assert code == 0 and json.loads(out)["latency"] == 27


def test_compare_ranks_best_first(capsys):
    code, out, _ = run(capsys, "compare", "-W", "4", "-S", "4", "-B", "8", "--json")
    assert code == 0
    rows = json.loads(out)["results"]
    assert len(rows) >= 5
    assert [r["latency"] for r in rows] == sorted(r["latency"] for r in rows)
    code, out, _ = run(capsys, "compare", "--strategies", "gpipe,ddp")
    assert "skipped ddp" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["simulate", "--strategy", "nope"], "unknown strategy"),
        (["simulate", "--strategy", "ddp", "-W", "4", "-B", "8"], "W = B"),
        (["simulate", "--strategy", "looped", "--param", "group_size=x"], "group_size"),
        (["simulate", "--strategy", "gpipe", "--param", "oops"], "K=V"),
        (["simulate", "--strategy", "gpipe", "--memory-limit", "0.5"], "cannot hold even one stash"),
        (["simulate", "--strategy", "gpipe", "--priority", "random"], "unknown priority"),
    ],
)
def test_bad_input_is_one_line_and_status_2(capsys, argv, words):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("unisched: error:") and words in err
    assert "Traceback" not in err


def test_every_verb_has_help():
    for verb in ("strategies", "simulate", "compare", "plan", "run"):
        result = subprocess.run(
            [sys.executable, "-m", "unisched", verb, "--help"], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0 and "usage: unisched " + verb in result.stdout
