"""The runtime's transfer waiters (gloo transfers complete only once waited
on): each transfer is waited on at once, never behind another that is still
blocked, by threads that are reused once idle."""

from __future__ import annotations

import threading

import pytest

from unisched.execute.runtime import _Waiters


class FakeWork:
    """A transfer that completes (or fails) when ``finish`` is called."""

    def __init__(self):
        self._finished = threading.Event()
        self.error: Exception | None = None

    def finish(self, error: Exception | None = None) -> None:
        self.error = error
        self._finished.set()

    def wait(self) -> bool:
        assert self._finished.wait(10), "a fake transfer was never finished"
        if self.error is not None:
            raise self.error
        return True


def _waiting_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "unisched-transfer"}


def test_a_blocked_transfer_holds_up_no_other_and_idle_threads_are_reused():
    earlier = _waiting_threads()
    waiters = _Waiters()
    blocked, quick = FakeWork(), FakeWork()
    watched_blocked, watched_quick = waiters.watch(blocked), waiters.watch(quick)
    quick.finish()
    assert watched_quick.wait() and watched_quick.is_completed()
    assert not watched_blocked.is_completed(), "the other transfer is still under way"
    assert waiters._threads == 2
    for _ in range(5):  # one thread is idle now: each transfer in turn goes to it
        work = FakeWork()
        watched = waiters.watch(work)
        work.finish()
        assert watched.wait()
    assert waiters._threads == 2
    blocked.finish(RuntimeError("the peer went away"))
    with pytest.raises(RuntimeError, match="the peer went away"):
        watched_blocked.wait()
    mine = _waiting_threads() - earlier
    assert len(mine) == 2
    waiters.close()
    for thread in mine:  # every thread ends once told to
        thread.join(timeout=10)
        assert not thread.is_alive()
