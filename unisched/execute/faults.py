"""Stopping every rank, in bounded time, with the cause in the message.

Three mechanisms together:

- every process group the trainer makes has a timeout, so a receive from a
  rank that never sends ends in an error instead of a hang;
- a rank that fails writes the cause on a *fault board* (a key in the
  process group's store) before it raises, so the ranks that then lose it
  (its process exits and gloo reports the closed connection, or the timeout
  fires) report that cause rather than a bare connection error; when the
  store itself cannot be reached, the process that served it is gone, and
  that is the cause named (rank 0 where it served the store, as when the
  process group starts from MASTER_ADDR outside torchrun);
- a watchdog thread per trainer interrupts a step that runs past the step
  timeout, after writing that on the board.  It sends SIGUSR1 to the main
  thread (:class:`MainThreadInterrupt`), which breaks a blocking C call such
  as ``time.sleep`` or a socket wait (the handler then raises in the step);
  where signals cannot be used (a trainer built off the main thread, or a
  platform without ``pthread_kill``) it falls back to
  ``_thread.interrupt_main``, which lands only when Python code runs next,
  so a stage blocked in C then stops only when that call returns.
"""

from __future__ import annotations

import _thread
import signal
import threading
import time
from typing import Callable

from unisched.errors import UniSchedError


class ExecutionError(UniSchedError, RuntimeError):
    """A training step failed; the message names the rank, the action and the cause."""


class NonFiniteLossError(ExecutionError, FloatingPointError):
    """The loss of some micro-batch was NaN or infinite; no weights were changed."""


class CommunicationError(ExecutionError):
    """A transfer with another rank failed (it died, raised, or timed out)."""

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message)
        self.peer = peer


class FaultBoard:
    """The first cause of failure, shared through the store every rank reaches."""

    KEY = "fault"

    def __init__(self, store, prefix: str, host: int | None = None):
        self._store = store
        self._prefix = prefix
        self.host = host
        self.lost = False

    @property
    def _key(self) -> str:
        return f"{self._prefix}/{self.KEY}"

    def post(self, message: str) -> str:
        """Record ``message`` unless a cause is already there; return the cause on the board."""
        if self._store is None:
            return message
        try:
            value = self._store.compare_set(self._key, "", message)
            return value.decode() if isinstance(value, bytes) else str(value)
        except Exception:
            return message

    def read(self, wait: float = 0.5) -> str | None:
        """The recorded cause, waiting up to ``wait`` seconds for a failing rank to post it."""
        if self._store is None:
            return None
        deadline = time.monotonic() + wait
        while True:
            try:
                if self._store.check([self._key]):
                    value = self._store.get(self._key)
                    return value.decode() if isinstance(value, bytes) else str(value)
            except Exception:
                self.lost = True
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


    def gone(self) -> str:
        """The cause when the store cannot be reached: the process that served it is gone."""
        if self.host is not None:
            return f"rank {self.host}, which hosts the rendezvous store, is gone (the store cannot be reached)"
        return "the process that hosts the rendezvous store is gone (the store cannot be reached)"


def hosts_store(store) -> bool:
    """Whether this process serves ``store`` (a TCPStore, or a PrefixStore
    over one).  torch tells this only in the store's description, which
    names its server (``server=<nullptr>`` on a client); False when unknown."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return "server=TCPServer" in repr(store)


class MainThreadInterrupt:
    """Raises ``KeyboardInterrupt`` in the main thread on :meth:`fire`, even
    inside a blocking C call: SIGUSR1 sent to the main thread, with a
    handler installed while this object is open (the previous handler back
    on :meth:`close`); ``_thread.interrupt_main`` where that is impossible.

    The handler raises only while ``wanted()`` is true, so a signal that
    arrives after the step it was meant for has ended does nothing."""

    SIGNAL = getattr(signal, "SIGUSR1", None)

    def __init__(self, wanted: Callable[[], bool]):
        self._wanted = wanted
        self._main = threading.main_thread().ident
        self._previous = None
        self.uses_signal = False
        self.pending = False
        if (self.SIGNAL is not None and hasattr(signal, "pthread_kill")
                and threading.current_thread() is threading.main_thread()):
            self._previous = signal.signal(self.SIGNAL, self._handle)
            self.uses_signal = True

    def _handle(self, signum, frame) -> None:
        if self._wanted() and self.pending:
            self.pending = False
            raise KeyboardInterrupt("step timeout")
        if callable(self._previous):  # another open trainer's, or the program's own
            self._previous(signum, frame)

    def fire(self) -> None:
        """Interrupt the main thread now."""
        if self.uses_signal:
            self.pending = True
            signal.pthread_kill(self._main, self.SIGNAL)
        else:
            _thread.interrupt_main()

    def take_pending(self) -> bool:
        """Whether a signal was sent whose handler has not raised yet (it then never will):
        the caller raises in its place.  Called by the main thread."""
        pending, self.pending = self.pending, False
        return pending

    def close(self) -> None:
        """Put the previous handler back (only if this one is still installed)."""
        if self.uses_signal and signal.getsignal(self.SIGNAL) == self._handle:
            signal.signal(self.SIGNAL, self._previous if self._previous is not None else signal.SIG_DFL)
        self.uses_signal = False


class Watchdog:
    """Interrupts the main thread when an armed step outlives its deadline
    and ``on_expire()`` says this rank is the one at fault.

    ``arm()`` returns the step's id; ``disarm(id)`` ends that step.  The
    expiry check, ``on_expire()`` and the interrupt all happen under the
    lock that ``disarm`` takes, and only while that id is still armed, so
    once ``disarm`` has returned no interrupt for the step can follow.  A
    caller that disarms as the last statement inside the ``try`` that
    catches ``KeyboardInterrupt`` therefore gets any interrupt inside it.
    ``on_expire`` runs under that lock and must not call the watchdog.
    The interrupt itself (:class:`MainThreadInterrupt`) raises only while
    the step it was fired for is still armed.
    """

    def __init__(self, timeout: float, on_expire: Callable[[], bool]):
        self.timeout = timeout
        self._on_expire = on_expire
        # a plain lock, entered directly by arm/disarm: its acquire and
        # release run no Python code an interrupt could land in
        self._mutex = threading.Lock()
        self._lock = threading.Condition(self._mutex)
        self._deadline: float | None = None
        self._wakes_at: float | None = None  # when the thread's timed wait ends; None: it waits for a notify
        self._steps = 0
        self._armed: int | None = None
        self._stopped = False
        self.fired = False
        self._fired_for: int | None = None
        self._interrupt = MainThreadInterrupt(self._interrupt_due)
        self._thread = threading.Thread(target=self._loop, name="unisched-watchdog", daemon=True)
        self._thread.start()

    def arm(self) -> int:
        """Start timing a step; returns its id for :meth:`disarm`."""
        with self._lock:
            self._steps += 1
            self._armed = self._steps
            self._deadline = time.monotonic() + self.timeout
            self.fired = False
            if self._wakes_at is None or self._wakes_at > self._deadline:
                self._lock.notify()  # else the thread wakes before the deadline and sees it then
            return self._steps

    def disarm(self, step: int | None = None) -> None:
        """End step ``step`` (any armed step when None); a stale id does nothing.

        If the watchdog fired for the step and its signal has not landed yet
        (the main thread was waiting here for the lock when it came), the
        interrupt is raised here, so it still lands before ``disarm`` returns."""
        with self._mutex:
            landed_here = False
            if step is None or step == self._armed:
                landed_here = self._fired_for is not None and self._fired_for == self._armed \
                    and self._interrupt.take_pending()
                self._deadline = None
                self._armed = None
        if landed_here:
            raise KeyboardInterrupt("step timeout")

    def stop(self) -> None:
        with self._lock:
            self._deadline = None
            self._armed = None
            self._stopped = True
            self._lock.notify()
        self._interrupt.close()

    def _interrupt_due(self) -> bool:
        """Whether a step is armed that this watchdog fired for."""
        return self._fired_for is not None and self._fired_for == self._armed

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self._deadline is None:
                    if self._stopped:
                        return
                    self._wakes_at = None
                    self._lock.wait()
                remaining = self._deadline - time.monotonic()
                if remaining > 0:
                    self._wakes_at = self._deadline
                    self._lock.wait(remaining)
                    continue
                self._deadline = None
                if self._armed is not None and self._on_expire():
                    self.fired = True
                    self._fired_for = self._armed
                    self._interrupt.fire()
