"""Seconds per call of a function on every rank: each call alone after a barrier, or batches of
back-to-back calls; every rank returns the slowest rank's figure."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from compass_fx.tools.timing import seconds_of_one_call

from .ranks import Ctx, barrier, max_over_ranks, synchronize


def time_fn(ctx: Ctx, fn: Callable[[], Any], warmup: int, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` (after ``warmup`` calls), each call started after a
    barrier; the slowest rank's median (every rank returns the same number).

    CUDA: events around each call; CPU: wall clock."""
    for _ in range(warmup):
        fn()
    synchronize(ctx)
    times = []
    for _ in range(repeats):
        barrier(ctx)
        if ctx.is_cuda:
            torch.cuda.synchronize(ctx.device)
        times.append(seconds_of_one_call(fn, ctx.is_cuda))
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def time_back_to_back(ctx: Ctx, fn, batch: int, batches: int, device_only: bool = False) -> float:
    """Median over ``batches`` of the mean seconds per call of ``batch`` back-to-back calls; the
    slowest rank's figure.  ``device_only``: the GPU first sleeps 20 ms so that the host has queued
    every call before the first starts: the device's time alone, without the host's launch cost."""
    for _ in range(3):
        fn()
    per_call = []
    for _ in range(batches):
        barrier(ctx)
        if ctx.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if device_only:
                torch.cuda._sleep(int(20e-3 * 1.98e9))
            start.record()
            for _ in range(batch):
                fn()
            end.record()
            end.synchronize()
            per_call.append(start.elapsed_time(end) / 1e3 / batch)
        else:
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            per_call.append((time.perf_counter() - t0) / batch)
    return max_over_ranks(ctx, statistics.median(per_call))
