"""The host CPUs' power state, read and held: a launch after the host slept costs up to 2.5x one
right after another (``graph_node_probe.py --sections cold``), so which idle states the cores may
enter is part of a host-time result's conditions, and a run can keep them out of the deep ones.

Linux exposes each core's idle states under ``/sys/devices/system/cpu/cpuN/cpuidle`` and takes a
latency request on ``/dev/cpu_dma_latency`` (PM QoS): while a process holds that file open with 0
written to it, no core enters an idle state that takes longer than 0 us to leave.  Reading the
file gives the request in force.  No torch here: the device batches' runner imports it."""
from __future__ import annotations

import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

CPUS = Path("/sys/devices/system/cpu")
PM_QOS = Path("/dev/cpu_dma_latency")
NO_REQUEST_US = 2_000_000_000  # the kernel's value where no process asks for a bound


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def idle_states(cpu: int = 0, cpus: Path | None = None) -> list[dict] | None:
    """Core ``cpu``'s idle states (name, exit latency in us, disabled), shallowest first; None where
    the kernel exposes none (a container without sysfs, a VM)."""
    folder = (cpus or CPUS) / f"cpu{cpu}" / "cpuidle"
    if not folder.is_dir():
        return None
    states = []
    for state in sorted(folder.glob("state*"), key=lambda p: (len(p.name), p.name)):  # state2 before state10
        latency = _read(state / "latency")
        states.append({"name": _read(state / "name"),
                       "exit_latency_us": int(latency) if latency and latency.isdigit() else None,
                       "disabled": _read(state / "disable") == "1"})
    return states


def latency_request_us(pm_qos: Path | None = None) -> int | None:
    """The CPU latency bound in force (us; ``NO_REQUEST_US`` where nobody asks); None if unreadable."""
    try:
        raw = (pm_qos or PM_QOS).read_bytes()[:4]
    except OSError:
        return None
    return struct.unpack("<i", raw)[0] if len(raw) == 4 else None


def state(cpus: Path | None = None, pm_qos: Path | None = None) -> dict:
    """What a host-time result records of the CPUs: core 0's idle states, its frequency governor and
    the latency bound in force."""
    governor = _read((cpus or CPUS) / "cpu0" / "cpufreq" / "scaling_governor")
    return {"idle_states": idle_states(0, cpus), "governor": governor,
            "latency_request_us": latency_request_us(pm_qos)}


@contextmanager
def kept_awake(pm_qos: Path | None = None) -> Iterator[None]:
    """Keep every core out of idle states slower than 0 us to leave while the block runs (a PM QoS
    request, dropped when the file closes).  Raises OSError where the request cannot be made (no
    such device, not root): a run meant to hold it must not silently run without it."""
    path = pm_qos or PM_QOS
    with open(path, "wb", buffering=0) as request:
        request.write(struct.pack("<i", 0))
        in_force = latency_request_us(path)
        if in_force is not None and in_force != 0:  # the kernel took the write but another bound rules
            raise OSError(f"{path}: a request of 0 us was written but {in_force} us is in force")
        yield
