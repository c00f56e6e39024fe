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
    assert zb_h1.throughput == pytest.approx(B / zb_h1.latency) == zb_h1.timeline.throughput
    ratio = zb_h1.throughput / one_f_one_b.throughput
    assert ratio == pytest.approx(one_f_one_b.latency / zb_h1.latency)  # 33 / 27, not 1.83
    # the per-worker item rate is what reads 1.83x: zb_h1 runs 96 items to 1F1B's 64
    items = zb_h1.timeline.item_rate / one_f_one_b.timeline.item_rate
    assert items == pytest.approx(ratio * 96 / 64) and items > 1.8
    assert "micro-batches/time" in zb_h1.summary() and "micro-batches/time" in zb_h1.to_text(color=False)


def test_simulate_json_reports_the_throughput_in_micro_batches(capsys):
    code, out, _ = run(capsys, "simulate", "--strategy", "zb_h1", "--json")
    result = json.loads(out)
    assert code == 0 and result["throughput"] == pytest.approx(8 / 27)
    assert "item_rate" not in result and "batch_throughput" not in result  # one rate, the one that compares
    # the gap is measured from the shape's bound, the one compare measures every row from
    assert result["gap"] == pytest.approx(27 / result["lower_bounds"]["shape"] - 1)
    code, out, _ = run(capsys, "compare", "--strategies", "zb_h1", "--json")
    assert json.loads(out)["results"][0]["gap"] == pytest.approx(result["gap"])


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
    assert bound == 9 and all(bound <= row["lower_bound"] for row in rows.values())  # F x 4, I x 4, then W of stage 0
    for row in rows.values():
        assert row["gap"] == pytest.approx(row["latency"] / bound - 1)
        assert row["throughput"] == pytest.approx(2 / row["latency"])
    # the faster strategy is the closer one to the bound
    assert rows["zb_h1"]["latency"] < rows["one_f_one_b"]["latency"]
    assert rows["zb_h1"]["gap"] < rows["one_f_one_b"]["gap"]
    assert rows["one_f_one_b"]["own_gap"] == pytest.approx(rows["one_f_one_b"]["latency"] / 12 - 1)  # its own path
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

    rows = {}  # a worker's row over every band the diagram wraps into
    for line in text.splitlines():
        if line.startswith("w") and "|" in line:
            name, row = line.split("|", 1)
            rows[name] = rows.get(name, "") + ANSI.sub("", row)
    return rows


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


# ---------------------------------------------------------------------- your own strategy
OWN = '''
import unisched
from unisched import ComputeAndWeightWorkers


def reverse(w):
    """Stage s on worker S - 1 - s (for S = 4)."""
    return ComputeAndWeightWorkers(3 - w.stage, 3 - w.stage)


def looped_by_hand(num_workers, num_stages, num_batches, group_size=2):
    return unisched.policies.get("looped", num_workers, num_stages, num_batches, group_size=group_size)


def mapping_factory(num_workers, num_stages, num_batches, shift=0):
    return lambda w: ComputeAndWeightWorkers((w.stage + shift) % num_workers, (w.stage + shift) % num_workers)


READY = unisched.as_strategy(reverse, name="ready")
NOT_A_FUNCTION = 3


def two_arguments(a, b):
    return None
'''


@pytest.fixture
def own_module(tmp_path, monkeypatch):
    """A module of strategies in the current directory, under a name no other test uses."""
    import sys
    import uuid

    name = f"own_strategies_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(OWN)
    monkeypatch.chdir(tmp_path)
    yield name
    sys.modules.pop(name, None)


def test_simulate_your_own_function(capsys, own_module):
    code, out, _ = run(capsys, "simulate", "--strategy", f"{own_module}:reverse", "--json")
    result = json.loads(out)
    assert code == 0 and result["latency"] == 33
    assert result["worker_stats"]["max_activation_storage"] == [1, 4, 7, 8]  # gpipe's, the workers reversed
    code, out, _ = run(capsys, "simulate", "--strategy", f"{own_module}:reverse", "--color", "never")
    assert code == 0 and f"{own_module}:reverse: W=4 S=4 B=8" in out and "w3|0F0" in out


def test_a_factory_takes_the_shape_and_the_parameters(capsys, own_module):
    looped = json.loads(run(capsys, "simulate", "--strategy", "looped", "--param", "group_size=2", "--json")[1])
    for argv in (["--strategy", f"{own_module}:looped_by_hand(group_size=2)"],
                 ["--strategy", f"{own_module}:looped_by_hand", "--param", "group_size=2"]):
        code, out, _ = run(capsys, "simulate", *argv, "--json")
        assert code == 0 and json.loads(out)["latency"] == looped["latency"] == 28
        assert json.loads(out)["params"] == looped["params"] == {"group_size": 2}  # reported as the registry's
    code, out, _ = run(capsys, "simulate", "--strategy", f"{own_module}:mapping_factory(shift=1)", "--json")
    assert code == 0 and json.loads(out)["worker_stats"]["max_activation_storage"] == [1, 8, 7, 4]
    assert json.loads(out)["params"] == {"shift": 1}
    code, out, _ = run(capsys, "simulate", "--strategy", f"{own_module}:READY", "--json")
    assert code == 0 and json.loads(out)["strategy"] == "ready"


def test_a_file_path_names_a_strategy_too(capsys, tmp_path):
    path = tmp_path / "sub" / "mine.py"
    path.parent.mkdir()
    path.write_text(OWN)
    code, out, _ = run(capsys, "simulate", "--strategy", f"{path}:reverse", "--json")
    assert code == 0 and json.loads(out)["latency"] == 33


def test_compare_and_plan_take_your_own_function(capsys, own_module):
    code, out, _ = run(capsys, "compare", "--strategies", f"gpipe,{own_module}:reverse,"
                       f"{own_module}:looped_by_hand(group_size=2)", "--json")
    assert code == 0
    rows = {row["strategy"]: row for row in json.loads(out)["results"]}
    assert rows[f"{own_module}:reverse"]["latency"] == rows["gpipe"]["latency"] == 33
    assert rows[f"{own_module}:looped_by_hand(group_size=2)"]["latency"] == 28
    code, out, _ = run(capsys, "compare", "--strategies", f"gpipe,{own_module}:looped_by_hand(group_size=3)", "--json")
    skipped = dict(json.loads(out)["skipped"])
    assert code == 0 and "group" in skipped[f"{own_module}:looped_by_hand(group_size=3)"]  # does not fit W=4
    code, out, _ = run(capsys, "plan", "-W", "4", "-S", "4", "-B", "8", "--memory-limit", "2", "--strategy",
                       f"{own_module}:reverse", "--time-limit", "5", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["latency"] == 51 and result["strategy"].startswith(f"{own_module}:reverse")
    mapping = result["plan"]["mapping"]
    assert all(workers == [3 - unisched.Work.parse(item).stage] * 2 for item, workers in mapping.items())


@pytest.mark.parametrize("target, words", [
    ("no_such_module_here:fn", "no module 'no_such_module_here'"),
    ("{own}:missing", "has no 'missing'"),
    ("{own}:NOT_A_FUNCTION", "not a function"),
    ("{own}:two_arguments", "takes 2 required arguments"),
    ("{own}:reverse(k=1)", "takes no parameters"),
    ("{own}:looped_by_hand(k=1)", "cannot take these parameters"),
    ("missing/file.py:fn", "no file missing/file.py"),
    (":fn", "MODULE:FUNCTION"),
])
@pytest.mark.parametrize("verb", ["simulate", "compare", "plan"])
def test_a_missing_module_or_function_is_a_clear_error(capsys, own_module, target, words, verb):
    target = target.format(own=own_module)
    flag = "--strategies" if verb == "compare" else "--strategy"
    code, out, err = run(capsys, verb, flag, f"gpipe,{target}" if verb == "compare" else target, "--json")
    assert code == 2 and not out
    error = json.loads(err)
    assert words in error["error"] and "Traceback" not in err


# ---------------------------------------------------------------------- plans drawn and replayed
PLAN_ARGS = ("plan", "-W", "4", "-S", "4", "-B", "8", "--memory-limit", "2", "--strategy", "gpipe", "--time-limit", "5")


def test_plan_out_by_extension(capsys, tmp_path):
    outs = [tmp_path / name for name in ("plan.json", "plan.png", "plan.svg", "plan.pdf", "plan.html", "plan.txt")]
    code, out, _ = run(capsys, *PLAN_ARGS, "--color", "never", *[arg for path in outs for arg in ("--out", str(path))])
    assert code == 0
    assert unisched.load_plan(outs[0]).simulate().latency == 51  # .json: the plan file
    assert outs[1].read_bytes().startswith(b"\x89PNG")  # an image: the plan's schedule drawn
    assert b"<svg" in outs[2].read_bytes()[:2000] and outs[3].read_bytes().startswith(b"%PDF")
    assert 'class="us-worker"' in outs[4].read_text()
    text = outs[5].read_text()
    assert "latency 51" in text and "w3|" in text and "3F0" in text
    for path in outs:
        assert f"wrote {path}" in out


@pytest.mark.parametrize("name", ["plan.gif", "plan", "trace.jsonl"])
def test_plan_out_with_another_extension_is_refused_before_planning(capsys, tmp_path, name):
    code, out, err = run(capsys, *PLAN_ARGS, "--out", str(tmp_path / name))
    assert code == 2 and not out
    assert f"--out {tmp_path / name}" in err and ".json" in err and ".png" in err
    assert "Traceback" not in err and not (tmp_path / name).exists()


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    from unisched.plan import plan

    result = plan(4, 4, 8, memory_limit=2, strategy="gpipe", time_limit=5)
    result.save(path)
    return path


def test_simulate_a_saved_plan(capsys, plan_file, tmp_path):
    code, out, _ = run(capsys, "simulate", "--plan", str(plan_file), "--json")
    result = json.loads(out)
    assert code == 0 and result["latency"] == 51 and result["shape"] == [4, 4, 8]
    assert result["plan"] == str(plan_file)
    assert max(result["worker_stats"]["max_activation_storage"]) <= 2
    drawing = tmp_path / "plan.png"
    code, out, _ = run(capsys, "simulate", "--plan", str(plan_file), "--color", "never", "--out", str(drawing))
    assert code == 0 and "latency 51" in out and "w3|" in out and drawing.read_bytes().startswith(b"\x89PNG")
    trace = tmp_path / "plan.json"
    assert run(capsys, "simulate", "--plan", str(plan_file), "--out", str(trace), "--time-unit", "ms")[0] == 0
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    assert max(e["ts"] + e["dur"] for e in events) == pytest.approx(51e3)


def test_simulate_plan_refuses_what_the_file_fixes_and_edited_files(capsys, plan_file, tmp_path):
    code, _, err = run(capsys, "simulate", "--plan", str(plan_file), "-W", "8", "--strategy", "gpipe")
    assert code == 2 and "drop --strategy, --workers" in err
    code, _, err = run(capsys, "simulate", "--plan", str(plan_file), "--comm", "0")  # 0 is given too
    assert code == 2 and "drop --comm" in err
    data = json.loads(plan_file.read_text())
    data["latency"] = 1.0  # an edited claim: the replay disagrees
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    code, out, err = run(capsys, "simulate", "--plan", str(edited))
    assert code == 2 and not out and str(edited) in err
    code, _, err = run(capsys, "simulate", "--plan", str(tmp_path / "missing.json"))
    assert code == 2 and "cannot read plan file" in err


# ---------------------------------------------------------------------- the README's Trainer snippet
def trainer_snippet() -> str:
    """The README's Python block that builds a Trainer from a simulated schedule."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    [block] = [b for b in blocks if "unisched.Trainer(stages, schedule" in b and "last_timeline" in b]
    return block


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_readme_trainer_snippet_runs_on_every_rank(rank, tmp_path, monkeypatch):
    """The snippet as the README gives it, with a stand-in Trainer: on ranks other than 0 the
    measured timeline is None (only rank 0 gathers it), and the snippet must not trip on that."""
    from types import SimpleNamespace

    monkeypatch.chdir(tmp_path)
    schedule_seen = []

    class Trainer:
        def __init__(self, stages, schedule, loss_fn, optimizer):
            schedule_seen.append(schedule)
            self.rank = rank
            self.last_timeline = schedule.timeline if rank == 0 else None

        def step(self, inputs, targets):
            return 0.5

        def gather_state_dict(self):
            return {}

    checkpoints = []

    def save_checkpoint(trainer, path, extra=None):
        assert isinstance(trainer, Trainer)
        checkpoints.append(("save", path))

    def load_checkpoint(trainer, path):
        assert isinstance(trainer, Trainer)
        checkpoints.append(("load", path))

    shim = SimpleNamespace(simulate=unisched.simulate, policies=unisched.policies, Trainer=Trainer,
                           save_checkpoint=save_checkpoint, load_checkpoint=load_checkpoint)
    exec(trainer_snippet(), {"unisched": shim, "stages": None, "loss_fn": None, "torch": None, "inputs": None,
                             "targets": None})
    assert schedule_seen and schedule_seen[0].latency == 33
    assert [what for what, _ in checkpoints] == ["save", "load"], "every rank saves and loads (it is collective)"
    assert (tmp_path / "step.html").exists() == (rank == 0)


def test_a_latency_above_a_bound_of_zero_is_not_said_to_be_at_it(capsys):
    """With passes of no time and transfers of 1 the shape's bound is 0: the summary said the
    latency was "at" it and --json gave a gap of 0."""
    from unisched.cli import main

    assert main(["simulate", "--strategy", "gpipe", "--forward", "0", "--backward", "0", "--comm", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["latency"] > 0 and result["lower_bound"] == 0 and result["gap"] is None  # infinite
    assert main(["simulate", "--strategy", "gpipe", "--forward", "0", "--backward", "0", "--comm", "1"]) == 0
    assert f"latency {result['latency']:g} (above 0, the shape's lower bound" in capsys.readouterr().out


def test_a_strategy_drawn_with_parameters_is_titled_with_them(capsys):
    from unisched.cli import main

    assert main(["simulate", "--strategy", "looped", "--param", "group_size=2", "-B", "4"]) == 0
    assert capsys.readouterr().out.startswith("looped(group_size=2): W=4 S=4 B=4")
    assert main(["simulate", "--strategy", "looped(group_size=1)", "-B", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["strategy"] == "looped(group_size=1)" and result["params"] == {"group_size": 1}
