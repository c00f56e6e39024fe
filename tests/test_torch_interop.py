"""Interop with torch.distributed.pipelining: torch's schedule classes as
strategies that reproduce its per-rank orders, its CSV schedule format both
ways, and torch's own runtime running exported schedules."""

from __future__ import annotations

import io
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import _Action, _PipelineScheduleRuntime

import unisched
from unisched import FORWARD, Costs, Work, policies, simulate
from unisched.policies import StrategyShapeError, TorchCSVError, from_torch_csv, to_torch_csv

COMPUTE = {"F", "B", "I", "W"}


# ---------------------------------------------------------------------- torch's orders, from torch itself
class RecordingStage:
    """Stands in for a PipelineStage under a single-stage schedule's own
    loop (``_step_microbatches``), recording what it is asked to compute."""

    def __init__(self, num_stages: int, rank: int):
        self.num_stages, self.stage_index = num_stages, rank
        self.is_first, self.is_last, self.has_backward = rank == 0, False, True
        self.ran: list[str] = []
        self.output_chunks: list = []

    def get_fwd_recv_ops(self, mb):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.ran.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb, **kwargs):
        self.ran.append(f"{self.stage_index}B{mb}")

    def clear_runtime_states(self):
        pass

    def perform_reduce_grad(self, *args):
        pass


def single_stage_orders(cls, num_workers: int, num_batches: int) -> dict[int, list[str]]:
    """What ScheduleGPipe / Schedule1F1B compute on each rank, in order, as their step loop runs it."""
    orders = {}
    for rank in range(num_workers):
        stage = RecordingStage(num_workers, rank)
        schedule = cls(stage, num_batches)
        schedule._initialize_stage = lambda *args, **kwargs: None
        schedule._step_microbatches([()] * num_batches, [{}] * num_batches)
        orders[rank] = stage.ran
    return orders


def dummy_stages(num_workers: int, stages_per_rank: int, rank: int = 0) -> list:
    return [SimpleNamespace(num_stages=num_workers * stages_per_rank, group_size=num_workers, group_rank=rank,
                            stage_index=rank + i * num_workers, submod=nn.Identity(), stage_index_to_group_rank=None)
            for i in range(stages_per_rank)]


def compute_cells(actions) -> list[str]:
    """The compute actions of a torch action list, in order, an overlapped pair as its two actions."""
    cells = []
    for action in actions:
        if action is None:
            continue
        for sub in action.sub_actions or (action,):
            if sub.computation_type.value in COMPUTE:
                cells.append(f"{sub.stage_index}{sub.computation_type.value}{sub.microbatch_index}")
    return cells


def runtime_orders(cls, num_workers: int, stages_per_rank: int, num_batches: int) -> dict[int, list[str]]:
    """What a multi-stage schedule's runtime computes on each rank: its lowered
    program (``pipeline_order_with_comms``) without the communication."""
    schedule = cls(dummy_stages(num_workers, stages_per_rank), num_batches)
    lowered = {rank: compute_cells(actions) for rank, actions in schedule.pipeline_order_with_comms.items()}
    assert lowered == {rank: compute_cells(actions) for rank, actions in schedule.pipeline_order.items()}
    return lowered


def split_b(cells: list[str]) -> list[str]:
    """DualPipeV's full backwards as the alias runs them: I then W."""
    return [half for cell in cells
            for half in ((cell.replace("B", "I"), cell.replace("B", "W")) if "B" in cell else (cell,))]


def ours(name: str, W: int, S: int, B: int) -> dict[int, list[str]]:
    strategy = policies.get(name, num_workers=W, num_stages=S, num_batches=B)
    timeline = simulate(W, S, B, strategy, costs=Costs(forward=1.3, backward=1.8, backward_input=1.1,
                                                        backward_weight=0.7)).timeline
    assert timeline.worker_orders() == {r: list(o) for r, o in strategy.worker_orders.items()}
    return {rank: [str(work) for work in order] for rank, order in timeline.worker_orders().items()}


def torch_or_error(build):
    try:
        return build()
    except (ValueError, AssertionError, RuntimeError):
        return None


def ours_or_error(name, W, S, B):
    try:
        return ours(name, W, S, B)
    except StrategyShapeError:
        return None


@pytest.fixture(autouse=True)
def _quiet_torch():
    logging.getLogger("torch.distributed.pipelining").setLevel(logging.ERROR)


@pytest.mark.parametrize("name, cls", [("ScheduleGPipe", torch_schedules.ScheduleGPipe),
                                       ("Schedule1F1B", torch_schedules.Schedule1F1B)])
def test_single_stage_schedules_run_torch_order(name, cls):
    for W in range(1, 5):
        for B in range(1, 9):
            expected = torch_or_error(lambda: single_stage_orders(cls, W, B))
            assert ours_or_error(name, W, W, B) == expected, (name, W, B)


def test_gpipe_ir_is_what_it_runs():
    """ScheduleGPipe's ``pipeline_order`` is its step loop's order (Schedule1F1B's is not:
    test_torch_1f1b_ir_differs_from_what_it_runs_on_the_last_rank)."""
    cls = torch_schedules.ScheduleGPipe
    ir = cls(RecordingStage(4, 0), 8).pipeline_order
    assert {r: compute_cells(a) for r, a in ir.items()} == single_stage_orders(cls, 4, 8)


def test_torch_1f1b_ir_differs_from_what_it_runs_on_the_last_rank():
    """Schedule1F1B's ``pipeline_order`` (display only) names micro-batches
    1..B on the last rank; its step loop runs 0..B-1, which is what the alias follows."""
    ir = {r: compute_cells(a) for r, a in torch_schedules.Schedule1F1B(RecordingStage(4, 0), 8).pipeline_order.items()}
    ran = single_stage_orders(torch_schedules.Schedule1F1B, 4, 8)
    assert {r: ir[r] for r in range(3)} == {r: ran[r] for r in range(3)}
    if ir[3] != ran[3]:
        assert "3F8" in ir[3] and "3F0" not in ir[3]
    assert ours("Schedule1F1B", 4, 4, 8) == ran


MULTI = [
    ("ScheduleInterleaved1F1B", torch_schedules.ScheduleInterleaved1F1B, (1, 2, 3)),
    ("ScheduleLoopedBFS", torch_schedules.ScheduleLoopedBFS, (1, 2, 3)),
    ("ScheduleInterleavedZeroBubble", torch_schedules.ScheduleInterleavedZeroBubble, (1, 2, 3)),
    ("ScheduleZBVZeroBubble", torch_schedules.ScheduleZBVZeroBubble, (2,)),
    ("ScheduleDualPipeV", torch_schedules.ScheduleDualPipeV, (2,)),
]


@pytest.mark.parametrize("name, cls, locals_", MULTI, ids=[m[0] for m in MULTI])
def test_multi_stage_schedules_run_torch_order(name, cls, locals_):
    """Every small shape: the alias builds exactly where torch's class does,
    and then runs torch's order on every rank (DualPipeV's full backwards as I then W)."""
    built = 0
    for W in range(1, 5):
        for v in locals_:
            for B in range(1, 10):
                expected = torch_or_error(lambda: runtime_orders(cls, W, v, B))
                if expected is not None and name == "ScheduleDualPipeV":
                    expected = {rank: split_b(cells) for rank, cells in expected.items()}
                assert ours_or_error(name, W, W * v, B) == expected, (name, W, v, B)
                built += expected is not None
    assert built > 10


@pytest.mark.parametrize("name, cls, v", [
    ("one_f_one_b", torch_schedules.Schedule1F1B, 1),
    ("zb_h1", torch_schedules.ScheduleInterleavedZeroBubble, 1),
    ("interleaved", torch_schedules.ScheduleInterleaved1F1B, 2),
    ("interleaved", torch_schedules.ScheduleInterleaved1F1B, 3),
], ids=["1F1B", "ZB-H1 is ZB1P on one stage per rank", "interleaved v=2", "interleaved v=3"])
def test_the_library_schedules_run_torchs_order_where_torch_has_them(name, cls, v):
    """1F1B, ZB-H1 and Megatron's interleaved order (B a multiple of W) are
    what torch runs, though each strategy builds its own."""
    for W in range(1, 5):
        for B in range(W, 3 * W + 1, W):
            expected = single_stage_orders(cls, W, B) if v == 1 and name == "one_f_one_b" else \
                runtime_orders(cls, W, v, B)
            assert ours(name, W, W * v, B) == expected, (name, W, v, B)


def test_aliases_resolve_by_torch_class_name_and_stay_out_of_the_listing():
    assert policies.aliases() == ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
                                  "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]
    for name in policies.aliases():
        assert name not in policies.names()
        assert policies.describe(name)["family"] == "torch"
        assert policies.entry(name.lower()).name == name
    strategy = policies.get("Schedule1F1B", num_workers=4, num_stages=4, num_batches=8)
    assert strategy.name == "Schedule1F1B" and strategy.shape == (4, 4, 8)
    assert policies.fits("ScheduleDualPipeV", unisched.Shape(4, 8, 8))
    assert not policies.fits("ScheduleDualPipeV", unisched.Shape(4, 8, 6))
    with pytest.raises(StrategyShapeError, match="at least as many micro-batches as stages"):
        policies.get("Schedule1F1B", 4, 4, 2)
    with pytest.raises(policies.UnknownStrategyError, match="ScheduleZBVZeroBubble"):
        policies.get("ScheduleNope", 4, 4, 8)


@pytest.mark.parametrize("short", ["1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "1f1b"])
def test_torchs_short_schedule_names_resolve_to_the_class_torch_gives_them(short):
    from torch.distributed.pipelining.schedules import get_schedule_class

    assert policies.entry(short).name == get_schedule_class(short).__name__


def test_short_names_of_unischeds_own_strategies_stay_theirs_however_spelt():
    assert policies.entry("GPipe").name == "gpipe" and policies.entry("ScheduleGPipe").name == "ScheduleGPipe"
    for spelt in ("LoopedBFS", "looped_bfs", "Looped-BFS"):
        assert policies.entry(spelt).name == "looped_bfs"
    assert policies.entry("DualPipeV").name == "dualpipe_v" and policies.entry("dualpipev").name == "dualpipe_v"
    assert policies.entry("ScheduleLoopedBFS").name == "ScheduleLoopedBFS"


def test_the_command_line_takes_torch_names(capsys):
    from unisched.cli import main

    assert main(["simulate", "--strategy", "Schedule1F1B", "-W", "4", "-S", "4", "-B", "8", "--json"]) == 0
    assert '"latency": 33' in capsys.readouterr().out.replace(".0", "")
    assert main(["simulate", "--strategy", "ScheduleZBVZeroBubble", "-W", "2", "-S", "4", "-B", "4", "--json"]) == 0


# ---------------------------------------------------------------------- the CSV format
def load_in_torch(path, num_workers: int, stages_per_rank: int, num_batches: int, rank: int = 0):
    """torch's own reader and lowering (no process group needed for either)."""
    stages = dummy_stages(num_workers, stages_per_rank, rank)
    runtime = _PipelineScheduleRuntime(stages, num_batches)
    runtime._load_csv(str(path))
    return runtime


@pytest.mark.parametrize("name, W, S, B", [
    ("ScheduleInterleaved1F1B", 2, 4, 4),
    ("ScheduleInterleavedZeroBubble", 2, 4, 6),
    ("ScheduleZBVZeroBubble", 2, 4, 4),
    ("ScheduleLoopedBFS", 3, 6, 3),
])
def test_torch_dumps_we_read_it_back(tmp_path, name, W, S, B):
    cls = getattr(torch_schedules, name)
    schedule = cls(dummy_stages(W, S // W), B)
    path = tmp_path / "torch.csv"
    schedule._dump_csv(str(path), format="compute_only")
    imported = from_torch_csv(path)
    assert imported.shape == (W, S, B)
    assert {r: [str(w) for w in o] for r, o in imported.worker_orders.items()} == ours(name, W, S, B)
    lowered = tmp_path / "lowered.csv"
    schedule._dump_csv(str(lowered), format="compute_comms")  # SEND/RECV/REDUCE_GRAD cells are read past
    assert from_torch_csv(lowered).worker_orders == imported.worker_orders


def test_dualpipe_v_mixes_full_and_split_backwards_and_is_refused_unless_asked(tmp_path):
    schedule = torch_schedules.ScheduleDualPipeV(dummy_stages(2, 2), 4)
    path = tmp_path / "dualpipe.csv"
    schedule._dump_csv(str(path), format="compute_only")
    assert "OVERLAP_F_B" in path.read_text()
    with pytest.raises(TorchCSVError, match=r"mixes full backwards \(B, e\.g\. rank \d .*\) with split ones"):
        from_torch_csv(path)
    imported = from_torch_csv(path, split_full_backward=True)
    assert imported.split_backward
    assert imported.worker_orders == policies.get("ScheduleDualPipeV", 2, 4, 4).worker_orders


@pytest.mark.parametrize("source", [
    lambda: simulate(4, 4, 8, policies.get("zb_h2", 4, 4, 8)),
    lambda: simulate(2, 4, 4, policies.get("interleaved", 2, 4, 4)).timeline,
    lambda: policies.get("ScheduleZBVZeroBubble", 2, 4, 4),
    lambda: simulate(4, 8, 8, policies.get("dualpipe_v", 4, 8, 8)),
    lambda: simulate(3, 3, 5, policies.get("gpipe", 3, 3, 5), costs=Costs(forward=[1, 2, 3], backward=2.5)),
], ids=["zb_h2", "interleaved timeline", "torch zbv strategy", "dualpipe_v", "gpipe uneven costs"])
def test_export_round_trips_through_torch(tmp_path, source):
    schedule = source()
    timeline = schedule if isinstance(schedule, unisched.Timeline) else getattr(schedule, "timeline", None)
    if timeline is None:
        timeline = simulate(*schedule.shape, schedule).timeline
    path = tmp_path / "schedule.csv"
    text = to_torch_csv(schedule, path)
    assert path.read_bytes().decode() == text
    W, S, B = timeline.shape
    orders = timeline.worker_orders()
    rows = [row.split(",") for row in text.splitlines()]
    assert [[_Action.from_str(c) for c in row if c] for row in rows] == \
        [[_Action.from_str(str(w)) for w in orders[r]] for r in range(W)]
    runtime = load_in_torch(path, W, S // W, B)
    assert {r: compute_cells(a) for r, a in runtime.pipeline_order_with_comms.items()} == \
        {r: [str(w) for w in orders[r]] for r in range(W)}
    again = from_torch_csv(path)
    assert again.worker_orders == orders and again.split_backward == timeline.split_backward
    assert simulate(W, S, B, again, costs=timeline.costs).latency == pytest.approx(timeline.latency)
    packed = to_torch_csv(schedule, align=False)
    assert "," * 2 not in packed and from_torch_csv(io.StringIO(packed)).worker_orders == orders


def test_aligned_cells_share_a_column_when_they_start_together():
    text = to_torch_csv(simulate(2, 2, 2, policies.get("gpipe", 2, 2, 2)))
    assert text.splitlines() == ["0F0,0F1,,0B0,,0B1", ",1F0,1B0,1F1,1B1"]


def test_a_plan_and_a_measured_timeline_export():
    from unisched.plan import plan

    result = plan(2, 4, 4, strategy="interleaved", time_limit=2)
    text = to_torch_csv(result)
    assert from_torch_csv(io.StringIO(text)).worker_orders == result.worker_orders()
    measured = simulate(2, 4, 4, result.strategy()).timeline
    measured = unisched.Timeline.from_records(
        (2, 4, 4), [r._replace(start=r.start * 1e-3 + 1.5, end=r.end * 1e-3 + 1.5) for r in measured.records],
        source="measured")
    assert from_torch_csv(io.StringIO(to_torch_csv(measured))).worker_orders == result.worker_orders()


@pytest.mark.parametrize("strategy, words", [
    (lambda: policies.get("looped", 4, 4, 8, group_size=2), "stage 0 runs on workers 0, 2"),
    (lambda: policies.get("fsdp", 4, 4, 4), "keeps each stage's weights on the rank that runs it"),
    (lambda: policies.get("ddp", 4, 4, 4), "stage 0 runs on workers 0, 1, 2, 3"),
])
def test_what_torch_cannot_express_is_refused_by_name(strategy, words):
    with pytest.raises(TorchCSVError, match=words):
        to_torch_csv(strategy())


def test_a_dag_is_refused():
    import networkx as nx

    sim = simulate(2, 3, 2, lambda w: unisched.ComputeAndWeightWorkers(min(w.stage, 1), min(w.stage, 1)),
                   stage_graph=nx.DiGraph([(0, 2), (1, 2)]))
    with pytest.raises(TorchCSVError, match="another stage graph"):
        to_torch_csv(sim)


@pytest.mark.parametrize("text, words", [
    ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n",
     r"cannot run: rank 0 step 1 \(0B0\) waits for 1B0; rank 1 step 0 \(1F1\) waits for 0F1"),
    ("0F0,0X0\n", "column 2: cannot read '0X0'"),
    ("0F0,0F0,0B0\n", "0F0 runs twice"),
    ("0F0,1F0,1B0,0B0\n", ""),
    ("0F0,0B0\n1F0,0B1,1B0\n", "stage 0 runs on ranks 0 and 1"),
    ("0F0,0I0\n", r"lists 2 of the 3 passes of 1 stage\(s\) and 1 micro-batch\(es\); missing e.g. 0W0"),
    ("0F0,0B0,0F99999999\n", "lists 3 of the 200000000 passes .* missing e.g. 0F1, 0B1, 0F2, 0B2"),
    ("0F0,0B0,9F0\n", r"stage\(s\) 1, 2, 3, 4, 5, 6, 7, 8 run nowhere"),
    ("0F,0B0\n", "names no micro-batch"),
    ("", "is empty"),
    (",,\n", "names no compute action"),
])
def test_bad_csv_files_are_refused_by_rank_and_cell(text, words):
    if not words:
        assert from_torch_csv(io.StringIO(text)).shape == (1, 2, 1)
        return
    with pytest.raises(TorchCSVError, match=words):
        from_torch_csv(io.StringIO(text))


def test_a_missing_file_and_a_wrong_shape_are_named(tmp_path):
    with pytest.raises(TorchCSVError, match="cannot read the torch CSV schedule .*nope.csv"):
        from_torch_csv(tmp_path / "nope.csv")
    with pytest.raises(TorchCSVError, match="names 2 micro-batches .* expected 3"):
        from_torch_csv(io.StringIO("0F0,0F1,0B0,0B1\n"), num_batches=3)


def test_reachable_from_the_top_level():
    assert unisched.to_torch_csv is to_torch_csv and unisched.from_torch_csv is from_torch_csv
    assert unisched.TorchCSVError is TorchCSVError


# ---------------------------------------------------------------------- torch's runtime runs what we export
WIDTH, ROWS, MICRO = 6, 8, 4


def make_stages(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(num_stages)]


def batches(steps: int = 2):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)) for _ in range(steps)]


def optimizer(params):
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


def _torch_runtime_rank(rank: int, world_size: int, schedules: dict[str, tuple[str, int]]) -> dict:
    """Train two steps under each exported CSV with torch's own runtime."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    logging.getLogger("torch.distributed.pipelining").setLevel(logging.ERROR)
    out = {}
    for label, (text, num_stages) in schedules.items():
        modules = make_stages(num_stages)
        stage_ranks = from_torch_csv(io.StringIO(text)).mapping
        mine = [s for s in range(num_stages) if stage_ranks(Work(0, s, FORWARD)).compute_worker == rank]
        stages = [PipelineStage(modules[s], s, num_stages, torch.device("cpu")) for s in mine]
        runtime = _PipelineScheduleRuntime(stages, MICRO, loss_fn=nn.functional.mse_loss)
        with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as file:
            file.write(text)
        runtime._load_csv(file.name)
        params = [p for s in mine for p in modules[s].parameters()]
        opt = optimizer(params)
        losses = []
        for inputs, targets in batches():
            opt.zero_grad()
            step_losses: list = []
            runtime.step(inputs, target=targets, losses=step_losses)
            opt.step()
            losses.append(float(sum(x.detach() for x in step_losses) / len(step_losses)) if step_losses else None)
        out[label] = {"state": {f"{s}.{k}": v.detach().numpy().copy() for s in mine
                                for k, v in modules[s].state_dict().items()},
                      "losses": losses, "ran": compute_cells(runtime.pipeline_order_with_comms[rank])}
        dist.barrier()
    return out


def test_torch_runtime_runs_exported_zb_h2_a_plan_and_dualpipe_v_and_matches_one_process():
    from unisched.execute import train_one_process
    from unisched.execute.launch import run_local
    from unisched.plan import plan

    zb_h2 = simulate(2, 2, MICRO, policies.get("zb_h2", 2, 2, MICRO))
    planned = plan(2, 4, MICRO, strategy="interleaved", time_limit=2)
    dualpipe_v = simulate(2, 4, MICRO, policies.get("dualpipe_v", 2, 4, MICRO))
    schedules = {"zb_h2": (to_torch_csv(zb_h2), 2), "plan": (to_torch_csv(planned), 4),
                 "dualpipe_v": (to_torch_csv(dualpipe_v), 4)}
    assert "I" in schedules["zb_h2"][0] and "W" in schedules["zb_h2"][0]
    results = run_local(_torch_runtime_rank, 2, schedules, timeout=120)
    for r in results:
        assert r.error is None, f"rank {r.rank}: {r.error}"
    for label, (text, num_stages) in schedules.items():
        rows = [[cell for cell in row.split(",") if cell] for row in text.splitlines()]
        assert [r.value[label]["ran"] for r in results] == rows
        losses, reference = train_one_process(make_stages(num_stages), nn.functional.mse_loss, optimizer, batches())
        state = {k: v for r in results for k, v in r.value[label]["state"].items()}
        assert set(state) == set(reference)
        initial = {f"{s}.{k}": v for s, m in enumerate(make_stages(num_stages)) for k, v in m.state_dict().items()}
        assert max(float((reference[k] - initial[k]).abs().max()) for k in reference) > 1e-2
        for key, expected in reference.items():
            assert np.abs(state[key] - expected.numpy()).max() < 1e-5, (label, key)
        last = [r.value[label]["losses"] for r in results if r.value[label]["losses"][0] is not None]
        assert last and np.allclose(last[0], losses, atol=1e-5)


def test_torchs_schedule_class_given_as_a_strategy_is_told_to_give_its_name():
    from torch.distributed.pipelining import Schedule1F1B

    with pytest.raises(TypeError, match=r"Schedule1F1B is torch's class.*policies.get\('Schedule1F1B'"):
        unisched.simulate(4, 4, 8, Schedule1F1B)


def test_one_cell_naming_a_huge_stage_is_refused_at_once():
    """The stages that run nowhere were listed, all 10^11 of them (memory without limit), before the
    first eight were named."""
    import io

    from unisched.policies.torch_interop import TorchCSVError, from_torch_csv

    with pytest.raises(TorchCSVError, match="stage\\(s\\) 1, 2, 3, 4, 5, 6, 7, 8 and 99999999990 more run nowhere"):
        from_torch_csv(io.StringIO("0F0,0B0,99999999999F0\n"))


def test_csv_bytes_are_read_as_text_and_a_binary_file_or_an_unwritable_path_refused(tmp_path):
    import io

    import unisched
    from unisched.policies.torch_interop import TorchCSVError, from_torch_csv, to_torch_csv

    assert from_torch_csv(io.BytesIO(b"0F0,0B0\n")).worker_orders[0] == from_torch_csv(io.StringIO("0F0,0B0\n")).worker_orders[0]
    binary = tmp_path / "x.csv"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    for source in (binary, io.BytesIO(b"\xff\xfe\x00\x01")):
        with pytest.raises(TorchCSVError, match="is not a text file"):
            from_torch_csv(source)
    with pytest.raises(TorchCSVError, match="cannot write .*nowhere"):
        to_torch_csv(unisched.simulate(2, 2, 4, unisched.policies.get("gpipe", 2, 2, 4)), tmp_path / "nowhere" / "x.csv")


@pytest.mark.parametrize("given", [{"num_stages": "2"}, {"num_batches": 0}, {"num_stages": 1.5}])
def test_counts_to_check_the_file_against_must_be_whole_numbers(given):
    """num_stages="2" said the file 'names 2 stages, expected 2'."""
    import io

    from unisched.policies.torch_interop import TorchCSVError, from_torch_csv

    with pytest.raises(TorchCSVError, match="a whole number >= 1, or None"):
        from_torch_csv(io.StringIO("0F0,0B0\n"), **given)
