"""Where a replayed fused call's host microseconds go, and what an InterDecom part's launches cost
alone (issue 27).  One GPU; three sections, each recorded even if another fails:

* ``graph_launch``: host us of one ``cuGraphLaunch`` of a captured graph of N nodes of one kind
  (kernels, GEMMs small and large, copies device->device small and large, copies to and from
  pinned host memory, stream memory writes and waits, and a two-stream mix like a fused call's),
  launched on an idle GPU and behind a busy one: which kinds of nodes the launch pays per node,
  and whether it pays for their size.
* ``fused``: ranks sharing the GPU (host transport, as ``fused_host_time.py``): per case the host
  us of a replayed ``.graph`` call, the part of it spent in ``cuGraphLaunch``, the same with the
  GPU kept busy (a sleep queued first), the captured graph's nodes by kind, and cProfile's top
  frames for the largest case.
* ``part``: a one-rank NCCL group: the launches an InterDecom part can be made of, alone.

    python benchmarks/host_cost_probe.py --worlds 2,4     # writes host_cost_probe-h200.{json,md}
"""
from __future__ import annotations

import ctypes
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import output  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

NAME = "host_cost_probe"
SLEEP_CYCLES_PER_S = 1.98e9
NODE_KINDS = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "sem_signal", 9: "sem_wait", 10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op",
              13: "conditional"}


def _node_kinds(graph_handle: int) -> dict[str, int]:
    lib = ctypes.CDLL("libcuda.so.1")
    n = ctypes.c_size_t(0)
    lib.cuGraphGetNodes.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    lib.cuGraphNodeGetType.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    assert lib.cuGraphGetNodes(graph_handle, None, ctypes.byref(n)) == 0
    nodes = (ctypes.c_void_p * n.value)()
    assert lib.cuGraphGetNodes(graph_handle, nodes, ctypes.byref(n)) == 0
    out: dict[str, int] = {}
    for node in nodes:
        t = ctypes.c_int()
        lib.cuGraphNodeGetType(node, ctypes.byref(t))
        name = NODE_KINDS.get(t.value, str(t.value))
        out[name] = out.get(name, 0) + 1
    return out


def launch_us(fn, busy: bool, rounds: int = 15, per_round: int = 1) -> float:
    """Median host us of ``per_round`` calls of ``fn`` from an idle GPU (or behind a 3 ms sleep)."""
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(int(3e-3 * SLEEP_CYCLES_PER_S))
        t0 = time.perf_counter()
        for _ in range(per_round):
            fn()
        times.append((time.perf_counter() - t0) / per_round * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


# ---- section 1 ---------------------------------------------------------------------------------
def graph_launch() -> list[dict]:
    from compass_fx.kernels.cuda import driver

    memcpy, write, wait = driver.raw("memcpy"), driver.raw("write"), driver.raw("wait")
    dev = "cuda"
    small_a = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
    small_b = torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    small_c = torch.empty(256, 1024, device=dev, dtype=torch.bfloat16)
    big_a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    big_b = torch.randn(4096, 7168, device=dev, dtype=torch.bfloat16)
    big_c = torch.empty(4096, 7168, device=dev, dtype=torch.bfloat16)
    src = torch.empty(64 << 20, device=dev, dtype=torch.uint8)
    dst = torch.empty_like(src)
    host = torch.empty(64 << 20, dtype=torch.uint8).pin_memory()
    flags = torch.ones(4096, dtype=torch.int32, device=dev)
    x = torch.zeros(16, device=dev)
    side = torch.cuda.Stream(priority=-1)
    cap = torch.cuda.Stream()
    with torch.cuda.stream(cap):
        torch.mm(small_a, small_b, out=small_c)
    torch.cuda.synchronize()

    def one(kind: str, i: int, main) -> None:
        h = main.cuda_stream
        if kind == "kernel_tiny":
            x.add_(1)
        elif kind == "gemm_small":
            torch.mm(small_a, small_b, out=small_c)
        elif kind == "gemm_large":
            torch.mm(big_a, big_b, out=big_c)
        elif kind == "copy_d2d_4k":
            memcpy(dst.data_ptr() + 4096 * i, src.data_ptr() + 4096 * i, 4096, h)
        elif kind == "copy_d2d_4m":
            memcpy(dst.data_ptr() + (i % 16) * (4 << 20), src.data_ptr(), 4 << 20, h)
        elif kind == "copy_d2h_4m":
            memcpy(host.data_ptr() + (i % 16) * (4 << 20), src.data_ptr(), 4 << 20, h)
        elif kind == "copy_h2d_4m":
            memcpy(dst.data_ptr() + (i % 16) * (4 << 20), host.data_ptr(), 4 << 20, h)
        elif kind == "mem_write":
            write(h, flags.data_ptr() + 4 * i, 1, 0)
        elif kind == "mem_wait":
            wait(h, flags.data_ptr() + 4 * i, 1, driver.WAIT_AND)
        elif kind == "mix_two_streams":  # (wait, copy, write) on a side stream, a GEMM every 2, events
            ev = torch.cuda.Event()
            ev.record(main)
            side.wait_event(ev)
            s = side.cuda_stream
            wait(s, flags.data_ptr() + 4 * i, 1, driver.WAIT_AND)
            memcpy(dst.data_ptr() + 4096 * i, src.data_ptr() + 4096 * i, 4096, s)
            write(s, flags.data_ptr() + 4 * (i + 2048), 1, 0)
            back = torch.cuda.Event()
            back.record(side)
            if i % 2 == 0:
                main.wait_event(back)
                torch.mm(small_a, small_b, out=small_c)
            else:
                main.wait_event(back)

    rows = []
    for kind in ("kernel_tiny", "gemm_small", "gemm_large", "copy_d2d_4k", "copy_d2d_4m", "copy_d2h_4m",
                 "copy_h2d_4m", "mem_write", "mem_wait", "mix_two_streams"):
        for n in (4, 16, 64):
            try:
                g = torch.cuda.CUDAGraph(keep_graph=True)
                with torch.cuda.stream(cap):
                    g.capture_begin(capture_error_mode="thread_local")
                    for i in range(n):
                        one(kind, i, cap)
                    g.capture_end()
                g.instantiate()
                kinds = _node_kinds(g.raw_cuda_graph())
                exec_ = g.raw_cuda_graph_exec()
                glaunch = driver.raw("graph_launch")
                stream = torch.cuda.current_stream().cuda_stream

                def go():
                    driver.check(glaunch(exec_, stream), "cuGraphLaunch")
                go()
                torch.cuda.synchronize()
                rows.append({"kind": kind, "n": n, "nodes": kinds, "idle_us": launch_us(go, False),
                             "busy_us": launch_us(go, True), "busy_x4_us": launch_us(go, True, per_round=4)})
                del g
            except Exception as e:  # noqa: BLE001
                rows.append({"kind": kind, "n": n, "error": f"{type(e).__name__}: {e}"[:300]})
            print(rows[-1], flush=True)
    return rows


# ---- section 2 ---------------------------------------------------------------------------------
FUSED_CASES = [("all_gather_matmul", 256, 4096, 7168), ("all_gather_matmul", 4096, 4096, 7168),
               ("matmul_reduce_scatter", 512, 7168, 4096), ("matmul_reduce_scatter", 2048, 7168, 4096),
               ("matmul_reduce_scatter", 8192, 7168, 4096), ("matmul_all_reduce", 512, 7168, 4096),
               ("matmul_all_reduce", 2048, 7168, 4096), ("matmul_all_reduce", 8192, 7168, 4096)]


def fused_worker(rank: int, world: int, init: str, out_path: str) -> None:
    os.environ["COMPASS_FUSED_TRANSPORT"] = "host"
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import compass_fx.kernels  # noqa: F401
    from compass_fx.kernels.cuda import replay

    kept: list = []
    real_graph = torch.cuda.CUDAGraph

    class KeptGraph(real_graph):  # the probe reads the captured graph's nodes
        def __new__(cls):
            return super().__new__(cls, keep_graph=True)

        def __init__(self):
            super().__init__(keep_graph=True)

        def capture_end(self):
            super().capture_end()
            self.instantiate()
            kept.append(self)

    replay.torch.cuda.CUDAGraph = KeptGraph
    in_launch = [0.0]
    real_launch = replay.Captured.launch

    def timed_launch(self, stream):
        t0 = time.perf_counter()
        real_launch(self, stream)
        in_launch[0] += time.perf_counter() - t0

    replay.Captured.launch = timed_launch
    rows = []
    group_name = dist.group.WORLD.group_name
    for op, m, k, n in FUSED_CASES:
        try:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            fn = getattr(torch.ops.compass, op).graph
            args = (a, [b] if op == "all_gather_matmul" else b, "direct", group_name, world)
            kept.clear()
            for _ in range(12):
                fn(*args)
            torch.cuda.synchronize()
            dist.barrier()
            nodes = _node_kinds(kept[-1].raw_cuda_graph()) if kept else {}
            res = {"world": world, "op": op, "rows": m, "nodes": nodes}
            for busy in (False, True):
                for calls in (1, 4):
                    per = []
                    launch = []
                    for _ in range(9):
                        torch.cuda.synchronize()
                        dist.barrier()
                        if busy:
                            torch.cuda._sleep(int(3e-3 * SLEEP_CYCLES_PER_S))
                        in_launch[0] = 0.0
                        t0 = time.perf_counter()
                        for _ in range(calls):
                            fn(*args)
                        per.append((time.perf_counter() - t0) / calls * 1e6)
                        launch.append(in_launch[0] / calls * 1e6)
                    tag = f"{'busy' if busy else 'idle'}_x{calls}"
                    res[f"call_us_{tag}"] = statistics.median(per)
                    res[f"launch_us_{tag}"] = statistics.median(launch)
            torch.cuda.synchronize()
            dist.barrier()
            if (op, m) in (("matmul_all_reduce", 8192), ("all_gather_matmul", 256)):
                import cProfile
                import pstats

                prof = cProfile.Profile()
                prof.enable()
                for _ in range(20):
                    fn(*args)
                prof.disable()
                torch.cuda.synchronize()
                st = pstats.Stats(prof).stats
                top = sorted(((tt / 20 * 1e6, f"{os.path.basename(f)}:{ln}:{nm}") for (f, ln, nm), (_, nc, tt, ct, _)
                              in st.items()), reverse=True)[:14]
                res["cprofile_self_us"] = [[round(t, 2), w] for t, w in top]
            dist.barrier()
        except Exception as e:  # noqa: BLE001
            res = {"world": world, "op": op, "rows": m, "error": f"{type(e).__name__}: {e}"[:300],
                   "traceback": traceback.format_exc()[-1500:]}
        rows.append(res)
        if rank == 0:
            print(res, flush=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def fused(worlds: list[int]) -> list[dict]:
    rows = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            mp.spawn(fused_worker, args=(world, f"file://{os.path.join(tmp, 'store')}", out), nprocs=world)
            rows += json.load(open(out))
    return rows


# ---- section 3 ---------------------------------------------------------------------------------
def part() -> dict:
    from compass_fx.lowering import row_blocks  # noqa: F401

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        pg = dist.group.WORLD
        gname = pg.group_name
        c10d = torch.ops._c10d_functional
        rows, k, n = 512, 4096, 3584
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        buf = torch.empty(4 * rows, n, device="cuda", dtype=torch.bfloat16)
        gath = torch.empty(rows, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        backend = pg._get_backend(torch.device("cuda"))
        dist.all_gather_into_tensor(gath, x, group=pg)
        torch.cuda.synchronize()

        def pg_gather_wait():
            backend._allgather_base(gath, x).wait()

        def pg_gather_only():
            return backend._allgather_base(gath, x)

        def dist_gather_wait():
            dist.all_gather_into_tensor(gath, x, group=pg, async_op=True).wait()

        stream = torch.cuda.current_stream()
        event = torch.cuda.Event()

        def event_recorded():
            event.record()
            return event

        tests = {
            "funcol_gather+wait_tensor": lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(x, 1, gname)),
            "c10d_backend._allgather_base+wait": pg_gather_wait,
            "c10d_backend._allgather_base(no wait)": pg_gather_only,
            "dist.all_gather_into_tensor(async)+wait": dist_gather_wait,
            "torch.mm(out=contiguous slice)": lambda: torch.mm(x, w, out=buf[rows:2 * rows]),
            "torch.mm(out=y)": lambda: torch.mm(x, w, out=y),
            "torch.mm": lambda: torch.mm(x, w),
            "aten.mm.out via torch.ops": lambda: torch.ops.aten.mm.out(x, w, out=y),
            "compass.mm_into_row_blocks(blocks=1)": lambda: torch.ops.compass.mm_into_row_blocks.default(
                buf, x, w, 1, 0, rows),
            "buf.narrow": lambda: buf.narrow(0, rows, rows),
            "torch.empty": lambda: torch.empty(rows, n, device="cuda", dtype=torch.bfloat16),
            "event_record+stream_wait": lambda: stream.wait_event(event_recorded()),
        }
        out = {}
        for name, fn in tests.items():
            try:
                fn()
                out[name] = {"idle": launch_us(fn, False, rounds=9, per_round=10),
                             "busy": launch_us(fn, True, rounds=9, per_round=10)}
            except Exception as e:  # noqa: BLE001
                out[name] = f"{type(e).__name__}: {e}"[:300]
            torch.cuda.synchronize()
            print(name, out[name], flush=True)
        return out
    finally:
        dist.destroy_process_group()


def markdown(payload: dict) -> str:
    lines = [f"# {NAME} ({payload['tag']})", ""]
    gl = payload.get("graph_launch")
    if isinstance(gl, list):
        lines += ["cuGraphLaunch host us of a graph of n nodes of one kind (idle GPU / behind a sleep / 4 "
                  "launches behind a sleep, per launch):", "",
                  output.markdown_table([dict(r, nodes=json.dumps(r.get("nodes"))) for r in gl],
                                        ["kind", "n", "nodes", "idle_us", "busy_us", "busy_x4_us", "error"]), ""]
    fu = payload.get("fused")
    if isinstance(fu, list):
        lines += ["Replayed `.graph` calls (ranks sharing the GPU, host transport): host us per call and the "
                  "part in cuGraphLaunch, one call or four, from an idle GPU or behind a 3 ms sleep:", "",
                  output.markdown_table([dict(r, nodes=json.dumps(r.get("nodes"))) for r in fu],
                                        ["world", "op", "rows", "nodes", "call_us_idle_x1", "launch_us_idle_x1",
                                         "call_us_idle_x4", "launch_us_idle_x4", "call_us_busy_x1",
                                         "launch_us_busy_x1", "call_us_busy_x4", "launch_us_busy_x4", "error"]), ""]
        for r in fu:
            if "cprofile_self_us" in r:
                lines += [f"cProfile, world {r['world']} {r['op']} {r['rows']}: " +
                          "; ".join(f"{w} {t}" for t, w in r["cprofile_self_us"]), ""]
    pa = payload.get("part")
    if isinstance(pa, dict) and "error" not in pa:
        lines += ["One-rank NCCL, launches alone (host us per call, idle / busy):", "",
                  output.markdown_table([{"what": k, "idle": v["idle"] if isinstance(v, dict) else v,
                                          "busy": v["busy"] if isinstance(v, dict) else None}
                                         for k, v in pa.items()], ["what", "idle", "busy"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2")
    p.add_argument("--sections", default="graph_launch,fused,part")
    p.add_argument("--tag", default="h200")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    payload = {"benchmark": NAME, "tag": args.tag, "environment": output.environment(False)}
    t0 = time.time()
    worlds = [int(w) for w in args.worlds.split(",")]
    for name, fn in (("graph_launch", graph_launch), ("fused", lambda: fused(worlds)), ("part", part)):
        if name not in args.sections.split(","):
            continue
        try:
            payload[name] = fn()
        except Exception as e:  # noqa: BLE001
            payload[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        print(f"{name} done ({time.time() - t0:.0f} s)", flush=True)
        payload["seconds"] = time.time() - t0
        output.write_results(NAME, args.tag, payload, markdown(payload), args.out_dir)
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
