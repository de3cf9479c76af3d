"""Reading the machine's topology on a GPU host, once, with every rank taking rank 0's answer.

Two sources give the same thing, a GPU x GPU matrix of connection labels as ``nvidia-smi topo -m``
prints them (``NV12``, ``PIX``, ``PXB``, ``PHB``, ``NODE``, ``SYS``): NVML (nvidia-ml-py) when
installed, else the text of ``nvidia-smi topo -m``.  :func:`topology_from_matrix` turns the
matrix into a :class:`Topology`.  Ranks must agree or their decisions differ and they deadlock,
hence :func:`agree_across_ranks`.  Detection builds topologies and the topology module never
imports it: the package gives :func:`detect_topology` to ``Topology.detect`` (``set_detector``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import warnings

import networkx as nx

from .gpus import gpu_name_from_device
from .links import GB, LINK_DEFAULTS, US
from .topology import Topology

# Per-direction NVLink bandwidth of one link, GB/s (achievable, ~80% of the datasheet's).
_NVLINK_PER_LINK = {"H100": 20.0, "H200": 20.0, "A100": 20.0, "A6000": 12.5, "L40S": 12.5, "RTX4090": 12.5}
_LABEL = re.compile(r"^(X|NV\d+|PIX|PXB|PHB|NODE|SYS|SOC)$")


def parse_topo_matrix(text: str) -> list[list[str]]:
    """The GPU x GPU label matrix from ``nvidia-smi topo -m`` output (NIC rows/columns and the
    affinity columns are dropped)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # nvidia-smi underlines the header on a terminal
    lines = [l for l in text.splitlines() if l.strip()]

    def is_header(line: str) -> bool:
        tokens = line.split()
        return tokens[0] == "GPU0" and (len(tokens) < 2 or not _LABEL.match(tokens[1]))

    header_idx = next((i for i, l in enumerate(lines) if is_header(l)), None)
    if header_idx is None:
        raise ValueError("nvidia-smi topo text: no header line starting with GPU0")
    columns = lines[header_idx].split()
    gpu_cols = [i for i, c in enumerate(columns) if re.fullmatch(r"GPU\d+", c)]
    matrix = []
    for line in lines[header_idx + 1:]:
        fields = line.split()
        if not fields or not re.fullmatch(r"GPU\d+", fields[0]):
            if fields and fields[0].startswith("Legend"):
                break
            continue
        cells = fields[1:]
        row = [cells[i] if i < len(cells) else "" for i in gpu_cols]
        for cell in row:
            if not _LABEL.match(cell):
                raise ValueError(f"nvidia-smi topo text: unexpected cell {cell!r} in row {fields[0]}")
        matrix.append(row)
    if len(matrix) != len(gpu_cols):
        raise ValueError(f"nvidia-smi topo text: {len(gpu_cols)} GPU columns but {len(matrix)} GPU rows")
    return matrix


def topology_from_matrix(matrix: list[list[str]], gpu: str, name: str = "detected") -> Topology:
    """Build a topology from connection labels.

    All pairs NVLinked with the same link count (and more than two GPUs): one NVSwitch.  Otherwise
    NVLink pairs become direct bridges, and PCIe is rebuilt as sockets (``SYS`` separates them)
    holding PCIe switches (``PIX``/``PXB`` share one) or GPUs straight on the root complex.
    """
    n = len(matrix)
    pcie_kind = "pcie5" if gpu in ("H100", "H200") else "pcie4"
    per_link = _NVLINK_PER_LINK.get(gpu, 20.0)
    g = nx.DiGraph()
    for i in range(n):
        g.add_node(f"gpu{i}", kind="gpu")

    def link(a: str, b: str, kind: str, bw_gbps: float, lat_us: float) -> None:
        for u, v in ((a, b), (b, a)):
            g.add_edge(u, v, bw=bw_gbps * GB, lat=lat_us * US, kind=kind)

    nv = {(i, j): int(matrix[i][j][2:]) for i in range(n) for j in range(n)
          if i != j and matrix[i][j].startswith("NV")}
    counts = set(nv.values())
    if n > 2 and len(nv) == n * (n - 1) and len(counts) == 1:
        g.add_node("nvswitch0", kind="nvswitch")
        per_gpu = per_link * counts.pop()
        for i in range(n):
            link(f"gpu{i}", "nvswitch0", "nvlink-switch", per_gpu, 0.8)
        return Topology(name, gpu, g)
    for (i, j), count in nv.items():
        if i < j:
            link(f"gpu{i}", f"gpu{j}", "nvlink-bridge", per_link * count, 0.9)
    # Sockets: connected components of the "not SYS" relation.
    socket_of: dict[int, int] = {}
    for i in range(n):
        if i in socket_of:
            continue
        sid = len(set(socket_of.values()))
        for j in range(n):
            if j == i or matrix[i][j] not in ("SYS", "SOC"):
                socket_of.setdefault(j, sid)
    sockets = sorted(set(socket_of.values()))
    bw, lat = LINK_DEFAULTS[pcie_kind]
    for s in sockets:
        g.add_node(f"cpu{s}", kind="cpu")
    for a in sockets:
        for b in sockets:
            if a < b:
                link(f"cpu{a}", f"cpu{b}", "upi", *LINK_DEFAULTS["upi"])
    # PCIe switches: groups of GPUs that reach each other without the host bridge.
    switch_of: dict[int, int] = {}
    for i in range(n):
        if i in switch_of:
            continue
        peers = [j for j in range(n) if j != i and matrix[i][j] in ("PIX", "PXB")]
        if peers:
            sw = len(set(switch_of.values()))
            for j in [i, *peers]:
                switch_of.setdefault(j, sw)
    for i in range(n):
        cpu = f"cpu{socket_of[i]}"
        if i in switch_of:
            sw = f"pcie_sw{switch_of[i]}"
            if sw not in g:
                g.add_node(sw, kind="pcie_switch")
                link(sw, cpu, pcie_kind, bw, lat)
            link(f"gpu{i}", sw, pcie_kind, bw, lat)
        else:
            link(f"gpu{i}", cpu, pcie_kind, bw, lat)
    return Topology(name, gpu, g)


def _matrix_from_nvml() -> tuple[list[list[str]], str] | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: fall back to the next source
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        name = pynvml.nvmlDeviceGetName(handles[0])
        name = name.decode() if isinstance(name, bytes) else name
        pci = [pynvml.nvmlDeviceGetPciInfo(h).busId for h in handles]
        pci = [p.decode() if isinstance(p, bytes) else p for p in pci]
        levels = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
        matrix = [["X"] * count for _ in range(count)]
        for i in range(count):
            links: dict[int, int] = {}
            for l in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(handles[i], l) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handles[i], l).busId
                except pynvml.NVMLError:
                    continue
                remote = remote.decode() if isinstance(remote, bytes) else remote
                j = pci.index(remote) if remote in pci else -1  # -1: an NVSwitch
                links[j] = links.get(j, 0) + 1
            for j in range(count):
                if i == j:
                    continue
                if links.get(-1):
                    matrix[i][j] = f"NV{links[-1]}"
                elif links.get(j):
                    matrix[i][j] = f"NV{links[j]}"
                else:
                    level = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                    matrix[i][j] = levels.get(int(level), "SYS")
        return matrix, name
    finally:
        pynvml.nvmlShutdown()


def _matrix_from_nvidia_smi() -> tuple[list[list[str]], str] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        text = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30, check=True).stdout
        name = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    return parse_topo_matrix(text), name


def detect_local() -> dict:
    """This process's own reading, as a ``Topology.to_dict()`` description."""
    found = _matrix_from_nvml() or _matrix_from_nvidia_smi()
    if found is None:
        raise RuntimeError("Topology.detect() found neither NVML (pip install nvidia-ml-py) nor nvidia-smi; "
                           "pass a preset (Topology.preset) or a file (Topology.from_file)")
    matrix, device_name = found
    gpu = gpu_name_from_device(device_name)
    if gpu is None:
        warnings.warn(f"unknown GPU {device_name!r}: using H100 constants; calibrate for better predictions")
        gpu = "H100"
    if host_staged():
        return host_staged_topology(len(matrix), gpu).to_dict()
    return topology_from_matrix(matrix, gpu).to_dict()


def host_staged() -> bool:
    """NCCL told not to use peer-to-peer (``NCCL_P2P_DISABLE``): its collectives, and so the
    pairs' communication, go through host memory whatever links the GPUs have."""
    return os.environ.get("NCCL_P2P_DISABLE", "0").strip().lower() in ("1", "true", "yes")


def host_staged_topology(gpus: int, gpu: str) -> Topology:
    """Every GPU on its own PCIe link to the host, copies staged through host memory."""
    link = "pcie5-staged" if gpu in ("H100", "H200") else "pcie4-staged"
    bw, lat = LINK_DEFAULTS[link]
    g = nx.DiGraph()
    g.add_node("cpu0", kind="cpu")
    for i in range(gpus):
        g.add_node(f"gpu{i}", kind="gpu")
        for u, v in ((f"gpu{i}", "cpu0"), ("cpu0", f"gpu{i}")):
            g.add_edge(u, v, bw=bw * GB, lat=lat * US, kind=link)
    return Topology("detected-host-staged", gpu, g)


def agree_across_ranks(local: dict, key: str = "compass_fx/topology") -> dict:
    """Rank 0's description on every rank when a process group is initialised, else ``local``.

    Rank 0 publishes its reading in the process group's key-value store and returns at once;
    the other ranks read it from there (waiting for rank 0 at most the store's timeout).  Unlike
    a broadcast this needs no lockstep: a rank that never plans anything (a pipeline stage
    without TP pairs) cannot leave the others hanging.
    """
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return local
    if not (dist.is_available() and dist.is_initialized()):
        return local
    try:
        from torch.distributed.distributed_c10d import _get_default_store
        store = _get_default_store()
    except (ImportError, RuntimeError, ValueError):
        store = None
    if store is None:  # no store reachable: fall back to a collective broadcast
        box = [local if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    if dist.get_rank() == 0:
        store.set(key, json.dumps(local, sort_keys=True))
        return local
    return json.loads(store.get(key))


def detect_topology() -> Topology:
    return Topology.from_dict(agree_across_ranks(detect_local()))
