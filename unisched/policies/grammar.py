"""The one grammar of a strategy and its parameters on every verb and in ``policies.get``:
``NAME`` or ``NAME(key=value, ...)``, and ``--param key=value`` beside it."""

from __future__ import annotations

from typing import Iterable

from unisched.policies._registry import StrategyParameterError
from unisched.work import name_key


def label_of(name: str, params: dict) -> str:
    """``name(k=v, ...)``, the form the table prints and ``--strategy`` accepts."""
    return name + ("(" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")" if params else "")


def parse_label(text: str) -> tuple[str, dict[str, str]]:
    """Inverse of :func:`label_of`; values stay strings for the registry to coerce."""
    text = text.strip()
    if "(" not in text:
        return text, {}
    name, _, rest = text.partition("(")
    if not rest.endswith(")") or "(" in rest or ")" in rest[:-1]:
        raise StrategyParameterError(f"cannot read strategy {text!r}; write NAME or NAME(key=value, ...), e.g. looped(group_size=2)")
    params = {}
    for part in filter(None, (p.strip() for p in rest[:-1].split(","))):
        key, eq, value = part.partition("=")
        if not eq:
            raise StrategyParameterError(f"strategy parameter {part!r} in {text!r} must be key=value")
        _set_once(params, key.strip(), value.strip(), f"strategy {text!r}")
    return name.strip(), params


def _set_once(params: dict[str, str], key: str, value: str, where: str) -> None:
    """``params[key] = value``, refusing a second, different value for the key."""
    if params.get(key, value) != value:
        raise StrategyParameterError(f"{where} sets {key} twice ({params[key]} and {value}); give it once")
    params[key] = value


def strategy_spec(text: str, params: dict | None = None) -> tuple[str, dict[str, str]]:
    """``NAME`` or ``NAME(key=value, ...)`` plus the ``--param`` values (see
    :func:`parse_params`): (name, parameters), the one grammar of every verb.

    A key given both ways must have one value."""
    params = dict(params or {})
    name, inline = parse_label(str(text))
    inline = {key.replace("-", "_"): value for key, value in inline.items()}
    for key in sorted(inline.keys() & params.keys()):
        if name_key(str(inline[key])) != name_key(str(params[key])):  # true and True, a-b and a_b alike
            raise StrategyParameterError(
                f"strategy {text!r} sets {key}={inline[key]} but {key}={params[key]} is given beside it (--param "
                f"or a keyword); give it once"
            )
    return name, {**inline, **params}


def parse_params(items: Iterable[str]) -> dict[str, str]:
    """``--param K=V`` items as ``{K: V}`` (a dash in K reads as an underscore)."""
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise StrategyParameterError(f"--param takes K=V, got {item!r}")
        _set_once(params, key.strip().replace("-", "_"), value.strip(), "--param")
    return params
