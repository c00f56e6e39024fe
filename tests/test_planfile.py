"""Plan files: start times kept and replayed, old versions read, no claim beyond what was proven."""

from __future__ import annotations

import json

import pytest

from unisched.plan import PlanFileError, PlanProblem, encode_costs, load_plan, plan
from unisched.plan.planfile import ANY_SCHEDULE, VERSION, objective_value, plan_from_dict
from unisched.plan.search import search
from unisched.work import Shape


@pytest.fixture(scope="module")
def cross_worker_plan(tmp_path_factory):
    """W = S = 2, B = 4, memory 1, comm 1: the best schedules run a backward away from its forward."""
    result = plan(2, 2, 4, encode_costs(comm=1), memory_limit=1, time_limit=20)
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    result.save(path)
    return result, path


def test_plan_file_keeps_start_times_and_its_replay_follows_them(cross_worker_plan):
    result, path = cross_worker_plan
    data = json.loads(path.read_text())
    assert data["version"] == VERSION == 2
    assert len(data["starts"]) == len(data["mapping"]) == 16
    loaded = load_plan(path)
    replay = loaded.simulate()
    assert replay.latency == result.latency == 25
    t = replay.timeline
    assert {str(t.work(i)): float(t.start[i]) for i in range(len(t))} == data["starts"]
    moved = [item for item, (compute, _) in data["mapping"].items()
             if "B" in item and data["mapping"][item.replace("B", "F")][0] != compute]
    assert moved  # the plan keeps a stash on another worker than its forward's, and still replays


def test_a_start_time_the_orders_do_not_reproduce_is_refused(cross_worker_plan):
    _, path = cross_worker_plan
    data = json.loads(path.read_text())
    item = max(data["starts"], key=data["starts"].get)
    data["starts"][item] -= 1.0  # earlier than its inputs and its worker allow
    with pytest.raises(PlanFileError, match=f"says {item} starts at"):
        plan_from_dict(data, source="edited")
    del data["starts"][item]
    with pytest.raises(PlanFileError, match=f"lacks the start time of {item}"):
        plan_from_dict(data, source="damaged")


def as_version_1(data: dict) -> dict:
    """A version 2 plan file's contents as version 1 wrote them (no start times)."""
    data = dict(data)
    for key in ("starts", "search", "objective", "objective_value", "proven_for", "bound_for", "bound_classes",
                "gap", "interrupted", "memory_budget", "optimizer_bytes"):
        data.pop(key, None)
    data["version"] = 1
    return data


def test_version_1_plan_files_are_still_read(tmp_path):
    """Version 1 plans replayed from their orders alone; one whose orders cannot run alone is refused,
    the error pointing at the start times a version 2 file keeps."""
    result = plan(2, 2, 4, encode_costs(comm=1), strategy="one_f_one_b", time_limit=5)
    path = tmp_path / "plan.json"
    result.save(path)
    data = as_version_1(json.loads(path.read_text()))
    old = plan_from_dict(data, source="old")
    assert old.latency == result.latency and old.objective == "latency" and old.search == "cpsat"
    stuck = json.loads(json.dumps(data))
    first = stuck["orders"]["0"]
    first.insert(0, first.pop(first.index("0B0")))  # its backward before the forward it needs: a deadlock
    with pytest.raises(PlanFileError, match="cannot be replayed.*needs the start times a version 2 file keeps"):
        plan_from_dict(stuck, source="old")
    data["version"] = 3
    with pytest.raises(PlanFileError, match="reads versions 1, 2"):
        plan_from_dict(data, source="future")


def test_a_proof_over_a_restricted_class_is_not_written_as_optimal(tmp_path):
    result = plan(4, 4, 8, memory_limit=2, strategy="gpipe", time_limit=10)
    assert result.optimal and result.proven_for.startswith("orders of the mapping of gpipe")
    path = tmp_path / "gpipe.json"
    result.save(path)
    data = json.loads(path.read_text())
    assert data["optimal"] is False
    assert data["proven_for"] == result.proven_for
    loaded = load_plan(path)
    assert not loaded.optimal_overall and loaded.claimed_class() == result.proven_for
    assert "optimal among orders of the mapping of gpipe" in repr(loaded)


def test_a_proof_over_every_schedule_is_written_as_optimal(tmp_path):
    result = search(PlanProblem(Shape(4, 4, 4), encode_costs()), time_limit=30)
    assert result.latency == result.lower_bound == 12
    path = tmp_path / "ddp.json"
    result.save(path)
    data = json.loads(path.read_text())
    assert data["optimal"] is True and data["proven_for"] == ANY_SCHEDULE and data["search"] == "heuristic search"
    assert load_plan(path).optimal_overall


def test_a_span_plan_keeps_its_objective(tmp_path):
    costs = encode_costs(forward=1, backward=3, backward_input=2, backward_weight=1, comm=0.5)
    problem = PlanProblem(Shape(3, 3, 6), costs, memory_limit=6, max_stages_per_worker=1, split_backward=True,
                          objective="span")
    result = search(problem, time_limit=1)
    path = tmp_path / "span.json"
    result.save(path)
    loaded = load_plan(path)
    assert loaded.objective == "span" and loaded.value == pytest.approx(result.value)
    assert loaded.value == pytest.approx(objective_value(loaded.simulate(), "span"))
    data = json.loads(path.read_text())
    data["lower_bound"] = result.value + 1
    with pytest.raises(PlanFileError, match="above its own replayed value"):
        plan_from_dict(data, source="edited")


def test_a_plan_file_that_cannot_be_written_is_a_plan_file_error(cross_worker_plan, tmp_path):
    result, _ = cross_worker_plan
    path = tmp_path / "no-such-folder" / "plan.json"
    with pytest.raises(PlanFileError, match="cannot write plan file .*no-such-folder.*: No such file or directory"):
        result.save(path)


def test_save_writes_the_plan_file_or_draws_the_plan_by_extension(cross_worker_plan, tmp_path):
    result, _ = cross_worker_plan
    result.save(tmp_path / "plan.png")
    result.save(tmp_path / "plan.txt")
    assert (tmp_path / "plan.png").read_bytes().startswith(b"\x89PNG")
    assert "latency" in (tmp_path / "plan.txt").read_text()
    for name in ("plan.xyz", "plan"):
        with pytest.raises(PlanFileError, match=r"write the plan file as .json or draw the plan as .html, .png, .svg, .pdf, .txt \(a Chrome"):
            result.save(tmp_path / name)
        assert not (tmp_path / name).exists()
