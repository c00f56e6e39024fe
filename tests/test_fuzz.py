"""Hypothesis over costs, plan files and command lines: every input ends in a
result that makes sense or in one of unisched's own errors (on the command
line: exit status 2), never in a traceback or a silently wrong number."""

import contextlib
import copy
import functools
import io
import json
import math
import re
import shlex

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import unisched
from unisched import Costs, Link, UniSchedError, simulate
from unisched.cli import main
from unisched.plan import plan
from unisched.plan.planfile import plan_from_dict

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------------- values a user might type
odd_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1.0, 2.5, -1.0, 1e-300, 1e300, 5e-324, math.nan, math.inf, -math.inf]),
    st.integers(-3, 10),
    st.sampled_from([10**400, 2**63]),
)
odd_values = st.one_of(odd_numbers, st.none(), st.booleans(), st.text(max_size=3),
                       st.lists(odd_numbers, max_size=4), st.lists(st.lists(odd_numbers, max_size=2), max_size=2))
links = st.dictionaries(
    st.one_of(st.tuples(st.integers(-1, 4), st.integers(-1, 4)), st.sampled_from(["0,1", "1,0", "0,7", "a,b", "1"]),
              st.integers(0, 3)),
    st.one_of(st.builds(Link, latency=odd_values, bandwidth=odd_values),
              st.dictionaries(st.sampled_from(["latency", "bandwidth", "bw"]), odd_values, max_size=2), odd_values),
    max_size=3,
)
cost_fields = st.fixed_dictionaries(
    {},
    optional={
        "forward": odd_values, "backward": odd_values, "backward_input": odd_values, "backward_weight": odd_values,
        "worker_speed": odd_values, "activation_bytes": odd_values, "stash_bytes": odd_values,
        "weight_bytes": odd_values, "latency": odd_values, "bandwidth": odd_values, "links": links,
        "prefetch_depth": st.one_of(st.integers(-1, 3), odd_values), "cache_weights": st.one_of(st.booleans(), odd_values),
        "input_grad_frees": odd_values, "backward_workspace_bytes": odd_values, "optimizer_bytes": odd_values,
    },
)
# (strategy, W -> (S, B)): shapes each strategy fits, with a split backward (zb_h1) among them
STRATEGY_SHAPES = {
    "gpipe": lambda W, B: (W, B), "fsdp": lambda W, B: (2, W), "one_f_one_b": lambda W, B: (W, B),
    "zb_h1": lambda W, B: (W, B), "looped": lambda W, B: (2 * W, B),
}


def assert_sane(sim) -> None:
    """A simulated step that is a step: finite times, every rule kept, no shorter than its bound."""
    latency = sim.latency
    assert math.isfinite(latency) and latency >= 0, latency
    sim.timeline.check()
    assert sim.lower_bounds["shape"] <= latency * (1 + 1e-9) + 1e-12, (sim.lower_bounds, latency)


def simulated_or_refused(costs_of, name, W, B, split, memory_limit):
    """``simulate`` with the costs ``costs_of()`` builds: a sane step, or one of unisched's errors."""
    try:
        costs = costs_of()
    except UniSchedError:
        return
    S, B = STRATEGY_SHAPES[name](W, B)
    strategy = unisched.policies.get(name, W, S, B)
    try:
        sim = simulate(W, S, B, strategy, costs=costs, split_backward=split, memory_limit=memory_limit)
    except UniSchedError:
        return
    assert_sane(sim)


strategy_names = st.sampled_from(sorted(STRATEGY_SHAPES))
limit_numbers = st.one_of(odd_numbers, st.sampled_from([0.5, "2", "x", True, None, {"workers": 1}]))
memory_limits = st.one_of(st.none(), st.none(), limit_numbers, st.lists(limit_numbers, min_size=1, max_size=3))


@FUZZ
@given(fields=cost_fields, name=strategy_names, W=st.integers(1, 3), B=st.integers(1, 3),
       split=st.sampled_from([None, False, True]), memory_limit=memory_limits)
def test_costs_make_a_valid_step_or_a_clear_error(fields, name, W, B, split, memory_limit):
    simulated_or_refused(lambda: Costs(**fields), name, W, B, split, memory_limit)


json_text = st.sampled_from(["nan", "inf", "-1", "1", "", "1e400", "0,1"])
json_link = st.dictionaries(st.sampled_from(["latency", "bandwidth"]), st.one_of(odd_values, json_text), max_size=2)
json_links = st.dictionaries(st.sampled_from(["0,1", "1,0", "0,0", "x", "0,1,2", ""]),
                             st.one_of(odd_values, json_text, json_link), max_size=2)
costs_json = st.dictionaries(
    st.sampled_from(["forward", "backward", "backward_input", "backward_weight", "worker_speed", "activation_bytes",
                     "latency", "bandwidth", "links", "prefetch_depth", "cache_weights", "speed", "Forward"]),
    st.one_of(odd_values, json_text, json_links),
    max_size=4,
)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@FUZZ
@given(data=st.one_of(costs_json, odd_values), name=strategy_names, W=st.integers(1, 3),
       split=st.sampled_from([None, True]))
def test_a_costs_file_makes_a_valid_step_or_a_clear_error(scratch, data, name, W, split):
    """What ``Costs.load`` reads: JSON, where a number may arrive as a string and a key misspelt."""
    path = scratch / "costs.json"
    path.write_text(json.dumps(data))  # Python's json writes NaN and Infinity, as a careless writer would
    simulated_or_refused(lambda: Costs.load(path), name, W, 2, split, None)


# ---------------------------------------------------------------------- plan files
@functools.lru_cache(maxsize=1)
def saved_plans() -> tuple[dict, dict]:
    """Two plan files as JSON: a whole backward under a memory limit, and a split one with sizes and a link."""
    whole = plan(2, 2, 3, memory_limit=2, strategy="gpipe", time_limit=5)
    split = plan(2, 2, 2, Costs(backward_input=1, backward_weight=1, activation_bytes=2, bandwidth=4,
                                links={(0, 1): Link(latency=0.5)}), strategy="zb_h1", time_limit=5)
    return tuple(json.loads(json.dumps(p.to_dict())) for p in (whole, split))


def paths(value, prefix=()):
    """Every place in a JSON value that an edit can reach."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths(item, (*prefix, index))


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), odd_numbers, st.text(max_size=4),
              st.sampled_from(["0F0", "1B2", "0", "gpipe", "unisched-plan"])),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
DELETE = object()


@FUZZ
@given(data=st.data())
def test_an_edited_plan_file_is_refused_or_what_it_says(data):
    edited = copy.deepcopy(data.draw(st.sampled_from(saved_plans())))
    places = [p for p in paths(edited) if p]
    for _ in range(data.draw(st.integers(1, 3))):
        place = data.draw(st.sampled_from(places))
        value = data.draw(st.one_of(json_values, st.just(DELETE)))
        parent = edited
        try:
            for key in place[:-1]:
                parent = parent[key]
            if value is DELETE:
                del parent[place[-1]]
            else:
                parent[place[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed the place
    try:
        loaded = plan_from_dict(edited)
    except UniSchedError:
        return
    replay = loaded.simulate()
    assert_sane(replay)
    assert loaded.latency == replay.latency
    assert loaded.lower_bound <= loaded.latency * (1 + 1e-9)
    assert not loaded.optimal or loaded.lower_bound >= loaded.latency * (1 - 1e-9)


# ---------------------------------------------------------------------- command lines
def flag(name, good, bad=()):
    """A flag and a value: a sensible one four times in five, so that whole runs happen too."""
    return st.tuples(st.just(name), st.sampled_from([*good, *good, *good, *good, *bad] if bad else list(good)))


def switch(name):
    return st.just((name,))


numbers_good = ("0", "1", "2.5", "0.25")
numbers_bad = ("-1", "nan", "inf", "1e300", "1e-300", "x", "")
shape = (("1", "2", "3", "4"), ("0", "-1", "x", "2.5", "1e3", "100000000"))
shape_flags = [flag("-W", *shape), flag("-S", *shape), flag("-B", *shape)]
common = [
    *shape_flags,
    flag("--forward", numbers_good, numbers_bad), flag("--backward", numbers_good, numbers_bad),
    flag("--backward-input", numbers_good, numbers_bad), flag("--backward-weight", numbers_good, numbers_bad),
    flag("--memory-limit", ("1", "2", "4", "2,2", "4,3,2,1"), ("0", "-1", "nan", "inf", "1,x", ",", "1e400")),
    flag("--param", ("group_size=2", "virtual_stages=2"), ("group_size=x", "oops", "=3", "group-size=1")),
    flag("--costs", ["{files}/" + name for name in ("good.json", "split.json", "sizes.json", "cluster.json")],
         ["{files}/" + name for name in ("null.json", "list.json", "text.json", "absent-worker.json", "stages.json",
                                         "unknown.json", "nan-link.json", "huge.json", "missing.json")]),
]
strategies_good = ("gpipe", "one_f_one_b", "looped(group_size=2)", "looped", "zb_h1", "interleaved(virtual_stages=2)")
strategies_bad = ("nope", "looped(group_size=x)", "looped(", "gpipe)", "ddp", "", "{files}/mine.py:missing",
                  "{files}/mine.py:two_arguments", "no_such_module:f")
plans = ("{files}/plan.json", "{files}/split-plan.json")
plans_bad = ("{files}/plan-wrong-latency.json", "{files}/plan-truncated.json", "{files}/missing.json",
             "{files}/good.json")
verbs = {
    "simulate": [flag("--strategy", strategies_good, strategies_bad),
                 flag("--priority", ("backward_first", "oldest_stage_first"), ("random", "")),
                 flag("--width", ("40", "100"), ("0", "-3")),
                 flag("--topology", ("dgx_h100", "p4d_24xlarge"), ("nope", "{files}/good.json")),
                 flag("--out", ("{files}/out/d.txt", "{files}/out/d.json", "{files}/out/d.html"),
                      ("{files}/out/d.bogus", "{files}/nowhere/d.txt", "{files}/out")),
                 flag("--time-unit", ("ms", "s", "1e-3"), ("0", "-1", "nan", "parsec")),
                 flag("--plan", plans, plans_bad), flag("--color", ("never", "always")), switch("--no-color")],
    "compare": [flag("--strategies", ("gpipe,ddp", "looped(group_size=2),gpipe", "zb_h1,one_f_one_b"),
                     ("gpipe,nope", ",", "gpipe,looped(group_size=2", "{files}/mine.py:missing"))],
    "plan": [flag("--strategy", strategies_good, strategies_bad),
             flag("--comm", numbers_good, numbers_bad), flag("--fetch", numbers_good, numbers_bad),
             flag("--max-stages-per-worker", ("1", "2"), ("0", "x")),
             flag("--objective", ("latency", "span"), ("speed",)), flag("--search", ("heuristic",), ("magic",)),
             flag("--memory-budget", ("100", "1e9"), ("-1", "x", "nan")),
             flag("--optimizer-bytes", ("0", "10"), ("-5", "inf")),
             flag("--out", ("{files}/out/p.json", "{files}/out/p.txt"),
                  ("{files}/out/p.bogus", "{files}/nowhere/p.json")),
             flag("--width", ("60",), ("3",))],
    "strategies": [],
    "run": [*shape_flags, flag("--strategy", strategies_good, strategies_bad),
            flag("--param", ("group_size=2",), ("group_size=x", "oops")),
            flag("--plan", plans, plans_bad), flag("--nnodes", ("1", "2", "1:2"), ("0", "-1", "x", "2:1", "")),
            flag("--node-rank", ("0", "1"), ("-1", "5", "x")), flag("--rdzv-endpoint", ("localhost:29500",)),
            flag("--timeline", ("{files}/out/t.html",), ("{files}/out/t.bogus",)),
            flag("--precision", ("fp32", "bf16"), ("fp8",)), flag("--lr", ("0.1",), ("0", "nan", "-1")),
            flag("--steps", ("1", "5"), ("0", "x")), flag("--checkpoint-every", ("2",), ("0",)),
            flag("--checkpoint", ("{files}/out/ckpt",), ("{files}/good.json",)),
            flag("--resume", (), ("{files}/out/none",)), flag("--model", ("mlp", "transformer"), ("cnn",))],
}


COSTS_FILES = {
    "good": {"forward": [1, 2, 1, 1], "backward": 2, "activation_bytes": 4, "bandwidth": 2, "links": {"0,1": {}}},
    "split": {"backward_input": 1, "backward_weight": 1, "latency": 0.5},
    "sizes": {"activation_bytes": 1e6, "weight_bytes": 4e6, "bandwidth": 1e9, "forward": 1e-3, "backward": 2e-3},
    "cluster": {"topology": "dgx_h100", "activation_bytes": 1e6, "forward": 1e-3, "backward": 2e-3},
    "null": {"forward": None},
    "list": [1, 2],
    "text": "not json",
    "absent-worker": {"links": {"0,9": {"latency": 1}}},
    "stages": {"forward": [1, 2]},
    "unknown": {"speed": 2},
    "nan-link": {"links": {"1,0": {"latency": "nan"}}},
    "huge": {"forward": 1e300, "backward": 1e300},
}
USER_STRATEGIES = """
def two_arguments(work, other):
    return (0, 0)
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Costs files, plan files (good and edited), a strategy module and an output folder, for the command lines."""
    folder = tmp_path_factory.mktemp("files")
    for name, content in COSTS_FILES.items():
        (folder / f"{name}.json").write_text(content if isinstance(content, str) else json.dumps(content))
    (folder / "out").mkdir()
    (folder / "mine.py").write_text(USER_STRATEGIES)
    saved, split = saved_plans()
    (folder / "plan.json").write_text(json.dumps(saved))
    (folder / "split-plan.json").write_text(json.dumps(split))
    (folder / "plan-wrong-latency.json").write_text(json.dumps({**saved, "latency": saved["latency"] / 2}))
    (folder / "plan-truncated.json").write_text(json.dumps(saved)[:200])
    return folder


@st.composite
def command_lines(draw, folder):
    verb = draw(st.sampled_from(sorted(verbs)))
    flags = verbs[verb] if verb == "run" else [*common, *verbs[verb]] if verb != "strategies" else []
    chosen = draw(st.lists(st.sampled_from(flags), max_size=5)) if flags else []
    argv = [verb]
    if verb in ("simulate", "compare", "plan") and draw(st.integers(0, 4)):
        argv += list(draw(verbs[verb][0]))  # mostly a strategy (or a list): the whole registry is slow to fuzz
    for pair in chosen:
        argv += list(draw(pair))
    if verb == "plan":
        argv += ["--time-limit", "0.5"]
    if verb == "run":  # never launch: print the command or the ranks' programs
        argv.append(draw(st.sampled_from(["--dry-run", "--program"])))
    if draw(st.booleans()):
        argv.append("--json")
    return [arg.replace("{files}", str(folder)) for arg in argv]


WORDS = ("-W", "-S", "-B", "--strategy", "--strategies", "--param", "--json", "--memory-limit", "--costs", "--out",
         "--plan", "--forward", "--width", "--time-limit", "--help-me", "gpipe", "2", "-1", "x", "=", "--", "nan",
         "zb_h1", "looped(", "1,2", "", " ", "--color", "--nnodes", "--priority", "--dry-run", "--program")
"""Flags and values of every verb, to jumble."""


def latencies(value):
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("latency", "lower_bound"):
                yield item
            yield from latencies(item)
    elif isinstance(value, list):
        for item in value:
            yield from latencies(item)


def run_cli(argv):
    """``unisched ARGV`` in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:  # argparse's complaints exit (status 2) as argparse does
            code = exit.code
    return code, out.getvalue(), err.getvalue()


def assert_clear_ending(argv, code, out, err):
    """A result (exit 0) or one clear error (exit 2); with --json, JSON on stdout or the error last on stderr."""
    event(f"{argv[0] if argv else '(none)'} exit {code}")
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    as_json = "--json" in argv
    if code == 2:
        assert out == "" or not as_json, (argv, out)
        if as_json:  # stderr is JSON Lines: progress objects, then the error
            lines = [json.loads(line) for line in err.splitlines()]
            assert lines[-1]["error"], (argv, err)
            assert all(set(line) == {"progress"} for line in lines[:-1]), (argv, err)
        else:
            assert "error:" in err, (argv, err)
    elif argv[0] == "run" and "--program" not in argv:  # the torchrun command, as a shell reads it
        assert "torch.distributed.run" in shlex.split(out), (argv, out)
    elif as_json:
        for latency in latencies(json.loads(out)):
            assert latency is not None and math.isfinite(latency) and latency >= 0, (argv, latency)
    else:
        assert not re.search(r"\b(nan|-inf)\b", out, re.IGNORECASE), (argv, out)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_command_lines_end_in_a_result_or_a_clear_error(files, data):
    argv = data.draw(command_lines(files), label="argv")
    assert_clear_ending(argv, *run_cli(argv))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(verb=st.sampled_from(["simulate", "compare", "plan", "strategies", "run"]),
       tokens=st.lists(st.sampled_from(WORDS), max_size=6),
       as_json=st.booleans())
def test_any_jumble_of_words_ends_in_a_result_or_a_clear_error(verb, tokens, as_json):
    """Flags without values, values without flags, flags of other verbs: argparse's complaints read like ours."""
    argv = [verb, *tokens, *(["--json"] if as_json else [])]
    if verb == "plan":
        argv += ["--time-limit", "0.5"]
    if verb == "run":
        argv.append("--dry-run")
    assert_clear_ending(argv, *run_cli(argv))
