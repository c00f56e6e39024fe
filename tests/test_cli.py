"""The `unisched` command: every verb answers, --json is pure JSON, errors are one line."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import unisched
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
    for name in policies.names() + policies.aliases():
        assert name in out
    assert "ScheduleZBVZeroBubble" in policies.aliases()
    code, out, _ = run(capsys, "strategies", "--json")
    listed = json.loads(out)
    assert [entry["name"] for entry in listed] == policies.names() + policies.aliases()
    assert {entry["family"] for entry in listed if entry["name"] in policies.aliases()} == {"torch"}


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
        (["simulate", "--strategy", "looped", "--param", "group_size=2", "--param", "group-size=4"],
         "--param sets group_size twice (2 and 4); give it once"),
        (["simulate", "--strategy", "looped(group_size=2, group_size=4)"], "sets group_size twice (2 and 4)"),
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


# ---------------------------------------------------------------------- one grammar for strategies
@pytest.mark.parametrize(
    "spec",
    [
        ["--strategy", "looped(group_size=2)"],
        ["--strategy", "looped", "--param", "group_size=2"],
        ["--strategy", "looped(group-size=2)"],
        ["--strategy", "looped(group_size=2)", "--param", "group_size=2"],
    ],
)
def test_simulate_takes_parameters_in_either_form(capsys, spec):
    code, out, _ = run(capsys, "simulate", *spec, "--json")
    result = json.loads(out)
    assert code == 0 and result["latency"] == 28 and result["params"]["group_size"] == 2


def test_compare_takes_parameters_in_its_list(capsys):
    code, out, _ = run(capsys, "compare", "--strategies", "gpipe, looped(group_size=2),looped(group_size=4)", "--json")
    assert code == 0
    assert {r["strategy"]: r["latency"] for r in json.loads(out)["results"]} == {
        "gpipe": 33, "looped(group_size=2)": 28, "looped(group_size=4)": 33
    }
    code, out, _ = run(capsys, "compare", "--strategies", "looped", "--param", "group_size=2", "--json")
    assert code == 0 and [r["strategy"] for r in json.loads(out)["results"]] == ["looped(group_size=2)"]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["compare", "--strategies", "gpipe,nope"], "unknown strategy 'nope'"),
        (["compare", "--strategies", "gpipe,looped(group_size=x)"], "group_size"),
        (["compare", "--strategies", "gpipe", "--param", "group_size=2"], "has no parameter 'group_size'"),
        (["compare", "--param", "group_size=2"], "--param needs --strategies"),
        (["compare", "--strategies", "gpipe,looped(group_size=2"], "unbalanced parentheses"),
        (["compare", "--strategies", ","], "names no strategy"),
        (["simulate", "--param", "group_size=2"], "--param needs --strategy"),
        (["simulate", "--out", "demo.png"], "--out needs --strategy"),
        (["simulate", "--strategy", "looped(group_size=2))"], "cannot read strategy 'looped(group_size=2))'"),
        (["simulate", "--time-unit", "ms"], "--time-unit needs --strategy"),
        (["simulate", "--strategy", "looped(group_size=2)", "--param", "group_size=4"], "give it once"),
        (["plan", "--param", "group_size=2"], "--param needs --strategy"),
        (["plan", "--strategy", "looped(group_size=2)", "--param", "group_size=4"], "give it once"),
        (["plan", "--strategy", "gpipe", "--memory-limit", "1,2"], "gives 2 numbers but there are 4 workers"),
        (["plan", "--strategy", "gpipe", "--memory-limit", "4,x"], "comma-separated numbers"),
        (["simulate", "--strategy", "gpipe", "--memory-limit", "1,2"], "--memory-limit gives 2 numbers"),
        (["compare", "--memory-limit", "nan"], "--memory-limit must be finite numbers >= 0"),
        (["simulate", "--strategy", "gpipe", "--memory-limit", "inf"], "--memory-limit must be finite numbers >= 0"),
    ],
)
def test_grammar_mistakes_are_errors(capsys, argv, words):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and words in err and "Traceback" not in err


@pytest.mark.parametrize("spec", [["--strategy", "looped(group_size=2)"], ["--strategy", "looped", "--param", "group_size=2"]])
def test_plan_takes_parameters_in_either_form(capsys, spec):
    code, out, _ = run(capsys, "plan", *spec, "--time-limit", "2", "--json")
    assert code == 0 and json.loads(out)["strategy"].startswith("looped(group_size=2)")


def test_plan_takes_a_memory_limit_per_worker(capsys):
    """Each worker plans under its own limit, as simulate takes them."""
    code, out, err = run(capsys, "plan", "--strategy", "gpipe", "--memory-limit", "4,3,2,1", "--time-limit", "2", "--json")
    result = json.loads(out)
    assert code == 0 and result["plan"]["memory_limit"] == [4, 3, 2, 1]
    assert result["plan"]["latency"] < 96, "the least limit, 1 on every worker, allows no better than 96"
    code, out, err = run(capsys, "plan", "--strategy", "gpipe", "--memory-limit", "4,3,2,1", "--time-limit", "2")
    assert code == 0 and "memory limit 4,3,2,1" in out and "least" not in err
    code, out, err = run(capsys, "plan", "--strategy", "gpipe", "--memory-limit", "3,3,3,3", "--time-limit", "2", "--json")
    assert code == 0 and json.loads(out)["plan"]["memory_limit"] == 3 and "note" not in err


# ---------------------------------------------------------------------- output and errors
class _ClosedPipe:
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_reader_that_goes_away_is_no_error(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    code = main(["simulate", "--strategy", "gpipe"])
    monkeypatch.undo()
    _, err = capsys.readouterr()
    assert code == 0 and err == ""


def test_piped_into_a_reader_that_closes():
    process = subprocess.Popen([sys.executable, "-m", "unisched", "simulate", "--strategy", "gpipe"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # as `| head -1` does once it has its line
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0 and err == ""


@pytest.mark.parametrize(
    "argv, words, kind",
    [
        (["simulate", "--strategy", "nope"], "unknown strategy", "UnknownStrategyError"),
        (["simulate", "-W", "x"], "invalid int value", "CommandLineError"),
        (["compare", "--strategies", "gpipe,nope"], "unknown strategy", "UnknownStrategyError"),
        (["plan", "--comm", "nan"], "--comm", "PlanInputError"),
    ],
)
def test_errors_under_json_are_one_json_object_on_stderr(capsys, argv, words, kind):
    try:
        code, out, err = run(capsys, *argv, "--json")
    except SystemExit as exit:  # argparse's complaints exit as argparse does
        code, (out, err) = exit.code, capsys.readouterr()
    error = json.loads(err)
    assert code == 2 and out == ""
    assert words in error["error"] and error["type"] == kind and error["details"] == []


def test_the_demo_under_json_is_pure_json(capsys):
    code, out, _ = run(capsys, "--json")
    assert code == 0 and len(json.loads(out)["results"]) >= 4


def test_a_deadlock_is_summed_up_on_its_first_line(capsys):
    code, out, err = run(capsys, "simulate", "--strategy", "cuckoo", "--memory-limit", "1")
    first, *details = err.splitlines()
    assert code == 2 and out == ""
    assert first.startswith("unisched: error: deadlock:") and "To fix:" in first
    assert details and all(line.startswith("  worker ") for line in details)
    code, _, err = run(capsys, "simulate", "--strategy", "cuckoo", "--memory-limit", "1", "--json")
    error = json.loads(err)
    assert "To fix:" in error["error"] and error["details"][0].startswith("worker ")


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--nnodes", "x", "--rdzv-endpoint", "h:1"], "--nnodes 'x': give a number of nodes N >= 1"),
        (["--nnodes", "0", "--rdzv-endpoint", "h:1"], "--nnodes '0'"),
        (["--nnodes", "-1", "--rdzv-endpoint", "h:1"], "--nnodes '-1'"),
        (["--nnodes", "3:2", "--rdzv-endpoint", "h:1"], "1 <= MIN <= MAX"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "-1"], "a node's rank lies in 0..1"),
        (["--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--node-rank", "2"], "a node's rank lies in 0..1"),
        (["--node-rank", "1"], "--node-rank 1 is for runs on several nodes"),
    ],
)
def test_run_refuses_nodes_torchrun_would_refuse_after_starting(capsys, flags, words):
    code, out, err = run(capsys, "run", "--dry-run", *flags)
    assert code == 2 and out == "" and words in err and "Traceback" not in err


def test_run_dry_run_passes_the_nodes_on_to_torchrun(capsys):
    code, out, _ = run(capsys, "run", "-W", "2", "--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--node-rank", "1",
                       "--dry-run")
    command = shlex.split(out)
    assert code == 0 and command[command.index("--nnodes") + 1] == "1:2"
    assert command[command.index("--node-rank") + 1] == "1" and command[command.index("--nproc-per-node") + 1] == "2"


def test_simulate_priority_is_reported_as_run_and_refused_where_it_changes_nothing(capsys):
    code, out, _ = run(capsys, "simulate", "--strategy", "gpipe", "--priority", "oldest_stage_first", "--json")
    assert code == 0 and json.loads(out)["params"]["priority"] == "oldest_stage_first"
    assert json.loads(out)["worker_stats"]["max_activation_storage"] == [8, 8, 8, 8]  # fill-drain: it did run
    code, out, err = run(capsys, "simulate", "--strategy", "zb_h1", "--priority", "backward_first")
    assert code == 2 and out == "" and "'zb_h1' fixes every worker's order" in err and "the command's --priority" in err


def test_simulate_gpipe_takes_as_its_parameter_every_priority_the_command_reports(capsys):
    code, out, _ = run(capsys, "simulate", "--strategy", "gpipe", "--priority", "backward_first", "--json")
    reported = json.loads(out)
    assert code == 0 and reported["params"] == {"priority": "backward_first"}
    code, out, err = run(capsys, "simulate", "--strategy", "gpipe", "--param", "priority=backward_first", "--json")
    assert code == 0, err
    assert json.loads(out)["latency"] == reported["latency"] and json.loads(out)["params"] == reported["params"]


def test_simulate_priority_is_reported_where_the_strategy_has_no_priority_of_its_own(capsys):
    code, out, _ = run(capsys, "simulate", "--strategy", "fsdp", "-B", "4", "--json")
    assert code == 0 and json.loads(out)["params"] == {}
    code, out, _ = run(capsys, "simulate", "--strategy", "fsdp", "-B", "4", "--priority", "backward_first", "--json")
    assert code == 0 and json.loads(out)["params"] == {"priority": "backward_first"}


def test_every_strategy_that_leaves_its_order_open_takes_the_priority_it_is_reported_with(capsys):
    """looped has no priority of its own; run with --priority it reports priority among its
    parameters, and given that parameter it runs the same (fill-drain here: 27, not the default's
    28); a strategy that fixes every worker's order refuses it."""
    shape = ["-W", "2", "-S", "4", "-B", "4", "--json"]
    default = json.loads(run(capsys, "simulate", "--strategy", "looped", *shape)[1])
    code, out, err = run(capsys, "simulate", "--strategy", "looped", "--priority", "oldest_stage_first", *shape)
    flag = json.loads(out)
    assert code == 0 and flag["params"] == {"group_size": 2, "priority": "oldest_stage_first"}, err
    code, out, err = run(capsys, "simulate", "--strategy", "looped(group_size=2, priority=Oldest-Stage-First)", *shape)
    assert code == 0, err
    given = json.loads(out)
    assert given["params"] == flag["params"] and given["latency"] == flag["latency"] == 27 < default["latency"]
    code, out, err = run(capsys, "simulate", "--strategy", "zb_h1(priority=backward_first)")
    assert code == 2 and out == "" and "'zb_h1' fixes every worker's order" in err and "drop priority=backward_first" in err


def test_simulate_refuses_two_priorities_and_reads_a_priority_parameter_as_the_flag_does(capsys):
    code, out, err = run(capsys, "simulate", "--strategy", "gpipe(priority=backward_first)", "--priority",
                         "oldest_stage_first", "--json")
    assert code == 2 and out == "" and "priority=backward_first and --priority oldest_stage_first" in err
    for given in ("backward_first", "'backward_first'", "Backward-First"):  # one value, however written
        code, out, _ = run(capsys, "simulate", "--strategy", f"gpipe(priority={given})", "--priority",
                           "Backward-First", "--json")
        assert code == 0 and json.loads(out)["params"] == {"priority": "backward_first"}
    flag = json.loads(run(capsys, "simulate", "--strategy", "gpipe", "--priority", "oldest_stage_first", "--json")[1])
    for given in ("Oldest-Stage-First", "'oldest_stage_first'", '"oldest_stage_first"'):
        code, out, err = run(capsys, "simulate", "--strategy", f"gpipe(priority={given})", "--json")
        assert code == 0, err
        assert json.loads(out)["params"] == flag["params"] and json.loads(out)["latency"] == flag["latency"]
        assert json.loads(out)["worker_stats"] == flag["worker_stats"]
    code, _, err = run(capsys, "simulate", "--strategy", "gpipe(priority=newest)")
    assert code == 2 and "must be one of oldest_batch_first" in err
    # the flag in quotes, and a parameter given both ways in two spellings: one name, one rule (work.name_key)
    code, out, err = run(capsys, "simulate", "--strategy", "gpipe", "--priority", "'backward_first'", "--json")
    assert code == 0 and json.loads(out)["params"] == {"priority": "backward_first"}, err
    code, out, err = run(capsys, "simulate", "--strategy", "gpipe(priority=backward-first)", "--param",
                         "priority=backward_first", "--json")
    assert code == 0 and json.loads(out)["params"] == {"priority": "backward_first"}, err


def test_compare_breaks_ties_by_priority_where_a_strategy_leaves_them_open(capsys):
    """--priority reaches every strategy compared that leaves its order open, as simulate's does,
    and leaves one that fixes every worker's order as it is; given twice, differently, it is refused."""
    shape = ["-W", "2", "-S", "4", "-B", "4", "--json"]

    def compared(*flags):
        code, out, err = run(capsys, "compare", "--strategies", "looped,zbv", *flags, *shape)
        assert code == 0, err
        return {row["strategy"]: row["latency"] for row in json.loads(out)["results"]}, json.loads(out)["priority"]

    by_stage, priority = compared("--priority", "oldest_stage_first")
    assert priority == "oldest_stage_first" and compared() == ({"looped": 28, "zbv": 25}, None)
    for name, flags in (("looped", ["--priority", "oldest_stage_first"]), ("zbv", [])):
        code, out, err = run(capsys, "simulate", "--strategy", name, *flags, *shape)
        assert code == 0 and json.loads(out)["latency"] == by_stage[name], err
    assert by_stage["looped"] == 27
    code, out, err = run(capsys, "compare", "--strategies", "zbv,looped(priority=backward_first)", "--priority",
                         "oldest_stage_first", *shape)
    assert code == 2 and out == "" and "give the priority once" in err and "skipped" not in err


@pytest.mark.parametrize("strategies, flags, words", [
    ("gpipe,looped(group_size=0)", [], "group_size must be a positive integer"),  # whatever the shape
    ("gpipe,one_f_one_b", ["--param", "priority=backward_first"], "fixes every worker's order"),
    ("gpipe(priority=backward_first),one_f_one_b", ["--priority", "oldest_batch_first"], "give the priority once"),
])
def test_compare_refuses_a_value_no_shape_takes_before_any_row_not_as_a_skipped_row(capsys, strategies, flags, words):
    """Skipped rows are for strategies that do not fit the shape; a parameter no shape can take,
    or given two ways, is the command's error (it was a skipped row and exit 0)."""
    code, out, err = run(capsys, "compare", "-W", "2", "-S", "2", "-B", "4", "--strategies", strategies, *flags)
    assert code == 2 and out == "" and words in err
    code, out, err = run(capsys, "compare", "-W", "2", "-S", "2", "-B", "4", "--strategies", "gpipe,looped(group_size=3)")
    assert code == 0 and "skipped looped(group_size=3)" in out  # W = 2 cannot form groups of 3: a misfit


def test_compare_priority_over_every_strategy_gives_gpipe_one_row_and_keeps_a_designed_order(capsys):
    """Without --strategies gpipe's grid tries each priority; with --priority it is one row, run with
    the flag's.  looped_bfs orders its work by a priority of its own design: compared as it is, and
    its priority= refused as a fixed order's is."""
    code, out, err = run(capsys, "compare", "--priority", "'Backward-First'", "--json")
    assert code == 0, err
    compared = json.loads(out)
    names = [row["strategy"] for row in compared["results"]]
    assert compared["priority"] == "backward_first" and names.count("gpipe") == 1
    code, out, _ = run(capsys, "simulate", "--strategy", "gpipe", "--priority", "backward_first", "--json")
    assert json.loads(out)["latency"] == next(r["latency"] for r in compared["results"] if r["strategy"] == "gpipe")
    shape = ["-W", "2", "-S", "4", "-B", "4", "--json"]
    code, out, err = run(capsys, "simulate", "--strategy", "looped_bfs", *shape)
    designed = json.loads(out)["latency"]
    code, out, err = run(capsys, "compare", "--strategies", "looped_bfs", "--priority", "oldest_batch_first", *shape)
    assert code == 0 and json.loads(out)["results"][0]["latency"] == designed == 27, err
    code, out, err = run(capsys, "simulate", "--strategy", "looped_bfs(priority=oldest_batch_first)", *shape)
    assert code == 2 and "orders its work by a priority of its own" in err


def test_an_unknown_priority_is_a_unisched_error():
    from unisched import policies

    with pytest.raises(unisched.UniSchedError, match="unknown priority 'nope'"):
        unisched.simulate(4, 4, 8, policies.get("gpipe", 4, 4, 8), "nope")


@pytest.mark.parametrize("verb, flag", [
    *[(["simulate", "--strategy", "gpipe"], flag) for flag in ("--topology", "--costs", "--priority", "--out")],
    (["simulate"], "--strategy"), (["simulate"], "--plan"), (["compare"], "--strategies"), (["compare"], "--priority"),
    *[(["plan", "-W", "2", "-S", "2", "-B", "2"], flag) for flag in ("--topology", "--costs", "--strategy", "--out")],
    *[(["run", "--dry-run", "-W", "2"], flag) for flag in ("--strategy", "--plan", "--timeline", "--checkpoint",
                                                           "--resume")],
])
def test_an_empty_name_is_refused_not_read_as_the_flag_left_out(capsys, verb, flag):
    """An unset shell variable (`--plan "$PLAN"`) gives an empty value: refused before anything
    runs, where it was read as no plan, no checkpoints or no resume and the run went on."""
    with pytest.raises(SystemExit) as exited:  # as argparse exits
        run(capsys, *verb, flag, "")
    code, (out, err) = exited.value.code, capsys.readouterr()
    assert code == 2 and out == "" and f"argument {flag}: was given an empty value" in err


def test_a_bad_width_is_refused_before_anything_runs_or_is_written(capsys, tmp_path):
    drawing = tmp_path / "a.png"
    code, out, err = run(capsys, "simulate", "--strategy", "gpipe", "--out", str(drawing), "--width", "5")
    assert code == 2 and out == "" and "--width must be a whole number of at least 24" in err
    assert not drawing.exists()
    code, out, err = run(capsys, "simulate", "--strategy", "gpipe", "--json", "--width", "5")
    assert code == 2 and out == "" and "--width" in err
    code, out, err = run(capsys, "plan", "-W", "2", "-S", "2", "-B", "2", "--width", "5")
    assert code == 2 and out == "" and "--width" in err and "family search" not in err


def test_simulate_on_a_topology_takes_the_cost_flags(capsys):
    code, out, err = run(capsys, "simulate", "--strategy", "gpipe", "--topology", "dgx_h100", "--forward", "0.5",
                         "--backward", "1", "--json")
    result = json.loads(out)
    assert code == 0 and result["topology"]["name"] and result["lower_bounds"]["shape"] == pytest.approx(8 * 1.5)  # B (F + B)
    code, out, err = run(capsys, "simulate", "--strategy", "gpipe", "--topology", "dgx_h100")
    assert code == 0 and "on dgx_h100: 1 node(s) x 4 devices, 8 NICs per node, all-reduces as rings" in out


def test_plan_report_names_the_topology_as_simulate_does(capsys):
    code, out, err = run(capsys, "plan", "--strategy", "gpipe", "--topology", "dgx_h100", "--time-limit", "5")
    assert code == 0, err
    assert "on dgx_h100: 1 node(s) x 4 devices, 8 NICs per node, all-reduces as rings; latencies are replays" in out


def test_simulate_topology_flag_replaces_the_costs_files_topology(capsys, tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"topology": "dgx_h100", "activation_bytes": 1e6}))
    code, out, err = run(capsys, "simulate", "--strategy", "gpipe", "--costs", str(costs), "--topology", "dgx_a100",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["topology"]["name"] == "dgx_a100"


def test_a_costs_file_reads_the_topology_file_it_names_from_its_own_folder(capsys, tmp_path, monkeypatch):
    preset = json.loads((Path(unisched.__file__).parent / "topologies" / "dgx_h100.json").read_text())
    (tmp_path / "mine.json").write_text(json.dumps({**preset, "name": "mine"}))
    (tmp_path / "costs.json").write_text(json.dumps({"topology": "mine.json", "activation_bytes": 1e6}))
    monkeypatch.chdir(tmp_path.parent)  # not the costs file's folder
    code, out, err = run(capsys, "simulate", "--strategy", "gpipe", "--costs", str(tmp_path / "costs.json"), "--json")
    assert code == 0, err
    assert json.loads(out)["topology"]["name"] == "mine"


def test_plan_refuses_an_out_file_in_no_folder_before_planning(capsys, tmp_path):
    missing = tmp_path / "no-such-folder" / "plan.json"
    code, out, err = run(capsys, "plan", "--strategy", "gpipe", "--out", str(missing), "--time-limit", "60")
    assert code == 2 and out == "" and f"there is no folder '{missing.parent}'" in err
    assert "family search" not in err  # refused before the search began


def test_compare_refuses_a_strategy_named_twice_and_lists_each_by_its_own_name(capsys):
    for listed, first, second in (("gpipe,gpipe", "gpipe", "gpipe"),
                                  ("gpipe,gpipe(priority=oldest_batch_first)", "gpipe",
                                   "gpipe(priority=oldest_batch_first)"),
                                  ("dualpipe_v,DualPipeV", "dualpipe_v", "DualPipeV")):
        code, out, err = run(capsys, "compare", "-W", "4", "--strategies", listed)
        assert code == 2 and f"names {first!r} and {second!r}, the same strategy; name it once" in err
    code, out, err = run(capsys, "compare", "-W", "4", "--strategies", "GPipe,one-f-one-b,gpipe(priority=oldest_stage_first)",
                         "--json")
    assert code == 0 and sorted(row["strategy"] for row in json.loads(out)["results"]) == [
        "gpipe", "gpipe(priority=oldest_stage_first)", "one_f_one_b"]


def test_simulate_draws_a_text_file_as_wide_as_asked(capsys, tmp_path):
    code, out, err = run(capsys, "simulate", "--strategy", "gpipe", "--width", "50", "--out", str(tmp_path / "w.txt"))
    assert code == 0 and max(len(line) for line in (tmp_path / "w.txt").read_text().splitlines()) <= 50  # was 100
    sim = unisched.simulate(2, 2, 2, unisched.policies.get("gpipe", 2, 2, 2))
    sim.save(tmp_path / "c.txt", color=True)
    sim.save(tmp_path / "plain.txt")
    colored = (tmp_path / "c.txt").read_text()
    assert "\x1b[" in colored and "\x1b[" not in (tmp_path / "plain.txt").read_text()


def test_plan_names_a_costs_file_for_another_stage_count_as_simulate_does(capsys, tmp_path):
    path = tmp_path / "c2.json"
    path.write_text(json.dumps({"forward": [1, 1], "backward": [2, 2]}))
    for verb in (["plan", "--time-limit", "1"], ["simulate", "--strategy", "gpipe"]):
        code, out, err = run(capsys, *verb, "-W", "4", "-S", "4", "--costs", str(path))
        assert code == 2 and f"costs file {path}: Costs.forward has 2 entries" in err and "fix the file or the shape" in err


def test_simulate_refuses_an_out_path_it_cannot_write_before_writing_any(capsys, tmp_path):
    (tmp_path / "folder.png").mkdir()
    for bad, said in ((tmp_path / "no" / "x.png", "there is no folder"), (tmp_path / "folder.png", "is a folder")):
        code, out, err = run(capsys, "simulate", "--strategy", "gpipe", "--out", str(tmp_path / "ok.html"),
                             "--out", str(bad))
        assert code == 2 and said in err and not (tmp_path / "ok.html").exists()


def test_plan_refuses_an_out_file_that_is_a_folder_before_planning(capsys, tmp_path):
    folder = tmp_path / "plan.json"
    folder.mkdir()
    code, out, err = run(capsys, "plan", "--strategy", "gpipe", "--out", str(folder), "--time-limit", "60")
    assert code == 2 and out == "" and f"--out {folder} is a folder" in err
    assert "family search" not in err


def test_plan_prints_its_answer_before_a_file_it_cannot_write(capsys, tmp_path, monkeypatch):
    from unisched.plan.planfile import Plan

    def full(self, path, **options):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(Plan, "save", full)
    code, out, err = run(capsys, "plan", "-W", "2", "-S", "2", "-B", "2", "--out", str(tmp_path / "plan.json"))
    assert code == 2 and "No space left on device" in err
    assert "best: " in out  # the search's answer is not lost


def test_your_own_strategy_that_fails_is_an_error_naming_it(capsys, tmp_path):
    mine = tmp_path / "mine.py"
    mine.write_text("def crashes(work):\n    raise RuntimeError('boom')\n\n"
                    "def factory(num_workers, num_stages, num_batches):\n    raise ValueError('nope')\n")
    code, out, err = run(capsys, "compare", "--strategies", f"{mine}:crashes,gpipe", "-W", "2", "-B", "2")
    assert code == 2 and out == "" and f"strategy '{mine}:crashes' failed on" in err and "RuntimeError: boom" in err
    code, out, err = run(capsys, "simulate", "--strategy", f"{mine}:factory", "-W", "2", "-B", "2")
    assert code == 2 and f"strategy factory '{mine}:factory' failed on W=2, S=2, B=2: ValueError: nope" in err


def test_simulate_time_unit_takes_a_number_of_seconds(capsys, tmp_path):
    path = tmp_path / "trace.json"
    code, _, err = run(capsys, "simulate", "--strategy", "gpipe", "--out", str(path), "--time-unit", "1e-3")
    events = json.loads(path.read_text())["traceEvents"]
    assert code == 0, err
    assert max(e["ts"] + e["dur"] for e in events if e["ph"] == "X") == pytest.approx(33e3)  # 33 ms in us


def test_simulate_writes_every_out_given_and_refuses_a_time_unit_without_a_trace(capsys, tmp_path):
    text, trace = tmp_path / "d.txt", tmp_path / "d.json"
    code, out, err = run(capsys, "simulate", "--strategy", "gpipe", "--out", str(text), "--out", str(trace),
                         "--time-unit", "ms")
    assert code == 0, err
    assert f"wrote {text}" in out and f"wrote {trace}" in out
    assert text.read_text().startswith("gpipe: W=4 S=4 B=8, latency 33")
    assert max(e["ts"] + e["dur"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X") \
        == pytest.approx(33e3)  # 33 ms in us
    code, _, err = run(capsys, "simulate", "--strategy", "gpipe", "--out", str(text), "--time-unit", "ms")
    assert code == 2 and "--time-unit ms sets the unit of a Chrome trace: give --out FILE.json" in err


@pytest.mark.parametrize("argv", [["run", "--dry-run", "--strategy", "zb_h1", "-B", "100000000"],
                                  ["run", "--program", "--strategy", "zbv", "-W", "2", "-B", "30000000"],
                                  ["plan", "--strategy", "zb_h1", "-B", "100000000", "--time-limit", "5"]])
def test_a_shape_too_large_is_refused_before_any_strategy_is_built_for_it(capsys, monkeypatch, argv):
    """zb_h1's factory alone would allocate gigabytes for 10^8 micro-batches."""
    from unisched import policies

    monkeypatch.setattr(policies, "get", lambda *a, **k: pytest.fail("built a strategy for a shape too large"))
    monkeypatch.setattr(policies, "fits", lambda *a, **k: pytest.fail("built a strategy for a shape too large"))
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and "work items" in err and "at most" in err


def test_compare_where_no_strategy_fits_is_an_error_with_every_reason(capsys):
    code, out, err = run(capsys, "compare", "--strategies", "gpipe,ddp", "-W", "3", "-S", "5", "-B", "2", "--json")
    error = json.loads(err)
    assert code == 2 and out == "" and "no strategy could be simulated on W=3, S=5, B=2" in error["error"]
    assert [line.split(":")[0] for line in error["details"]] == ["gpipe", "ddp"]


@pytest.mark.parametrize("flags, whole, halves", [
    (["--backward-input", "1", "--backward-weight", "2"], 3.0, (1.0, 2.0)),  # the whole is their sum
    (["--backward-input", "1.5"], 4.0, (1.5, 2.5)),  # one half: the other is what remains of the file's whole
    (["--backward", "6"], 6.0, (None, None)),  # the whole alone replaces the file's halves
    (["--backward", "5", "--backward-input", "1"], 5.0, (1.0, 4.0)),
])
def test_time_flags_put_into_a_costs_file_read_alike_in_every_verb(capsys, tmp_path, flags, whole, halves):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"forward": 2.0, "backward_input": 1.0, "backward_weight": 3.0}))
    expected = 8 * (2.0 + whole)
    for verb in (["simulate", "--strategy", "gpipe"], ["plan", "--strategy", "gpipe", "--time-limit", "2"]):
        assert main([*verb, "-W", "1", "-S", "1", "-B", "8", "--costs", str(costs), *flags, "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["latency"] == pytest.approx(expected), verb  # one worker: the step is all its work
    planned = result["plan"]["costs"]  # the plan's own record of the costs it was made with
    assert (planned["backward"], planned["backward_input"], planned["backward_weight"]) == (whole, *halves)  # exact


def test_an_unknown_option_is_refused_with_the_verbs_own_usage(capsys):
    for verb in ("simulate", "compare", "plan", "strategies"):
        with pytest.raises(SystemExit) as exited:  # as argparse exits
            main([verb, "--bogus"])
        out, err = capsys.readouterr()
        assert exited.value.code == 2 and out == ""
        assert err.startswith(f"usage: unisched {verb}") and f"unisched {verb}: error: unrecognized arguments: --bogus" in err


def test_a_costs_file_that_does_not_fit_the_shape_is_named_once(capsys, tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text('{"worker_speed": [1, 1]}')
    for verb in (["compare"], ["simulate", "--strategy", "gpipe"]):
        code, out, err = run(capsys, *verb, "--costs", str(costs))
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
        assert f"costs file {costs}: Costs.worker_speed has 2 entries but there are 4 workers" in err


def test_every_out_name_is_checked_before_anything_is_written(capsys, tmp_path):
    first = tmp_path / "a.png"
    code, _, err = run(capsys, "simulate", "--strategy", "gpipe", "--out", str(first), "--out", str(tmp_path / "b.xyz"))
    assert code == 2 and "extension '.xyz' is not supported" in err and not first.exists()
    code, _, err = run(capsys, "simulate", "--strategy", "gpipe", "--out", ".")
    assert code == 2 and "cannot save '.': it has no extension" in err


def test_every_verb_reads_the_link_flags_as_plan_does(capsys):
    latencies = []
    for verb in (["simulate", "--strategy", "gpipe"], ["compare", "--strategies", "gpipe"],
                 ["plan", "--strategy", "gpipe", "--time-limit", "1"]):
        code, out, _ = run(capsys, *verb, "--comm", "1", "--json")
        found = json.loads(out)
        latencies.append(found["results"][0]["latency"] if "results" in found else found["latency"])
        assert code == 0
    # gpipe at W = S = 4, B = 8, each transfer 1: 33 + 2 * 3 on the critical path; plan's best order of gpipe's
    # mapping under the same costs is no shorter (33 would mean it read no --comm)
    assert latencies == [39, 39, 39]
    code, _, err = run(capsys, "simulate", "--strategy", "gpipe", "--comm", "1", "--topology", "dgx_h100")
    assert code == 2 and "drop --comm" in err


def test_a_topology_without_sizes_says_its_bandwidths_play_no_part(capsys, tmp_path):
    code, out, _ = run(capsys, "simulate", "--strategy", "gpipe", "--topology", "dgx_h100")
    assert code == 0 and "no sizes given, so every transfer takes only its route's latency" in out
    costs = tmp_path / "costs.json"
    costs.write_text('{"activation_bytes": 1e6, "weight_bytes": 1e8}')
    code, out, _ = run(capsys, "simulate", "--strategy", "gpipe", "--topology", "dgx_h100", "--costs", str(costs))
    assert code == 0 and "on dgx_h100" in out and "no sizes given" not in out


def test_the_demo_says_the_costs_it_ran_with(capsys):
    code, out, _ = run(capsys, "--forward", "2", "--comm", "1")
    assert code == 0 and out.splitlines()[0].endswith("(forward 2, comm 1; otherwise forward 1, backward 2)")
    code, out, _ = run(capsys)
    assert code == 0 and out.splitlines()[0].endswith("(forward 1, backward 2)")


def test_the_halves_split_the_backward_as_simulate_splits_it_from_the_costs(capsys):
    import unisched

    halves = ["--backward-input", "1", "--backward-weight", "1"]
    for name in ("gpipe", "one_f_one_b", "zb_h1"):
        code, out, _ = run(capsys, "simulate", "--strategy", name, *halves, "--json")
        strategy = unisched.policies.get(name, num_workers=4, num_stages=4, num_batches=8)
        python = unisched.simulate(4, 4, 8, strategy, costs=unisched.Costs(backward_input=1, backward_weight=1))
        assert code == 0 and json.loads(out)["latency"] == python.latency, name


@pytest.mark.parametrize("as_json", [False, True])
def test_ctrl_c_outside_a_search_is_one_line_not_a_traceback(capsys, monkeypatch, as_json):
    import unisched.cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(unisched.cli, "_simulate", interrupted)  # e.g. while a strategy file imports
    code, out, err = run(capsys, "simulate", "--strategy", "gpipe", *(["--json"] if as_json else []))
    assert code == 130 and out == "" and "Traceback" not in err
    if as_json:
        assert json.loads(err)["type"] == "KeyboardInterrupt"
    else:
        assert err == "unisched: error: interrupted (Ctrl-C) before an answer was ready\n"


def test_compare_leaves_a_priority_parameter_of_the_users_own_factory_to_it(capsys, tmp_path):
    """--priority beside NAME(priority=...) is one priority given twice for a registry strategy;
    a factory of the user's own may have a parameter of that name that means something else."""
    (tmp_path / "mine.py").write_text(
        "from unisched import ComputeAndWeightWorkers\n"
        "def factory(num_workers, num_stages, num_batches, priority='x'):\n"
        "    return lambda work: ComputeAndWeightWorkers(work.stage % num_workers, work.stage % num_workers)\n")
    code, out, err = run(capsys, "compare", "-W", "2", "-S", "2", "-B", "4", "--strategies",
                         f"gpipe,{tmp_path}/mine.py:factory(priority=abc)", "--priority", "backward_first")
    assert code == 0 and "mine.py:factory" in out, err


def test_compare_refuses_two_names_of_one_strategy_once_its_defaults_are_resolved(capsys):
    """looped's group_size defaults to the largest divisor of W up to S: at W = 2 that is 2, so
    looped and looped(group_size=2) are one strategy (two identical rows before); at W = 4 two."""
    code, out, err = run(capsys, "compare", "-W", "2", "-S", "2", "-B", "4", "--strategies", "looped,looped(group_size=2)")
    assert code == 2 and out == "" and "the same strategy on this shape" in err
    code, out, err = run(capsys, "compare", "-W", "4", "-S", "4", "-B", "8", "--strategies", "looped,looped(group_size=2)")
    assert code == 0 and "2 strategies" in out, err
