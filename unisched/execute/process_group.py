"""Starting the process group and choosing where a rank computes: the one
bootstrap of unisched (the Trainer, the examples and :mod:`unisched.epl`)."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from unisched.errors import ShapeError, first_line
from unisched.execute.faults import ExecutionError


def ensure_process_group(timeout: float) -> None:
    """Start the default process group unless one is running (NCCL with CUDA,
    gloo otherwise): from torchrun's variables, or without them a world of
    this one process (a schedule for more workers is then refused, saying to
    launch them with torchrun)."""
    if dist.is_initialized():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=timeout))
        return
    backend, options = "gloo", {}
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend, options = "nccl", {"device_id": device}
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout), **options)
    except RuntimeError as error:  # the store's and the backends' errors (torch.distributed.DistError) among them
        raise ExecutionError(_start_failure(error, timeout)) from error


def _start_failure(error: RuntimeError, timeout: float) -> str:
    """What to say when the process group does not start: a port in use, a timeout, or another cause."""
    cause = first_line(error)
    where = f"MASTER_ADDR:MASTER_PORT ({os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')})"
    if "EADDRINUSE" in cause or "address already in use" in cause:
        return (f"rank {os.environ.get('RANK')} could not listen on {where}: the port is in use, by another job or "
                f"a run still ending ({cause}); pick another port (torchrun --master-port, or MASTER_PORT)")
    if "timed out" in cause.lower() or "timeout" in cause.lower():
        return (f"the process group did not start within the timeout of {timeout:g} s ({cause}): raise the timeout "
                f"(unisched run: --timeout), or check that every rank reaches {where}")
    return (f"the process group did not start ({cause}): check that every rank reaches {where} and that "
            f"WORLD_SIZE and RANK are right")


def compute_device(device: torch.device | str | None = None) -> torch.device:
    """Where this rank computes: ``device`` if given; with an NCCL process
    group (or none and CUDA present) ``cuda:LOCAL_RANK`` (else the current
    CUDA device); the CPU otherwise (gloo moves CPU tensors)."""
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ShapeError(f"device={device!r} is not a device torch knows ({first_line(error)}); pass e.g. "
                             f"'cpu' or 'cuda:0', or leave it out") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ShapeError(f"device={str(device)!r} but this torch sees no CUDA device (torch {torch.__version__}); "
                             f"leave device out to compute on the CPU with gloo, or install a CUDA build of torch")
        return device
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if dist.is_initialized() and dist.get_backend() != "nccl":
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK")
    return torch.device("cuda", int(local) if local is not None else torch.cuda.current_device())


def default_store():
    """The default process group's store, or None where torch keeps none to give."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None
