"""EPL's ``Config``: dotted keys in sections, with values from a dict or from
environment variables ``EPL_<SECTION>_<KEY>``.

EPL silently ignores keys it does not know; here an unknown key, a value of
the wrong type or a value outside its choices is a :class:`ConfigError` that
names the key, so a typo cannot quietly fall back to a default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from unisched.errors import UniSchedError


class ConfigError(UniSchedError, ValueError):
    """A key, type or value that EPL's configuration does not accept."""


@dataclass(frozen=True)
class Option:
    """One configuration key: its type, default and (for strings) allowed values."""

    type: type
    default: Any
    choices: tuple | None = None
    minimum: int | None = None
    help: str = ""


OPTIONS: dict[str, dict[str, Option]] = {
    "pipeline": {
        "num_micro_batch": Option(int, 1, minimum=1, help="micro-batches per replica and step"),
        "strategy": Option(
            str,
            "PreferBackward",
            ("PreferBackward", "PreferForward"),
            help="PreferBackward = 1F1B (backward first, activation limit); PreferForward = GPipe (fill-drain)",
        ),
    },
    "cluster": {
        "colocate_split_and_replicate": Option(
            bool, False, help="place every TaskGraph on the same devices instead of side by side"
        ),
    },
    "gradient_checkpoint": {
        "type": Option(str, "", ("", "auto"), help="'auto' recomputes each TaskGraph's forward in its backward"),
    },
    "zero": {
        "level": Option(str, "", ("", "v1"), help="'v1' shards weights of truth over the data-parallel replicas"),
    },
    "offload": {
        "level": Option(str, "", ("", "v0"), help="'v0' keeps the weights of truth in host memory"),
    },
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class Section:
    """The values of one section, read as attributes (``config.pipeline.num_micro_batch``)."""

    def __init__(self, name: str, values: Mapping[str, Any]):
        self._name = name
        self.__dict__.update(values)

    def __setattr__(self, key: str, value: Any) -> None:
        if key.startswith("_"):
            object.__setattr__(self, key, value)
            return
        raise ConfigError(f"epl.Config is read-only; pass {self._name}.{key} to epl.Config(...) instead")

    def __repr__(self) -> str:
        items = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items() if not k.startswith("_"))
        return f"{self._name}({items})"


class Config:
    """EPL's configuration: ``Config({"pipeline.num_micro_batch": 4})``.

    Each value comes from, in order of precedence: the dict, the environment
    variable ``EPL_<SECTION>_<KEY>`` (upper case, e.g.
    ``EPL_PIPELINE_NUM_MICRO_BATCH=4``), the default.  Keys may also be given
    nested (``{"pipeline": {"num_micro_batch": 4}}``).
    """

    def __init__(self, param_dict: Mapping[str, Any] | None = None, *, environ: Mapping[str, str] | None = None):
        given = _flatten(param_dict or {})
        environ = os.environ if environ is None else environ
        from_env = _from_environment(environ)
        self._values: dict[str, Any] = {}
        for section, options in OPTIONS.items():
            values = {}
            for key, option in options.items():
                dotted = f"{section}.{key}"
                if dotted in given:
                    value = _check(dotted, option, given[dotted], "given")
                elif dotted in from_env:
                    value = _parse_env(dotted, option, *from_env[dotted])
                else:
                    value = option.default
                values[key] = value
                self._values[dotted] = value
            object.__setattr__(self, section, Section(section, values))

    def __getitem__(self, key: str) -> Any:
        if key not in self._values:
            raise ConfigError(_unknown_message(key))
        return self._values[key]

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and other._values == self._values

    def __repr__(self) -> str:
        changed = {k: v for k, v in self._values.items() if v != _option(k).default}
        return f"epl.Config({changed})"


def _option(dotted: str) -> Option:
    section, _, key = dotted.partition(".")
    return OPTIONS[section][key]


def _known_keys() -> list[str]:
    return [f"{section}.{key}" for section, options in OPTIONS.items() for key in options]


def _unknown_message(key: str) -> str:
    return f"unknown EPL config key {key!r}; known keys are {', '.join(_known_keys())}"


def _flatten(param_dict: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(param_dict, Mapping):
        raise ConfigError(f"epl.Config takes a dict of 'section.key' -> value, got {type(param_dict).__name__}")
    flat: dict[str, Any] = {}
    for key, value in param_dict.items():
        if not isinstance(key, str):
            raise ConfigError(f"EPL config keys are strings like 'pipeline.num_micro_batch', got {key!r}")
        given = ({f"{key}.{inner}": inner_value for inner, inner_value in value.items()}
                 if key in OPTIONS and isinstance(value, Mapping) else {key: value})
        for dotted, one in given.items():
            if dotted in flat and flat[dotted] != one:
                raise ConfigError(f"EPL config sets {dotted} twice ({flat[dotted]!r} and {one!r}), nested and as "
                                  f"'{dotted}'; give it once")
            flat[dotted] = one
    for key in flat:
        section, _, name = key.partition(".")
        if section not in OPTIONS or name not in OPTIONS[section]:
            raise ConfigError(_unknown_message(key))
    return flat


def _from_environment(environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """``dotted key -> (variable name, raw value)`` for the EPL_* variables.

    A variable whose section is known but whose key is not is an error: it is
    almost surely a misspelt setting.  Variables of other sections are left
    alone (other tools may use the EPL_ prefix).
    """
    found: dict[str, tuple[str, str]] = {}
    for variable, raw in environ.items():
        if not variable.startswith("EPL_"):
            continue
        rest = variable[4:].lower()
        for section in sorted(OPTIONS, key=len, reverse=True):
            if rest.startswith(section + "_"):
                key = rest[len(section) + 1 :]
                if key not in OPTIONS[section]:
                    known = ", ".join(f"EPL_{section.upper()}_{k.upper()}" for k in OPTIONS[section])
                    raise ConfigError(f"unknown EPL environment variable {variable}; known ones are {known}")
                found[f"{section}.{key}"] = (variable, raw)
                break
    return found


def _parse_env(dotted: str, option: Option, variable: str, raw: str) -> Any:
    text = raw.strip()
    if option.type is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"environment variable {variable}={raw!r} for {dotted} must be true or false")
    if option.type is int:
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"environment variable {variable}={raw!r} for {dotted} must be an integer") from None
        return _check(dotted, option, value, f"environment variable {variable}")
    return _check(dotted, option, text, f"environment variable {variable}")


def _check(dotted: str, option: Option, value: Any, origin: str) -> Any:
    is_bool = isinstance(value, bool)
    if option.type is bool and not is_bool:
        raise ConfigError(f"{dotted} must be True or False, got {value!r} ({origin})")
    if option.type is int and (is_bool or not isinstance(value, int)):
        raise ConfigError(f"{dotted} must be an integer, got {value!r} ({origin})")
    if option.type is str and not isinstance(value, str):
        raise ConfigError(f"{dotted} must be a string, got {value!r} ({origin})")
    if option.minimum is not None and value < option.minimum:
        raise ConfigError(f"{dotted} must be at least {option.minimum}, got {value!r} ({origin})")
    if option.choices is not None and value not in option.choices:
        choices = ", ".join(repr(c) for c in option.choices)
        raise ConfigError(f"{dotted} must be one of {choices}, got {value!r} ({origin})")
    return value
