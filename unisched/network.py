"""The network model: how long every transfer of a training step takes.

This module is the one place where a transfer's time is computed.
The simulator books transfers with it and the planner prices its CP-SAT
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
    the ring's slowest hop (its largest latency, its smallest bandwidth):
    ``2(k-1) latency + 2(k-1)/k bytes / bandwidth``, NCCL's ring model (its
    "bus bandwidth" is the bandwidth here).

Tree all-reduce
    NCCL's (double binary) tree: a reduction up the tree and a broadcast
    down, pipelined, each rank sending and receiving about the whole buffer
    in each phase: ``2 ceil(log2 k) latency + 2 bytes / bandwidth``.  Fewer
    latency steps than the ring, a little more data.

Reduce-scatter and all-gather (ring)
    The two halves of the ring all-reduce, for fully sharded weights:
    ``(k-1) latency + (k-1)/k bytes / bandwidth`` each, ``bytes`` the whole
    (unsharded) buffer.

Tensor-parallel collective
    A gang of workers that computes one item jointly exchanges the stage's
    activation with an all-reduce; it has its own name so that a better
    model of it changes one function.

On a topology (:class:`unisched.topology.ClusterCosts`) a point-to-point
transfer takes its path's bottleneck (:meth:`Topology.route`) and a
collective the bus bandwidth and step latency of the links its members use
(:meth:`Topology.group_route`); the topology's ``collective`` says whether
all-reduces run as rings or trees.  Without one, the links of the costs
price everything as above and all-reduces are rings.

Contention (transfers queueing on a busy link) is not modelled here: it
depends on what else is in flight, which only the simulator knows; it books
the serialisation part of :func:`link_times` on its link calendars.
"""

from __future__ import annotations

import math
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
    k, latency, bandwidth = _group(costs, members)
    return 2 * (k - 1) * latency + 2 * (k - 1) / k * np.asarray(nbytes) / bandwidth


def tree_allreduce_time(costs: Costs, members: Sequence[int], nbytes):
    """Time of a tree all-reduce (NCCL's double binary tree) of ``nbytes``
    among ``members``: 2 ceil(log2 k) steps, about twice the buffer moved."""
    k, latency, bandwidth = _group(costs, members)
    if k < 2:
        return 0.0 * np.asarray(nbytes)
    return 2 * math.ceil(math.log2(k)) * latency + 2 * np.asarray(nbytes) / bandwidth


def reduce_scatter_time(costs: Costs, members: Sequence[int], nbytes):
    """Time of a ring reduce-scatter of a buffer of ``nbytes`` among ``members``
    (each ends with its 1/k of the sum): k-1 steps of 1/k of the data."""
    k, latency, bandwidth = _group(costs, members)
    return (k - 1) * latency + (k - 1) / k * np.asarray(nbytes) / bandwidth


def all_gather_time(costs: Costs, members: Sequence[int], nbytes):
    """Time of a ring all-gather of a buffer of ``nbytes`` (each member holding
    1/k of it) among ``members``: the same steps as a reduce-scatter."""
    return reduce_scatter_time(costs, members, nbytes)


def allreduce_time(costs: Costs, members: Sequence[int], nbytes):
    """An all-reduce as the cluster runs them: a tree where the topology says
    so, else a ring."""
    topology = getattr(costs, "topology", None)
    if topology is not None and topology.collective == "tree":
        return tree_allreduce_time(costs, members, nbytes)
    return ring_allreduce_time(costs, members, nbytes)


def tensor_parallel_time(costs: Costs, members: Sequence[int], nbytes):
    """Time a gang of ``members`` spends exchanging ``nbytes`` of a stage's
    activation per item it computes jointly (an all-reduce)."""
    return allreduce_time(costs, members, nbytes)


def _group(costs: Costs, members: Sequence[int]) -> tuple[int, float, float]:
    """(members, step latency, bandwidth) of a collective among ``members``."""
    members = np.asarray(members)
    k = len(members)
    if k == 0:
        raise ShapeError("a collective needs at least one worker; got an empty list of members")
    if not np.issubdtype(members.dtype, np.integer):
        raise ShapeError(f"a collective's members are worker numbers; got {members.tolist()!r}")
    topology = getattr(costs, "topology", None)
    if topology is not None:
        route = topology.group_route(members.tolist())
        return k, route.latency, route.bandwidth
    latency, bandwidth = pair_links(costs, members, np.roll(members, -1))  # the ring's hops, on arrays
    return k, float(latency.max()), float(bandwidth.min())


# ---------------------------------------------------------------------- vectorised forms
def pair_links(costs: Costs, src, dst) -> tuple[np.ndarray, np.ndarray]:
    """(latency, bandwidth) of the links of arrays of (src, dst) pairs, as
    ``Costs.link`` (or the topology's :meth:`~unisched.topology.Topology.route`) gives them."""
    src, dst = np.asarray(src), np.asarray(dst)
    topology = getattr(costs, "topology", None)
    if topology is not None:
        return topology.route_arrays(src, dst)
    latency = np.full(src.shape, float(costs.latency))
    bandwidth = np.full(src.shape, float(costs.bandwidth))
    for (a, b), link in costs.links.items():
        named = (src == a) & (dst == b)
        latency[named], bandwidth[named] = link.latency, link.bandwidth
    return latency, bandwidth


def link_arrays(costs: Costs, num_workers: int) -> tuple[np.ndarray, np.ndarray]:
    """(latency, bandwidth) of every link, as two (W, W) arrays indexed [src, dst]."""
    src, dst = np.indices((num_workers, num_workers))
    return pair_links(costs, src, dst)


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
    "all_gather_time",
    "allreduce_time",
    "reduce_scatter_time",
    "tree_allreduce_time",
    "link_arrays",
    "link_times",
    "pair_links",
    "ring_allreduce_time",
    "tensor_parallel_time",
    "transfer_matrix",
    "transfer_time",
]
