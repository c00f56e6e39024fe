"""A cluster as data: nodes of devices, a fabric inside each node, NICs, and
a fabric between the nodes.

A :class:`Topology` says which links a transfer between two devices uses and
how fast each is; :mod:`unisched.network` turns that into times (the path's
bottleneck for a point-to-point transfer, NCCL's cost models for
collectives) and the simulator books the links, so that transfers sharing a
link queue behind each other.

The model
    Devices are numbered node by node: device d sits on node
    ``d // devices_per_node``.  Inside a node every device has a port on a
    switched fabric (NVLink through NVSwitch): a transfer between two devices
    of a node uses the sender's out-port and the receiver's in-port, at
    ``intra_node.bandwidth`` (per direction).  Between nodes a transfer
    leaves through the sender's NIC and enters through the receiver's, at
    ``nic.bandwidth``: device i of a node uses NIC ``i * nics_per_node //
    devices_per_node``, so devices share a NIC when a node has fewer NICs
    than devices.  Nodes hang under leaf switches of ``nodes_per_switch``
    nodes; traffic between nodes under different switches crosses the
    switches' uplinks, which ``oversubscription`` (>= 1) thins: such a
    transfer runs at ``nic.bandwidth / oversubscription`` (each NIC's share
    of the uplinks when every NIC sends at once).  The uplinks are not a
    queue of their own.

File format (JSON; every number in bytes, bytes per second and seconds)::

    {
      "name": "dgx_h100",
      "description": "what the cluster is",
      "sources": {"intra_node.bandwidth": "where the number comes from", ...},
      "nodes": 2,                               (optional: as many as the workers fill)
      "devices_per_node": 8,
      "intra_node": {"bandwidth": 450e9, "latency": 2e-6},
      "nics_per_node": 8,
      "nic": {"bandwidth": 50e9},
      "inter_node": {"latency": 5e-6, "oversubscription": 1, "nodes_per_switch": 32},
      "collective": "ring"                      (or "tree": how all-reduces run)
    }

Presets live in ``unisched/topologies/`` and are named by file stem
(:func:`presets`).  :class:`ClusterCosts` is a :class:`~unisched.costs.Costs`
whose transfers the topology prices instead of ``latency``, ``bandwidth``
and ``links``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from unisched.costs import LARGEST_STEP, Costs, Link, PerStage, check_per_stage
from unisched.errors import ShapeError, read_json
from unisched.work import is_whole

PRESETS = Path(__file__).resolve().parent / "topologies"
COLLECTIVES = ("ring", "tree")


@dataclass(frozen=True)
class Fabric:
    """A kind of link: bytes per second per direction, and seconds per message."""

    bandwidth: float
    latency: float = 0.0


class Route(NamedTuple):
    """What a transfer or a collective uses: its links (("port_out", device),
    ("port_in", device), ("nic_out", node, nic), ("nic_in", node, nic)), the
    bandwidth it gets and the latency of one step."""

    links: tuple[tuple, ...]
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Topology:
    """A cluster: see the module docstring for the model and the file format."""

    devices_per_node: int
    intra_node: Fabric
    nics_per_node: int
    nic: Fabric
    inter_node_latency: float
    nodes: int | None = None
    oversubscription: float = 1.0
    nodes_per_switch: int | None = None
    collective: str = "ring"
    name: str = ""
    description: str = ""
    sources: Mapping[str, str] = field(default_factory=dict)

    # ------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, data: Mapping, where: str = "topology") -> "Topology":
        """A topology from the file format, every field checked (errors name it)."""
        if not isinstance(data, Mapping):
            raise ShapeError(f"{where} must be a JSON object with the fields of docs/topology.md, got {data!r}")
        known = {"name", "description", "sources", "nodes", "devices_per_node", "intra_node", "nics_per_node", "nic",
                 "inter_node", "collective"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ShapeError(f"{where}: unknown field(s) {unknown}; the fields are {sorted(known)}")
        intra = _section(data, "intra_node", where, ("bandwidth", "latency"), ())
        nic = _section(data, "nic", where, ("bandwidth",), ())
        inter = _section(data, "inter_node", where, ("latency",), ("oversubscription", "nodes_per_switch"))
        collective = data.get("collective", "ring")
        if collective not in COLLECTIVES:
            raise ShapeError(f"{where}: collective must be one of {list(COLLECTIVES)}, got {collective!r}")
        sources = data.get("sources", {})
        if not isinstance(sources, Mapping):
            raise ShapeError(f"{where}: sources must map a field to where its number comes from, got {sources!r}")
        topology = cls(
            devices_per_node=_count(data, "devices_per_node", where),
            intra_node=Fabric(_bandwidth(intra, "intra_node", where), _latency(intra, "intra_node", where)),
            nics_per_node=_count(data, "nics_per_node", where),
            nic=Fabric(_bandwidth(nic, "nic", where)),
            inter_node_latency=_latency(inter, "inter_node", where),
            nodes=_count(data, "nodes", where) if data.get("nodes") is not None else None,
            oversubscription=_oversubscription(inter, where),
            nodes_per_switch=_count(inter, "nodes_per_switch", f"{where}: inter_node")
            if inter.get("nodes_per_switch") is not None else None,
            collective=collective,
            name=str(data.get("name", "")),
            description=str(data.get("description", "")),
            sources=dict(sources),
        )
        return topology

    @classmethod
    def load(cls, source: "str | Path | Topology | Mapping") -> "Topology":
        """A topology from a preset name (:func:`presets`), a JSON file, a dict, or itself."""
        if isinstance(source, Topology):
            return source
        if isinstance(source, Mapping):
            return cls.from_dict(source)
        text = str(source)
        path = PRESETS / f"{text}.json" if text in presets() else Path(text)
        if not path.exists():
            raise ShapeError(
                f"no topology file {text!r} and no preset of that name; give a JSON file (docs/topology.md) "
                f"or one of the presets {presets()}"
            )
        data = read_json(path, "topology file", "write a JSON object of nodes, devices and links (docs/topology.md)",
                         ShapeError)
        return cls.from_dict(data, where=f"topology file {path}")

    def to_dict(self) -> dict:
        """The file format (what :meth:`from_dict` reads back)."""
        data = {
            "name": self.name,
            "description": self.description,
            "sources": dict(self.sources),
            "devices_per_node": self.devices_per_node,
            "intra_node": asdict(self.intra_node),
            "nics_per_node": self.nics_per_node,
            "nic": {"bandwidth": self.nic.bandwidth},
            "inter_node": {"latency": self.inter_node_latency, "oversubscription": self.oversubscription,
                           **({"nodes_per_switch": self.nodes_per_switch} if self.nodes_per_switch else {})},
            "collective": self.collective,
        }
        return {**data, "nodes": self.nodes} if self.nodes is not None else data

    # ------------------------------------------------------------------ size
    def sized(self, num_devices: int) -> "Topology":
        """This topology with as many nodes as ``num_devices`` fill, checked
        (:meth:`check`): a preset names a kind of node, a run says how many."""
        if self.nodes is not None:
            return self.check(num_devices)
        per_node = self.devices_per_node
        if num_devices % per_node and num_devices > per_node:
            raise ShapeError(
                f"{num_devices} workers do not fill whole nodes of devices_per_node={per_node} "
                f"({self.name or 'topology'}); use a multiple of {per_node} workers (or at most {per_node})"
            )
        nodes = max(1, num_devices // per_node)
        return self._replace(nodes=nodes, devices_per_node=min(per_node, num_devices)).check(num_devices)

    def check(self, num_devices: int) -> "Topology":
        """Refuse a topology whose device count is not ``num_devices``."""
        if self.nodes is None:
            raise ShapeError(f"{self._called} gives no nodes; "
                             "call sized(workers) or set \"nodes\"")
        if self.devices != num_devices:
            per_node = self.devices_per_node
            if num_devices % per_node == 0:
                fix = f"set \"nodes\" to {num_devices // per_node}, or leave it out to fit the workers"
            elif num_devices < per_node:
                fix = "leave \"nodes\" out: the workers then take part of one node"
            else:
                fix = f"use a multiple of {per_node} workers, or fewer than {per_node} without \"nodes\""
            raise ShapeError(
                f"{self._called} has nodes={self.nodes} x "
                f"devices_per_node={per_node} = {self.devices} devices but the step has {num_devices} workers; {fix}"
            )
        return self

    @property
    def _called(self) -> str:
        """How messages name this topology."""
        return f"topology {self.name!r}" if self.name else "the topology"

    def _replace(self, **changes) -> "Topology":
        from dataclasses import replace

        return replace(self, **changes)

    @property
    def devices(self) -> int:
        return (self.nodes or 0) * self.devices_per_node

    # ------------------------------------------------------------------ links
    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def nic_of(self, device: int) -> int:
        """The NIC (0..nics_per_node-1) a device sends and receives through."""
        return (device % self.devices_per_node) * self.nics_per_node // self.devices_per_node

    def switch_of(self, node: int) -> int:
        return node // self.nodes_per_switch if self.nodes_per_switch else 0

    def _nic_link(self, device: int, receive: bool) -> tuple:
        return ("nic_in" if receive else "nic_out", self.node_of(device), self.nic_of(device))

    def link_among(self, link: tuple, num_devices: int) -> bool:
        """Whether ``link`` (of a :class:`Route`) serves devices 0..num_devices-1:
        a port of one of them, or a NIC of one of their nodes."""
        if link[0].startswith("port"):
            return link[1] < num_devices
        return link[1] * self.devices_per_node < num_devices

    def route(self, src: int, dst: int) -> Route:
        """The links a transfer from device src to device dst uses (src != dst)."""
        latency, bandwidth = (float(v) for v in self.route_arrays(src, dst))
        if self.node_of(src) == self.node_of(dst):
            return Route((("port_out", src), ("port_in", dst)), bandwidth, latency)
        return Route((self._nic_link(src, False), self._nic_link(dst, True)), bandwidth, latency)

    def route_arrays(self, src, dst) -> tuple[np.ndarray, np.ndarray]:
        """(latency, bandwidth) of routes between arrays of devices: inside a
        node the fabric's, between nodes the NIC's, thinned by the
        oversubscription across leaf switches."""
        src_node, dst_node = np.asarray(src) // self.devices_per_node, np.asarray(dst) // self.devices_per_node
        same_node = src_node == dst_node
        crossing = self.switch_of(src_node) != self.switch_of(dst_node)
        inter = self.nic.bandwidth / np.where(crossing, self.oversubscription, 1.0)
        bandwidth = np.where(same_node, self.intra_node.bandwidth, inter)
        latency = np.where(same_node, self.intra_node.latency, self.inter_node_latency)
        return latency.astype(float), bandwidth.astype(float)

    def collective_links(self, members: Sequence[int], num_devices: int) -> tuple:
        """The links a collective among ``members`` books that serve devices
        0..num_devices-1 (replica 0's, where replicas repeat it on links of their own)."""
        return tuple(link for link in self.group_route(members).links if self.link_among(link, num_devices))

    def group_route(self, members: Sequence[int]) -> Route:
        """The links a collective among ``members`` uses, the bus bandwidth it
        gets and the latency of one of its steps, as NCCL lays it out: inside
        a node the members' NVLink ports; between nodes one channel per NIC
        the members of a node use, so a node's share is its members' distinct
        NICs times ``nic.bandwidth`` (thinned by the oversubscription when the
        members span switches)."""
        by_node: dict[int, list[int]] = {}
        for m in sorted({int(m) for m in members}):
            by_node.setdefault(self.node_of(m), []).append(m)
        links: list[tuple] = []
        bandwidth, latency = math.inf, 0.0
        if any(len(group) > 1 for group in by_node.values()):
            for group in by_node.values():
                links += [("port_out", m) for m in group] + [("port_in", m) for m in group]
            bandwidth, latency = self.intra_node.bandwidth, self.intra_node.latency
        if len(by_node) > 1:
            switches = {self.switch_of(node) for node in by_node}
            per_nic = self.nic.bandwidth / (self.oversubscription if len(switches) > 1 else 1.0)
            for group in by_node.values():
                nics = {self.nic_of(m): m for m in group}
                bandwidth = min(bandwidth, len(nics) * per_nic)
                links += [self._nic_link(m, receive) for m in nics.values() for receive in (False, True)]
            latency = self.inter_node_latency
        return Route(tuple(links), bandwidth, latency)


def presets() -> list[str]:
    """The names of the topologies shipped in ``unisched/topologies/``."""
    return sorted(p.stem for p in PRESETS.glob("*.json"))


# ---------------------------------------------------------------------- costs on a cluster
@dataclass(frozen=True)
class ClusterCosts(Costs):
    """Costs whose transfers a :class:`Topology` prices (``latency``,
    ``bandwidth`` and ``links`` are not used).  ``replicas`` > 1 says the step
    simulated is replica 0 of that many identical data-parallel replicas laid
    out one after another on the topology: the workers are devices
    0..W-1 and each stage's gradient is all-reduced with the same workers of
    every replica (exact when the replicas do not share links, see
    :func:`unisched.simulate.layout.simulate_layout`)."""

    topology: Any = None
    replicas: int = 1
    tensor_parallel_bytes: PerStage | None = None
    """Bytes a tensor-parallel gang all-reduces per pass of a stage (default:
    the stage's ``activation_bytes``; Megatron-LM's layer all-reduces twice in
    the forward and twice in the backward, so 2 x layers x activation)."""

    def __post_init__(self):
        super().__post_init__()
        if self.tensor_parallel_bytes is not None:
            check_per_stage("tensor_parallel_bytes", self.tensor_parallel_bytes)
        if self.topology is None:
            raise ShapeError("ClusterCosts needs a topology (a preset name, a JSON file or a Topology)")
        object.__setattr__(self, "topology", Topology.load(self.topology))
        if self.links:
            raise ShapeError("Costs.links and a topology both say how fast workers talk; drop links")
        if not is_whole(self.replicas):
            raise ShapeError(f"ClusterCosts.replicas must be an integer >= 1, got {self.replicas!r}")

    @classmethod
    def on(cls, costs: Costs, topology) -> "ClusterCosts":
        """``costs`` on a cluster (a preset name, a topology file, a dict or a
        Topology, read by :meth:`Topology.load`); it replaces a topology the
        costs carry (what ``--topology`` means beside a costs file)."""
        values = {f.name: getattr(costs, f.name) for f in fields(costs)}
        return cls(**{**values, "topology": topology})

    @classmethod
    def read(cls, path: str | None, times: Mapping[str, Any], topology=None) -> Costs:
        """What ``--costs``, the time flags and ``--topology`` say, as every
        command reads them: the costs file (or the defaults) with ``times``
        put in (:meth:`Costs.with_times`), on ``topology`` when given (it
        replaces a file's)."""
        costs = (Costs.load(path) if path else Costs()).with_times(**times)
        return cls.on(costs, topology) if topology else costs

    def check(self, num_workers: int, num_stages: int) -> "ClusterCosts":
        super().check(num_workers, num_stages)
        self.cluster(num_workers)
        return self

    def tensor_parallel_sizes(self, num_stages: int):
        """Per stage: the bytes a gang all-reduces per pass."""
        name = "activation_bytes" if self.tensor_parallel_bytes is None else "tensor_parallel_bytes"
        return self.per_stage(name, num_stages)

    def everywhere(self, members: Sequence[int], num_workers: int) -> list[int]:
        """``members`` (of replica 0's ``num_workers``) and the same workers of every other replica."""
        return [m + r * num_workers for r in range(self.replicas) for m in members]

    def cluster(self, num_workers: int) -> Topology:
        """The topology sized for ``num_workers`` workers times the replicas."""
        return self.topology.sized(num_workers * self.replicas)

    @property
    def has_communication(self) -> bool:
        return True

    def link(self, src: int, dst: int) -> Link:
        """The path from src to dst as one link: its bottleneck and latency."""
        route = self.topology.route(src, dst)
        return Link(route.latency, route.bandwidth)

    def to_dict(self) -> dict:
        data = super().to_dict()
        data["topology"] = self.topology.to_dict()
        return data


def cluster_json(costs: Costs, num_workers: int) -> dict:
    """``{"topology": ...}``: the cluster ``costs`` run on, sized to
    ``num_workers`` (as the commands' --json show it); ``{}`` without one."""
    cluster = getattr(costs, "cluster", None)
    return {"topology": cluster(num_workers).to_dict()} if cluster is not None else {}


def describe_cluster(topology: Mapping) -> str:
    """One line naming a topology given as :func:`cluster_json` writes it:
    ``on NAME: N node(s) x D devices, K NICs per node, all-reduces as Cs``."""
    return (f"on {topology['name'] or 'the topology'}: {topology['nodes']} node(s) x {topology['devices_per_node']} "
            f"devices, {topology['nics_per_node']} NICs per node, all-reduces as {topology['collective']}s")


# ---------------------------------------------------------------------- checks
def _section(data: Mapping, name: str, where: str, required: tuple, optional: tuple) -> Mapping:
    section = data.get(name)
    if not isinstance(section, Mapping):
        fields = ", ".join(f'"{f}": ...' for f in required)
        raise ShapeError(f"{where}: missing field {name!r} (an object {{{fields}}})" if section is None
                         else f"{where}: {name} must be an object {{{fields}}}, got {section!r}")
    for key in required:
        if key not in section:
            raise ShapeError(f"{where}: missing field {name}.{key}")
    unknown = sorted(set(section) - set(required) - set(optional))
    if unknown:
        raise ShapeError(f"{where}: unknown field(s) {[f'{name}.{k}' for k in unknown]}")
    return section


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _bandwidth(section: Mapping, name: str, where: str) -> float:
    value = section["bandwidth"]
    if not _number(value) or value < 1:
        raise ShapeError(f"{where}: {name}.bandwidth must be a number >= 1 (bytes per second), got {value!r}")
    return float(value)


MAX_COUNT = 2**31 - 1
"""The most nodes or devices a topology may count (worker numbers are indices)."""


def _latency(section: Mapping, name: str, where: str) -> float:
    value = section["latency"]
    if not _number(value) or not 0 <= value <= LARGEST_STEP:
        raise ShapeError(f"{where}: {name}.latency must be a number of seconds from 0 to {LARGEST_STEP:g} "
                         f"(larger ones overflow a step's times; a fabric's is microseconds: 2e-6), got {value!r}")
    return float(value)


def _oversubscription(section: Mapping, where: str) -> float:
    value = section.get("oversubscription", 1.0)
    if not _number(value) or value < 1:
        raise ShapeError(f"{where}: inter_node.oversubscription must be a number >= 1 (1: non-blocking), got {value!r}")
    return float(value)


def _count(data: Mapping, name: str, where: str) -> int:
    if name not in data:
        raise ShapeError(f"{where}: missing field {name!r}")
    value = data[name]
    if not (is_whole(value) and value <= MAX_COUNT):
        raise ShapeError(f"{where}: {name} must be an integer from 1 to {MAX_COUNT}, got {value!r}")
    return value


__all__ = ["ClusterCosts", "Fabric", "Route", "Topology", "presets"]
