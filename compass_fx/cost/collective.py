"""How long a collective takes on a topology, for each schedule.

Model: a schedule is a sequence of *steps*; in a step every rank sends one message to one peer.
A step lasts the latency of its longest path plus the time its most loaded directed link needs
for all the bytes routed across it (bytes / per-direction bandwidth): the per-step bottleneck
link, with contention of flows that share a link counted.  Schedules:

* ``ring`` — g-1 steps of rank i -> i+1 (all-gather, reduce-scatter; all-reduce is both, 2(g-1)).
* ``double_ring`` — the same steps on two rings in opposite directions at once, each message split
  between them in proportion to each direction's own bottleneck bandwidth, so both directions of
  every full-duplex link carry data.
* ``direct`` — g-1 steps of rank i -> i+s (s = 1..g-1): pushes straight to each peer, no forwarding;
  on a switch every step is one hop, on PCIe the far peers' traffic crosses shared links.

``NCCL_LAUNCH_S`` and ``STEP_SYNC_S`` are the software costs of a collective launch and of one
step's handshake.  Link figures are achievable rates, so no extra protocol efficiency is applied.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ..machine.calibration import calibrated_collective, calibration_path
from ..machine.topology import Topology
from .decision import SCHEDULES

NCCL_LAUNCH_S = 6e-6
STEP_SYNC_S = 1.5e-6
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class CollectiveTime:
    """Split into a fixed part (latencies, launches) and a part proportional to the bytes, which
    is what the decomposition model needs (A and C come from different parts)."""

    latency_s: float
    transfer_s: float
    steps: int

    @property
    def seconds(self) -> float:
        return self.latency_s + self.transfer_s


def step_time(topo: Topology, flows: list[tuple[str, str, float]]) -> tuple[float, float]:
    """(latency, transfer) seconds of one step in which each (src, dst, bytes) flow is sent at once."""
    load: dict[tuple[str, str], float] = defaultdict(float)
    latency = 0.0
    for src, dst, nbytes in flows:
        path = topo.route(src, dst)
        latency = max(latency, topo.latency(path))
        for edge in path:
            load[edge] += nbytes
    transfer = max((b / topo.bandwidth(e) for e, b in load.items()), default=0.0)
    return latency + STEP_SYNC_S, transfer


def _ring(gpus: tuple[str, ...], nbytes: float, direction: int = 1) -> list[tuple[str, str, float]]:
    g = len(gpus)
    return [(gpus[i], gpus[(i + direction) % g], nbytes) for i in range(g)]


def double_ring_split(topo: Topology, gpus: tuple[str, ...]) -> float:
    """Fraction of every message sent on the forward ring: proportional to each direction's
    bottleneck bandwidth (so that both rings finish together when they share no link)."""
    _, fwd = step_time(topo, _ring(gpus, 1.0, +1))
    _, bwd = step_time(topo, _ring(gpus, 1.0, -1))
    return bwd / (fwd + bwd)  # bandwidth_fwd / (bandwidth_fwd + bandwidth_bwd)


def schedule_steps(topo: Topology, group_size: int, message_bytes: float, schedule: str) -> list[tuple[float, float]]:
    """Per-step (latency, transfer) seconds of moving one ``message_bytes`` shard per rank per step
    around a group for g-1 steps (one all-gather or one reduce-scatter)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if message_bytes < 0:
        raise ValueError(f"message_bytes must be >= 0, got {message_bytes!r}")
    gpus = topo.group(group_size)
    g = len(gpus)
    if g == 1:
        return []
    if schedule == "ring":
        return [step_time(topo, _ring(gpus, message_bytes))] * (g - 1)
    if schedule == "double_ring":
        f = double_ring_split(topo, gpus)
        flows = _ring(gpus, f * message_bytes, +1) + _ring(gpus, (1 - f) * message_bytes, -1)
        return [step_time(topo, flows)] * (g - 1)
    return [step_time(topo, [(gpus[i], gpus[(i + s) % g], message_bytes) for i in range(g)])
            for s in range(1, g)]


def collective_time(op: str, total_bytes: float, topo: Topology, group_size: int,
                    schedule: str = "ring", launch_s: float = NCCL_LAUNCH_S) -> CollectiveTime:
    """Time of ``op`` over ``total_bytes`` (the full, gathered / pre-scatter tensor) in a group.

    all_gather / reduce_scatter: g-1 steps of total/g bytes; all_reduce: reduce-scatter then
    all-gather, 2(g-1) steps of total/g.
    """
    if op not in COLLECTIVES:
        raise ValueError(f"op must be one of {COLLECTIVES}, got {op!r}")
    steps = schedule_steps(topo, group_size, total_bytes / group_size, schedule)
    measured = _measured(op, total_bytes, topo, group_size) if schedule == "ring" else None
    if measured is not None:
        return CollectiveTime(measured[0], measured[1], 2 * len(steps) if op == "all_reduce" else len(steps))
    if op == "all_reduce":
        steps = steps + steps
    latency = launch_s + sum(l for l, _ in steps) if steps else 0.0
    transfer = sum(t for _, t in steps)
    return CollectiveTime(latency, transfer, len(steps))


def _measured(op: str, total_bytes: float, topo: Topology, group_size: int) -> tuple[float, float] | None:
    """(latency, transfer) from the calibration's NCCL measurements of this op, group size and
    regime, fitted as latency + bytes / bandwidth; None without such a measurement."""
    if calibration_path() is None:  # the common case: no file, and no route walk for the regime
        return None
    regime = topo.regime(group_size)
    line = calibrated_collective(regime, op, group_size)
    return None if line is None else (line[0], line[1] * total_bytes)


def collective_seconds(op: str, total_bytes: float, topo: Topology, group_size: int,
                       schedule: str = "ring") -> float:
    """Seconds of one collective (see :func:`collective_time`)."""
    return collective_time(op, total_bytes, topo, group_size, schedule).seconds
