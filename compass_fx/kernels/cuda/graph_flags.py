"""The epoch and the flag waits of fused calls captured in a CUDA graph, read from GPU memory.

Why: a call issued eagerly passes its epoch to the stream memory operations as a number; a graph
replays the numbers it was captured with, so a replayed wait would see a stale flag as fresh.  A
captured call instead keeps its epoch in a 4-byte counter in GPU memory: the call's first command
raises it (a one-thread kernel on the caller's stream, before anything of the call starts on
any stream), a flag is set by storing the counter onto it (in stream order after the data it
announces: a kernel, or a 4-byte copy after a copy-engine copy, see below), and a flag wait is a
one-thread kernel that spins until the flag reaches counter + delta.  A graph also repeats the
buffer parities it was captured with, which need not alternate from one replay to the next, so
the plan's fence (:func:`..protocol.fenced`) waits for the peers' "done" flag of the last call
that used the same buffers: the first kernel keeps one word per set of buffers with that call's
epoch, and the fence's wait reads its target there.  The spinning kernel is a single program, so it never waits for a peer's grid to
become resident, and it is bounded: past ``COMPASS_FUSED_TIMEOUT_S`` it writes which wait failed
into a host word that the watchdog reads (:func:`.watchdog.Watchdog.watch_status`), then stops
the process's GPU work with a trap, so a lost peer fails the job loudly instead of freezing it.

Small messages.  Inside a graph, each switch between a kernel and the copy engines on one stream
costs about 3.5 us (one H200: a kernel then a 64 KiB copy 7.3 us, alone 0.8 and 2.8 us; copy
after copy and kernel after kernel cost nothing extra), and a captured call alternates between
them at every flag.  So a captured copy of at most ``SMALL_COPY_BYTES`` runs as a kernel
(:func:`copy`), which also sets the flag that announces it when the plan sets one right after
(the last block to finish stores it, after a system-wide fence); a flag set after a kernel is a
kernel too (:func:`set_flag`).  Larger copies stay on the copy engines, whose rate a handful of
blocks would not reach.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

from ..protocol import Copy, Plan, Record, SetFlag, WaitEvent
from . import driver

SOURCE = r"""
// A call's first command: the counter moves to the call's epoch, the fence's target becomes the
// last call that used this call's buffers (``last_use``: one word per set of buffers), and this
// call becomes that last call.
extern "C" __global__ void compass_bump_epoch(int* epoch, int* last_use, int* fence_target) {
  *fence_target = *last_use;
  *epoch += 1;
  *last_use = *epoch;
}

extern "C" __global__ void compass_set_flag(volatile int* flag, const volatile int* epoch) {
  __threadfence_system();
  *flag = *epoch;
  __threadfence_system();
}

// dst[0:n16] = src[0:n16] (16-byte words; either side may be host or peer memory: loads bypass the
// caches), then, if flag: once every block's stores are fenced, the last block stores the epoch.
extern "C" __global__ void compass_copy(uint4* dst, const uint4* src, unsigned long long n16,
                                        volatile int* flag, const volatile int* epoch, unsigned int* arrived) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n16;
       i += (unsigned long long)gridDim.x * blockDim.x)
    __stwt(dst + i, __ldcv(src + i));
  if (flag == 0) return;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(arrived, 1u) == gridDim.x - 1) {
    *arrived = 0;
    __threadfence_system();
    *flag = *epoch;
    __threadfence_system();
  }
}

// Kernels of an EAGER call's replay graph (replay.py): a graph made only of kernel nodes and
// device-to-device copies launches in ~4 us whatever its size, while every copy to or from host
// memory, stream memory operation or memset in it costs the launch ~2 us more.
// The flag codes are constants of the graph (flag_codes: one graph per residue of the epoch).

// Store ``code`` once the stream's earlier work is done (kernel boundary) and fenced system-wide.
extern "C" __global__ void compass_write_code(volatile int* flag, int code) {
  __threadfence_system();
  *flag = code;
  __threadfence_system();
}

// The last node of an eager call's replay graph: one more replayed call of its workspace has
// finished.  ``word`` is pinned host memory that the watchdog reads with no GPU work (instead of an
// event recorded and registered per call).  The replays of one workspace run one after another on
// one stream (impl: a call on another stream is issued, not replayed, until the earlier replays have
// finished: watchdog.Progress.room), so a plain increment from one thread is exact.
extern "C" __global__ void compass_count(volatile unsigned int* word) {
  __threadfence_system();
  *word = *word + 1u;
  __threadfence_system();
}

// A memset node of a captured graph, as a kernel (graph_edit.py: in a graph, a memset node costs
// the launch ~2 us of host, a kernel node next to nothing; cuBLAS clears its workspace with one
// before many of its GEMMs).  ``value`` holds the byte, half or word to store (``size`` 1, 2 or 4
// bytes) into ``height`` rows of ``width`` elements, ``pitch`` bytes apart; a 16-byte pattern
// ``wide`` is stored where a row's bytes and the address are 16-byte multiples.
extern "C" __global__ void compass_memset(unsigned char* dst, unsigned long long pitch, unsigned int value,
                                          unsigned int size, unsigned long long width, unsigned long long height,
                                          uint4 wide, int aligned) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  const unsigned long long first = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  const unsigned long long row_bytes = width * size;
  if (aligned) {
    const unsigned long long n16 = row_bytes / 16;
    for (unsigned long long i = first; i < n16 * height; i += stride)
      *(uint4*)(dst + (i / n16) * pitch + (i % n16) * 16) = wide;
    return;
  }
  for (unsigned long long i = first; i < width * height; i += stride) {
    unsigned char* p = dst + (i / width) * pitch + (i % width) * size;
    if (size == 1) *p = (unsigned char)value;
    else if (size == 2) *(unsigned short*)p = (unsigned short)value;
    else *(unsigned int*)p = value;
  }
}

// Hold the stream until (*flag & bits) != 0 (cuStreamWaitValue32's CU_STREAM_WAIT_VALUE_AND).  One
// thread: it never waits for a peer's grid to become resident.  Unbounded here: the watchdog bounds
// it from the host, as it bounds a stream wait (it stores the awaited code into the flag itself).
extern "C" __global__ void compass_wait_code(const volatile int* flag, int bits) {
  while ((*flag & bits) == 0) __nanosleep(256);
  __threadfence_system();
}

// dst[0:n16] = src[0:n16] in 16-byte words, four loads in flight per thread (a read of host memory
// over PCIe needs many bytes in flight to reach the link's rate); loads bypass the caches (the
// source may be host memory a peer's copy just wrote), stores write through, then a system fence.
extern "C" __global__ void compass_copy_wide(uint4* dst, const uint4* src, unsigned long long n16) {
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n16; i += 4 * stride) {
    const uint4 a = __ldcv(src + i), b = __ldcv(src + i + stride), c = __ldcv(src + i + 2 * stride),
                d = __ldcv(src + i + 3 * stride);
    __stwt(dst + i, a);
    __stwt(dst + i + stride, b);
    __stwt(dst + i + 2 * stride, c);
    __stwt(dst + i + 3 * stride, d);
  }
  for (; i < n16; i += stride) __stwt(dst + i, __ldcv(src + i));
  __threadfence_system();
}

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


KERNELS = ("compass_bump_epoch", "compass_wait_flag", "compass_set_flag", "compass_copy", "compass_write_code",
           "compass_wait_code", "compass_copy_wide", "compass_count", "compass_memset")


@lru_cache(maxsize=None)
def _functions(device_index: int) -> dict[str, int]:
    """The kernels, compiled (NVRTC, through torch) and loaded for ``device_index``'s context."""
    import torch

    try:
        from torch.cuda._utils import _nvrtc_compile
    except ImportError as e:  # a private helper of torch's: say what is missing rather than fail later
        raise RuntimeError("compass fused operators in CUDA graphs need torch.cuda._utils._nvrtc_compile "
                           f"(torch >= 2.8 with NVRTC): {e}") from e
    with torch.cuda.device(device_index):
        torch.cuda.current_stream().synchronize()  # the context exists before the driver loads into it
        # One compile holds every kernel of SOURCE (each is extern "C" and no template, so NVRTC emits
        # them all under their own names): compiling once per kernel cost ~50-100 ms each at start.
        ptx, mangled = _nvrtc_compile(SOURCE, KERNELS[0])
        if mangled != KERNELS[0]:
            raise RuntimeError(f"NVRTC named {KERNELS[0]} {mangled!r}: graph_flags.SOURCE's kernels must be extern \"C\"")
        return driver.load_functions(ptx, KERNELS)


def bump(device_index: int, epoch_address: int, last_use_address: int, fence_target_address: int):
    """``launch(stream)``: raise the call's epoch counter at ``epoch_address`` by one, after
    moving the last call that used this call's buffers (``last_use_address``) to the fence's
    target (``fence_target_address``) and recording this call there instead."""
    return driver.launcher(_functions(device_index)["compass_bump_epoch"],
                           [ctypes.c_uint64(epoch_address), ctypes.c_uint64(last_use_address),
                            ctypes.c_uint64(fence_target_address)])


def wait(device_index: int, flag_address: int, epoch_address: int, delta: int, status_address: int, code: int,
         timeout_s: float):
    """``launch(stream)``: hold ``stream`` until the int32 at ``flag_address`` reaches the counter +
    ``delta``; after ``timeout_s`` store ``code`` at ``status_address`` (host memory) and trap."""
    return driver.launcher(_functions(device_index)["compass_wait_flag"],
                           [ctypes.c_uint64(flag_address), ctypes.c_uint64(epoch_address), ctypes.c_int(delta),
                            ctypes.c_uint64(status_address), ctypes.c_int(code),
                            ctypes.c_uint64(int(timeout_s * 1e9))])


def write_code(device_index: int, flag_address: int, code: int):
    """``launch(stream)``: store ``code`` at ``flag_address`` once the stream's earlier work is done
    (a kernel node: what ``cuStreamWriteValue32`` does, for an eager call's replay graph)."""
    return driver.launcher(_functions(device_index)["compass_write_code"],
                           [ctypes.c_uint64(flag_address), ctypes.c_int(code)])


def count(device_index: int, word_address: int):
    """``launch(stream)``: add one to the uint32 at ``word_address`` (pinned host memory) once the
    stream's earlier work is done (the last node of a replay graph: :class:`.watchdog.Progress`)."""
    return driver.launcher(_functions(device_index)["compass_count"], [ctypes.c_uint64(word_address)])


def wait_code(device_index: int, flag_address: int, bits: int):
    """``launch(stream)``: hold ``stream`` until ``*flag_address & bits`` is nonzero (what
    ``cuStreamWaitValue32`` with ``WAIT_AND`` does, as a one-thread kernel; bounded by the watchdog,
    which releases a late wait by storing the awaited code into the flag)."""
    return driver.launcher(_functions(device_index)["compass_wait_code"],
                           [ctypes.c_uint64(flag_address), ctypes.c_int(bits)])


WIDE_COPY_THREADS = 512
WIDE_COPY_BYTES_PER_BLOCK = 256 << 10  # one block per 256 KiB: a 4 MiB piece gets 16
WIDE_COPY_MOST_BLOCKS = 16


def wide_copy_blocks(nbytes: int) -> int:
    return max(1, min(WIDE_COPY_MOST_BLOCKS, -(-nbytes // WIDE_COPY_BYTES_PER_BLOCK)))


def copy_wide(device_index: int, nbytes: int, blocks: int | None = None):
    """``(launch(stream), set_addresses(dst, src))``: copy ``nbytes`` (whole 16-byte words, 16-byte
    aligned addresses) with a kernel of ``blocks`` blocks (default :func:`wide_copy_blocks`); for
    copies to or from host memory in an eager call's replay graph."""
    if nbytes <= 0 or nbytes % 16:
        raise ValueError(f"a copy kernel moves whole 16-byte words, not {nbytes} bytes")
    dst, src = ctypes.c_uint64(0), ctypes.c_uint64(0)
    launch = driver.launcher(_functions(device_index)["compass_copy_wide"],
                             [dst, src, ctypes.c_uint64(nbytes // 16)],
                             blocks=blocks or wide_copy_blocks(nbytes), threads=WIDE_COPY_THREADS)

    def set_addresses(to: int, frm: int) -> None:
        if (to | frm) % 16:
            raise ValueError(f"a copy kernel needs 16-byte aligned addresses, got {to:#x} <- {frm:#x}")
        dst.value, src.value = to, frm
    return launch, set_addresses


SMALL_COPY_BYTES = 256 << 10  # captured copies up to this size run as a kernel (see the module docstring)
COPY_THREADS = 256
COPY_MOST_BLOCKS = 64


def copy_fits(nbytes: int) -> bool:
    """Whether a captured copy of ``nbytes`` runs as a kernel: small, and whole 16-byte words."""
    return 0 < nbytes <= SMALL_COPY_BYTES and nbytes % 16 == 0


def set_flag(device_index: int, flag_address: int, epoch_address: int):
    """``launch(stream)``: store the counter at ``flag_address`` once the stream's earlier kernels are done."""
    return driver.launcher(_functions(device_index)["compass_set_flag"],
                           [ctypes.c_uint64(flag_address), ctypes.c_uint64(epoch_address)])


def copy(device_index: int, nbytes: int, flag_address: int = 0, epoch_address: int = 0, arrived_address: int = 0):
    """``(launch(stream), set_addresses(dst, src))``: copy ``nbytes`` (:func:`copy_fits`) with
    one block per 4 KiB (at most ``COPY_MOST_BLOCKS``: one load per thread in flight, whatever the
    memory's distance), then, with ``flag_address``, store the counter there (``arrived_address``:
    an int32 in device memory, zero, that the blocks count on)."""
    if not copy_fits(nbytes):
        raise ValueError(f"a copy kernel moves whole 16-byte words up to {SMALL_COPY_BYTES} bytes, not {nbytes}")
    words = nbytes // 16
    blocks = min(COPY_MOST_BLOCKS, -(-words // COPY_THREADS))
    dst, src = ctypes.c_uint64(0), ctypes.c_uint64(0)
    launch = driver.launcher(_functions(device_index)["compass_copy"],
                             [dst, src, ctypes.c_uint64(words), ctypes.c_uint64(flag_address),
                              ctypes.c_uint64(epoch_address), ctypes.c_uint64(arrived_address)],
                             blocks=blocks, threads=COPY_THREADS)

    def set_addresses(to: int, frm: int) -> None:
        if (to | frm) % 16:
            raise ValueError(f"a copy kernel needs 16-byte aligned addresses, got {to:#x} <- {frm:#x}")
        dst.value, src.value = to, frm
    return launch, set_addresses


# How a captured call lowers its copies and flag sets (:func:`engines`)
KERNEL_COPY, KERNEL_COPY_AND_FLAG, DONE_BY_COPY, KERNEL_FLAG, COPY_ENGINE_FLAG = (
    "kernel copy", "kernel copy + flag", "set by its copy", "kernel flag", "copy-engine flag")


def engines(plan: Plan, row_bytes: int) -> dict[int, str]:
    """For each ``Copy`` and ``SetFlag`` of ``plan`` (by position), how a captured call runs it:
    a copy of a small message is a kernel, which also sets the flag the plan sets right after it
    on the same stream (that ``SetFlag`` is then done by the copy); any other flag is a kernel
    unless the stream's previous command runs on the copy engines (a large copy), where a 4-byte
    copy of the counter avoids the switch.  Larger copies (absent here) stay on the copy engines.
    ``row_bytes``: bytes per row of every buffer the plan's copies touch."""
    out: dict[int, str] = {}
    last: dict[str, str] = {}  # stream -> "kernel" or "copy": what its previous command ran on
    pending: dict[str, int] = {}  # stream -> a kernel copy whose stream has had nothing since
    for i, cmd in enumerate(plan.commands):
        stream = cmd.stream
        if isinstance(cmd, Record):  # marks what is done; changes nothing the flag announces
            continue
        if isinstance(cmd, WaitEvent):  # a flag after it may announce another stream's work: no merge
            pending.pop(stream, None)
            continue
        if isinstance(cmd, SetFlag) and stream in pending:
            out[pending.pop(stream)] = KERNEL_COPY_AND_FLAG
            out[i] = DONE_BY_COPY
            continue
        pending.pop(stream, None)
        if isinstance(cmd, Copy):
            if copy_fits(cmd.dst.rows * row_bytes):
                out[i] = KERNEL_COPY
                pending[stream] = i
                last[stream] = "kernel"
            else:
                last[stream] = "copy"
            continue
        if isinstance(cmd, SetFlag):
            out[i] = COPY_ENGINE_FLAG if last.get(stream) == "copy" else KERNEL_FLAG
            continue
        last[stream] = "kernel"  # a GEMM, a sum, a flag wait
    return out
