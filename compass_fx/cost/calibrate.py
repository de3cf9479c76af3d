"""Measuring GEMMs on a real GPU and fitting the GEMM model's per-GPU constants to them.

Shared by ``compass-fx calibrate`` (which writes a calibration file, see gpus.py) and the
validation benchmark (benchmarks/gemm_model_validation.py).  A measurement is the time of one
(m x k) @ (k x n) GEMM run as ``parts`` back-to-back GEMMs of m/parts rows, as InterDecom runs it.
The fit is a deterministic coordinate search that minimises the median relative error of the
absolute times and of the split/unsplit ratios together.
"""
from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from .gemm import gemm_seconds
from .gpus import GpuSpec, with_overrides
from .timing import seconds_of_one_call

LLAMA3_WIDTHS = {"llama3-8b": (4096, 14336), "llama3-70b": (8192, 28672)}  # (hidden, ffn)


@dataclass(frozen=True)
class GemmMeasurement:
    m: int
    n: int
    k: int
    parts: int
    seconds: float


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


def measure_gemms(shapes: Sequence[tuple[int, int, int]], parts: Sequence[int] = (1, 2, 4, 8, 16, 32),
                  dtype: str = "bfloat16", device: str = "cuda", min_time_s: float = 0.02,
                  progress: bool = False) -> list[GemmMeasurement]:
    """Median time of each shape split into each part count (CUDA events on a GPU; a wall clock
    on CPU, for dry runs)."""
    import torch

    tdtype = getattr(torch, dtype)
    cuda = device.startswith("cuda")
    out = []
    for i, (m, n, k) in enumerate(shapes):
        a = torch.randn(m, k, device=device, dtype=tdtype)
        b = torch.randn(k, n, device=device, dtype=tdtype)
        c = torch.empty(m, n, device=device, dtype=tdtype)
        for d in parts:
            if m % d:
                continue
            rows = m // d
            pieces = [(a[j * rows:(j + 1) * rows], c[j * rows:(j + 1) * rows]) for j in range(d)]

            def run(pieces=pieces, weight=b) -> None:
                for x, y in pieces:
                    torch.mm(x, weight, out=y)

            out.append(GemmMeasurement(m, n, k, d, _median_time(run, cuda, min_time_s)))
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


def model_errors(measurements: Sequence[GemmMeasurement], spec: GpuSpec, dtype: str = "bfloat16") -> dict:
    """Relative errors of the model: on absolute times, and on split/unsplit ratios (parts > 1)."""
    unsplit = {(r.m, r.n, r.k): r.seconds for r in measurements if r.parts == 1}
    abs_err, ratio_err, rows = [], [], []
    for r in measurements:
        predicted = r.parts * gemm_seconds(r.m // r.parts, r.n, r.k, dtype, spec)
        e = predicted / r.seconds - 1.0
        abs_err.append(abs(e))
        row = {"m": r.m, "n": r.n, "k": r.k, "parts": r.parts, "measured_s": r.seconds,
               "model_s": predicted, "abs_error": e}
        base = unsplit.get((r.m, r.n, r.k))
        if r.parts > 1 and base:
            measured_ratio = r.seconds / base
            model_ratio = predicted / gemm_seconds(r.m, r.n, r.k, dtype, spec)
            row.update(measured_ratio=measured_ratio, model_ratio=model_ratio,
                       ratio_error=model_ratio / measured_ratio - 1.0)
            ratio_err.append(abs(row["ratio_error"]))
        rows.append(row)
    return {"median_abs_error": statistics.median(abs_err) if abs_err else None,
            "median_ratio_error": statistics.median(ratio_err) if ratio_err else None,
            "p90_ratio_error": _quantile(ratio_err, 0.9), "p90_abs_error": _quantile(abs_err, 0.9),
            "rows": rows}


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _objective(measurements: Sequence[GemmMeasurement], spec: GpuSpec, dtype: str) -> float:
    e = model_errors(measurements, spec, dtype)
    return (e["median_abs_error"] or 0) + (e["median_ratio_error"] or 0) + 0.5 * (e["p90_ratio_error"] or 0)


def fit_gpu_spec(measurements: Sequence[GemmMeasurement], base: GpuSpec, dtype: str = "bfloat16",
                 rounds: int = 3) -> GpuSpec:
    """Fit efficiency, the overheads, the small tiles' relative efficiencies and split-K to the
    measurements (coordinate search over fixed grids; deterministic)."""
    if not measurements:
        raise ValueError("fit_gpu_spec: measurements must not be empty")
    grids = {
        "efficiency": [x / 100 for x in range(40, 101, 2)],
        "kernel_overhead_s": [x * 1e-7 for x in range(0, 101, 5)],
        "wave_overhead_s": [x * 1e-7 for x in range(0, 61, 3)],
        "tile1": [x / 20 for x in range(4, 21)],
        "tile2": [x / 20 for x in range(2, 21)],
        "max_split_k": [1, 2, 4, 8],
    }

    def make(spec: GpuSpec, name: str, value: float) -> GpuSpec:
        if name.startswith("tile"):
            i = int(name[-1])
            tiles = list(spec.tiles)
            tiles[i] = (tiles[i][0], tiles[i][1], value)
            return with_overrides(spec, tiles=tuple(tiles))
        return with_overrides(spec, **{name: value})

    best, best_score = base, _objective(measurements, base, dtype)
    for _ in range(rounds):
        improved = False
        for name, grid in grids.items():
            for value in grid:
                candidate = make(best, name, value)
                score = _objective(measurements, candidate, dtype)
                if score < best_score - 1e-9:
                    best, best_score, improved = candidate, score, True
        if not improved:
            break
    return with_overrides(best, source="fitted to measurements")


def write_calibration(path: "str | Path", specs: Sequence[GpuSpec], extra: dict | None = None) -> None:
    """A calibration file gpus.load_calibration reads: format, version, {"gpus": {name: constants}}, and
    ``extra`` (the device it was measured on, how many measurements, ...)."""
    from .gpus import CALIBRATION_FORMAT, CALIBRATION_VERSION

    keep = ("efficiency", "kernel_overhead_s", "wave_overhead_s", "tiles", "max_split_k", "source")
    data = {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION,
            "gpus": {s.name: {k: v for k, v in s.to_dict().items() if k in keep} for s in specs}}
    data.update(extra or {})
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


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


def fit_latency_bandwidth(points: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(seconds fixed, seconds per byte) of ``seconds = a + b * bytes`` fitted to measured points in
    relative error (small messages count as much as large ones); a >= 0, b > 0."""
    if len(points) < 2:
        raise ValueError("a collective's table needs at least two message sizes")
    w = [1.0 / max(s, 1e-12) for _, s in points]
    sw = sum(wi * wi for wi in w)
    sx = sum(wi * wi * x for wi, (x, _) in zip(w, points))
    sy = sum(wi * wi * y for wi, (_, y) in zip(w, points))
    sxx = sum(wi * wi * x * x for wi, (x, _) in zip(w, points))
    sxy = sum(wi * wi * x * y for wi, (x, y) in zip(w, points))
    det = sw * sxx - sx * sx
    b = (sw * sxy - sx * sy) / det if det else 0.0
    a = (sy - b * sx) / sw
    if a < 0 or b <= 0:  # a line through the origin then (or a flat one): never a negative part
        b = max(sum(y / x for x, y in points) / len(points), 1e-18)
        a = 0.0
    return a, b
