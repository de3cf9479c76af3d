"""The fused calls' host fast path (compass_fx/kernels/cuda/lane.cpp), built with the system compiler
and run on CPU tensors: every step a replayed call takes in Python, taken in C on the same objects.

The workspace here is the part of ``impl._Workspace`` the fast path reads (its epoch, pending join,
watchdog, :class:`replay.Replays` and :class:`watchdog.Progress`, the real classes); the launch is a
C callback that records what it was handed.  On a GPU, tests/test_fused_ipc_peer.py's calls go through
the same path against real graphs.
"""
from __future__ import annotations

import ctypes
import os
import time
import warnings
from types import SimpleNamespace

import pytest
import torch

from compass_fx.kernels.cuda import env_raw, impl, lane, replay
from compass_fx.kernels.cuda.watchdog import Progress

pytestmark = pytest.mark.slow  # builds a C++ extension (~20 s on 2 cores)

STREAM = 0x5151
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


class Launches:
    """cuGraphLaunch's stand-in: records (graph exec, stream); returns ``result``."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []
        self.result = 0
        self.hold_s = 0.0  # how long a launch takes
        self.callback = LAUNCH(self._launch)

    def _launch(self, graph_exec, stream) -> int:
        self.seen.append((graph_exec, stream))
        if self.hold_s:
            time.sleep(self.hold_s)
        return self.result


def _raise(result: int, what: str) -> None:
    raise RuntimeError(f"{what} failed: {result}")


@pytest.fixture(scope="module")
def fast():
    if env_raw(b"PATH") is None:
        pytest.skip("os.environ keeps no bytes dict here")
    module = lane.compile_module()
    launches = Launches()
    capturing = [False]
    lane.configure(module, transports=impl._transports, join=impl.Join, raw_stream=lambda index: STREAM,
                   capturing=lambda: capturing[0],
                   launch_address=ctypes.cast(launches.callback, ctypes.c_void_p).value, check=_raise)
    impl.transport()  # the settings' parsed values, as a first Python call leaves them
    replay.enabled()
    yield SimpleNamespace(module=module, launches=launches, capturing=capturing)
    lane.lanes.clear()


class Graph:
    """What lane.cpp reads of ``replay.Captured``: its executable graph's handle."""

    def __init__(self, handle: int) -> None:
        self.exec = handle


def _workspace() -> SimpleNamespace:
    return SimpleNamespace(epoch=0, pending=None, dog=SimpleNamespace(failure=None), replays=replay.Replays(-1),
                           progress=Progress(word=torch.zeros(1, dtype=torch.int32)))


CASES = {  # case -> (op, a, weights, group size, output shapes: the gathered rows first)
    "gather": ("all_gather_matmul", (4, 8), [(8, 6)], 2, [(8, 8), (8, 6)]),
    "gather, three weights": ("all_gather_matmul", (4, 8), [(8, 6), (8, 5), (8, 3)], 2, [(8, 8), (8, 6), (8, 5), (8, 3)]),
    "gather without weights": ("all_gather_matmul", (4, 8), [], 2, [(8, 8)]),  # a ring all-reduce's second call
    "reduce-scatter": ("matmul_reduce_scatter", (8, 8), [(8, 6)], 2, [(4, 6)]),
    "all-reduce": ("matmul_all_reduce", (8, 8), [(8, 6)], 4, [(8, 6)]),
}


def _weights(op: str, b):
    """What the op's kernel hands the fast path: the gather's list of weights, the others' weight."""
    if op == "all_gather_matmul":
        return b if isinstance(b, list) else [b]
    return b


def _call(fast, op: str, a, b, world: int):
    return fast.module.call(lane.OPS[op], a, _weights(op, b), "direct", "g0", world)


def _key(fast, op: str, a, b, world: int):
    return fast.module.key(lane.OPS[op], a, _weights(op, b), "direct", "g0", world)


def _meta(*shape: int, dtype=torch.float32) -> torch.Tensor:
    """A tensor with no memory: its outputs' addresses (0) recur call after call, as the caching
    allocator's do on a GPU (the CPU allocator's do not)."""
    return torch.empty(shape, dtype=dtype, device="meta")


def _learn_graphs(fast, ws, op, a, b, world) -> object:
    """Capture by hand: a graph per phase for the addresses the fast path looked up; then it hits."""
    assert _call(fast, op, a, b, world) is None
    key = fast.module.last_addresses()
    ws.replays.graphs[key] = [Graph(0x1000 + phase) for phase in range(4)]
    out = _call(fast, op, a, b, world)
    assert out is not None
    return out


def test_the_graphs_are_looked_up_by_the_python_paths_addresses(fast):
    """On real memory: the input's and the weight's addresses and the weight's strides first."""
    a, b = torch.randn(4, 8), torch.randn(16, 8).t()
    ws = _workspace()
    lane.lanes[_key(fast, "all_gather_matmul", a, b, 2)] = ws
    assert _call(fast, "all_gather_matmul", a, b, 2) is None
    key = fast.module.last_addresses()
    assert key[:4] == (a.data_ptr(), b.data_ptr(), (1, 8), -1) and len(key) == 6
    assert all(isinstance(address, int) and address for address in key[4:])
    lane.lanes.clear()


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_replayed_call_takes_every_step_of_the_python_path(fast, case):
    op, a_shape, b_shapes, world, shapes = CASES[case]
    a, weights = _meta(*a_shape), [_meta(*shape) for shape in b_shapes]
    b = weights if op == "all_gather_matmul" else weights[0]
    ws = _workspace()
    key = _key(fast, op, a, b, world)
    assert key is not None
    lane.lanes[key] = ws
    launches = len(fast.launches.seen)
    assert _call(fast, op, a, b, world) is None  # no graph yet: the Python path's call
    assert ws.epoch == 0 and ws.progress.issued == 0 and len(fast.launches.seen) == launches

    replayed = replay.stats["replayed"]
    out = _learn_graphs(fast, ws, op, a, b, world)
    gathering = op == "all_gather_matmul"
    outputs = [out[0], *out[1]] if gathering else [out]
    assert [tuple(t.shape) for t in outputs] == shapes
    assert all(t.dtype == a.dtype and t.device == a.device for t in outputs)
    # the graph it launched is the one the Python path would: the outputs' addresses, the epoch's phase
    tensors = {"A": [a], "W": weights, "OUT": outputs[1:] if gathering else outputs,
               "GATHERED": outputs[:1] if gathering else []}
    addresses = impl._Workspace._addresses(tensors)
    assert addresses in ws.replays.graphs and next(reversed(ws.replays.graphs)) == addresses
    assert fast.launches.seen[-1] == (ws.replays.graphs[addresses][1].exec, STREAM)
    assert ws.epoch == 1 and ws.progress.issued == 1 and ws.progress.epochs[0] == 1
    assert ws.progress.stream == STREAM and replay.stats["replayed"] == replayed + 1

    # the next calls walk the phases; each one counted in the watchdog's ring
    for epoch in range(2, 7):
        out = _call(fast, op, a, b, world)
        assert out is not None
        assert fast.launches.seen[-1][0] & 0xF == epoch % 4
        assert ws.epoch == epoch and ws.progress.issued == epoch and ws.progress.epochs[epoch - 1] == epoch
    lane.lanes.clear()


def _ring_all_reduce(fast, world: int = 4):
    """A ring all-reduce's lane: the reduce-scatter's workspace and the gather's, as
    lane.register_ring_all_reduce leaves them."""
    a, b = _meta(8, 8), _meta(8, 6)
    rs, ag = _workspace(), _workspace()
    lane.lanes[_key(fast, "matmul_all_reduce", a, b, world)] = (rs, ag)
    return a, b, rs, ag


def test_a_ring_all_reduce_replays_both_its_calls_or_neither(fast):
    """The ring schedules' all-reduce is two calls in Python (the fused reduce-scatter, then a
    gather of the sums without weights): from C both replays are prepared before either runs, so a
    missing graph of the second leaves the first untouched too; once both exist, one call runs
    the reduce-scatter's graph, then the gather's, each with its workspace's epoch and ring."""
    world = 4
    a, b, rs, ag = _ring_all_reduce(fast, world)
    launches = len(fast.launches.seen)
    assert _call(fast, "matmul_all_reduce", a, b, world) is None  # no graph of the reduce-scatter yet
    scattered = _meta(2, 6)
    rs_addresses = impl._Workspace._addresses({"A": [a], "W": [b], "OUT": [scattered], "GATHERED": []})
    assert fast.module.last_addresses() == rs_addresses
    rs.replays.graphs[rs_addresses] = [Graph(0x1000 + phase) for phase in range(4)]
    assert _call(fast, "matmul_all_reduce", a, b, world) is None  # no graph of the gather yet
    gathered = _meta(8, 6)
    ag_addresses = impl._Workspace._addresses({"A": [scattered], "W": [], "OUT": [], "GATHERED": [gathered]})
    assert fast.module.last_addresses() == ag_addresses
    assert (rs.epoch, rs.progress.issued, ag.epoch, ag.progress.issued) == (0, 0, 0, 0)
    assert len(fast.launches.seen) == launches  # the reduce-scatter's graph did not run alone
    ag.replays.graphs[ag_addresses] = [Graph(0x2000 + phase) for phase in range(4)]
    for epoch in range(1, 6):
        replayed, from_c = replay.stats["replayed"], replay.stats["lane"]
        out = _call(fast, "matmul_all_reduce", a, b, world)
        assert tuple(out.shape) == (8, 6) and out.dtype == a.dtype and out.device == a.device
        assert fast.launches.seen[-2:] == [(0x1000 + epoch % 4, STREAM), (0x2000 + epoch % 4, STREAM)]
        for ws in (rs, ag):
            assert ws.epoch == epoch and ws.progress.issued == epoch and ws.progress.epochs[epoch - 1] == epoch
        assert (replay.stats["replayed"], replay.stats["lane"]) == (replayed + 2, from_c + 2)
    # the gather's ring full: neither runs
    ag.progress.issued, ag.progress.done.value = Progress.RING - 1 + 5, 5
    before = (rs.epoch, rs.progress.issued, ag.epoch, len(fast.launches.seen))
    assert _call(fast, "matmul_all_reduce", a, b, world) is None
    assert (rs.epoch, rs.progress.issued, ag.epoch, len(fast.launches.seen)) == before
    lane.lanes.clear()


def test_a_call_from_c_says_where_its_host_time_went(fast, monkeypatch):
    """``lane.last_phases``: a call issued from C reads its clock between its phases, so a launch
    held 3 ms shows in "launch" (both launches of a ring all-reduce: 6 ms) and not in the others;
    a call C declined leaves no phases (the previous call's are not passed off as its)."""
    monkeypatch.setitem(lane._state, "module", fast.module)
    op, a_shape, b_shapes, world, _ = CASES["reduce-scatter"]
    a, b = _meta(*a_shape), _meta(*b_shapes[0])
    lane.lanes[_key(fast, op, a, b, world)] = ws = _workspace()
    _learn_graphs(fast, ws, op, a, b, world)
    phases = lane.last_phases()
    assert tuple(phases) == lane.PHASES and all(us >= 0 for us in phases.values()), phases
    assert _call(fast, op, _meta(6, 8), b, world) is None and lane.last_phases() is None  # no lane for it
    a_ring, b_ring, rs, ag = _ring_all_reduce(fast, 4)
    for ws, first in ((rs, 0x1000), (ag, 0x2000)):
        assert _call(fast, "matmul_all_reduce", a_ring, b_ring, 4) is None
        ws.replays.graphs[fast.module.last_addresses()] = [Graph(first + phase) for phase in range(4)]
    fast.launches.hold_s = 0.003
    try:
        for args, launches in (((op, a, b, world), 1), (("matmul_all_reduce", a_ring, b_ring, 4), 2)):
            before = len(fast.launches.seen)
            assert _call(fast, *args) is not None and len(fast.launches.seen) == before + launches
            held = lane.last_phases()
            assert held["launch"] >= launches * 3000, held
            assert sum(us for name, us in held.items() if name != "launch") < 3000, held
    finally:
        fast.launches.hold_s = 0.0
    lane.lanes.clear()


def test_the_python_path_registers_a_ring_all_reduce_once_both_its_calls_are(fast, monkeypatch):
    a, b, scattered = torch.randn(8, 8), torch.randn(8, 6), torch.randn(2, 6)
    monkeypatch.setitem(lane._state, "module", fast.module)
    rs, ag = _workspace(), _workspace()
    lane.register("matmul_reduce_scatter", a, b, "ring", "g0", 4, rs)
    lane.register_ring_all_reduce(a, b, scattered, "ring", "g0", 4)
    assert list(lane.lanes.values()) == [rs]  # the gather's workspace is not known yet
    lane.register("all_gather_matmul", scattered, [], "ring", "g0", 4, ag)
    lane.register_ring_all_reduce(a, b, scattered, "ring", "g0", 4)
    assert lane.lanes[fast.module.key(lane.OPS["matmul_all_reduce"], a, b, "ring", "g0", 4)] == (rs, ag)
    lane.lanes.clear()
    # a single workspace under an all-reduce's key is the direct schedule's; a pair elsewhere is refused
    lane.lanes[fast.module.key(lane.OPS["matmul_reduce_scatter"], _meta(8, 8), _meta(8, 6), "direct", "g0", 4)] = (rs, ag)
    assert _call(fast, "matmul_reduce_scatter", _meta(8, 8), _meta(8, 6), 4) is None
    lane.lanes.clear()


def _hitting(fast) -> tuple:
    a, b = _meta(4, 8), _meta(8, 6)
    ws = _workspace()
    lane.lanes[_key(fast, "all_gather_matmul", a, b, 2)] = ws
    _learn_graphs(fast, ws, "all_gather_matmul", a, b, 2)
    return a, b, ws


def _unchanged(fast, ws, a, b, before: tuple) -> None:
    launches = len(fast.launches.seen)
    assert _call(fast, "all_gather_matmul", a, b, 2) is None
    assert (ws.epoch, ws.progress.issued, ws.progress.stream, len(fast.launches.seen)) == before + (launches,)


def test_anything_unexpected_leaves_the_call_to_the_python_path_untouched(fast):
    a, b, ws = _hitting(fast)
    before = (ws.epoch, ws.progress.issued, ws.progress.stream)
    ws.progress.done.value = ws.progress.issued  # every replay finished
    cases = {
        "a deferred call outstanding": lambda: setattr(ws, "pending", object()),
        "the watchdog failed": lambda: setattr(ws.dog, "failure", "rank 1 is late"),
        "replays off": lambda: os.environ.__setitem__("COMPASS_FUSED_REPLAY", "0"),
        "the lane off": lambda: os.environ.__setitem__("COMPASS_FUSED_LANE", "0"),
        "the lane off, in words": lambda: os.environ.__setitem__("COMPASS_FUSED_LANE", "off"),
        "the point-to-point path asked for": lambda: os.environ.__setitem__("COMPASS_CUDA_FUSED", "p2p"),
        "another transport": lambda: os.environ.__setitem__("COMPASS_FUSED_TRANSPORT", "host"),
        "a capture": lambda: fast.capturing.__setitem__(0, True),
        "a join outstanding": lambda: setattr(impl.Join, "outstanding", 1),
        "replays turned off by a failed capture": lambda: replay._disabled.append("capture failed"),
        "no graph for the phase": lambda: [g.__setitem__((ws.epoch + 1) % 4, None) for g in ws.replays.graphs.values()],
    }
    replay.enabled()  # "0" parsed once by the Python path, as a call would
    for why, change in cases.items():
        saved = (dict(os.environ), ws.pending, ws.dog.failure, {k: list(v) for k, v in ws.replays.graphs.items()})
        change()
        if why == "replays off":
            replay.enabled()
        try:
            _unchanged(fast, ws, a, b, before)
        finally:
            os.environ.clear()
            os.environ.update(saved[0])
            ws.pending, ws.dog.failure = saved[1], saved[2]
            ws.replays.graphs.update(saved[3])
            fast.capturing[0] = False
            impl.Join.outstanding = 0
            replay._disabled.clear()
        assert _call(fast, "all_gather_matmul", a, b, 2) is not None, why  # and back on
        before = (ws.epoch, ws.progress.issued, ws.progress.stream)
        ws.progress.done.value = ws.progress.issued
    lane.lanes.clear()


def test_arguments_the_workspace_was_not_built_for_are_not_replayed(fast):
    a, b, ws = _hitting(fast)
    before = (ws.epoch, ws.progress.issued, ws.progress.stream)
    for a2, b2 in ((_meta(8, 4).t(), b),                         # a non-contiguous input
                   (a, _meta(8, 6, dtype=torch.float64)),       # a weight of another dtype
                   (a, _meta(9, 6)),                            # a weight that does not multiply
                   (a, torch.empty(8, 6)),                      # a weight on another device
                   (a, [b, _meta(8, 3, dtype=torch.float64)]),  # a second weight of another dtype
                   (_meta(4, 8, dtype=torch.float64), _meta(8, 6, dtype=torch.float64)),  # another key
                   (_meta(4, 4), _meta(4, 6))):                 # another shape
        launches = len(fast.launches.seen)
        assert _call(fast, "all_gather_matmul", a2, b2, 2) is None
        assert (ws.epoch, ws.progress.issued, ws.progress.stream) == before
        assert len(fast.launches.seen) == launches
    assert fast.module.call(0, a, [b], "direct", "another group", 2) is None
    assert fast.module.call(0, a, b, "direct", "g0", 2) is None  # the gather's weights come as a list
    assert fast.module.call(0, a, [b, "not a tensor"], "direct", "g0", 2) is None
    assert fast.module.call(0, a, [b, _meta(8, 3)], "direct", "g0", 2) is None  # another key: two weights
    lane.lanes.clear()


def test_a_busy_ring_or_another_stream_waits_for_the_python_path(fast):
    a, b, ws = _hitting(fast)
    ws.progress.done.value = 0  # the replays issued so far have not finished
    ws.progress.stream = STREAM + 1  # and ran on another stream: this one must wait for them
    before = (ws.epoch, ws.progress.issued, ws.progress.stream)
    _unchanged(fast, ws, a, b, before)
    ws.progress.stream = STREAM
    ws.progress.issued = Progress.RING - 1  # the ring is full
    before = (ws.epoch, ws.progress.issued, ws.progress.stream)
    _unchanged(fast, ws, a, b, before)
    lane.lanes.clear()


def test_a_launch_the_driver_refuses_raises_and_is_not_counted(fast):
    a, b, ws = _hitting(fast)
    ws.progress.done.value = ws.progress.issued
    issued = ws.progress.issued
    fast.launches.result = 700
    try:
        with pytest.raises(RuntimeError, match="cuGraphLaunch failed: 700"):
            _call(fast, "all_gather_matmul", a, b, 2)
    finally:
        fast.launches.result = 0
    assert ws.progress.issued == issued
    lane.lanes.clear()


def test_the_python_path_registers_only_workspaces_it_replays(fast, monkeypatch):
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    monkeypatch.setitem(lane._state, "module", fast.module)
    ws = _workspace()
    lane.register("all_gather_matmul", a, [b], "direct", "g0", 2, ws)
    assert list(lane.lanes.values()) == [ws]
    lane.lanes.clear()
    for off in (SimpleNamespace(progress=None, replays=ws.replays), SimpleNamespace(progress=ws.progress, replays=None)):
        lane.register("all_gather_matmul", a, [b], "direct", "g0", 2, off)  # an event per call / a captured twin
    monkeypatch.setenv("COMPASS_FUSED_LANE", "0")
    lane.register("all_gather_matmul", a, [b], "direct", "g0", 2, ws)
    assert not lane.lanes


def _aged(lock, age_s: float) -> None:
    """``lock`` made (or touched) as if written ``age_s`` ago."""
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))


def test_a_baton_left_by_a_killed_build_is_removed_where_torch_would_wait_for_it(monkeypatch, caplog, tmp_path):
    """torch 2.13's builder waits as long as its lock file exists: one older than STALE_LOCK_S goes at
    once, and a younger one once it is that old (a build killed moments ago: the wait is bounded and,
    past LOCK_PATIENCE_S, said), while a lock the building process removes ends the wait silently."""
    import threading

    monkeypatch.setattr(lane, "builder_locks_by_flock", lambda: False)
    lock = tmp_path / "lock"
    _aged(lock, lane.STALE_LOCK_S + 60)
    with pytest.warns(RuntimeWarning, match="build lock"):
        lane._wait_for_another_build(lock)
    assert not lock.exists()
    monkeypatch.setattr(lane, "STALE_LOCK_S", 3.0)
    monkeypatch.setattr(lane, "LOCK_PATIENCE_S", 1.5)
    monkeypatch.setattr(lane, "LOCK_POLL_S", 0.05)
    _aged(lock, 1.0)  # stale two seconds from now
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="compass_fx"), pytest.warns(RuntimeWarning, match="build lock"):
        lane._wait_for_another_build(lock)
    assert 1.5 <= time.monotonic() - started < 30 and not lock.exists()
    assert "waiting for another process's build" in caplog.text and str(lock) in caplog.text
    _aged(lock, 0.0)  # another process building: it removes its lock when done
    done = threading.Timer(0.3, lambda: lock.unlink(missing_ok=True))
    done.start()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lane._wait_for_another_build(lock)
    done.join()
    assert not lock.exists()


def test_where_torch_holds_an_advisory_lock_only_a_held_one_is_waited_for(monkeypatch, caplog, tmp_path):
    """torch 2.14's builder holds an advisory lock (``flock``) on a file it leaves after every build, so a
    file there, however young, is no build in progress: the wait ends at once, silently, the file left
    as it is (waiting on the file's age stalled every process started within 10 minutes of a build).  A
    lock held by another open file is waited for, said past LOCK_PATIENCE_S, and one held longer than
    STALE_LOCK_S raises instead of waiting with torch for as long as its holder lives."""
    import fcntl
    import threading

    monkeypatch.setattr(lane, "builder_locks_by_flock", lambda: True)
    monkeypatch.setattr(lane, "STALE_LOCK_S", 2.0)
    monkeypatch.setattr(lane, "LOCK_PATIENCE_S", 0.2)
    monkeypatch.setattr(lane, "LOCK_POLL_S", 0.02)
    lock = tmp_path / "lock"
    lane._wait_for_another_build(lock)  # no file: nothing to wait for
    _aged(lock, 0.0)  # the file a finished build left, written just now
    with caplog.at_level("WARNING", logger="compass_fx"), warnings.catch_warnings():
        warnings.simplefilter("error")
        lane._wait_for_another_build(lock)
    assert lock.exists() and caplog.text == ""

    holder = os.open(lock, os.O_RDWR)  # a builder at work: another open file holds the lock
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        done = threading.Timer(0.6, lambda: fcntl.flock(holder, fcntl.LOCK_UN))
        done.start()
        started = time.monotonic()
        with caplog.at_level("WARNING", logger="compass_fx"):
            lane._wait_for_another_build(lock)
        done.join()
        assert time.monotonic() - started >= 0.5 and lock.exists()
        assert "waiting for another process's build" in caplog.text and str(lock) in caplog.text
        fcntl.flock(holder, fcntl.LOCK_EX)  # and one that never lets go
        with pytest.raises(TimeoutError, match="held the host fast path's build lock"):
            lane._wait_for_another_build(lock)
    finally:
        os.close(holder)
    lane._wait_for_another_build(lock)  # its holder gone, the lock is free


def test_the_running_torchs_own_build_lock_let_go_does_not_delay_the_first_call(fast, monkeypatch, caplog):
    """The lock of the running torch's builder (torch 2.13: a file it removes when done; 2.14: an advisory
    lock on a file it leaves), taken and let go as by a build that finished: the next process's first
    call loads the cached build without a wait or a word (a wait would be said at once here, and a lock
    taken for stale would be removed with a warning, both errors here)."""
    monkeypatch.setattr(lane, "LOCK_PATIENCE_S", 0.0)
    monkeypatch.setattr(lane, "STALE_LOCK_S", 5.0)
    lock = lane.build_directory() / "lock"
    builder = lane._builder()
    if lane.builder_locks_by_flock():
        with builder.FileLock(str(lock)):
            pass
        assert lock.exists()  # what makes a file's age no sign of a build
    else:
        baton = builder.FileBaton(str(lock))
        assert baton.try_acquire()
        baton.release()
    with caplog.at_level("WARNING", logger="compass_fx"), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lane.compile_module().call is fast.module.call
    assert caplog.text == ""


def test_an_allocation_that_fails_leaves_the_call_to_the_python_path(fast):
    """A C++ error before the call is committed (here the outputs' allocation) declines instead of
    ending the process; the Python path then meets the allocator's error and raises it."""
    a, b = torch.empty(4, 8), torch.empty(8, 6)
    world = 2 ** 50  # outputs of 2**52 rows: more than any host has
    ws = _workspace()
    lane.lanes[fast.module.key(0, a, [b], "direct", "g0", world)] = ws
    assert fast.module.call(0, a, [b], "direct", "g0", world) is None
    assert (ws.epoch, ws.progress.issued) == (0, 0)
    lane.lanes.clear()


def test_a_first_build_says_it_takes_a_while_and_a_cached_one_does_not(fast, monkeypatch, caplog, tmp_path):
    """The first workspace of a process compiles the extension where no build is cached (~20 s, in the
    middle of a first step): a warning says so first; a cached build loads without a word."""
    import logging

    assert lane.is_cached()  # the fixture's build
    monkeypatch.setattr(lane, "build_directory", lambda: tmp_path)
    assert not lane.is_cached()

    def no_compiler():
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(lane, "compile_module", no_compiler)
    for cached in (False, True):
        if cached:
            (tmp_path / "compass_lane.so").write_bytes(b"")
            assert lane.is_cached()
            source = tmp_path / "lane.cpp"  # a source changed after the build: built again, and said so
            source.write_text("// changed")
            later = (tmp_path / "compass_lane.so").stat().st_mtime + 60
            os.utime(source, (later, later))
            with monkeypatch.context() as m:
                m.setattr(lane, "_SOURCE", source)
                assert not lane.is_cached()
        monkeypatch.setattr(lane, "_state", {})
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="compass_fx"), \
                pytest.warns(RuntimeWarning, match="host fast path is off .*no compiler here"):
            assert lane.module(transports={}, join=object, raw_stream=None, capturing=None) is None
        assert ("building the host fast path" in caplog.text) == (not cached), caplog.text


class Entry:
    """A .graph overload's Python entry or its kernel's Python path, as the C entry hands a call on:
    records what it was called with; returns the input (a tensor: vmap wants one back)."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple, dict]] = []
        self.through_dispatcher = "the dispatcher"

    def __call__(self, *args, **kwargs):
        self.seen.append((args, kwargs))
        return args[0]


QUIET = (torch._C._len_torch_dispatch_stack, torch._C._is_torch_function_mode_enabled,
         torch._C._are_functorch_transforms_active)


@pytest.fixture
def entry(fast):
    """The reduce-scatter's and the gather's C entries over meta tensors (the kernel's device here),
    with the fast path on (a non-empty fast_calls), as lane.install_entries makes them for CUDA."""
    on = [fast.module.call]
    fast.module.configure_direct(torch.Tensor, QUIET, on, "meta")
    made = {}
    for name, op, listed in (("scatter", "matmul_reduce_scatter", False), ("gather", "all_gather_matmul", True)):
        fallback, python_path = Entry(), Entry()
        made[name] = SimpleNamespace(call=fast.module.direct(lane.OPS[op], fallback, python_path, listed),
                                   fallback=fallback, python_path=python_path)
    yield SimpleNamespace(on=on, **made)
    lane.lanes.clear()


ENTRY_CASES = {"reduce-scatter": "scatter", "gather": "gather", "gather, three weights": "gather"}


def _entry_case(fast, case: str):
    op, a_shape, b_shapes, world, _ = CASES[case]
    a, bs = _meta(*a_shape), [_meta(*shape) for shape in b_shapes]
    b = bs[0] if op == "matmul_reduce_scatter" else bs
    ws = _workspace()
    lane.lanes[_key(fast, op, a, b, world)] = ws
    return a, b, world, ws


@pytest.mark.parametrize("case", sorted(ENTRY_CASES))
def test_the_graph_overloads_c_entry_issues_a_plain_call_and_hands_on_one_it_declines(fast, entry, case):
    """A plain call (exact tensors on the kernel's device, no mode, no gradient wanted) goes from the
    overload's entry straight to the replay, no Python called; one C declines (no graph yet) goes to
    the kernel's Python path with its arguments, not back through the entry.  A gather of three
    weights (Q, K and V sharing their gathered rows) is as plain as one of one."""
    e = getattr(entry, ENTRY_CASES[case])
    a, b, world, ws = _entry_case(fast, case)
    args = (a, b, "direct", "g0", world)
    assert e.call(*args) is a  # no graph: declined, the Python path's answer
    assert e.python_path.seen == [(args, {})] and e.fallback.seen == []
    ws.replays.graphs[fast.module.last_addresses()] = [Graph(0x3000 + phase) for phase in range(4)]
    for epoch in (1, 2):
        launches = len(fast.launches.seen)
        out = e.call(*args)
        assert out is not a and len(fast.launches.seen) == launches + 1
        assert fast.launches.seen[-1] == (0x3000 + epoch % 4, STREAM) and ws.epoch == epoch
    if ENTRY_CASES[case] == "gather":
        assert [tuple(t.shape) for t in out[1]] == [tuple(w.shape) for w in b] and out[1][0] is not a
    with torch.no_grad():  # a gradient not wanted: plain however the inputs require one
        a.requires_grad_()
        b_last = b[-1] if isinstance(b, list) else b
        b_last.requires_grad_()
        assert e.call(*args) is not a and ws.epoch == 3
    assert len(e.python_path.seen) == 1 and e.fallback.seen == []
    assert e.call.through_dispatcher == "the dispatcher"


def _not_plain():
    """Calls the C entry must hand to the overload's Python entry untouched: (label, how to call)."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def under(mode):
        def call(e, args):
            with mode():
                return e.call(*args)
        return call

    def requires_grad(e, args):
        args[0].requires_grad_()
        return e.call(*args)

    def last_weight(change):  # the call with its (last) weight changed
        def call(e, args):
            b = args[1]
            b = b[:-1] + [change(b[-1])] if isinstance(b, list) else change(b)
            return e.call(args[0], b, *args[2:])
        return call

    return {
        "keywords": lambda e, args: e.call(*args[:4], group_size=args[4]),
        "four arguments": lambda e, args: e.call(*args[:4]),
        "a tensor subclass": lambda e, args: e.call(torch.nn.Parameter(args[0], requires_grad=False), *args[1:]),
        "another device": lambda e, args: e.call(torch.empty(args[0].shape), *args[1:]),
        "a dispatch mode": under(Passing),
        "a torch-function mode": under(TorchFunctionMode),
        "a functorch transform": lambda e, args: torch.func.vmap(lambda x: e.call(x, *args[1:]))(
            _meta(2, *args[0].shape)),
        "a gradient wanted": requires_grad,
        "a weight a tensor subclass": last_weight(lambda w: torch.nn.Parameter(w, requires_grad=False)),
        "a weight wanting a gradient": last_weight(lambda w: w.requires_grad_()),
        "the fast path set aside": None,  # fast_calls emptied, as COMPASS_FUSED_LANE's A/B does
    }


@pytest.mark.parametrize("case", sorted(_not_plain()))
@pytest.mark.parametrize("entry_case", sorted(ENTRY_CASES))
def test_the_c_entry_hands_anything_but_a_plain_call_to_the_python_entry(fast, entry, entry_case, case):
    e = getattr(entry, ENTRY_CASES[entry_case])
    a, b, world, ws = _entry_case(fast, entry_case)
    args = (a, b, "direct", "g0", world)
    e.call(*args)
    ws.replays.graphs[fast.module.last_addresses()] = [Graph(0x3000 + phase) for phase in range(4)]
    assert e.call(*args) is not a and ws.epoch == 1  # plain: issued from C
    how = _not_plain()[case]
    if how is None:
        entry.on.clear()
        how = lambda e, args: e.call(*args)  # noqa: E731
    launches = len(fast.launches.seen)
    how(e, args)
    assert len(e.fallback.seen) == 1 and len(e.python_path.seen) == 1  # the declined first call's only
    assert len(fast.launches.seen) == launches and ws.epoch == 1


@pytest.mark.parametrize("weights", ["none", "a tuple"])
def test_a_gather_is_plain_with_a_list_of_weights_only(fast, entry, weights):
    """As ops._direct's entry: a gather's weights come as a list of at least one."""
    a, bs = _meta(4, 8), [_meta(8, 6), _meta(8, 5)]
    b = [] if weights == "none" else tuple(bs)
    entry.gather.call(a, b, "direct", "g0", 2)
    assert entry.gather.fallback.seen == [((a, b, "direct", "g0", 2), {})] and entry.gather.python_path.seen == []


def test_the_fast_path_built_installs_the_c_entries_over_the_python_ones(fast, monkeypatch):
    """lane.install_entries: each offered overload's entry becomes the C one, the Python one its fallback."""
    fallback = Entry()
    overload = SimpleNamespace(_op=fallback)
    monkeypatch.setattr(lane, "entries", [(overload, "matmul_reduce_scatter", Entry(), False)])
    lane.install_entries(fast.module, device_type="meta")
    assert overload._op.fallback is fallback and overload._op.through_dispatcher == "the dispatcher"
    first = overload._op
    lane.install_entries(fast.module, device_type="meta")  # again: replaced, not wrapped
    assert overload._op is not first and overload._op.fallback is fallback
    overload._op(torch.empty(8, 8), _meta(8, 6), "direct", "g0", 2)  # another device: the Python entry
    assert len(fallback.seen) == 1
