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

Memory beyond weights and stashes: ``backward_workspace_bytes`` is held on a
worker for as long as each of its backward passes of the stage runs, and
``optimizer_bytes`` by each weight worker of the stage for the whole step
(:mod:`unisched.memory`).

Tied weights: a weight several stages hold a copy of (GPT-2 ties its head to
its embedding; ``split_model`` gives each stage its copy) is one
:class:`TiedWeight` in ``tied_weights``.  Each copy counts in its stage's
``weight_bytes``; the step ends with an all-reduce of the copies' gradients
among the workers that hold them (:func:`unisched.dataflow.tie_holders`).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from unisched.errors import ShapeError, read_json
from unisched.work import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Direction

PerStage = float | Sequence[float]


@dataclass(frozen=True)
class Link:
    latency: float = 0.0
    bandwidth: float = math.inf


class TiedWeight(NamedTuple):
    """One weight of ``nbytes`` bytes that the ``stages`` (two or more, in
    order) each hold a copy of."""

    stages: tuple[int, ...]
    nbytes: float

    @classmethod
    def of(cls, value) -> "TiedWeight":
        """A TiedWeight from itself, a ``(stages, bytes)`` pair or a
        ``{"stages": [...], "bytes": n}`` object (a costs file's form)."""
        if isinstance(value, Mapping) and set(value) == {"stages", "bytes"}:
            value = (value["stages"], value["bytes"])
        try:
            given, nbytes = value
            given = list(given)
            stages = tuple(sorted({int(s) for s in given if not isinstance(s, bool) and int(s) == s}))
            if len(stages) != len(given) or len(stages) < 2 or stages[0] < 0:
                raise ValueError
        except (TypeError, ValueError, OverflowError):  # int(inf) overflows
            raise ShapeError(f"a tied weight is {{\"stages\": [two or more distinct stage indices], \"bytes\": n}}, "
                             f"got {value!r}") from None
        if not _is(nbytes, "number") or not _is_finite(nbytes) or nbytes < 0:
            raise ShapeError(f"the tied weight of stages {list(stages)} must have a finite size >= 0 in bytes, "
                             f"got {nbytes!r}")
        return cls(stages, float(nbytes))


@dataclass(frozen=True)
class Costs:
    forward: PerStage = 1.0
    backward: PerStage | None = None
    """A whole backward (default: the sum of the two halves when both are
    given, else 2); where the halves are given too, it must be their sum."""
    backward_input: PerStage | None = None
    """Input-gradient half of a split backward (default: what ``backward`` leaves beside the
    weight-gradient half where that one is given, else half of ``backward``)."""
    backward_weight: PerStage | None = None
    """Weight-gradient half of a split backward (default: what ``backward`` leaves beside the
    input-gradient half where that one is given, else half of ``backward``)."""
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
    backward_workspace_bytes: PerStage = 0.0
    """Bytes a backward pass (or either half of a split one) of the stage
    holds only while it runs: a parameter's fresh gradient before it is
    added to the accumulated one, the gradients of the stage's activations."""
    optimizer_bytes: PerStage = 0.0
    """Bytes of the stage's optimizer state (Adam's two moments: twice
    ``weight_bytes``; plain SGD: none), held by each of its weight workers."""
    tied_weights: Sequence[TiedWeight] = ()
    """Weights that several stages hold copies of (:class:`TiedWeight`), whose
    gradients are all-reduced among the copies' holders at the end of a step."""

    def __post_init__(self):
        self._whole_backward()
        for name in PER_STAGE_FIELDS:
            value = getattr(self, name)
            if value is None and name in _DEFAULTED:
                continue
            check_per_stage(name, value)
        if self.worker_speed is not None:
            speeds = None if _is(self.worker_speed, "number") else _numbers(self.worker_speed)
            if speeds is None or not all(math.isfinite(v) and v > 0 for v in speeds):
                raise ShapeError(
                    f"Costs.worker_speed must be a list of positive numbers, one per worker, got {self.worker_speed!r}"
                )
        for name, kind in (("latency", "number"), ("bandwidth", "number"), ("input_grad_frees", "number"),
                           ("prefetch_depth", "integer"), ("cache_weights", "boolean")):
            if not _is(getattr(self, name), kind):
                article = "an" if kind == "integer" else "a"
                raise ShapeError(f"Costs.{name} must be {article} {kind}, got {getattr(self, name)!r}")
        _check_link("Costs.", self.latency, self.bandwidth)
        if not 0 <= self.input_grad_frees <= 1:
            raise ShapeError(f"Costs.input_grad_frees must lie in [0, 1], got {self.input_grad_frees}")
        if self.prefetch_depth < 0:
            raise ShapeError(f"Costs.prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if not isinstance(self.links, Mapping):
            raise ShapeError(f"Costs.links must map 'src,dst' to {{latency, bandwidth}}, got {self.links!r}")
        links = {}
        for pair, link in dict(self.links).items():
            src, dst = _pair(pair)
            if not isinstance(link, Link):
                try:
                    link = dict(link)
                    if "bandwidth" in link and link["bandwidth"] is None:
                        link["bandwidth"] = math.inf
                    link = Link(**link)
                except (TypeError, ValueError):
                    raise ShapeError(
                        f"Costs.links[{pair!r}] must be {{'latency': seconds, 'bandwidth': bytes/s}}, got {link!r}"
                    ) from None
            elif link.bandwidth is None:
                link = Link(link.latency, math.inf)
            _check_link(f"Costs.links[{src},{dst}].", link.latency, link.bandwidth)
            links[(src, dst)] = link
        object.__setattr__(self, "links", links)
        if isinstance(self.tied_weights, (str, Mapping)) or not isinstance(self.tied_weights, Sequence):
            raise ShapeError(f"Costs.tied_weights must be a list of tied weights, got {self.tied_weights!r}")
        object.__setattr__(self, "tied_weights", tuple(TiedWeight.of(t) for t in self.tied_weights))

    def _whole_backward(self) -> None:
        """The whole backward and its halves describe one pass: a whole left out is
        the halves' sum (or 2), a whole given beside both halves must equal it, and
        one half given leaves the other what remains of the whole (given, or 2)."""
        halves = self.backward_input, self.backward_weight
        if all(h is None for h in halves):
            if self.backward is None:
                object.__setattr__(self, "backward", 2.0)
            return
        if any(h is None for h in halves):
            name, other = ("backward_input", "backward_weight")[::1 if halves[1] is None else -1]
            half = getattr(self, name)
            whole = 2.0 if self.backward is None else self.backward
            for field_name, value in ((name, half), ("backward", whole)):
                check_per_stage(field_name, value)
            _same_length("backward", whole, name, half)
            rest = np.asarray(whole, dtype=float) - np.asarray(half, dtype=float)
            if np.any(rest < -1e-9 * np.maximum(1.0, np.abs(whole))):
                raise ShapeError(f"Costs.backward {whole!r} is shorter than its half {name} {half!r}: give both "
                                 "halves, or a backward at least as long as the half you give")
            rest = np.maximum(rest, 0.0)  # round-off of a half that is the whole
            object.__setattr__(self, other, float(rest) if rest.ndim == 0 else rest.tolist())
            object.__setattr__(self, "backward", whole)
            return
        for name, value in zip(("backward_input", "backward_weight"), halves):
            check_per_stage(name, value)
        _same_length("backward_input", halves[0], "backward_weight", halves[1])
        total = np.add(*(np.asarray(h, dtype=float) for h in halves))
        if self.backward is None:
            object.__setattr__(self, "backward", float(total) if total.ndim == 0 else total.tolist())
            return
        check_per_stage("backward", self.backward)
        whole = np.asarray(self.backward, dtype=float)
        if np.shape(whole) == np.shape(total) or 0 in (whole.ndim, total.ndim):
            if np.allclose(whole, total, rtol=1e-9, atol=0.0):
                return
        raise ShapeError(
            f"Costs.backward {self.backward!r} is not backward_input + backward_weight "
            f"({self.backward_input!r} + {self.backward_weight!r}): a split backward is the whole one in two "
            "halves; leave backward out (it is then their sum) or give halves that add up to it")

    def with_times(self, forward: PerStage | None = None, backward: PerStage | None = None,
                   backward_input: PerStage | None = None, backward_weight: PerStage | None = None) -> "Costs":
        """These costs with the pass times given (None: keep) put in, the backward kept one
        pass: both halves given make the whole their sum (or must add up to a whole given);
        one half given leaves the other what remains of the whole (given, or these costs');
        a whole given alone drops these costs' halves (each is then half of it)."""
        changes = {} if forward is None else {"forward": forward}
        halves = {name: value for name, value in (("backward_input", backward_input),
                                                  ("backward_weight", backward_weight)) if value is not None}
        if len(halves) == 1:  # the other half is what the whole leaves (the rule of __post_init__)
            other = "backward_weight" if "backward_input" in halves else "backward_input"
            changes.update(halves, **{other: None}, backward=self.backward if backward is None else backward)
        elif halves:
            changes.update(halves, backward=backward)  # None: their sum
        elif backward is not None:
            changes.update(backward=backward, backward_input=None, backward_weight=None)
        return replace(self, **changes) if changes else self

    def check(self, num_workers: int, num_stages: int) -> "Costs":
        """Check that these costs describe a step of ``num_stages`` stages on
        ``num_workers`` workers: one entry per stage where a list is given, one
        speed per worker, links only between existing workers, and times that
        add up to a finite step.  Returns the costs."""
        for name in PER_STAGE_FIELDS:
            self.per_stage(name, num_stages)
        speeds = self.speeds(num_workers)
        for src, dst in self.links:
            if src >= num_workers or dst >= num_workers:
                raise ShapeError(
                    f"Costs.links names the link {src},{dst} but there are {num_workers} workers "
                    f"(0..{num_workers - 1}); drop the link or give the costs of this world size"
                )
        for tie in self.tied_weights:
            if tie.stages[-1] >= num_stages:
                raise ShapeError(
                    f"Costs.tied_weights names stages {list(tie.stages)} but there are {num_stages} stages "
                    f"(0..{num_stages - 1}); give the costs of this model's split"
                )
        hops = [self.link(src, dst) for src, dst in self.links] + [Link(self.latency, self.bandwidth)]
        passes = np.concatenate([np.ravel(d) for d in self.durations(num_stages).values()])
        sizes = np.concatenate([np.ravel(self.per_stage(name, num_stages))
                                for name in ("activation_bytes", "stash_bytes", "weight_bytes")])
        with np.errstate(over="ignore", invalid="ignore"):
            work = passes.sum() / speeds.min(initial=np.inf)
            hop = max(h.latency for h in hops) + sizes.max(initial=0.0) / min(h.bandwidth for h in hops)
            total = np.float64(work) + np.float64(hop) * (4.0 * num_stages)
            if not total <= LARGEST_STEP:
                raise ShapeError(
                    f"the costs are too large to add up: one micro-batch's passes and transfers take {total:.3g}, "
                    f"more than {LARGEST_STEP:g} (a step of many micro-batches would overflow a float); give the "
                    "times, sizes and speeds in units that keep them far smaller"
                )
            moves = sizes / max(h.bandwidth for h in hops)
            durations = np.concatenate([passes / speeds.max(), moves, [h.latency for h in hops]])
            shortest = np.min(durations[durations > 0], initial=np.inf)
            if shortest < SMALLEST_TIME:
                raise ShapeError(
                    f"the costs are too small to measure: a pass or transfer takes {shortest:.3g}, less than "
                    f"{SMALLEST_TIME:g} (its schedule could not be drawn or planned in whole ticks); give the times, "
                    "sizes and speeds in units that keep them far larger"
                )
        return self

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
    def moves_bytes(self) -> bool:
        """Whether any transfer carries bytes (else bandwidths play no part)."""
        stash = 0.0 if self.stash_bytes is None else self.stash_bytes
        return any(bool(np.any(np.asarray(value) > 0)) for value in (self.activation_bytes, stash, self.weight_bytes))

    @property
    def has_communication(self) -> bool:
        """Whether any transfer can take time (else the engine skips link bookkeeping)."""
        return bool(self.latency > 0 or (self.moves_bytes and math.isfinite(self.bandwidth)) or self.links)

    @property
    def times_halves(self) -> bool:
        """Whether the costs time the backward's halves (``backward_input`` or ``backward_weight``
        given): a step with them splits its backward unless told otherwise."""
        return self.backward_input is not None or self.backward_weight is not None

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
        data["tied_weights"] = [{"stages": list(t.stages), "bytes": t.nbytes} for t in self.tied_weights]
        return _finite(data)

    @classmethod
    def from_dict(cls, data: Mapping) -> "Costs":
        """Costs from :meth:`to_dict`'s form.  A dict with the fields of a
        kind of Costs defined elsewhere (a :class:`~unisched.topology.ClusterCosts`'
        ``topology``) is read as that kind, so a file can carry a cluster."""
        if not isinstance(data, Mapping):
            raise ShapeError(f"costs must be given as an object of fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            wider = [kind for kind in _kinds_of(cls) if set(data) <= {f.name for f in fields(kind)}]
            if wider:
                return wider[0].from_dict(data)
            raise ShapeError(f"unknown cost field(s) {unknown}; known fields are {sorted(known)}")
        data = dict(data)
        if data.get("bandwidth", 0) is None:
            data["bandwidth"] = math.inf
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path) -> "Costs":
        """Read a JSON costs file (the fields of this class; ``links`` keyed "src,dst")."""
        data = read_json(path, "costs file", 'write a JSON object of the fields of unisched.Costs, e.g. '
                         '{"forward": 1, "backward": 2}', ShapeError)
        if not isinstance(data, dict):
            raise ShapeError(f"costs file {path} must hold a JSON object")
        named = data.get("topology")
        if isinstance(named, str) and (Path(path).parent / named).is_file():  # a file beside it, not a preset
            data["topology"] = str(Path(path).parent / named)
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as error:
            raise ShapeError(f"costs file {path}: {error}") from error

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _same_length(name: str, value: PerStage, other_name: str, other: PerStage) -> None:
    """Two per-stage fields given as lists must give one entry per stage alike."""
    if np.ndim(value) and np.ndim(other) and np.shape(value) != np.shape(other):
        raise ShapeError(f"Costs.{name} has {np.shape(value)[0]} entries but Costs.{other_name} has "
                         f"{np.shape(other)[0]}: give both per stage, one entry for each stage")


def _kinds_of(cls: type) -> list[type]:
    """The subclasses of ``cls`` that are loaded, nearest first."""
    found = list(cls.__subclasses__())
    for kind in list(found):
        found += _kinds_of(kind)
    return found


LARGEST_STEP = 1e290
"""The most one micro-batch's passes and transfers may add up to: far below
the largest float, so that a step's latency and its measures stay finite."""

SMALLEST_TIME = 1e-290
"""The least a pass or transfer that takes any time may take: far above the smallest float, so
that a diagram's characters per time unit and a plan's ticks stay finite."""

PER_STAGE_FIELDS = ("forward", "backward", "backward_input", "backward_weight", "activation_bytes", "stash_bytes",
                    "weight_bytes", "backward_workspace_bytes", "optimizer_bytes")
_DEFAULTED = ("backward_input", "backward_weight", "stash_bytes")
"""Per-stage fields whose None means a default derived from another field."""


def _numbers(value) -> list[float] | None:
    """The numbers in a number or a flat list of numbers, else None (strings, None, booleans, nesting)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
    if _is(value, "number"):
        items = [value]
    elif isinstance(value, (str, bytes, Mapping)) or value is None:
        return None
    else:
        try:
            items = list(value)
        except TypeError:
            return None
    if not all(_is(v, "number") for v in items):
        return None
    try:
        return [float(v) for v in items]
    except OverflowError:  # an integer beyond float range
        return [math.inf]


def check_per_stage(name: str, value) -> None:
    """Refuse a per-stage cost field that is not a finite number >= 0 or a flat list of them."""
    numbers = _numbers(value)
    if numbers is None or not all(math.isfinite(v) and v >= 0 for v in numbers):
        raise ShapeError(
            f"Costs.{name} must be a finite non-negative number or a list of them (one per stage), got {value!r}"
        )


def _check_link(where: str, latency, bandwidth) -> None:
    """A latency is a finite time >= 0; a bandwidth a number > 0 (infinity: free)."""
    if not _is(latency, "number") or not (_is_finite(latency) and latency >= 0):
        raise ShapeError(f"{where}latency must be a finite number >= 0 (seconds), got {latency!r}")
    if not _is(bandwidth, "number") or not bandwidth > 0 or not _is_float(bandwidth):  # NaN is not > 0
        raise ShapeError(f"{where}bandwidth must be a number > 0 (bytes per second; null or inf: free), "
                         f"got {bandwidth!r}")


def _is_finite(value) -> bool:
    """math.isfinite, for integers beyond float range too (they are not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _is_float(value) -> bool:
    """Whether a number fits a float (an integer of 400 digits does not)."""
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _pair(pair) -> tuple[int, int]:
    """A link's key: (src, dst) or "src,dst", two worker numbers >= 0."""
    parts = pair.split(",") if isinstance(pair, str) else pair
    try:
        src, dst = parts
        if isinstance(pair, str):
            src, dst = int(src), int(dst)
        if not (_is(src, "integer") and _is(dst, "integer")) or src < 0 or dst < 0:
            raise ValueError
    except (TypeError, ValueError):
        raise ShapeError(f"Costs.links keys must be (src, dst) worker pairs or 'src,dst' strings, got {pair!r}") from None
    return int(src), int(dst)


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
