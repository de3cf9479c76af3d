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
    assert not parts_replay.enabled()  # opt in until checked on several GPUs
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
