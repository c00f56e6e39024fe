"""The Timeline as an interchange value: what it carries, check(), its fixed
orders and replay, and that it depends on nothing drawn from it."""

from dataclasses import replace

import networkx as nx
import numpy as np
import pytest

import unisched
from unisched import (
    BACKWARD,
    FORWARD,
    ComputeAndWeightWorkers,
    Costs,
    Timeline,
    TimelineError,
    UniSchedError,
    Work,
    policies,
    simulate,
)

SHAPES = [(4, 4, 8), (2, 4, 4), (8, 4, 8), (3, 6, 6), (4, 8, 8)]
UNEVEN = Costs(forward=[1, 3, 1, 2], backward=[2, 5, 2, 3])
OTHER = Costs(forward=[2, 1, 3, 1], backward=[4, 2, 6, 2])


def gpipe(w: Work) -> ComputeAndWeightWorkers:
    return ComputeAndWeightWorkers(w.stage, w.stage)


def every_registered_simulation():
    seen = set()
    for shape in SHAPES:
        for name, params in policies.variants(*shape):
            strategy = policies.get(name, *shape, **params)
            seen.add(name)
            yield name, simulate(*shape, strategy)
    assert seen == set(policies.names()), "every registered strategy fits one of SHAPES"


def rows(t: Timeline, index) -> Timeline:
    """``t`` with only (or repeated) the rows ``index``."""
    columns = ("batch", "stage", "direction", "worker", "weight_worker", "start", "end", "gang")
    return replace(t, **{name: getattr(t, name)[index] for name in columns})


def moved(t: Timeline, work: Work, start: float, end: float) -> Timeline:
    row = t.index()[work]
    starts, ends = t.start.copy(), t.end.copy()
    starts[row], ends[row] = start, end
    return replace(t, start=starts, end=ends)


# ---------------------------------------------------------------------- what it carries
def test_a_simulated_timeline_carries_its_graph_costs_and_caching():
    graph = nx.DiGraph([(0, 2), (1, 2), (2, 3)])
    costs = Costs(forward=[1, 3, 1, 1], cache_weights=False)
    t = simulate(3, 4, 2, lambda w: ComputeAndWeightWorkers(min(w.stage, 2), 0), costs=costs, stage_graph=graph).timeline
    assert isinstance(t.stage_graph, unisched.StageGraph) and set(t.stage_graph.graph.edges) == set(graph.edges)
    assert t.costs is costs and t.cache_weights is False


def test_from_records_carries_the_stage_graph_it_is_given():
    graph = nx.DiGraph([(0, 2), (1, 2), (2, 3)])
    sim = simulate(3, 4, 2, lambda w: ComputeAndWeightWorkers(min(w.stage, 2), min(w.stage, 2)), stage_graph=graph)
    measured = Timeline.from_records(sim.shape, sim.timeline.records, source="measured", stage_graph=graph)
    assert set(measured.stage_graph.graph.edges) == set(graph.edges)
    assert measured.costs is None and measured.cache_weights
    measured.check()
    bare = Timeline.from_records(sim.shape, sim.timeline.records, source="measured")
    assert bare.stage_graph.is_chain
    with pytest.raises(TimelineError, match="before"):
        bare.check()  # the legs ran side by side, which a chain forbids


# ---------------------------------------------------------------------- check()
def test_check_accepts_every_registered_strategy():
    for name, sim in every_registered_simulation():
        assert sim.timeline.check(sim.memory_limit) is sim.timeline, name


def test_check_counts_a_limit_in_the_unit_the_simulation_used():
    """A strategy's own limit counts stashes even when the costs give sizes;
    a limit passed to simulate counts bytes then."""
    sized = Costs(activation_bytes=2.0)
    own = simulate(4, 4, 8, policies.get("one_f_one_b", 4, 4, 8), costs=sized)
    assert own.timeline.check(own.memory_limit) is own.timeline
    given = simulate(4, 4, 8, gpipe, costs=sized, memory_limit=8.0)
    given.timeline.check(8.0)
    with pytest.raises(TimelineError, match=r"bytes of stashed activations"):
        given.timeline.check(4.0)


def test_check_names_a_missing_item():
    t = simulate(4, 4, 8, gpipe).timeline
    gone = t.index()[Work(3, 2, BACKWARD)]
    with pytest.raises(TimelineError, match=r"lacks 1 of the step's 64 work items: backward of stage 2, batch 3 \(2B3\)") as caught:
        rows(t, np.delete(np.arange(len(t)), gone)).check()
    assert caught.value.items == [Work(3, 2, BACKWARD)]


def test_check_names_a_duplicated_item():
    t = simulate(4, 4, 8, gpipe).timeline
    again = t.index()[Work(5, 1, FORWARD)]
    with pytest.raises(TimelineError, match=r"runs forward of stage 1, batch 5 \(1F5\) 2 times") as caught:
        rows(t, np.append(np.arange(len(t)), again)).check()
    assert caught.value.items == [Work(5, 1, FORWARD)]


def test_check_names_a_broken_dependency():
    t = simulate(4, 4, 8, gpipe).timeline
    early = moved(t, Work(0, 1, FORWARD), 0.5, 1.5)  # 0F0 ends at 1
    with pytest.raises(TimelineError, match=r"\(1F0\) starts at 0.5 on worker 1, before .*\(0F0\) ends at 1") as caught:
        early.check()
    assert caught.value.items == [Work(0, 1, FORWARD), Work(0, 0, FORWARD)]


def test_check_names_a_dependency_that_moves_nothing_as_such():
    t = simulate(1, 1, 1, gpipe).timeline
    early = moved(t, Work(0, 0, BACKWARD), 0.5, 2.5)  # a source stage's backward needs its forward done, not data
    with pytest.raises(TimelineError, match=r"\(0B0\) starts at 0.5 .* \(0F0\) ends at 1 on worker 0, whose completion"):
        early.check()


def test_check_names_two_items_at_once_on_a_worker():
    t = simulate(4, 4, 8, gpipe).timeline
    crowded = moved(t, Work(1, 0, FORWARD), 0.5, 1.5)  # 0F1 has no dependency; 0F0 runs 0 to 1
    with pytest.raises(TimelineError, match=r"worker 0 runs .*\(0F0\) \(0 to 1\) and .*\(0F1\) \(0.5 to 1.5\)") as caught:
        crowded.check()
    assert caught.value.workers == [0]


def test_check_counts_a_gang_item_on_each_of_its_workers():
    strategy = unisched.Strategy(
        lambda w: ComputeAndWeightWorkers(0 if w.stage == 0 else 1, 0), gang=lambda w: (0, 1) if w.stage == 0 else None
    )
    t = simulate(2, 2, 2, strategy).timeline.check()
    assert t.start[t.index()[Work(0, 1, FORWARD)]] == 1
    crowded = moved(t, Work(1, 0, FORWARD), 1, 2)  # led by worker 0, but worker 1 runs 1F0 then
    with pytest.raises(TimelineError, match=r"worker 1 runs .*\(1F0\).*\(0F1\)|worker 1 runs .*\(0F1\).*\(1F0\)") as caught:
        crowded.check()
    assert caught.value.workers == [1]


def test_check_names_the_worker_over_its_memory_limit_and_the_stash_that_did_it():
    t = simulate(4, 4, 8, gpipe).timeline  # worker 0 holds 8 stashes
    t.check(8)
    with pytest.raises(TimelineError, match=r"worker 0 holds 5 stashed activations .* over its memory_limit 4.*\(0F4\)") as caught:
        t.check(4)
    assert caught.value.workers == [0] and caught.value.items == [Work(4, 0, FORWARD)]
    with pytest.raises(TimelineError, match="worker 1 holds 3 stashed activations"):
        t.check([8, 2, 8, 8])


def test_check_reads_a_limit_in_bytes_when_the_costs_give_sizes():
    t = simulate(4, 4, 8, gpipe, costs=Costs(activation_bytes=2.0)).timeline  # 8 stashes of 2 bytes
    t.check(16)
    with pytest.raises(TimelineError, match="worker 0 holds 16 bytes"):
        t.check(15)


def test_timeline_error_is_a_unisched_value_error():
    assert issubclass(TimelineError, UniSchedError) and issubclass(TimelineError, ValueError)


# ---------------------------------------------------------------------- fixed orders and replay
def test_a_replay_reproduces_every_registered_strategy():
    for name, sim in every_registered_simulation():
        t = sim.timeline
        replay = simulate(*t.shape, t.as_strategy(memory_limit=sim.memory_limit)).timeline
        assert replay.worker_orders() == t.worker_orders(), name
        order = np.lexsort((t.direction, t.stage, t.batch))
        again = np.lexsort((replay.direction, replay.stage, replay.batch))
        assert np.array_equal(replay.start[again], t.start[order]), name
        assert np.array_equal(replay.worker[again], t.worker[order]), name


def test_worker_orders_list_every_worker_and_zero_length_items_in_a_runnable_order():
    t = simulate(3, 4, 3, lambda w: ComputeAndWeightWorkers(w.stage % 3, 0), costs=Costs(forward=0, backward=0)).timeline
    orders = t.worker_orders()
    assert sorted(orders) == [0, 1, 2] and sum(map(len, orders.values())) == len(t)
    assert simulate(*t.shape, t.as_strategy()).timeline.worker_orders() == orders


def test_a_replay_keeps_gangs():
    strategy = unisched.Strategy(
        lambda w: ComputeAndWeightWorkers(0, 0), gang=lambda w: unisched.Gang((0, 1), w.stage == 0)
    )
    costs = Costs(activation_bytes=8.0, bandwidth=4.0)
    t = simulate(2, 2, 2, strategy, costs=costs).timeline
    assert t.gang_collective == (True, False)
    replay = simulate(*t.shape, t.as_strategy(), costs=costs).timeline
    assert replay.gang_members == t.gang_members and replay.gang_collective == t.gang_collective
    assert replay.latency == t.latency


@pytest.mark.parametrize("name", ["gpipe", "cuckoo"])
def test_predict_retimes_the_order_that_ran(name):
    from unisched.execute import predict

    shape = (4, 4, 8)
    sim = simulate(*shape, policies.get(name, *shape), costs=UNEVEN)
    greedy = simulate(*shape, policies.get(name, *shape), costs=OTHER)
    assert greedy.timeline.worker_orders() != sim.timeline.worker_orders(), "the greedy would pick other orders"

    prediction = predict(sim, OTHER)
    assert prediction.timeline.worker_orders() == sim.timeline.worker_orders()
    assert prediction.costs is OTHER and prediction.timeline.check()

    measured = Timeline.from_records(shape, sim.timeline.records, source="measured")
    assert predict(measured, OTHER).timeline.worker_orders() == sim.timeline.worker_orders()


# ---------------------------------------------------------------------- what is drawn from it
def test_the_views_work_on_a_bare_timeline(tmp_path):
    sim = simulate(4, 4, 8, gpipe)
    t = Timeline.from_records(sim.shape, sim.timeline.records, source="measured")
    assert t.worker_stats()["max_activation_storage"] == [8, 7, 4, 1]
    assert [c.peak for c in t.memory("activations", "units")] == [8, 7, 4, 1]
    assert "w0" in t.to_text(color=False) and "<" in t.to_html() and t.to_chrome_trace()
    t.save(tmp_path / "step.txt")
    assert (tmp_path / "step.txt").read_text()
    with pytest.raises(ValueError, match="not a Timeline view"):
        Timeline.register_view("bogus", print)


# ---------------------------------------------------------------------- rates
def test_throughput_is_micro_batches_per_time_and_the_item_rate_counts_items_per_worker():
    """B / latency whatever the backward's form; items / (latency W) counts a split backward twice."""
    whole = simulate(2, 2, 4, gpipe, costs=Costs(forward=1, backward=2))
    split = simulate(2, 2, 4, gpipe, costs=Costs(forward=1, backward_input=1, backward_weight=1), split_backward=True)
    for sim, items in ((whole, 16), (split, 24)):
        t = sim.timeline
        assert t.throughput == 4 / t.latency
        assert t.item_rate == pytest.approx(items / (t.latency * 2))
    # the split step is 15/14 faster, and its throughput says so; its item rate says 1.5 times more
    assert split.timeline.throughput / whole.timeline.throughput == pytest.approx(whole.latency / split.latency)
    assert split.timeline.item_rate / whole.timeline.item_rate == pytest.approx(1.5 * whole.latency / split.latency)


def test_the_drawing_view_keeps_both_rates():
    t = simulate(2, 2, 2, unisched.Strategy(lambda w: ComputeAndWeightWorkers(0, 0), gang=lambda w: (0, 1))).timeline
    drawn = t.per_worker()
    assert len(drawn) == 2 * len(t)
    assert (drawn.throughput, drawn.item_rate) == (t.throughput, t.item_rate)


# ---------------------------------------------------------------------- rows no view can draw
@pytest.mark.parametrize(
    "column, row, value, words",
    [
        ("start", 1, np.nan, r"has start time nan in timeline 'gpipe'; times must be finite numbers"),
        ("end", 3, np.inf, r"has end time inf"),
        ("worker", 0, 9, r"\(0F0\) has compute worker 9, but timeline 'gpipe' has workers 0..3"),
        ("weight_worker", 0, -1, r"has weight worker -1"),
        ("batch", 0, 8, r"row 0 .* = \(8, 0, 0\), which is not a work item of a step with S=4, B=8"),
        ("direction", 0, 7, r"row 0 .* = \(0, 0, 7\), which is not a work item"),
        ("gang", 0, 0, r"\(0F0\) is in gang 0, but timeline 'gpipe' has 0 gangs"),
    ],
)
def test_rows_no_view_can_draw_are_refused_when_the_timeline_is_made(column, row, value, words):
    """Every view (text, HTML, figure, trace, stats, memory) can then draw any timeline there is."""
    t = simulate(4, 4, 8, gpipe).timeline
    values = getattr(t, column).astype(float if column in ("start", "end") else np.int64)
    values[row] = value
    with pytest.raises(TimelineError, match=words):
        replace(t, **{column: values})
    with pytest.raises(TimelineError, match="differ in length"):
        replace(t, start=t.start[:-1])


def test_a_timeline_of_python_lists_is_taken_and_one_of_wrong_values_refused():
    """Hand-made rows as lists raised numpy's and Python's own errors ('>=' between list and int)."""
    from unisched import Timeline
    from unisched.errors import TimelineError

    rows = dict(batch=[0], stage=[0], direction=[0], worker=[0], weight_worker=[0], start=[0], end=[1])
    assert Timeline(2, 2, 2, **rows).latency == 1
    with pytest.raises(TimelineError, match="activation_bytes must be one number, or one per stage"):
        Timeline(2, 2, 2, **rows, activation_bytes=[1, 2, 3])
    with pytest.raises(TimelineError, match="batch must be a sequence of numbers"):
        Timeline(2, 2, 2, **{**rows, "batch": ["x"]})


def test_check_and_worker_order_refuse_what_they_cannot_answer():
    """A negative tolerance made a sound timeline fail ("ends before it starts"); worker 5 of 2 gave []."""
    import unisched
    from unisched.errors import TimelineError

    timeline = unisched.simulate(2, 2, 4, unisched.policies.get("gpipe", 2, 2, 4)).timeline
    for tolerance in (-1, float("nan"), "x"):
        with pytest.raises(TimelineError, match="tolerance"):
            timeline.check(tolerance=tolerance)
    for worker in (5, "0", -1):
        with pytest.raises(TimelineError, match="the workers are 0..1"):
            timeline.worker_order(worker)
    assert timeline.check() is timeline and timeline.worker_order(1)
