"""The strategy library: every known strategy as a factory of
:class:`unisched.Strategy`, and a registry by name.

>>> from unisched import policies, simulate
>>> strategy = policies.get("one_f_one_b", num_workers=4, num_stages=4, num_batches=8)
>>> simulate(4, 4, 8, strategy).latency
33.0

``names()`` lists the strategies, ``describe(name)`` / ``catalog()`` say what
each is and takes, ``variants(W, S, B)`` enumerates the settings that fit a
shape, and ``strategy(fn, name)`` wraps a user's own function.

torch.distributed.pipelining's schedule classes are accepted by their class
names (``get("Schedule1F1B", ...)``), each reproducing torch's per-rank
order; ``aliases()`` lists them.  They stay out of ``names()`` and
``variants()``.  ``to_torch_csv`` / ``from_torch_csv`` write and read torch's
CSV schedule format.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from unisched.policies import data_parallel, looped_pp, pipeline, seed, torch_interop, zero_bubble
from unisched.policies._orders import KeyPriority, unit_time_orders
from unisched.policies._registry import (
    Entry,
    Param,
    StrategyParameterError,
    StrategyShapeError,
    UnknownStrategyError,
)
from unisched.policies.grammar import strategy_spec
from unisched.policies.data_parallel import ddp, fsdp
from unisched.policies.looped_pp import fully_sharded_looped, looped, looped_bfs
from unisched.policies.pipeline import gpipe, interleaved, megatron_interleaved_orders, one_f_one_b
from unisched.policies.seed import cuckoo, overflow
from unisched.policies.torch_interop import TorchCSVError, from_torch_csv, to_torch_csv, torch_orders
from unisched.policies.zero_bubble import dualpipe_v, dualpipe_v_order, zb_h1, zb_h2, zbv
from unisched.strategy import Strategy, as_strategy
from unisched.work import Shape, name_key

_REGISTRY: dict[str, Entry] = {
    entry.name: entry
    for entry in (
        *data_parallel.STRATEGIES,
        *pipeline.STRATEGIES,
        *looped_pp.STRATEGIES,
        *seed.STRATEGIES,
        *zero_bubble.STRATEGIES,
    )
}

_BARE: dict[str, Entry] = {key.replace("_", ""): entry for key, entry in _REGISTRY.items()}
"""The registered strategies by name without underscores (``LoopedBFS`` is ``looped_bfs``)."""
_ALIASES: dict[str, Entry] = {
    **{entry.name.lower().removeprefix("schedule"): entry for entry in torch_interop.ALIASES},
    **{entry.name.lower(): entry for entry in torch_interop.ALIASES},
}
"""torch's schedule classes by class name and by the short name ``get_schedule_class`` takes
(``1F1B``, ``Interleaved1F1B``; lower case, without underscores): resolved by name, not listed.
A registered strategy's name comes first: ``GPipe``, ``LoopedBFS`` and ``DualPipeV`` are
unisched's ``gpipe``, ``looped_bfs`` and ``dualpipe_v``; torch's are ``ScheduleGPipe`` ...."""


def names() -> list[str]:
    """The registered strategy names, in catalog order."""
    return list(_REGISTRY)


def entry(name: str) -> Entry:
    """The registry entry of ``name`` (dashes and case are forgiven), or of
    one of torch's schedule classes by its class name or short name."""
    key = name_key(str(name))
    found = _REGISTRY.get(key) or _BARE.get(key.replace("_", "")) or _ALIASES.get(key.replace("_", ""))
    if found is None:
        raise UnknownStrategyError(
            f"unknown strategy {name!r}; choose one of: {', '.join(_REGISTRY)} "
            f"(or one of torch's schedules: {', '.join(aliases())})"
        )
    return found


def aliases() -> list[str]:
    """torch.distributed.pipelining's schedule classes that ``get`` accepts by name."""
    return [entry.name for entry in torch_interop.ALIASES]


def get(
    name: str,
    num_workers: int | None = None,
    num_stages: int | None = None,
    num_batches: int | None = None,
    **params: Any,
) -> Strategy:
    """Build strategy ``name`` for a shape; ``params`` may be strings (from a command line), or be
    written in the name as the command line takes them: ``get("looped(group_size=2)", 4, 4, 8)``."""
    missing = [k for k, v in (("num_workers", num_workers), ("num_stages", num_stages),
                              ("num_batches", num_batches)) if v is None]
    name, params = strategy_spec(name, params)
    found = entry(name)
    if missing:
        raise StrategyParameterError(
            f"strategy {found.name!r} needs the shape; give {', '.join(missing)}"
        )
    shape = Shape(num_workers, num_stages, num_batches).check()
    return found.build(shape, params)


def describe(name: str) -> dict:
    """What ``name`` is: description, family, constraints and parameters (name, default, help)."""
    return entry(name).as_dict()


def catalog() -> list[dict]:
    """``describe`` of every registered strategy."""
    return [e.as_dict() for e in _REGISTRY.values()]


def variants(num_workers: int, num_stages: int, num_batches: int,
             only: list[str] | None = None) -> Iterator[tuple[str, dict]]:
    """Each (name, params) of the registry's parameter grids that fits the shape.

    Settings whose constraints fail are skipped; ``only`` restricts the names.
    """
    shape = Shape(num_workers, num_stages, num_batches).check()
    only = [only] if isinstance(only, str) else only  # one name, not its letters
    for e in (entry(n) for n in only) if only is not None else _REGISTRY.values():
        for params in e.grid(shape):
            if e.fits(shape, params):
                yield e.name, dict(params)


def fits(name: str, shape: Shape, params: dict | None = None) -> bool:
    """Whether ``name`` with ``params`` can serve ``shape`` (its constraints hold)."""
    return entry(name).fits(Shape(*shape).check(), params or {})


def strategy(fn: Callable | Strategy, name: str | None = None, description: str = "") -> Strategy:
    """Wrap a user's function ``Work -> ComputeAndWeightWorkers`` so it shows under its own name."""
    return as_strategy(fn, name=name, description=description)


__all__ = [
    "Entry",
    "KeyPriority",
    "Param",
    "StrategyParameterError",
    "StrategyShapeError",
    "TorchCSVError",
    "UnknownStrategyError",
    "aliases",
    "catalog",
    "cuckoo",
    "ddp",
    "describe",
    "dualpipe_v",
    "dualpipe_v_order",
    "entry",
    "fits",
    "from_torch_csv",
    "fsdp",
    "fully_sharded_looped",
    "get",
    "gpipe",
    "interleaved",
    "looped",
    "looped_bfs",
    "megatron_interleaved_orders",
    "names",
    "one_f_one_b",
    "overflow",
    "strategy",
    "to_torch_csv",
    "torch_orders",
    "unit_time_orders",
    "variants",
    "zb_h1",
    "zb_h2",
    "zbv",
]
