"""The epoch and the flag waits of fused calls captured in a CUDA graph, read from GPU memory.

Why: a call issued eagerly passes its epoch to the stream memory operations as a number; a graph
replays the numbers it was captured with, so a replayed wait would see a stale flag as fresh.  A
captured call instead keeps its epoch in a 4-byte counter in GPU memory: the call's first command
raises it (a one-thread kernel on the caller's stream, before anything of the call starts on
any stream), a flag is set by copying the counter onto it (the copy engine, in stream order after
the data it announces), and a flag wait is a one-thread kernel that spins until the flag reaches
counter + delta.  The spinning kernel is a single program, so it never waits for a peer's grid to
become resident, and it is bounded: past ``COMPASS_FUSED_TIMEOUT_S`` it writes which wait failed
into a host word that the watchdog reads (:func:`.watchdog.Watchdog.watch_status`), then stops
the process's GPU work with a trap, so a lost peer fails the job loudly instead of freezing it.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

from . import driver

SOURCE = r"""
extern "C" __global__ void compass_bump_epoch(int* epoch) { *epoch += 1; }

extern "C" __global__ void compass_wait_flag(const volatile int* flag, const volatile int* epoch, int delta,
                                             volatile int* status, int code, unsigned long long timeout_ns) {
  const int target = *epoch + delta;
  if (target < 1) return;  // a wait for the call before the first one
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  while ((int)((unsigned int)*flag - (unsigned int)target) < 0) {  // wrap-around safe
    __nanosleep(200);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > timeout_ns) {
      *status = code;
      __threadfence_system();
      __trap();
    }
  }
  __threadfence_system();
}
"""


@lru_cache(maxsize=None)
def _functions(device_index: int) -> dict[str, int]:
    """The two kernels, compiled (NVRTC, through torch) and loaded for ``device_index``'s context."""
    import torch

    try:
        from torch.cuda._utils import _nvrtc_compile
    except ImportError as e:  # a private helper of torch's: say what is missing rather than fail later
        raise RuntimeError("compass fused operators in CUDA graphs need torch.cuda._utils._nvrtc_compile "
                           f"(torch >= 2.8 with NVRTC): {e}") from e
    with torch.cuda.device(device_index):
        torch.cuda.current_stream().synchronize()  # the context exists before the driver loads into it
        out = {}
        for name in ("compass_bump_epoch", "compass_wait_flag"):
            ptx, mangled = _nvrtc_compile(SOURCE, name)
            out[name] = driver.load_function(ptx, mangled)
    return out


def bump(device_index: int, epoch_address: int):
    """``launch(stream)``: raise the call's epoch counter at ``epoch_address`` by one."""
    return driver.launcher(_functions(device_index)["compass_bump_epoch"], [ctypes.c_uint64(epoch_address)])


def wait(device_index: int, flag_address: int, epoch_address: int, delta: int, status_address: int, code: int,
         timeout_s: float):
    """``launch(stream)``: hold ``stream`` until the int32 at ``flag_address`` reaches the counter +
    ``delta``; after ``timeout_s`` store ``code`` at ``status_address`` (host memory) and trap."""
    return driver.launcher(_functions(device_index)["compass_wait_flag"],
                           [ctypes.c_uint64(flag_address), ctypes.c_uint64(epoch_address), ctypes.c_int(delta),
                            ctypes.c_uint64(status_address), ctypes.c_int(code),
                            ctypes.c_uint64(int(timeout_s * 1e9))])
