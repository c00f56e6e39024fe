"""Hypothesis over costs, plan files and command lines: every input ends in a
result that makes sense or in one of unisched's own errors (on the command
line: exit status 2), never in a traceback or a silently wrong number."""

import contextlib
import copy
import functools
import io
import json
import math

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
        "input_grad_frees": odd_values,
    },
)


def assert_sane(sim) -> None:
    """A simulated step that is a step: finite times, every rule kept, no shorter than its bound."""
    latency = sim.latency
    assert math.isfinite(latency) and latency >= 0, latency
    sim.timeline.check()
    assert sim.lower_bounds["shape"] <= latency * (1 + 1e-9) + 1e-12, (sim.lower_bounds, latency)


@FUZZ
@given(fields=cost_fields, name=st.sampled_from(["gpipe", "fsdp"]), W=st.integers(1, 3), B=st.integers(1, 3),
       split=st.booleans())
def test_costs_make_a_valid_step_or_a_clear_error(fields, name, W, B, split):
    try:
        costs = Costs(**fields)
    except UniSchedError:
        return
    S = W if name == "gpipe" else 2
    B = W if name == "fsdp" else B
    strategy = unisched.policies.get(name, W, S, B)
    try:
        sim = simulate(W, S, B, strategy, costs=costs, split_backward=split)
    except UniSchedError:
        return
    assert_sane(sim)


# ---------------------------------------------------------------------- plan files
@functools.lru_cache(maxsize=1)
def saved_plan() -> dict:
    return json.loads(json.dumps(plan(2, 2, 3, memory_limit=2, strategy="gpipe", time_limit=5).to_dict()))


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
    edited = copy.deepcopy(saved_plan())
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


numbers_good = ("0", "1", "2.5", "0.25")
numbers_bad = ("-1", "nan", "inf", "1e300", "1e-300", "x", "")
shape = (("1", "2", "3", "4"), ("0", "-1", "x", "2.5", "1e3", "100000000"))
common = [
    flag("-W", *shape), flag("-S", *shape), flag("-B", *shape),
    flag("--forward", numbers_good, numbers_bad), flag("--backward", numbers_good, numbers_bad),
    flag("--backward-input", numbers_good, numbers_bad), flag("--backward-weight", numbers_good, numbers_bad),
    flag("--memory-limit", ("1", "2", "4", "2,2", "4,3,2,1"), ("0", "-1", "nan", "inf", "1,x")),
    flag("--param", ("group_size=2", "num_chunks=2"), ("group_size=x", "oops", "=3", "group-size=1")),
]
strategies_good = ("gpipe", "one_f_one_b", "looped(group_size=2)", "looped", "zb_h1", "interleaved(num_chunks=2)")
strategies_bad = ("nope", "looped(group_size=x)", "looped(", "gpipe)", "ddp", "")
verbs = {
    "simulate": [flag("--strategy", strategies_good, strategies_bad),
                 flag("--priority", ("backward_first", "oldest_stage_first"), ("random", "")),
                 flag("--width", ("40", "100"), ("0", "-3"))],
    "compare": [flag("--strategies", ("gpipe,ddp", "looped(group_size=2),gpipe", "zb_h1,one_f_one_b"),
                     ("gpipe,nope", ",", "gpipe,looped(group_size=2"))],
    "plan": [flag("--strategy", strategies_good, strategies_bad),
             flag("--comm", numbers_good, numbers_bad), flag("--fetch", numbers_good, numbers_bad),
             flag("--max-stages-per-worker", ("1", "2"), ("0", "x"))],
}


COSTS_FILES = {
    "good": {"forward": [1, 2, 1, 1], "backward": 2, "activation_bytes": 4, "bandwidth": 2, "links": {"0,1": {}}},
    "null": {"forward": None},
    "list": [1, 2],
    "text": "not json",
    "absent-worker": {"links": {"0,9": {"latency": 1}}},
    "stages": {"forward": [1, 2]},
    "unknown": {"speed": 2},
    "nan-link": {"links": {"1,0": {"latency": "nan"}}},
    "huge": {"forward": 1e300, "backward": 1e300},
}


@pytest.fixture(scope="module")
def costs_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("costs")
    for name, content in COSTS_FILES.items():
        (folder / f"{name}.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


@st.composite
def command_lines(draw, costs_folder):
    verb = draw(st.sampled_from(sorted(verbs)))
    required = verbs[verb][0]  # a strategy (or a list): the whole registry is too slow to fuzz
    costs = flag("--costs", [str(costs_folder / f"{name}.json") for name in [*COSTS_FILES, "missing"]])
    chosen = draw(st.lists(st.sampled_from([*common, costs, *verbs[verb][1:]]), max_size=5))
    argv = [verb, *draw(required)]
    for pair in chosen:
        argv += list(draw(pair))
    if verb == "plan":
        argv += ["--time-limit", "0.5"]
    if draw(st.booleans()):
        argv.append("--json")
    return argv


def latencies(value):
    if isinstance(value, dict):
        for key, item in value.items():
            if key in ("latency", "lower_bound"):
                yield item
            yield from latencies(item)
    elif isinstance(value, list):
        for item in value:
            yield from latencies(item)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_command_lines_end_in_a_result_or_a_clear_error(costs_files, data):
    argv = data.draw(command_lines(costs_files), label="argv")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit:  # argparse's complaints exit (status 2) as argparse does
            code = exit.code
    out, err = out.getvalue(), err.getvalue()
    event(f"{argv[0]} exit {code}")
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    if code == 2:
        assert out == "" or "--json" not in argv, (argv, out)
        if "--json" in argv:  # stderr is JSON Lines: progress objects, then the error
            lines = [json.loads(line) for line in err.splitlines()]
            assert lines[-1]["error"], (argv, err)
            assert all(set(line) == {"progress"} for line in lines[:-1]), (argv, err)
        else:
            assert "error:" in err, (argv, err)
    elif "--json" in argv:
        for latency in latencies(json.loads(out)):
            assert latency is not None and math.isfinite(latency) and latency >= 0, (argv, latency)
