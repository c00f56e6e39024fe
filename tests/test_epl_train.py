"""The seeds' EPL snippets, trained with ``epl.Trainer`` on 2 and 4 gloo
processes, against the same model trained in one process.

Each ``model()`` placeholder of the seeds is replaced by a small torch
module.  One launch per world size runs every scenario in turn (starting
processes is the slow part); the tests then read each scenario's result.
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

from unisched import epl
from unisched.execute import train_one_process
from unisched.execute.launch import run_local

TOLERANCE = 1e-5
STEPS = 2


# ---------------------------------------------------------------------- the seeds' models
class TinyResNet(nn.Module):
    """The "ResNet" of the large-scale classification snippet: one residual block."""

    def __init__(self, features: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, features))

    def forward(self, x):
        h = torch.relu(self.stem(x))
        return self.head(torch.relu(h + self.block(h)))


class AttentionAndGating(nn.Module):
    """Self-attention over a short sequence, then a softmax gate per expert;
    the output carries the hidden state and the gate side by side."""

    def __init__(self, dim: int, experts: int):
        super().__init__()
        self.dim = dim
        self.attention = nn.MultiheadAttention(dim, num_heads=2, batch_first=True)
        self.gate = nn.Linear(dim, experts)

    def forward(self, x):
        h = x + self.attention(x, x, x, need_weights=False)[0]
        pooled = h.mean(dim=1)
        return torch.cat([pooled, torch.softmax(self.gate(pooled), dim=-1)], dim=-1)


class Experts(nn.Module):
    """MOE_Variable_Define: the experts' feed-forward weights (split over devices)."""

    def __init__(self, dim: int, hidden: int, experts: int):
        super().__init__()
        self.dim = dim
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(experts)
        )

    def forward(self, x):
        hidden, gates = x[:, : self.dim], x[:, self.dim :]
        outputs = torch.stack([expert(hidden) for expert in self.experts], dim=-1)
        return hidden + (outputs * gates.unsqueeze(1)).sum(dim=-1)


def mlp(*sizes: int, last_activation: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_activation:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------- scenarios
def data_parallel(world):
    """Seed: ``with epl.replicate(device_count=1): model()``."""
    epl.init()
    with epl.replicate(device_count=1):
        mlp(6, 16, 3)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    return x, y, nn.CrossEntropyLoss()


def default_data_parallel(world):
    """Seed: ``epl.set_default_strategy(epl.replicate(device_count=1)); model()``."""
    epl.init()
    epl.set_default_strategy(epl.replicate(device_count=1))
    mlp(6, 16, 3)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    return x, y, nn.CrossEntropyLoss()


def split_whole_model(world):
    """Seed: ``with epl.split(device_count=n): model()`` (n = 2 here)."""
    epl.init()
    with epl.split(device_count=2):
        nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 6), nn.LayerNorm(6), nn.Linear(6, 4))
    x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
    return x, y, nn.CrossEntropyLoss()


def pipeline(world, **more):
    """Seed: two stages, ``pipeline.num_micro_batch`` 4 (on 4 ranks: 2-way DP over the pipeline)."""
    epl.init(epl.Config({"pipeline.num_micro_batch": 4, **more}))
    with epl.replicate(device_count=1, name="stage_0"):
        mlp(6, 12, 12, last_activation=True)
    with epl.replicate(device_count=1, name="stage_1"):
        mlp(12, 8, 3)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    return x, y, nn.CrossEntropyLoss()


class TwoOutputs(nn.Module):
    """A stage whose output is a pair of tensors."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 8)

    def forward(self, x):
        h = torch.tanh(self.linear(x))
        return h, 2 * h


class TwoInputs(nn.Module):
    """A stage that takes the pair as two arguments."""

    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(8, 3), nn.Linear(8, 3)

    def forward(self, a, b):
        return self.left(a) + self.right(b)


def pair_between_stages_recomputed(world):
    """Two tensors between TaskGraphs, each stage's forward recomputed in its backward."""
    epl.init(epl.Config({"pipeline.num_micro_batch": 2, "gradient_checkpoint.type": "auto"}))
    with epl.replicate(device_count=1, name="pair"):
        TwoOutputs()
    with epl.replicate(device_count=1, name="head"):
        TwoInputs()
    return torch.randn(8, 6), torch.randint(0, 3, (8,)), nn.CrossEntropyLoss()


def resnet_classifier(world, **more):
    """Seed: ``replicate(n)`` ResNet + ``split(n)`` classifier, colocated."""
    epl.init(epl.Config({"cluster.colocate_split_and_replicate": True, **more}))
    with epl.replicate(2):
        TinyResNet(8)
    with epl.split(2):
        nn.Linear(8, 12)
    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 12, (8,))
    return x, y, nn.CrossEntropyLoss()


def moe(world):
    """Seed: MoE with ``set_default_strategy(replicate(total))`` and split experts."""
    epl.init(epl.Config({"cluster.colocate_split_and_replicate": True}))
    total = epl.Env.get().cluster.total_gpu_num
    epl.set_default_strategy(epl.replicate(total))
    AttentionAndGating(8, 3)
    with epl.split(total):
        Experts(8, 16, 3)
    nn.Linear(8, 5)
    x, y = torch.randn(8, 4, 8), torch.randint(0, 5, (8,))
    return x, y, nn.CrossEntropyLoss()


def replicate_then_split_apart(world):
    """replicate(2) and split(2) on different devices, with recompute and GPipe order."""
    epl.init(epl.Config({"gradient_checkpoint.type": "auto", "pipeline.strategy": "PreferForward",
                         "pipeline.num_micro_batch": 2}))
    with epl.replicate(2, name="features"):
        mlp(6, 8, last_activation=True)
    with epl.split(2, name="head"):
        mlp(8, 16, 8, 4)
    x, y = torch.randn(8, 6), torch.randint(0, 4, (8,))
    return x, y, nn.CrossEntropyLoss()


def regression_apart(world):
    """A non cross-entropy loss: the split classifier's output is gathered whole."""
    epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
    with epl.split(2):
        mlp(5, 8, 4)
    with epl.replicate(2):
        mlp(4, 6, 2)
    x, y = torch.randn(8, 5), torch.randn(8, 2)
    return x, y, nn.MSELoss()


def pipeline_fill_drain(world):
    """The pipeline snippet with ``pipeline.strategy: PreferForward`` (GPipe's fill-drain)."""
    return pipeline(world, **{"pipeline.strategy": "PreferForward"})


def pipeline_zero(world):
    """The pipeline snippet with ``zero.level: v1``: weights of truth sharded over the replicas."""
    return pipeline(world, **{"zero.level": "v1"})


def parameterless_first_stage(world):
    """A first TaskGraph without parameters: its output needs no gradient."""
    epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
    with epl.replicate(1, name="flatten"):
        nn.Sequential(nn.Flatten(), nn.Tanh())
    with epl.replicate(1, name="head"):
        mlp(6, 8, 3)
    return torch.randn(8, 2, 3), torch.randint(0, 3, (8,)), nn.CrossEntropyLoss()


def resnet_classifier_zero(world):
    """The classification snippet with ``zero.level: v1`` and Adam: each stage's state on one replica."""
    return resnet_classifier(world, **{"zero.level": "v1"})


resnet_classifier_zero.optimizer = torch.optim.Adam


def pipeline_offload(world):
    """The pipeline snippet with ``offload.level: v0``: weights of truth and optimizer on the host."""
    return pipeline(world, **{"offload.level": "v0"})


def resnet_classifier_offload_zero(world):
    """The classification snippet with offload and ZeRO: host shards of the weights of truth, Adam."""
    return resnet_classifier(world, **{"offload.level": "v0", "zero.level": "v1"})


resnet_classifier_offload_zero.optimizer = torch.optim.Adam


def data_parallel_offload(world):
    """The data-parallel snippet with ``offload.level: v0``."""
    epl.init(epl.Config({"offload.level": "v0"}))
    with epl.replicate(device_count=1):
        mlp(6, 16, 3)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    return x, y, nn.CrossEntropyLoss()


SCENARIOS = {
    2: [("data_parallel", data_parallel), ("default_data_parallel", default_data_parallel),
        ("split_whole_model", split_whole_model), ("resnet_classifier", resnet_classifier),
        ("moe", moe), ("pipeline_offload", pipeline_offload), ("data_parallel_offload", data_parallel_offload),
        ("pipeline", pipeline), ("pipeline_fill_drain", pipeline_fill_drain),
        ("pair_between_stages_recomputed", pair_between_stages_recomputed)],
    4: [
        ("data_parallel", data_parallel),
        ("split_whole_model", split_whole_model),
        ("pipeline", pipeline),
        ("pipeline_fill_drain", pipeline_fill_drain),
        ("pipeline_zero", pipeline_zero),
        ("resnet_classifier", resnet_classifier),
        ("resnet_classifier_zero", resnet_classifier_zero),
        ("moe", moe),
        ("replicate_then_split_apart", replicate_then_split_apart),
        ("regression_apart", regression_apart),
        ("parameterless_first_stage", parameterless_first_stage),
        ("resnet_classifier_offload_zero", resnet_classifier_offload_zero),
    ],
}


def run_scenario(build, world) -> dict:
    torch.manual_seed(0)
    inputs, targets, loss_fn = build(world)
    env = epl.Env.get()
    with env.paused():
        reference = [copy.deepcopy(t.module()) for t in env.taskgraphs]
    initial = {f"{s}.{k}": v.clone() for s, stage in enumerate(reference) for k, v in stage.state_dict().items()}
    optimizer = getattr(build, "optimizer", torch.optim.SGD)
    trainer = epl.Trainer(loss_fn, lambda params: optimizer(params, lr=0.2))
    fetched_copies = _watch_fetches(trainer)
    losses = [trainer.step(inputs, targets) for _ in range(STEPS)]
    reference_losses, expected = train_one_process(
        reference, loss_fn, lambda params: optimizer(params, lr=0.2), [(inputs, targets)] * STEPS
    )
    state = trainer.gather_state_dict()
    simulated = epl.simulate(world_size=world).timeline
    result = {
        "keys": sorted(state),
        "expected_keys": sorted(expected),
        "max_diff": max((state[k] - expected[k]).abs().max().item() for k in expected if k in state),
        "losses": losses,
        "reference_losses": reference_losses,
        "moved": max((expected[k] - initial[k]).abs().max().item() for k in expected),
        "strategy": trainer.strategy.name,
        "data_parallel": trainer.placement.data_parallel,
        "split_groups": {int(k): [list(g) for g in v] for k, v in trainer.strategy.params["split_groups"].items()},
        "sharded": None if trainer.stages[-1] is None else  # a rank builds only the TaskGraphs it uses
        {name: list(p.shape) for name, p in trainer.stages[-1].named_parameters()},
        "optimized": _optimized_elements(trainer.optimizer),
        "host": _host_report(trainer, fetched_copies),
        "device": str(trainer.device),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "executed": [str(work) for work in trainer.order],
        "measured": _orders(trainer.last_timeline),
        "simulated": _orders(simulated),
        "simulated_per_worker": _orders(simulated.per_worker()),
        "full_shapes": [list(expected[k].shape) for k in sorted(expected)],
    }
    trainer.close()
    return result


def _orders(timeline) -> dict[int, list[str]] | None:
    """Each worker's items in the order it ran them."""
    if timeline is None:
        return None
    return {w: [str(work) for work in order] for w, order in timeline.worker_orders().items()}


def _watch_fetches(trainer) -> list[bool]:
    """Before each forward of a stage whose weights of truth this rank keeps
    in host memory: does the module compute with its own device copy of
    every host weight (same shape and values, other memory)?"""
    seen: list[bool] = []
    for s, host in trainer.scheduled.host_weights.items():
        def check(module, args, host=host):
            seen.append(all(
                p.shape == h.shape and p.data_ptr() != h.data_ptr() and torch.equal(p.detach().cpu(), h.detach())
                for p, h in zip(module.parameters(), host)
            ))
        trainer.stages[s].register_forward_pre_hook(check)
    return seen


def _host_report(trainer, fetched_copies: list[bool]) -> dict | None:
    """Where an offloading trainer keeps its weights of truth and optimizer state."""
    held = trainer.scheduled.host_weights
    if not trainer.scheduled.program.offloaded:
        return None
    host = [p for h in held.values() for p in h]
    compute = [p for s in held for p in trainer.stages[s].parameters()]
    optimizer = trainer.optimizer
    optimized = [] if optimizer is None else [p for group in optimizer.param_groups for p in group["params"]]
    return {
        "held": sorted(held),
        "host_elements": sum(p.numel() for p in host),
        "optimizer_has_the_truth": [id(p) for p in optimized] == [id(p) for p in host],
        "on_cpu": all(p.device.type == "cpu" for p in optimized + host),
        "compute_is_not_host": not {id(p) for p in compute} & {id(p) for p in host},
        "state_on_host": optimizer is None or all(
            v.device.type == "cpu" for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)),
        "released_between_steps": all(p.numel() == 0 and p.grad is None for p in compute),
        "fetches": len(fetched_copies),
        "fetched_copies": all(fetched_copies),
    }


def _optimized_elements(optimizer) -> int:
    """How many numbers this rank's optimizer updates (and keeps state for)."""
    if optimizer is None:
        return 0
    return sum(p.numel() for group in optimizer.param_groups for p in group["params"])


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    results = {}
    for name, build in SCENARIOS[world]:
        try:
            results[name] = run_scenario(build, world)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        verdicts = [None] * world
        dist.all_gather_object(verdicts, "error" in results[name])
        if any(verdicts):
            break
    return results


def launch(world: int, timeout: float = 150.0) -> list[dict]:
    outcome = run_local(_worker, world, timeout=timeout)
    failed = [f"rank {r.rank}: {r.error}" for r in outcome if r.error is not None]
    if failed:
        pytest.fail("\n".join(failed))
    return [r.value for r in outcome]


@pytest.fixture(scope="module")
def two():
    return launch(2)


@pytest.fixture(scope="module")
def four():
    return launch(4)


def check(results: list[dict], name: str) -> dict:
    for rank, by_name in enumerate(results):
        result = by_name.get(name, {"error": "not run (an earlier scenario failed)"})
        assert "error" not in result, f"rank {rank}: {result['error']}"
        assert result["keys"] == result["expected_keys"]
        assert result["max_diff"] < TOLERANCE, f"rank {rank}: weights differ by {result['max_diff']}"
        assert result["losses"] == pytest.approx(result["reference_losses"], abs=TOLERANCE)
        assert result["moved"] > 1e-3, "training did not change the weights"
    return results[0][name]


@pytest.mark.parametrize("name", [name for name, _ in SCENARIOS[2]])
def test_two_ranks_match_one_process(two, name):
    check(two, name)


@pytest.mark.parametrize("name", [name for name, _ in SCENARIOS[4]])
def test_four_ranks_match_one_process(four, name):
    check(four, name)


def _one_f_one_b(stage: int, stages: int, batches: range) -> list[str]:
    ahead = min(len(batches), stages - stage - 1)
    order = [f"{stage}F{b}" for b in batches[:ahead]]
    for f, b in zip(batches[ahead:], batches):
        order += [f"{stage}F{f}", f"{stage}B{b}"]
    return order + [f"{stage}B{b}" for b in batches[len(batches) - ahead:]]


def _fill_drain(stage: int, stages: int, batches: range) -> list[str]:
    return [f"{stage}F{b}" for b in batches] + [f"{stage}B{b}" for b in batches]


ORDERS = {"pipeline": _one_f_one_b, "pipeline_fill_drain": _fill_drain}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", sorted(ORDERS))
def test_pipeline_runs_the_simulated_order(request, world, name):
    """Each worker runs its passes in the order the simulated compiled
    strategy gives: 1F1B for PreferBackward, fill-drain for PreferForward
    (the measured timeline on rank 0 says what every rank ran)."""
    results = request.getfixturevalue({2: "two", 4: "four"}[world])
    first = check(results, name)
    simulated = first["simulated"]
    for rank in range(world):
        replica, stage = divmod(rank, 2)
        batches = range(4 * replica, 4 * replica + 4)
        assert simulated[rank] == ORDERS[name](stage, 2, batches), f"simulated order of worker {rank}"
    assert first["measured"] == simulated


def test_every_scenario_runs_the_simulated_order(two, four):
    """Colocated TaskGraphs, replicate(k) and split groups, ZeRO, offload:
    every rank's program runs what the simulation gives its worker (a
    group's items on each member), and the measured step ran the simulated
    order on every worker."""
    ran = 0
    for results in (two, four):
        for name in results[0]:
            check(results, name)
            measured = results[0][name]["measured"]
            simulated = results[0][name]["simulated"]
            assert {w: o for w, o in measured.items() if o} == {w: o for w, o in simulated.items() if o}, name
            for rank, by_name in enumerate(results):
                result = by_name[name]
                assert result["executed"] == result["simulated_per_worker"][rank], f"{name}: rank {rank}"
                ran += 1
    assert ran == 2 * len(SCENARIOS[2]) + 4 * len(SCENARIOS[4])


def test_pipeline_on_four_ranks_is_two_way_data_parallel(four):
    result = check(four, "pipeline")
    assert result["data_parallel"] == 2
    assert result["split_groups"] == {}
    assert check(four, "pipeline_zero")["strategy"].endswith("[zero-v1]")


def test_classifier_is_sharded_over_classes(two, four):
    assert check(two, "resnet_classifier")["sharded"]["weight"] == [6, 8]
    result = check(four, "resnet_classifier")
    assert result["data_parallel"] == 2
    assert result["split_groups"] == {1: [[0, 1], [2, 3]]}
    assert [r["resnet_classifier"]["sharded"]["bias"] for r in four] == [[6]] * 4


def test_split_whole_model(two, four):
    assert check(two, "split_whole_model")["split_groups"] == {0: [[0, 1]]}
    assert two[1]["split_whole_model"]["sharded"]["0.weight"] == [8, 6]
    assert two[1]["split_whole_model"]["sharded"]["2.weight"] == [6, 8]
    assert two[1]["split_whole_model"]["sharded"]["4.weight"] == [2, 6]
    assert check(four, "split_whole_model")["split_groups"] == {0: [[0, 1], [2, 3]]}


def test_moe_experts_split_over_every_rank(four):
    result = check(four, "moe")
    assert result["split_groups"] == {1: [[0, 1, 2, 3]]}
    assert result["strategy"].startswith("EPL replicate(4)+split(4)+replicate(4)")


def test_split_apart_uses_the_other_devices(four):
    result = check(four, "replicate_then_split_apart")
    assert result["split_groups"] == {1: [[2, 3]]}
    for rank in (0, 1):
        assert not any(item.startswith("1") for item in four[rank]["replicate_then_split_apart"]["executed"])
    assert [four[r]["replicate_then_split_apart"]["sharded"]["0.weight"] for r in (2, 3)] == [[8, 8]] * 2
    assert [four[r]["replicate_then_split_apart"]["sharded"]["2.weight"] for r in (2, 3)] == [[8, 8]] * 2


def test_zero_keeps_each_weight_of_truth_once(four):
    """With ZeRO v1 each stage's weights of truth (and its optimizer state)
    live on one replica: the ranks' optimizers together update each number
    once, against once per replica without it."""
    check(four, "resnet_classifier_zero")
    sharded = [r["resnet_classifier_zero"]["optimized"] for r in four]
    whole = [r["resnet_classifier"]["optimized"] for r in four]
    total = sum(int(torch.Size(shape).numel()) for shape in _full_shapes(four, "resnet_classifier_zero"))
    assert sum(sharded) == total
    assert sum(whole) == 2 * total, "without ZeRO each of the 2 replicas holds every number"
    assert all(z <= w for z, w in zip(sharded, whole))


def _full_shapes(results, name) -> list[list[int]]:
    """Shapes of the whole model's parameters (from the gathered state's keys)."""
    return results[0][name]["full_shapes"]


def test_offload_trains_from_host_copies(two, four):
    for results, name, stages_per_rank in ((two, "pipeline_offload", 1), (four, "resnet_classifier_offload_zero", None)):
        check(results, name)
        holders = 0
        for rank, by_name in enumerate(results):
            host = by_name[name]["host"]
            assert host is not None, f"rank {rank} has no offloaded program"
            if not host["held"]:
                continue
            holders += 1
            assert host["optimizer_has_the_truth"] and host["on_cpu"] and host["state_on_host"]
            assert host["compute_is_not_host"] and host["released_between_steps"]
            assert host["fetches"] >= STEPS and host["fetched_copies"]
            if stages_per_rank is not None:
                assert len(host["held"]) == stages_per_rank
        assert holders >= 2
    total = sum(int(torch.Size(shape).numel()) for shape in _full_shapes(four, "resnet_classifier_offload_zero"))
    assert sum(r["resnet_classifier_offload_zero"]["host"]["host_elements"] for r in four) == total, \
        "with ZeRO each weight of truth is in one host memory"


def _setup_errors(rank: int, world: int) -> list[str]:
    """An indivisible split (every rank cuts the layer) and an optimizer
    factory that fails on rank 1 only."""
    messages = []
    for failing in ("split", "optimizer"):
        epl.init()
        with epl.replicate(1, name="body"):
            mlp(4, 8)
        with epl.split(2, name="head"):
            nn.Linear(8, 5 if failing == "split" else 4)

        def optimizer(params):
            if failing == "optimizer" and rank == 1:
                raise RuntimeError("no optimizer on rank 1")
            return torch.optim.SGD(params, lr=0.1)

        try:
            epl.Trainer(nn.CrossEntropyLoss(), optimizer, timeout=30)
            messages.append("no error")
        except Exception as error:
            messages.append(f"{type(error).__name__}: {error}")
    return messages


def test_a_setup_error_on_some_ranks_stops_every_rank():
    outcome = run_local(_setup_errors, 3, timeout=120)
    assert [r.error for r in outcome] == [None] * 3
    split = [r.value[0] for r in outcome]
    assert all("5 output features" in m and "2 devices" in m for m in split)
    optimizer = [r.value[1] for r in outcome]
    assert optimizer[1] == "RuntimeError: no optimizer on rank 1"
    assert all(m.startswith("ProgramError: rank 1 cannot run this schedule") and "no optimizer" in m
               for m in (optimizer[0], optimizer[2]))


# ---------------------------------------------------------------------- on GPUs, with NCCL
def _nccl_worker(rank: int, world: int) -> dict:
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    build = resnet_classifier_offload_zero if world == 2 else data_parallel_offload
    return run_scenario(build, world)


@pytest.mark.gpu
def test_nccl_trains_on_cuda_with_offload():
    """The classification snippet (one GPU: the data-parallel one) on
    ``cuda:rank`` with NCCL, weights of truth in pinned host memory."""
    world = min(2, torch.cuda.device_count())
    outcome = run_local(_nccl_worker, world, backend="nccl", timeout=300)
    assert [r.error for r in outcome] == [None] * world
    for rank, result in enumerate(r.value for r in outcome):
        assert result["backend"] == "nccl"
        assert result["device"] == f"cuda:{rank}"
        assert result["keys"] == result["expected_keys"]
        assert result["max_diff"] < 1e-4, f"rank {rank}: weights differ by {result['max_diff']}"
        assert result["losses"] == pytest.approx(result["reference_losses"], abs=1e-4)
        assert result["moved"] > 1e-3
        host = result["host"]
        assert host["optimizer_has_the_truth"] and host["on_cpu"] and host["state_on_host"]
        assert host["compute_is_not_host"] and host["released_between_steps"] and host["fetched_copies"]
