"""EPL's behaviour in one process: Config, scopes and TaskGraphs, placement,
and the strategy it compiles to."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import unisched
from unisched import epl
from unisched.execute import train_one_process
from unisched.epl.config import ConfigError
from unisched.epl.scopes import ScopeError
from unisched.memory import memory_curves


@pytest.fixture(autouse=True)
def fresh_env(monkeypatch):
    for name in [n for n in __import__("os").environ if n.startswith("EPL_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    epl.init()
    yield
    epl.init()


# ---------------------------------------------------------------------- Config
def test_config_defaults():
    config = epl.Config()
    assert config.pipeline.num_micro_batch == 1
    assert config.pipeline.strategy == "PreferBackward"
    assert config.cluster.colocate_split_and_replicate is False
    assert config.gradient_checkpoint.type == ""
    assert config.zero.level == ""
    assert config.offload.level == ""
    assert config["pipeline.num_micro_batch"] == 1


def test_config_dict_and_nested_dict_agree():
    flat = epl.Config({"pipeline.num_micro_batch": 4, "zero.level": "v1"})
    nested = epl.Config({"pipeline": {"num_micro_batch": 4}, "zero": {"level": "v1"}})
    assert flat == nested
    assert flat.pipeline.num_micro_batch == 4 and flat.zero.level == "v1"
    assert epl.Config({"pipeline": {"num_micro_batch": 4}, "pipeline.num_micro_batch": 4}) == epl.Config(
        {"pipeline.num_micro_batch": 4})
    with pytest.raises(ConfigError, match=r"sets pipeline.num_micro_batch twice \(2 and 3\)"):
        epl.Config({"pipeline": {"num_micro_batch": 2}, "pipeline.num_micro_batch": 3})


def test_environment_gives_values_and_the_dict_wins():
    environ = {"EPL_PIPELINE_NUM_MICRO_BATCH": "8", "EPL_CLUSTER_COLOCATE_SPLIT_AND_REPLICATE": "true",
               "EPL_OFFLOAD_LEVEL": "v0", "EPL_UNRELATED_THING": "x"}
    from_env = epl.Config(environ=environ)
    assert from_env.pipeline.num_micro_batch == 8
    assert from_env.cluster.colocate_split_and_replicate is True
    assert from_env.offload.level == "v0"
    both = epl.Config({"pipeline.num_micro_batch": 2}, environ=environ)
    assert both.pipeline.num_micro_batch == 2
    assert both.offload.level == "v0"


def test_environment_is_read_from_os_environ(monkeypatch):
    monkeypatch.setenv("EPL_PIPELINE_STRATEGY", "PreferForward")
    assert epl.Config().pipeline.strategy == "PreferForward"


@pytest.mark.parametrize(
    "values, named",
    [
        ({"pipeline.num_micro_batches": 4}, "pipeline.num_micro_batches"),
        ({"pipelines.num_micro_batch": 4}, "pipelines.num_micro_batch"),
        ({"pipeline.num_micro_batch": "4"}, "pipeline.num_micro_batch"),
        ({"pipeline.num_micro_batch": 0}, "pipeline.num_micro_batch"),
        ({"pipeline.num_micro_batch": True}, "pipeline.num_micro_batch"),
        ({"pipeline.strategy": "PreferSideways"}, "pipeline.strategy"),
        ({"cluster.colocate_split_and_replicate": 1}, "cluster.colocate_split_and_replicate"),
        ({"zero.level": "v3"}, "zero.level"),
        ({"gradient_checkpoint.type": "collection"}, "gradient_checkpoint.type"),
        ({"offload.level": None}, "offload.level"),
    ],
)
def test_bad_config_names_the_key(values, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        epl.Config(values)


@pytest.mark.parametrize(
    "variable, raw",
    [
        ("EPL_PIPELINE_NUM_MICRO_BATCH", "four"),
        ("EPL_PIPELINE_NUM_MICRO_BATCH", "-1"),
        ("EPL_CLUSTER_COLOCATE_SPLIT_AND_REPLICATE", "maybe"),
        ("EPL_ZERO_LEVEL", "v2"),
        ("EPL_PIPELINE_NUM_MICRO_BATCHES", "4"),
    ],
)
def test_bad_environment_names_the_variable(variable, raw):
    with pytest.raises(ConfigError, match=variable):
        epl.Config(environ={variable: raw})


def test_config_is_read_only():
    with pytest.raises(ConfigError, match="read-only"):
        epl.Config().pipeline.num_micro_batch = 3
    with pytest.raises(ConfigError, match="unknown EPL config key"):
        epl.Config()["pipeline.nope"]


def test_init_rejects_a_plain_dict():
    with pytest.raises(ConfigError, match="epl.Config"):
        epl.init({"pipeline.num_micro_batch": 2})


# ---------------------------------------------------------------------- scopes and TaskGraphs
def test_each_scope_is_one_taskgraph_with_its_modules():
    with epl.replicate(device_count=1, name="stage_0"):
        first = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with epl.replicate(device_count=2):
        second = nn.Linear(4, 2)
        third = nn.Linear(2, 2)
    graphs = epl.Env.get().taskgraphs
    assert [(t.index, t.kind, t.device_count, t.name) for t in graphs] == [
        (0, "replicate", 1, "stage_0"),
        (1, "replicate", 2, "taskgraph_1"),
    ]
    assert graphs[0].top_modules() == [first]
    assert graphs[1].top_modules() == [second, third]
    assert [m for m in graphs[1].module()] == [second, third]


def test_modules_without_parameters_built_in_a_scope_are_applied_too():
    with epl.replicate(1):
        first, act, drop, last = nn.Linear(4, 4), nn.ReLU(), nn.Dropout(0.5), nn.Linear(4, 2)
    graph = epl.Env.get().taskgraphs[0]
    assert graph.top_modules() == [first, act, drop, last] and list(graph.module()) == [first, act, drop, last]


def test_a_model_that_annotates_its_parts_in_its_own_init_is_one_taskgraph_per_part():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            with epl.replicate(1, name="body"):
                self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
            with epl.replicate(1, name="head"):
                self.head = nn.Linear(4, 2)

    net = Net()
    graphs = epl.Env.get().checked_taskgraphs()
    assert [t.name for t in graphs] == ["body", "head"]
    assert [t.module() for t in graphs] == [net.body, net.head]


def test_modules_are_captured_only_while_a_scope_is_open_or_a_default_is_set():
    from unisched.epl.scopes import _BuiltModules

    torch_init = nn.Module.__init__
    assert _BuiltModules.torch_init is None and not _BuiltModules.listeners, "nothing captures after epl.init"
    nn.Linear(3, 3)
    with epl.replicate(1):
        assert len(_BuiltModules.listeners) == 1 and nn.Module.__init__ is not torch_init
        inside = nn.Linear(3, 4)
    assert nn.Module.__init__ is torch_init and not _BuiltModules.listeners
    nn.Linear(4, 4)  # after the scope, with no default: no one's
    graphs = epl.Env.get().taskgraphs
    assert len(graphs) == 1 and graphs[0].top_modules() == [inside]
    epl.set_default_strategy(epl.replicate(1))
    with pytest.raises(ScopeError):
        with epl.split(2):
            with epl.split(2):
                pass
    assert len(_BuiltModules.listeners) == 1, "one listener, however often a scope opens"
    epl.init()
    assert nn.Module.__init__ is torch_init and not _BuiltModules.listeners


def test_a_split_with_nothing_to_shard_is_refused_before_it_is_simulated():
    with epl.split(2, name="convs"):
        nn.Sequential(nn.Conv1d(2, 3, 1), nn.Flatten(1))
    with pytest.raises(epl.SplitError, match="TaskGraph 0 \\('convs'\\) has no nn.Linear layer.*epl.replicate"):
        epl.simulate(world_size=2)
    assert epl.SplitError is unisched.SplitError


def test_a_split_whose_features_do_not_divide_is_refused_before_it_is_placed():
    with epl.split(3):
        nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 8))  # a pair: 6 outputs, then 6 inputs: fine
    epl.placement(world_size=3)
    epl.init()
    with epl.split(3):
        nn.Linear(4, 8)
    with pytest.raises(epl.SplitError, match="the Linear module of TaskGraph 0 .* 8 output features.* 3 devices"):
        epl.placement(world_size=3)


def test_nesting_is_an_error_and_names_both_scopes():
    with epl.replicate(1, name="outer"):
        with pytest.raises(ScopeError, match=r"epl\.split\(2\).*epl\.replicate\(1, name='outer'\)"):
            with epl.split(2):
                pass
    with epl.replicate(1):
        with pytest.raises(ScopeError, match="outside annotation scopes"):
            epl.set_default_strategy(epl.replicate(1))


def test_default_strategy_takes_what_is_built_outside_scopes():
    nn.Linear(2, 2)  # before the default: not annotated
    epl.set_default_strategy(epl.replicate(4))
    gating = nn.Linear(4, 4)
    with epl.split(4):
        experts = nn.Linear(4, 8)
    combine = nn.Linear(8, 2)
    loss = nn.CrossEntropyLoss()
    graphs = epl.Env.get().taskgraphs
    assert [(t.index, t.kind, t.device_count, t.is_default) for t in graphs] == [
        (0, "replicate", 4, True),
        (1, "split", 4, False),
        (2, "replicate", 4, True),
    ]
    assert [t.top_modules() for t in graphs] == [[gating], [experts], [combine]]
    assert all(loss not in t.modules for t in graphs)


def test_init_again_starts_a_new_model():
    with epl.replicate(1):
        nn.Linear(2, 2)
    epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
    assert epl.Env.get().taskgraphs == []
    assert epl.Env.get().config.pipeline.num_micro_batch == 2
    nn.Linear(2, 2)
    assert epl.Env.get().taskgraphs == []


@pytest.mark.parametrize("count", [None, 0, -2, 1.5, True])
def test_device_count_must_be_a_positive_integer(count):
    with pytest.raises(ScopeError, match="device_count"):
        epl.replicate(count)
    with pytest.raises(ScopeError, match="device_count"):
        epl.split(count)


def test_set_default_strategy_needs_a_scope():
    with pytest.raises(ScopeError, match="set_default_strategy"):
        epl.set_default_strategy("replicate")


def test_total_gpu_num_is_the_world_size(monkeypatch):
    assert epl.Env.get().cluster.total_gpu_num == 1
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert epl.Env.get().cluster.total_gpu_num == 8


# ---------------------------------------------------------------------- placement
def _two_stages(config=None, counts=(1, 1)):
    epl.init(config)
    with epl.replicate(device_count=counts[0], name="stage_0"):
        nn.Linear(4, 4)
    with epl.replicate(device_count=counts[1], name="stage_1"):
        nn.Linear(4, 2)


def test_data_parallel_degree_is_world_over_devices_per_replica():
    _two_stages(epl.Config({"pipeline.num_micro_batch": 4}))
    placement = epl.placement(world_size=8)
    assert placement.devices_per_replica == 2
    assert placement.data_parallel == 4
    assert placement.groups == tuple(((2 * r,), (2 * r + 1,)) for r in range(4))
    assert placement.num_batches == 16


def test_not_divisible_names_both_numbers():
    _two_stages(counts=(1, 2))
    with pytest.raises(ScopeError, match=r"world size 8 .* 3 devices"):
        epl.placement(world_size=8)


def test_colocate_puts_taskgraphs_on_the_same_devices():
    epl.init(epl.Config({"cluster.colocate_split_and_replicate": True}))
    with epl.replicate(4):
        nn.Linear(4, 4)
    with epl.split(4):
        nn.Linear(4, 8)
    placement = epl.placement(world_size=8)
    assert placement.devices_per_replica == 4 and placement.data_parallel == 2
    assert placement.groups == (((0, 1, 2, 3),) * 2, ((4, 5, 6, 7),) * 2)
    apart = epl.Config()
    separate = epl.place(epl.Env.get().taskgraphs, apart, 8)
    assert separate.data_parallel == 1
    assert separate.groups == (((0, 1, 2, 3), (4, 5, 6, 7)),)


def test_colocate_needs_equal_device_counts():
    epl.init(epl.Config({"cluster.colocate_split_and_replicate": True}))
    with epl.replicate(2, name="body"):
        nn.Linear(4, 4)
    with epl.split(4, name="head"):
        nn.Linear(4, 8)
    with pytest.raises(ScopeError, match="body: 2, head: 4"):
        epl.placement(world_size=4)


def test_no_taskgraph_is_an_error():
    with pytest.raises(ScopeError, match="no TaskGraph"):
        epl.strategy(world_size=2)


# ---------------------------------------------------------------------- the compiled strategy
def _pipeline(stages: int, micro: int, strategy: str):
    epl.init(epl.Config({"pipeline.num_micro_batch": micro, "pipeline.strategy": strategy}))
    for s in range(stages):
        with epl.replicate(1, name=f"stage_{s}"):
            nn.Linear(2, 2)


def test_prefer_forward_is_gpipe_fill_drain():
    _pipeline(4, 8, "PreferForward")
    strategy = epl.strategy(world_size=4)
    assert isinstance(strategy, unisched.Strategy)
    assert strategy.shape == unisched.Shape(4, 4, 8)
    assert strategy(unisched.Work(5, 2, unisched.BACKWARD)) == (2, 2)
    simulation = unisched.simulate(4, 4, 8, strategy)
    assert simulation.latency == 33
    assert simulation.worker_stats()["max_activation_storage"] == [8, 8, 8, 8]


def test_prefer_backward_is_one_f_one_b():
    _pipeline(4, 8, "PreferBackward")
    strategy = epl.strategy(world_size=4)
    assert strategy.memory_limit == [4, 3, 2, 1]
    simulation = unisched.simulate(4, 4, 8, strategy)
    assert simulation.worker_stats()["max_activation_storage"] == [4, 3, 2, 1]
    gpipe = unisched.simulate(4, 4, 8, strategy.with_(priority=unisched.OldestStageFirst(4, 8), memory_limit=None))
    assert simulation.latency == gpipe.latency == 33


def test_data_parallel_over_a_pipeline_maps_batches_to_replicas():
    _two_stages(epl.Config({"pipeline.num_micro_batch": 4}))
    strategy = epl.strategy(world_size=4)
    table = {(b, s): strategy(unisched.Work(b, s, unisched.FORWARD)) for b in range(8) for s in range(2)}
    assert {table[b, 0].compute_worker for b in range(4)} == {0}
    assert {table[b, 1].compute_worker for b in range(4, 8)} == {3}
    assert all(pair.compute_worker == pair.weight_worker for pair in table.values())
    simulation = epl.simulate(world_size=4)
    assert simulation.shape == unisched.Shape(4, 2, 8)
    assert simulation.timeline.worker_stats()["weight_storage"] == [1, 1, 1, 1]


def test_map_arrays_agrees_with_mapping():
    _two_stages(epl.Config({"pipeline.num_micro_batch": 3, "zero.level": "v1"}))
    strategy = epl.strategy(world_size=6)
    W, S, B = strategy.shape
    batch, stage = np.meshgrid(np.arange(B), np.arange(S), indexing="ij")
    compute, weight = strategy.map_arrays(batch.ravel(), stage.ravel(), np.zeros(B * S, dtype=int))
    pairs = [strategy(unisched.Work(int(b), int(s))) for b, s in zip(batch.ravel(), stage.ravel())]
    assert list(compute) == [p.compute_worker for p in pairs]
    assert list(weight) == [p.weight_worker for p in pairs]


def test_zero_v1_shards_weights_over_replicas():
    _two_stages(epl.Config({"zero.level": "v1"}))
    strategy = epl.strategy(world_size=4)
    simulation = unisched.simulate(*strategy.shape, strategy)
    assert simulation.worker_stats()["weight_storage"] == [1, 0, 0, 1]
    assert sum(simulation.worker_stats()["weight_transmissions"]) > 0
    assert strategy.params["zero"] == "v1"


def test_offload_v0_moves_the_weights_to_each_devices_host_worker():
    _two_stages(epl.Config({"offload.level": "v0"}))
    strategy = epl.strategy(world_size=2)
    assert strategy.shape == unisched.Shape(4, 2, 1)
    assert strategy.params["host_workers"] == [2, 3]
    simulation = unisched.simulate(*strategy.shape, strategy)
    assert simulation.worker_stats()["weight_storage"] == [0, 0, 1, 1]
    assert list(simulation.timeline.busy_time[2:]) == [0, 0]


def test_offload_with_zero_keeps_each_stage_on_one_host():
    _two_stages(epl.Config({"offload.level": "v0", "zero.level": "v1"}))
    strategy = epl.strategy(world_size=4)
    assert strategy.params["host_workers"] == [4, 7]
    simulation = unisched.simulate(*strategy.shape, strategy)
    assert simulation.worker_stats()["weight_storage"] == [0, 0, 0, 0, 1, 0, 0, 1]


def test_recompute_costs_a_forward_per_backward():
    _two_stages(epl.Config({"pipeline.num_micro_batch": 4}))
    plain = epl.simulate(world_size=2)
    _two_stages(epl.Config({"pipeline.num_micro_batch": 4, "gradient_checkpoint.type": "auto"}))
    costs = epl.stage_costs(epl.placement(world_size=2), epl.Env.get().config)
    assert costs.backward == [3.0, 3.0]
    recomputed = epl.simulate(world_size=2)
    assert recomputed.latency > plain.latency
    assert recomputed.strategy.params["recompute"] is True


def test_split_groups_are_in_the_strategy_params_and_costs():
    epl.init(epl.Config({"cluster.colocate_split_and_replicate": True}))
    with epl.replicate(2):
        nn.Linear(4, 4)
    with epl.split(2):
        nn.Linear(4, 8)
    strategy = epl.strategy(world_size=4)
    assert strategy.params["split_groups"] == {1: [(0, 1), (2, 3)]}
    assert strategy.params["groups"][0] == [(0, 1), (2, 3)]
    costs = epl.stage_costs(epl.placement(world_size=4), epl.Env.get().config)
    assert costs.forward == [0.5, 0.5]
    assert costs.backward == [1.0, 1.0]


def test_split_gangs_pay_one_ring_all_reduce_per_pass_and_replicate_gangs_only_their_rows():
    epl.init()
    with epl.replicate(2, name="rows"):
        nn.Linear(4, 4)
    with epl.split(2, name="features"):
        nn.Linear(4, 8)
    strategy = epl.strategy(world_size=4)
    assert not strategy.gang(unisched.Work(0, 0, unisched.FORWARD)).collective
    assert strategy.gang(unisched.Work(0, 1, unisched.FORWARD)).collective
    base = unisched.Costs(activation_bytes=100.0, bandwidth=100.0)
    costs = epl.stage_costs(epl.placement(world_size=4), epl.Env.get().config, base)
    assert costs.forward == [0.5, 0.5] and costs.backward == [1.0, 1.0]
    timeline = epl.simulate(world_size=4, costs=base).timeline
    durations = {(int(s), int(d)): float(e - b) for s, d, b, e in
                 zip(timeline.stage, timeline.direction, timeline.start, timeline.end)}
    ring = 2 * (2 - 1) / 2 * 100.0 / 100.0
    collect = 100.0 / 2 / 100.0  # the first member gathers the other's half of the output
    assert durations[(0, int(unisched.FORWARD))] == pytest.approx(0.5 + collect)
    assert durations[(0, int(unisched.BACKWARD))] == pytest.approx(1.0)
    assert durations[(1, int(unisched.FORWARD))] == pytest.approx(0.5 + ring)
    assert durations[(1, int(unisched.BACKWARD))] == pytest.approx(1.0 + ring)


def test_stash_bytes_keep_the_input_only_with_recompute():
    for recompute, expected in (("", [100 / 2 + 400 / 2, 60 + 300 / 2]), ("auto", [100 / 2, 60])):
        epl.init(epl.Config({"gradient_checkpoint.type": recompute}))
        with epl.replicate(2):
            nn.Linear(4, 4)
        with epl.split(2):
            nn.Linear(4, 8)
        costs = epl.stage_costs(epl.placement(world_size=4), epl.Env.get().config,
                                input_bytes=[100, 60], internal_bytes=[400, 300])
        assert costs.activation_bytes == [100, 60]
        assert costs.stash_bytes == pytest.approx(expected)
    with pytest.raises(ScopeError, match="internal_bytes.*2"):
        epl.stage_costs(epl.placement(world_size=4), epl.Env.get().config, internal_bytes=[1, 2, 3])


def test_stage_costs_take_internal_activations_from_the_base_costs():
    epl.init(epl.Config({"gradient_checkpoint.type": ""}))
    with epl.replicate(1):
        nn.Linear(4, 4)
    base = unisched.Costs(activation_bytes=10.0, stash_bytes=50.0)
    assert epl.stage_costs(epl.placement(world_size=1), epl.Env.get().config, base).stash_bytes == [50.0]
    epl.init(epl.Config({"gradient_checkpoint.type": "auto"}))
    with epl.replicate(1):
        nn.Linear(4, 4)
    assert epl.stage_costs(epl.placement(world_size=1), epl.Env.get().config, base).stash_bytes == [10.0]


def test_recompute_shows_less_activation_memory_in_the_simulation():
    peaks, latencies = {}, {}
    for recompute in ("", "auto"):
        _two_stages(epl.Config({"pipeline.num_micro_batch": 4, "gradient_checkpoint.type": recompute}))
        simulation = epl.simulate(world_size=2, input_bytes=100, internal_bytes=[400, 300])
        peaks[recompute] = [c.peak for c in memory_curves(simulation.timeline, "activations")]
        latencies[recompute] = simulation.latency
        assert simulation.worker_stats()["max_activation_storage"] == [2, 1]
    assert peaks[""] == [2 * 500, 400]
    assert peaks["auto"] == [2 * 100, 100]
    assert latencies["auto"] > latencies[""]


# ---------------------------------------------------------------------- the trainer in one process
def test_one_process_trainer_matches_plain_training():
    torch.manual_seed(0)
    epl.init(epl.Config({"pipeline.num_micro_batch": 2, "gradient_checkpoint.type": "auto"}))
    with epl.replicate(device_count=1):
        model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    reference = copy.deepcopy(model)
    trainer = epl.Trainer(nn.MSELoss(), lambda params: torch.optim.SGD(params, lr=0.1))
    x, y = torch.randn(6, 3), torch.randn(6, 2)
    losses = [trainer.step(x, y) for _ in range(2)]
    expected_losses, expected = train_one_process(
        [reference], nn.MSELoss(), lambda params: torch.optim.SGD(params, lr=0.1), [(x, y)] * 2
    )
    assert losses == pytest.approx(expected_losses, abs=1e-6)
    state = trainer.gather_state_dict()
    assert sorted(state) == sorted(expected) == ["0.0.bias", "0.0.weight", "0.2.bias", "0.2.weight"]
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0)


def test_one_process_offload_steps_on_host_copies():
    torch.manual_seed(0)
    epl.init(epl.Config({"offload.level": "v0", "gradient_checkpoint.type": "auto", "pipeline.num_micro_batch": 2}))
    with epl.replicate(device_count=1):
        model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    reference = copy.deepcopy(model)
    optimizer = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    trainer = epl.Trainer(nn.MSELoss(), optimizer)
    assert trainer.scheduled.program.offloaded == {(0, 0)}
    host = trainer.scheduled.host_weights[0]
    assert all(p.device.type == "cpu" for p in host)
    assert [id(p) for p in trainer.optimizer.param_groups[0]["params"]] == [id(p) for p in host]
    assert not {id(p) for p in model.parameters()} & {id(p) for p in host}
    x, y = torch.randn(6, 3), torch.randn(6, 2)
    losses = []
    for _ in range(2):
        losses.append(trainer.step(x, y))
        assert all(p.numel() == 0 and p.grad is None for p in model.parameters())
        assert all(trainer.optimizer.state[p]["momentum_buffer"].device.type == "cpu" for p in host)
    expected_losses, expected = train_one_process([reference], nn.MSELoss(), optimizer, [(x, y)] * 2)
    assert losses == pytest.approx(expected_losses, abs=1e-6)
    for (name, value), kept in zip(reference.named_parameters(), host):
        torch.testing.assert_close(kept.detach(), value.detach(), atol=1e-6, rtol=0, msg=name)
    state = trainer.gather_state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0)


def test_batch_that_does_not_divide_is_an_error():
    epl.init(epl.Config({"pipeline.num_micro_batch": 4}))
    with epl.replicate(1):
        nn.Linear(3, 1)
    trainer = epl.Trainer(nn.MSELoss(), lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(unisched.ShapeError, match="6 rows.*multiple of 4"):
        trainer.step(torch.randn(6, 3), torch.randn(6, 1))


def test_a_module_in_two_taskgraphs_is_an_error():
    epl.init(epl.Config({"cluster.colocate_split_and_replicate": True}))
    with epl.replicate(1, name="a"):
        shared = nn.Linear(2, 2)
    with epl.replicate(1, name="b"):
        nn.Sequential(shared, nn.ReLU())
    for use in (epl.simulate, epl.strategy, epl.placement,
                lambda: epl.Trainer(nn.MSELoss(), lambda params: torch.optim.SGD(params, lr=0.1))):
        with pytest.raises(ScopeError, match=r"TaskGraph 0 \('a'\) is also used in TaskGraph 1 \('b'\)"):
            use()


@pytest.fixture
def no_process_group(monkeypatch):
    """A Trainer that starts a process group fails the test: what it refuses, it refuses first."""
    def start(*args):
        pytest.fail("a process group was started before the annotations were checked and the placement made")

    monkeypatch.setattr("unisched.epl.trainer.ensure_process_group", start)


def test_an_empty_scope_is_an_error(no_process_group):
    with epl.replicate(1, name="empty"):
        pass
    for use in (epl.simulate, epl.strategy, epl.placement,
                lambda: epl.Trainer(nn.MSELoss(), lambda params: torch.optim.SGD(params, lr=0.1))):
        with pytest.raises(ScopeError, match="'empty'"):
            use()


def test_a_placement_that_cannot_be_made_is_refused_before_a_process_group_starts(no_process_group, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")  # or the group an earlier test left, of 1: neither holds 2 devices a replica
    with epl.replicate(2, name="a"):
        nn.Linear(2, 2)
    with pytest.raises(unisched.UniSchedError, match="not divisible by the 2 devices"):
        epl.Trainer(nn.MSELoss(), lambda params: torch.optim.SGD(params, lr=0.1))


def test_groups_are_gangs_in_the_simulation():
    epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
    with epl.replicate(2):
        nn.Linear(4, 4)
    with epl.split(2):
        nn.Linear(4, 8)
    strategy = epl.strategy(world_size=8)
    assert strategy.gang(unisched.Work(3, 1, unisched.BACKWARD)) == unisched.Gang((6, 7), collective=True)
    assert strategy.gang(unisched.Work(3, 0, unisched.FORWARD)) == unisched.Gang((4, 5), collective=False)
    simulation = epl.simulate(world_size=8)
    timeline = simulation.timeline
    assert set(timeline.gang_members) == {(0, 1), (2, 3), (4, 5), (6, 7)}
    assert np.all(timeline.gang >= 0)
    busy = timeline.busy_time
    assert busy[0] == busy[1] and busy[2] == busy[3] and busy[0] > 0
    _pipeline(2, 2, "PreferBackward")
    one_device_each = epl.simulate(world_size=4)
    assert simulation.latency == pytest.approx(one_device_each.latency / 2)


@pytest.mark.parametrize("micro, stages", [(1, 1), (4, 1), (4, 2), (2, 4), (8, 3)])
def test_simulated_orders_run_every_pass_once_and_bound_the_stash(micro, stages):
    """The order the runtime follows (the compiled strategy's
    simulation) is a valid pipeline order with 1F1B's and fill-drain's bounds."""
    for strategy in ("PreferBackward", "PreferForward"):
        _pipeline(stages, micro, strategy)
        orders = epl.simulate(world_size=stages).timeline.worker_orders()
        for position in range(stages):
            bound = min(micro, stages - position) if strategy == "PreferBackward" else micro
            order = orders[position]
            directions = (unisched.FORWARD, unisched.BACKWARD)
            passes = [unisched.Work(m, position, d) for m in range(micro) for d in directions]
            assert sorted(order) == sorted(passes)
            held, peak = set(), 0
            for work in order:
                if work.direction == unisched.FORWARD:
                    held.add(work.batch)
                else:
                    assert work.batch in held, f"backward of {work.batch} before its forward"
                    held.remove(work.batch)
                peak = max(peak, len(held))
            assert peak == bound
            assert [w.batch for w in order if w.direction == unisched.BACKWARD] == list(range(micro))


def test_colocated_taskgraphs_in_one_process_run_stage_by_stage_in_the_simulated_order():
    """Colocated TaskGraphs share one worker, whose simulated order need not
    keep a micro-batch's stages together (fill-drain runs stage by stage);
    the trainer follows it and still trains as one model.  Its backwards,
    which follow each other, go to autograd in one call, which runs them
    in an order of its own: the measured timeline has the same items, the
    forwards in the simulated order."""
    torch.manual_seed(0)
    epl.init(epl.Config({"cluster.colocate_split_and_replicate": True, "pipeline.num_micro_batch": 2,
                         "pipeline.strategy": "PreferForward"}))
    with epl.replicate(1):
        first = nn.Sequential(nn.Linear(3, 5), nn.Tanh())
    with epl.replicate(1):
        second = nn.Linear(5, 2)
    reference = [copy.deepcopy(first), copy.deepcopy(second)]
    trainer = epl.Trainer(nn.MSELoss(), lambda params: torch.optim.SGD(params, lr=0.1))
    x, y = torch.randn(6, 3), torch.randn(6, 2)
    losses = [trainer.step(x, y) for _ in range(2)]
    simulated = trainer.simulate().timeline.worker_orders()[0]
    assert trainer.order == simulated
    # the backwards are one run: autograd runs the backward of the latest forward first
    assert [str(w) for w in trainer.last_timeline.worker_orders()[0]] == \
        ["0F0", "0F1", "1F0", "1F1", "1B1", "1B0", "0B1", "0B0"]
    assert [str(w) for w in simulated] == ["0F0", "0F1", "1F0", "1F1", "1B0", "1B1", "0B0", "0B1"]
    expected_losses, expected = train_one_process(
        reference, nn.MSELoss(), lambda params: torch.optim.SGD(params, lr=0.1), [(x, y)] * 2
    )
    assert losses == pytest.approx(expected_losses, abs=1e-6)
    state = trainer.gather_state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, atol=1e-6, rtol=0)


def _saved_bytes_in_forward(recompute: bool) -> int:
    """Bytes autograd keeps for the backward during one training step."""
    torch.manual_seed(0)
    epl.init(epl.Config({"gradient_checkpoint.type": "auto" if recompute else ""}))
    with epl.replicate(1):
        nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    trainer = epl.Trainer(nn.MSELoss(), lambda params: torch.optim.SGD(params, lr=0.1))
    total = [0]

    def pack(tensor):
        total[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        trainer.step(torch.randn(32, 16), torch.randn(32, 1))
    return total[0]


def test_recompute_keeps_less_for_the_backward():
    kept, recomputed = _saved_bytes_in_forward(False), _saved_bytes_in_forward(True)
    assert recomputed < kept / 2


# ---------------------------------------------------------------------- every small placement
_layouts = st.tuples(
    st.lists(st.tuples(st.sampled_from(["replicate", "split"]), st.integers(1, 3)), min_size=1, max_size=3),
    st.booleans(),
    st.integers(1, 3),
    st.integers(1, 4),
    st.sampled_from(["PreferBackward", "PreferForward"]),
    st.sampled_from(["", "v1"]),
    st.sampled_from(["", "v0"]),
)


@settings(max_examples=60, deadline=None)
@given(_layouts)
def test_every_small_placement_compiles_and_simulates(layout):
    scopes, colocate, replicas, micro, order, zero, offload = layout
    if colocate:
        scopes = [(kind, scopes[0][1]) for kind, _ in scopes]
    epl.init(epl.Config({"cluster.colocate_split_and_replicate": colocate, "pipeline.num_micro_batch": micro,
                         "pipeline.strategy": order, "zero.level": zero, "offload.level": offload}))
    for kind, count in scopes:
        with (epl.replicate if kind == "replicate" else epl.split)(count):
            nn.Linear(2, 6)  # 6 features: split over 1, 2 or 3 devices
    per_replica = scopes[0][1] if colocate else sum(count for _, count in scopes)
    world = per_replica * replicas
    placement = epl.placement(world_size=world)
    assert placement.data_parallel == replicas
    for r in range(replicas):
        used = [rank for group in placement.groups[r] for rank in group]
        assert set(used) == set(range(r * per_replica, (r + 1) * per_replica))
        if not colocate:
            assert len(used) == len(set(used))
    strategy = epl.strategy(world_size=world)
    simulation = unisched.simulate(*strategy.shape, strategy)
    timeline = simulation.timeline
    assert len(timeline) == 2 * len(scopes) * replicas * micro
    for row in range(len(timeline)):
        work = unisched.Work(int(timeline.batch[row]), int(timeline.stage[row]))
        group = placement.group(work.batch // micro, work.stage)
        assert timeline.worker[row] == group[0]
        members = timeline.gang_members[timeline.gang[row]] if timeline.gang[row] >= 0 else (group[0],)
        assert tuple(members) == group
    if order == "PreferBackward":
        peaks = simulation.worker_stats()["max_activation_storage"]
        assert all(peak <= limit for peak, limit in zip(peaks, strategy.memory_limit))


def test_a_negative_world_size_is_a_clear_error():
    epl.init()
    with epl.replicate(device_count=1):
        torch.nn.Linear(2, 2)
    with pytest.raises(unisched.UniSchedError, match="positive number of devices"):
        epl.simulate(world_size=-2)


def test_simulate_names_costs_or_sizes_of_the_wrong_kind():
    """A dict for costs raised AttributeError; internal_bytes="x" numpy's own message."""
    with epl.replicate(1):
        nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(TypeError, match="costs must be a unisched.Costs"):
        epl.simulate(world_size=1, costs={"forward": 1})
    with pytest.raises(ScopeError, match=r"internal_bytes=\.\.\.\) takes a non-negative number"):
        epl.simulate(world_size=1, internal_bytes="x")
