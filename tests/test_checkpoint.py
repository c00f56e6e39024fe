"""Checkpoints: a resumed run continues exactly, a checkpoint loads into
another strategy and world size and into one process, and one of another
model is refused on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import unisched
from unisched import policies, simulate
from unisched.execute import train_one_process
from unisched.execute.checkpoint import (
    CheckpointError,
    checkpoint_state_dict,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
    step_checkpoint,
)
from unisched.execute.launch import run_local

WIDTH, ROWS, S, B = 8, 16, 4, 4


def make_stages(num_stages: int = S, width: int = WIDTH) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(num_stages)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)


def adam(params):
    return torch.optim.Adam(params, lr=0.05)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def trainer_for(name: str, world: int, stages=None, optimizer=adam) -> unisched.Trainer:
    schedule = simulate(world, S, B, policies.get(name, num_workers=world, num_stages=S, num_batches=B))
    return unisched.Trainer(stages or make_stages(), schedule, nn.functional.mse_loss, optimizer, timeout=60)


def train(trainer, steps: range) -> list[float]:
    return [trainer.step(*batch(step)) for step in steps]


def reference(steps: int, optimizer_after: int | None = None) -> dict[str, torch.Tensor]:
    """One process, ``steps`` steps; with ``optimizer_after``, a fresh Adam from that step on."""
    stages = make_stages()
    if optimizer_after is None:
        return train_one_process(stages, nn.functional.mse_loss, adam, (batch(k) for k in range(steps)))[1]
    train_one_process(stages, nn.functional.mse_loss, adam, (batch(k) for k in range(optimizer_after)))
    return train_one_process(stages, nn.functional.mse_loss, adam, (batch(k) for k in range(optimizer_after, steps)))[1]


# ---------------------------------------------------------------------- the runs
def _save_along_the_way(rank: int, world: int, directory: str):
    trainer = trainer_for("looped", world)
    losses = train(trainer, range(2))
    save_checkpoint(trainer, step_checkpoint(directory, 2), extra={"step": 2})
    middle = trainer.gather_state_dict()
    losses += train(trainer, range(2, 4))
    save_checkpoint(trainer, step_checkpoint(directory, 4), extra={"step": 4})
    trainer.close()
    return {"losses": losses, "middle": middle} if rank == 0 else None


def _resume(rank: int, world: int, directory: str):
    trainer = trainer_for("looped", world)
    extra = load_checkpoint(trainer, step_checkpoint(directory, 2))
    losses = train(trainer, range(extra["step"], 4))
    save_checkpoint(trainer, f"{directory}/resumed")
    trainer.close()
    return losses


def _elsewhere(rank: int, world: int, directory: str):
    """Into ddp (every stage on every rank) and fsdp (stage s on rank s);
    refused: a model of other shapes, another optimizer, a place that cannot be written."""
    out = {}
    wider = trainer_for("gpipe", world, make_stages(width=WIDTH * 2))
    out["refused"] = _refusal(lambda: load_checkpoint(wider, step_checkpoint(directory, 2)))
    out["unwritable"] = _refusal(lambda: save_checkpoint(wider, f"{directory}/step-00000002/.metadata/inside"))
    wider.close()
    other = trainer_for("gpipe", world, optimizer=sgd)
    out["other optimizer"] = _refusal(lambda: load_checkpoint(other, step_checkpoint(directory, 2)))
    other.close()
    for name in ("ddp", "fsdp"):
        trainer = trainer_for(name, world)
        load_checkpoint(trainer, step_checkpoint(directory, 2))
        out[name + " losses"] = train(trainer, range(2, 4))
        out[name] = trainer.gather_state_dict()
        trainer.close()
    return out


def _refusal(action) -> str | None:
    try:
        action()
    except CheckpointError as error:
        return str(error)
    return None


def _ranks(fn, world: int, *args) -> list:
    results = run_local(fn, world, *args, timeout=120)
    for r in results:
        assert r.error is None, f"rank {r.rank}: {r.error}"
    return [r.value for r in results]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("checkpoints"))
    straight = _ranks(_save_along_the_way, 2, directory)[0]
    resumed = _ranks(_resume, 2, directory)
    elsewhere = _ranks(_elsewhere, 4, directory)
    return directory, straight, resumed, elsewhere


# ---------------------------------------------------------------------- the checks
def test_two_steps_saved_and_two_resumed_equal_four_steps(runs):
    directory, straight, resumed, _ = runs
    assert resumed[0] == resumed[1] and len(resumed[0]) == 2
    assert max(abs(a - b) for a, b in zip(resumed[0], straight["losses"][2:])) < 1e-6
    unbroken = read_checkpoint(step_checkpoint(directory, 4))
    again = read_checkpoint(f"{directory}/resumed")
    moments = [key for key in unbroken if key.startswith("optim.") and key.endswith(".exp_avg_sq")]
    assert len(moments) == 2 * S, "Adam's state of every weight and bias is in the checkpoint"
    assert set(again) - {"trainer.extra"} == set(unbroken) - {"trainer.extra"}
    for key, value in unbroken.items():
        if torch.is_tensor(value):
            assert (again[key] - value).abs().max() < 1e-6, key
    assert again["trainer.param_groups"] == unbroken["trainer.param_groups"]
    assert unbroken["trainer.extra"] == {"step": 4} and "trainer.extra" not in again


def test_a_checkpoint_loads_into_another_strategy_and_world_size(runs):
    _, straight, _, elsewhere = runs
    expected = reference(4)
    fresh_adam = reference(4, optimizer_after=2)
    assert max((fresh_adam[k] - expected[k]).abs().max() for k in expected) > 1e-3, "Adam's state matters here"
    for rank, out in enumerate(elsewhere):
        for name in ("ddp", "fsdp"):
            assert set(out[name]) == set(expected)
            worst = max(float((out[name][k] - expected[k]).abs().max()) for k in expected)
            assert worst < 1e-5, f"{name} on rank {rank}: {worst}"
            assert max(abs(a - b) for a, b in zip(out[name + " losses"], straight["losses"][2:])) < 1e-5


def test_a_checkpoint_loads_in_one_process_as_a_plain_state_dict(runs):
    directory, straight, _, _ = runs
    state = checkpoint_state_dict(step_checkpoint(directory, 2))
    assert set(state) == set(straight["middle"])
    for key, value in straight["middle"].items():
        assert torch.equal(state[key], value), key
    expected = reference(2)
    assert max(float((state[k] - expected[k]).abs().max()) for k in expected) < 1e-5


def test_a_checkpoint_of_another_model_is_refused_on_every_rank(runs):
    *_, elsewhere = runs
    messages = {out["refused"] for out in elsewhere}
    assert len(messages) == 1, "every rank raises the same error"
    message = messages.pop()
    assert "stage 0 '0.weight'" in message and "(8, 8)" in message and "(16, 16)" in message
    assert "same model" in message
    refused = {out["other optimizer"] for out in elsewhere}
    assert len(refused) == 1 and "optimizer is Adam but this Trainer's is SGD" in refused.pop()


def test_a_checkpoint_that_cannot_be_written_fails_on_every_rank_and_leaves_the_old_one(runs):
    directory, *_, elsewhere = runs
    messages = {out["unwritable"] for out in elsewhere}
    assert len(messages) == 1 and "cannot write" in messages.pop()
    assert set(checkpoint_state_dict(step_checkpoint(directory, 2))) == set(reference(0))


def test_latest_checkpoint_skips_unfinished_ones_and_says_what_is_missing(tmp_path):
    for step, finished in ((2, True), (4, True), (6, False)):
        (tmp_path / f"step-{step:08d}").mkdir()
        if finished:
            (tmp_path / f"step-{step:08d}" / ".metadata").write_bytes(b"")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000004"
    assert latest_checkpoint(tmp_path / "step-00000002") == tmp_path / "step-00000002"
    with pytest.raises(CheckpointError, match="no checkpoint in .*step-N"):
        latest_checkpoint(tmp_path / "step-00000006")
    with pytest.raises(CheckpointError, match="no checkpoint at .*nowhere: it does not exist"):
        checkpoint_state_dict(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no checkpoint at .*step-00000006: it has no .metadata"):
        checkpoint_state_dict(tmp_path / "step-00000006")


# ---------------------------------------------------------------------- offloaded and tensor-parallel stages
def _epl_resume(rank: int, world: int, directory: str):
    """EPL placements whose weights of truth live in host memory (offload)
    or in tensor-parallel shares (split experts): 2 + 2 steps against 4."""
    from unisched import epl
    from test_epl_train import moe, pipeline_offload

    out = {}
    for name, build in (("offload", pipeline_offload), ("split", moe)):
        def trainer():
            torch.manual_seed(0)
            inputs, targets, loss_fn = build(world)
            return epl.Trainer(loss_fn, lambda params: torch.optim.Adam(params, lr=0.05)), inputs, targets

        straight, inputs, targets = trainer()
        for _ in range(2):
            straight.step(inputs, targets)
        save_checkpoint(straight.scheduled, f"{directory}/{name}")
        for _ in range(2):
            straight.step(inputs, targets)
        expected = straight.gather_state_dict()
        held = {"host": sorted(straight.scheduled.host_weights), "shares": straight.scheduled.program.shares}
        straight.close()
        resumed, inputs, targets = trainer()
        load_checkpoint(resumed.scheduled, f"{directory}/{name}")
        for _ in range(2):
            resumed.step(inputs, targets)
        state = resumed.gather_state_dict()
        resumed.close()
        out[name] = {"held": held, "worst": max(float((state[k] - expected[k]).abs().max()) for k in expected)}
    return out


def test_offloaded_and_tensor_parallel_stages_resume_exactly(tmp_path):
    results = _ranks(_epl_resume, 2, str(tmp_path))
    for rank, out in enumerate(results):
        assert out["offload"]["held"]["host"], f"rank {rank} keeps weights of truth in host memory"
        assert any(len(set(shares.values())) > 1 for shares in out["split"]["held"]["shares"]), "a sharded stage"
        for name in ("offload", "split"):
            assert out[name]["worst"] < 1e-6, f"{name} on rank {rank}: {out[name]['worst']}"
    saved = read_checkpoint(tmp_path / "split")
    assert any(":1." in key for key in saved), "share 1 of the split stage has keys of its own"


@pytest.fixture
def in_this_process():
    """A Trainer of one process starts a process group of one here; it goes with the test."""
    import torch.distributed as dist

    running = dist.is_initialized()
    yield
    if not running and dist.is_initialized():
        dist.destroy_process_group()


def test_saving_never_deletes_what_is_not_a_checkpoint_and_refuses_extras_it_cannot_load(tmp_path, in_this_process):
    """A checkpoint replaces an older one in its place, and an empty directory; a directory of the
    user's own files (they were deleted) or a file is refused, and so is an ``extra`` that torch's
    weights-only loader would refuse on the way back, before anything is written."""
    trainer = trainer_for("looped", 1)
    try:
        train(trainer, range(1))
        mine = tmp_path / "experiment"
        (mine / "data").mkdir(parents=True)
        (mine / "notes.txt").write_text("keep me")
        with pytest.raises(CheckpointError, match="holds files that are not a checkpoint"):
            save_checkpoint(trainer, mine)
        assert (mine / "notes.txt").read_text() == "keep me" and (mine / "data").is_dir()
        with pytest.raises(CheckpointError, match="it is a file"):
            save_checkpoint(trainer, mine / "notes.txt")
        with pytest.raises(CheckpointError, match="cannot write"):  # an OSError on rank 0 alone left the others waiting
            save_checkpoint(trainer, tmp_path / ("x" * 300))
        for nowhere in (None, ""):
            with pytest.raises(CheckpointError, match="needs a directory to save in"):
                save_checkpoint(trainer, nowhere)
        with pytest.raises(TypeError, match="needs a unisched Trainer"):
            save_checkpoint(None, tmp_path / "new")
        with pytest.raises(CheckpointError, match="extra= cannot be kept"):
            save_checkpoint(trainer, tmp_path / "new", extra={"where": tmp_path})
        assert not (tmp_path / "new").exists() and not (tmp_path / "new.partial").exists()
        (tmp_path / "empty").mkdir()
        for path in (tmp_path / "empty", tmp_path / "empty"):  # an empty directory, then the checkpoint in it
            save_checkpoint(trainer, path, extra={"step": 1})
            assert read_checkpoint(path)["trainer.extra"] == {"step": 1}
    finally:
        trainer.close()


def test_a_corrupt_checkpoint_is_a_checkpoint_error_not_a_base_exception(tmp_path, in_this_process):
    """DCP's CheckpointException derives from BaseException alone: it escaped every `except Exception`."""
    trainer = trainer_for("looped", 1)
    try:
        save_checkpoint(trainer, tmp_path / "ck")
        for data in (tmp_path / "ck").glob("*.distcp"):
            data.write_bytes(b"not a checkpoint")
        with pytest.raises(CheckpointError, match="cannot read checkpoint|loading checkpoint"):
            checkpoint_state_dict(tmp_path / "ck")
    finally:
        trainer.close()
