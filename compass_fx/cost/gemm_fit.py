"""Fitting the GEMM model's per-GPU constants to measured GEMM times (``compass-fx calibrate``
and benchmarks/gemm_model_validation.py measure them, ``tools.calibrate``).

A measurement is the time of one (m x k) @ (k x n) GEMM run as ``parts`` back-to-back GEMMs of
m/parts rows, as InterDecom runs it.  The fit is a deterministic coordinate search that minimises
the median relative error of the absolute times and of the split/unsplit ratios together.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from ..machine.gpus import GpuSpec, with_overrides
from .gemm import gemm_seconds


@dataclass(frozen=True)
class GemmMeasurement:
    m: int
    n: int
    k: int
    parts: int
    seconds: float


def model_errors(measurements: Sequence[GemmMeasurement], spec: GpuSpec, dtype: str = "bfloat16") -> dict:
    """Relative errors of the model: on absolute times, and on split/unsplit ratios (parts > 1)."""
    return _errors(measurements, spec, dtype, keep_rows=True)


def _errors(measurements: Sequence[GemmMeasurement], spec: GpuSpec, dtype: str, keep_rows: bool) -> dict:
    """:func:`model_errors`; without ``keep_rows`` only the summary (what a fit's search needs, for
    every candidate constant: each distinct GEMM is priced once, the rows are not built)."""
    unsplit = {(r.m, r.n, r.k): r.seconds for r in measurements if r.parts == 1}
    priced: dict[tuple[int, int, int], float] = {}

    def seconds(m: int, n: int, k: int) -> float:
        t = priced.get((m, n, k))
        if t is None:
            t = priced[(m, n, k)] = gemm_seconds(m, n, k, dtype, spec)
        return t

    abs_err, ratio_err, rows = [], [], []
    for r in measurements:
        predicted = r.parts * seconds(r.m // r.parts, r.n, r.k)
        e = predicted / r.seconds - 1.0
        abs_err.append(abs(e))
        base = unsplit.get((r.m, r.n, r.k))
        ratio = None
        if r.parts > 1 and base:
            measured_ratio = r.seconds / base
            model_ratio = predicted / seconds(r.m, r.n, r.k)
            ratio = model_ratio / measured_ratio - 1.0
            ratio_err.append(abs(ratio))
        if keep_rows:
            row = {"m": r.m, "n": r.n, "k": r.k, "parts": r.parts, "measured_s": r.seconds,
                   "model_s": predicted, "abs_error": e}
            if ratio is not None:
                row.update(measured_ratio=measured_ratio, model_ratio=model_ratio, ratio_error=ratio)
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
    e = _errors(measurements, spec, dtype, keep_rows=False)
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
        **{f"tile{i}": [x / 20 for x in range(2, 21)] for i in range(1, len(base.tiles))},  # the first is the reference
        "max_split_k": [1, 2, 4, 8],
    }

    def make(spec: GpuSpec, name: str, value: float) -> GpuSpec:
        if name.startswith("tile"):
            i = int(name[4:])
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
