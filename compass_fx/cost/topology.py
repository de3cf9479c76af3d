"""The interconnect as a graph: GPUs, switches, CPUs and NICs joined by links.

A :class:`Topology` is a networkx ``DiGraph``; every physical link is two directed edges, one per
direction, each with its own bandwidth (bytes/s, the rate a collective achieves, not the
datasheet's) and latency (s).  Traffic between two GPUs takes the fewest hops, then the widest
path (``route``); the collective model charges every directed edge with the bytes of all flows
crossing it, which is how shared PCIe uplinks and cross-socket links become bottlenecks.

Rank i of a tensor-parallel group of size g runs on the i-th GPU (``group``): TP groups are
placed on consecutive GPUs, as launchers do.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable, Iterable

import networkx as nx

from .gpus import GPUS, gpu_spec

GB = 1e9
US = 1e-6

# Achievable per-direction bandwidth (GB/s) and per-link latency (us) of each kind of link.
LINK_DEFAULTS: dict[str, tuple[float, float]] = {
    "nvlink4-switch": (370.0, 0.8),   # H100/H200: 18 NVLink4 links, 450 GB/s per direction on paper
    "nvlink3-switch": (240.0, 0.9),   # A100: 12 NVLink3 links, 300 GB/s per direction on paper
    "nvlink3-bridge": (50.0, 0.9),    # A6000 bridge: 4 links, 56.25 GB/s per direction on paper
    "pcie4": (24.0, 1.2),             # x16 Gen4: 32 GB/s on paper, 20-25 measured
    "pcie5": (48.0, 1.2),             # x16 Gen5
    "pcie4-staged": (13.0, 4.0),      # no peer-to-peer: copies bounce through host memory
    # no peer-to-peer on PCIe Gen5 (or NCCL_P2P_DISABLE=1): measured between two H200s, NCCL bus
    # bandwidth 25 GB/s at 64-256 MiB, about 30 us fixed (benchmarks/results/profile_pair-h200x2-hoststaged)
    "pcie5-staged": (25.0, 30.0),
    "upi": (40.0, 1.0),               # two-three UPI links between the sockets, per direction
    "ib-ndr": (45.0, 2.5),            # 400 Gb/s InfiniBand NIC per GPU
}

# Copy engines through pinned host memory (the host-staged fused operators), per direction per
# GPU while every GPU copies both ways, and the fixed cost of one piece (its flag's round trip).
# Measured on 2 H200s (benchmarks/results/host_copy-h200x2): 36.7-41.7 GB/s per direction with
# both GPUs copying both ways, 54-55 one way; about 30 us fixed per fused call of a small shape.
HOST_COPY_DEFAULTS: dict[str, tuple[float, float]] = {
    "pcie5-staged": (40.0, 10.0),
    "pcie4-staged": (20.0, 10.0),
}

# The two communication regimes a calibration's collective tables are tagged with.
PEER_TO_PEER, HOST_STAGED = "peer-to-peer", "host-staged"


class Topology:
    """A machine's GPUs and the links between them; build one with ``preset``, ``from_file``,
    ``from_dict``, ``detect`` or ``default``."""

    def __init__(self, name: str, gpu: str, graph: nx.DiGraph) -> None:
        gpu_spec(gpu)  # validates the name
        self.name = name
        self.gpu = gpu
        self.graph = graph
        self.gpus: tuple[str, ...] = tuple(sorted(
            (n for n, a in graph.nodes(data=True) if a.get("kind") == "gpu"),
            key=lambda n: int(n[3:]) if n[3:].isdigit() else n))
        if not self.gpus:
            raise ValueError(f"topology {name!r} has no node of kind 'gpu'")
        for u, v, a in graph.edges(data=True):
            if not (a.get("bw", 0) > 0 and a.get("lat", -1) >= 0):
                raise ValueError(f"topology {name!r}: link {u}->{v} needs bw > 0 and lat >= 0, got {a}")
        self._routes: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def presets(cls) -> tuple[str, ...]:
        """Names accepted by :meth:`preset`."""
        return tuple(PRESETS)

    @classmethod
    def preset(cls, name: str) -> "Topology":
        """A built-in machine, e.g. ``"h200-nvswitch-8"`` or ``"a6000-nvlink-pairs-pcie-8"``."""
        if name not in PRESETS:
            raise ValueError(f"unknown topology preset {name!r}; known presets: {', '.join(PRESETS)}")
        return PRESETS[name]()

    @classmethod
    def resolve(cls, name_or_path: "str | Topology | None") -> "Topology":
        """A preset name, a path to a JSON/YAML description, a Topology (returned as is), or None
        (:meth:`default`: the machine at hand)."""
        if name_or_path is None:
            return cls.default()
        if isinstance(name_or_path, Topology):
            return name_or_path
        if name_or_path in PRESETS:
            return cls.preset(name_or_path)
        if Path(name_or_path).is_file():
            return cls.from_file(name_or_path)
        raise ValueError(f"topology {name_or_path!r} is neither a preset nor a file; "
                         f"known presets: {', '.join(PRESETS)}")

    @classmethod
    def from_dict(cls, data: dict) -> "Topology":
        """Inverse of :meth:`to_dict`.  ``links`` entries: src, dst, gbps, latency_us, kind,
        duplex (default true: the same figures in both directions)."""
        for key in ("gpu", "nodes", "links"):
            if key not in data:
                raise ValueError(f"topology description needs a {key!r} field")
        g = nx.DiGraph()
        for node in data["nodes"]:
            g.add_node(node["id"], kind=node.get("kind", "switch"))
        for link in data["links"]:
            src, dst = link["src"], link["dst"]
            for end in (src, dst):
                if end not in g:
                    raise ValueError(f"topology link {src}->{dst} names unknown node {end!r}")
            attrs = dict(bw=float(link["gbps"]) * GB, lat=float(link.get("latency_us", 1.0)) * US,
                         kind=link.get("kind", "link"))
            g.add_edge(src, dst, **attrs)
            if link.get("duplex", True):
                g.add_edge(dst, src, **attrs)
        return cls(data.get("name", "custom"), data["gpu"], g)

    @classmethod
    def from_file(cls, path: "str | Path") -> "Topology":
        """Load a user's machine description (JSON, or YAML when PyYAML is installed)."""
        path = Path(path)
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            try:
                import yaml  # type: ignore[import-untyped]
            except ImportError as exc:
                raise ImportError("reading a YAML topology needs PyYAML (pip install pyyaml)") from exc
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        return cls.from_dict(data)

    @classmethod
    def detect(cls) -> "Topology":
        """Read this machine's GPUs and links (NVML, else ``nvidia-smi topo -m``); every rank of an
        initialised process group gets rank 0's answer.  Needs a GPU."""
        from .detect import detect_topology
        return detect_topology()

    @classmethod
    def default(cls) -> "Topology":
        """``detect()`` when CUDA is available, else the preset ``"h200-nvswitch-8"``.

        Never detects on a CPU-only machine, so CPU runs and tests are reproducible.  Detection
        runs once per process (cached); in a process group every rank gets rank 0's reading."""
        return _default_topology()

    def replicated(self, nodes: int) -> "Topology":
        """``nodes`` copies of this machine joined by InfiniBand (one NIC per GPU, one switch):
        what a TP group larger than one machine runs on.  GPU i of copy c becomes gpu{c*G + i}."""
        if not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes must be a positive int, got {nodes!r}")
        if nodes == 1:
            return self
        per = self.num_gpus
        index = {g: i for i, g in enumerate(self.gpus)}
        g = nx.DiGraph()

        def rename(node: str, c: int) -> str:
            return f"gpu{c * per + index[node]}" if node in index else f"{node}_n{c}"

        for c in range(nodes):
            for node, attrs in self.graph.nodes(data=True):
                g.add_node(rename(node, c), **attrs)
            for u, v, attrs in self.graph.edges(data=True):
                g.add_edge(rename(u, c), rename(v, c), **attrs)
        g.add_node("ib0", kind="ib")
        bw, lat = LINK_DEFAULTS["ib-ndr"]
        for i in range(nodes * per):
            for u, v in ((f"gpu{i}", "ib0"), ("ib0", f"gpu{i}")):
                g.add_edge(u, v, bw=bw * GB, lat=lat * US, kind="ib-ndr")
        return Topology(f"{nodes}x-{self.name}-ib", self.gpu, g)

    def to_dict(self) -> dict:
        nodes = [{"id": n, "kind": a.get("kind", "switch")} for n, a in self.graph.nodes(data=True)]
        links = [{"src": u, "dst": v, "gbps": a["bw"] / GB, "latency_us": a["lat"] / US,
                  "kind": a.get("kind", "link"), "duplex": False}
                 for u, v, a in self.graph.edges(data=True)]
        return {"name": self.name, "gpu": self.gpu, "nodes": nodes, "links": links}

    def fingerprint(self) -> str:
        """A canonical string: equal on two ranks exactly when they describe the same machine."""
        d = self.to_dict()
        d["nodes"].sort(key=lambda n: n["id"])
        d["links"].sort(key=lambda l: (l["src"], l["dst"]))
        return json.dumps(d, sort_keys=True)

    # ---- queries --------------------------------------------------------------------------
    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def group(self, size: int) -> tuple[str, ...]:
        """The GPUs a TP group of ``size`` ranks runs on (the first ``size`` GPUs)."""
        if not isinstance(size, int) or not 1 <= size <= self.num_gpus:
            raise ValueError(f"group size must be between 1 and {self.num_gpus} on {self.name}, got {size!r}")
        return self.gpus[:size]

    def route(self, src: str, dst: str) -> tuple[tuple[str, str], ...]:
        """The directed edges traffic from ``src`` to ``dst`` crosses (see ``_route``)."""
        key = (src, dst)
        if key not in self._routes:
            self._routes[key] = _route(self.graph, src, dst)
        return self._routes[key]

    def bandwidth(self, edge: tuple[str, str]) -> float:
        return self.graph.edges[edge]["bw"]

    def latency(self, path: Iterable[tuple[str, str]]) -> float:
        return sum(self.graph.edges[e]["lat"] for e in path)

    def peer_access(self, size: int | None = None) -> bool:
        """True when every GPU pair of the group can copy from each other's memory directly: no
        route crosses a host-staged link (GeForce PCIe cards, or ``NCCL_P2P_DISABLE=1``)."""
        gpus = self.group(size or self.num_gpus)
        return not any(self.graph.edges[e].get("kind", "").endswith("-staged")
                       for a in gpus for b in gpus if a != b for e in self.route(a, b))

    def regime(self, size: int | None = None) -> str:
        """``PEER_TO_PEER`` when the group's GPUs reach each other's memory, else ``HOST_STAGED``."""
        return PEER_TO_PEER if self.peer_access(size) else HOST_STAGED

    def host_copy(self, size: int | None = None) -> tuple[float, float] | None:
        """(bytes/s per direction per GPU, seconds per piece) of copy-engine transfers through
        pinned host memory between the group's GPUs, when they have no peer access; else None."""
        gpus = self.group(size or self.num_gpus)
        kinds = {self.graph.edges[e].get("kind", "") for a in gpus for b in gpus if a != b
                 for e in self.route(a, b)}
        staged = [HOST_COPY_DEFAULTS[k] for k in kinds if k in HOST_COPY_DEFAULTS]
        if not staged:  # every such kind is a "-staged" link: a route through one has no peer access
            return None
        bw, lat = min(staged)
        return bw * GB, lat * US

    def is_switched(self, size: int | None = None) -> bool:
        """True when every GPU pair of the group talks through one switch at full per-GPU rate."""
        gpus = self.group(size or self.num_gpus)
        return all(len(self.route(a, b)) == 2 and self.graph.nodes[self.route(a, b)[0][1]].get("kind") == "nvswitch"
                   for a in gpus for b in gpus if a != b)

    def describe(self) -> str:
        kinds = sorted({a.get("kind", "link") for _, _, a in self.graph.edges(data=True)})
        return f"{self.name}: {self.num_gpus}x {self.gpu}, links {', '.join(kinds)}"

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, gpu={self.gpu!r}, gpus={self.num_gpus})"


def _route(graph: nx.DiGraph, src: str, dst: str) -> tuple[tuple[str, str], ...]:
    """Fewest hops (as peer-to-peer traffic goes: a direct link when there is one), then the
    widest bottleneck, then the lowest latency, then the path's names (so ties are deterministic)."""
    if src not in graph or dst not in graph:
        raise ValueError(f"route: unknown node {src if src not in graph else dst!r}")
    if src == dst:
        return ()
    try:
        paths = list(nx.all_shortest_paths(graph, src, dst))
    except nx.NetworkXNoPath:
        raise ValueError(f"route: no path from {src} to {dst}") from None

    def key(nodes: list[str]) -> tuple:
        edges = list(zip(nodes[:-1], nodes[1:]))
        return (-min(graph.edges[e]["bw"] for e in edges), sum(graph.edges[e]["lat"] for e in edges), nodes)

    best = min(paths, key=key)
    return tuple(zip(best[:-1], best[1:]))


# ---- preset builders ---------------------------------------------------------------------------
class _Builder:
    def __init__(self) -> None:
        self.g = nx.DiGraph()

    def node(self, name: str, kind: str) -> str:
        self.g.add_node(name, kind=kind)
        return name

    def link(self, a: str, b: str, kind: str, gbps: float | None = None, lat_us: float | None = None) -> None:
        default_bw, default_lat = LINK_DEFAULTS[kind]
        attrs = dict(bw=(gbps or default_bw) * GB, lat=(default_lat if lat_us is None else lat_us) * US, kind=kind)
        self.g.add_edge(a, b, **attrs)
        self.g.add_edge(b, a, **attrs)


def nvswitch_node(gpu: str, gpus: int = 8, nodes: int = 1, link: str | None = None) -> Callable[[], nx.DiGraph]:
    """``nodes`` NVSwitch domains of ``gpus`` GPUs; across domains, one IB NIC per GPU (rail switch)."""
    link = link or ("nvlink3-switch" if gpu == "A100" else "nvlink4-switch")

    def build() -> nx.DiGraph:
        b = _Builder()
        if nodes > 1:
            b.node("ib0", "ib")
        for n in range(nodes):
            sw = b.node(f"nvswitch{n}", "nvswitch")
            for i in range(gpus):
                g = b.node(f"gpu{n * gpus + i}", "gpu")
                b.link(g, sw, link)
                if nodes > 1:
                    b.link(g, "ib0", "ib-ndr")
        return b.g
    return build


def pcie_node(gpus: int = 8, per_switch: int = 2, link: str = "pcie4", bridges: bool = False,
              upstream: str | None = None) -> Callable[[], nx.DiGraph]:
    """Two CPU sockets, GPUs split evenly between them, ``per_switch`` GPUs under each PCIe switch
    (1: straight into the root complex); optional NVLink bridges between GPU pairs (2i, 2i+1)."""
    upstream = upstream or link

    def build() -> nx.DiGraph:
        b = _Builder()
        cpus = [b.node("cpu0", "cpu"), b.node("cpu1", "cpu")]
        b.link(cpus[0], cpus[1], "upi")
        for i in range(gpus):
            b.node(f"gpu{i}", "gpu")
        for s in range(0, gpus, per_switch):
            cpu = cpus[0] if s < gpus // 2 else cpus[1]
            if per_switch == 1:
                b.link(f"gpu{s}", cpu, link)
                continue
            sw = b.node(f"pcie_sw{s // per_switch}", "pcie_switch")
            b.link(sw, cpu, upstream)
            for i in range(s, s + per_switch):
                b.link(f"gpu{i}", sw, link)
        if bridges:
            for i in range(0, gpus, 2):
                b.link(f"gpu{i}", f"gpu{i + 1}", "nvlink3-bridge")
        return b.g
    return build


_PRESET_SPECS: dict[str, tuple[str, Callable[[], nx.DiGraph]]] = {
    "h100-nvswitch-8": ("H100", nvswitch_node("H100")),
    "h200-nvswitch-8": ("H200", nvswitch_node("H200")),
    "a100-nvswitch-8": ("A100", nvswitch_node("A100")),
    # The paper's machine: NVLink bridges between GPU pairs, PCIe Gen4 across pairs, two sockets.
    "a6000-nvlink-pairs-pcie-8": ("A6000", pcie_node(per_switch=1, bridges=True)),
    "a100-pcie-8": ("A100", pcie_node(per_switch=2)),
    "l40s-pcie-8": ("L40S", pcie_node(per_switch=2)),
    # GeForce cards have no peer-to-peer: every copy is staged through host memory.
    "rtx4090-pcie-8": ("RTX4090", pcie_node(per_switch=1, link="pcie4-staged")),
    # H200s without peer access (PCIe only, or NCCL_P2P_DISABLE=1): copies staged through host memory.
    "h200-host-staged-8": ("H200", pcie_node(per_switch=1, link="pcie5-staged")),
    "2x-h100-nvswitch-8-ib": ("H100", nvswitch_node("H100", nodes=2)),
}


def _make(name: str) -> Callable[[], Topology]:
    gpu, build = _PRESET_SPECS[name]
    return lambda: Topology(name, gpu, build())


PRESETS: dict[str, Callable[[], Topology]] = {name: _make(name) for name in _PRESET_SPECS}
assert all(g in GPUS for g, _ in _PRESET_SPECS.values())


@functools.lru_cache(maxsize=1)
def _default_topology() -> Topology:
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a dependency
        has_cuda = False
    if has_cuda:
        return Topology.detect()
    return Topology.preset("h200-nvswitch-8")
