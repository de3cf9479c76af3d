"""What an eager fused call's replay graph can be made of (issue 27), on one GPU:

* ``launch``: host us of one ``cuGraphLaunch`` of 64 tiny kernels alone and with ONE node of a
  slow kind added (stream wait, stream write, copy to host memory, memset): does one such node
  make the whole launch slow, or only itself?  And graphs of 16 of the kernels that would replace
  those nodes (flag write, flag wait on a set flag, copy to and from host memory).
* ``copy``: device time of a 4 MiB copy to and from registered host memory on the copy engines
  against a copy kernel of 4-64 blocks, alone and beside a large GEMM on another stream (what the
  kernel takes from the GEMM).
* ``memset``: which GEMMs captured in a graph bring a memset node, under which cuBLAS settings
  (in subprocesses for the environment variables), and their device time.
* ``chain``: host us of graphs of 16 copies to or from host memory (and of 16 stream waits) laid
  out in different ways: in a row on one stream, each followed by a kernel (the host-staged
  plans' copy-then-flag pattern), each flag a 4-byte copy instead (no kernel between copies),
  waits paired with copies (a pull), on two streams, and one copy of the same bytes.  Does such a
  node cost the launch by itself, or by the change of engine around it?
* ``shape``: host us of graphs shaped like a two-rank host-staged gather's replay (three streams,
  events between them, cuBLAS GEMMs), against the same nodes on one stream, tiny kernels for the
  GEMMs, fewer events: is the launch the sum of its nodes, or do the streams and events add?
* ``hostmap``: copies between device memory and registered host memory, device memory, or host
  memory made with ``cuMemCreate`` and mapped as device memory is: launch cost and device time
  alone and beside a GEMM (is a host copy node's launch cost about host memory, or the address?).
* ``lines``: 7 or 16 pulls of 1 MiB out of host memory regions one stride apart (a round of
  host-staged pulls, ``kernels/cuda/copy_runs``) as separate copies, one 2D copy or two: launch
  cost, and the device time and content of the 16.
* ``guard``: device time of a graph shaped like a two-rank reduce-scatter of one host-staged piece,
  its pull after the graph guard's edge from the flag kernel or not (one process, no MPS).
* ``cold``: host us of one launch of the same graph (8 copies to host memory, each followed by a
  flag kernel, and 8 kernels: a host-staged call's publications) after different things: right
  after another launch, after a wait for an idle GPU, after a wait of 1, 3 or 10 ms for a busy
  one (with and without 3 ms of spinning after it; or 10 ms polling an event from Python instead of
  the driver's wait), after 10 ms of spinning with the GPU idle, after the host slept 10 ms, behind a graph on
  its stream held by a wait for a host flag (as a call waiting for its peer); and the same graph
  with copies of 64 KiB, 4 and 16 MiB instead of 1 MiB, after a wait for an idle GPU.  Does a
  launch cost what its graph holds, the bytes its copies move, or also what the host did before
  (the large fused_host_time rows launch graphs of the same nodes as small rows in up to 1.9x the
  time)?  And one ``torch.empty`` on the GPU by size (does a large output cost its call more to
  allocate?).

    python benchmarks/graph_node_probe.py --out X.json     # and X.md, each section's rows as a table
    python benchmarks/graph_node_probe.py --render X.json  # that markdown again, printed, from the JSON alone
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from host_cost_probe import _node_kinds, launch_us  # noqa: E402
from harness.output import markdown_table  # noqa: E402
from harness.timing import spin  # noqa: E402

GEMMS = [(8192, 4096, 7168), (4096, 4096, 7168), (2048, 4096, 7168), (1024, 4096, 7168), (512, 4096, 7168),
         (4096, 7168, 4096), (2048, 7168, 4096), (1024, 7168, 4096), (512, 7168, 4096), (256, 7168, 4096)]


_kept: list = []  # registered host buffers live as long as the process (an address is registered once)


def host_buffer(nbytes: int):
    from compass_fx.kernels.cuda import driver

    m = mmap.mmap(-1, nbytes)
    t = torch.frombuffer(m, dtype=torch.uint8)
    dev = driver.host_register(t.data_ptr(), nbytes)
    _kept.append((m, t, dev))
    return m, t, dev


def graph_of(fn, cap):
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(cap):
        g.capture_begin(capture_error_mode="thread_local")
        fn(cap.cuda_stream)
        g.capture_end()
    g.instantiate()
    return g


def _after(waiter: torch.cuda.Stream, stream: torch.cuda.Stream) -> None:
    """``waiter``'s later work after ``stream``'s work so far (an event: a graph edge when captured)."""
    ev = torch.cuda.Event()
    ev.record(stream)
    waiter.wait_event(ev)


def launch_rows(cases: dict, cap: torch.cuda.Stream) -> list[dict]:
    """Each case (name -> what to capture, given the capture stream's handle) captured as a graph on
    ``cap``: its nodes and the host us of one ``cuGraphLaunch`` from an idle GPU and behind a sleep."""
    from compass_fx.kernels.cuda import driver

    rows = []
    glaunch = driver.raw("graph_launch")
    for name, fn in cases.items():
        try:
            g = graph_of(fn, cap)
            exec_, stream = g.raw_cuda_graph_exec(), torch.cuda.current_stream().cuda_stream

            def go():
                driver.check(glaunch(exec_, stream), "cuGraphLaunch")
            go()
            torch.cuda.synchronize()
            rows.append({"case": name, "nodes": _node_kinds(g.raw_cuda_graph()), "idle_us": launch_us(go, False),
                         "busy_x4_us": launch_us(go, True, per_round=4)})
        except Exception as e:  # noqa: BLE001
            rows.append({"case": name, "error": f"{type(e).__name__}: {e}"[:300]})
        print(rows[-1], flush=True)
    return rows


def launch_section() -> list[dict]:
    from compass_fx.kernels.cuda import driver, graph_flags

    dev = torch.cuda.current_device()
    memcpy, write, wait = driver.raw("memcpy"), driver.raw("write"), driver.raw("wait")
    x = torch.zeros(16, device="cuda")
    flags = torch.ones(4096, dtype=torch.int32, device="cuda")
    src = torch.empty(64 << 20, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    keep = host_buffer(64 << 20)
    host = keep[2]
    big_a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    big_b = torch.randn(4096, 7168, device="cuda", dtype=torch.bfloat16)
    big_c = torch.empty(4096, 7168, device="cuda", dtype=torch.bfloat16)
    cap = torch.cuda.Stream()
    with torch.cuda.stream(cap):
        torch.mm(big_a, big_b, out=big_c)
    torch.cuda.synchronize()
    wc = [graph_flags.write_code(dev, flags.data_ptr() + 4 * (100 + i), 1) for i in range(16)]
    wt = [graph_flags.wait_code(dev, flags.data_ptr() + 4 * i, 1) for i in range(16)]
    cps = [graph_flags.copy_wide(dev, 4 << 20) for _ in range(16)]
    for i, (_, aim) in enumerate(cps[:8]):
        aim(host + i * (4 << 20), src.data_ptr())
    for i, (_, aim) in enumerate(cps[8:]):
        aim(dst.data_ptr() + i * (4 << 20), host + i * (4 << 20))

    def k64(extra):
        def fn(h):
            for i in range(64):
                x.add_(1)
                if i == 32 and extra:
                    extra(h)
        return fn

    cases = {
        "kernels64": k64(None),
        "kernels64+mem_wait": k64(lambda h: wait(h, flags.data_ptr(), 1, driver.WAIT_AND)),
        "kernels64+mem_write": k64(lambda h: write(h, flags.data_ptr() + 400, 1, 0)),
        "kernels64+copy_d2h_4m": k64(lambda h: memcpy(host, src.data_ptr(), 4 << 20, h)),
        "kernels64+copy_d2d_4m": k64(lambda h: memcpy(dst.data_ptr(), src.data_ptr(), 4 << 20, h)),
        "kernels64+gemm_large": k64(lambda h: torch.mm(big_a, big_b, out=big_c)),
        "write_code16": lambda h: [f(h) for f in wc],
        "wait_code16": lambda h: [f(h) for f in wt],
        "copy_wide16_host": lambda h: [f(h) for f, _ in cps],
        "mix16(wait,copy,write,kernel)": lambda h: [(wt[i](h), cps[i][0](h), wc[i](h), x.add_(1)) for i in range(16)],
    }
    return launch_rows(cases, cap)


def device_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def alone_and_beside(fn, side: torch.cuda.Stream, gemm):
    """``fn``'s work on ``side`` (a high-priority stream joined to the caller's before and after),
    alone and after ``gemm`` is issued on ``side`` too: two functions for :func:`device_ms`."""
    main = torch.cuda.current_stream()

    def alone():
        side.wait_stream(main)
        fn()
        main.wait_stream(side)

    def beside():
        side.wait_stream(main)
        gemm()
        fn()
        main.wait_stream(side)
    return alone, beside


def copy_section() -> list[dict]:
    from compass_fx.kernels.cuda import driver, graph_flags

    dev = torch.cuda.current_device()
    memcpy = driver.raw("memcpy")
    n = 4 << 20
    pieces = 8
    src = torch.empty(pieces * n, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    keep = host_buffer(pieces * n)
    host = keep[2]
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 7168, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(8192, 7168, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream(priority=-1)
    rows = []

    def copies(kind, blocks):
        def fn():
            h = side.cuda_stream
            for i in range(pieces):
                d, s = ((host + i * n, src.data_ptr() + i * n) if kind == "d2h"
                        else (dst.data_ptr() + i * n, host + i * n))
                if blocks == 0:
                    driver.check(memcpy(d, s, n, h), "memcpy")
                else:
                    launch, aim = kernels[(kind, blocks, i)]
                    aim(d, s)
                    launch(h)
        return fn

    kernels = {}
    for kind in ("d2h", "h2d"):
        for blocks in (4, 8, 16, 32, 64):
            for i in range(pieces):
                kernels[(kind, blocks, i)] = graph_flags.copy_wide(dev, n, blocks)
    gemm_ms = device_ms(lambda: torch.mm(a, b, out=c))
    for kind in ("d2h", "h2d"):
        for blocks in (0, 4, 8, 16, 32, 64):
            alone, beside = alone_and_beside(copies(kind, blocks), side, lambda: torch.mm(a, b, out=c))
            try:
                ok = None
                if kind == "h2d":
                    dst.zero_()
                    keep[1].copy_(src.cpu())
                    alone()
                    torch.cuda.synchronize()
                    ok = bool(torch.equal(dst, src))
                t_alone = device_ms(alone)
                t_beside = device_ms(beside)
                rows.append({"kind": kind, "blocks": blocks, "MiB": pieces * n >> 20, "alone_ms": t_alone,
                             "GBps": pieces * n / t_alone / 1e6, "with_gemm_ms": t_beside, "gemm_ms": gemm_ms,
                             "correct": ok})
            except Exception as e:  # noqa: BLE001
                rows.append({"kind": kind, "blocks": blocks, "error": f"{type(e).__name__}: {e}"[:300]})
            print(rows[-1], flush=True)
    flags = torch.zeros(64, dtype=torch.int32, device="cuda")
    writes = [graph_flags.write_code(dev, flags.data_ptr() + 4 * i, 1) for i in range(pieces)]
    write = driver.raw("write")
    for how in ("stream_write", "kernel_write"):  # a copy-engine copy to host memory, then its flag
        def fn():
            h = side.cuda_stream
            for i in range(pieces):
                driver.check(memcpy(host + i * n, src.data_ptr() + i * n, n, h), "memcpy")
                if how == "stream_write":
                    driver.check(write(h, flags.data_ptr() + 4 * i, 1, 0), "write")
                else:
                    writes[i](h)

        _, beside = alone_and_beside(fn, side, lambda: torch.mm(a, b, out=c))
        rows.append({"kind": f"d2h+flag:{how}", "blocks": 0, "MiB": pieces * n >> 20, "with_gemm_ms": device_ms(beside),
                     "gemm_ms": gemm_ms})
        print(rows[-1], flush=True)
    return rows


class _WaitParams(ctypes.Structure):
    """``CUstreamBatchMemOpParams`` as a 32-bit wait (a union of 48 bytes)."""
    _fields_ = [("operation", ctypes.c_uint32), ("address", ctypes.c_uint64), ("value", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("alias", ctypes.c_uint64), ("pad", ctypes.c_uint64)]


def _batch_waits(addresses: list[int], value: int):
    """One ``cuStreamBatchMemOp`` of 32-bit waits (each address >= ``value``): one graph node for
    all of them?"""
    from compass_fx.kernels.cuda import driver

    _, batch = driver.driver_function(("cuStreamBatchMemOp_v2", "cuStreamBatchMemOp"),
                                      [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint])
    assert ctypes.sizeof(_WaitParams) == 48
    params = (_WaitParams * len(addresses))(*[_WaitParams(1, a, value, driver.WAIT_GEQ, 0, 0) for a in addresses])

    def run(stream: int) -> None:
        driver.check(batch(stream, len(addresses), ctypes.cast(params, ctypes.c_void_p), 0), "cuStreamBatchMemOp")
    run.params = params  # kept alive with the function
    return run


def chain_section() -> list[dict]:
    from compass_fx.kernels.cuda import driver, graph_flags

    dev = torch.cuda.current_device()
    memcpy, wait = driver.raw("memcpy"), driver.raw("wait")
    n, count = 1 << 20, 16
    src = torch.empty(count * n, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    registered = host_buffer(count * n)[2]  # as the host-staged arena: mmap'd memory registered with CUDA
    pinned_tensor = torch.empty(count * n, dtype=torch.uint8).pin_memory()  # as torch pins
    pinned = pinned_tensor.data_ptr()
    flags = torch.ones(4096, dtype=torch.int32, device="cuda")
    host_flags = host_buffer(4096 * 4)
    host_flags[1].view(torch.int32).fill_(1)
    one = torch.ones(1, dtype=torch.int32, device="cuda")
    x = torch.zeros(16, device="cuda")
    writes = [graph_flags.write_code(dev, flags.data_ptr() + 4 * (64 + i), 1) for i in range(count)]
    cap, fork = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()

    def d2h(h, i, host=registered):
        driver.check(memcpy(host + i * n, src.data_ptr() + i * n, n, h), "memcpy")

    def h2d(h, i, host=registered):
        driver.check(memcpy(dst.data_ptr() + i * n, host + i * n, n, h), "memcpy")

    def wait_host_flag(h, i):
        driver.check(wait(h, host_flags[2] + 4 * i, 1, driver.WAIT_GEQ), "wait")

    def two_streams(h):
        f = fork.cuda_stream
        _after(fork, torch.cuda.current_stream())
        for i in range(count // 2):
            d2h(h, i)
            d2h(f, count // 2 + i)
        _after(torch.cuda.current_stream(), fork)

    batch = _batch_waits([host_flags[2] + 4 * i for i in range(count)], 1)

    cases = {
        "d2h16_in_a_row": lambda h: [d2h(h, i) for i in range(count)],
        "d2h16_in_a_row_pinned": lambda h: [d2h(h, i, pinned) for i in range(count)],
        "h2d16_in_a_row": lambda h: [h2d(h, i) for i in range(count)],
        "d2h16_kernel_after_each": lambda h: [(d2h(h, i), x.add_(1)) for i in range(count)],
        "d2h16_flag_kernel_after_each": lambda h: [(d2h(h, i), writes[i](h)) for i in range(count)],
        "d2h16_flag_copy_after_each": lambda h: [
            (d2h(h, i), driver.check(memcpy(host_flags[2] + 4 * (64 + i), one.data_ptr(), 4, h), "memcpy"))
            for i in range(count)],
        "d2h16_two_streams": two_streams,
        "d2h1_of_16MiB": lambda h: driver.check(memcpy(registered, src.data_ptr(), count * n, h), "memcpy"),
        "wait16_in_a_row": lambda h: [wait_host_flag(h, i) for i in range(count)],
        "wait16_then_h2d16": lambda h: ([wait_host_flag(h, i) for i in range(count)],
                                        [h2d(h, i) for i in range(count)]),
        "wait_h2d_pairs16": lambda h: [(wait_host_flag(h, i), h2d(h, i)) for i in range(count)],
        "wait16_one_batch": batch,
        "wait16_one_batch_then_h2d16": lambda h: (batch(h), [h2d(h, i) for i in range(count)]),
        "kernels16": lambda h: [x.add_(1) for _ in range(count)],
    }
    return launch_rows(cases, cap)


def shape_section() -> list[dict]:
    """Host us of one launch of graphs shaped like a host-staged gather's replay at two ranks (8
    pieces of 4 MiB: each published by a copy to host memory and a flag kernel on one side stream,
    pulled by a stream wait and a copy on another, consumed by a GEMM on the caller's stream after
    an event), and of the same nodes laid out otherwise: which part of the launch is the nodes,
    which the streams and events between them?"""
    from compass_fx.kernels.cuda import driver, graph_flags

    dev = torch.cuda.current_device()
    memcpy, wait = driver.raw("memcpy"), driver.raw("wait")
    pieces, rows, k, n = 8, 512, 4096, 7168
    piece = rows * k * 2
    a = torch.randn(pieces * rows, k, device="cuda", dtype=torch.bfloat16)
    gathered = torch.empty(2 * pieces * rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(2 * pieces * rows, n, device="cuda", dtype=torch.bfloat16)
    host = host_buffer(2 * pieces * piece)[2]
    flags = host_buffer(4096 * 4)
    flags[1].view(torch.int32).fill_(1)
    writes = [graph_flags.write_code(dev, flags[2] + 4 * (64 + i), 1) for i in range(pieces)]
    x = torch.zeros(16, device="cuda")
    cap, comm, pub = torch.cuda.Stream(), torch.cuda.Stream(priority=-1), torch.cuda.Stream(priority=-1)
    with torch.cuda.stream(cap):
        torch.mm(a, w, out=out[:pieces * rows])
        torch.mm(gathered[:rows], w, out=out[:rows])
    torch.cuda.synchronize()

    def publish(h, i):
        driver.check(memcpy(host + i * piece, a.data_ptr() + i * piece, piece, h), "memcpy")
        writes[i](h)

    def pull(h, i):
        driver.check(wait(h, flags[2] + 4 * i, 1, driver.WAIT_GEQ), "wait")
        off = (pieces + i) * piece
        driver.check(memcpy(gathered.data_ptr() + off, host + off, piece, h), "memcpy")

    def own_gemm():
        torch.mm(a, w, out=out[:pieces * rows])

    def gemm(i, tiny=False):
        if tiny:
            x.add_(1)
        else:
            lo = (pieces + i) * rows
            torch.mm(gathered[lo:lo + rows], w, out=out[lo:lo + rows])

    def self_copy(h):
        driver.check(memcpy(gathered.data_ptr(), a.data_ptr(), pieces * piece, h), "memcpy")

    def as_plan(tiny=False, pub_events=True, gemm_events=True):
        def fn(h):
            main = torch.cuda.current_stream()
            _after(comm, main)
            if not pub_events:
                _after(pub, comm)
            for i in range(pieces):
                if pub_events:
                    _after(pub, comm)
                publish(pub.cuda_stream, i)
            own_gemm()
            published = torch.cuda.Event()
            published.record(pub)
            got = []
            for i in range(pieces):
                pull(comm.cuda_stream, i)
                got.append(torch.cuda.Event())
                got[-1].record(comm)
            self_copy(comm.cuda_stream)
            for i in range(pieces):
                if gemm_events:
                    main.wait_event(got[i])
                gemm(i, tiny)
            main.wait_event(published)
            _after(main, comm)
        return fn

    def one_stream(h):
        for i in range(pieces):
            publish(h, i)
        own_gemm()
        for i in range(pieces):
            pull(h, i)
        self_copy(h)
        for i in range(pieces):
            gemm(i)

    def copies_only(h):
        main = torch.cuda.current_stream()
        _after(comm, main)
        _after(pub, comm)
        for i in range(pieces):
            driver.check(memcpy(host + i * piece, a.data_ptr() + i * piece, piece, pub.cuda_stream), "memcpy")
            off = (pieces + i) * piece
            driver.check(memcpy(gathered.data_ptr() + off, host + off, piece, comm.cuda_stream), "memcpy")
        _after(main, pub)
        _after(main, comm)

    cases = {
        "gather8_as_plan": as_plan(),
        "gather8_tiny_gemms": as_plan(tiny=True),
        "gather8_one_pub_event": as_plan(pub_events=False),
        "gather8_gemms_join_at_end": as_plan(gemm_events=False),
        "gather8_one_stream": one_stream,
        "gemms9_one_stream": lambda h: (own_gemm(), [gemm(i) for i in range(pieces)]),
        "copies16_two_streams": copies_only,
        "publish8_one_stream": lambda h: [publish(h, i) for i in range(pieces)],
        "pull8_one_stream": lambda h: [pull(h, i) for i in range(pieces)],
    }
    return launch_rows(cases, cap)


class _Location(ctypes.Structure):
    """``CUmemLocation``."""
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocProp(ctypes.Structure):
    """``CUmemAllocationProp`` (32 bytes)."""
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    """``CUmemAccessDesc``."""
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_LOCATIONS = {"device": 1, "host": 2, "host_numa": 3}


def vmm_memory(nbytes: int, where: str, device: int) -> tuple[int, dict]:
    """``nbytes`` of pinned memory made with ``cuMemCreate`` at ``where`` (host, host_numa: physical
    pages in host memory) and mapped into a reserved address range the GPU reads and writes: the
    driver sees a mapped address, not a registered host range.  Returns the address and what was
    tried."""
    from compass_fx.kernels.cuda import driver

    f = driver.driver_function
    u64p, sizep = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t)
    _, create = f(("cuMemCreate",), [u64p, ctypes.c_size_t, ctypes.POINTER(_AllocProp), ctypes.c_uint64])
    _, granularity = f(("cuMemGetAllocationGranularity",), [sizep, ctypes.POINTER(_AllocProp), ctypes.c_int])
    _, reserve = f(("cuMemAddressReserve",), [u64p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64,
                                              ctypes.c_uint64])
    _, map_ = f(("cuMemMap",), [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint64])
    _, access = f(("cuMemSetAccess",), [ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(_AccessDesc),
                                        ctypes.c_size_t])
    assert ctypes.sizeof(_AllocProp) == 32 and ctypes.sizeof(_AccessDesc) == 12
    prop = _AllocProp(type=1, requestedHandleTypes=0, location=_Location(_LOCATIONS[where], 0))
    g = ctypes.c_size_t()
    driver.check(granularity(ctypes.byref(g), ctypes.byref(prop), 0), "cuMemGetAllocationGranularity")
    size = -(-nbytes // g.value) * g.value
    handle, va = ctypes.c_uint64(), ctypes.c_uint64()
    driver.check(create(ctypes.byref(handle), size, ctypes.byref(prop), 0), f"cuMemCreate({where})")
    driver.check(reserve(ctypes.byref(va), size, 0, 0, 0), "cuMemAddressReserve")
    driver.check(map_(va.value, size, 0, handle.value, 0), "cuMemMap")
    dev = _AccessDesc(_Location(1, device), 3)  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    driver.check(access(va.value, size, ctypes.byref(dev), 1), "cuMemSetAccess(device)")
    info = {"granularity": g.value, "size": size}
    host = _AccessDesc(_Location(_LOCATIONS[where], 0), 3)
    info["host_access"] = access(va.value, size, ctypes.byref(host), 1)  # 0: the CPU may map it too
    return va.value, info


def hostmap_section() -> list[dict]:
    """Is a copy node's launch cost about host memory as such, or about how the driver knows the
    address?  16 copies of 1 MiB between device memory and: registered host memory (the arena's
    today), device memory, and host memory made with ``cuMemCreate`` and mapped like device memory;
    their launch cost, and the device time of 8 x 4 MiB of each alone and beside a GEMM that fills
    the GPU (a copy engine overlaps it; a copy run by multiprocessors would wait for it)."""
    from compass_fx.kernels.cuda import driver, graph_flags

    dev = torch.cuda.current_device()
    memcpy = driver.raw("memcpy")
    n, count = 1 << 20, 16
    big = 4 << 20
    src = torch.empty(8 * big, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    device_target = torch.empty_like(src)
    rows = []
    addresses = {"registered": host_buffer(8 * big)[2], "device": device_target.data_ptr()}
    for where in ("host_numa", "host"):
        try:
            va, info = vmm_memory(8 * big, where, dev)
            addresses[f"vmm_{where}"] = va
            rows.append({"case": f"vmm_{where}_alloc", **info})
        except Exception as e:  # noqa: BLE001
            rows.append({"case": f"vmm_{where}_alloc", "error": f"{type(e).__name__}: {e}"[:300]})
        print(rows[-1], flush=True)
    flags = torch.zeros(64, dtype=torch.int32, device="cuda")
    writes = [graph_flags.write_code(dev, flags.data_ptr() + 4 * i, 1) for i in range(count)]
    cap = torch.cuda.Stream()
    torch.cuda.synchronize()
    cases = {}
    for name, addr in addresses.items():
        cases[f"d2h16_{name}"] = (lambda a: lambda h: [driver.check(memcpy(a + i * n, src.data_ptr() + i * n, n, h),
                                                                   "memcpy") for i in range(count)])(addr)
        cases[f"h2d16_{name}"] = (lambda a: lambda h: [driver.check(memcpy(dst.data_ptr() + i * n, a + i * n, n, h),
                                                                   "memcpy") for i in range(count)])(addr)
        cases[f"d2h16_flag_kernel_after_each_{name}"] = (lambda a: lambda h: [
            (driver.check(memcpy(a + i * n, src.data_ptr() + i * n, n, h), "memcpy"), writes[i](h))
            for i in range(count)])(addr)
    rows += launch_rows(cases, cap)
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 7168, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(8192, 7168, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream(priority=-1)
    gemm_ms = device_ms(lambda: torch.mm(a, b, out=c))
    for name, addr in addresses.items():
        for kind in ("d2h", "h2d"):
            def fn(addr=addr, kind=kind):
                h = side.cuda_stream
                for i in range(8):
                    d, s_ = (addr + i * big, src.data_ptr() + i * big) if kind == "d2h" else (
                        dst.data_ptr() + i * big, addr + i * big)
                    driver.check(memcpy(d, s_, big, h), "memcpy")

            alone, beside = alone_and_beside(fn, side, lambda: torch.mm(a, b, out=c))
            try:
                ok = None
                if kind == "h2d":  # what the d2h rows just wrote there comes back
                    dst.zero_()
                    alone()
                    torch.cuda.synchronize()
                    ok = bool(torch.equal(dst, src))
                t_alone, t_beside = device_ms(alone), device_ms(beside)
                rows.append({"case": f"copy_{kind}_{name}", "MiB": 8 * big >> 20, "alone_ms": t_alone,
                             "GBps": 8 * big / t_alone / 1e6, "with_gemm_ms": t_beside, "gemm_ms": gemm_ms,
                             "round_trip_correct": ok})
            except Exception as e:  # noqa: BLE001
                rows.append({"case": f"copy_{kind}_{name}", "error": f"{type(e).__name__}: {e}"[:300]})
            print(rows[-1], flush=True)
    return rows


def memset_child(setting: str) -> list[dict]:
    if setting == "cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    elif setting == "cublas":
        torch.backends.cuda.preferred_blas_library("cublas")
    elif setting == "no_reduced_precision":
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    cap = torch.cuda.Stream()
    rows = []
    for m, k, n in GEMMS:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        with torch.cuda.stream(cap):
            torch.mm(a, b, out=c)
        torch.cuda.synchronize()
        try:
            g = graph_of(lambda h: torch.mm(a, b, out=c), cap)
            nodes = _node_kinds(g.raw_cuda_graph())
        except Exception as e:  # noqa: BLE001
            nodes = {"error": str(e)[:200]}
        rows.append({"setting": setting, "m": m, "k": k, "n": n, "nodes": nodes,
                     "ms": device_ms(lambda: torch.mm(a, b, out=c))})
    return rows


def memset_section() -> list[dict]:
    rows = []
    variants = [("default", {}), ("cublaslt", {}), ("cublas", {}), ("no_reduced_precision", {}),
                ("ws_0", {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}),
                ("ws_4096x8", {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
                ("lt_ws_0", {"CUBLASLT_WORKSPACE_SIZE": "0"})]
    for setting, extra in variants:
        env = dict(os.environ, **extra)
        arg = setting if setting in ("cublaslt", "cublas", "no_reduced_precision") else "default"
        r = subprocess.run([sys.executable, __file__, "--memset-child", arg], env=env, capture_output=True,
                           text=True, timeout=120)
        try:
            got = json.loads(r.stdout.strip().splitlines()[-1])
            for g in got:
                g["setting"] = setting
            rows += got
        except Exception:  # noqa: BLE001
            rows.append({"setting": setting, "error": (r.stderr or r.stdout)[-600:]})
        print(rows[-1], flush=True)
    return rows


def lines_section() -> list[dict]:
    """A round of pulls out of host memory as separate copies or as 2D copies (copy_runs): the
    launch's host us, and the device ms and content of the copies (issue 27)."""
    from compass_fx.kernels.cuda import driver

    n, count, stride = 1 << 20, 16, 5 << 20  # 1 MiB lines, an arena region every 5 MiB
    dst = torch.empty(count * n, device="cuda", dtype=torch.uint8)  # the context first: then register
    host = host_buffer(count * stride)
    host[1].view(torch.int32).copy_(torch.arange(count * stride // 4, dtype=torch.int32))
    cap = torch.cuda.Stream()
    base, out = host[2], dst.data_ptr()

    def pulls(lines: int, heights: tuple[int, ...]):
        def fn(h):
            first = 0
            for height in heights:
                driver.memcpy_lines(out + first * n, base + first * stride, n, height, n, stride, h)
                first += height
            assert first == lines
        return fn

    def separate(lines: int):
        return pulls(lines, (1,) * lines)

    cases = {}
    for lines in (7, 16):
        cases[f"h2d{lines}_separate"] = separate(lines)
        cases[f"h2d{lines}_one_2d"] = pulls(lines, (lines,))
        cases[f"h2d{lines}_two_2d"] = pulls(lines, (lines // 2, lines - lines // 2))
    rows = launch_rows(cases, cap)
    expected = torch.cat([host[1][i * stride:i * stride + n] for i in range(count)]).cuda()
    for name in ("h2d16_separate", "h2d16_one_2d", "h2d16_two_2d"):
        dst.zero_()
        fn = cases[name]
        ms = device_ms(lambda fn=fn: fn(torch.cuda.current_stream().cuda_stream))
        torch.cuda.synchronize()
        rows.append({"case": name + "_device", "ms": ms, "gb_s": count * n / ms / 1e6,
                     "content_right": bool(torch.equal(dst, expected))})
        print(rows[-1], flush=True)
    return rows


def guard_section(reps: int = 50) -> list[dict]:
    """Device us per replay of graphs shaped like a two-rank host-staged reduce-scatter of one piece
    (a GEMM on the caller's stream; its piece published to host memory and a flag kernel on a
    publication stream; a stream wait for the peer's flag, already set, and a pull out of host
    memory on a pull stream; the sum after the pull), the pull stream's first node placed four ways:
    ``unguarded`` (forked at the graph's start), ``guarded`` (after an event recorded after the flag
    kernel: :mod:`compass_fx.kernels.graph_order`'s guard), ``guarded_no_wait`` (the same without
    the stream wait), ``serial`` (wait and pull on the publication stream after the flag, no edge).
    Two ranks sharing one H200 under MPS started a guarded pull 75-87 us after its flag kernel
    (``replay_trace-h200-*-guards-ranks-*``); one process alone: is it the edge?"""
    from compass_fx.kernels.cuda import driver, graph_flags

    dev = torch.cuda.current_device()
    memcpy = driver.raw("memcpy")
    rows, k, n = 512, 7168, 4096
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    part = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    stage = torch.empty_like(part)
    nbytes = part.numel() * part.element_size()
    host = host_buffer(nbytes)[2]
    flags = host_buffer(4096)
    flags[1].view(torch.int32).fill_(1)  # the peer's flag: set
    write = graph_flags.write_code(dev, flags[2] + 64, 1)
    wait = _batch_waits([flags[2]], 1)
    cap, pub, pull = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(cap):  # cuBLAS's handle and workspace for this stream, before any capture
        torch.mm(a, b, out=part)
        part.add_(stage)
    torch.cuda.synchronize()

    def case(how: str):
        def capture(h):
            main = torch.cuda.current_stream()
            if how == "unguarded":
                _after(pull, main)
            torch.mm(a, b, out=part)
            _after(pub, main)
            driver.check(memcpy(host, part.data_ptr(), nbytes, pub.cuda_stream), "memcpy")
            write(pub.cuda_stream)
            if how == "serial":
                wait(pub.cuda_stream)
                driver.check(memcpy(stage.data_ptr(), host, nbytes, pub.cuda_stream), "memcpy")
                _after(main, pub)
            else:
                if how != "unguarded":
                    _after(pull, pub)
                if how != "guarded_no_wait":
                    wait(pull.cuda_stream)
                driver.check(memcpy(stage.data_ptr(), host, nbytes, pull.cuda_stream), "memcpy")
                _after(main, pull)
                _after(main, pub)
            part.add_(stage)
        return capture

    rows_out = []
    for how in ("unguarded", "guarded", "guarded_no_wait", "serial"):
        try:
            g = graph_of(case(how), cap)
            g.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    g.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / reps)
            rows_out.append({"case": how, "nodes": _node_kinds(g.raw_cuda_graph()), "device_us": statistics.median(times)})
        except Exception as e:  # noqa: BLE001
            rows_out.append({"case": how, "error": f"{type(e).__name__}: {e}"[:300]})
        print(rows_out[-1], flush=True)
    return rows_out


COLD_WAITS_MS = (1, 3, 10)
COLD_COPY_MIB = (0.0625, 1, 4, 16)  # each of the 8 copies; 1 MiB: every other condition's graph


def cold_section(rounds: int = 15) -> list[dict]:
    """One graph (a host-staged call's publications: 8 copies of 1 MiB to host memory, a flag kernel
    after each, 8 kernels on the caller's stream), its launch timed after each kind of wait, and
    graphs of the same nodes copying other sizes (``COLD_COPY_MIB``) after a wait for an idle GPU:
    median host us over ``rounds``, the conditions taking turns within every round."""
    from compass_fx.kernels.cuda import driver, graph_flags

    from host_cost_probe import SLEEP_CYCLES_PER_S

    dev = torch.cuda.current_device()
    memcpy = driver.raw("memcpy")
    count, largest = 8, int(max(COLD_COPY_MIB) * (1 << 20))
    src = torch.empty(count * largest, device="cuda", dtype=torch.uint8)
    host = host_buffer(count * largest)[2]
    flags = torch.zeros(4096, dtype=torch.int32, device="cuda")
    writes = [graph_flags.write_code(dev, flags.data_ptr() + 4 * i, 1) for i in range(count)]
    x = torch.zeros(16, device="cuda")
    cap, side = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()

    def publications(n: int):
        def capture(h):
            _after(side, torch.cuda.current_stream())
            for i in range(count):
                x.add_(1)
                driver.check(memcpy(host + i * n, src.data_ptr() + i * n, n, side.cuda_stream), "memcpy")
                writes[i](side.cuda_stream)
            _after(torch.cuda.current_stream(), side)
        return capture

    g, other = graph_of(publications(1 << 20), cap), graph_of(publications(1 << 20), cap)
    # the same nodes copying other sizes: does a copy node's launch cost grow with its bytes?
    by_size = {mib: graph_of(publications(int(mib * (1 << 20))), cap) for mib in COLD_COPY_MIB if mib != 1}
    glaunch = driver.raw("graph_launch")
    stream = torch.cuda.current_stream().cuda_stream

    def launch(graph) -> float:
        t0 = time.perf_counter()
        driver.check(glaunch(graph.raw_cuda_graph_exec(), stream), "cuGraphLaunch")
        return (time.perf_counter() - t0) * 1e6

    def after_launch():
        torch.cuda.synchronize()
        launch(other)
        return launch(g)

    def after_idle(graph):
        def run():
            torch.cuda.synchronize()
            return launch(graph)
        return run

    def after_wait(ms: float, spin_s: float = 0.0):
        def run():
            torch.cuda.synchronize()
            torch.cuda._sleep(int(ms * 1e-3 * SLEEP_CYCLES_PER_S))
            torch.cuda.synchronize()
            spin(spin_s)
            return launch(g)
        return run

    def after_host_sleep():
        torch.cuda.synchronize()
        time.sleep(10e-3)
        return launch(g)

    def after_polling(ms: float):  # the host busy in Python for the whole wait, not in the driver's
        def run():
            torch.cuda.synchronize()
            done = torch.cuda.Event()
            torch.cuda._sleep(int(ms * 1e-3 * SLEEP_CYCLES_PER_S))
            done.record()
            while not done.query():
                pass
            return launch(g)
        return run

    def after_spinning(ms: float):  # the GPU idle the whole time, the host busy: the GPU's state or the host's?
        def run():
            torch.cuda.synchronize()
            spin(ms * 1e-3)
            return launch(g)
        return run

    # a graph on the same stream held by a stream wait on a host word, as a call waiting for its peer is
    _, word_tensor, word = host_buffer(4096)
    released = word_tensor.view(torch.int32)
    wait = driver.raw("wait")
    blocker = graph_of(lambda h: driver.check(wait(h, word, 1, driver.WAIT_GEQ), "cuStreamWaitValue32"), cap)

    def behind_a_waiting_graph():
        torch.cuda.synchronize()
        released[0] = 0
        driver.check(glaunch(blocker.raw_cuda_graph_exec(), stream), "cuGraphLaunch")
        took = launch(g)
        released[0] = 1  # the wait ends, then the timed graph runs
        return took

    sized_cases = {f"copies_of_{mib:g}MiB_after_waiting_for_an_idle_gpu": (mib, graph)
                   for mib, graph in by_size.items()}
    conditions = {"right_after_another_launch": after_launch, "after_waiting_for_an_idle_gpu": after_idle(g),
                  **{f"after_waiting_{ms}ms_for_the_gpu": after_wait(ms) for ms in COLD_WAITS_MS},
                  **{f"after_waiting_{ms}ms_then_spinning_3ms": after_wait(ms, 3e-3) for ms in COLD_WAITS_MS},
                  "after_the_host_slept_10ms": after_host_sleep,
                  "after_polling_10ms_for_the_gpu": after_polling(10),
                  "after_spinning_10ms_the_gpu_idle": after_spinning(10),
                  "behind_a_graph_waiting_for_a_host_flag": behind_a_waiting_graph,
                  **{name: after_idle(graph) for name, (_, graph) in sized_cases.items()}}
    for fn in conditions.values():  # every launch path warm once
        fn()
    times: dict[str, list[float]] = {name: [] for name in conditions}
    for _ in range(rounds):
        for name, fn in conditions.items():
            times[name].append(fn())
    torch.cuda.synchronize()
    nodes = _node_kinds(g.raw_cuda_graph())
    rows = [{"case": name, "nodes": nodes, "copy_mib": sized_cases.get(name, (1, None))[0],
             "launch_us": statistics.median(v), "min_us": min(v), "max_us": max(v)} for name, v in times.items()]
    rows += allocation_rows(rounds)
    for row in rows:
        print(row, flush=True)
    return rows


ALLOCATIONS_MIB = (0.008, 1, 16, 64, 112)  # one row of 4096 bf16 columns ... a 4096-row gather's output


def allocation_rows(rounds: int, per_round: int = 4) -> list[dict]:
    """Host us of one ``torch.empty`` on the GPU by size, freed at once (as a fused call's outputs
    are when the caller drops them): from an idle GPU and behind a 3 ms sleep.  Does an output's
    allocation cost more the larger it is (fused_host_time's breakdowns read 14-20 us for the
    largest outputs against 4-8 for one row each)?"""
    from host_cost_probe import SLEEP_CYCLES_PER_S

    def one(nbytes: int) -> float:
        t0 = time.perf_counter()
        for _ in range(per_round):
            torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        return (time.perf_counter() - t0) / per_round * 1e6

    sizes = {mib: int(mib * (1 << 20)) for mib in ALLOCATIONS_MIB}
    times: dict[tuple[float, bool], list[float]] = {(mib, busy): [] for mib in sizes for busy in (False, True)}
    for nbytes in sizes.values():  # cached once, as a call's outputs are after its first call
        torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for _ in range(rounds):
        for (mib, busy), got in times.items():
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(int(3e-3 * SLEEP_CYCLES_PER_S))
            got.append(one(sizes[mib]))
    torch.cuda.synchronize()
    return [{"case": f"torch.empty {mib:g} MiB" + (", GPU busy" if busy else ""), "alloc_us": statistics.median(v),
             "min_us": min(v), "max_us": max(v)} for (mib, busy), v in times.items()]


def render(res: dict, title: str) -> str:
    """Markdown of a probe's results: each section's rows as one table (its columns every key its
    rows hold, in the order first seen; a graph's node kinds as JSON), the seconds it took, or the
    last line of the error that stopped it; a note the JSON carries comes first."""
    lines = [f"# {title}", ""]
    if isinstance(res.get("note"), str):
        lines += [res["note"], ""]
    for name, value in res.items():
        if name == "note" or name.endswith("_s"):
            continue
        took = res.get(f"{name}_s")
        lines.append(f"## {name}" + (f" ({took:.1f} s)" if isinstance(took, (int, float)) else ""))
        lines.append("")
        if isinstance(value, dict) and "error" in value:
            lines += [f"failed: `{str(value['error']).strip().splitlines()[-1]}`", ""]
            continue
        rows = [{k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in row.items()}
                for row in value if isinstance(row, dict)] if isinstance(value, list) else []
        columns = list(dict.fromkeys(k for row in rows for k in row))
        lines += [markdown_table(rows, columns) if rows else "no rows", ""]
    return "\n".join(lines).rstrip() + "\n"


def markdown_path(out: str) -> str:
    """Where the markdown of the JSON file ``out`` goes: beside it, ``.md`` for its suffix."""
    root, ext = os.path.splitext(out)
    return (root if ext == ".json" else out) + ".md"


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="the JSON file to write (rewritten after each section), its markdown beside it")
    p.add_argument("--render", metavar="JSON", help="print the markdown of a JSON file this probe wrote (a committed "
                   "result's .md holds a reading too: nothing is overwritten), and stop")
    p.add_argument("--sections", default="launch,copy,memset", help="comma-separated, of launch, copy, memset, chain, shape, hostmap, lines, guard, cold")
    p.add_argument("--memset-child", help=argparse.SUPPRESS)  # internal: one cuBLAS setting, in a subprocess
    args = p.parse_args(argv)
    if args.memset_child:
        print(json.dumps(memset_child(args.memset_child)))
        return 0
    if args.render:
        with open(args.render) as f:
            print(render(json.load(f), os.path.basename(os.path.splitext(args.render)[0])), end="")
        return 0
    if not args.out:
        p.error("--out is required (or --render)")
    out, sections = args.out, args.sections.split(",")
    res = {}
    for name in sections:
        t0 = time.time()
        try:
            res[name] = globals()[f"{name}_section"]()
        except Exception:  # noqa: BLE001
            res[name] = {"error": traceback.format_exc()[-2000:]}
        res[f"{name}_s"] = time.time() - t0
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        with open(markdown_path(out), "w") as f:
            f.write(render(res, f"{os.path.basename(os.path.splitext(out)[0])} ({', '.join(sections)})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
