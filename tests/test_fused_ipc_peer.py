"""The peer transport with ranks sharing one GPU: each rank maps the others' flags and buffers with
CUDA IPC (torch's symmetric memory refuses ranks on one device), so the plans an NVLink machine
runs (device-to-device pulls, flags in GPU memory) run, and are checked, on one GPU.  Needs a GPU;
two ranks spawned once for the module (the session's gloo pool forks, and a forked process cannot
use CUDA)."""
from __future__ import annotations

import pytest
import torch

TOLERANCE = 2e-2  # of the largest element: bf16 products summed in another order than the reference


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double().cpu() - want).abs().max() / want.abs().max())


def _seeded(step: int, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """One step's inputs of every rank, seeded, as bf16 values held in float64 (the references'):
    the gathers' 128-row shards, the reductions' 256-row inputs, a 256x192 and a 256x64 weight."""
    g = torch.Generator().manual_seed(step)
    shards = [torch.randn(128, 256, generator=g).bfloat16().double() for _ in range(world)]
    full = [torch.randn(256, 256, generator=g).bfloat16().double() for _ in range(world)]
    return (shards, full, torch.randn(256, 192, generator=g).bfloat16().double(),
            torch.randn(256, 64, generator=g).bfloat16().double())


def _peer_transport_calls(rank: int, world: int, init: str, out_dir: str, transport: str = "peer",
                          our_kernels: bool = True) -> None:
    """Ten calls of each fused operator through the ``.graph`` overloads (issued, captured, then
    replayed: from C by the host fast path, but for one call from Python; then, on the peer transport,
    ten all-reduces on the ring, whose two replays run from C as one call), on new seeded values each
    time, against references from every rank's inputs (at four ranks the all-reduce's replay waits
    for each chunk's three peers as one batch).
    ``transport``: "host" for the host-staged plans; ``our_kernels`` False: replay graphs as where
    the flag and copy kernels do not load (stream operations and copy-engine copies only)."""
    import json
    import os

    import torch.distributed as dist

    import compass_fx.kernels  # noqa: F401  (registers torch.ops.compass)
    from compass_fx.kernels.cuda import impl

    os.environ["COMPASS_FUSED_TRANSPORT"] = transport
    if not our_kernels:
        from compass_fx.kernels.cuda import replay

        replay.kernel_nodes = lambda device_index: False
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        group, world = dist.group.WORLD.group_name, dist.get_world_size()
        worst = 0.0
        cuda = {"dtype": torch.bfloat16, "device": "cuda"}
        # the inputs in the same device tensors every call and the outputs freed before the next:
        # each operator's calls see one set of addresses, so from the second on they replay
        shard, a, w = torch.empty(128, 256, **cuda), torch.empty(256, 256, **cuda), torch.empty(256, 192, **cuda)
        w2 = torch.empty(256, 64, **cuda)  # a second weight of the same gathered rows (as Q, K and V share them)
        from compass_fx.kernels.cuda import lane, replay

        for step in range(10):
            os.environ["COMPASS_FUSED_LANE"] = "0" if step == 7 else "1"  # the two paths take turns
            if step == 7:
                before_python_step = dict(replay.stats)
            if step == 8:
                python_step = {k: replay.stats[k] - before_python_step[k] for k in ("replayed", "lane")}
            shards, full, w_host, w2_host = _seeded(step, world)
            shard.copy_(shards[rank])
            a.copy_(full[rank])
            w.copy_(w_host)
            w2.copy_(w2_host)
            gathered, (out,) = torch.ops.compass.all_gather_matmul.graph(shard, [w], "direct", group, world)
            everyone = torch.cat(shards)
            worst = max(worst, _close(gathered, everyone), _close(out, everyone @ w_host))
            del gathered, out
            gathered, (out, out2) = torch.ops.compass.all_gather_matmul.graph(shard, [w, w2], "direct", group, world)
            worst = max(worst, _close(gathered, everyone), _close(out, everyone @ w_host),
                        _close(out2, everyone @ w2_host))
            del gathered, out, out2
            total = sum(x @ w_host for x in full)
            rows = total.shape[0] // world
            scattered = torch.ops.compass.matmul_reduce_scatter.graph(a, w, "direct", group, world)
            worst = max(worst, _close(scattered, total[rank * rows:(rank + 1) * rows]))
            del scattered
            reduced = torch.ops.compass.matmul_all_reduce.graph(a, w, "direct", group, world)
            worst = max(worst, _close(reduced, total))
            del reduced
        torch.cuda.synchronize()
        stats = dict(replay.stats)
        # one more replayed call of each, watching for Python frames of ours: a plain call runs none of
        # ops.py's (its entry or kernel), a gather of two weights too (it took the dispatcher and the
        # kernel in Python while only one weight counted as plain)
        frames = {name: _python_frames(call) for name, call in (
            ("gather", lambda: torch.ops.compass.all_gather_matmul.graph(shard, [w], "direct", group, world)),
            ("gather, two weights", lambda: torch.ops.compass.all_gather_matmul.graph(shard, [w, w2], "direct",
                                                                                      group, world)),
            ("reduce-scatter", lambda: torch.ops.compass.matmul_reduce_scatter.graph(a, w, "direct", group, world)),
            ("all-reduce", lambda: torch.ops.compass.matmul_all_reduce.graph(a, w, "direct", group, world)))}
        torch.cuda.synchronize()
        stats_frames = {k: replay.stats[k] - stats[k] for k in ("replayed", "lane")}
        from compass_fx import fused_calls

        ring_from_c = []  # the ring's all-reduce (the cost model picks the ring where GPUs reach each other): a
        # fused reduce-scatter, then a gather of the sums; once both have graphs, two replays from one lane
        ring_settled = None  # its last four calls read as one step would: fused_calls().since(before the sixth)
        for step in range(10 if transport == "peer" else 0):
            if step == 6:
                before_sixth = fused_calls()
            g = torch.Generator().manual_seed(100 + step)
            full = [torch.randn(256, 256, generator=g).bfloat16().double() for _ in range(world)]
            a.copy_(full[rank])
            before = replay.stats["lane"]
            reduced = torch.ops.compass.matmul_all_reduce.graph(a, w, "ring", group, world)
            ring_from_c.append(replay.stats["lane"] - before)
            worst = max(worst, _close(reduced, sum(x @ w_host for x in full)))
            del reduced
            if step == 9:
                ring_settled = fused_calls().since(before_sixth).settled
        torch.cuda.synchronize()
        # what replay graphs keep: a weight of its own for each of four more call sites of the reductions
        # (a set of addresses each, captured on its second call), the GPU memory reserved around them;
        # a graph keeps what its capture allocated, and a sum of more than two terms allocated nothing
        # only since it accumulates in the workspace's rows (each graph kept a segment of its own before)
        weights = [w.clone() for _ in range(4)]
        total = sum(x @ w_host for x in full)  # a holds this rank's rows of the last inputs, every weight w's values
        rows = total.shape[0] // world
        torch.cuda.empty_cache()
        reserved, captured = torch.cuda.memory_reserved(), replay.stats["captured"]
        for weight in weights:
            for _ in range(2):
                scattered = torch.ops.compass.matmul_reduce_scatter.graph(a, weight, "direct", group, world)
                reduced = torch.ops.compass.matmul_all_reduce.graph(a, weight, "direct", group, world)
                worst = max(worst, _close(scattered, total[rank * rows:(rank + 1) * rows]), _close(reduced, total))
                del scattered, reduced
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        graphs_kept = {"bytes": torch.cuda.memory_reserved() - reserved,
                       "captured": replay.stats["captured"] - captured}
        mapped = [ws for ws in impl._workspaces.values() if ws.transport == transport]
        result = {"worst": worst, "workspaces": len(mapped), "replayed": stats["replayed"], "graphs_kept": graphs_kept,
                  "captured": stats["captured"], "from_c": stats["lane"], "ring_from_c": ring_from_c,
                  "ring_settled": ring_settled,
                  "python_step": python_step, "fast_path_off": lane._state.get("failed"),
                  "frames": frames, "frames_stats": stats_frames,
                  "wait_batches": sum(len(ws.plan.wait_runs()) for ws in mapped),
                  "ipc": transport == "peer" and all(isinstance(ws.memory[1], dict) for ws in mapped),
                  "counted_on_gpu": sum(ws.progress is not None for ws in mapped),
                  # replay steps that issue a run of pulls as 2D copies (impl._join_copies)
                  "joined_replay_copies": sum(getattr(step, "__name__", "") == "copy_all"
                                              for ws in mapped for step in ws.replay_steps[0])}
        usage = fused_calls()  # what a user reads after a few steps
        result["usage"] = {"replayed": usage.replayed, "from_c": usage.from_c, "issued": usage.issued,
                           "stopped": [w.op for w in usage.workspaces if w.stopped],
                           "ops_with_graphs": sorted({w.op for w in usage.workspaces if w.graphs}),
                           "text": str(usage)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _python_frames(call) -> list[str]:
    """The Python functions of compass_fx that ``call`` runs (file:function, in order)."""
    import os
    import sys

    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and "compass_fx" in frame.f_code.co_filename:
            seen.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        out = call()
    finally:
        sys.setprofile(None)
    del out
    return seen


def _shares_a_gpu(rank: int, ids: list[str]) -> bool:
    import torch.distributed as dist

    from compass_fx.kernels.cuda import impl

    return impl._ranks_share_a_gpu(dist.group.WORLD, 0, gpu_id=lambda index: ids[rank])


def test_every_rank_reaches_the_same_answer_on_sharing_a_gpu(ranks):
    """Which memory the peer transport maps (symmetric memory, or CUDA IPC for ranks on one GPU) is
    decided from every rank's GPU, so both ranks answer alike, whoever holds the shared one."""
    pool = ranks(2)
    assert pool.run(_shares_a_gpu, ["GPU-a", "GPU-a"]) == [True, True]
    assert pool.run(_shares_a_gpu, ["GPU-a", "GPU-b"]) == [False, False]


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_peer_transport_on_one_gpu(tmp_path, world):
    import json

    import torch.multiprocessing as mp

    mp.spawn(_peer_transport_calls, args=(world, f"file://{tmp_path}/store", str(tmp_path)), nprocs=world)
    for rank in range(world):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["workspaces"] >= 4 and r["ipc"], r  # every operator's workspace, peers mapped with CUDA IPC
        assert r["worst"] < TOLERANCE, r
        assert r["replayed"] >= 4 * 8, r  # calls 2-10 of each operator (a set captured on its second sighting)
        # every replay from C but the captures and the eighth calls (the host fast path set aside)
        assert r["python_step"]["lane"] == 0 and r["fast_path_off"] is None, r
        assert r["from_c"] == r["replayed"] - r["captured"] - r["python_step"]["replayed"] >= 4 * 3, r
        # a plain call, a gather of two weights too, enters C from OpOverload.__call__: no Python of ops.py
        assert r["frames_stats"] == {"replayed": 4, "lane": 4}, r
        assert not [f for frames in r["frames"].values() for f in frames if f.startswith("ops.py")], r["frames"]
        assert (r["wait_batches"] > 0) == (world > 2), r  # the all-reduce's runs of waits, batched
        # the ring's all-reduce, once its two calls' graphs exist (by the sixth call): both replays from C, every call
        assert r["ring_from_c"][6:] == [2] * 4, r
        assert r["ring_settled"] is True, r  # and fused_calls().since() over those calls says the run settled
        # eight more graphs (two reductions at four call sites) keep no GPU memory: at four ranks each kept a
        # segment of its private pool for its sum (2 MiB here) until the sums moved into the workspace's rows
        assert r["graphs_kept"]["captured"] == 8 and r["graphs_kept"]["bytes"] < 1 << 20, r["graphs_kept"]
        # compass_fx.fused_calls() says the same: the replays, the first calls issued, every operator's graphs
        usage = r["usage"]
        assert usage["replayed"] >= r["replayed"] and usage["from_c"] >= r["from_c"] and usage["issued"] >= 4, usage
        assert usage["ops_with_graphs"] == ["all_gather_matmul", "matmul_all_reduce", "matmul_reduce_scatter"], usage
        assert not usage["stopped"] and "replayed" in usage["text"], usage


@pytest.mark.gpu
def test_host_staged_replays_without_our_kernels_on_one_gpu(tmp_path):
    """Where the flag and copy kernels cannot load, host-staged replays keep the stream operations
    and copy-engine copies an issued call makes, in the guarded order, their rounds of pulls joined
    into 2D copies as the issued calls' are: every result right at four ranks."""
    import json

    import torch.multiprocessing as mp

    world = 4
    mp.spawn(_peer_transport_calls, args=(world, f"file://{tmp_path}/store", str(tmp_path), "host", False),
             nprocs=world)
    for rank in range(world):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["workspaces"] >= 4 and r["counted_on_gpu"] == 0, r  # no kernel counts a replay done
        assert r["worst"] < TOLERANCE, r
        assert r["replayed"] >= 4 * 8 and r["from_c"] == 0, r  # the fast path needs the count on the GPU
        assert r["joined_replay_copies"] > 0, r


def _deferred_calls(rank: int, world: int, init: str, out_dir: str, transport: str) -> None:
    """Ten steps of ``fused_async``'s calls: a reduce-scatter's and an all-reduce's ``*_start`` (on the
    peer transport also the ring all-reduce's, whose gather of the sums is the deferred part), each
    with a gather (another workspace) while it is outstanding and its input overwritten on the
    caller's stream before its ``wait_tensor``, then checked against references from every rank's
    inputs.  Per step and call: the graphs it replayed."""
    import json
    import os

    import torch.distributed as dist

    import compass_fx.kernels  # noqa: F401  (registers torch.ops.compass)
    from compass_fx.kernels.cuda import impl, replay

    os.environ["COMPASS_FUSED_TRANSPORT"] = transport
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        group = dist.group.WORLD.group_name
        cuda = {"dtype": torch.bfloat16, "device": "cuda"}
        shard, a = torch.empty(128, 256, **cuda), torch.empty(256, 256, **cuda)
        w_gather, w = torch.empty(256, 64, **cuda), torch.empty(256, 192, **cuda)
        wait = torch.ops._c10d_functional.wait_tensor
        starts = [("reduce-scatter", torch.ops.compass.matmul_reduce_scatter_start, "direct"),
                  ("all-reduce", torch.ops.compass.matmul_all_reduce_start, "direct")]
        if transport == "peer":
            starts.append(("ring all-reduce", torch.ops.compass.matmul_all_reduce_start, "ring"))
        worst, replayed = 0.0, {name: [] for name, _, _ in starts}
        inside = {name: [] for name, _, _ in starts}
        for step in range(10):
            shards, full, w_host, wg_host = _seeded(step, world)
            shard.copy_(shards[rank])
            w_gather.copy_(wg_host)
            w.copy_(w_host)
            total = sum(x @ w_host for x in full)
            rows = total.shape[0] // world
            everyone = torch.cat(shards)
            for name, start, schedule in starts:
                a.copy_(full[rank])
                before = replay.stats["replayed"]
                out = start(a, w, schedule, group, world)
                replayed[name].append(replay.stats["replayed"] - before)
                a.fill_(7.0)  # the caller's stream may overwrite the input once the start returns
                before = replay.stats["replayed"]
                gathered, (product,) = torch.ops.compass.all_gather_matmul.graph(shard, [w_gather], "direct",
                                                                                 group, world)
                inside[name].append(replay.stats["replayed"] - before)
                worst = max(worst, _close(gathered, everyone), _close(product, everyone @ wg_host))
                del gathered, product
                want = total[rank * rows:(rank + 1) * rows] if name == "reduce-scatter" else total
                worst = max(worst, _close(wait(out), want))
                del out
        torch.cuda.synchronize()
        result = {"worst": worst, "replayed": replayed, "inside": inside,
                  "outstanding": impl.Join.outstanding,
                  "pending": sum(ws.pending is not None for ws in impl._workspaces.values())}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("transport,world", [("host", 2), ("peer", 2), ("host", 4)])
def test_deferred_calls_replay_on_one_gpu(tmp_path, transport, world):
    """``fused_async``'s deferred calls replay from their second step on, as the calls issued while
    they are outstanding do (once, no eager call replayed while a deferred one was out), and every
    result is right although the caller overwrote each call's input before joining it."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_deferred_calls, args=(world, f"file://{tmp_path}/store", str(tmp_path), transport), nprocs=world)
    for rank in range(world):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["worst"] < TOLERANCE, r
        for name, counts in r["replayed"].items():
            # a set of addresses is captured on its second sighting (a ring all-reduce: two graphs)
            assert all(c >= 1 for c in counts[3:]), (name, r)
            assert all(c == 1 for c in r["inside"][name][3:]), (name, r)
        assert r["outstanding"] == 0 and r["pending"] == 0, r
