"""Eager fused calls replayed from CUDA graphs (no GPU needed): the flags' codes decide every wait
as the epoch does, the simulator catches a protocol whose flags run outside the codes' window,
and a workspace captures a set of addresses only on its second sighting, once per residue."""
import ctypes

import pytest

from compass_fx.kernels import flag_codes
from compass_fx.kernels import protocol as pr
from compass_fx.kernels.cuda import replay
from compass_fx.kernels.simulate import ProtocolViolation, Simulator


@pytest.mark.parametrize("target", range(1, 12))
def test_codes_decide_waits_as_the_epoch_does_over_the_window(target):
    assert not flag_codes.satisfied(0, target)  # never set
    for value in range(max(1, target - 2), target + 2):
        assert flag_codes.satisfied(flag_codes.code(value), target) == (value >= target)
    assert flag_codes.satisfied(0, 0) and flag_codes.satisfied(0, -1)  # a wait for the call before the first


def test_the_simulator_catches_a_flag_outside_the_window():
    """Rank 1 raises its flag every call without waiting for anyone, so it can run calls ahead of
    rank 0's wait: coded flags could not tell its epochs apart, and the coded simulator says so."""
    plans = [pr.Plan("toy", 0, 2, (pr.WaitFlag(pr.COMM, 1, 0),), 1),
             pr.Plan("toy", 1, 2, (pr.SetFlag(pr.COMM, 0),), 1)]
    calls = [[{}, {}] for _ in range(40)]
    with pytest.raises(ProtocolViolation, match="window"):
        for seed in range(20):
            Simulator(plans, 1, seed=seed, coded=True).run(calls, lateness=0.0)
    Simulator(plans, 1, seed=0).run(calls, lateness=0.0)  # by the epoch alone nothing is wrong


class _Recorder(replay.Replays):
    def __init__(self, most=2):
        self.captured = []
        self.device_index, self.most = 0, most
        from collections import OrderedDict
        self.graphs, self.seen = OrderedDict(), OrderedDict()
        self.captures = self.evicted = 0

    def _capture(self, issue):
        self.captured.append(issue)
        return f"graph{len(self.captured)}"


def test_a_set_of_addresses_is_captured_on_its_second_sighting_once_per_residue():
    r = _Recorder()
    assert r.graph("a", 1, "issue") is None and not r.captured  # first sighting: issued eagerly
    assert r.graph("a", 2, "issue") == "graph1"  # second: captured (epoch 2's residue)
    assert r.graph("a", 6, "issue") == "graph1" and len(r.captured) == 1  # 6 = 2 mod 4: replayed
    assert r.graph("a", 3, "issue") == "graph2"  # another residue: its own graph
    for epoch in range(4, 12):
        r.graph("a", epoch, "issue")
    assert len(r.captured) == flag_codes.PERIOD


def test_the_least_recently_used_sets_go_beyond_the_limit():
    r = _Recorder(most=2)
    for key in "abc":
        r.graph(key, 1, None)
        r.graph(key, 1, None)
    assert list(r.graphs) == ["b", "c"]


def test_replays_are_off_when_asked(monkeypatch):
    monkeypatch.setenv("COMPASS_FUSED_REPLAY", "0")
    assert not replay.enabled()
    monkeypatch.setenv("COMPASS_FUSED_REPLAY", "1")
    assert replay.enabled()
    monkeypatch.setenv("COMPASS_FUSED_REPLAY_GRAPHS", "0")
    with pytest.raises(ValueError, match="COMPASS_FUSED_REPLAY_GRAPHS"):
        replay.limit()
    # deferred calls (fused_async) replay by default, not where asked, and never with replays off
    assert replay.deferred_enabled()
    monkeypatch.setenv("COMPASS_FUSED_REPLAY_DEFERRED", "0")
    assert not replay.deferred_enabled()
    monkeypatch.setenv("COMPASS_FUSED_REPLAY_DEFERRED", "1")
    monkeypatch.setenv("COMPASS_FUSED_REPLAY", "0")
    assert not replay.deferred_enabled()


def test_a_workspace_whose_sets_do_not_recur_in_time_stops_capturing():
    """More recurring sets than the limit holds: each would be evicted before its graphs pay back
    their captures (about two eager issues each), so the workspace stops capturing and issues."""
    r = _Recorder(most=2)
    for round_ in range(6):
        for key in "abcde":  # five call sites of one shape, the limit two: every set evicted in turn
            r.graph(key, round_ * 5 + ord(key), None)
    assert r.thrashing()
    captured = len(r.captured)
    for epoch in range(40):
        r.graph("abcde"[epoch % 5], epoch, None)
    assert len(r.captured) == captured  # no capture once thrashing
    kept = _Recorder(most=8)
    for round_ in range(6):
        for key in "abcde":
            kept.graph(key, round_ * 5 + ord(key), None)
    assert not kept.thrashing() and len(kept.graphs) == 5


def test_a_batched_wait_is_laid_out_as_the_drivers_batch_operation():
    """``driver.wait_all``'s operations, as ``CUstreamBatchMemOpParams`` (cuda.h) lays out a 32-bit
    wait: a 48-byte union; the operation, then the address at 8, the value at 16, the flags at 24
    and the alias at 32 (a wrong offset would wait on the wrong word on the GPU)."""
    from compass_fx.kernels.cuda import driver

    op = driver._WaitOp
    assert ctypes.sizeof(op) == 48
    assert [(name, getattr(op, name).offset) for name in ("operation", "address", "value", "flags", "alias")] == [
        ("operation", 0), ("address", 8), ("value", 16), ("flags", 24), ("alias", 32)]
    with pytest.raises(ValueError, match="at least one"):
        driver.wait_all([])


def test_a_memset_kernel_stores_the_memsets_pattern_wide_only_where_aligned():
    """graph_edit's arguments for compass_memset: the 32-bit pattern of 1-, 2- and 4-byte values,
    16-byte stores only where the address, a row's bytes and the pitch are 16-byte multiples, and
    enough blocks for the work (at most MOST_BLOCKS)."""
    from compass_fx.kernels.cuda import graph_edit as ge

    def args(**kw):
        return ge.kernel_arguments(ge._MemsetParams(**kw))

    a, blocks = args(dst=0x1000, pitch=0, value=0, elementSize=1, width=4096, height=1)
    assert a[-1].value == 1 and blocks == 1 and (a[-2].x, a[-2].w) == (0, 0)
    a, _ = args(dst=0x1003, pitch=0, value=0xA5, elementSize=1, width=4096, height=1)
    assert a[-1].value == 0 and a[-2].x == 0xA5A5A5A5
    a, _ = args(dst=0x1000, pitch=4100, value=0xBEEF, elementSize=2, width=64, height=3)
    assert a[-1].value == 0 and a[-2].y == 0xBEEFBEEF  # the pitch is no 16-byte multiple
    a, blocks = args(dst=0x1000, pitch=0, value=7, elementSize=4, width=1 << 26, height=1)
    assert a[-1].value == 1 and a[-2].z == 7 and blocks == ge.MOST_BLOCKS


def test_replay_graphs_keep_their_memsets_when_asked(monkeypatch):
    monkeypatch.setenv("COMPASS_REPLAY_MEMSETS", "memset")
    assert not replay.memsets_as_kernels() and replay.memset_kernel(0) == 0
    monkeypatch.setenv("COMPASS_REPLAY_MEMSETS", "kernel")
    assert replay.memsets_as_kernels()
    monkeypatch.setenv("COMPASS_REPLAY_MEMSETS", "sometimes")
    with pytest.raises(ValueError, match="COMPASS_REPLAY_MEMSETS"):
        replay.memsets_as_kernels()
