"""Seconds per call of a function on every rank: each call alone after a barrier, batches of
back-to-back calls, or several functions' batches side by side (interleaved rounds); every rank
returns the slowest rank's figure."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from compass_fx.tools.timing import batch_seconds, queued_seconds, seconds_of_one_call

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
        if ctx.is_cuda and device_only:
            per_call.append(queued_batch_seconds(fn, batch))
        else:
            per_call.append(batch_seconds(fn, batch, ctx.is_cuda))
    return max_over_ranks(ctx, statistics.median(per_call))


def queued_batch_seconds(fn: Callable[[], Any], calls: int, sleep_s: float = 20e-3) -> float:
    """:func:`batch_seconds` of a batch the host has all queued before the first call starts (the
    GPU sleeps ``sleep_s`` first, longer than the host's issue): the device's time alone."""
    return queued_seconds(fn, calls, sleep_s)


def median_batch_seconds(fn: Callable[[], Any], calls: int, rounds: int, cuda: bool = True) -> float:
    """One process's :func:`batch_seconds`, median of ``rounds`` batches (one-GPU benchmarks)."""
    return statistics.median(batch_seconds(fn, calls, cuda) for _ in range(rounds))


def warm_up(ctx: Ctx, fn: Callable[[], Any], calls: int) -> None:
    """Call ``fn`` (compiling it, building its workspaces) and wait for the device."""
    for _ in range(max(1, calls)):
        fn()
    synchronize(ctx)


def graphed(ctx: Ctx, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` (warmed up: compiled, its workspaces built) captured once in a CUDA graph; the
    returned function replays it, so a timing sees the device's work without the host's issue.
    Every rank captures the same functions in the same order; on CPU ``fn`` itself."""
    if not ctx.is_cuda:
        return fn
    import torch

    synchronize(ctx)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    synchronize(ctx)
    return graph.replay


def _batch_seconds(ctx: Ctx, fn: Callable[[], Any], batch: int) -> float:
    """Mean seconds per call of ``batch`` back-to-back calls started after a barrier."""
    barrier(ctx)
    return batch_seconds(fn, batch, ctx.is_cuda)


def time_interleaved(ctx: Ctx, fns: dict[str, Callable[[], Any]], batch: int, rounds: int
                     ) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per call of each of ``fns`` (warmed up), measured side by side: each of ``rounds``
    rounds times one back-to-back batch of every function, the order rotated by one per round.
    Returns (median over rounds, interquartile range over rounds / median), the slowest rank's."""
    labels = list(fns)
    samples: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(rounds):
        shift = r % len(labels)
        for label in labels[shift:] + labels[:shift]:
            samples[label].append(_batch_seconds(ctx, fns[label], max(1, batch)))

    def spread(xs: list[float]) -> float:
        if len(xs) < 4:
            return (max(xs) - min(xs)) / statistics.median(xs)
        q = statistics.quantiles(xs, n=4)
        return (q[2] - q[0]) / statistics.median(xs)

    figures = torch.tensor([[statistics.median(samples[x]) for x in labels], [spread(samples[x]) for x in labels]],
                           dtype=torch.float64, device=ctx.device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    medians, spreads = figures.tolist()
    return dict(zip(labels, medians)), dict(zip(labels, spreads))


def sleep_cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on the current GPU (its clock, measured once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def host_us_per_call(fn: Callable[[], Any], calls: int = 4) -> float:
    """Host microseconds per call of ``calls`` calls of ``fn`` issued from now (nothing waited
    for: what the host spends issuing them, not the GPU's time)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def spin(seconds: float) -> None:
    """Keep the host busy for ``seconds`` (no sleep: a waiting core clocks down)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def synchronize_polling() -> None:
    """Wait for the current stream by polling it in a busy loop (no pause instruction, no sleep, no
    yield: a core that never looks idle to its host or hypervisor), then synchronize (which then
    finds nothing to wait for)."""
    stream = torch.cuda.current_stream()
    while not stream.query():
        pass
    torch.cuda.synchronize()


def python_loop() -> int:
    """A fixed piece of pure Python (200 additions): what the host's speed alone makes of it, beside
    the CUDA calls a probe times."""
    total = 0
    for i in range(200):
        total += i
    return total
