"""Where a profiled run's GPU time went: torch.profiler activity sorted into GEMMs, NCCL, copies by
direction and other kernels, each category's busy time, and how much communication ran beside a
GEMM."""
from __future__ import annotations

from typing import Sequence

import torch


def busy_seconds(spans: Sequence[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: time during which at least one ran."""
    total, cur = 0.0, None
    for start, end in sorted(spans):
        if cur is None or start > cur[1]:
            total += (cur[1] - cur[0]) if cur else 0.0
            cur = [start, end]
        else:
            cur[1] = max(cur[1], end)
    return total + ((cur[1] - cur[0]) if cur else 0.0)


def gpu_category(name: str) -> str:
    """What a profiled GPU activity is: nccl, gemm, copy_dtoh / copy_htod / copy_dtod / copy_peer
    (copy engines), or other (kernels: elementwise, attention, reductions ...)."""
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if low.startswith("memcpy"):
        for tag, cat in (("dtoh", "copy_dtoh"), ("htod", "copy_htod"), ("ptop", "copy_peer"), ("dtod", "copy_dtod")):
            if tag in low:
                return cat
        return "copy_other"
    if any(t in low for t in ("gemm", "sm90", "cutlass", "xmma", "nvjet", "matmul")):
        return "gemm"
    return "other"


def gpu_time_summary(prof, steps: int, top: int = 12) -> dict:
    """Per step, from a torch.profiler run on one rank: busy milliseconds per category of GPU
    activity (each category's union of intervals), the GPU's busy and idle time, how much of the
    communication (NCCL and copies) ran beside a GEMM, and the costliest kernels."""
    events = [e for e in prof.events()
              if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0]
    if not events:
        return {"note": "no GPU activity recorded"}
    spans: dict[str, list] = {}
    by_name: dict[str, list] = {}
    for e in events:
        spans.setdefault(gpu_category(e.name), []).append((e.time_range.start, e.time_range.end))
        by_name.setdefault(e.name[:90], []).append(e.time_range.elapsed_us())
    every = [x for v in spans.values() for x in v]
    wall = max(t for _, t in every) - min(s for s, _ in every)
    comm = [x for k, v in spans.items() if k == "nccl" or k.startswith("copy") for x in v]
    gemm = spans.get("gemm", [])
    overlap = busy_seconds(comm) + busy_seconds(gemm) - busy_seconds(comm + gemm)
    per = 1e-3 / steps  # microseconds -> ms per step
    costly = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"steps": steps, "span_ms": wall * per, "busy_ms": busy_seconds(every) * per,
            "idle_ms": (wall - busy_seconds(every)) * per,
            "busy_ms_by_category": {k: busy_seconds(v) * per for k, v in sorted(spans.items())},
            "count_by_category": {k: len(v) / steps for k, v in sorted(spans.items())},
            "communication_beside_gemm_ms": overlap * per,
            "top_kernels": [{"name": n, "ms": sum(t) * per, "count": len(t) / steps} for n, t in costly]}
