"""Faults on gloo ranks: a rank blocked in a C call is still stopped by its
step timeout, and the ranks agree on metadata without unpickling peer bytes."""

from __future__ import annotations

import datetime
import functools
import multiprocessing as mp
import os
import time

import torch
from torch import nn

from unisched import policies, simulate
from unisched.execute import ExecutionError, Trainer
from unisched.execute.launch import free_port, run_local

WIDTH = 8


def make_stages(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(num_stages)]


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(12, WIDTH, generator=g), torch.randn(12, WIDTH, generator=g)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


def gpipe_timeline(W: int, B: int):
    return simulate(W, W, B, policies.get("gpipe", num_workers=W, num_stages=W, num_batches=B)).timeline


# ---------------------------------------------------------------------- a rank blocked in C
class FailsInStepTwo(nn.Module):
    """A stage that, on one rank and in the second step, does ``fault()`` (sleeps in C for good, exits)."""

    def __init__(self, inner: nn.Module, rank: int, bad_rank: int, fault):
        super().__init__()
        self.inner, self.rank, self.bad_rank, self.fault, self.calls = inner, rank, bad_rank, fault, 0

    def forward(self, x):
        self.calls += 1
        if self.rank == self.bad_rank and self.calls > 6:
            self.fault()
        return self.inner(x)


def _blocked_run(rank: int, world: int, schedule):
    stages = make_stages(3)
    stages[1] = FailsInStepTwo(stages[1], rank, 1, functools.partial(time.sleep, 1e6))
    trainer = Trainer(stages, schedule, nn.functional.mse_loss, optimizer, timeout=3)
    x, y = batch()
    start = time.monotonic()
    try:
        for _ in range(3):
            trainer.step(x, y)
        return {"error": None}
    except ExecutionError as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    finally:
        trainer.close()


def test_a_rank_blocked_in_a_c_call_is_stopped_by_its_step_timeout():
    results = run_local(_blocked_run, 3, gpipe_timeline(3, 6), timeout=40)
    for r in results:
        assert r.error is None, f"rank {r.rank}: {r.error}"
        assert "rank 1 ran past the step timeout of 3 s" in r.value["error"], r.value
        assert r.value["seconds"] < 3 + 10, r.value


# ---------------------------------------------------------------------- no unpickling of peer bytes
class ToDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return {"h": self.linear(x), "ids": torch.arange(x.shape[0])}


class FromDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.norm = nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH)

    def forward(self, value):
        return self.norm(self.linear(value["h"])) + value["ids"][:, None]


def _refuse(*args, **kwargs):
    raise AssertionError("a rank unpickled bytes")


def _without_pickle(rank: int, world: int, schedule):
    import pickle

    import torch.distributed.distributed_c10d as c10d

    pickle.loads = c10d._tensor_to_object = _refuse
    torch.manual_seed(0)
    trainer = Trainer([ToDict(), FromDict()], schedule, nn.functional.mse_loss, optimizer, timeout=20)
    x, y = batch()
    losses = [trainer.step(x, y) for _ in range(2)]
    costs = trainer.calibrate(x, y, steps=2)
    state = {name: tensor.sum().item() for name, tensor in trainer.gather_state_dict().items()}
    trainer.close()
    return {"losses": losses, "forward": list(costs.forward), "state": state,
            "timeline": rank != 0 or trainer.last_timeline is not None}


def test_ranks_agree_on_set_up_shapes_and_costs_without_unpickling():
    results = run_local(_without_pickle, 2, gpipe_timeline(2, 4), timeout=60)
    for r in results:
        assert r.error is None, f"rank {r.rank}: {r.error}"
    first, second = (r.value for r in results)
    assert first["losses"] == second["losses"] and first["forward"] == second["forward"]
    assert first["state"] == second["state"] and "1.norm.running_mean" in first["state"]
    assert len(first["forward"]) == 2 and min(first["forward"]) > 0 and first["timeline"]


# ---------------------------------------------------------------------- the rank that hosts the store dies
def _store_on_rank_zero(rank: int, world: int, port: int, schedule, results):
    """One rank of a process group started as outside torchrun: rank 0 serves the store."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=20))
        stages = make_stages(3)
        stages[0] = FailsInStepTwo(stages[0], rank, 0, functools.partial(os._exit, 7))
        trainer = Trainer(stages, schedule, nn.functional.mse_loss, optimizer, timeout=10)
        x, y = batch()
        try:
            for _ in range(3):
                trainer.step(x, y)
            results.put((rank, "finished"))
        except ExecutionError as error:
            results.put((rank, str(error)))
    except BaseException as error:
        results.put((rank, f"unexpected {type(error).__name__}: {error}"))
    finally:
        results.close()
        results.join_thread()
    os._exit(0)


def test_when_the_rank_that_hosts_the_store_dies_every_rank_names_it():
    context = mp.get_context("forkserver")
    results = context.Queue()
    port = free_port()
    procs = [context.Process(target=_store_on_rank_zero, args=(r, 3, port, gpipe_timeline(3, 6), results),
                             daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    try:
        heard = dict(results.get(timeout=40) for _ in range(2))
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    assert procs[0].exitcode == 7
    for rank in (1, 2):
        assert "because rank 0, which hosts the rendezvous store, is gone" in heard[rank], heard
