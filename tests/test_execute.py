"""The executor: compiled programs, and real multi-process training on gloo
that must match one process to 1e-5 under every strategy."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import unisched
from unisched import ComputeAndWeightWorkers, DeadlockError, Direction, TimelineError, Work, policies, simulate
from unisched.execute import (
    NonFiniteLossError,
    ProgramError,
    Trainer,
    calibrate_costs,
    compile_program,
    parse_action,
    train_one_process,
)
from unisched.execute.launch import run_local
from unisched.execute.measure import UnmeasuredBandwidth
from unisched.timeline import Timeline, TransferRecord, WorkRecord

WIDTH = 8
ROWS = 16


# ---------------------------------------------------------------------- model and reference
def make_stages(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(num_stages)]


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def single_process(num_stages: int, steps: int = 2) -> dict[str, torch.Tensor]:
    batches = (batch(step) for step in range(steps))
    return train_one_process(make_stages(num_stages), nn.functional.mse_loss, optimizer, batches)[1]


def run_ranks(fn, world: int, *args, timeout: float) -> list:
    """Each rank's value of ``fn(rank, world, *args)`` on ``world`` gloo ranks; an error on any rank fails."""
    results = run_local(fn, world, *args, timeout=timeout)
    for r in results:
        assert r.error is None, f"rank {r.rank}: {r.error}"
    return [r.value for r in results]


def state_of(stages) -> dict[str, torch.Tensor]:
    """``{"<stage>.<name>": tensor}`` of ``stages``, the form gather_state_dict gives."""
    return {f"{s}.{k}": v for s, stage in enumerate(stages) for k, v in stage.state_dict().items()}


def largest_change(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor], prefix: str = "") -> float:
    """How far training moved the weights (those whose key starts with ``prefix``)."""
    return max(float((after[k] - before[k]).abs().max()) for k in after if k.startswith(prefix))


def assert_every_rank_matches(states, reference: dict[str, torch.Tensor], what: str) -> None:
    """Every rank's gathered weights (``states``, numpy, one per rank) equal ``reference`` to 1e-5."""
    for rank, state in enumerate(states):
        assert set(state) == set(reference), f"{what}: rank {rank} gathers other weights"
        for key, expected in reference.items():
            assert np.abs(state[key] - expected.numpy()).max() < 1e-5, f"{what}: rank {rank} differs in {key}"


def seed_cuckoo(num_workers: int, num_stages: int, num_batches: int):
    """The seed notebook's Cuckoo, as a user writes it: F and B of early
    (stage, batch) pairs run on different workers."""

    def cuckoo(work: Work) -> ComputeAndWeightWorkers:
        if work.direction == Direction.BACKWARD and work.stage < num_stages // 2 + 1 and work.batch < num_batches // 2 - 1:
            return ComputeAndWeightWorkers(num_workers - work.stage - 1, work.stage)
        return ComputeAndWeightWorkers(work.stage, work.stage)

    return cuckoo


def scattered_split(work: Work) -> ComputeAndWeightWorkers:
    """A split backward whose halves wander: some input-gradient passes run
    away from their forward, some weight-gradient passes away from both."""
    s, b, d = work.stage, work.batch, Direction(work.direction)
    worker = s
    if d == Direction.BACKWARD_INPUT and b % 2 == 0:
        worker = (s + 1) % 4
    if d == Direction.BACKWARD_WEIGHT and b % 3 == 0:
        worker = (s + 2) % 4
    return ComputeAndWeightWorkers(worker, s)


# (name, S, B, params); W = 4 throughout
CASES = [
    ("ddp", 4, 4, {}),
    ("fsdp", 4, 4, {}),
    ("gpipe", 4, 4, {}),
    ("one_f_one_b", 4, 8, {}),
    ("looped", 4, 8, {"group_size": 2}),
    ("fully_sharded_looped", 4, 8, {"group_size": 2}),
    ("interleaved", 8, 8, {}),
    ("zb_h1", 4, 8, {}),
    ("zb_h2", 4, 8, {}),
    ("overflow", 2, 4, {}),
    ("seed_cuckoo", 4, 8, {}),
    ("scattered_split", 4, 8, {}),
]


def schedule_for(name: str, S: int, B: int, params: dict):
    if name == "seed_cuckoo":
        return simulate(4, S, B, seed_cuckoo(4, S, B))
    if name == "scattered_split":
        return simulate(4, S, B, scattered_split, split_backward=True)
    return simulate(4, S, B, policies.get(name, num_workers=4, num_stages=S, num_batches=B, **params))


# ---------------------------------------------------------------------- compiled programs
@pytest.mark.parametrize("name,S,B,params", CASES)
def test_every_action_prints_and_parses_back(name, S, B, params):
    program = compile_program(schedule_for(name, S, B, params).timeline, num_stages=S, world_size=4)
    for actions in program.actions:
        for action in actions:
            back = parse_action(str(action))
            assert (back.op, back.stage, back.batch, back.peer, back.group) == (
                action.op, action.stage, action.batch, action.peer, action.group)
    assert str(program).count("rank ") == 4


def test_cuckoo_program_stashes_inputs_and_fetches_weights():
    program = compile_program(simulate(4, 4, 8, seed_cuckoo(4, 4, 8)).timeline)
    text = str(program)
    # stage 1's backward of batch 0 runs on worker 2: worker 1 sends it the stash and
    # worker 2 fetches stage 1's weights from worker 1 and returns the gradient
    assert "1X0>2" in text.splitlines()[1] and "1X0<1" in text.splitlines()[2]
    assert "1w<1" in text.splitlines()[2] and "1r>1" in text.splitlines()[2]
    assert program.replicas == [(0,), (1,), (2,), (3,)]


def test_deadlocking_orders_are_reported_with_ranks_and_actions():
    # worker 0 wants 0B0 before it sends 1F1's input; worker 1 wants 1F1 before it sends 0B0's gradient
    orders = {0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F1", "1B1", "1F0", "1B0"]}
    records = [
        WorkRecord(Work.parse(text), worker, worker, float(t), float(t + 1))
        for worker, texts in orders.items()
        for t, text in enumerate(texts)
    ]
    timeline = Timeline.from_records((2, 2, 2), records)
    with pytest.raises(DeadlockError) as caught:
        compile_program(timeline, num_stages=2, world_size=2)
    message = str(caught.value)
    assert "rank 0 is stuck at 0B0" in message and "rank 1 is stuck at 1F1" in message
    assert set(caught.value.blocked) == {0, 1}


def test_local_order_violation_names_rank_and_action():
    records = [WorkRecord(Work(0, 0, Direction.BACKWARD), 0, 0, 0.0, 1.0), WorkRecord(Work(0, 0, Direction.FORWARD), 0, 0, 1.0, 2.0)]
    with pytest.raises(ProgramError, match=r"rank 0 runs 0B0 .* before its forward"):
        compile_program(Timeline.from_records((1, 1, 1), records))


def test_world_size_and_stage_count_mismatches_say_what_to_change():
    timeline = simulate(4, 4, 4, policies.get("gpipe", num_workers=4, num_stages=4, num_batches=4)).timeline
    with pytest.raises(ProgramError, match=r"4 workers but the world has 2 ranks.*--nproc-per-node 4"):
        compile_program(timeline, world_size=2)
    with pytest.raises(ProgramError, match=r"4 stages but 3 stage modules"):
        compile_program(timeline, num_stages=3)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.booleans(), st.randoms(use_true_random=False)
)
def test_any_mapping_compiles_to_matched_fifo_messages(W, S, B, split, rng):
    """For random user mappings: every message is sent once and received once,
    each receiver posts a pair's messages in the order the sender sends them
    (what NCCL needs), and validation passes on the simulator's orders."""
    table = {w: (rng.randrange(W), rng.randrange(W)) for w in unisched.all_work(S, B, split_backward=split)}
    program = compile_program(simulate(W, S, B, lambda w: ComputeAndWeightWorkers(*table[w]), split_backward=split).timeline)
    sends = [a.message for acts in program.actions for a in acts if a.is_send]
    recvs = [a.message for acts in program.actions for a in acts if a.is_recv]
    assert sorted(sends) == sorted(recvs) == list(range(len(program.messages)))
    for rank, acts in enumerate(program.actions):
        sent_order = [program.messages[a.message] for a in acts if a.is_send]
        for peer in range(W):
            seqs = [m.seq for m in sent_order if m.dst == peer]
            assert seqs == sorted(seqs) == list(range(len(seqs)))
            posted = [program.messages[a.message].seq for a in acts if a.is_recv and a.peer == peer]
            assert posted == list(range(len(posted)))


def test_calibrate_costs_fits_per_stage_medians():
    records = []
    durations = {(0, Direction.FORWARD): 0.010, (1, Direction.FORWARD): 0.020,
                 (0, Direction.BACKWARD): 0.030, (1, Direction.BACKWARD): 0.050}
    t = 0.0
    for b in range(3):
        for (s, d), base in durations.items():
            wobble = (b - 1) * 0.001
            records.append(WorkRecord(Work(b, s, d), s, s, t, t + base + wobble))
            t += 1.0
    timeline = Timeline.from_records((2, 2, 3), records, activation_bytes=[64, 32], weight_bytes=[100, 200], source="measured")
    costs = calibrate_costs(timeline, communication=False, overhead=False)
    assert np.allclose(costs.forward, [0.010, 0.020]) and np.allclose(costs.backward, [0.030, 0.050])
    assert list(costs.activation_bytes) == [64, 32] and list(costs.weight_bytes) == [100, 200]
    assert simulate(2, 2, 3, lambda w: ComputeAndWeightWorkers(w.stage, w.stage), costs=costs).latency > 0.1


def test_calibrate_costs_fits_the_bandwidth_of_fetched_weights_and_returned_gradients():
    # fsdp's shape: each rank fetches the other's stage and returns its gradient; no all-reduce
    records = [WorkRecord(Work(b, s, d), b, s, 10.0 * b + 2 * s + d, 10.0 * b + 2 * s + d + 1)
               for b in range(2) for s in range(2) for d in (Direction.FORWARD, Direction.BACKWARD)]
    transfers = [TransferRecord("weights", 1, 0, 0.0, 2.0, 400.0, None),         # 200 B/s
                 TransferRecord("weights", 0, 1, 0.0, 1.0, 400.0, None),         # 400 B/s
                 TransferRecord("weight_gradient", 0, 1, 4.0, 8.0, 400.0, None),  # 100 B/s
                 TransferRecord("weight_gradient", 1, 0, 9.0, 9.0, 400.0, None),  # no time: says nothing
                 TransferRecord("activation", 0, 1, 5.0, 5.5, 1.0, Work(0, 1, Direction.FORWARD))]  # latency 0.5
    timeline = Timeline.from_records((2, 2, 2), records, transfers, weight_bytes=[400, 400], source="measured")
    costs = calibrate_costs(timeline)
    assert costs.latency == pytest.approx(0.5) and costs.bandwidth == pytest.approx(200.0)  # the median
    assert calibrate_costs(timeline, communication=False).bandwidth == float("inf")
    alone = Timeline.from_records((2, 2, 2), records, transfers[3:], source="measured")  # none with a span
    assert calibrate_costs(alone).bandwidth == float("inf")  # nothing says how long bytes take
    weighed = Timeline.from_records((2, 2, 2), records, transfers[3:], weight_bytes=[400, 400], source="measured")
    with pytest.warns(UnmeasuredBandwidth, match="moved no weights and ran no all-reduce, so the bandwidth is left"):
        assert calibrate_costs(weighed).bandwidth == float("inf")  # weights a plan may fetch: said


# ---------------------------------------------------------------------- real runs on gloo
def _train_every_case(rank: int, world: int, timelines: dict[str, Timeline]):
    out = {}
    for name, S, B, params in CASES:
        trainer = Trainer(make_stages(S), timelines[name], nn.functional.mse_loss, optimizer, timeout=30)
        for step in range(2):
            trainer.step(*batch(step))
        state = trainer.gather_state_dict()
        row = {"state": {k: v.numpy() for k, v in state.items()}, "loss": trainer.last_loss}
        if rank == 0:
            t = trainer.last_timeline
            row["timeline"] = {
                "source": t.source,
                "items": len(t),
                "orders": [[str(w) for w in t.worker_order(r)] for r in range(world)],
                "planned": [[str(w) for w in trainer.program.compute_order(r)] for r in range(world)],
                "ordered": bool(np.all(t.end >= t.start)),
                "overlaps": _overlaps(t),
            }
        out[name] = row
        trainer.close()
    return out


def _overlaps(t: Timeline) -> int:
    count = 0
    for w in range(t.num_workers):
        rows = np.flatnonzero(t.worker == w)
        rows = rows[np.argsort(t.start[rows])]
        count += int(np.sum(t.start[rows[1:]] < t.end[rows[:-1]] - 1e-9))
    return count


@pytest.fixture(scope="module")
def trained():
    timelines = {name: schedule_for(name, S, B, params).timeline for name, S, B, params in CASES}
    return run_ranks(_train_every_case, 4, timelines, timeout=300)


@pytest.mark.parametrize("name,S,B,params", CASES)
def test_two_steps_match_single_process_training(trained, name, S, B, params):
    reference = single_process(S)
    assert largest_change(reference, state_of(make_stages(S))) > 1e-2, "training must move weights"
    assert_every_rank_matches([rows[name]["state"] for rows in trained], reference, name)
    losses = {rows[name]["loss"] for rows in trained}
    assert len(losses) == 1


@pytest.mark.parametrize("name,S,B,params", CASES)
def test_measured_timeline_follows_the_schedule(trained, name, S, B, params):
    t = trained[0][name]["timeline"]
    dirs = 3 if name.startswith("zb") or name == "scattered_split" else 2
    assert t["source"] == "measured" and t["items"] == S * B * dirs
    assert t["orders"] == t["planned"]
    assert t["ordered"] and t["overlaps"] == 0


# ---------------------------------------------------------------------- bad input and faults
def gpipe_timeline(W: int, B: int) -> Timeline:
    return simulate(W, W, B, policies.get("gpipe", num_workers=W, num_stages=W, num_batches=B)).timeline


def _consistent_errors(rank: int, world: int, gpipe4: Timeline, gpipe2: Timeline):
    """Errors every rank detects the same way: all ranks raise, none hangs."""
    from torch.distributed.distributed_c10d import _world

    groups_before = len(_world.pg_map)
    seen = {}
    for label, make in (
        ("world", lambda: Trainer(make_stages(4), gpipe4, nn.functional.mse_loss, optimizer, timeout=10)),
        ("stages", lambda: Trainer(make_stages(3), gpipe2, nn.functional.mse_loss, optimizer, timeout=10)),
        ("one_rank_stages", lambda: Trainer(make_stages(2 + rank), gpipe2, nn.functional.mse_loss, optimizer, timeout=10)),
        ("one_rank_clips", lambda: Trainer(make_stages(2), gpipe2, nn.functional.mse_loss, optimizer, timeout=10,
                                           clip_grad_norm=0.01 if rank == 0 else None)),
        ("one_rank_precision", lambda: Trainer(make_stages(2), gpipe2, nn.functional.mse_loss, optimizer, timeout=10,
                                               precision="bf16" if rank == 1 else "fp32")),
    ):
        try:
            make()
            seen[label] = None
        except ProgramError as error:
            seen[label] = str(error)

    def picky_optimizer(params):
        if rank == 1:
            raise RuntimeError("no optimizer on this host")
        return optimizer(params)

    try:
        Trainer(make_stages(2), gpipe2, nn.functional.mse_loss, picky_optimizer, timeout=10)
    except (ProgramError, RuntimeError) as error:
        seen["optimizer"] = f"{type(error).__name__}: {error}"
    seen["groups_left"] = len(_world.pg_map) - groups_before
    trainer = Trainer(make_stages(2), gpipe2, nn.functional.mse_loss, optimizer, timeout=10)
    x, y = batch()
    x[12, 0] = float("nan")
    try:
        trainer.step(x, y)
        seen["nan"] = None
    except NonFiniteLossError as error:
        seen["nan"] = str(error)
    seen["after_nan"] = trainer.step(*batch())
    costs = trainer.calibrate(*batch(), steps=3)
    seen["calibrated"] = (list(costs.forward), list(costs.backward), costs.latency)
    return seen


def test_bad_input_stops_every_rank_with_the_cause():
    start = time.monotonic()
    results = run_local(_consistent_errors, 2, gpipe_timeline(4, 4), gpipe_timeline(2, 2), timeout=90)
    assert time.monotonic() - start < 90
    for r in results:
        assert r.error is None, r.error
        seen = r.value
        assert "4 workers but the world has 2 ranks" in seen["world"]
        assert "2 stages but 3 stage modules" in seen["stages"]
        assert "micro-batch 1 is nan" in seen["nan"] and "no weights were changed" in seen["nan"]
        assert np.isfinite(seen["after_nan"])
    forward, backward, latency = results[0].value["calibrated"]
    assert results[1].value["calibrated"] == results[0].value["calibrated"]
    assert len(forward) == 2 and min(forward) > 0 and min(backward) > 0 and latency >= 0
    for r in results:  # a clipping norm on one rank alone waited for the other's norm until the step timed out
        assert "rank 1 was given clip_grad_norm=None but rank 0 clip_grad_norm=0.01" in r.value["one_rank_clips"]
        assert "rank 1 was given precision='bf16' but rank 0 precision='fp32'" in r.value["one_rank_precision"]
    assert "rank 1 cannot run this schedule" in results[0].value["one_rank_stages"]
    assert "2 stages but 3 stage modules" in results[1].value["one_rank_stages"]
    assert "rank 1 cannot run this schedule: RuntimeError: no optimizer on this host" in results[0].value["optimizer"]
    assert results[1].value["optimizer"] == "RuntimeError: no optimizer on this host"
    assert all(r.value["groups_left"] == 0 for r in results), "a refused Trainer must release its process groups"


class Faulty(nn.Module):
    """A stage that misbehaves on one rank in the second step."""

    def __init__(self, inner: nn.Module, rank: int, bad_rank: int, how: str):
        super().__init__()
        self.inner, self.rank, self.bad_rank, self.how = inner, rank, bad_rank, how
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.rank == self.bad_rank and self.calls > 6:
            if self.how == "raise":
                raise ValueError("stage exploded")
            if self.how == "die":
                os._exit(7)
            if self.how == "hang":
                while True:
                    pass
        return self.inner(x)


def _faulty_run(rank: int, world: int, schedule: Timeline, how: str, linger: float):
    stages = make_stages(3)
    stages[1] = Faulty(stages[1], rank, 1, how)
    trainer = Trainer(stages, schedule, nn.functional.mse_loss, optimizer, timeout=4)
    x, y = batch()
    start = time.monotonic()
    try:
        for _ in range(3):
            trainer.step(x[:12], y[:12])
        return {"error": None}
    except unisched.execute.ExecutionError as error:
        took = time.monotonic() - start
        if linger:
            time.sleep(linger)
        return {"error": str(error), "seconds": took}


@pytest.mark.parametrize("how", ["raise", "die", "hang"])
def test_a_failing_rank_stops_every_rank_in_bounded_time(how):
    start = time.monotonic()
    results = run_local(_faulty_run, 3, gpipe_timeline(3, 6), how, 0.0, timeout=60)
    assert time.monotonic() - start < 60
    survivors = [r for r in results if r.rank != 1 or how != "die"]
    for r in survivors:
        assert r.error is None, r.error
        assert r.value["error"] is not None and "rank 1" in r.value["error"], r.value
    if how == "die":
        assert results[1].exitcode == 7
    elif how == "raise":
        assert "rank 1 raised ValueError: stage exploded at 1F" in results[1].value["error"]
        assert all("because rank 1 raised ValueError" in r.value["error"] for r in results if r.rank != 1)
    else:
        assert "ran past the step timeout of 4 s at 1F" in results[1].value["error"]


def test_a_rank_that_raises_and_lingers_releases_the_others_by_timeout():
    results = run_local(_faulty_run, 3, gpipe_timeline(3, 6), "raise", 6.0, timeout=60)
    for r in results:
        assert r.error is None, r.error
        assert "rank 1" in r.value["error"]
        assert r.value["seconds"] < 4 + 5, r.value


# ---------------------------------------------------------------------- NCCL
def _nccl_case(rank: int, world: int, timelines: dict[str, Timeline]):
    torch.cuda.set_device(rank)
    out = {}
    for name, schedule in timelines.items():
        trainer = Trainer(make_stages(2), schedule, nn.functional.mse_loss, optimizer, timeout=60)
        for step in range(2):
            trainer.step(*batch(step))
        out[name] = {k: v.numpy() for k, v in trainer.gather_state_dict().items()}
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_matches_single_process():
    timelines = {name: simulate(2, 2, 2, policies.get(name, num_workers=2, num_stages=2, num_batches=2)).timeline
                 for name in ("gpipe", "ddp")}
    results = run_local(_nccl_case, 2, timelines, backend="nccl", timeout=300)
    reference = single_process(2)
    for r in results:
        assert r.error is None, r.error
        for name, state in r.value.items():
            for key, expected in reference.items():
                assert np.abs(state[key] - expected.numpy()).max() < 1e-5, f"{name} {key}"


# ---------------------------------------------------------------------- launching
def _example_run(rank: int, world: int, argv: list[str]):
    import contextlib
    import io

    from unisched.execute.example import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def test_example_trains_reports_prediction_and_matches_one_process():
    argv = ["--strategy", "one_f_one_b", "--model", "transformer", "--steps", "4", "--check", "--json"]
    results = run_local(_example_run, 2, argv, timeout=120)
    for r in results:
        assert r.error is None, r.error
        assert r.value[0] == 0
    import json

    report = json.loads(results[0].value[1])
    assert report["shape"] == [2, 2, 4] and len(report["losses"]) == 4
    assert report["losses"][-1] < report["losses"][0]
    assert report["check"] == {"max_difference": 0.0, "tolerance": 1e-5, "passed": True}  # to the last bit
    assert report["predicted_ms"] > 0 and report["measured_ms"] > 0
    assert results[1].value[1] == ""


def _example_run_off_by(rank: int, world: int, argv: list[str], off: float):
    """The example, with the one-process reference's weights moved by ``off``."""
    from unisched.execute import example

    reference = example.difference_from_one_process
    example.difference_from_one_process = lambda *args: reference(*args) + off
    return _example_run(rank, world, argv)


@pytest.mark.parametrize("tolerance,off,passed", [("1e-5", 0.0, True), ("1e-5", 2e-5, False)])
def test_example_check_passes_bit_for_bit_and_fails_beyond_its_tolerance(tolerance, off, passed):
    """The run and one process accumulating the same micro-batches end with the same weights to
    the last bit; a difference beyond --tolerance fails the check with exit status 1."""
    argv = ["--strategy", "one_f_one_b", "--steps", "2", "--lr", "0.5", "--check", "--tolerance", tolerance, "--json"]
    results = run_local(_example_run_off_by, 2, argv, off, timeout=120)
    report = json.loads(results[0].value[1])
    assert report["check"]["max_difference"] == off
    assert report["check"]["passed"] is passed and results[0].value[0] == (0 if passed else 1)


def test_unisched_run_prints_programs_and_the_torchrun_command(capsys):
    from unisched.cli import main

    assert main(["run", "--nproc", "4", "--strategy", "looped", "--param", "group_size=2", "--program", "--json"]) == 0
    import json

    printed = json.loads(capsys.readouterr().out)
    assert printed["workers"] == 4 and len(printed["ranks"]) == 4
    assert all(parse_action(text) for rank in printed["ranks"] for text in rank)
    assert main(["run", "--nproc", "2", "--strategy", "gpipe", "--steps", "3", "--dry-run"]) == 0
    command = capsys.readouterr().out
    assert "torch.distributed.run --nproc-per-node 2" in command and "-m unisched.execute.example --strategy gpipe" in command
    assert "--steps 3" in command


# ---------------------------------------------------------------------- review fixes
def _tensor_result(rank: int, world: int):
    return torch.full((3,), float(rank))


def test_run_local_returns_tensors_from_ranks():
    results = run_local(_tensor_result, 2, timeout=60)
    for r in results:
        assert r.error is None, r.error
        assert torch.equal(r.value, torch.full((3,), float(r.rank)))
        assert r.exitcode == 0


def _sleeping_rank(rank: int, world: int):
    time.sleep(60)


def test_run_local_leaves_no_worker_behind_when_collecting_fails(monkeypatch):
    from unisched.execute import launch

    started = []
    real_context = launch._context

    class Recording:
        def __init__(self):
            self.context = real_context()

        def Queue(self):
            results = self.context.Queue()

            def get(timeout=None):
                raise KeyboardInterrupt

            results.get = get  # the parent's side only: workers get the queue's own state
            return results

        def Process(self, *args, **kwargs):
            started.append(self.context.Process(*args, **kwargs))
            return started[-1]

    monkeypatch.setattr(launch, "_context", Recording)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_local(_sleeping_rank, 2, timeout=60)
    assert len(started) == 2 and not any(p.is_alive() for p in started)
    assert time.monotonic() - start < 20


def test_unisched_run_help_answers_without_loading_torch():
    code = "import sys\nfrom unisched.cli import main\ntry:\n    main(['run', '--help'])\nexcept SystemExit:\n    pass\n" \
           "print('torch' in sys.modules, file=sys.stderr)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "--workers" in done.stdout and "--model-width" in done.stdout and "--tolerance" in done.stdout
    assert done.stderr.strip().splitlines()[-1] == "False"


@pytest.mark.parametrize("argv,expected", [
    (["--timeline", "step.jpg"], "--timeline step.jpg: the measured step is saved as"),
    (["--strategy", "looped(group_size=3)"], "cannot form groups of group_size=3"),
    (["--strategy", "nope"], "unknown strategy 'nope'"),
])
def test_unisched_run_refuses_before_launching(capsys, monkeypatch, argv, expected):
    from unisched.cli import main
    from unisched.execute import command

    monkeypatch.setattr(command, "_launch", lambda argv: pytest.fail("launched"))
    assert main(["run", "-W", "2", *argv]) == 2
    assert expected in capsys.readouterr().err


def test_unisched_run_refuses_a_plan_for_another_world_size_before_launching(capsys, monkeypatch, tmp_path):
    from unisched.cli import main
    from unisched.execute import command
    from unisched.plan import plan

    path = tmp_path / "plan.json"
    plan(4, 4, 4, time_limit=2).save(path)
    monkeypatch.setattr(command, "_launch", lambda argv: pytest.fail("launched"))
    assert main(["run", "-W", "2", "--plan", str(path)]) == 2
    assert "4 workers" in capsys.readouterr().err


def test_unisched_run_prints_a_rank_error_as_one_line_and_keeps_the_log(capsys):
    from unisched.execute.command import _launch

    failing = [sys.executable, "-c", "import sys; print('Traceback ...\\nrank 1: error: boom; do this', file=sys.stderr); "
               "sys.exit(1)"]
    assert _launch(failing) == 2
    printed = capsys.readouterr().err.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("unisched run: error: rank 1: boom; do this (the whole log is in ")
    log = printed[0].rsplit(" ", 1)[-1].rstrip(")")
    assert "Traceback" in open(log).read()

    assert _launch([*failing, "--json"]) == 2  # the ranks were asked for JSON: the failure is JSON too
    said = json.loads(capsys.readouterr().err)
    assert said["error"] == "rank 1: boom; do this" and said["rank"] == 1 and said["type"] == "TrainingFailed"
    assert said["details"][0].startswith("the whole log is in ")

    # a rank reporting another's failure: the failing one is named once, in the message and in "rank"
    reported = [sys.executable, "-c", "import sys; print('rank 1: error: rank 0: cannot write x', file=sys.stderr); "
                "sys.exit(1)"]
    assert _launch(reported) == 2
    assert capsys.readouterr().err.startswith("unisched run: error: rank 0: cannot write x (the whole log is in ")
    assert _launch([*reported, "--json"]) == 2
    said = json.loads(capsys.readouterr().err)
    assert said["error"] == "rank 0: cannot write x" and said["rank"] == 0
    stopped = [sys.executable, "-c", "import sys; print('rank 2: error: rank 2 stopped at 2F4 in step 1 because rank 0 "
               "at 0B2 waited', file=sys.stderr); sys.exit(1)"]
    assert _launch([*stopped, "--json"]) == 2
    assert json.loads(capsys.readouterr().err)["rank"] == 0, "the rank it stopped for"

    # a rank killed by a signal (torchrun's root cause) is named as the cause, before what the others said
    root_cause = ("Root Cause (first observed failure):\\n[0]:\\n  rank      : 1 (local_rank: 1)\\n"
                  "  exitcode  : -9 (pid: 42)  (SIGKILL)\\n  error_file: <N/A>\\n"
                  "  traceback : Signal 9 (SIGKILL) received by PID 42\\n")
    # (torchrun's exit status where no rank said why; 2, unisched's error status, where one did)
    for extra, said, status in (
            ("", "rank 1 was killed (Signal 9 (SIGKILL) received by PID 42), and torchrun stopped the others", 1),
            ("rank 0: error: rank 0 could not complete x\\n",
             "rank 1 was killed (Signal 9 (SIGKILL) received by PID 42); then rank 0 could not complete x", 2)):
        killed = [sys.executable, "-c", f"import sys; sys.stderr.write('{extra}{root_cause}'); sys.exit(1)"]
        assert _launch(killed) == status
        assert capsys.readouterr().err.startswith(f"unisched run: error: {said} (the whole log is in ")
        assert _launch([*killed, "--json"]) == status
        assert json.loads(capsys.readouterr().err)["rank"] == 1

    checked = [sys.executable, "-c", "import sys; print('rank 0: check failed', file=sys.stderr); sys.exit(1)"]
    logs = set(Path(tempfile.gettempdir()).glob("unisched-run-*.log"))
    for json_or_not in ([], ["--json"]):  # a failed --check is not a failure to train: rank 0's report says it
        assert _launch([*checked, *json_or_not]) == 1
        assert capsys.readouterr().err == ""
    assert set(Path(tempfile.gettempdir()).glob("unisched-run-*.log")) == logs, "no log file, as none is named"


@pytest.mark.parametrize("argv,flag", [
    (["--steps", "0"], "--steps"), (["--rows-per-batch", "-1"], "--rows-per-batch"), (["--model-width", "x"], "--model-width"),
    (["-S", "0"], "--stages"), (["-B", "0"], "--batches"), (["--nproc", "0"], "--nproc"),
])
def test_unisched_run_refuses_counts_below_one(capsys, argv, flag):
    from unisched.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["run", *argv, "--dry-run"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert flag in error and "positive whole number" in error and "Traceback" not in error


def test_the_transformers_width_is_the_one_given_or_refused_not_rounded(capsys):
    """An explicit --model-width 64 was read as "not given" and trained 32; 30 trained 28."""
    from unisched.cli import main
    from unisched.execute.example import build

    def attention_width(width):
        stages, _, _ = build("transformer", 2, width)
        return next(m for m in stages[0].modules() if isinstance(m, torch.nn.MultiheadAttention)).embed_dim

    assert attention_width(None) == 32 and attention_width(64) == 64 and attention_width(8) == 8
    assert main(["run", "--model", "transformer", "--model-width", "30", "--dry-run"]) == 2
    assert "give a multiple of 4, e.g. 28 or 32" in capsys.readouterr().err


def test_unisched_run_takes_no_warm_up_and_refuses_a_negative_one(capsys):
    from unisched.cli import main

    assert main(["run", "--warmup-steps", "0", "--dry-run"]) == 0
    assert "--warmup-steps 0" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--warmup-steps", "-1", "--dry-run"])
    assert exit_.value.code == 2
    assert "--warmup-steps: expected a whole number (0 or more), got -1" in capsys.readouterr().err


@pytest.mark.parametrize("argv,expected", [
    (["--param", "foo"], "--param takes K=V, got 'foo'"),
    (["--plan", "plan.json", "--strategy", "zb_h1"], "drop --strategy"),
    (["--plan", "plan.json", "--param", "group_size=2", "-S", "4", "-B", "8"], "drop --param, --stages, --batches"),
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
])
def test_unisched_run_refuses_contradictory_options(capsys, argv, expected):
    from unisched.cli import main

    assert main(["run", "--nproc", "2", *argv, "--dry-run"]) == 2
    error = capsys.readouterr().err.strip()
    assert expected in error and len(error.splitlines()) == 1


def test_unisched_run_on_several_nodes_passes_the_endpoint(capsys):
    from unisched.cli import main

    assert main(["run", "--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:29400",
                 "--strategy", "looped", "--param", "group-size = 2", "--dry-run"]) == 0
    command = capsys.readouterr().out
    assert "--rdzv-endpoint h:29400 --node-rank 1" in command and "--strategy looped" in command


def test_example_saves_the_timeline_from_short_runs(tmp_path):
    path = str(tmp_path / "step.json")
    results = run_local(_example_run, 2, ["--steps", "1", "--timeline", path, "--json"], timeout=60)
    for r in results:
        assert r.error is None, r.error
        assert r.value[0] == 0
    import json

    report = json.loads(results[0].value[1])
    assert report["timeline"] == path and os.path.getsize(path) > 0
    assert "measured_ms" not in report


def _bare_trainer(stages) -> Trainer:
    trainer = Trainer.__new__(Trainer)
    trainer.stages, trainer.device = stages, torch.device("cpu")
    trainer.world_size, trainer.rank, trainer._runs = 1, 0, set(range(len(stages)))
    trainer._mine = list(range(len(stages)))
    trainer._first_forward = [0] * len(stages)  # one rank runs every stage
    trainer._dtype = None  # fp32: no autocast
    return trainer


def test_shape_probe_leaves_batchnorm_statistics_and_modes_alone():
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)), nn.Sequential(nn.Dropout(0.5), nn.Linear(WIDTH, 3))]
    stages[1][0].eval()  # a submodule in eval mode stays so
    before = {k: v.clone() for k, v in stages[0].state_dict().items()}
    metas = _bare_trainer(stages)._infer_shapes(torch.randn(4, WIDTH) * 5 + 3)
    assert [tuple(shape) for shape, _ in metas] == [(4, WIDTH), (4, 3)]
    for key, value in stages[0].state_dict().items():
        assert torch.equal(value, before[key]), key
    assert stages[0].training and stages[0][1].training and stages[1].training and not stages[1][0].training


def test_calibrate_needs_two_steps():
    with pytest.raises(unisched.ShapeError, match="steps >= 2"):
        _bare_trainer([]).calibrate(*batch(), steps=1)


def test_watchdog_interrupts_only_a_step_that_is_still_armed():
    import threading

    from unisched.execute.faults import Watchdog

    calls = []
    dog = Watchdog(0.05, lambda: calls.append(1) or True)
    try:
        ticket = dog.arm()
        dog.disarm(ticket)
        time.sleep(0.2)  # a step that ended in time: no check, no interrupt
        assert calls == [] and not dog.fired
        old, ticket = ticket, dog.arm()
        dog.disarm(old)  # a stale id leaves the current step armed
        with pytest.raises(KeyboardInterrupt):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)
        assert calls == [1] and dog.fired
        dog.disarm(ticket)
    finally:
        dog.stop()

    # the step ends while the expiry is being decided: the interrupt lands
    # before disarm returns, never after it
    started = threading.Event()

    def slow_expire():
        started.set()
        time.sleep(0.2)
        return True

    dog = Watchdog(0.05, slow_expire)
    try:
        ticket = dog.arm()
        assert started.wait(5)
        with pytest.raises(KeyboardInterrupt):
            dog.disarm(ticket)
        time.sleep(0.2)  # nothing else is pending
        assert dog.fired
    finally:
        dog.stop()


class _Slowly(nn.Module):
    """The identity, whose gradient takes half a second to pass."""

    def forward(self, x):
        if x.requires_grad:
            x.register_hook(lambda grad: time.sleep(0.5))
        return x


def _read_the_timeline_and_leave(rank: int, world: int, timeline):
    stages = make_stages(2)
    stages[0] = nn.Sequential(stages[0], _Slowly())  # rank 0 ends its step long after rank 1
    trainer = Trainer(stages, timeline, nn.functional.mse_loss, optimizer, timeout=30, record=True)
    trainer.step(*batch())
    recorded = trainer.last_timeline  # every rank reads it and leaves, without close()
    return None if recorded is None else len(recorded)


def test_a_rank_that_reads_last_timeline_and_leaves_does_not_cut_off_the_gathering_of_the_step():
    timeline = simulate(2, 2, 2, policies.get("gpipe", num_workers=2, num_stages=2, num_batches=2)).timeline
    assert run_ranks(_read_the_timeline_and_leave, 2, timeline, timeout=120) == [8, None]


def test_calibrate_costs_counts_the_item_overhead_once_per_item():
    records, t = [], 0.0
    durations = {Direction.FORWARD: 0.010, Direction.BACKWARD_INPUT: 0.020, Direction.BACKWARD_WEIGHT: 0.030}
    for b in range(3):
        for d, base in durations.items():
            records.append(WorkRecord(Work(b, 0, d), 0, 0, t, t + base))
            t += base + 0.005  # the runtime's own time between items
    timeline = Timeline.from_records((1, 1, 3), records, split_backward=True, source="measured")
    costs = calibrate_costs(timeline, communication=False)
    assert np.allclose(costs.forward, [0.015]) and np.allclose(costs.backward_input, [0.025])
    assert np.allclose(costs.backward_weight, [0.035])
    assert np.allclose(costs.backward, [0.060])  # a whole backward is its two halves, each one item
    bare = calibrate_costs(timeline, communication=False, overhead=False)
    assert np.allclose(bare.backward, [0.050])


def test_an_item_outside_the_schedule_shape_is_named():
    # the Timeline refuses it as it is made, before any program is compiled from it
    order = [(0, Direction.FORWARD), (0, Direction.BACKWARD), (1, Direction.FORWARD), (1, Direction.BACKWARD), (2, Direction.FORWARD)]
    records = [WorkRecord(Work(b, 0, d), 0, 0, i, i + 1) for i, (b, d) in enumerate(order)]
    with pytest.raises(TimelineError, match=r"row 4 .* \(2, 0, 0\), which is not a work item of a step with S=1, B=2"):
        Timeline.from_records((1, 1, 2), records)
    # and a timeline of two stages compiled for a model of one is refused by its shape
    order = [(0, Direction.FORWARD), (1, Direction.FORWARD), (1, Direction.BACKWARD), (0, Direction.BACKWARD)]
    timeline = Timeline.from_records((1, 2, 1), [WorkRecord(Work(0, s, d), 0, 0, i, i + 1) for i, (s, d) in enumerate(order)])
    with pytest.raises(ProgramError, match="the schedule has 2 stages but 1 stage modules were given"):
        compile_program(timeline, num_stages=1, world_size=1)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_unisched_run_stopped_tells_torchrun_to_stop_its_ranks(tmp_path, signum):
    """Ctrl-C or SIGTERM on `unisched run` passes a SIGTERM on to torchrun (which stops its ranks)
    and waits for it, then ends with one line and 128 + the signal; before, torchrun was killed
    at once and its ranks trained on, orphaned."""
    told, ready = tmp_path / "told", tmp_path / "ready"
    child = textwrap.dedent(f"""
        import signal, sys, time
        def stop(signum, frame):
            open({str(told)!r}, "w").write(signal.Signals(signum).name)
            sys.exit(1)
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the launcher's SIGTERM counts
        open({str(ready)!r}, "w").close()
        time.sleep(60)
    """)
    launcher = ("import sys; from unisched.execute.command import _launch; "
                f"sys.exit(_launch([sys.executable, '-c', {child!r}]))")
    process = subprocess.Popen([sys.executable, "-c", launcher], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    assert told.read_text() == "SIGTERM"
    assert process.returncode == 128 + signum.value
    said = err.strip().splitlines()
    assert said[0] == f"unisched run: {signum.name}: telling every rank to stop (at most 45 s) ..."
    assert said[1].startswith(f"unisched run: stopped by {signum.name}; every rank stopped (the whole log is in ")
    assert len(said) == 2


def test_a_trainer_outside_torchrun_trains_as_a_world_of_one_and_refuses_more_workers_saying_how():
    code = textwrap.dedent("""
        import torch, unisched
        from torch import nn
        stages = [nn.Linear(4, 4), nn.Linear(4, 2)]
        trainer = unisched.Trainer(stages, unisched.simulate(1, 2, 2, unisched.policies.get("looped", 1, 2, 2)),
                                   nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.1))
        assert trainer.step(torch.randn(4, 4), torch.randn(4, 2)) > 0
        try:
            unisched.Trainer(stages, unisched.simulate(2, 2, 2, unisched.policies.get("gpipe", 2, 2, 2)),
                             nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.1))
        except unisched.UniSchedError as error:
            print(error)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "the schedule is for 2 workers but the world has 1 rank (" in done.stdout
    assert "launch 2 processes (torchrun --nproc-per-node 2)" in done.stdout
