"""Measuring on the machine at hand what the model's constants are fitted to: GEMMs split into
parts on one GPU, and NCCL's collectives over message sizes on every rank of a group.

Shared by ``compass-fx calibrate`` (which fits the GEMM constants with ``cost.gemm_fit`` and
writes a calibration file, ``machine.calibration``) and the validation benchmark
(benchmarks/gemm_model_validation.py).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Iterable, Sequence

from ..cost.gemm_fit import GemmMeasurement
from .timing import issue_seconds, median_queued_seconds, queued_seconds, seconds_of_one_call

LLAMA3_WIDTHS = {"llama3-8b": (4096, 14336), "llama3-70b": (8192, 28672)}  # (hidden, ffn)


def grid_shapes(tokens: Iterable[int] = (2048, 4096, 8192, 16384), group_sizes: Iterable[int] = (2, 4, 8),
                models: Iterable[str] = tuple(LLAMA3_WIDTHS)) -> list[tuple[int, int, int]]:
    """The distinct per-rank GEMMs of the sweep grid: the MLP's column-parallel GEMM
    (m, ffn/tp, hidden) and row-parallel GEMM (m, hidden, ffn/tp)."""
    shapes = []
    for model in models:
        hidden, ffn = LLAMA3_WIDTHS[model]
        for tp in group_sizes:
            for m in tokens:
                for shape in ((m, ffn // tp, hidden), (m, hidden, ffn // tp)):
                    if shape not in shapes:
                        shapes.append(shape)
    return shapes


def measure_gemms(shapes: Sequence[tuple[int, int, int]], part_counts: Sequence[int] = (1, 2, 4, 8, 16, 32),
                  dtype: str = "bfloat16", device: str = "cuda", min_time_s: float = 0.02,
                  progress: bool = False, device_only: bool = False) -> list[GemmMeasurement]:
    """Median time of each shape split into each part count (CUDA events on a GPU; a wall clock
    on CPU, for dry runs).  Each call starts on an idle GPU, so a split into thin parts also
    pays the host's launches, as an issued decomposition does; ``device_only``: the calls are
    queued first (:func:`..tools.timing.queued_seconds`), the GEMMs' own time, what the GEMM model
    predicts."""
    import torch

    tdtype = getattr(torch, dtype)
    cuda = device.startswith("cuda")
    out = []
    for i, (m, n, k) in enumerate(shapes):
        a = torch.randn(m, k, device=device, dtype=tdtype)
        b = torch.randn(k, n, device=device, dtype=tdtype)
        c = torch.empty(m, n, device=device, dtype=tdtype)
        for parts in part_counts:
            if m % parts:
                continue
            rows = m // parts
            pieces = [(a[j * rows:(j + 1) * rows], c[j * rows:(j + 1) * rows]) for j in range(parts)]

            def run(pieces=pieces, weight=b) -> None:
                for x, y in pieces:
                    torch.mm(x, weight, out=y)

            timed = _median_queued_time if device_only and cuda else _median_time
            out.append(GemmMeasurement(m, n, k, parts, timed(run, cuda, min_time_s)))
        if progress:
            print(f"  measured {i + 1}/{len(shapes)}: {m}x{n}x{k}", flush=True)
        del a, b, c
    return out


def _median_time(fn, cuda: bool, min_time_s: float) -> float:
    import torch

    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    once = max(time.perf_counter() - t0, 1e-6)
    reps = max(5, min(100, math.ceil(min_time_s / once)))
    return statistics.median(seconds_of_one_call(fn, cuda) for _ in range(reps))


def _median_queued_time(fn, cuda: bool, min_time_s: float) -> float:  # noqa: ARG001 - _median_time's signature
    """Median over 5 rounds of the device seconds per call of a queued batch of about
    ``min_time_s`` / 5 of calls (3 to 50; the GPU's sleep covers the host's issue of it)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    host_once = max(time.perf_counter() - t0, 1e-6)  # an upper bound of the device's time, too
    device_once = queued_seconds(fn, 3)
    calls = max(3, min(50, math.ceil(min_time_s / 5 / max(device_once, 1e-7))))
    sleep_s = max(20e-3, 2 * calls * host_once)
    return median_queued_seconds(fn, calls, sleep_s)


# ---- collectives over the group at hand ---------------------------------------------------------
COLLECTIVE_MIB = (1, 4, 16, 64, 256)


def measure_collectives(group=None, sizes_mib: Sequence[int] = COLLECTIVE_MIB, dtype=None,
                        repeats: int = 10) -> list[dict]:
    """Time NCCL's (or gloo's) all-gather, reduce-scatter and all-reduce over the whole tensor sizes
    ``sizes_mib`` on every rank of ``group``; every rank returns the same numbers (the slowest
    rank's median, agreed by an all-reduce), so every rank prices the same."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    element = torch.empty((), dtype=dtype).element_size()
    points: dict[str, list[list[float]]] = {op: [] for op in ("all_gather", "reduce_scatter", "all_reduce")}
    for mib in sizes_mib:
        numel = max(world, (mib << 20) // element // world * world)
        full = torch.ones(numel, dtype=dtype, device=device)
        shard = torch.ones(numel // world, dtype=dtype, device=device)
        calls = {"all_gather": lambda: dist.all_gather_into_tensor(full, shard, group=group),
                 "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, full, group=group),
                 "all_reduce": lambda: dist.all_reduce(full, group=group)}
        for op, fn in calls.items():
            fn()
            times = []
            for _ in range(repeats):
                dist.barrier(group=group)
                times.append(seconds_of_one_call(fn, cuda))
            t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            points[op].append([numel * element, float(t.item())])
    return [{"op": op, "group_size": world, "points": pts} for op, pts in points.items()]


def measure_fused_host(calls: int = 200) -> dict:
    """What one fused call costs the host on this machine: the host seconds of each kind of launch
    a plan command makes, alone (a cuBLAS GEMM, a copy and the stream memory operations through the
    driver, an event record / wait), and of the op's dispatch (a one-rank call, which
    multiplies directly, less the multiplication alone).  Needs a CUDA GPU; the cost model scales
    its fused host time with these (``cost.strategies.fused_host_seconds``)."""
    import torch

    from ..kernels import ops  # noqa: F401 - registers torch.ops.compass
    from ..kernels.cuda import driver

    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    flag = torch.zeros(4, dtype=torch.int32, device="cuda")
    side, event = torch.cuda.Stream(), torch.cuda.Event()
    launches = {"Matmul": lambda: torch.mm(a, a, out=out), "Reduce": lambda: torch.add(a, a, out=out),
                "Copy": lambda: driver.memcpy(out.data_ptr(), a.data_ptr(), 1024, side.cuda_stream),
                "SetFlag": lambda: driver.write(flag.data_ptr(), 1, side.cuda_stream),
                "WaitFlag": lambda: driver.wait_at_least(flag.data_ptr(), 0, side.cuda_stream),
                "Record": lambda: event.record(side), "WaitEvent": lambda: side.wait_event(event)}

    def host_seconds(fn) -> float:  # each round from an idle GPU: launches alone, nothing queued ahead
        return issue_seconds(fn, calls, True, busy_s=0)

    launch_s = {kind: host_seconds(fn) for kind, fn in launches.items()}
    # the overload rewritten graphs call
    one_rank = host_seconds(lambda: torch.ops.compass.matmul_reduce_scatter.graph(a, a, "direct", "0", 1))
    dispatch_s = max(one_rank - host_seconds(lambda: a @ a), 0.0)
    return {"launch_s": launch_s, "dispatch_s": dispatch_s}


# ---- InterDecom as lowered -----------------------------------------------------------------------
def measure_part_overhead(parts: int = 4, shard_rows: int = 2048, k: int = 4096, n: int = 3584,
                          dtype: str | None = None, calls: int = 20) -> dict:
    """What one extra InterDecom part costs as the lowering emits it: an all-gather feeding a matmul
    (Llama-3 8B's gate projection at TP = 8 by default), compiled with ``backend="compass"`` whole
    and in ``parts`` parts, on the process group at hand (every rank runs this together; without
    one, on a one-rank group of its own: NCCL on a GPU, gloo on CPU).

    Returns, per extra part: ``device_s`` (CUDA only), the device's seconds beyond what splitting
    the GEMM alone costs, every call queued behind a GPU sleep: what a step replayed as CUDA graphs,
    or one whose host runs ahead, pays; and ``issue_s``, the host's seconds to issue it: what a
    host-bound step pays.  Every rank returns the slowest rank's figures (agreed by an all-reduce).
    """
    import socket

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    own_group = not dist.is_initialized()
    cuda = torch.cuda.is_available()
    if own_group:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    try:
        group = dist.group.WORLD
        world = dist.get_world_size(group)
        cuda = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        tdtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if cuda else torch.float32)
        shard = torch.randn(shard_rows, k, device=device, dtype=tdtype)
        weight = torch.randn(k, n, device=device, dtype=tdtype)
        gathered = torch.randn(shard_rows * world, k, device=device, dtype=tdtype)

        def device_seconds(fn) -> float | None:
            return median_queued_seconds(fn, calls, 0.1) if cuda else None

        def pair(x, w):
            return torch.mm(funcol.all_gather_tensor(x, 0, group), w)

        figures = {}
        for p in (1, parts):
            torch._dynamo.reset()
            options = {"strategy": "off"} if p == 1 else {"chunks": p}
            fn = torch.compile(pair, backend="compass", options=options)
            rows = shard_rows * world // p
            with torch.no_grad():
                for _ in range(3):
                    fn(shard, weight)
                figures[p] = {"issue_s": issue_seconds(lambda: fn(shard, weight), calls, cuda, busy_s=0.1),
                              "device_s": device_seconds(lambda: fn(shard, weight)),
                              "gemm_device_s": device_seconds(
                                  lambda: [torch.mm(gathered[i * rows:(i + 1) * rows], weight) for i in range(p)])}
        torch._dynamo.reset()
        one, many = figures[1], figures[parts]
        out = {"parts": parts, "m": shard_rows * world, "n": n, "k": k, "group_size": world,
               "issue_s": (many["issue_s"] - one["issue_s"]) / (parts - 1), "device_s": None}
        if cuda:
            out["device_s"] = ((many["device_s"] - one["device_s"]) - (many["gemm_device_s"] - one["gemm_device_s"])
                               ) / (parts - 1)
        agreed = torch.tensor([out["issue_s"], out["device_s"] or 0.0], dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        out["issue_s"] = float(agreed[0])
        if cuda:
            out["device_s"] = float(agreed[1])
        return out
    finally:
        if own_group:
            dist.destroy_process_group()
