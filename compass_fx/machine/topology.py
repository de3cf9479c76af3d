"""The interconnect as a graph: GPUs, switches, CPUs and NICs joined by links.

A :class:`Topology` is a networkx ``DiGraph``; every physical link is two directed edges, one per
direction, each with its own bandwidth (bytes/s, the rate a collective achieves, not the
datasheet's) and latency (s).  Traffic between two GPUs takes the fewest hops, then the widest
path (``route``); the collective model charges every directed edge with the bytes of all flows
crossing it, which is how shared PCIe uplinks and cross-socket links become bottlenecks.

Rank i of a tensor-parallel group of size g runs on the i-th GPU (``group``): TP groups are
placed on consecutive GPUs, as launchers do.

Link kinds and their figures are in ``links``, the built-in machines' graphs in ``presets``;
``detect`` reads the machine at hand into a Topology (see ``set_detector``).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable, Iterable

import networkx as nx

from .calibration import gpu_spec
from .links import GB, HOST_COPY_DEFAULTS, HOST_STAGED, LINK_DEFAULTS, PEER_TO_PEER, US
from .presets import PRESETS

# Reading the machine at hand is machine.detect's job: it builds a Topology from what NVML or
# nvidia-smi report, so it imports this module and this module never imports it.  The package
# (machine/__init__.py) hands detection's entry point to ``Topology.detect`` through ``set_detector``.
_detector: "Callable[[], Topology] | None" = None


def set_detector(detect: "Callable[[], Topology]") -> None:
    """Make ``detect`` what :meth:`Topology.detect` (and :meth:`Topology.default` on a GPU) call."""
    global _detector
    _detector = detect


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
        gpu, build = PRESETS[name]
        return cls(name, gpu, build())

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
        if _detector is None:  # only when this module is loaded without its package
            raise RuntimeError("Topology.detect() needs machine.detect: import compass_fx.machine")
        return _detector()

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

    def host_staged(self, size: int) -> bool:
        """Whether a group of ``size`` GPUs meets in pinned host memory (``host_copy`` has figures
        for it): never for one GPU, nor for a group larger than the machine (priced as replicas of
        it, over their peer links)."""
        return 1 < size <= self.num_gpus and self.host_copy(size) is not None

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
