"""Eager fused calls replayed from CUDA graphs (no GPU needed): the flags' codes decide every wait
as the epoch does, the simulator catches a protocol whose flags run outside the codes' window,
and a workspace captures a set of addresses only on its second sighting, once per residue."""
import ctypes
import warnings

import pytest
import torch

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


def _steady_share_replayed(call_sites: int, most: int) -> float:
    """The share of a step's calls served from graphs once a workspace has settled: ``call_sites``
    sets called in the same order every step (a model's layers), epochs counting on."""
    r = _Recorder(most=most)
    epoch = replayed = 0
    for step in range(12):
        for site in range(call_sites):
            epoch += 1
            graph = r.graph(("layer", site), epoch, None)
            replayed += step >= 10 and graph is not None
    return replayed / (2 * call_sites)


def test_every_call_of_a_deep_models_step_replays_at_the_default_limit():
    """A workspace meets a set of addresses per call site a step: up to two a layer (a layer's two
    reductions share a workspace: the same rows and width), twice with activation checkpointing, 504
    for Llama-3.1-405B's 126 layers.  The least recently used set is the next one called, so a limit
    below the sets a step calls leaves part of every step issued (the old limit, 64: 20% of 80 call
    sites' calls, 49% of 126's); the default holds every set of such a step."""
    with pytest.warns(RuntimeWarning, match="than the 64 this workspace keeps .* stops capturing"):
        assert _steady_share_replayed(80, 64) == pytest.approx(0.8)
    with pytest.warns(RuntimeWarning, match="stops capturing"):
        assert _steady_share_replayed(126, 64) < 0.55
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default limit holds them all: nothing to say
        for layers in (2, 80, 126):
            assert _steady_share_replayed(4 * layers, replay.limit()) == 1.0


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
    with pytest.warns(RuntimeWarning, match="stops capturing"):
        for round_ in range(6):
            for key in "abcde":  # five call sites of one shape, the limit two: every set evicted in turn
                r.graph(key, round_ * 5 + ord(key), None)
    assert r.thrashing() and r.stopped
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


@pytest.mark.parametrize("world", [2, 4, 8])
def test_sums_of_more_than_two_terms_have_rows_of_the_workspace(world):
    """A captured call's allocations stay in its graph's pool for the graph's life, so a sum of more
    than two terms (a reduction beyond two ranks) accumulates in float32 rows the workspace holds,
    one block per stream that runs such sums, as many rows as its largest; two ranks need none."""
    from compass_fx.kernels.cuda import impl

    for op in ("matmul_reduce_scatter", "matmul_all_reduce"):
        for host in (False, True):
            for detach in (False, True):
                plans = pr.stream_plans(op, "direct", world, 1, 512, 64, 1, 2, host, detach=detach)
                sums = impl.sum_scratch(plans, 64, torch.device("cpu"))
                wide = [c for p in plans for c in p.commands if isinstance(c, pr.Reduce) and len(c.srcs) > 2]
                assert set(sums) == {c.stream for c in wide}
                assert not sums or world > 2
                for side, rows in sums.items():
                    assert rows.dtype == torch.float32 and rows.shape == (
                        max(c.dst.rows for c in wide if c.stream == side), 64)


def test_a_sum_in_the_workspaces_rows_equals_the_sum_a_call_allocated():
    """Bit for bit what the calls computed before the rows were the workspace's (``terms[0].float()``,
    the others added, rounded once), the rows reused from call to call."""
    from compass_fx.kernels.cuda import impl

    acc = torch.empty(16, 8)
    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 5, 8):
        for _ in range(2):  # the rows hold the last call's sum: nothing of it may leak into the next
            terms = [torch.randn(16, 8, generator=g).bfloat16() for _ in range(n)]
            want = terms[0] + terms[1] if n == 2 else sum(terms[1:], terms[0].float()).bfloat16()
            got = torch.empty(16, 8, dtype=torch.bfloat16)
            impl.add_terms(got, terms, acc if n > 2 else None)
            assert torch.equal(got, want)


def test_fused_calls_reads_every_workspace_and_a_workspace_that_stops_capturing_says_so_once(monkeypatch):
    """What ``compass_fx.fused_calls()`` tells a user: the process's replayed and issued calls and each
    workspace's sets; a step with more call sites than a workspace keeps graphs for makes it stop
    capturing, with one warning that names the operator and the setting to raise."""
    from types import SimpleNamespace

    from compass_fx import fused_calls
    from compass_fx.kernels.cuda import impl

    r = _Recorder(most=4)
    r.label = "compass::matmul_reduce_scatter (4096 columns, 8 ranks)"
    workspace = SimpleNamespace(plan=SimpleNamespace(op="matmul_reduce_scatter", world_size=8), cols=4096,
                                transport="host", replays=r, apart=SimpleNamespace(replays=_Recorder()))
    monkeypatch.setattr(impl, "_workspaces", {("key", False): workspace})
    monkeypatch.setattr(replay, "_disabled", [])
    monkeypatch.setattr(replay, "stats", dict(replay.stats))  # the loop's counts stay out of the process's
    epoch = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(12):  # six call sites a step against four places: each capture evicted before it replays
            for site in range(6):
                epoch += 1
                r.graph(("site", site), epoch, None)
    stopped = [w for w in caught if "stops capturing" in str(w.message)]
    assert len(stopped) == 1 and "matmul_reduce_scatter" in str(stopped[0].message), [str(w.message) for w in caught]
    assert "COMPASS_FUSED_REPLAY_GRAPHS" in str(stopped[0].message)
    monkeypatch.setattr(replay, "stats", dict(replay.stats, replayed=30, lane=20, issued=12, captured=9))
    usage = fused_calls()
    assert (usage.replayed, usage.from_c, usage.issued, usage.calls) == (30, 20, 12, 42)
    w, deferred = usage.workspaces  # its eager calls' graphs, and its deferred calls' (none captured yet)
    assert (w.op, w.ranks, w.columns, w.sets, w.limit, w.stopped) == ("matmul_reduce_scatter", 8, 4096, 4, 4, True)
    assert deferred.deferred and not w.deferred and (deferred.sets, deferred.graphs, deferred.stopped) == (0, 0, False)
    assert w.evicted > w.limit and w.graphs == sum(g is not None for gs in r.graphs.values() for g in gs)
    text = str(usage)
    assert "42 eager, 30 replayed (71%; 20 from C), 12 issued" in text and "STOPPED CAPTURING" in text, text
    assert "deferred calls of matmul_reduce_scatter (4096 columns, 8 ranks, host): 0 of 2 sets" in text, text
    assert f"{w.evicted} evicted, {len(r.seen)} seen once; STOPPED" in text, text


def test_fused_calls_before_any_call_says_there_were_none(monkeypatch):
    from compass_fx import fused_calls
    from compass_fx.kernels.cuda import impl

    monkeypatch.setattr(impl, "_workspaces", {})
    monkeypatch.setattr(replay, "stats", {k: 0 for k in replay.stats})
    assert str(fused_calls()).startswith("compass fused calls: no eager call of the CUDA fused operators in this")


def test_fused_calls_since_an_earlier_reading_is_one_steps_own(monkeypatch):
    """Two readings around a step: their difference counts that step's calls alone (the totals keep
    the first steps' captures and calls from Python, so they never read settled), with the
    workspaces as they are at the later reading; readings given in the wrong order are refused."""
    from compass_fx import fused_calls
    from compass_fx.kernels.cuda import impl

    monkeypatch.setattr(impl, "_workspaces", {})
    monkeypatch.setattr(replay, "_disabled", [])
    monkeypatch.setattr(replay, "stats", dict(replay.stats, replayed=30, lane=20, issued=12, captured=9))
    before = fused_calls()
    assert not before.settled
    monkeypatch.setattr(replay, "stats", dict(replay.stats, replayed=36, lane=24, issued=14, captured=11))
    warming = fused_calls().since(before)  # a step still capturing: 2 of its 8 calls issued from Python
    assert (warming.replayed, warming.from_c, warming.issued, warming.captured, warming.calls) == (6, 4, 2, 2, 8)
    assert not warming.settled and "8 eager, 6 replayed (75%; 4 from C), 2 issued" in str(warming)
    mark = fused_calls()
    monkeypatch.setattr(replay, "stats", dict(replay.stats, replayed=44, lane=32))
    step = fused_calls().since(mark)
    assert step.settled and (step.calls, step.from_c, step.captured) == (8, 8, 0)
    assert not fused_calls().since(fused_calls()).settled  # no call between: nothing to call settled
    with pytest.raises(ValueError, match="read after this reading"):
        before.since(mark)
