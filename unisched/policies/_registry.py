"""What the registry knows about a strategy: its factory, one line that says
what it is, its parameters (with defaults and help), and which parameter
settings are worth trying on a given shape.

Every factory has the signature ``factory(num_workers, num_stages,
num_batches, **params) -> Strategy`` and checks its own constraints, raising
:class:`StrategyShapeError` with a message that says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from unisched.errors import ShapeError, UniSchedError
from unisched.simulate.priorities import BUILTIN_PRIORITIES, priority_by_name
from unisched.strategy import Strategy
from unisched.work import Shape, is_whole, name_key, unquoted


class UnknownStrategyError(UniSchedError, ValueError):
    """A strategy name the registry does not know."""


class StrategyParameterError(UniSchedError, ValueError):
    """A parameter a strategy does not take, or a value it cannot use."""


class StrategyShapeError(ShapeError):
    """A shape (workers, stages, micro-batches) a strategy cannot serve."""


@dataclass(frozen=True)
class Param:
    """One parameter of a strategy factory, as the CLI and catalog show it."""

    name: str
    default: Any
    help: str
    type: Callable[[Any], Any] = int
    choices: tuple | None = None

    def coerce(self, strategy: str, value: Any) -> Any:
        """Turn a value (possibly a string from the command line) into this parameter's type."""
        if value is None:
            return None
        try:
            if self.type is bool and isinstance(value, str):
                lowered = value.strip().lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                value = lowered in ("true", "1", "yes")
            elif self.type is bool and value not in (True, False):  # 0 and 1 (numpy's too) are True and False
                raise ValueError(value)
            elif self.type is int and isinstance(value, float) and value.is_integer():
                value = int(value)
            elif self.type is int and isinstance(value, bool):
                raise ValueError(value)
            elif self.type is int and not isinstance(value, (int, str)):
                raise ValueError(value)
            elif self.type is str and isinstance(value, str):
                value = _name_of(value, self.choices)
            else:
                value = self.type(value)
        except (TypeError, ValueError):
            raise StrategyParameterError(
                f"strategy {strategy!r}: parameter {self.name!r} must be {_TYPE_WORDS.get(self.type, 'valid')}, "
                f"got {value!r}"
            ) from None
        if self.choices is not None and value not in self.choices:
            raise StrategyParameterError(
                f"strategy {strategy!r}: parameter {self.name!r} must be one of "
                f"{', '.join(map(str, self.choices))}; got {value!r}"
            )
        return value

    def as_dict(self) -> dict:
        data = {"name": self.name, "default": self.default, "help": self.help,
                "type": getattr(self.type, "__name__", str(self.type))}
        if self.choices is not None:
            data["choices"] = list(self.choices)
        return data


def _name_of(value: str, choices: tuple | None) -> str:
    """A string parameter as given, quotes stripped; one of ``choices`` as it is looked up
    (:func:`unisched.work.name_key`: ``Backward-First`` is ``backward_first``), as ``--priority``
    and strategy names read."""
    key = name_key(value)
    return key if choices is not None and key in choices else unquoted(value)


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}

TIE_BREAK = Param("priority", None,
                  "the simulator's tie-break where the strategy leaves the order open, as --priority: "
                  "oldest_batch_first, oldest_stage_first or backward_first", str, tuple(BUILTIN_PRIORITIES))
"""A parameter every strategy takes that leaves its workers' orders open (``looped(priority=backward_first)``
runs as ``looped`` with ``--priority backward_first``, and reports the same parameters), or takes as its own
(gpipe); refused by one that fixes every order."""

Grid = Callable[[Shape], Iterable[Mapping[str, Any]]]


def _defaults_only(shape: Shape) -> Iterable[Mapping[str, Any]]:
    yield {}


@dataclass(frozen=True)
class Entry:
    """A registered strategy: the factory plus what the catalog says about it."""

    name: str
    factory: Callable[..., Strategy]
    description: str
    family: str
    constraints: str
    params: tuple[Param, ...] = ()
    grid: Grid = field(default=_defaults_only)
    """Parameter settings worth trying on a shape (each may still not fit it)."""
    check: Callable[[Shape], None] | None = None
    """Checks the constraints alone, for strategies that are costly to build
    (those that design a fixed order); parameterless strategies only."""

    def param(self, name: str) -> Param:
        """The parameter ``name``: one of the factory's, else :data:`TIE_BREAK` (which :meth:`build`
        attaches, or refuses for a strategy that fixes every order)."""
        for param in self.params:
            if param.name == name:
                return param
        if name == TIE_BREAK.name:
            return TIE_BREAK
        valid = ", ".join(p.name for p in self.params) or "none"
        tie_break = "" if self.own_priority else (f" (and {TIE_BREAK.name}, the simulator's tie-break, where it "
                                                  "leaves the order open)")
        raise StrategyParameterError(
            f"strategy {self.name!r} has no parameter {name!r}; its parameters are: {valid}{tie_break}"
        )

    def build(self, shape: Shape, params: Mapping[str, Any]) -> Strategy:
        """The strategy for ``shape`` with ``params``; ``priority`` (:data:`TIE_BREAK`) also where the
        factory takes none (:meth:`tie_broken`)."""
        params = dict(params)
        tie_break = None if self.own_priority else params.pop(TIE_BREAK.name, None)
        values = {name: self.param(name).coerce(self.name, value) for name, value in params.items()}
        strategy = self.factory(*shape, **values)
        return strategy if tie_break is None else self.tie_broken(strategy, tie_break, shape)

    @property
    def own_priority(self) -> bool:
        """Whether the factory takes the tie-break as a parameter of its own (gpipe)."""
        return any(param.name == TIE_BREAK.name for param in self.params)

    def leaves_order_open(self, strategy: Strategy) -> bool:
        """Whether ``strategy`` (built by this entry) leaves ties to the simulator's priority: no
        fixed orders, and no priority of its design (looped_bfs's breadth-first order) unless it is
        the factory's own tie-break."""
        return strategy.worker_orders is None and (strategy.priority is None or self.own_priority)

    def tie_broken(self, strategy: Strategy, tie_break: str, shape: Shape) -> Strategy:
        """``strategy`` (built by this entry for ``shape``) with the simulator's tie-break ``tie_break``, and
        reporting it among its parameters; refused where the strategy decides its order itself."""
        tie_break = TIE_BREAK.coerce(self.name, tie_break)
        if not self.leaves_order_open(strategy):
            how = "fixes every worker's order" if strategy.worker_orders is not None else \
                "orders its work by a priority of its own"
            raise StrategyParameterError(f"strategy {self.name!r} {how}, and a priority only breaks the ties the "
                                         f"simulator chooses: drop priority={tie_break} (or the command's --priority)")
        return strategy.with_(priority=priority_by_name(tie_break, shape.num_stages, shape.num_batches),
                              params={**strategy.params, TIE_BREAK.name: tie_break})

    def fits(self, shape: Shape, params: Mapping[str, Any]) -> bool:
        """Whether the strategy with ``params`` serves ``shape``; a parameter it does not have, or a
        value of the wrong kind, is an error (StrategyParameterError), not a misfit."""
        try:
            if self.check is not None and not params:
                self.check(shape)
            else:
                self.build(shape, params)
        except StrategyShapeError:
            return False
        return True

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "family": self.family,
            "description": self.description,
            "constraints": self.constraints,
            "params": [p.as_dict() for p in self.params],
        }


def require(condition: bool, strategy: str, message: str) -> None:
    """Raise a StrategyShapeError naming the strategy when a constraint fails."""
    if not condition:
        raise StrategyShapeError(f"strategy {strategy!r}: {message}")


def require_count(value, strategy: str, name: str) -> None:
    """Refuse a count parameter given as anything but a positive integer: a bad value whatever
    the shape (a StrategyParameterError), not a strategy that does not fit it."""
    if value is not None and not is_whole(value):
        raise StrategyParameterError(f"strategy {strategy!r}: {name} must be a positive integer, got {value!r}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
