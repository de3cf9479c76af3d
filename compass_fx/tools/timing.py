"""Timed calls of a function: CUDA events on a GPU, the wall clock elsewhere.

Shared by ``compass-fx calibrate`` and the benchmarks so that every figure is taken the same way.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def seconds_of_one_call(fn: Callable[[], Any], cuda: bool) -> float:
    """Seconds ``fn()`` takes; on CUDA, the device time between events around it."""
    return batch_seconds(fn, 1, cuda)


H200_CLOCK_HZ = 1.98e9  # cycles per second of torch.cuda._sleep on the H200 (its boost clock)


def queued_seconds(fn: Callable[[], Any], calls: int, sleep_s: float = 20e-3) -> float:
    """Mean device seconds per call of ``calls`` back-to-back calls that the host has all queued
    before the first starts: the GPU first sleeps ``sleep_s`` (longer than the host's issue of
    the batch), then events around the batch time the device alone.  Why: a GEMM of a few
    hundred rows runs in less time than the host takes to launch it, and timed from an idle GPU
    it measures the launches."""
    import torch

    torch.cuda._sleep(int(sleep_s * H200_CLOCK_HZ))
    return batch_seconds(fn, calls, True)


def median_queued_seconds(fn: Callable[[], Any], calls: int, sleep_s: float = 20e-3, rounds: int = 5) -> float:
    """Median over ``rounds`` of :func:`queued_seconds`, each round started from an idle GPU."""
    import torch

    per_call = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        per_call.append(queued_seconds(fn, calls, sleep_s))
    return statistics.median(per_call)


def issue_seconds(fn: Callable[[], Any], calls: int, cuda: bool, busy_s: float = 0.08, rounds: int = 5) -> float:
    """Median over ``rounds`` of the host's seconds to issue one of ``calls`` calls while the GPU
    is kept busy (it sleeps ``busy_s`` first, so no launch waits for it; ``busy_s=0``: each round
    starts from an idle GPU instead): what a call costs a step whose host is the bottleneck.  On
    CPU, the calls' wall clock."""
    import torch

    per_call = []
    for _ in range(rounds):
        if cuda:
            torch.cuda.synchronize()
            if busy_s > 0:
                torch.cuda._sleep(int(busy_s * H200_CLOCK_HZ))
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) / calls)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(per_call)


def batch_seconds(fn: Callable[[], Any], calls: int, cuda: bool) -> float:
    """Mean seconds per call of ``calls`` back-to-back calls: CUDA events around them on a GPU
    (the device's time once the host keeps ahead), a wall clock on CPU."""
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls
