"""Annotation scopes: ``replicate`` and ``split`` group the modules built
inside them into TaskGraphs.

As in EPL, the user only annotates where modules are *built*; every process
runs the same script.  A scope learns what was built inside it by being told
of every ``nn.Module`` as ``nn.Module.__init__`` runs, while a scope is open
or a default strategy is set (torch has registration hooks, but a module
without parameters, buffers or submodules, such as ``nn.ReLU()``, registers
nothing), so plain ``nn.Module`` code needs no changes, and a model that
builds its parts inside scopes in its own ``__init__`` is annotated part by
part.  Loss modules are left out: the trainer applies the loss.  The
TaskGraphs then form a chain: TaskGraph i+1 is fed by TaskGraph i's output,
and the modules built in one scope are applied in the order they were built.

EPL's API is process-global (``epl.init()`` then bare ``with`` blocks), so the
state lives in one :class:`Env` per process; ``epl.init`` starts a new one.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, field
from typing import Iterator

from torch import nn
from torch.nn.modules.loss import _Loss

from unisched.epl.config import Config, ConfigError
from unisched.epl.tensor_parallel import check_split
from unisched.errors import UniSchedError
from unisched.work import is_whole


class ScopeError(UniSchedError):
    """A misuse of ``replicate``/``split`` scopes (nesting, bad device counts, shared modules)."""


REPLICATE = "replicate"
SPLIT = "split"


@dataclass(eq=False)
class TaskGraph:
    """The modules built under one strategy annotation: one stage of the model."""

    index: int
    kind: str
    device_count: int
    name: str
    is_default: bool = False
    modules: list[nn.Module] = field(default_factory=list)
    _module: nn.Module | None = field(default=None, repr=False)

    def add(self, module: nn.Module) -> None:
        if all(m is not module for m in self.modules):
            self.modules.append(module)
            self._module = None

    def top_modules(self) -> list[nn.Module]:
        """The built modules that are not inside another one built here, in build order."""
        inner = {id(sub) for m in self.modules for sub in m.modules() if sub is not m}
        return [m for m in self.modules if id(m) not in inner]

    def module(self) -> nn.Module:
        """The TaskGraph as one module: its top modules applied in build order."""
        if self._module is None:
            tops = self.top_modules()
            with Env.get().paused():
                self._module = tops[0] if len(tops) == 1 else nn.Sequential(*tops)
        return self._module

    def __repr__(self) -> str:
        default = ", default" if self.is_default else ""
        return f"TaskGraph({self.index}, {self.kind}({self.device_count}), name={self.name!r}{default})"


class Scope:
    """``replicate(n)`` or ``split(n)``: a context manager that opens a TaskGraph,
    or an argument to :func:`set_default_strategy`."""

    def __init__(self, kind: str, device_count: int | None, name: str | None):
        if not is_whole(device_count):
            raise ScopeError(
                f"epl.{kind}(device_count=...) needs a positive integer number of devices per model replica, "
                f"got {device_count!r}"
            )
        if name is not None and not isinstance(name, str):
            raise ScopeError(f"epl.{kind}(name=...) must be a string, got {name!r}")
        self.kind = kind
        self.device_count = device_count
        self.name = name

    def __enter__(self) -> "Scope":
        Env.get().enter(self)
        return self

    def __exit__(self, *exc) -> None:
        Env.get().exit(self)

    def __repr__(self) -> str:
        name = f", name={self.name!r}" if self.name else ""
        return f"epl.{self.kind}({self.device_count}{name})"


def replicate(device_count: int | None = None, name: str | None = None) -> Scope:
    """Data parallelism: one model replica of this part spans ``device_count``
    devices, each taking an equal share of the micro-batch."""
    return Scope(REPLICATE, device_count, name)


def split(device_count: int | None = None, name: str | None = None) -> Scope:
    """Tensor parallelism: this part is split over ``device_count`` devices that
    work on each micro-batch together."""
    return Scope(SPLIT, device_count, name)


def set_default_strategy(strategy: Scope) -> None:
    """Annotate everything built outside scopes with ``strategy`` from now on."""
    if not isinstance(strategy, Scope):
        raise ScopeError(
            f"epl.set_default_strategy takes epl.replicate(...) or epl.split(...), got {strategy!r}"
        )
    Env.get().set_default(strategy)


@dataclass(frozen=True)
class Cluster:
    """What EPL's ``Env.get().cluster`` reports."""

    total_gpu_num: int


class _BuiltModules:
    """Tells its listeners of every ``nn.Module`` built while any listens: ``nn.Module.__init__``
    wrapped from the first :meth:`listen`, and torch's own restored at the last :meth:`stop`.  A
    listener is told once however often it listens, and stopping one that does not listen does
    nothing."""

    listeners: list = []
    torch_init = None
    wrapper = None

    @classmethod
    def listen(cls, listener) -> None:
        if cls.torch_init is None:
            cls.torch_init = torch_init = nn.Module.__init__

            @functools.wraps(torch_init)
            def init_and_tell(module, *args, **kwargs):
                torch_init(module, *args, **kwargs)
                for told in list(cls.listeners):
                    told(module)

            nn.Module.__init__ = cls.wrapper = init_and_tell
        if listener not in cls.listeners:
            cls.listeners.append(listener)

    @classmethod
    def stop(cls, listener) -> None:
        if listener in cls.listeners:
            cls.listeners.remove(listener)
        # restored unless another library wrapped it since (then ours stays under theirs, telling no one)
        if not cls.listeners and cls.torch_init is not None and nn.Module.__init__ is cls.wrapper:
            nn.Module.__init__, cls.torch_init = cls.torch_init, None


class Env:
    """The per-process state of the annotations: config, TaskGraphs, open scope."""

    _current: "Env | None" = None

    def __init__(self, config: Config | None = None):
        if config is not None and not isinstance(config, Config):
            raise ConfigError(f"epl.init takes an epl.Config, got {type(config).__name__}")
        self.config = config if config is not None else Config()
        self.taskgraphs: list[TaskGraph] = []
        self.scope: Scope | None = None
        self.default: Scope | None = None
        self._default_open: TaskGraph | None = None
        self._capturing = True

    @classmethod
    def get(cls) -> "Env":
        if cls._current is None:
            cls.start(None)
        return cls._current

    @classmethod
    def start(cls, config: Config | None) -> "Env":
        env = cls(config)
        if cls._current is not None:
            cls._current.close()
        cls._current = env
        return env

    def close(self) -> None:
        """Stop capturing: no module built from now on is this Env's."""
        self.scope = self.default = None
        self._listen()

    def _listen(self) -> None:
        """Be told of the modules built while a scope is open or a default strategy is set, and
        only then (torch's own ``nn.Module.__init__`` runs otherwise)."""
        wanted = self.scope is not None or self.default is not None
        (_BuiltModules.listen if wanted else _BuiltModules.stop)(self._on_build)

    @property
    def cluster(self) -> Cluster:
        return Cluster(world_size())

    def checked_taskgraphs(self) -> list[TaskGraph]:
        """The TaskGraphs annotated since ``epl.init``, refused (saying what to change) when there
        are none, one holds no module, a module belongs to two, or a split one cannot be cut over
        its devices (:func:`~unisched.epl.tensor_parallel.check_split`)."""
        taskgraphs = self.taskgraphs
        if not taskgraphs:
            raise ScopeError(
                "no TaskGraph was annotated since epl.init(): build the model inside epl.replicate(...) or "
                "epl.split(...), or call epl.set_default_strategy(...) first"
            )
        owner: dict[int, TaskGraph] = {}
        for t in taskgraphs:
            if not t.modules:
                raise ScopeError(
                    f"TaskGraph {t.index} ({t.name!r}) holds no module; "
                    "build its modules inside the scope or remove the scope"
                )
            for top in t.top_modules():
                for sub in top.modules():
                    if id(sub) in owner and owner[id(sub)] is not t:
                        raise ScopeError(
                            f"a {type(sub).__name__} built in TaskGraph {owner[id(sub)].index} "
                            f"({owner[id(sub)].name!r}) is also used in TaskGraph {t.index} ({t.name!r}); "
                            "a module belongs to one TaskGraph"
                        )
                    owner[id(sub)] = t
        for t in taskgraphs:
            if t.kind == SPLIT:
                check_split(t.module(), t.device_count, f"TaskGraph {t.index} ({t.name!r})")
        return taskgraphs

    # ------------------------------------------------------------------ scopes
    def enter(self, scope: Scope) -> None:
        if self.scope is not None:
            raise ScopeError(
                f"cannot open {scope!r} inside {self.scope!r}: EPL annotations do not nest; "
                "close the outer scope first"
            )
        self.scope = scope
        self._default_open = None
        self.taskgraphs.append(self._new_taskgraph(scope, is_default=False))
        self._listen()

    def exit(self, scope: Scope) -> None:
        if self.scope is not scope:
            raise ScopeError(f"{scope!r} was closed but it is not the open scope ({self.scope!r})")
        self.scope = None
        self._listen()

    def set_default(self, scope: Scope) -> None:
        if self.scope is not None:
            raise ScopeError(f"call epl.set_default_strategy outside annotation scopes (inside {self.scope!r})")
        self.default = scope
        self._default_open = None
        self._listen()

    def _new_taskgraph(self, scope: Scope, is_default: bool) -> TaskGraph:
        index = len(self.taskgraphs)
        return TaskGraph(index, scope.kind, scope.device_count, scope.name or f"taskgraph_{index}", is_default)

    def _on_build(self, module: nn.Module) -> None:
        if not self._capturing or isinstance(module, _Loss):
            return
        if self.scope is not None:
            self.taskgraphs[-1].add(module)
        elif self.default is not None:
            if self._default_open is None:
                self._default_open = self._new_taskgraph(self.default, is_default=True)
                self.taskgraphs.append(self._default_open)
            self._default_open.add(module)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Build modules without adding them to any TaskGraph (the library's own)."""
        previous, self._capturing = self._capturing, False
        try:
            yield
        finally:
            self._capturing = previous


def init(config: Config | None = None) -> Env:
    """Start a new model: forget earlier TaskGraphs and use ``config``."""
    return Env.start(config)


def world_size() -> int:
    """Devices taking part: torch.distributed's world, else ``WORLD_SIZE``, else 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        value = int(raw)
    except ValueError:
        raise ScopeError(f"environment variable WORLD_SIZE={raw!r} must be a positive integer") from None
    if value < 1:
        raise ScopeError(f"environment variable WORLD_SIZE={raw!r} must be a positive integer")
    return value
