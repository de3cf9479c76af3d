"""``compass::all_gather_mm_parts`` replayed from CUDA graphs (``lowering/parts_replay.py``): the
settings that turn it off, CPU calls that never replay, and on a GPU (one-rank NCCL group) replays
that compute what the issued launches compute on new values at the same addresses."""
import os
import socket

import pytest
import torch

from compass_fx.lowering import gather_parts, parts_replay


def test_replays_follow_both_settings(monkeypatch):
    monkeypatch.delenv("COMPASS_PARTS_REPLAY", raising=False)
    monkeypatch.delenv("NCCL_GRAPH_MIXING_SUPPORT", raising=False)
    assert parts_replay.enabled()  # on by default (checked with 2 and 4 NCCL ranks: parts_replay_ranks)
    monkeypatch.setenv("COMPASS_PARTS_REPLAY", "1")
    assert parts_replay.enabled()
    monkeypatch.setenv("NCCL_GRAPH_MIXING_SUPPORT", "0")  # captured and eager NCCL calls may not mix
    assert not parts_replay.enabled()
    monkeypatch.setenv("NCCL_GRAPH_MIXING_SUPPORT", "1")
    assert parts_replay.enabled()
    monkeypatch.setenv("COMPASS_PARTS_REPLAY", "0")
    assert not parts_replay.enabled()


def test_a_cpu_call_is_issued_never_replayed(monkeypatch):
    """On CPU tensors (gloo) the parts' gathers block one by one; no graph is ever looked for."""
    asked = []
    monkeypatch.setattr(parts_replay, "replayed", lambda *a, **k: asked.append(a) or True)
    issued = []
    monkeypatch.setattr(gather_parts, "_issue", lambda *a: issued.append(a))
    shard, w = torch.randn(8, 4), torch.randn(4, 3)
    gather_parts._all_gather_mm_parts(shard, [w], 2, 1, "unused")
    assert issued and not asked


def _fake_state(dog, group_name: str):
    """What release() reads of a signature's state: its side stream, watchdog entry and graph."""
    from types import SimpleNamespace

    from compass_fx.kernels.cuda import watchdog

    synced = []
    watched = watchdog.Watched(lambda epoch: ("", None), registered=True)
    dog.watched.append(watched)
    state = SimpleNamespace(side=SimpleNamespace(query=lambda: synced.append(True) or True), dog=dog,
                            watched=watched, graph=object(), synced=synced, what="compass::all_gather_mm_parts")
    return (0, group_name, 4, (512, 64), torch.bfloat16), state


def test_release_drops_a_groups_graphs_after_their_replays_and_stops_watching_them(monkeypatch):
    from compass_fx.kernels.cuda import watchdog

    dog = watchdog.Watchdog(0)
    tp, tp_state = _fake_state(dog, "tp")
    dp, dp_state = _fake_state(dog, "dp")
    monkeypatch.setattr(parts_replay, "_states", {tp: tp_state, dp: dp_state, (0, "tp", 2, (8, 8), None): None})
    assert parts_replay.release("tp") == 1
    assert tp_state.synced and tp_state.graph is None and tp_state.watched not in dog.watched
    assert list(parts_replay._states) == [dp] and dp_state.graph is not None and dp_state.watched in dog.watched
    assert parts_replay.release() == 1 and not parts_replay._states and not dog.watched


def test_release_waits_for_replays_a_bounded_time_and_never_for_a_failed_process(monkeypatch, caplog):
    """A teardown must not hang on a stuck collective: replays still running after the bound are
    dropped with a warning, and a process whose watchdog has failed is not waited for."""
    from types import SimpleNamespace

    from compass_fx.kernels.cuda import watchdog

    dog = watchdog.Watchdog(0)
    key, stuck = _fake_state(dog, "tp")
    stuck.side = SimpleNamespace(query=lambda: stuck.synced.append(True) or False)
    monkeypatch.setattr(parts_replay, "_states", {key: stuck})
    monkeypatch.setattr(parts_replay, "DRAIN_S", 0.05)
    assert parts_replay.release() == 1 and stuck.graph is None and len(stuck.synced) > 1
    assert "had not finished" in caplog.text
    key, failed = _fake_state(dog, "tp")
    failed.side = SimpleNamespace(query=lambda: pytest.fail("a failed process's replays are waited for"))
    dog.failure = "compass: a peer died"
    monkeypatch.setattr(parts_replay, "_states", {key: failed})
    assert parts_replay.release() == 1 and failed.graph is None


def test_destroying_a_process_group_releases_its_graphs_first(monkeypatch):
    """NCCL's communicator destruction waits forever for a live graph holding its collectives, so
    once a graph exists destroy_process_group releases the destroyed group's graphs (every group's
    when it destroys them all) before torch destroys the group."""
    from types import SimpleNamespace

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    order = []
    monkeypatch.setattr(parts_replay, "release", lambda name=None: order.append(("release", name)) or 0)
    monkeypatch.setattr(c10d, "destroy_process_group", lambda group=None: order.append(("destroy", group)))
    monkeypatch.setattr(dist, "destroy_process_group", c10d.destroy_process_group)
    monkeypatch.setattr(parts_replay, "_guarded", [])
    monkeypatch.setattr("atexit.register", lambda fn: order.append(("at exit", fn)))
    parts_replay._release_before_destroy()
    parts_replay._release_before_destroy()  # once only
    assert order == [("at exit", parts_replay.release)]
    dist.destroy_process_group()
    tp = SimpleNamespace(group_name="tp")
    c10d.destroy_process_group(tp)
    assert order[1:] == [("release", None), ("destroy", None), ("release", "tp"), ("destroy", tp)]


@pytest.fixture(scope="module")
def nccl_group():
    import torch.distributed as dist

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("n_weights", [1, 2])
def test_replays_compute_what_the_issued_launches_compute(nccl_group, n_weights, monkeypatch):
    """The first call of a signature is issued, the second captures, the rest replay; each on new
    values, against the same call issued (the parts' launches from Python, as before)."""
    torch.manual_seed(n_weights)
    rows = 512 + 64 * n_weights  # a signature of its own per case
    shard = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(256, 128 * (i + 1), device="cuda", dtype=torch.bfloat16) for i in range(n_weights)]
    op = torch.ops.compass.all_gather_mm_parts.default
    for step in range(6):
        shard = torch.randn_like(shard)  # new values, and a new address now and then
        monkeypatch.setenv("COMPASS_PARTS_REPLAY", "1")
        replayed = op(shard, weights, 4, 1, nccl_group)
        monkeypatch.setenv("COMPASS_PARTS_REPLAY", "0")
        issued = op(shard, weights, 4, 1, nccl_group)
        for r, i, w in zip(replayed, issued, weights):
            assert torch.equal(r, i), step
            assert torch.allclose(r.float(), shard.float() @ w.float(), rtol=2e-2, atol=2e-1), step
    torch.cuda.synchronize()
    state = parts_replay._states[(shard.get_device(), nccl_group, 4, (rows, 256), torch.bfloat16)]
    assert state.calls == 6 and state.graph is not None
    assert state.progress.issued == 5 and state.progress.done.value == 5  # every replay counted finished
    assert state.watched in state.dog.watched  # the watchdog bounds them


@pytest.mark.gpu
def test_a_late_gather_holds_the_gemms_back(nccl_group, monkeypatch):
    """The side stream's graph starts behind a 20 ms sleep; the caller's GEMMs must wait for its
    events, not run on the previous call's gather buffer."""
    monkeypatch.setenv("COMPASS_PARTS_REPLAY", "1")
    shard = torch.randn(384, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    op = torch.ops.compass.all_gather_mm_parts.default
    for _ in range(3):
        op(torch.randn_like(shard), [w], 2, 1, nccl_group)
    state = parts_replay._states[(shard.get_device(), nccl_group, 2, (384, 128), torch.bfloat16)]
    torch.cuda.synchronize()
    with torch.cuda.stream(state.side):
        torch.cuda._sleep(int(20e-3 * 1.98e9))  # queued on the side stream before the next graph
    (out,) = op(shard, [w], 2, 1, nccl_group)
    assert torch.allclose(out.float(), shard.float() @ w.float(), rtol=2e-2, atol=2e-1)
