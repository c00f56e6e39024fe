"""The network model: how long every transfer of a training step takes.

This module is the one place where a transfer's time is computed (DESIGN.md
§5).  The simulator books transfers with it and the planner prices its CP-SAT
model with it, so a plan and its replay agree on what communication costs.

Links
    Each ordered pair of workers (src, dst) has a :class:`~unisched.costs.Link`
    (``Costs.link``): a latency and a bandwidth, the costs' defaults unless
    ``Costs.links`` overrides the pair.

Point to point
    Moving ``nbytes`` from src to dst takes ``latency + nbytes / bandwidth``
    of their link; nothing moves, and no time passes, when src == dst.
    Activations, gradients, stashes, weight fetches and weight-gradient
    returns are all point-to-point transfers.

Ring all-reduce
    k replicas of a stage reduce its gradient around the ring
    ``members[0] -> members[1] -> ... -> members[0]``: 2(k-1) steps, each
    moving 1/k of the data over every hop at once, so each step is as slow as
    the ring's slowest hop (its largest latency, its smallest bandwidth).

Tensor-parallel collective
    A gang of workers that computes one item jointly exchanges the stage's
    activation with the same ring all-reduce; it has its own name so that a
    better model of it changes one function.

Contention (transfers queueing on a busy link) is not modelled here: it
depends on what else is in flight, which only the simulator knows; it books
the serialisation part of :func:`link_times` on its link calendars.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from unisched.costs import Costs
from unisched.errors import ShapeError


def transfer_time(costs: Costs, src: int, dst: int, nbytes):
    """Time to move ``nbytes`` (a number or an array) from worker src to dst."""
    if src == dst:
        return np.zeros_like(np.asarray(nbytes, dtype=float)) if np.ndim(nbytes) else 0.0
    latency, serialisation = link_times(costs, src, dst, nbytes)
    return latency + serialisation


def link_times(costs: Costs, src: int, dst: int, nbytes) -> tuple:
    """The two parts of a transfer from src to dst (src != dst): the link's
    latency, and the time ``nbytes`` occupy the link (what queues transfers
    on a busy link, which the simulator books)."""
    link = costs.link(src, dst)
    return link.latency, nbytes / link.bandwidth


class LinkTable:
    """:func:`link_times` for many transfers: each link is looked up once, on
    its first transfer (the simulator calls it once per transfer; a table of
    every pair would be W² entries on a large cluster)."""

    def __init__(self, costs: Costs):
        self._costs = costs
        self._links: dict[tuple[int, int], tuple[float, float]] = {}

    def times(self, src: int, dst: int, nbytes: float) -> tuple[float, float]:
        """(latency, serialisation) of ``nbytes`` from src to dst, as :func:`link_times`."""
        link = self._links.get((src, dst))
        if link is None:
            found = self._costs.link(src, dst)
            link = self._links[(src, dst)] = (found.latency, found.bandwidth)
        return link[0], nbytes / link[1]


def ring_allreduce_time(costs: Costs, members: Sequence[int], nbytes):
    """Time of a ring all-reduce of ``nbytes`` (a number or an array) among
    ``members``, in ring order: 2(k-1) steps of 1/k of the data, each as slow
    as the ring's slowest hop."""
    members = [int(m) for m in members]
    k = len(members)
    if k == 0:
        raise ShapeError("a ring all-reduce needs at least one worker; got an empty list of members")
    hops = [costs.link(a, b) for a, b in zip(members, (*members[1:], members[0]))]
    latency = max(h.latency for h in hops)
    bandwidth = min(h.bandwidth for h in hops)
    return 2 * (k - 1) * latency + 2 * (k - 1) / k * np.asarray(nbytes) / bandwidth


def tensor_parallel_time(costs: Costs, members: Sequence[int], nbytes):
    """Time a gang of ``members`` spends exchanging ``nbytes`` of a stage's
    activation per item it computes jointly (modelled as a ring all-reduce)."""
    return ring_allreduce_time(costs, members, nbytes)


# ---------------------------------------------------------------------- vectorised forms
def link_arrays(costs: Costs, num_workers: int) -> tuple[np.ndarray, np.ndarray]:
    """(latency, bandwidth) of every link, as two (W, W) arrays indexed [src, dst]."""
    latency = np.full((num_workers, num_workers), float(costs.latency))
    bandwidth = np.full((num_workers, num_workers), float(costs.bandwidth))
    for (src, dst), link in costs.links.items():
        if 0 <= src < num_workers and 0 <= dst < num_workers:
            latency[src, dst] = link.latency
            bandwidth[src, dst] = link.bandwidth
    return latency, bandwidth


def transfer_matrix(costs: Costs, num_workers: int, nbytes) -> np.ndarray:
    """Point-to-point times for every (src, dst) pair and every size in
    ``nbytes`` (e.g. one per stage): a (W, W, len(nbytes)) array, zero on the
    diagonal, equal entry by entry to :func:`transfer_time`."""
    sizes = np.atleast_1d(np.asarray(nbytes, dtype=float))
    if sizes.ndim != 1:
        raise ShapeError(f"transfer_matrix takes one size per column (a 1-d list), got shape {sizes.shape}")
    latency, bandwidth = link_arrays(costs, num_workers)
    times = latency[:, :, None] + sizes[None, None, :] / bandwidth[:, :, None]
    times[np.arange(num_workers), np.arange(num_workers)] = 0.0
    return times


__all__ = [
    "LinkTable",
    "link_arrays",
    "link_times",
    "ring_allreduce_time",
    "tensor_parallel_time",
    "transfer_matrix",
    "transfer_time",
]
