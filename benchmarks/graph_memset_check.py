"""A replay graph's memsets as kernels (``compass_fx.kernels.cuda.graph_edit``), checked on ONE GPU.

Why (issue 27): a memset node costs ``cuGraphLaunch`` ~2 us of host, a kernel node next to nothing,
and cuBLAS clears its workspace with a memset before many GEMMs.  This checks that the edited
graph computes exactly what the captured one does and says what the edit saves:

* ``memsets``: driver memsets (8-, 16- and 32-bit values, 1-D and pitched 2-D, aligned and not, a
  few bytes to 64 MiB) captured into a graph, run with and without the edit over a buffer of
  noise: the two buffers must be equal byte for byte;
* ``gemms``: a chain of GEMMs whose captured graph has cuBLAS's memsets, run edited and not:
  equal results bit for bit, the node kinds before and after, and the host us of one launch of each.

    python benchmarks/graph_memset_check.py   # writes graph_memset_check-h200.{json,md}
"""
from __future__ import annotations

import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import output  # noqa: E402
import torch  # noqa: E402

from host_cost_probe import _node_kinds  # noqa: E402

NAME = "graph_memset_check"
# (element bytes, byte offset into the buffer, width in elements, height, pitch in bytes or 0 for 1-D)
MEMSETS = [(1, 0, 4096, 1, 0), (1, 3, 1001, 1, 0), (2, 2, 777, 1, 0), (4, 0, 1 << 24, 1, 0), (4, 4, 12345, 1, 0),
           (1, 0, 4096, 8, 8192), (1, 5, 100, 7, 333), (2, 0, 640, 5, 4096), (4, 8, 300, 3, 2000), (1, 0, 16, 1, 0)]
GEMMS = [(8192, 4096, 7168), (4096, 7168, 4096), (2048, 4096, 7168)]


def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    u64, p = ctypes.c_uint64, ctypes.c_void_p
    sizes = {1: ("cuMemsetD8Async", ctypes.c_ubyte), 2: ("cuMemsetD16Async", ctypes.c_ushort),
             4: ("cuMemsetD32Async", ctypes.c_uint)}
    out = {}
    for size, (name, value) in sizes.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = [u64, value, ctypes.c_size_t, p], ctypes.c_int
        f2 = getattr(lib, name.replace("D", "D2D", 1))
        f2.argtypes, f2.restype = [u64, ctypes.c_size_t, value, ctypes.c_size_t, ctypes.c_size_t, p], ctypes.c_int
        out[size] = (f, f2)
    return out


def _graph(fn, edit: bool):
    """``fn`` captured (kept), edited if asked, instantiated; (graph, node kinds, memsets replaced)."""
    from compass_fx.kernels.cuda import replay

    stream = replay._capture_stream(0)
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(stream):
        g.capture_begin(capture_error_mode="thread_local")
        fn(stream.cuda_stream)
        g.capture_end()
    replaced = replay.edit(g.raw_cuda_graph(), replay.memset_kernel(0)) if edit else 0
    kinds = _node_kinds(g.raw_cuda_graph())
    g.instantiate()
    return g, kinds, replaced


def check_memsets() -> list[dict]:
    drv = _driver()
    rows = []
    noise = torch.randint(0, 256, (96 << 20,), dtype=torch.uint8, device="cuda")
    for size, offset, width, height, pitch in MEMSETS:
        value = {1: 0xA5, 2: 0xBEEF, 4: 0x12345678}[size]
        bufs = {edit: noise.clone() for edit in (False, True)}

        def fn(stream, buf=None):
            dst = buf.data_ptr() + offset
            one, two = drv[size]
            r = one(dst, value, width, stream) if height == 1 else two(dst, pitch, value, width, height, stream)
            assert r == 0, r

        row = {"element_bytes": size, "offset": offset, "width": width, "height": height, "pitch": pitch}
        for edit in (False, True):
            g, kinds, replaced = _graph(lambda s, b=bufs[edit]: fn(s, b), edit)
            g.replay()
            torch.cuda.synchronize()
            row["nodes_edited" if edit else "nodes"] = kinds
            if edit:
                row["replaced"] = replaced
        row["equal"] = bool(torch.equal(bufs[False], bufs[True]))
        row["changed_bytes"] = int((bufs[False] != noise).sum())
        rows.append(row)
    return rows


def launch_us(g, rounds: int = 50) -> float:
    exec_, launch = g.raw_cuda_graph_exec(), ctypes.CDLL("libcuda.so.1").cuGraphLaunch
    launch.argtypes, launch.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    stream = torch.cuda.current_stream().cuda_stream
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        launch(exec_, stream)
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def check_gemms() -> dict:
    torch.manual_seed(0)
    pairs = [(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(k, n, device="cuda",
                                                                                dtype=torch.bfloat16))
             for m, k, n in GEMMS]
    outs = {edit: [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for m, _, n in GEMMS]
            for edit in (False, True)}
    res = {}
    graphs = {}
    for edit in (False, True):
        def fn(stream, edit=edit):
            for (a, b), o in zip(pairs, outs[edit]):
                torch.mm(a, b, out=o)
        g, kinds, replaced = _graph(fn, edit)
        graphs[edit] = g
        res["nodes_edited" if edit else "nodes"] = kinds
        if edit:
            res["replaced"] = replaced
    for g in graphs.values():  # twice each, in turns: the same inputs, the same results
        g.replay()
    torch.cuda.synchronize()
    res["equal"] = all(torch.equal(x, y) for x, y in zip(outs[False], outs[True]))
    res["max_error_vs_eager"] = max(float((o.float() - (a @ b).float()).abs().max())
                                    for (a, b), o in zip(pairs, outs[True]))
    res["launch_us"] = launch_us(graphs[False])
    res["launch_us_edited"] = launch_us(graphs[True])
    res["launch_us_again"] = launch_us(graphs[False])
    res["launch_us_edited_again"] = launch_us(graphs[True])
    return res


def main(argv=None) -> int:
    args = output.one_gpu_args(__doc__, argv, "graph_memset_check needs a CUDA GPU")
    import compass_fx.kernels  # noqa: F401

    memsets, gemms = check_memsets(), check_gemms()
    ok = all(r["equal"] and r["replaced"] == 1 and "memset" not in r["nodes_edited"] for r in memsets) and gemms["equal"]
    payload = {"environment": output.environment(False), "status": "pass" if ok else "FAIL", "memsets": memsets,
               "gemms": gemms}
    md = [f"# {NAME} ({args.tag})", "", __doc__.split("\n\n")[0], "", f"* status: {payload['status']}", "",
          output.markdown_table(memsets, ["element_bytes", "offset", "width", "height", "pitch", "changed_bytes",
                                          "replaced", "equal"]), "",
          f"GEMMs {GEMMS}: nodes {gemms['nodes']} -> {gemms['nodes_edited']}, results equal bit for bit: "
          f"{gemms['equal']}; host us of one cuGraphLaunch (median of 50, idle GPU, two turns): "
          f"{gemms['launch_us']:.1f} / {gemms['launch_us_again']:.1f} captured, {gemms['launch_us_edited']:.1f} / "
          f"{gemms['launch_us_edited_again']:.1f} edited"]
    output.print_and_write(NAME, args, payload, "\n".join(md))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
