"""The built-in machines, as interconnect graphs: NVSwitch nodes (one or several joined by
InfiniBand) and PCIe machines (sockets, PCIe switches, optional NVLink bridges between pairs).

``PRESETS`` maps a preset name to its GPU model and a builder of its graph; ``Topology.preset``
turns one into a :class:`~compass_fx.machine.topology.Topology`.
"""
from __future__ import annotations

from typing import Callable

import networkx as nx

from .gpus import GPUS
from .links import GB, LINK_DEFAULTS, US


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


PRESETS: dict[str, tuple[str, Callable[[], nx.DiGraph]]] = {
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
assert all(g in GPUS for g, _ in PRESETS.values())
