"""The host CPUs' power state that host-time results record (``benchmarks/harness/cpu_power.py``):
idle states read from a sysfs tree, the latency request read and held."""
from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from harness import cpu_power  # noqa: E402


def _cpu_tree(root: Path) -> Path:
    for i, (name, latency, disable) in enumerate([("POLL", 0, 0), ("C1", 2, 0), ("C6", 170, 1)]):
        state = root / "cpu0" / "cpuidle" / f"state{i}"
        state.mkdir(parents=True)
        (state / "name").write_text(f"{name}\n")
        (state / "latency").write_text(f"{latency}\n")
        (state / "disable").write_text(f"{disable}\n")
    (root / "cpu0" / "cpufreq").mkdir()
    (root / "cpu0" / "cpufreq" / "scaling_governor").write_text("powersave\n")
    return root


def test_the_state_lists_idle_states_shallowest_first_with_governor_and_request(tmp_path):
    request = tmp_path / "cpu_dma_latency"
    request.write_bytes(struct.pack("<i", cpu_power.NO_REQUEST_US))
    got = cpu_power.state(_cpu_tree(tmp_path / "cpu"), request)
    assert got == {"idle_states": [{"name": "POLL", "exit_latency_us": 0, "disabled": False},
                                   {"name": "C1", "exit_latency_us": 2, "disabled": False},
                                   {"name": "C6", "exit_latency_us": 170, "disabled": True}],
                   "governor": "powersave", "latency_request_us": cpu_power.NO_REQUEST_US}


def test_odd_sysfs_contents_read_as_unknown_rather_than_failing_a_run(tmp_path):
    """A result's environment is written after its run: a state whose latency is unreadable, or a
    folder named oddly, must not fail it."""
    cpus = _cpu_tree(tmp_path / "cpu")
    (cpus / "cpu0" / "cpuidle" / "state1" / "latency").write_text("n/a\n")
    (cpus / "cpu0" / "cpuidle" / "stateX").mkdir()
    states = cpu_power.idle_states(0, cpus)
    assert [s["name"] for s in states] == ["POLL", "C1", "C6", None]
    assert states[1]["exit_latency_us"] is None and states[2]["exit_latency_us"] == 170


def test_a_host_without_sysfs_or_the_device_reads_as_unknown(tmp_path):
    assert cpu_power.state(tmp_path / "none", tmp_path / "none" / "dev") == {
        "idle_states": None, "governor": None, "latency_request_us": None}


def test_the_request_is_zero_while_held(tmp_path):
    request = tmp_path / "cpu_dma_latency"
    with cpu_power.kept_awake(request):
        assert cpu_power.latency_request_us(request) == 0


def test_a_request_that_does_not_take_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_power, "latency_request_us", lambda path=None: 100)
    with pytest.raises(OSError, match="100 us is in force"):
        with cpu_power.kept_awake(tmp_path / "cpu_dma_latency"):
            raise AssertionError("the block ran without the request in force")


def test_a_request_that_cannot_be_made_raises(tmp_path):
    ran = []
    with pytest.raises(FileNotFoundError):
        with cpu_power.kept_awake(tmp_path / "no" / "device"):
            ran.append(True)
    assert not ran
