"""The unified scheme's vocabulary: work items, the two workers a strategy picks
for each, and the stage graph.

One training step over B micro-batches of an S-stage network is the set of
work items ``Work(batch, stage, direction)``.  A *strategy* maps each item to a
:class:`ComputeAndWeightWorkers` pair; everything else (transfers, memory,
traffic) follows from that pair and the data flow of :mod:`unisched.dataflow`.

``Work`` is a ``NamedTuple``, so ``Work(3, 1, Direction.BACKWARD)`` and
``Work(batch=3, stage=1, direction=Direction.BACKWARD)`` are the same item, and
``work.batch``, ``work.stage``, ``work.direction`` read it back.
"""

from __future__ import annotations

import enum
import functools
import numbers
from typing import NamedTuple

import networkx as nx

from unisched.errors import ShapeError


class Direction(enum.IntEnum):
    """Which pass over a stage a work item is.

    With a *split backward* (zero-bubble pipelines) the backward pass is two
    items: BACKWARD_INPUT computes the gradient with respect to the stage's
    input (it is on the critical path), BACKWARD_WEIGHT the gradient with
    respect to its weights (it can be delayed to fill bubbles).
    """

    FORWARD = 0
    BACKWARD = 1
    BACKWARD_INPUT = 2
    BACKWARD_WEIGHT = 3

    @property
    def letter(self) -> str:
        """One-letter label used in diagrams and compact action strings."""
        return "FBIW"[self]

    @classmethod
    def from_letter(cls, letter: str) -> "Direction":
        try:
            return cls("FBIW".index(letter.upper()))
        except ValueError:
            raise ValueError(f"unknown direction letter {letter!r}; use one of F, B, I, W") from None


FORWARD = Direction.FORWARD
BACKWARD = Direction.BACKWARD
BACKWARD_INPUT = Direction.BACKWARD_INPUT
BACKWARD_WEIGHT = Direction.BACKWARD_WEIGHT


class Work(NamedTuple):
    """One pass of one micro-batch over one stage."""

    batch: int
    stage: int
    direction: Direction = Direction.FORWARD

    def __str__(self) -> str:
        return f"{self.stage}{Direction(self.direction).letter}{self.batch}"

    @classmethod
    def parse(cls, text: str) -> "Work":
        """Inverse of ``str``: ``"2F0"`` is stage 2, forward, micro-batch 0."""
        for index, char in enumerate(text):
            if char.isalpha():
                return cls(int(text[index + 1 :]), int(text[:index]), Direction.from_letter(char))
        raise ValueError(f"cannot parse work item {text!r}; expected e.g. '2F0' (stage, direction, batch)")


class ComputeAndWeightWorkers(NamedTuple):
    """What a strategy returns for a work item: who computes it, and who holds
    the source of truth of its stage's weights for it."""

    compute_worker: int
    weight_worker: int


class Shape(NamedTuple):
    """The size of one training step: workers, pipeline stages, micro-batches."""

    num_workers: int
    num_stages: int
    num_batches: int

    def check(self) -> "Shape":
        """This shape, each count a positive integer (a numpy integer taken as a Python one)."""
        return Shape(*(positive_count(name, value) for name, value in zip(self._fields, self)))


def is_whole(value, least: int | None = 1) -> bool:
    """Whether ``value`` is an integer (a numpy one too, but not a bool) of at least ``least``
    (None: any)."""
    integer = not isinstance(value, bool) and isinstance(value, numbers.Integral)  # numpy's bool is no Integral
    return integer and (least is None or value >= least)


def is_real(value) -> bool:
    """Whether ``value`` is a real number (a numpy one too, but not a bool); its range is the
    caller's to check."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def name_key(text: str) -> str:
    """A name as given (a strategy, a priority, a parameter's value) as it is looked up and compared:
    without surrounding spaces and one pair of quotes, dashes as underscores, in lower case
    (``"'Backward-First'"`` -> ``backward_first``)."""
    return unquoted(text).replace("-", "_").lower()


def unquoted(text: str) -> str:
    """``text`` without surrounding spaces and one pair of matching quotes around the rest."""
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def positive_count(name: str, value, where: str = "") -> int:
    """``value`` as a positive Python integer (a numpy one taken as such), or an error naming it
    (after ``where``, e.g. the function it was given to)."""
    if not is_whole(value):
        raise ShapeError(f"{where}{name} must be a positive integer, got {value!r}")
    return int(value)


def backward_directions(split_backward: bool) -> tuple[Direction, ...]:
    return (BACKWARD_INPUT, BACKWARD_WEIGHT) if split_backward else (BACKWARD,)


def directions(split_backward: bool) -> tuple[Direction, ...]:
    return (FORWARD, *backward_directions(split_backward))


class StageGraph:
    """The stages of a model and which feeds which.

    A chain (the default) is stage 0 -> 1 -> ... -> S-1.  A general DAG, given
    as a ``networkx.DiGraph`` on the nodes ``0..S-1``, lets e.g. two encoder
    legs feed one decoder: a forward waits for the forwards of all its
    predecessor stages, a backward for the backwards of all its successors.
    """

    def __init__(self, num_stages: int, graph: nx.DiGraph | None = None):
        if graph is None:
            graph = nx.path_graph(num_stages, create_using=nx.DiGraph)
        if not isinstance(graph, nx.DiGraph) or graph.is_multigraph():
            raise TypeError(f"stage_graph must be a networkx.DiGraph on the stages 0..{num_stages - 1} (no edge twice) "
                            f"or a StageGraph, got {type(graph).__name__}: e.g. networkx.DiGraph([(0, 2), (1, 2)])")
        if not all(is_whole(s, None) for s in graph.nodes):
            raise ShapeError(f"stage_graph's nodes must be the stage numbers 0..{num_stages - 1}, got "
                             f"{sorted(graph.nodes, key=repr)}")
        nodes = set(graph.nodes)
        if nodes != set(range(num_stages)):
            missing = sorted(set(range(num_stages)) - nodes)
            extra = sorted(nodes - set(range(num_stages)), key=repr)
            raise ShapeError(
                f"stage_graph must have exactly the nodes 0..{num_stages - 1}; "
                f"missing {missing}, unexpected {extra}"
            )
        if not nx.is_directed_acyclic_graph(graph):
            cycle = nx.find_cycle(graph)
            raise ShapeError(f"stage_graph has a cycle {cycle}; stages must form a DAG")
        self.num_stages = num_stages
        self.graph = graph
        self.predecessors = tuple(tuple(sorted(graph.predecessors(s))) for s in range(num_stages))
        self.successors = tuple(tuple(sorted(graph.successors(s))) for s in range(num_stages))
        self.is_chain = all(p == ((s - 1,) if s else ()) for s, p in enumerate(self.predecessors))

    @property
    def sources(self) -> tuple[int, ...]:
        return tuple(s for s in range(self.num_stages) if not self.predecessors[s])

    @property
    def sinks(self) -> tuple[int, ...]:
        return tuple(s for s in range(self.num_stages) if not self.successors[s])


def as_stage_graph(num_stages: int, stage_graph: StageGraph | nx.DiGraph | None) -> StageGraph:
    if isinstance(stage_graph, StageGraph):
        if stage_graph.num_stages != num_stages:
            raise ShapeError(f"stage_graph has {stage_graph.num_stages} stages but the model has {num_stages}")
        return stage_graph
    if stage_graph is None:
        return chain(num_stages)
    return StageGraph(num_stages, stage_graph)


@functools.lru_cache(maxsize=64)
def chain(num_stages: int) -> StageGraph:
    """The chain 0 -> 1 -> ... -> S-1, built once per length."""
    return StageGraph(num_stages)
