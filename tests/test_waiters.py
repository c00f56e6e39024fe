"""The threads that wait on gloo transfers keep nothing alive once a
transfer has completed: a sent buffer lives as long as its send, not until
the thread that waited on it is reused."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from unisched.execute.runtime import _Waiters


class _Send:
    """A completed transfer, as torch's Work: it holds its buffer."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer

    def wait(self) -> bool:
        return True


def test_a_completed_transfer_lets_its_buffer_go():
    waiters = _Waiters()
    try:
        buffer = torch.zeros(1 << 20)
        gone = weakref.ref(buffer)
        watched = waiters.watch(_Send(buffer))
        assert watched.wait()
        del buffer, watched
        gc.collect()
        assert gone() is None, "the idle waiting thread still holds the sent buffer"
    finally:
        waiters.close()


def test_a_failed_transfer_still_reports_its_failure():
    class Broken:
        def wait(self):
            raise RuntimeError("peer gone")

    waiters = _Waiters()
    try:
        watched = waiters.watch(Broken())
        with pytest.raises(RuntimeError, match="peer gone"):
            watched.wait()
    finally:
        waiters.close()
