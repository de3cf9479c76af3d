"""One timed call of a function: CUDA events on a GPU, the wall clock elsewhere.

Shared by ``compass-fx calibrate`` and the benchmarks so that every figure is taken the same way.
"""
from __future__ import annotations

import time
from typing import Any, Callable


def seconds_of_one_call(fn: Callable[[], Any], cuda: bool) -> float:
    """Seconds ``fn()`` takes; on CUDA, the device time between events around it."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
