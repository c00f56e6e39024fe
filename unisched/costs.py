"""Costs: how long work takes, how big the data is, and how fast it moves.

The default is the paper's model: a forward takes 1, a backward 2, and
communication is free.  Everything can be given per stage (a sequence of S
numbers) or as one number for all stages.

Communication: a transfer of ``n`` bytes from worker a to worker b takes
``latency + n / bandwidth`` and occupies the link (a, b) for ``n / bandwidth``;
transfers on one link do not overlap: each takes the first gap long enough at
or after the time it is ready.
``links`` overrides latency and bandwidth for given (src, dst) pairs.

Weights: an item whose weight worker is not its compute worker fetches the
stage's weights (``weight_bytes``).  With ``prefetch_depth`` d >= 1 the fetch
may start while the worker runs its d previous items; with 0 it starts when
the item is chosen.  With ``cache_weights`` a worker keeps a fetched stage for
the rest of the step (forward and backward share one fetch) and returns its
accumulated gradient once, after its last backward of that stage; without, it
fetches for every item and returns every backward's gradient.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from unisched.errors import ShapeError
from unisched.work import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Direction

PerStage = float | Sequence[float]


@dataclass(frozen=True)
class Link:
    latency: float = 0.0
    bandwidth: float = math.inf


@dataclass(frozen=True)
class Costs:
    forward: PerStage = 1.0
    backward: PerStage = 2.0
    backward_input: PerStage | None = None
    """Input-gradient half of a split backward (default: half of ``backward``)."""
    backward_weight: PerStage | None = None
    """Weight-gradient half of a split backward (default: half of ``backward``)."""
    worker_speed: Sequence[float] | None = None
    """Relative speed per worker: a duration on worker w is divided by speed[w]."""
    activation_bytes: PerStage = 0.0
    """Bytes of a stage's input: what flows into it (and back as a gradient)."""
    stash_bytes: PerStage | None = None
    """Bytes a forward keeps for its backward (default: ``activation_bytes``,
    i.e. recompute from the input; without recompute, add the stage's
    internal activations)."""
    weight_bytes: PerStage = 0.0
    latency: float = 0.0
    bandwidth: float = math.inf
    links: Mapping[tuple[int, int], Link] = field(default_factory=dict)
    prefetch_depth: int = 1
    cache_weights: bool = True
    input_grad_frees: float = 0.5
    """Share of a stash freed by the input-gradient pass of a split backward."""

    def __post_init__(self):
        for name in ("forward", "backward", "backward_input", "backward_weight", "activation_bytes", "stash_bytes",
                     "weight_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            array = np.asarray(value, dtype=float)
            if array.ndim > 1 or np.any(array < 0) or np.any(~np.isfinite(array)):
                raise ShapeError(f"Costs.{name} must be a non-negative number or a list of them, got {value!r}")
        for name, kind in (("latency", "number"), ("bandwidth", "number"), ("input_grad_frees", "number"),
                           ("prefetch_depth", "integer"), ("cache_weights", "boolean")):
            if not _is(getattr(self, name), kind):
                article = "an" if kind == "integer" else "a"
                raise ShapeError(f"Costs.{name} must be {article} {kind}, got {getattr(self, name)!r}")
        for name in ("forward", "backward", "backward_input", "backward_weight", "activation_bytes", "stash_bytes",
                     "weight_bytes"):
            value = getattr(self, name)
            if value is not None and not all(_is(v, "number") for v in np.ravel(np.asarray(value, dtype=object))):
                raise ShapeError(f"Costs.{name} must be a number or a list of numbers, got {value!r}")
        if self.worker_speed is not None and np.any(np.asarray(self.worker_speed, dtype=float) <= 0):
            raise ShapeError(f"Costs.worker_speed must be positive, got {self.worker_speed!r}")
        if self.latency < 0 or self.bandwidth <= 0:
            raise ShapeError("Costs.latency must be >= 0 and Costs.bandwidth > 0")
        if not 0 <= self.input_grad_frees <= 1:
            raise ShapeError(f"Costs.input_grad_frees must lie in [0, 1], got {self.input_grad_frees}")
        if self.prefetch_depth < 0:
            raise ShapeError(f"Costs.prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if not isinstance(self.links, Mapping):
            raise ShapeError(f"Costs.links must map 'src,dst' to {{latency, bandwidth}}, got {self.links!r}")
        links = {}
        for pair, link in dict(self.links).items():
            src, dst = (int(x) for x in (pair.split(",") if isinstance(pair, str) else pair))
            if not isinstance(link, Link):
                try:
                    link = dict(link)
                    if link.get("bandwidth", 0) is None:
                        link["bandwidth"] = math.inf
                    link = Link(**link)
                except (TypeError, ValueError):
                    raise ShapeError(
                        f"Costs.links[{pair!r}] must be {{'latency': seconds, 'bandwidth': bytes/s}}, got {link!r}"
                    ) from None
            links[(src, dst)] = link
        object.__setattr__(self, "links", links)

    # ------------------------------------------------------------------ per-stage views
    def per_stage(self, name: str, num_stages: int) -> np.ndarray:
        value = getattr(self, name)
        if value is None and name in ("backward_input", "backward_weight"):
            return self.per_stage("backward", num_stages) / 2
        if value is None and name == "stash_bytes":
            return self.per_stage("activation_bytes", num_stages)
        array = np.asarray(value, dtype=float)
        if array.ndim == 0:
            return np.full(num_stages, float(array))
        if len(array) != num_stages:
            raise ShapeError(f"Costs.{name} has {len(array)} entries but the model has {num_stages} stages")
        return array

    def durations(self, num_stages: int) -> dict[Direction, np.ndarray]:
        """Duration of each direction per stage, before worker speed."""
        return {
            FORWARD: self.per_stage("forward", num_stages),
            BACKWARD: self.per_stage("backward", num_stages),
            BACKWARD_INPUT: self.per_stage("backward_input", num_stages),
            BACKWARD_WEIGHT: self.per_stage("backward_weight", num_stages),
        }

    def item_time(self, stage, direction, worker, num_stages: int, num_workers: int) -> np.ndarray:
        """How long items take: their stage's duration for their pass, divided
        by their worker's speed.  The arguments broadcast, so a column of items
        against a row of workers gives every item's time on every worker."""
        durations = self.durations(num_stages)
        table = np.stack([durations[d] for d in Direction])
        return table[np.asarray(direction), np.asarray(stage)] / self.speeds(num_workers)[np.asarray(worker)]

    def speeds(self, num_workers: int) -> np.ndarray:
        if self.worker_speed is None:
            return np.ones(num_workers)
        speeds = np.asarray(self.worker_speed, dtype=float)
        if len(speeds) != num_workers:
            raise ShapeError(f"Costs.worker_speed has {len(speeds)} entries but there are {num_workers} workers")
        return speeds

    @property
    def has_communication(self) -> bool:
        """Whether any transfer can take time (else the engine skips link bookkeeping)."""
        sizes = any(
            np.any(np.asarray(value) > 0)
            for value in (self.activation_bytes, 0.0 if self.stash_bytes is None else self.stash_bytes, self.weight_bytes)
        )
        return bool(self.latency > 0 or (sizes and math.isfinite(self.bandwidth)) or self.links)

    @property
    def has_sizes(self) -> bool:
        """Whether memory is counted in bytes (else in stash units)."""
        stash = self.activation_bytes if self.stash_bytes is None else self.stash_bytes
        return bool(np.any(np.asarray(stash) > 0))

    def link(self, src: int, dst: int) -> Link:
        return self.links.get((src, dst)) or Link(self.latency, self.bandwidth)

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        data = asdict(self)
        data["links"] = {f"{s},{d}": _finite(asdict(link)) for (s, d), link in self.links.items()}
        return _finite(data)

    @classmethod
    def from_dict(cls, data: Mapping) -> "Costs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ShapeError(f"unknown cost field(s) {unknown}; known fields are {sorted(known)}")
        data = dict(data)
        if data.get("bandwidth", 0) is None:
            data["bandwidth"] = math.inf
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> "Costs":
        """Read a JSON costs file (the fields of this class; ``links`` keyed "src,dst")."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ShapeError(f"cannot read costs file {path}: {error}") from error
        if not isinstance(data, dict):
            raise ShapeError(f"costs file {path} must hold a JSON object")
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as error:
            raise ShapeError(f"costs file {path}: {error}") from error

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _is(value, kind: str) -> bool:
    """Type check for values read from JSON (where True is not a number)."""
    if kind == "boolean":
        return isinstance(value, (bool, np.bool_))
    if isinstance(value, (bool, np.bool_)):
        return False
    if kind == "integer":
        return isinstance(value, (int, np.integer))
    return isinstance(value, (int, float, np.integer, np.floating))


def _finite(data: dict) -> dict:
    """JSON has no infinity: an unlimited bandwidth is written as null."""
    return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in data.items()}


DEFAULT_COSTS = Costs()
