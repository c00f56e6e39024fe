"""The simulator: the seed's figures, the paper's closed forms and theorem,
timeline invariants, costs, DAGs, and bad input."""

import math
from dataclasses import replace

import networkx as nx
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import unisched
from unisched import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    ComputeAndWeightWorkers,
    Costs,
    DeadlockError,
    Direction,
    ShapeError,
    StrategyError,
    UniSchedError,
    Work,
    simulate,
)
from unisched import network
from unisched.dataflow import Items
from unisched.strategy import WorkerOrders
from unisched.simulate.priorities import BackwardFirst, OldestStageFirst

from seed_notebook import run_seed_cells

UNIT = 3.0  # one forward (1) + one backward (2) of one stage: the paper's unit of time


def ddp(w):
    return ComputeAndWeightWorkers(w.batch, w.batch)


def gpipe(w):
    return ComputeAndWeightWorkers(w.stage, w.stage)


def looped(num_workers, group_size):
    def h(x, y):
        return (group_size * y % num_workers) + (x % group_size)

    return lambda w: ComputeAndWeightWorkers(h(w.stage, w.batch), h(w.stage, w.batch))


def random_mapping(seed, W, S, B, split=False):
    """A strategy that sends each work item to random compute and weight workers."""
    rng = np.random.default_rng(seed)
    table = {w: (int(rng.integers(W)), int(rng.integers(W))) for w in unisched.all_work(S, B, split_backward=split)}
    return lambda work: ComputeAndWeightWorkers(*table[work])


def stats(sim, column):
    return sim.worker_stats()[column]


# ---------------------------------------------------------------------- seed figures
def test_seed_ddp():
    sim = simulate(8, 4, 8, ddp)
    assert sim.latency == 12
    assert round(sim.timeline.item_rate, 4) == 0.6667
    assert stats(sim, "max_activation_storage") == [4] * 8


def test_seed_fsdp():
    sim = simulate(8, 4, 8, lambda w: ComputeAndWeightWorkers(w.batch, w.stage % 8))
    assert sim.latency == 12
    assert round(sim.timeline.item_rate, 4) == 0.6667
    assert stats(sim, "max_activation_storage") == [4] * 8
    assert stats(sim, "weight_transmissions") == [6, 6, 6, 6, 8, 8, 8, 8]
    assert stats(sim, "weight_storage") == [1, 1, 1, 1, 0, 0, 0, 0]


def test_seed_gpipe_both_priorities():
    by_stage = simulate(4, 4, 8, gpipe, OldestStageFirst(4, 8))
    by_batch = simulate(4, 4, 8, gpipe)
    assert by_stage.latency == by_batch.latency == 33
    assert round(by_batch.timeline.item_rate, 4) == 0.4848
    assert stats(by_stage, "max_activation_storage") == [8, 8, 8, 8]
    assert stats(by_batch, "max_activation_storage") == [8, 7, 4, 1]


def test_a_built_in_priority_is_taken_by_class_or_name_as_well():
    made = simulate(4, 4, 8, gpipe, OldestStageFirst(4, 8)).timeline
    assert made.start.tolist() != simulate(4, 4, 8, gpipe).timeline.start.tolist()  # the priority matters here
    for given in (OldestStageFirst, "oldest_stage_first", "Oldest-Stage-First"):
        sim = simulate(4, 4, 8, gpipe, given)
        assert sim.timeline.start.tolist() == made.start.tolist()
        assert isinstance(sim.priority, OldestStageFirst)  # what the Simulation keeps is made, too
    # a strategy's own priority may be a class as well, replicated side by side
    from unisched.simulate.layout import replicated
    strategy = replace(unisched.policies.get("gpipe", num_workers=4, num_stages=4, num_batches=8),
                       priority=OldestStageFirst)
    two = replicated(strategy, 2)
    assert simulate(8, 4, 16, two).timeline.start.tolist() == \
        simulate(8, 4, 16, replicated(replace(strategy, priority=OldestStageFirst(4, 8)), 2)).timeline.start.tolist()
    with pytest.raises(ValueError, match="unknown priority 'newest'"):
        simulate(4, 4, 8, gpipe, "newest")


def test_the_priority_has_one_name_as_in_a_strategy_and_the_command():
    made = simulate(4, 4, 8, gpipe, OldestStageFirst).timeline.start.tolist()
    assert simulate(4, 4, 8, gpipe, priority="oldest_stage_first").timeline.start.tolist() == made
    with pytest.warns(DeprecationWarning, match="now simulate\\(priority=...\\)"):
        former = simulate(4, 4, 8, gpipe, priority_order="oldest_stage_first")
    assert former.timeline.start.tolist() == made
    with pytest.raises(TypeError, match="takes the priority once"):
        simulate(4, 4, 8, gpipe, "oldest_stage_first", priority_order="oldest_stage_first")


def test_seed_looped():
    sim = simulate(4, 4, 8, looped(4, 2))
    assert sim.latency == 28
    assert round(sim.timeline.item_rate, 4) == 0.5714
    assert stats(sim, "max_activation_storage") == [6, 3, 6, 3]
    assert stats(sim, "weight_storage") == [2, 2, 2, 2]


def test_seed_notebook_cells_run_unchanged():
    sims = run_seed_cells()
    assert len(sims) == 7
    ddp6, fsdp6, gpipe_stage, gpipe_batch, cuckoo, looped6, fs_looped6 = sims
    assert ddp6.latency == fsdp6.latency == 6 * UNIT
    assert gpipe_stage.latency == gpipe_batch.latency == (12 + 6 - 1) * UNIT
    assert stats(fs_looped6, "weight_storage") == [1, 1, 1, 1, 1, 1]
    assert stats(looped6, "weight_storage") == [2] * 6
    moved_backwards = 5 * 4  # stages < 6 // 2 + 2, batches < 12 // 2 - 2
    assert sum(stats(cuckoo, "weight_transmissions")) == moved_backwards


def test_cuckoo_counts_a_stash_on_the_backward_worker_from_the_forward_start():
    """F(s, b) on worker s, B(s, b) on worker W-s-1: the stash is W-s-1's from F's start."""
    W = S = 4

    def cuckoo(w):
        if w.direction == BACKWARD and w.stage == 0 and w.batch == 0:
            return ComputeAndWeightWorkers(W - 1, 0)
        return ComputeAndWeightWorkers(w.stage, w.stage)

    sim = simulate(W, S, 1, cuckoo)
    curve = sim.timeline.memory("activations", "units")[W - 1]
    forward_start = sim.timeline.start[sim.timeline.index()[Work(0, 0, FORWARD)]]
    assert curve.at(forward_start) == 1
    assert stats(sim, "max_activation_storage")[W - 1] == 2
    assert stats(sim, "max_activation_storage")[0] == 0


# ---------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("S", [1, 2, 3, 5])
@pytest.mark.parametrize("B", [1, 2, 4, 7])
def test_ddp_and_fsdp_latency_is_S(S, B):
    assert simulate(B, S, B, ddp).latency == S * UNIT
    assert simulate(B, S, B, lambda w: ComputeAndWeightWorkers(w.batch, w.stage % B)).latency == S * UNIT


@pytest.mark.parametrize("S", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("B", [1, 2, 5, 8, 12])
def test_pipeline_latency_and_memory(S, B):
    for priority in (None, OldestStageFirst(S, B)):
        assert simulate(S, S, B, gpipe, priority).latency == (B + S - 1) * UNIT
    limits = [min(S - s, B) for s in range(S)]
    one_f_one_b = simulate(S, S, B, gpipe, BackwardFirst(S, B), memory_limit=limits)
    assert one_f_one_b.latency == (B + S - 1) * UNIT
    peaks = stats(one_f_one_b, "max_activation_storage")
    assert peaks == limits
    assert max(peaks) == min(S, B)


@pytest.mark.parametrize("S,G,per_group", [(2, 2, 2), (3, 2, 3), (4, 2, 2), (4, 3, 2), (3, 4, 1)])
def test_looped_latency_with_R_equal_S(S, G, per_group):
    B = G * per_group
    sim = simulate(G * S, S, B, looped(G * S, S))
    assert sim.latency == (S + B / G - 1) * UNIT


def test_looped_with_R_below_S_is_slower_than_the_formula():
    S, R, W, B = 4, 2, 4, 8
    G = W // R
    sim = simulate(W, S, B, looped(W, R))
    formula = (S + B / G - 1) * UNIT
    work_per_worker = (S / R) * (B / G) * UNIT
    assert sim.latency > formula
    assert sim.latency >= work_per_worker


@settings(max_examples=60, deadline=None)
@given(
    W=st.integers(1, 5),
    S=st.integers(1, 5),
    B=st.integers(1, 6),
    seed=st.integers(0, 2**31),
)
def test_throughput_bounded_by_memory(W, S, B, seed):
    """rho = S B / (L W) <= 2 M / (S + 1), L in units of F + B, M the peak stash count.

    The stash of (s, b) is held from F(s, b)'s start to B(s, b)'s end, which
    encloses the chain F(s..S-1, b), B(S-1..s, b): at least (S - s) units.
    Summed over the S stages and B micro-batches that is B S (S + 1) / 2
    units of stash time, which the W workers hold at most M at a time over
    L: B S (S + 1) / 2 <= W M L.  (The last stage's stash lives one unit,
    so M / S, which assumes S units for every stage, is not a bound: W = S
    = B = 2 with stage 0's backward moved to the other worker gives L = 11,
    M = 1 and rho = 6/11 > 1/2.)"""
    sim = simulate(W, S, B, random_mapping(seed, W, S, B))
    rho = S * B / (sim.latency / UNIT * W)
    M = max(stats(sim, "max_activation_storage"))
    assert rho <= 2 * M / (S + 1) + 1e-9
    assert_valid_timeline(sim.timeline)


# ---------------------------------------------------------------------- invariants
def assert_valid_timeline(t, memory_limit=None, split_backward=False, stage_graph=None):
    """The simulator's invariants (Timeline.check), and that the timeline
    carries the backward form and stage graph it was simulated with."""
    assert t.split_backward == split_backward
    if stage_graph is None:
        assert t.stage_graph.is_chain
    else:
        assert set(t.stage_graph.graph.edges) == set(stage_graph.edges)
    assert t.check(memory_limit) is t


@settings(max_examples=40, deadline=None)
@given(
    W=st.integers(1, 4),
    S=st.integers(1, 4),
    B=st.integers(1, 5),
    split=st.booleans(),
    limit=st.one_of(st.none(), st.integers(2, 6)),
    seed=st.integers(0, 2**31),
)
def test_random_strategies_give_valid_timelines(W, S, B, split, limit, seed):
    try:
        sim = simulate(W, S, B, random_mapping(seed, W, S, B, split), memory_limit=limit, split_backward=split)
    except DeadlockError as error:
        assert error.blocked, "a deadlock names the blocked workers"
        return
    assert_valid_timeline(sim.timeline, limit, split)
    assert sim.latency >= sim.lower_bound - 1e-9


def test_memory_limit_turns_gpipe_into_1f1b():
    free = simulate(4, 4, 8, gpipe, BackwardFirst(4, 8))
    limited = simulate(4, 4, 8, gpipe, BackwardFirst(4, 8), memory_limit=4)
    assert max(stats(free, "max_activation_storage")) == 8
    assert max(stats(limited, "max_activation_storage")) == 4
    assert limited.latency == free.latency


def test_memory_limit_per_worker_is_respected():
    sim = simulate(4, 4, 8, gpipe, memory_limit=[2, 2, 2, 2])
    assert_valid_timeline(sim.timeline, [2, 2, 2, 2])
    assert max(stats(sim, "max_activation_storage")) == 2


def test_deadlocking_memory_limit_raises_naming_workers():
    with pytest.raises(DeadlockError) as caught:
        simulate(2, 4, 2, ddp, memory_limit=2)
    message = str(caught.value)
    assert "worker 0" in message and "memory" in message
    assert set(caught.value.blocked) == {0, 1}
    assert "or choose a priority that runs backwards earlier" in message


def test_a_deadlock_of_fixed_orders_does_not_advise_another_priority():
    fixed = unisched.policies.get("one_f_one_b", num_workers=4, num_stages=4, num_batches=8)
    with pytest.raises(DeadlockError) as caught:
        simulate(4, 4, 8, fixed, memory_limit=1)
    message = str(caught.value)
    assert "the strategy fixes each worker's order: no priority changes it" in message
    assert "priority that runs backwards earlier" not in message


def test_a_fixed_order_against_the_dependencies_names_each_workers_next_item_and_what_it_waits_for():
    stage_owner = unisched.policies.strategy(lambda w: ComputeAndWeightWorkers(w.stage, w.stage), name="by_stage")
    orders = {s: [Work(b, s, d) for b in range(2) for d in (FORWARD, BACKWARD)] for s in range(2)}
    orders[1][0], orders[1][1] = orders[1][1], orders[1][0]  # worker 1 puts 1B0 before 1F0
    with pytest.raises(DeadlockError) as caught:
        simulate(2, 2, 2, stage_owner.with_(worker_orders=orders))
    lines = str(caught.value).splitlines()
    assert ("  worker 1: B(stage 1, batch 0) (position 0 of its order) waits for F(stage 1, batch 0) "
            "(worker 1, position 1 of its order)") in lines
    assert ("  worker 0: B(stage 0, batch 0) (position 1 of its order) waits for B(stage 1, batch 0) "
            "(worker 1, position 0 of its order)") in lines
    with pytest.raises(DeadlockError) as roomy:  # memory to spare: the order, not the memory, is to blame
        simulate(2, 2, 2, stage_owner.with_(worker_orders=orders), memory_limit=100)
    assert str(roomy.value).splitlines()[1:3] == lines[1:3]
    assert "respects the dependencies" in str(roomy.value) and "raise the memory limit" not in str(roomy.value)


def test_numpy_integers_are_counts_like_any_other():
    W, B = np.arange(3, 5)  # a sweep over np.arange gave numpy integers, refused as "not a positive integer"
    strategy = unisched.policies.get("gpipe", W, W, B)
    assert simulate(W, W, B, strategy).latency == simulate(3, 3, 4, unisched.policies.get("gpipe", 3, 3, 4)).latency
    with pytest.raises(ShapeError, match="num_workers must be a positive integer, got np.True_"):
        simulate(np.bool_(True), 1, 1, strategy)
    from unisched.policies.pipeline import interleaved
    from unisched.policies.seed import cuckoo
    assert cuckoo(*np.array([4, 4, 8])).params == {"stage_cutoff": 4, "batch_cutoff": 2}  # it refused its defaults
    assert type(interleaved(*np.array([2, 4, 8])).params["virtual_stages"]) is int  # JSON takes it


def test_memory_limit_below_one_stash_is_a_clear_error():
    with pytest.raises(UniSchedError, match="cannot hold even one stash"):
        simulate(4, 4, 8, gpipe, memory_limit=0.5)


# ---------------------------------------------------------------------- split backward
def test_split_backward_dependencies_and_memory():
    costs = Costs(forward=1, backward_input=1, backward_weight=1, input_grad_frees=0.5)
    sim = simulate(4, 4, 4, gpipe, costs=costs, split_backward=True)
    assert_valid_timeline(sim.timeline, split_backward=True)
    assert len(sim.timeline) == 4 * 4 * 3
    halves = sim.timeline.memory("activations", "units")[3]
    assert any(v % 1 == 0.5 for v in halves.values), "an input-gradient pass frees half a stash"
    assert halves.values[-1] == 0, "the weight passes free the rest"


def test_costs_that_time_the_halves_split_the_backward_as_plan_and_the_command_do():
    costs = Costs(backward_input=5, backward_weight=5)
    split = simulate(4, 4, 8, gpipe, costs=costs)
    assert split.timeline.split_backward and split.latency == 106
    whole = simulate(4, 4, 8, gpipe, costs=costs, split_backward=False)
    assert not whole.timeline.split_backward and whole.latency == 121
    assert not simulate(4, 4, 8, gpipe, costs=Costs(backward=10)).timeline.split_backward
    fixed = unisched.policies.get("one_f_one_b", num_workers=4, num_stages=4, num_batches=8)
    assert not simulate(4, 4, 8, fixed, costs=costs).timeline.split_backward  # its own orders say B whole


def test_a_priority_for_a_strategy_that_fixes_every_order_is_refused():
    fixed = unisched.policies.get("one_f_one_b", num_workers=4, num_stages=4, num_batches=8)
    with pytest.raises(StrategyError, match="would change nothing: one_f_one_b fixes every worker's order"):
        simulate(4, 4, 8, fixed, "backward_first")


def test_a_memory_limit_or_split_flag_of_the_wrong_type_is_refused():
    for limit in ("4", b"1", True, [1, 2, "3", 4]):
        with pytest.raises(ShapeError, match="memory_limit must be a number or one number per worker"):
            simulate(4, 4, 8, gpipe, memory_limit=limit)
    with pytest.raises(ShapeError, match="split_backward must be True, False or None"):
        simulate(4, 4, 8, gpipe, split_backward="yes")
    assert simulate(4, 4, 8, gpipe, memory_limit=[4, 4, 4, 4.0]).latency == 33


def test_split_dependency_rules():
    assert unisched.dependencies(Work(0, 3, BACKWARD_INPUT), 4, split_backward=True) == (Work(0, 3, FORWARD),)
    assert unisched.dependencies(Work(0, 1, BACKWARD_INPUT), 4, split_backward=True) == (
        Work(0, 2, BACKWARD_INPUT),
        Work(0, 1, FORWARD),
    )
    assert unisched.dependencies(Work(0, 1, BACKWARD_WEIGHT), 4, split_backward=True) == (Work(0, 1, BACKWARD_INPUT),)


# ---------------------------------------------------------------------- costs
def test_transfer_delays_its_consumer_by_latency_plus_bytes_over_bandwidth():
    costs = Costs(activation_bytes=1000.0, latency=0.5, bandwidth=4000.0)
    sim = simulate(2, 2, 1, gpipe, costs=costs)
    t, index = sim.timeline, sim.timeline.index()
    f0, f1 = index[Work(0, 0, FORWARD)], index[Work(0, 1, FORWARD)]
    assert t.start[f1] == pytest.approx(t.end[f0] + 0.5 + 1000 / 4000)
    b1, b0 = index[Work(0, 1, BACKWARD)], index[Work(0, 0, BACKWARD)]
    assert t.start[b0] == pytest.approx(t.end[b1] + 0.75)
    kinds = [r.kind for r in t.transfers]
    assert kinds.count("activation") == 1 and kinds.count("gradient") == 1


def test_transfers_on_one_link_serialise():
    costs = Costs(activation_bytes=1.0, bandwidth=1.0)  # each transfer occupies the link for 1
    fast_forward = Costs(forward=0.25, backward=2, activation_bytes=1.0, bandwidth=1.0)
    sim = simulate(2, 2, 4, gpipe, costs=fast_forward)
    moves = sorted((r.start, r.end) for r in sim.timeline.transfers if r.kind == "activation")
    for (s1, e1), (s2, _) in zip(moves, moves[1:]):
        assert s2 >= e1 - 1e-9
    assert simulate(2, 2, 4, gpipe, costs=costs).latency > simulate(2, 2, 4, gpipe).latency


def test_per_stage_durations_and_worker_speed():
    costs = Costs(forward=[1, 2], backward=[2, 4], worker_speed=[1, 2])
    sim = simulate(2, 2, 1, gpipe, costs=costs)
    t, index = sim.timeline, sim.timeline.index()
    assert t.end[index[Work(0, 1, FORWARD)]] - t.start[index[Work(0, 1, FORWARD)]] == 1.0
    assert t.end[index[Work(0, 0, BACKWARD)]] - t.start[index[Work(0, 0, BACKWARD)]] == 2.0


def test_weight_fetches_delay_work_and_return_gradients():
    fsdp = lambda w: ComputeAndWeightWorkers(w.batch, w.stage % 2)  # noqa: E731
    costs = Costs(weight_bytes=2.0, bandwidth=1.0, prefetch_depth=0)
    sim = simulate(2, 2, 2, fsdp, costs=costs)
    t = sim.timeline
    fetches = [r for r in t.transfers if r.kind == "weights"]
    returns = [r for r in t.transfers if r.kind == "weight_gradient"]
    assert len(fetches) == 2 and len(returns) == 2  # cached: one per (worker, foreign stage)
    assert sim.latency > simulate(2, 2, 2, fsdp).latency
    uncached = simulate(2, 2, 2, fsdp, costs=Costs(weight_bytes=2.0, bandwidth=1.0, cache_weights=False))
    assert sum(r.kind == "weights" for r in uncached.timeline.transfers) == 4
    assert sum(r.kind == "weight_gradient" for r in uncached.timeline.transfers) == 2


def test_prefetch_hides_fetch_time():
    fsdp = lambda w: ComputeAndWeightWorkers(w.batch, w.stage % 2)  # noqa: E731
    base = dict(weight_bytes=0.5, bandwidth=1.0, cache_weights=False)
    eager = simulate(2, 4, 2, fsdp, costs=Costs(prefetch_depth=1, **base))
    lazy = simulate(2, 4, 2, fsdp, costs=Costs(prefetch_depth=0, **base))
    assert eager.latency < lazy.latency


def test_replicas_all_reduce_at_the_end():
    costs = Costs(weight_bytes=4.0, bandwidth=2.0, latency=0.0)
    sim = simulate(4, 2, 4, ddp, costs=costs)
    reduces = [r for r in sim.timeline.transfers if r.kind == "allreduce"]
    assert len(reduces) == 2 * 4
    assert sim.latency == pytest.approx(2 * UNIT + 2 * 3 / 4 * 4.0 / 2.0)


def test_a_tied_weight_ends_the_step_with_an_all_reduce_among_its_copies_holders():
    """Stages 0 and 3 hold copies of one weight of 4 bytes: a pipeline
    all-reduces it between workers 0 and 3 once both copies' gradients are
    done (4 bytes over a 2-worker ring at 1 byte a unit: 4 units more); a
    mapping that keeps both copies on one worker moves nothing for it."""
    pipeline = unisched.policies.one_f_one_b(4, 4, 8)
    untied = simulate(4, 4, 8, pipeline, costs=Costs(bandwidth=1.0))
    tied = simulate(4, 4, 8, pipeline, costs=Costs(bandwidth=1.0, tied_weights=[((0, 3), 4.0)]))
    rows = [r for r in tied.timeline.transfers if r.kind == "allreduce"]
    assert sorted((r.src, r.dst, r.nbytes) for r in rows) == [(0, 3, 4.0), (3, 0, 4.0)]
    t = tied.timeline
    gradients = np.isin(t.stage, (0, 3)) & (t.direction == BACKWARD)
    assert all(r.start == t.end[gradients].max() and r.end == r.start + 4.0 for r in rows)
    assert tied.latency == pytest.approx(untied.latency + 4.0)
    folded = lambda w: ComputeAndWeightWorkers(min(w.stage, 3 - w.stage), min(w.stage, 3 - w.stage))  # noqa: E731
    alone = simulate(2, 4, 4, folded, costs=Costs(bandwidth=1.0, tied_weights=[((0, 3), 4.0)]))
    assert not alone.timeline.transfers.of_kind("allreduce").any()
    assert alone.latency == simulate(2, 4, 4, folded, costs=Costs(bandwidth=1.0)).latency


def test_a_tied_weight_of_replicated_stages_is_all_reduced_after_their_replicas_are():
    """Under data parallelism every worker holds both copies: the tie's
    all-reduce among all four starts when the stages' own all-reduces end."""
    costs = Costs(weight_bytes=4.0, bandwidth=2.0, tied_weights=[((0, 1), 8.0)])
    sim = simulate(4, 2, 4, ddp, costs=costs)
    rows = sim.timeline.transfers
    reduces = rows.of_kind("allreduce")
    tie = reduces & (rows.nbytes == 2 * 3 / 4 * 8.0)
    assert tie.sum() == 4 and (reduces & ~tie).sum() == 2 * 4
    assert np.all(rows.start[tie] == rows.end[reduces & ~tie].max())
    assert sim.latency == pytest.approx(2 * UNIT + 2 * 3 / 4 * 4.0 / 2.0 + 2 * 3 / 4 * 8.0 / 2.0)


def test_tied_weights_are_checked_and_round_trip(tmp_path):
    costs = Costs(tied_weights=[{"stages": [3, 0], "bytes": 10}])
    assert costs.tied_weights == (unisched.TiedWeight((0, 3), 10.0),)
    costs.save(tmp_path / "costs.json")
    assert Costs.load(tmp_path / "costs.json") == costs
    for bad, message in [([((0,), 1.0)], "two or more distinct stage indices"),
                         ([((1, 1), 1.0)], "two or more distinct stage indices"),
                         ([((-1, 2), 1.0)], "two or more distinct stage indices"),
                         ([((0, 1), -1.0)], "finite size >= 0"),
                         ({"stages": [0, 1], "bytes": 1}, "must be a list of tied weights")]:
        with pytest.raises(UniSchedError, match=message):
            Costs(tied_weights=bad)
    with pytest.raises(UniSchedError, match=r"names stages \[0, 3\] but there are 3 stages"):
        costs.check(num_workers=3, num_stages=3)


def test_free_and_costed_runs_move_the_same_things():
    fsdp = lambda w: ComputeAndWeightWorkers(w.batch % 2, w.stage % 2)  # noqa: E731
    free = simulate(2, 3, 4, fsdp, costs=Costs(activation_bytes=1, weight_bytes=1))
    costed = simulate(2, 3, 4, fsdp, costs=Costs(activation_bytes=1, weight_bytes=1, latency=1e-6))

    def counts(sim):
        return sorted((r.kind, r.src, r.dst) for r in sim.timeline.transfers)

    assert counts(free) == counts(costed)


def test_costs_file_round_trip(tmp_path):
    costs = Costs(forward=[1, 2], backward=3, activation_bytes=10, bandwidth=5.0, links={(0, 1): {"latency": 2}})
    path = tmp_path / "costs.json"
    costs.save(path)
    again = Costs.load(path)
    assert again.forward == [1, 2] and again.link(0, 1).latency == 2 and again.bandwidth == 5.0
    path.write_text('{"forwrd": 1}')
    with pytest.raises(UniSchedError, match="forwrd"):
        Costs.load(path)


# ---------------------------------------------------------------------- DAG of stages
def test_two_encoders_feed_a_decoder():
    graph = nx.DiGraph([(0, 2), (1, 2), (2, 3)])
    placement = {0: 0, 1: 1, 2: 2, 3: 2}
    strategy = lambda w: ComputeAndWeightWorkers(placement[w.stage], placement[w.stage])  # noqa: E731
    costs = Costs(forward=[1, 3, 1, 1], backward=[2, 2, 2, 2])
    sim = simulate(3, 4, 2, strategy, costs=costs, stage_graph=graph)
    t, index = sim.timeline, sim.timeline.index()
    assert_valid_timeline(t, stage_graph=graph)
    assert t.start[index[Work(0, 2, FORWARD)]] == 3  # waits for the slower leg
    assert t.start[index[Work(0, 0, BACKWARD)]] >= t.end[index[Work(0, 2, BACKWARD)]]
    assert t.start[index[Work(0, 1, BACKWARD)]] >= t.end[index[Work(0, 2, BACKWARD)]]


def test_stage_graph_must_be_a_dag_on_all_stages():
    with pytest.raises(UniSchedError, match="cycle"):
        simulate(2, 2, 1, gpipe, stage_graph=nx.DiGraph([(0, 1), (1, 0)]))
    with pytest.raises(UniSchedError, match="missing"):
        simulate(2, 3, 1, gpipe, stage_graph=nx.DiGraph([(0, 1)]))


# ---------------------------------------------------------------------- bad input
def test_worker_out_of_range_names_the_work():
    with pytest.raises(StrategyError, match=r"Work\(batch=0, stage=3"):
        simulate(3, 4, 2, gpipe)


def test_non_integer_worker_names_the_work():
    with pytest.raises(StrategyError, match=r"Work\(batch=0, stage=0.*integers"):
        simulate(2, 2, 2, lambda w: ComputeAndWeightWorkers(0.5, 0))


def test_strategy_that_raises_names_the_work():
    def broken(w):
        if w.stage == 1:
            raise KeyError("no such stage")
        return ComputeAndWeightWorkers(0, 0)

    with pytest.raises(StrategyError, match=r"failed on Work\(batch=0, stage=1.*KeyError"):
        simulate(2, 2, 2, broken)


@pytest.mark.parametrize("shape", [(0, 2, 2), (2, 0, 2), (2, 2, -1), (2.5, 2, 2)])
def test_bad_shapes(shape):
    with pytest.raises(UniSchedError):
        simulate(*shape, gpipe)


def test_fixed_orders_are_followed_and_checked():
    order = {0: [Work(1, 0, FORWARD), Work(0, 0, FORWARD), Work(0, 0, BACKWARD), Work(1, 0, BACKWARD)]}
    strategy = unisched.Strategy(lambda w: ComputeAndWeightWorkers(0, 0), name="fixed", worker_orders=order)
    sim = simulate(1, 1, 2, strategy)
    assert sim.timeline.worker_order(0) == order[0]
    bad = unisched.Strategy(lambda w: ComputeAndWeightWorkers(0, 0), worker_orders={0: order[0][:3]})
    with pytest.raises(StrategyError, match="leave out"):
        simulate(1, 1, 2, bad)
    backwards = {0: [Work(0, 0, BACKWARD), Work(0, 0, FORWARD), Work(1, 0, FORWARD), Work(1, 0, BACKWARD)]}
    with pytest.raises(DeadlockError):
        simulate(1, 1, 2, unisched.Strategy(lambda w: ComputeAndWeightWorkers(0, 0), worker_orders=backwards))


def test_fixed_orders_as_item_ids_are_followed_and_checked():
    """Orders given as arrays of item ids (dataflow.Items numbering) run as
    the same orders given as Work, and are checked the same way."""
    items = Items(1, 2)
    order = [Work(1, 0, FORWARD), Work(0, 0, FORWARD), Work(0, 0, BACKWARD), Work(1, 0, BACKWARD)]
    ids = items.id(*np.array(order).T)
    mapping = lambda w: ComputeAndWeightWorkers(0, 0)  # noqa: E731
    for orders in ({0: ids}, WorkerOrders(items, {0: ids})):
        sim = simulate(1, 1, 2, unisched.Strategy(mapping, worker_orders=orders))
        assert sim.timeline.worker_order(0) == order
    assert WorkerOrders(items, {0: ids}) == {0: order}
    replay = unisched.fixed_strategy((1, 1, 2), [0] * 4, [0] * 4, {0: ids})
    assert isinstance(replay.worker_orders, WorkerOrders)
    assert simulate(1, 1, 2, replay).timeline.worker_order(0) == order
    with pytest.raises(StrategyError, match="leave out"):
        simulate(1, 1, 2, unisched.Strategy(mapping, worker_orders={0: ids[:3]}))
    with pytest.raises(StrategyError, match=r"worker 0's order has 0B0 \(micro-batch 0, stage 0, backward\) twice, at "
                                             "positions 2 and 3; name each work item once"):
        simulate(1, 1, 2, unisched.Strategy(mapping, worker_orders={0: ids[[0, 1, 2, 2]]}))
    with pytest.raises(StrategyError, match="item ids outside 0..3"):
        simulate(1, 1, 2, unisched.Strategy(mapping, worker_orders={0: ids + 1}))
    two = lambda w: ComputeAndWeightWorkers(w.batch, w.batch)  # noqa: E731
    with pytest.raises(StrategyError, match="the mapping sends it to worker 1"):
        simulate(2, 1, 2, unisched.Strategy(two, worker_orders={0: ids, 1: ids[:0]}))


def test_strategy_is_called_once_per_work_item():
    calls = []

    def counting(w):
        calls.append(w)
        return ComputeAndWeightWorkers(w.stage, w.stage)

    simulate(4, 4, 8, counting)
    assert len(calls) == len(set(calls)) == 4 * 8 * 2


def seed_style(w):
    return ComputeAndWeightWorkers(w.stage % 8, w.stage % 8)


def branching(w):
    if w.direction == BACKWARD and w.stage == 0:
        return ComputeAndWeightWorkers(1, 0)
    return ComputeAndWeightWorkers(w.stage % 8, w.stage % 8)


def branches_without_failing(w):
    """Vectorises without an error but wrong on arrays: ``w.batch.max()``
    is a whole array's maximum, a number per item."""
    b = w.batch.max() if isinstance(w.batch, np.ndarray) else w.batch
    return ComputeAndWeightWorkers((w.stage + b) % 8, 0)


@pytest.mark.parametrize("mapping", [seed_style, branching, branches_without_failing])
def test_a_plain_function_runs_on_arrays_where_that_gives_what_per_item_calls_give(mapping):
    calls = []

    def counting(w):
        calls.append(isinstance(w.stage, np.ndarray))
        return mapping(w)

    W, S, B = 8, 16, 64
    fast_way = simulate(W, S, B, counting).timeline
    for b, s, d, c, k in zip(fast_way.batch, fast_way.stage, fast_way.direction, fast_way.worker, fast_way.weight_worker):
        assert tuple(mapping(Work(int(b), int(s), Direction(int(d))))) == (c, k)
    on_arrays = calls.count(True)
    assert on_arrays == 1, "one call on arrays is tried first"
    if mapping is seed_style:
        assert len(calls) < 300, "and a sample of per-item calls checks it"
    else:
        assert len(calls) > S * B * 2, "a function that branches runs per item"


def test_map_arrays_that_disagree_with_the_mapping_or_give_no_integers_are_refused():
    wrong = unisched.Strategy(seed_style, map_arrays=lambda b, s, d: (s % 4, s % 4))
    with pytest.raises(StrategyError, match=r"map_arrays gives .* but its mapping gives"):
        simulate(8, 16, 64, wrong)
    fractional = unisched.Strategy(seed_style, map_arrays=lambda b, s, d: (s * 0.9, s))
    with pytest.raises(StrategyError, match=r"map_arrays returned compute workers of type float64"):
        simulate(8, 16, 64, fractional)


# ---------------------------------------------------------------------- results
def test_result_reports_and_bounds():
    sim = simulate(4, 4, 8, gpipe)
    assert "latency 33" in repr(sim)
    assert "peak activations per worker 8,7,4,1" in sim.summary()
    assert sim.lower_bound == 24  # the busiest worker's 8 forwards and 8 backwards
    assert sim.lower_bounds["shape"] == max(4 * 8 * UNIT / 4, 4 * UNIT)
    assert sim.bubble_fraction == pytest.approx(1 - 4 * 8 * UNIT / (33 * 4))
    columns = sim.worker_stats()
    for name in unisched.metrics.STAT_COLUMNS:
        assert len(columns[name]) == 4
    assert columns["utilization"] == pytest.approx([24 / 33] * 4)
    assert columns["activation_transmissions"] == [8, 16, 16, 8]


def test_memory_curves_in_bytes():
    costs = Costs(activation_bytes=[10, 20], weight_bytes=[100, 200])
    sim = simulate(2, 2, 2, gpipe, costs=costs)
    peak = sim.worker_stats()["peak_memory_bytes"]
    # the weights, and their gradient from the end of the stage's first
    # backward to the optimizer step, beside one stash: worker 0 still holds
    # 0F1's input (10) when 0B0 ends; worker 1 starts 1F1 (20) as 1B0 ends
    assert peak == [100 + 100 + 1 * 10, 200 + 200 + 1 * 20]


def test_work_text_form_round_trips():
    for work in [Work(0, 2, FORWARD), Work(11, 0, BACKWARD_WEIGHT)]:
        assert Work.parse(str(work)) == work
    assert str(Work(0, 2, FORWARD)) == "2F0"
    assert Work(batch=1, stage=2, direction=Direction.BACKWARD) == Work(1, 2, BACKWARD)
    assert math.isclose(simulate(1, 1, 1, gpipe).latency, UNIT)


# ---------------------------------------------------------------------- tensor parallelism
def test_gang_items_keep_their_whole_group_busy():
    """Stage 1 split over workers 1 and 2: its items start when both are free."""
    strategy = unisched.Strategy(
        lambda w: ComputeAndWeightWorkers(min(w.stage, 1) if w.stage < 2 else 2, w.stage),
        name="split middle",
        gang=lambda w: (1, 2) if w.stage == 1 else None,
    )
    sim = simulate(3, 3, 4, strategy)
    t = sim.timeline
    assert_valid_timeline(t)
    ganged = np.flatnonzero(t.gang >= 0)
    assert len(ganged) == 4 * 2 and t.gang_members == ((1, 2),)
    assert t.busy_time[2] == pytest.approx(4 * UNIT + 4 * UNIT)


def test_gang_collective_costs_time():
    base = dict(activation_bytes=8.0, bandwidth=4.0)
    strategy = unisched.Strategy(lambda w: ComputeAndWeightWorkers(0, 0), gang=lambda w: (0, 1))
    sim = simulate(2, 1, 1, strategy, costs=Costs(**base))
    all_reduce = 2 * 1 / 2 * 8.0 / 4.0  # per pass: 2(k-1)/k of the activation over the ring
    hand_out = 8.0 / 4.0  # the backward's output gradient (from the loss) broadcast to member 1
    assert sim.latency == pytest.approx(UNIT + 2 * all_reduce + hand_out)
    moved = sim.timeline.transfers
    assert [(tr.kind, tr.src, tr.dst, tr.nbytes) for tr in moved] == [("gradient", 0, 1, 8.0)]


def test_gang_must_hold_its_compute_worker():
    strategy = unisched.Strategy(lambda w: ComputeAndWeightWorkers(0, 0), gang=lambda w: (1, 2))
    with pytest.raises(StrategyError, match="gang"):
        simulate(3, 1, 1, strategy)


@pytest.mark.parametrize("as_ids", [False, True], ids=["Work", "item ids"])
def test_fixed_orders_follow_the_backward_form_asked_for(as_ids):
    order = {0: [Work(0, 0, FORWARD), Work(0, 0, BACKWARD)]}
    split_order = {0: [Work(0, 0, FORWARD), Work(0, 0, BACKWARD_INPUT), Work(0, 0, BACKWARD_WEIGHT)]}
    if as_ids:
        order, split_order = WorkerOrders(Items(1, 1), {0: np.arange(2)}), WorkerOrders(Items(1, 1, True), {0: np.arange(3)})
    strategy = unisched.Strategy(lambda w: ComputeAndWeightWorkers(0, 0), worker_orders=order)
    split = simulate(1, 1, 1, strategy, split_backward=True)
    assert split.timeline.worker_order(0) == [Work(0, 0, FORWARD), Work(0, 0, BACKWARD_INPUT), Work(0, 0, BACKWARD_WEIGHT)]
    joined = simulate(1, 1, 1, strategy.with_(worker_orders=split_order, split_backward=True), split_backward=False)
    assert joined.timeline.worker_order(0) == [Work(0, 0, FORWARD), Work(0, 0, BACKWARD)]


GANG_CASE = (2, 4, 4, "10000101000010001110100001110001", {2})
"""A gang item made ready while its leader was busy, and its partner busier."""


@settings(max_examples=30, deadline=None)
@given(W=st.integers(2, 4), S=st.integers(1, 4), B=st.integers(1, 4), seed=st.integers(0, 2**31))
@example(W=2, S=4, B=4, seed=-1)
def test_random_gangs_never_overlap_their_workers(W, S, B, seed):
    rng = np.random.default_rng(abs(seed))
    table = {w: int(rng.integers(W)) for w in unisched.all_work(S, B)}
    ganged = {s for s in range(S) if rng.random() < 0.5}
    if seed == -1:
        table = {w: int(c) for w, c in zip(unisched.all_work(S, B), GANG_CASE[3])}
        ganged = GANG_CASE[4]
    strategy = unisched.Strategy(
        lambda w: ComputeAndWeightWorkers(0 if w.stage in ganged else table[w], 0),
        gang=lambda w: (0, 1) if w.stage in ganged else None,
    )
    t = simulate(W, S, B, strategy).timeline
    assert_valid_timeline(t)


def test_a_gang_without_collective_costs_no_all_reduce_only_its_rows():
    base = Costs(activation_bytes=8.0, weight_bytes=16.0, bandwidth=4.0)
    shared = unisched.Strategy(lambda w: ComputeAndWeightWorkers(0, 0), gang=lambda w: unisched.Gang((0, 1), False))
    sim = simulate(2, 1, 1, shared, costs=base)
    # member 1 fetches the whole stage (4) and returns its gradient; a source
    # stage slices its rows from the micro-batch; the first member collects
    # member 1's half of the output (1), then hands it half the output
    # gradient (1); a source needs no input gradient back
    assert sim.timeline.end.max() == pytest.approx(4.0 + UNIT + 2 * (4.0 / 4.0))
    assert sorted((tr.kind, tr.src, tr.dst, tr.nbytes, tr.start) for tr in sim.timeline.transfers) == [
        ("activation", 1, 0, 4.0, 5.0), ("gradient", 0, 1, 4.0, 6.0),
        ("weight_gradient", 1, 0, 16.0, 9.0), ("weights", 0, 1, 16.0, 0.0),
    ]


def test_stash_bytes_count_in_memory_and_limits():
    costs = Costs(activation_bytes=10.0, stash_bytes=30.0)
    sim = simulate(2, 2, 2, gpipe, costs=costs)
    assert sim.timeline.memory("activations", "bytes")[0].peak == 2 * 30.0
    limited = simulate(2, 2, 2, gpipe, costs=costs, memory_limit=30.0)
    assert limited.timeline.memory("activations", "bytes")[0].peak == 30.0
    with pytest.raises(UniSchedError, match="cannot hold even one stash"):
        simulate(2, 2, 2, gpipe, costs=costs, memory_limit=20.0)


def test_drawing_view_keeps_the_throughput_of_the_items():
    strategy = unisched.Strategy(lambda w: ComputeAndWeightWorkers(0, 0), gang=lambda w: (0, 1))
    t = simulate(2, 2, 2, strategy).timeline
    assert len(t.per_worker()) == 2 * len(t)
    assert t.per_worker().throughput == t.throughput


def test_a_link_fills_gaps_in_time_order_not_booking_order():
    from unisched.simulate.engine import _Calendar

    link = _Calendar()
    assert link.book(5, 2) == 5  # booked first, sent later
    assert link.book(0, 2) == 0  # booked later for an earlier time: it goes first
    assert link.book(0, 2) == 2
    assert link.book(1, 3) == 7  # no gap of 3 before the transfer at 5..7
    assert link.book(4, 0) == 4  # a transfer that occupies nothing never waits


def test_unlimited_link_bandwidth_round_trips_as_null(tmp_path):
    costs = Costs(links={(0, 1): unisched.Link(latency=1.0)})
    path = tmp_path / "costs.json"
    costs.save(path)
    assert '"bandwidth": null' in path.read_text()
    assert network.transfer_time(Costs.load(path), 0, 1, 100.0) == 1.0


def test_measured_latency_counts_from_the_first_item():
    records = [unisched.WorkRecord(Work(0, 0, FORWARD), 0, 0, 100.0, 101.0),
               unisched.WorkRecord(Work(0, 0, BACKWARD), 0, 0, 101.0, 103.0)]
    t = unisched.Timeline.from_records((1, 1, 1), records, source="measured")
    assert t.latency == 3.0 and t.bubble_fraction == 0.0


def test_a_strategys_own_limit_counts_stashes_even_with_sizes():
    strategy = unisched.policies.get("one_f_one_b", num_workers=4, num_stages=4, num_batches=8)
    sim = simulate(4, 4, 8, strategy, costs=Costs(activation_bytes=1e6))
    assert stats(sim, "max_activation_storage") == [4, 3, 2, 1]


def test_a_moved_stash_carries_the_stage_inputs_and_nothing_at_a_source():
    def cuckoo(w):  # every backward on the other worker than its forward
        return ComputeAndWeightWorkers(1 - w.stage if w.direction == BACKWARD else w.stage, w.stage)

    sim = simulate(2, 2, 1, cuckoo, costs=Costs(activation_bytes=3.0, stash_bytes=50.0, bandwidth=1.0))
    stashes = [(r.src, r.dst, r.nbytes, r.end - r.start, r.work) for r in sim.timeline.transfers if r.kind == "stash"]
    # stage 1's backward recomputes its forward from its input (3 bytes); stage
    # 0's input is the micro-batch, which worker 1 has already
    assert stashes == [(1, 0, 3.0, 3.0, Work(0, 1, BACKWARD))]


def test_all_reduce_is_as_slow_as_the_ring_s_slowest_hop():
    slow = Costs(weight_bytes=1e6, bandwidth=1e6)
    one_fast_hop = Costs(weight_bytes=1e6, bandwidth=1e6, links={(0, 1): unisched.Link(0.0, 1e12)})
    assert simulate(4, 4, 4, ddp, costs=slow).latency == simulate(4, 4, 4, ddp, costs=one_fast_hop).latency


def test_a_stage_graph_of_another_size_is_refused():
    with pytest.raises(UniSchedError, match="stage_graph has 4 stages"):
        simulate(3, 3, 2, gpipe, stage_graph=unisched.StageGraph(4))


@pytest.mark.parametrize("bad", [dict(prefetch_depth="1"), dict(latency=None), dict(links=[1, 2]),
                                 dict(links={"0,1": {"bw": 2}}), dict(forward=True)])
def test_bad_cost_fields_are_named(bad):
    with pytest.raises(UniSchedError, match=next(iter(bad))):
        Costs(**bad)


@settings(max_examples=40, deadline=None)
@given(
    W=st.integers(1, 4),
    S=st.integers(1, 4),
    B=st.integers(1, 5),
    split=st.booleans(),
    sizes=st.lists(st.sampled_from([1.0, 2.0, 5.0]), min_size=4, max_size=4),
    latency=st.sampled_from([0.0, 0.5]),
    limit_stashes=st.one_of(st.none(), st.integers(2, 6)),
    seed=st.integers(0, 2**31),
)
def test_random_strategies_with_sizes_costs_and_byte_limits(W, S, B, split, sizes, latency, limit_stashes, seed):
    costs = Costs(activation_bytes=sizes[:S], weight_bytes=3.0, latency=latency, bandwidth=4.0)
    limit = None if limit_stashes is None else limit_stashes * max(sizes[:S])
    try:
        sim = simulate(W, S, B, random_mapping(seed, W, S, B, split), costs=costs,
                       memory_limit=limit, split_backward=split)
    except DeadlockError as error:
        assert error.blocked
        return
    t = sim.timeline
    assert_valid_timeline(t, split_backward=split)
    if limit is not None:
        assert max(c.peak for c in t.memory("activations", "bytes")) <= limit + 1e-9
    for r in t.transfers:
        if r.kind in ("activation", "gradient", "stash"):
            assert r.end - r.start >= latency + r.nbytes / 4.0 - 1e-9


def test_a_returned_gradient_is_held_from_its_backward_until_sent():
    """From the start of the backward that makes it (unisched.memory) to the end of its return."""
    fsdp = lambda w: ComputeAndWeightWorkers(w.batch, w.stage % 2)  # noqa: E731
    sim = simulate(2, 2, 2, fsdp, costs=Costs(weight_bytes=2.0, bandwidth=1.0, cache_weights=False))
    t = sim.timeline
    sent = [r for r in t.transfers if r.kind == "weight_gradient"]
    assert sent
    expected = np.zeros(2)
    for r in sent:
        expected[r.src] += r.nbytes * (r.end - t.start[t.index()[r.work]])
    held = [float(np.sum(c.values[:-1] * np.diff(c.times))) for c in t.memory("gradients", "bytes")]
    assert held == pytest.approx(expected.tolist()) and expected.sum() > 0


def _item_starts(t, split=False):
    """Each item id's start time in timeline ``t``."""
    ids = Items(t.num_stages, t.num_batches, split).id(t.batch, t.stage, t.direction)
    starts = np.empty(len(ids))
    starts[ids] = t.start
    return starts


@pytest.mark.parametrize("costs", [Costs(), Costs(activation_bytes=1.0, latency=0.5, bandwidth=2.0)])
def test_a_release_time_delays_exactly_its_item(costs):
    """A fixed strategy's release holds one item back to that time; what started before it is untouched."""
    first = simulate(2, 2, 4, unisched.policies.get("one_f_one_b", num_workers=2, num_stages=2, num_batches=4),
                     costs=costs).timeline
    before = _item_starts(first)
    item = int(np.argsort(before)[len(before) // 2])
    release = np.zeros(len(before))
    release[item] = before[item] + 3.0
    replay = simulate(2, 2, 4, first.as_strategy().with_(release=release), costs=costs).timeline
    after = _item_starts(replay)
    assert after[item] == before[item] + 3.0
    earlier = before < before[item]
    assert earlier.any() and np.array_equal(after[earlier], before[earlier])
    assert replay.latency > first.latency


def test_release_times_of_a_schedule_s_own_starts_replay_it_unchanged():
    """Under a memory limit, a schedule replayed with its own starts as releases is the same schedule."""
    sim = simulate(2, 4, 8, random_mapping(5, 2, 4, 8, False), memory_limit=5)  # the limit binds here
    starts = _item_starts(sim.timeline)
    replay = simulate(2, 4, 8, sim.timeline.as_strategy().with_(release=starts), memory_limit=5).timeline
    assert np.array_equal(_item_starts(replay), starts)


def test_release_times_are_checked():
    """One finite, non-negative release time per item, else an error naming ``release``."""
    t = simulate(2, 2, 2, unisched.policies.get("gpipe", num_workers=2, num_stages=2, num_batches=2)).timeline
    rows = t._rows_by_item()
    args = (t.shape, t.worker[rows], t.weight_worker[rows], t.worker_orders())
    with pytest.raises(unisched.UniSchedError, match="release"):
        unisched.fixed_strategy(*args, release=[0.0, 1.0])
    with pytest.raises(unisched.UniSchedError, match=r"release\[1\]"):
        unisched.fixed_strategy(*args, release=[0.0, -1.0] + [0.0] * (len(rows) - 2))
    with pytest.raises(unisched.UniSchedError, match="release"):
        simulate(2, 2, 2, t.as_strategy().with_(release=np.zeros(3)))


def test_a_factory_passed_as_a_strategy_says_to_call_it_with_the_shape():
    def factory(num_workers, num_stages, num_batches):
        return gpipe

    with pytest.raises(StrategyError, match=r"factory \(num_workers, num_stages, num_batches\).*factory\(W, S, B\)"):
        simulate(4, 4, 8, factory)
    assert simulate(4, 4, 8, factory(4, 4, 8)).latency == 33


def test_a_priority_made_for_another_shape_is_refused():
    with pytest.raises(ShapeError, match=r"BackwardFirst\(2, 2\) was made for 2 stages and 2 micro-batches"):
        simulate(4, 4, 8, gpipe, unisched.BackwardFirst(2, 2))
    assert simulate(4, 4, 8, gpipe, unisched.BackwardFirst(4, 8)).latency == \
        simulate(4, 4, 8, gpipe, unisched.BackwardFirst).latency


def test_a_strategy_given_by_name_is_told_how_to_build_it():
    with pytest.raises(TypeError, match=r"not its name 'gpipe'.*unisched.policies.get\('gpipe', num_workers"):
        simulate(4, 4, 8, "gpipe")
