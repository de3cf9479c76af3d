"""The kinds of link between GPUs, switches, CPUs and NICs, and what each achieves.

Figures are the rates a collective achieves per direction (GB/s), not the datasheet's, and the
per-link latency (us); presets, detection and files that name a kind without figures take them
from here.
"""
from __future__ import annotations

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
    # bandwidth 25 GB/s at 64-256 MiB, about 30 us fixed (benchmarks/results/profile_pair/profile_pair-h200x2-hoststaged)
    "pcie5-staged": (25.0, 30.0),
    "upi": (40.0, 1.0),               # two-three UPI links between the sockets, per direction
    "ib-ndr": (45.0, 2.5),            # 400 Gb/s InfiniBand NIC per GPU
}

# Copy engines through pinned host memory (the host-staged fused operators), per direction per
# GPU while every GPU copies both ways, and the fixed cost of one piece (its flag's round trip).
# Measured on 2 H200s (benchmarks/results/host_copy/host_copy-h200x2): 36.7-41.7 GB/s per direction with
# both GPUs copying both ways, 54-55 one way; about 30 us fixed per fused call of a small shape.
HOST_COPY_DEFAULTS: dict[str, tuple[float, float]] = {
    "pcie5-staged": (40.0, 10.0),
    "pcie4-staged": (20.0, 10.0),
}

# The two communication regimes a calibration's collective tables are tagged with.
PEER_TO_PEER, HOST_STAGED = "peer-to-peer", "host-staged"
