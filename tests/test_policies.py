"""The strategy library against the known figures of each strategy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import unisched
from unisched import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Costs, UniSchedError, Work, simulate
from unisched import policies
from unisched.errors import ShapeError
from unisched.policies import StrategyParameterError, StrategyShapeError, UnknownStrategyError
from unisched.policies.zero_bubble import zbv_order

UNIT = Costs(forward=1, backward=2)
SPLIT = Costs(forward=1, backward_input=1, backward_weight=1)
T_F = T_B = T_W = 1.0


def run(name, W, S, B, costs=UNIT, **params):
    return simulate(W, S, B, policies.get(name, num_workers=W, num_stages=S, num_batches=B, **params), costs=costs)


def spans_idle(timeline) -> np.ndarray:
    """Per worker: idle time between its first start and its last end."""
    idle = []
    for w in range(timeline.num_workers):
        rows = timeline.worker == w
        idle.append(timeline.end[rows].max() - timeline.start[rows].min() - timeline.busy_time[w])
    return np.array(idle)


# ---------------------------------------------------------------------- the seed's figures
@pytest.mark.parametrize(
    "name, W, params, latency, peaks",
    [
        ("ddp", 8, {}, 12, [4] * 8),
        ("fsdp", 8, {}, 12, [4] * 8),
        ("gpipe", 4, {"priority": "oldest_stage_first"}, 33, [8, 8, 8, 8]),
        ("gpipe", 4, {"priority": "oldest_batch_first"}, 33, [8, 7, 4, 1]),
        ("looped", 4, {"group_size": 2}, 28, [6, 3, 6, 3]),
    ],
)
def test_seed_figures_through_the_registry(name, W, params, latency, peaks):
    sim = run(name, W, 4, 8, **params)
    assert sim.latency == latency
    assert sim.timeline.item_rate == pytest.approx(64 / (latency * W))
    assert sim.worker_stats()["max_activation_storage"] == peaks


def test_fsdp_fetches_the_stages_it_does_not_hold():
    assert run("fsdp", 8, 4, 8).worker_stats()["weight_transmissions"] == [6, 6, 6, 6, 8, 8, 8, 8]


def test_fully_sharded_looped_keeps_each_stage_on_one_worker():
    stats = run("fully_sharded_looped", 4, 4, 8, group_size=2).worker_stats()
    assert sum(stats["weight_storage"]) == 4
    assert sum(stats["weight_transmissions"]) > 0


@pytest.mark.parametrize("S, G", [(4, 2), (2, 4), (4, 1)])
def test_looped_latency_formula_holds_when_groups_have_S_workers(S, G):
    B = 8
    sim = run("looped", S * G, S, B, group_size=S)
    assert sim.latency == 3 * (S + B / G - 1)


# ---------------------------------------------------------------------- pipelines
@pytest.mark.parametrize("name", ["gpipe", "one_f_one_b"])
@pytest.mark.parametrize("p, m", [(4, 8), (4, 4), (3, 9), (6, 12)])
def test_pipeline_bubble_fraction(name, p, m):
    sim = run(name, p, p, m)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, m", [(4, 8), (5, 5), (6, 12)])
def test_one_f_one_b_holds_p_minus_s_activations_on_stage_s(p, m):
    sim = run("one_f_one_b", p, p, m)
    assert sim.worker_stats()["max_activation_storage"] == [p - s for s in range(p)]
    gpipe = run("gpipe", p, p, m)
    assert sim.latency == gpipe.latency


def test_one_f_one_b_alternates_after_warm_up():
    sim = run("one_f_one_b", 4, 4, 8)
    order = sim.timeline.worker_order(0)
    assert [Work(b, 0, FORWARD) for b in range(4)] == order[:4]
    assert order[4:8] == [Work(0, 0, BACKWARD), Work(4, 0, FORWARD), Work(1, 0, BACKWARD), Work(5, 0, FORWARD)]


@pytest.mark.parametrize("p, m", [(4, 8), (4, 12), (2, 4), (8, 16)])
@pytest.mark.parametrize("v", [1, 2, 4])
def test_interleaved_bubble_shrinks_by_v(p, m, v):
    costs = Costs(forward=1 / v, backward=2 / v)  # the same work per worker for every v
    sim = run("interleaved", p, v * p, m, costs=costs)
    idle = sim.latency - sim.timeline.busy_time
    assert idle.max() == pytest.approx((p - 1) * (1 + 2) / v)
    assert np.allclose(sim.timeline.busy_time, 3 * m)


def test_interleaved_with_one_chunk_is_one_f_one_b():
    a, b = run("interleaved", 4, 4, 8), run("one_f_one_b", 4, 4, 8)
    assert a.latency == b.latency
    assert a.worker_stats()["max_activation_storage"] == b.worker_stats()["max_activation_storage"]


def test_looped_bfs_runs_each_stage_for_every_batch_in_turn():
    sim = run("looped_bfs", 2, 4, 3)
    order = [str(w) for w in sim.timeline.worker_order(0)]
    assert order == ["0F0", "0F1", "0F2", "2F0", "2F1", "2F2", "2B0", "2B1", "2B2", "0B0", "0B1", "0B2"]


# ---------------------------------------------------------------------- zero bubble
@pytest.mark.parametrize("p, m", [(4, 8), (4, 12), (6, 12), (3, 9)])
def test_zero_bubble_h1_bubble_and_memory(p, m):
    zb = run("zb_h1", p, p, m, costs=SPLIT)
    bubble = zb.latency - zb.timeline.busy_time.max()
    assert bubble == pytest.approx((p - 1) * (T_F + T_B - T_W))
    one_f_one_b = run("one_f_one_b", p, p, m, costs=Costs(forward=T_F, backward=T_B + T_W))
    assert one_f_one_b.latency - one_f_one_b.timeline.busy_time.max() == pytest.approx((p - 1) * (T_F + T_B + T_W))
    peak = zb.worker_stats()["max_activation_storage"]
    assert max(peak) <= max(one_f_one_b.worker_stats()["max_activation_storage"])


@pytest.mark.parametrize("p, m", [(4, 8), (4, 12), (6, 12), (3, 9)])
def test_zero_bubble_h2_bubble_and_memory(p, m):
    zb = run("zb_h2", p, p, m, costs=SPLIT)
    # no worker idles between its first and its last pass ...
    assert spans_idle(zb.timeline) == pytest.approx((p - 1) * (T_F + T_B - 2 * T_W))
    # ... so the step is the work plus the pipeline's fill, which no schedule avoids
    assert zb.latency == pytest.approx(zb.timeline.busy_time.max() + (p - 1) * T_F)
    one_f_one_b = run("one_f_one_b", p, p, m)
    ratio = max(zb.worker_stats()["max_activation_storage"]) / max(one_f_one_b.worker_stats()["max_activation_storage"])
    assert ratio == pytest.approx((2 * p - 1) / p)
    assert 1.5 <= ratio < 2


@pytest.mark.parametrize("times, h1_bubble, h2_idle", [
    ((1, 2, 1), 6, [3, 2, 1, 0]),  # the ZB-H1 form holds (3 x 2); ZB-H2 idles inside the spans
    ((2, 1, 1), 6, [3, 2, 1, 0]),
    ((1, 1, 2), 3, [0, 0, 0, 0]),  # the ZB-H1 form says 0: W passes longer than F and I leave its fill
])
def test_the_zb_h1_form_fails_only_where_the_weight_pass_is_longest(times, h1_bubble, h2_idle):
    """The closed forms above are the paper's, at T_F = T_B = T_W.  W = S = 4, B = 8 under other
    times (README): ZB-H1's bubble is (p - 1)(T_F + T_B - T_W) on the two where T_W is not the
    longest, and 3 where the form says 0; ZB-H2 idles 3, 2, 1, 0 inside the workers' spans on those
    two, and nowhere inside them where T_W is the longest."""
    F, I, W = times
    costs = Costs(forward=F, backward_input=I, backward_weight=W)
    h1 = run("zb_h1", 4, 4, 8, costs=costs)
    assert h1.latency - h1.timeline.busy_time.max() == h1_bubble
    assert spans_idle(run("zb_h2", 4, 4, 8, costs=costs).timeline).tolist() == h2_idle


@pytest.mark.parametrize("p, m", [(4, 8), (2, 4), (3, 9), (6, 12)])
def test_zbv_reaches_the_fill_bound_at_one_f_one_b_memory(p, m):
    sim = run("zbv", p, 2 * p, m, costs=SPLIT)
    # the last worker cannot start before p - 1 forwards have run: nothing beats busy + (p - 1) T_F
    assert sim.latency == pytest.approx(sim.timeline.busy_time.max() + (p - 1) * T_F)
    assert spans_idle(sim.timeline) == pytest.approx(0)  # no worker idles inside its span
    # two half-size stages per worker: 2p half stashes are 1F1B's p full ones
    assert max(sim.worker_stats()["max_activation_storage"]) <= 2 * p


# The hand-made orders come from their papers' structure, never from timings,
# so the same order runs, and the papers' formulas hold, under any costs.
UNEVEN_SPLIT = Costs(forward=[1.0, 2.5, 0.7, 1.9], backward_input=[1.2, 2.0, 0.4, 3.0],
                     backward_weight=[0.5, 1.5, 0.9, 0.3], latency=0.35)


def test_one_f_one_b_is_megatrons_order_with_one_chunk():
    """(torch's Schedule1F1B and ScheduleInterleaved1F1B orders: test_torch_interop)"""
    for p, m in [(4, 8), (4, 3), (6, 13), (1, 4)]:
        assert policies.get("one_f_one_b", p, p, m).worker_orders == policies.megatron_interleaved_orders(p, 1, m)


def test_one_f_one_b_keeps_its_rhythm_where_the_greedy_rule_would_not():
    # stage 2's backward is slow: backward-first greedy with 1F1B's limit runs
    # 2F0 2F1 2B0 2B1 2F2 2F3 there (two backwards in a row); 1F1B alternates
    costs = Costs(forward=1, backward=[1, 1, 2, 1])
    greedy = policies.get("gpipe", 4, 4, 8).with_(priority=unisched.BackwardFirst(4, 8), memory_limit=[4, 3, 2, 1])
    assert [str(w) for w in simulate(4, 4, 8, greedy, costs=costs).timeline.worker_order(2)[:6]] == \
        ["2F0", "2F1", "2B0", "2B1", "2F2", "2F3"]
    sim = run("one_f_one_b", 4, 4, 8, costs=costs)
    assert sim.timeline.worker_orders() == policies.megatron_interleaved_orders(4, 1, 8)
    assert sim.worker_stats()["max_activation_storage"] == [4, 3, 2, 1]


@pytest.mark.parametrize("frees", [0.25, 0.5, 0.6])
@pytest.mark.parametrize("p, m", [(4, 8), (6, 12), (3, 9)])
def test_zero_bubble_memory_is_the_papers_formula_under_any_costs(p, m, frees):
    """Worker i (from 1) of ZB-H1 holds (p - i + 1) M_B + (i - 1) M_W at its
    peak, of ZB-H2 (2p - 2i + 1) M_B + (2i - 2) M_W (the paper's Table 2
    text), with M_W = (1 - input_grad_frees) M_B: the warm-up forwards are
    in flight, and the W passes lag s and 2s micro-batches behind their I."""
    costs = Costs(forward=1.3, backward_input=1.1, backward_weight=0.6, latency=0.1, input_grad_frees=frees)
    kept = 1 - frees
    h1 = run("zb_h1", p, p, m, costs=costs).worker_stats()["max_activation_storage"]
    h2 = run("zb_h2", p, p, m, costs=costs).worker_stats()["max_activation_storage"]
    assert h1 == pytest.approx([(p - s) + s * kept for s in range(p)])
    assert h2 == pytest.approx([(2 * p - 2 * s - 1) + 2 * s * kept for s in range(p)])


def test_zero_bubble_strategies_follow_their_fixed_orders():
    for name, shape in [("zb_h1", (4, 4, 8)), ("zb_h2", (4, 4, 8)), ("zbv", (2, 4, 6)), ("dualpipe_v", (2, 4, 6))]:
        strategy = policies.get(name, *shape)
        assert strategy.split_backward
        sim = simulate(*shape, strategy, costs=UNEVEN_SPLIT)
        for worker, order in strategy.worker_orders.items():
            assert sim.timeline.worker_order(worker) == list(order)


@pytest.mark.parametrize("name, shape", [("one_f_one_b", (4, 4, 10**8)), ("interleaved", (4, 8, 10**8)),
                                         ("zb_h1", (4, 4, 10**8)), ("zbv", (2, 4, 10**8)),
                                         ("ScheduleDualPipeV", (2, 4, 10**8))])
def test_a_fixed_order_too_large_to_simulate_is_refused_before_it_is_built(name, shape):
    with pytest.raises(ShapeError, match="MAX_ITEMS"):
        policies.get(name, *shape)


@pytest.mark.parametrize("order, m", [(policies.dualpipe_v_order, 10), (zbv_order, 10), (zbv_order, 3)],
                         ids=["dualpipe_v", "zbv", "zbv fewer than 2W - 1 micro-batches"])
def test_v_orders_cover_every_pass_of_their_two_stages_once(order, m):
    p = 4
    for rank in range(p):
        ran = order(p, rank, m)
        stages = {rank, 2 * p - 1 - rank}
        expected = {Work(b, s, d) for b in range(m) for s in stages for d in (FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)}
        assert len(ran) == len(expected) and set(ran) == expected


# ---------------------------------------------------------------------- the seed's new pipelines
def test_cuckoo_moves_the_chosen_backwards_to_the_mirror_worker():
    strategy = policies.get("cuckoo", 6, 6, 12, stage_cutoff=2, batch_cutoff=3)
    for work in unisched.all_work(6, 12):
        compute, weight = strategy(work)
        moved = work.direction == BACKWARD and work.stage < 2 and work.batch < 3
        assert compute == (5 - work.stage if moved else work.stage)
        assert weight == work.stage
    defaults = policies.get("cuckoo", 6, 6, 12)
    assert defaults.params == {"stage_cutoff": 5, "batch_cutoff": 4}


def test_overflow_moves_early_stashes_to_the_extra_workers():
    sim = run("overflow", 6, 4, 8)
    peaks = sim.worker_stats()["max_activation_storage"]
    assert peaks[:2] == [0, 0] and min(peaks[4:]) > 0
    assert sim.latency == run("gpipe", 4, 4, 8).latency


# ---------------------------------------------------------------------- every strategy
SHAPES = [(4, 4, 8), (4, 8, 8), (8, 4, 8), (2, 4, 4), (3, 6, 6), (6, 4, 6), (4, 4, 4)]


def test_every_strategy_fits_some_shape_here():
    fitted = {name for shape in SHAPES for name, _ in policies.variants(*shape)}
    assert fitted == set(policies.names())


@pytest.mark.parametrize("shape", SHAPES)
def test_every_variant_simulates(shape):
    W, S, B = shape
    for name, params in policies.variants(*shape):
        strategy = policies.get(name, *shape, **params)
        costs = SPLIT if strategy.split_backward else UNIT
        sim = simulate(W, S, B, strategy, costs=costs)
        items = S * B * (3 if strategy.split_backward else 2)
        assert len(sim.timeline) == items, name
        assert sim.latency >= sim.lower_bound - 1e-9, name
        assert sim.strategy.name == name and sim.strategy.description


def test_every_variant_of_every_small_shape_simulates_with_its_own_orders():
    count = 0
    for W in range(1, 5):
        for S in range(1, 7):
            for B in range(1, 7):
                for name, params in policies.variants(W, S, B):
                    strategy = policies.get(name, W, S, B, **params)
                    sim = simulate(W, S, B, strategy)
                    assert len(sim.timeline) == S * B * (3 if strategy.split_backward else 2), (name, W, S, B)
                    count += 1
    assert count > 500


@pytest.mark.parametrize("shape", SHAPES)
def test_map_arrays_agrees_with_mapping(shape):
    W, S, B = shape
    for name, params in policies.variants(*shape):
        strategy = policies.get(name, *shape, **params)
        assert strategy.map_arrays is not None, name
        works = list(unisched.all_work(S, B, split_backward=strategy.split_backward))
        batch, stage, direction = (np.array(column) for column in zip(*works))
        compute, weight = strategy.map_arrays(batch, stage, direction.astype(np.int64))
        expected = np.array([tuple(strategy(w)) for w in works])
        assert np.array_equal(compute, expected[:, 0]), name
        assert np.array_equal(weight, expected[:, 1]), name


@settings(max_examples=30, deadline=None)
@given(W=st.integers(1, 8), S=st.integers(1, 8), B=st.integers(1, 10))
def test_map_arrays_agrees_with_mapping_on_random_shapes(W, S, B):
    for name, params in policies.variants(W, S, B, only=["ddp", "fsdp", "gpipe", "looped", "fully_sharded_looped",
                                                         "looped_bfs", "cuckoo", "overflow"]):
        strategy = policies.get(name, W, S, B, **params)
        works = list(unisched.all_work(S, B))
        batch, stage, direction = (np.array(column, dtype=np.int64) for column in zip(*works))
        compute, weight = strategy.map_arrays(batch, stage, direction)
        assert [tuple(p) for p in zip(compute.tolist(), weight.tolist())] == [tuple(strategy(w)) for w in works]


# ---------------------------------------------------------------------- registry and errors
@pytest.mark.parametrize(
    "name, shape, params, words",
    [
        ("ddp", (4, 4, 8), {}, ["W = B", "micro-batches to 4"]),
        ("fsdp", (4, 4, 8), {}, ["W = B"]),
        ("gpipe", (4, 8, 8), {}, ["W = S", "workers to 8"]),
        ("one_f_one_b", (2, 4, 8), {}, ["W = S"]),
        ("looped", (6, 4, 8), {"group_size": 4}, ["divisor of 6", "1, 2, 3, 6"]),
        ("looped", (8, 2, 8), {"group_size": 4}, ["at least 4 stages"]),
        ("interleaved", (4, 6, 8), {}, ["multiple of 4"]),
        ("interleaved", (4, 8, 6), {}, ["B=6", "multiple of 4"]),
        ("interleaved", (4, 8, 8), {"virtual_stages": 3}, ["S=12"]),
        ("looped_bfs", (4, 6, 8), {}, ["multiple of W"]),
        ("cuckoo", (4, 6, 8), {}, ["W = S"]),
        ("overflow", (4, 4, 8), {}, ["W > S"]),
        ("overflow", (6, 4, 8), {"stages": 5}, ["1..4"]),
        ("zb_h1", (4, 8, 8), {}, ["W = S"]),
        ("zbv", (4, 4, 8), {}, ["S must be 2W"]),
        ("dualpipe_v", (4, 8, 6), {}, ["at least 2W = 8"]),
    ],
)
def test_constraint_errors_say_what_to_change(name, shape, params, words):
    with pytest.raises(StrategyShapeError) as error:
        policies.get(name, *shape, **params)
    assert isinstance(error.value, UniSchedError)
    message = str(error.value)
    assert repr(name) in message
    for word in words:
        assert word in message


def test_unknown_strategy_lists_the_choices():
    with pytest.raises(UnknownStrategyError) as error:
        policies.get("pipedream", 4, 4, 8)
    assert isinstance(error.value, UniSchedError)
    for name in policies.names():
        assert name in str(error.value)


def test_bad_parameters_list_the_valid_ones():
    with pytest.raises(StrategyParameterError, match="its parameters are: group_size"):
        policies.get("looped", 4, 4, 8, groups=2)
    with pytest.raises(StrategyParameterError, match="oldest_batch_first, oldest_stage_first"):
        policies.get("gpipe", 4, 4, 8, priority="newest")
    with pytest.raises(StrategyParameterError, match="must be an integer"):
        policies.get("looped", 4, 4, 8, group_size="two")
    with pytest.raises(StrategyParameterError, match="num_batches"):
        policies.get("gpipe", num_workers=4, num_stages=4)


def test_parameters_from_a_command_line_are_coerced():
    assert policies.get("looped", 4, 4, 8, group_size="2").params == {"group_size": 2}
    assert policies.get("Looped-PP".replace("-PP", ""), 4, 4, 8).params == {"group_size": 4}


def test_catalog_describes_every_strategy_and_parameter():
    catalog = policies.catalog()
    assert [e["name"] for e in catalog] == policies.names()
    for e in catalog:
        assert e["description"] and e["constraints"] and e["family"]
        assert policies.describe(e["name"]) == e
        for param in e["params"]:
            assert set(param) >= {"name", "default", "help"} and param["help"]


def test_variants_respect_constraints_and_only():
    found = list(policies.variants(8, 4, 8))
    assert ("ddp", {}) in found and all(name != "gpipe" for name, _ in found)
    assert {p["group_size"] for n, p in found if n == "looped"} == {1, 2, 4}
    assert [n for n, _ in policies.variants(4, 4, 8, only=["zb_h1", "ddp"])] == ["zb_h1"]


def test_a_user_function_keeps_its_name():
    def my_pipeline(work):
        return unisched.ComputeAndWeightWorkers(work.stage, work.stage)

    named = policies.strategy(my_pipeline)
    assert named.name == "my_pipeline"
    renamed = policies.strategy(lambda w: (w.stage, w.stage), name="mine", description="my own")
    sim = simulate(4, 4, 8, renamed)
    assert sim.strategy.name == "mine" and sim.timeline.label == "mine"
    assert sim.latency == run("gpipe", 4, 4, 8).latency


def test_a_strategy_is_still_a_plain_function():
    strategy = policies.get("fsdp", 4, 2, 4)
    assert strategy(Work(3, 1, BACKWARD)) == (3, 1)
    assert unisched.policies is policies


def test_the_simulation_call_overrides_the_strategy_limit():
    strategy = policies.get("gpipe", 4, 4, 8).with_(priority=unisched.BackwardFirst(4, 8), memory_limit=[4, 3, 2, 1])
    assert simulate(4, 4, 8, strategy).worker_stats()["max_activation_storage"] == [4, 3, 2, 1]
    assert simulate(4, 4, 8, strategy, memory_limit=8).worker_stats()["max_activation_storage"] != [4, 3, 2, 1]
    assert BACKWARD_WEIGHT not in set(simulate(4, 4, 8, strategy).timeline.direction.tolist())


@pytest.mark.parametrize("name", ["zb_h1", "zb_h2", "zbv", "dualpipe_v"])
def test_constraint_checks_without_building_agree_with_building(name):
    for shape in [(4, 4, 8), (4, 8, 8), (4, 8, 6), (3, 6, 3), (2, 2, 1), (5, 10, 10)]:
        try:
            policies.get(name, *shape)
            buildable = True
        except StrategyShapeError:
            buildable = False
        assert policies.fits(name, unisched.Shape(*shape)) == buildable, shape


def test_fits_says_a_misfit_but_refuses_a_misspelt_or_mistyped_parameter():
    assert not policies.fits("looped", unisched.Shape(4, 4, 8), {"group_size": 3})  # 3 does not divide 4
    assert policies.fits("looped", unisched.Shape(4, 4, 8), {"group_size": 2})
    with pytest.raises(StrategyParameterError, match="has no parameter 'bogus'"):
        policies.fits("looped", unisched.Shape(4, 4, 8), {"bogus": 1})
    with pytest.raises(StrategyParameterError, match="group_size"):
        policies.fits("looped", unisched.Shape(4, 4, 8), {"group_size": "two"})


@pytest.mark.parametrize("cutoff", ["stage_cutoff", "batch_cutoff"])
def test_a_negative_cuckoo_cutoff_is_refused_not_run_as_gpipe(cutoff):
    with pytest.raises(StrategyParameterError, match=f"{cutoff} must be an integer >= 0"):
        policies.get("cuckoo", 4, 4, 8, **{cutoff: -1})
    with pytest.raises(StrategyParameterError):
        policies.fits("cuckoo", unisched.Shape(4, 4, 8), {cutoff: -1})
    assert policies.get("cuckoo", 4, 4, 2).params["batch_cutoff"] == 0  # B // 2 - 2 < 0: none moves, said as 0


def test_get_takes_parameters_written_in_the_name_as_the_command_line_does():
    assert policies.get("looped(group_size=2)", 4, 8, 8).params == policies.get("looped", 4, 8, 8, group_size=2).params
    assert policies.get("looped(group_size=2)", 4, 8, 8, group_size=2).params == {"group_size": 2}
    with pytest.raises(policies.StrategyParameterError, match="sets group_size=2 but group_size=4 is given beside it"):
        policies.get("looped(group_size=2)", 4, 8, 8, group_size=4)
    with pytest.raises(policies.StrategyParameterError, match="cannot read strategy"):
        policies.get("looped(group_size=2))", 4, 8, 8)


def test_a_flag_parameter_takes_true_or_false_only():
    assert policies.get("fsdp", 4, 4, 4, shard=1).params["shard"] is True
    with pytest.raises(policies.StrategyParameterError, match="'shard' must be true or false, got 2"):
        policies.get("fsdp", 4, 4, 4, shard=2)
