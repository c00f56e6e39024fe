"""The executor over stage graphs and gangs: its messages come from
unisched.dataflow, a stage DAG and a stage run by a gang of ranks (tensor
parallel or sharing rows) train on gloo like one process, and what cannot
run (several sinks, a gang with a split backward) is refused by name at
compile time."""

from __future__ import annotations

import dataclasses

import networkx as nx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import unisched
from unisched import ComputeAndWeightWorkers, Direction, Work, simulate
from unisched.execute import ProgramError, Trainer, compile_program, train_one_process
from unisched.execute.program import validate
from unisched.strategy import Gang, Strategy
from unisched.timeline import Transfers

from test_execute import WIDTH, assert_every_rank_matches, batch, largest_change, optimizer, run_ranks, state_of

TWO_LEGS = [(0, 2), (1, 2)]
CHAIN = [(0, 1), (1, 2)]
DIAMOND = [(0, 1), (0, 2), (1, 3), (2, 3)]
W, B = 3, 4


# ---------------------------------------------------------------------- model and schedules
class Join(nn.Module):
    """One Linear per input, summed: swapping two inputs changes the result."""

    def __init__(self, inputs: int):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(inputs))

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(sum(linear(x) for linear, x in zip(self.linears, xs)))


def graph_of(edges) -> nx.DiGraph:
    return nx.DiGraph(edges)


def make_stages(edges) -> list[nn.Module]:
    graph = graph_of(edges)
    torch.manual_seed(0)
    return [Join(max(1, graph.in_degree(s))) for s in range(graph.number_of_nodes())]


def on_table(table: dict[int, int]):
    """Stage s on worker table[s], its weights there too."""
    return lambda w: ComputeAndWeightWorkers(table[w.stage], table[w.stage])


def head_backward_away(w: Work) -> ComputeAndWeightWorkers:
    """Stage s on worker s, but the head's backward of micro-batch b on worker b mod 2."""
    if w.stage == 2 and w.direction == Direction.BACKWARD:
        return ComputeAndWeightWorkers(w.batch % 2, 2)
    return ComputeAndWeightWorkers(w.stage % W, w.stage % W)


def scattered_halves(w: Work) -> ComputeAndWeightWorkers:
    """A split backward whose halves wander away from their forward and from each other."""
    worker = w.stage % W
    if w.direction == Direction.BACKWARD_INPUT and w.batch % 2 == 0:
        worker = (w.stage + 1) % W
    if w.direction == Direction.BACKWARD_WEIGHT and w.batch % 3 == 0:
        worker = (w.stage + 2) % W
    return ComputeAndWeightWorkers(worker, w.stage % W)


def data_parallel(w: Work) -> ComputeAndWeightWorkers:
    return ComputeAndWeightWorkers(w.batch % W, w.batch % W)


# name -> (edges, mapping, split_backward)
CASES = {
    "legs": (TWO_LEGS, on_table({0: 0, 1: 1, 2: 2}), False),
    "legs_head_backward_away": (TWO_LEGS, head_backward_away, False),
    "legs_scattered_halves": (TWO_LEGS, scattered_halves, True),
    "diamond": (DIAMOND, on_table({0: 0, 1: 1, 2: 2, 3: 0}), False),
    "diamond_legs_share_a_rank": (DIAMOND, on_table({0: 0, 1: 1, 2: 1, 3: 2}), False),
    "diamond_scattered_halves": (DIAMOND, scattered_halves, True),
    "diamond_data_parallel": (DIAMOND, data_parallel, False),
}


def schedule(name: str):
    edges, mapping, split = CASES[name]
    S = graph_of(edges).number_of_nodes()
    return simulate(W, S, B, mapping, stage_graph=graph_of(edges), split_backward=split)


def single_process(edges, steps: int = 2) -> dict[str, torch.Tensor]:
    batches = (batch(step) for step in range(steps))
    return train_one_process(make_stages(edges), nn.functional.mse_loss, optimizer, batches, stage_graph=graph_of(edges))[1]


def gang_schedule(collective: bool = True, split_backward: bool = False):
    """A chain whose stage 1 runs on the gang of workers 1 and 2: tensor
    parallel (each member runs the whole micro-batch; with unsplit modules
    the shards are whole copies) or sharing the rows."""
    strategy = Strategy(
        mapping=lambda w: ComputeAndWeightWorkers(w.stage, w.stage),
        name="tensor_parallel_stage_1" if collective else "rows_stage_1",
        gang=lambda w: Gang((1, 2), collective) if w.stage == 1 else None,
    )
    return simulate(W, 3, B, strategy, split_backward=split_backward)


GANGS = {"tensor_parallel": True, "rows": False}


# ---------------------------------------------------------------------- compiled programs
def test_a_two_legged_head_receives_both_legs_and_returns_a_gradient_to_each():
    program = compile_program(schedule("legs").timeline, num_stages=3, world_size=W)
    head = [str(a) for a in program.actions[2]]
    assert head[:3] == ["2F0<0", "2F0<1", "2F0"]
    assert "0B0>0" in head and "1B0>1" in head
    assert program.loss_stage == 2 and program.loss_rank(0) == 2
    assert program.reads(Work(0, 2, Direction.FORWARD), 2).inputs == (("y", 0, 0), ("y", 1, 0))


def test_a_backward_away_from_its_forward_gets_every_input_of_the_stage():
    program = compile_program(schedule("legs_head_backward_away").timeline)
    stashes = [m for m in program.messages if m.letter == "X" and m.batch == 1]
    assert [(m.src, m.dst, m.key, m.value) for m in stashes] == [
        (2, 1, ("x", 2, 1, 0), ("y", 0, 1)),
        (2, 1, ("x", 2, 1, 1), ("y", 1, 1)),
    ]
    assert program.reads(Work(1, 2, Direction.BACKWARD), 1).inputs == (("x", 2, 1, 0), ("x", 2, 1, 1))
    # the loss is evaluated where the head's backward runs; in a step of forwards only, where its forward does
    assert [program.loss_rank(b) for b in range(4)] == [0, 1, 0, 1]
    assert [program.loss_rank(b, forward_only=True) for b in range(4)] == [2, 2, 2, 2]


def test_an_output_goes_once_to_each_rank_and_its_gradient_sums_every_consumer():
    program = compile_program(schedule("diamond_legs_share_a_rank").timeline)
    to_legs = [str(a) for a in program.actions[0] if a.is_send and a.batch == 0 and a.op == "F>"]
    assert to_legs == ["1F0>1"], "stages 1 and 2 on rank 1 share one copy of stage 0's output"
    from_legs = [program.messages[a.message].key for a in program.actions[0] if a.is_recv and a.batch == 0]
    assert from_legs == [("g", 0, 0, 1), ("g", 0, 0, 2)]
    assert program.reads(Work(0, 0, Direction.BACKWARD), 0).gradients == (("g", 0, 0, 1), ("g", 0, 0, 2))


def test_a_weight_pass_away_from_its_input_pass_gets_the_summed_output_gradient():
    program = compile_program(schedule("diamond_scattered_halves").timeline)
    # micro-batch 0: I(0) on worker 1, W(0) on worker 2, stage 0's consumers' input passes on 2 and 0
    sums = [m for m in program.messages if m.letter == "V" and m.stage == 0 and m.batch == 0]
    assert [(m.src, m.dst, m.key) for m in sums] == [(1, 2, ("g", 0, 0))]
    assert program.reads(Work(0, 0, Direction.BACKWARD_WEIGHT), 2).gradients == (("g", 0, 0),)


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_a_returned_gradient_is_received_where_the_simulator_returns_it(workers):
    """Under fsdp every rank runs its micro-batch in step, so the others
    return stage s's gradient as its weight worker finishes its own pass of
    s: the weight worker posts those receives right there, not after its
    last item, so neither the sender's copy nor the buffer waits."""
    sim = simulate(workers, workers, workers, unisched.policies.get("fsdp", num_workers=workers,
                                                                    num_stages=workers, num_batches=workers))
    program = compile_program(sim.timeline)
    for rank, acts in enumerate(program.actions):
        before = [str(next(a for a in reversed(acts[:i]) if a.is_compute)) for i, a in enumerate(acts) if a.op == "r<"]
        assert before == [f"{rank}B{rank}"] * (workers - 1), str(program)
    posted_last = compile_program(dataclasses.replace(sim.timeline, transfers=Transfers.empty()))
    for acts in posted_last.actions:
        last = max(i for i, a in enumerate(acts) if a.is_compute)
        assert all(i > last for i, a in enumerate(acts) if a.op == "r<"), "without the simulator's returns: at the end"


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([TWO_LEGS, DIAMOND]), st.integers(1, 3), st.integers(1, 3), st.booleans(),
       st.randoms(use_true_random=False))
def test_any_mapping_of_a_dag_compiles_to_matched_messages(edges, workers, batches, split, rng):
    S = graph_of(edges).number_of_nodes()
    table = {w: (rng.randrange(workers), rng.randrange(workers)) for w in unisched.all_work(S, batches, split_backward=split)}
    sim = simulate(workers, S, batches, lambda w: ComputeAndWeightWorkers(*table[w]), stage_graph=graph_of(edges),
                   split_backward=split)
    program = compile_program(sim.timeline)
    sends = [a.message for acts in program.actions for a in acts if a.is_send]
    recvs = [a.message for acts in program.actions for a in acts if a.is_recv]
    assert sorted(sends) == sorted(recvs) == list(range(len(program.messages)))
    for m in program.messages:
        if m.letter == "F":
            assert m.key[0] == "y" and graph_of(edges).has_edge(m.key[1], m.stage)


def test_several_sinks_are_refused_by_name():
    sim = simulate(2, 3, 2, on_table({0: 0, 1: 1, 2: 1}), stage_graph=nx.DiGraph([(0, 1), (0, 2)]))
    with pytest.raises(ProgramError, match=r"2 sinks, stages \[1, 2\].*loss takes one output"):
        compile_program(sim.timeline)
    with pytest.raises(ProgramError, match=r"2 sinks, stages \[1, 2\]"):
        train_one_process(make_stages([(0, 1), (0, 2)]), nn.functional.mse_loss, optimizer, [batch()],
                          stage_graph=nx.DiGraph([(0, 1), (0, 2)]))


def test_a_stage_graph_that_contradicts_the_timeline_is_refused():
    with pytest.raises(ProgramError, match=r"made for the stage graph \[\(0, 2\), \(1, 2\)\]"):
        compile_program(schedule("legs").timeline, stage_graph=nx.path_graph(3, create_using=nx.DiGraph))


@pytest.mark.parametrize("kind", list(GANGS))
def test_every_gang_member_runs_the_gang_items_and_only_the_first_member_talks(kind):
    program = compile_program(gang_schedule(GANGS[kind]).timeline)
    ranks = [str(program).splitlines()[r] for r in range(W)]
    gang_items = [w for w in program.compute_order(1) if w.stage == 1]
    assert len(gang_items) == 2 * B and [w for w in program.compute_order(2) if w.stage == 1] == gang_items
    assert "1F0<0" in ranks[1] and "1F0<" not in ranks[2], "only the first member receives the gang's input"
    assert "0B0>0" in ranks[1] and "0B0>" not in ranks[2], "only the first member sends its input gradient"
    if GANGS[kind]:
        assert program.shares[1] == {1: 0, 2: 1}, "member i holds shard i"
        assert "1w" not in str(program) and "1r" not in str(program)
    else:
        assert program.shares[1] == {1: 0}, "a gang that shares rows computes with the weight worker's whole stage"
        assert "1w>2" in ranks[1] and "1r>1" in ranks[2]


def test_a_gang_with_a_split_backward_is_refused_naming_its_item():
    with pytest.raises(ProgramError, match=r"work item 1F0 runs on the gang of workers \[1, 2\].*split_backward"):
        compile_program(gang_schedule(split_backward=True).timeline)


def test_a_gang_whose_backward_runs_elsewhere_is_refused():
    strategy = Strategy(
        mapping=lambda w: ComputeAndWeightWorkers(w.stage, w.stage),
        name="forward_only_gang",
        gang=lambda w: Gang((1, 2)) if w.stage == 1 and w.direction == Direction.FORWARD else None,
    )
    with pytest.raises(ProgramError, match=r"1F0 runs on the gang of workers \[1, 2\] but its backward 1B0 on \[1\]"):
        compile_program(simulate(W, 3, B, strategy).timeline)


def test_a_gang_replay_blocks_members_until_the_first_member_has_its_input():
    """The deadlock replay treats a gang item as a collective: a member waits
    at it until the first member arrives with its input."""
    program = compile_program(gang_schedule().timeline)
    validate(program)
    program.actions[2] = [a for a in program.actions[2] if not (a.is_compute and a.work == Work(3, 1, Direction.BACKWARD))]
    with pytest.raises(unisched.DeadlockError, match=r"ranks \[2\] to join the gang item 1B3"):
        validate(program)


# ---------------------------------------------------------------------- the simulator books what the program sends
def replicated_tensor_parallel(w: Work) -> ComputeAndWeightWorkers:
    """Stage 1 tensor-parallel on gang (1, 2) for even micro-batches and (3, 4)
    for odd ones, each gang holding its own replica of the shards."""
    if w.stage == 1:
        return ComputeAndWeightWorkers(1 + 2 * (w.batch % 2), 1 + 2 * (w.batch % 2))
    return ComputeAndWeightWorkers(0, 0)


def tensor_parallel_weights_elsewhere(w: Work) -> ComputeAndWeightWorkers:
    """Stage 1 tensor-parallel as in :func:`replicated_tensor_parallel`, but
    every micro-batch uses the shards gang (3, 4) holds: the members of gang
    (1, 2) fetch theirs and return their gradients."""
    if w.stage == 1:
        return ComputeAndWeightWorkers(1 + 2 * (w.batch % 2), 3)
    return ComputeAndWeightWorkers(0, 0)


def tensor_parallel_by_batch(w: Work) -> Gang | None:
    return Gang((1, 2) if w.batch % 2 == 0 else (3, 4)) if w.stage == 1 else None


TRAFFIC_CASES = {
    **{name: (graph_of(edges), mapping, split, None) for name, (edges, mapping, split) in CASES.items()},
    "rows": (None, lambda w: ComputeAndWeightWorkers(w.stage, w.stage), False,
             lambda w: Gang((1, 2), False) if w.stage == 1 else None),
    "rows_replicas": (None, lambda w: ComputeAndWeightWorkers(w.stage if w.stage != 1 else 1 + 2 * (w.batch % 2),
                                                              w.stage if w.stage != 1 else 1 + 2 * (w.batch % 2)),
                      False, lambda w: Gang((1, 2) if w.batch % 2 == 0 else (3, 4), False) if w.stage == 1 else None),
    "tensor_parallel_replicas": (None, replicated_tensor_parallel, False, tensor_parallel_by_batch),
    "tensor_parallel_weights_elsewhere": (None, tensor_parallel_weights_elsewhere, False,
                                          tensor_parallel_by_batch),
    "backwards_away_from_a_source": (None, lambda w: ComputeAndWeightWorkers(
        (w.stage + (w.direction != Direction.FORWARD)) % W, w.stage), False, None),
    # a worker holding a stage's weights for its forwards alone is a replica all the same
    "a_holder_for_forwards_only": (None, lambda w: ComputeAndWeightWorkers(
        w.batch % 2, w.batch % 2 if w.direction == Direction.FORWARD else 0), False, None),
}


def traffic(columns, kinds: str) -> set:
    rows = zip(columns.kind.tolist(), columns.src.tolist(), columns.dst.tolist(), columns.stage.tolist(),
               columns.batch.tolist())
    wanted = [unisched.timeline.TRANSFER_KINDS.index(k) for k in kinds.split()]
    return {(src, dst, stage) + ((batch,) if kinds == "stash" else ()) for kind, src, dst, stage, batch in rows
            if kind in wanted}


@pytest.mark.parametrize("name", list(TRAFFIC_CASES))
def test_the_simulator_books_the_weights_stashes_and_all_reduces_the_program_sends(name):
    graph, mapping, split, gang = TRAFFIC_CASES[name]
    S = graph.number_of_nodes() if graph is not None else 3
    strategy = Strategy(mapping=mapping, name=name, gang=gang)
    costs = unisched.Costs(activation_bytes=1.0, weight_bytes=8.0, bandwidth=4.0, cache_weights=True)
    sim = simulate(5, S, B, strategy, stage_graph=graph, split_backward=split, costs=costs)
    program = compile_program(sim.timeline)
    sent = {letter: {(m.src, m.dst, m.stage) + ((m.batch,) if letter in "XV" else ()) for m in program.messages
                     if m.letter == letter} for letter in "wrXV"}
    booked = sim.timeline.transfers
    assert traffic(booked, "weights") == sent["w"]
    assert traffic(booked, "weight_gradient") == sent["r"]
    assert traffic(booked, "stash") == sent["X"] | sent["V"]
    rings = nx.Graph()
    for src, dst, stage in traffic(booked, "allreduce"):
        rings.add_edge((stage, src), (stage, dst))
    booked_groups = {(group[0][0], tuple(sorted(w for _, w in group))) for group in map(sorted, nx.connected_components(rings))}
    program_groups = {(s, program.reduce_group(r, s)) for s, shares in enumerate(program.shares) for r in shares
                      if len(program.reduce_group(r, s)) > 1}
    assert booked_groups == program_groups


def test_a_worker_holding_a_replica_computes_with_its_own_copy():
    """W = 2, S = 1, B = 2, comm 1: micro-batch b on worker b, each forward with its own worker's
    weights, each backward naming worker 0's.  Worker 1 holds a replica (for its forward), so its
    backward uses that copy, fetching nothing and returning nothing, and both replicas
    all-reduce: 3 + 2 = 5, as the executor runs it."""
    def mixed(w):
        return ComputeAndWeightWorkers(w.batch, w.batch if w.direction == Direction.FORWARD else 0)

    sim = simulate(2, 1, 2, Strategy(mapping=mixed), costs=unisched.Costs(forward=1, backward=2, latency=1.0))
    assert sim.latency == 5
    assert sim.timeline.weight_worker.tolist() == sim.timeline.worker.tolist()
    assert traffic(sim.timeline.transfers, "weights weight_gradient") == set()
    assert traffic(sim.timeline.transfers, "allreduce") == {(0, 1, 0), (1, 0, 0)}


def test_a_replicated_tensor_parallel_stage_all_reduces_each_shard_among_its_holders():
    _, mapping, _, gang = TRAFFIC_CASES["tensor_parallel_replicas"]
    costs = unisched.Costs(weight_bytes=8.0, bandwidth=4.0)
    sim = simulate(5, 3, B, Strategy(mapping=mapping, gang=gang), costs=costs)
    reduced = [(tr.src, tr.dst, tr.nbytes) for tr in sim.timeline.transfers if tr.kind == "allreduce"]
    half = 2 * (2 - 1) / 2 * 8.0 / 2  # a ring of two moves 2(k-1)/k of its shard, half the stage
    assert sorted(reduced) == [(1, 3, half), (2, 4, half), (3, 1, half), (4, 2, half)]


# ---------------------------------------------------------------------- real runs on gloo
def _train_dags(rank: int, world: int):
    out = {}
    for name, (edges, _, _) in CASES.items():
        sim = schedule(name)
        for form, given_schedule in (("simulation", sim), ("timeline", sim.timeline)):
            trainer = Trainer(make_stages(edges), given_schedule, nn.functional.mse_loss, optimizer, timeout=30)
            for step in range(2):
                trainer.step(*batch(step))
            out[(name, form)] = {
                "state": {k: v.numpy() for k, v in trainer.gather_state_dict().items()},
                "loss": trainer.last_loss,
                "measured": None if trainer.last_timeline is None else len(trainer.last_timeline),
            }
            trainer.close()
    for kind, collective in GANGS.items():
        gang = gang_schedule(collective)
        for form, given_schedule in (("simulation", gang), ("timeline", gang.timeline)):
            # a factory (stage index -> module) builds the stages on the timeline runs
            stages = make_stages(CHAIN) if form == "simulation" else (lambda s: make_stages(CHAIN)[s])
            trainer = Trainer(stages, given_schedule, nn.functional.mse_loss, optimizer, timeout=30)
            for step in range(2):
                trainer.step(*batch(step))
            out[(kind, form)] = {
                "state": {k: v.numpy() for k, v in trainer.gather_state_dict().items()},
                "order": [str(w) for w in trainer.program.compute_order(rank)],
                "stage_1_numbers": None if trainer.stages[1] is None else
                sum(p.numel() for p in trainer.stages[1].parameters()),
                "measured": None if trainer.last_timeline is None else trainer.last_timeline.worker_orders(),
            }
            trainer.close()
    return out


@pytest.fixture(scope="module")
def trained():
    return run_ranks(_train_dags, W, timeout=300)


@pytest.mark.parametrize("form", ["simulation", "timeline"])
@pytest.mark.parametrize("name", list(CASES))
def test_a_stage_dag_trains_like_one_process(trained, name, form):
    edges, _, split = CASES[name]
    reference = single_process(edges)
    assert largest_change(reference, state_of(make_stages(edges))) > 1e-2, "training must move weights"
    assert_every_rank_matches([rows[(name, form)]["state"] for rows in trained], reference, f"{name} ({form})")
    assert len({rows[(name, form)]["loss"] for rows in trained}) == 1
    S = graph_of(edges).number_of_nodes()
    assert trained[0][(name, form)]["measured"] == S * B * (3 if split else 2)


@pytest.mark.parametrize("form", ["simulation", "timeline"])
@pytest.mark.parametrize("kind", list(GANGS))
def test_a_gang_stage_trains_like_one_process(trained, kind, form):
    reference = single_process(CHAIN)
    simulated = gang_schedule(GANGS[kind]).timeline
    expected = simulated.per_worker().worker_orders()
    assert_every_rank_matches([rows[(kind, form)]["state"] for rows in trained], reference, f"{kind} ({form})")
    for rank, rows in enumerate(trained):
        assert rows[(kind, form)]["order"] == [str(w) for w in expected[rank]], f"rank {rank} runs another order"
    assert trained[0][(kind, form)]["measured"] == simulated.worker_orders()
    held = sum(v.numel() for k, v in reference.items() if k.startswith("1."))
    fetched_by_rank_2 = not GANGS[kind]
    assert trained[2][(kind, form)]["stage_1_numbers"] == (0 if fetched_by_rank_2 else held), \
        "weights fetched for a step are freed after it; weights of truth stay"
    assert trained[1][(kind, form)]["stage_1_numbers"] == held
    if form == "timeline":
        assert trained[0][(kind, form)]["stage_1_numbers"] is None, "the factory builds no stage a rank does not use"
