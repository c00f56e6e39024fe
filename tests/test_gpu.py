"""The Trainer on one GPU (NCCL, world size 1): the same numbers as one
process on that GPU, dropout and clipping included, bf16 autocast close to
fp32, a measured timeline from CUDA events, and a resumed run that continues
exactly.  Skipped without CUDA; the two-GPU NCCL test lives in test_execute."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from unisched import policies, simulate
from unisched.execute import Trainer, train_one_process
from unisched.execute.launch import run_local

pytestmark = pytest.mark.gpu

S, B, ROWS, WIDTH = 3, 4, 16, 32


def make_stages(dropout: float = 0.25) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(dropout), nn.Tanh()) for _ in range(S)]


def batch(step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(ROWS, WIDTH, generator=g).to(device), torch.randn(ROWS, WIDTH, generator=g).to(device))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def one_worker(name: str):
    return simulate(1, S, B, policies.get(name, num_workers=1, num_stages=S, num_batches=B)).timeline


def _host(state: dict) -> dict:
    return {k: v.detach().cpu().numpy() for k, v in state.items()}


def _on_one_gpu(rank: int, world: int) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    out = {"device": str(device)}
    options = {"clip_grad_norm": 0.5, "scheduler": halving}
    for name in ("looped", "looped_bfs"):
        trainer = Trainer(make_stages(), one_worker(name), nn.functional.mse_loss, sgd, record=True, **options)
        losses = [trainer.step(*batch(step, device)) for step in range(3)]
        timeline = trainer.last_timeline
        out[name] = {"losses": losses, "state": _host(trainer.gather_state_dict()),
                     "spans": np.stack([timeline.start, timeline.end], axis=1),
                     "step_seconds": trainer.last_step_seconds, "clock_on_cuda": trainer._clock.cuda}
        trainer.close()
    stages = [stage.to(device) for stage in make_stages()]
    losses, state = train_one_process(stages, nn.functional.mse_loss, sgd, (batch(step, device) for step in range(3)),
                                      micro_batches=B, **options)
    out["reference"] = {"losses": losses, "state": _host(state)}

    for precision in ("fp32", "bf16"):
        trainer = Trainer(make_stages(0.0), one_worker("looped"), nn.functional.mse_loss, sgd, precision=precision)
        out[precision] = [trainer.step(*batch(0, device)) for _ in range(6)]
        trainer.close()

    whole = Trainer(make_stages(), one_worker("looped"), nn.functional.mse_loss, sgd, **options)
    for step in range(4):
        whole.step(*batch(step, device))
    out["four steps"] = _host(whole.gather_state_dict())
    whole.close()
    first = Trainer(make_stages(), one_worker("looped"), nn.functional.mse_loss, sgd, **options)
    for step in range(2):
        first.step(*batch(step, device))
    weights, state = first.gather_state_dict(), first.training_state()
    optimizer = copy.deepcopy(first.optimizer.state_dict())
    first.close()
    stages = make_stages()
    for s, stage in enumerate(stages):
        stage.load_state_dict({k.split(".", 1)[1]: v for k, v in weights.items() if k.startswith(f"{s}.")})
    second = Trainer(stages, one_worker("looped"), nn.functional.mse_loss, sgd, **options)
    second.optimizer.load_state_dict(optimizer)
    second.load_training_state(state)
    for step in (2, 3):
        second.step(*batch(step, device))
    out["2 + 2 steps"] = _host(second.gather_state_dict())
    second.close()
    return out


@pytest.fixture(scope="module")
def on_one_gpu():
    (result,) = run_local(_on_one_gpu, 1, backend="nccl", timeout=300)
    assert result.error is None, result.error
    return result.value


@pytest.mark.parametrize("name", ["looped", "looped_bfs"])
def test_one_gpu_trains_as_one_process_on_it(on_one_gpu, name):
    """Dropout, clipping and a scheduler: the Trainer's weights and losses are the reference's."""
    assert on_one_gpu["device"].startswith("cuda")
    got, expected = on_one_gpu[name], on_one_gpu["reference"]
    assert got["losses"] == pytest.approx(expected["losses"], abs=1e-6)
    for key, value in expected["state"].items():
        assert np.abs(got["state"][key] - value).max() < 1e-5, f"{name} {key}"


@pytest.mark.parametrize("name", ["looped", "looped_bfs"])
def test_a_gpu_step_is_measured_with_cuda_events(on_one_gpu, name):
    """Every item's span lies inside the step, and on one worker they follow each other."""
    assert on_one_gpu[name]["clock_on_cuda"]  # the marks are CUDA events on the stream, not host clock reads
    spans = on_one_gpu[name]["spans"]
    assert len(spans) == 2 * S * B
    ordered = spans[np.argsort(spans[:, 0])]
    assert (ordered[:, 1] >= ordered[:, 0]).all()
    assert (ordered[1:, 0] >= ordered[:-1, 1] - 1e-6).all(), "items on one GPU stream overlap"
    assert ordered[-1, 1] - ordered[0, 0] <= on_one_gpu[name]["step_seconds"] + 1e-3


def test_bf16_on_a_gpu_trains_close_to_fp32(on_one_gpu):
    fp32, bf16 = on_one_gpu["fp32"], on_one_gpu["bf16"]
    assert fp32[-1] < fp32[0]
    assert abs(bf16[-1] - fp32[-1]) / fp32[-1] < 0.02
    assert bf16 != fp32  # autocast did run in bf16


def test_a_resumed_gpu_run_continues_exactly(on_one_gpu):
    for key, value in on_one_gpu["four steps"].items():
        assert np.array_equal(on_one_gpu["2 + 2 steps"][key], value), key
