"""Run a function on N local processes with a process group, with a hard time limit.

Like torchrun, each worker uses one compute thread unless OMP_NUM_THREADS
says otherwise.

The store lives in the launching process, so a worker that dies does not
take the fault board with it; every worker is killed when the time limit
passes, so a caller (a test, a benchmark) can never hang.  For real runs use
torchrun (see ``examples/train.py`` and ``unisched run``).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from unisched.execute.faults import ExecutionError


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None
    exitcode: int | None = None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args,
    timeout: float = 120.0,
    backend: str = "gloo",
    group_timeout: float = 30.0,
) -> list[RankResult]:
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned processes;
    one :class:`RankResult` per rank (its return value, or the error text and exit code)."""
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=group_timeout))
    context = _context()
    results = context.Queue()
    procs = [
        context.Process(target=_worker, args=(fn, rank, world_size, port, backend, group_timeout, results, args), daemon=True)
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    out = {r: RankResult(r) for r in range(world_size)}
    received = set()
    collected = False
    try:
        for p in procs:
            p.start()
        while len(received) < world_size and time.monotonic() < deadline:
            try:
                rank, payload, error = results.get(timeout=0.2)
            except queue.Empty:
                if all(not p.is_alive() for p in procs):
                    break
                continue
            if error is None:
                try:
                    out[rank].value = pickle.loads(payload)
                except Exception as caught:
                    error = f"its result could not be read back ({type(caught).__name__}: {caught})"
            out[rank].error = error
            received.add(rank)
        collected = True
    finally:
        # always reached, so that no worker outlives the call; after an
        # error here the workers are killed at once
        for p in procs:
            if collected and p.pid is not None:
                p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        for rank, p in enumerate(procs):
            if p.pid is None:
                out[rank].error = out[rank].error or "was not started"
                continue
            if p.is_alive():
                p.kill()
                p.join(1.0)
                if out[rank].error is None and rank not in received:
                    out[rank].error = f"killed after the launch time limit of {timeout:g} s"
            out[rank].exitcode = p.exitcode
            if rank not in received and out[rank].error is None:
                out[rank].error = f"exited with code {p.exitcode} without a result"
    del store
    return [out[r] for r in range(world_size)]


def _context():
    """A forkserver that has imported torch once: workers start in a fraction
    of a second instead of each importing torch (seconds on a busy machine)."""
    if "forkserver" in mp.get_all_start_methods():
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "unisched.execute"])
        return context
    return mp.get_context("spawn")


def _worker(fn, rank, world_size, port, backend, group_timeout, results, args):
    import torch.distributed as dist

    try:
        if "OMP_NUM_THREADS" not in os.environ:
            import torch

            torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=datetime.timedelta(seconds=group_timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=group_timeout))
        value = fn(rank, world_size, *args)
        # plain bytes: a tensor sent through the queue as is travels as a
        # shared-memory handle, which dies with this process before the
        # parent reads it
        results.put((rank, pickle.dumps(value), None))
    except BaseException as error:
        results.put((rank, None, f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        try:
            results.close()
            results.join_thread()
        except Exception:
            pass
    # leave without waiting for peers in process-group teardown
    os._exit(0)


def check(results: list[RankResult]) -> list[Any]:
    """The ranks' values, or an :class:`ExecutionError` listing every rank that failed."""
    failed = [r for r in results if r.error is not None]
    if failed:
        raise ExecutionError("\n".join(f"rank {r.rank}: {r.error}" for r in failed))
    return [r.value for r in results]
