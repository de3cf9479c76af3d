"""Replay graphs launched by the GPU itself: a fused call's host cost that does not grow with its plan
(issue 27; opt in: ``COMPASS_REPLAY_LAUNCH=device``).

Why: ``cuGraphLaunch`` of a host-launched graph costs the host about 1 us per node (copies to and
from host memory and stream waits ~1.8 us): 21-242 us for the replay graphs of
``fused_host_time``, the bulk of a replayed call.  A graph instantiated for device launch
(``CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH``) can be launched from a kernel; so each replay
graph gets a one-node host graph whose kernel (``compass_tail_launch``) tail-launches it.  The host
then launches one node whatever the plan.  Measured on one H200 (``benchmarks/device_graph_launch.py``):
a graph of 2-32 pieces (6-96 nodes: copies to and from pinned host memory on one branch, kernels
waiting for them on the other) costs the host 5.9 / 20.7 / 109 us launched from the host and
2.9-3.9 us tail-launched; the work after the launcher on the caller's stream waits for the tail
graph (checked with a graph held 20 ms behind a sleep), as the caller's later work must.

What a device graph may hold: kernel, memcpy and memset nodes (copies only between device memory
and device-mapped pinned host memory, which the host-staged arena is).  A stream wait
(``cuStreamWaitValue32``) node is refused, so with device launch a replay graph's flag waits are
kernels (:func:`.replay.waits_as_kernels`); a spinning kernel is fine where each rank has its GPU
(or under MPS) and slow where ranks time-slice one GPU without MPS (``impl._compile_replay`` says
why).  A graph the driver will not instantiate for device launch is launched from the host as
before, with a warning, and device launch stays off for the process.

A graph is uploaded before its first launch, and the host waits for that upload (it runs on the
capture stream, the first launch on the caller's): without the wait, two world-4 runs of 500 calls
under MPS stalled early (calls 8 and 11, during the captures) on a rank "waiting for its own streams"
with every awaited flag set, a graph that never ran; with it, 500 calls passed every case at worlds
2, 4 (three runs, one mixing issued and replayed calls) and 8 (``benchmarks/results/fused_host_stress/``,
``-device-launch-upload-``).  A tail launch the device runtime refuses stores its error where the
watchdog reads it, then traps (:func:`explain_refusal`).

Why it stays opt in: the GPU runs a device-launched graph's copies to and from host memory
without overlapping its GEMM (``benchmarks/results/device_launch_overlap``: overlap 0.09-0.21
against 0.99 launched from the host, the same with the copies in a graph of their own beside a
host-launched GEMM), and overlapping those copies is what the host-staged fused operators are for.
With ranks sharing one H200 (MPS, each rank pinned, also with the SMs split 50/50), the calls'
back-to-back period was longer than the host launch's in 27 of 30 rows (median 1.27x, up to 1.78x;
``fused_host_time-h200-device-launch-pin-mps``) while their host time was 24-52 us at two ranks
against 49-249.  The flag waits it turns into spinning kernels are not the cause: host-launched
graphs with kernel waits keep the host launch's period (``fused_host_time-h200-part50-host-kwait-mps``).

The launcher calls the device runtime (``cudaGraphLaunch`` in device code), which lives in CUDA's
static ``libcudadevrt.a``: the kernel is compiled by NVRTC as relocatable code and linked with that
library by the driver's linker.  The library is looked for in ``COMPASS_CUDADEVRT``, then
``CUDA_HOME`` / ``CUDA_PATH`` and ``/usr/local/cuda*``, then NVIDIA's Python wheels; without it the
graphs are launched from the host, with a warning.
"""
from __future__ import annotations

import ctypes
import glob
import os
import warnings
from functools import lru_cache

from . import driver, env

LAUNCH_SOURCE = r"""
// NVRTC declares the device runtime's API (cudaGraphLaunch and its types) itself.
// Launch `graph` (instantiated for device launch) once this kernel's graph has finished; the work
// after this kernel's graph on its stream waits for it.  A launch the device runtime refuses
// stores its error in `refused` (pinned host memory: the watchdog reads it and names it) and traps,
// so that the context reports an error at the caller's next synchronisation rather than the call's
// work silently not running.
extern "C" __global__ void compass_tail_launch(cudaGraphExec_t graph, volatile int* refused) {
  cudaError_t result = cudaGraphLaunch(graph, (cudaStream_t)0x0100000000000000ull);  // cudaStreamGraphTailLaunch
  if (result != cudaSuccess) {
    *refused = (int)result;
    __threadfence_system();
    __trap();
  }
}
"""

_INSTANTIATE_DEVICE_LAUNCH = 4  # CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH
_JIT_INPUT_PTX, _JIT_INPUT_LIBRARY = 1, 4
_off: list[str] = []  # why device launch was turned off in this process
_warned: list[bool] = []  # the experimental warning was given
_u64, _ptr = ctypes.c_uint64, ctypes.c_void_p


def wanted() -> bool:
    """``COMPASS_REPLAY_LAUNCH`` = ``host`` (default) or ``device``: who launches a replay graph."""
    value = env("COMPASS_REPLAY_LAUNCH", "host").strip().lower()
    if value not in ("host", "device"):
        raise ValueError(f"COMPASS_REPLAY_LAUNCH must be host or device, got {value!r}")
    return value == "device" and not _off


def cudadevrt_candidates() -> list[str]:
    """Where ``libcudadevrt.a`` may be, in the order looked at."""
    paths = []
    given = os.environ.get("COMPASS_CUDADEVRT")
    if given:
        paths.append(given)
    roots = [os.environ.get(name) for name in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    roots += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for root in filter(None, roots):
        paths += [os.path.join(root, sub, "libcudadevrt.a") for sub in ("lib64", "lib", "targets/x86_64-linux/lib")]
    try:
        import nvidia

        for base in nvidia.__path__:
            paths += sorted(glob.glob(os.path.join(base, "*", "lib", "libcudadevrt.a")))
    except ImportError:
        pass
    return paths


def find_cudadevrt() -> str | None:
    """The first ``libcudadevrt.a`` that exists, or None."""
    return next((p for p in cudadevrt_candidates() if os.path.isfile(p)), None)


@lru_cache(maxsize=1)
def _linker() -> dict:
    def fn(names, argtypes):
        return driver.driver_function(names, argtypes)[1]

    return {
        "create": fn(("cuLinkCreate_v2", "cuLinkCreate"), [ctypes.c_uint, _ptr, _ptr, ctypes.POINTER(_ptr)]),
        "add_data": fn(("cuLinkAddData_v2", "cuLinkAddData"), [_ptr, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
                                                                ctypes.c_char_p, ctypes.c_uint, _ptr, _ptr]),
        "add_file": fn(("cuLinkAddFile_v2", "cuLinkAddFile"), [_ptr, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint,
                                                                _ptr, _ptr]),
        "complete": fn(("cuLinkComplete",), [_ptr, ctypes.POINTER(_ptr), ctypes.POINTER(ctypes.c_size_t)]),
        "destroy": fn(("cuLinkDestroy",), [_ptr]),
        "instantiate": fn(("cuGraphInstantiateWithFlags",), [ctypes.POINTER(_ptr), _ptr, ctypes.c_ulonglong]),
        "upload": fn(("cuGraphUpload",), [_ptr, _ptr]),
        "exec_destroy": fn(("cuGraphExecDestroy",), [_ptr]),
    }


@lru_cache(maxsize=None)
def _launch_function(device_index: int) -> int:
    """``compass_tail_launch`` compiled (NVRTC, relocatable), linked with the device runtime and
    loaded into ``device_index``'s context; raises if any step cannot be done here."""
    import torch
    from torch.cuda._utils import _nvrtc_compile

    library = find_cudadevrt()
    if library is None:
        raise RuntimeError("libcudadevrt.a (CUDA's device runtime) not found; looked at "
                           + ", ".join(cudadevrt_candidates()[:6]) + " ... (set COMPASS_CUDADEVRT to its path)")
    with torch.cuda.device(device_index):
        torch.cuda.current_stream().synchronize()  # the context exists before the driver links into it
        ptx, name = _nvrtc_compile(LAUNCH_SOURCE, "compass_tail_launch", nvcc_options=["-rdc=true"])
        lk = _linker()
        state = _ptr()
        driver.check(lk["create"](0, None, None, ctypes.byref(state)), "cuLinkCreate")
        try:
            driver.check(lk["add_data"](state, _JIT_INPUT_PTX, ptx, len(ptx), b"compass_tail_launch.ptx", 0, None,
                                        None), "cuLinkAddData")
            driver.check(lk["add_file"](state, _JIT_INPUT_LIBRARY, library.encode(), 0, None, None), "cuLinkAddFile")
            cubin, size = _ptr(), ctypes.c_size_t()
            driver.check(lk["complete"](state, ctypes.byref(cubin), ctypes.byref(size)), "cuLinkComplete")
            image = ctypes.string_at(cubin, size.value)  # the linker owns its output until destroyed
        finally:
            lk["destroy"](state)
        return driver.load_function(image, name)


def available(device_index: int) -> bool:
    """Whether replay graphs on ``device_index`` can be device-launched (the launcher links and
    loads); warns once and turns device launch off for the process where not."""
    try:
        _launch_function(device_index)
    except Exception as e:  # noqa: BLE001 - launched from the host instead, as before
        turn_off(f"the launcher kernel could not be built ({e})")
        return False
    return True


_refusals: dict = {}  # device index -> the pinned int32 word its launchers report a refused launch in


def refusal_word(device_index: int) -> int:
    """The address of ``device_index``'s word (pinned host memory, watched by its watchdog) where a
    launcher stores the device runtime's error when a tail launch is refused."""
    if device_index not in _refusals:
        import torch

        from . import watchdog

        word = torch.zeros(1, dtype=torch.int32).pin_memory()
        watchdog.for_device(device_index).watch_status(word, explain_refusal)
        _refusals[device_index] = word
    return _refusals[device_index].data_ptr()


def explain_refusal(code: int) -> str:
    """The error of a process whose GPU refused to launch a replay graph with CUDA error ``code``."""
    return (f"compass fused operators: the GPU refused to launch a replay graph (device-side cudaGraphLaunch "
            f"returned CUDA error {code}); the launcher trapped, so this process's CUDA context is lost. "
            "COMPASS_REPLAY_LAUNCH=host (the default) launches replay graphs from the host")


def turn_off(why: str) -> None:
    if not _off:
        _off.append(why)
        warnings.warn(f"compass fused operators: replay graphs are launched from the host: {why}",
                      RuntimeWarning, stacklevel=3)


class DeviceGraph:
    """A replay graph instantiated for device launch (``work``), the captured graph it was made
    from, and ``launcher``: the one-node host graph whose kernel tail-launches it, which
    :class:`.replay.Captured` launches like any replay graph (one node of host launch)."""

    __slots__ = ("work", "captured", "launcher", "_destroy")

    def __init__(self, work: int, captured, launcher) -> None:
        self.work = work  # the CUgraphExec the launcher's kernel tail-launches
        self.captured = captured  # a torch CUDAGraph (keep_graph=True), never instantiated by torch
        self.launcher = launcher  # a torch CUDAGraph holding one launch of compass_tail_launch
        self._destroy = _linker()["exec_destroy"]

    def __del__(self) -> None:
        if self.work:
            self._destroy(_ptr(self.work))
            self.work = 0


def instantiate(captured, device_index: int, capture_stream) -> DeviceGraph | None:
    """``captured`` (a torch CUDAGraph captured with ``keep_graph=True``) instantiated for device
    launch, uploaded, with its launcher captured on ``capture_stream``; None where the driver refuses
    the graph (device launch is then turned off for the process, with a warning naming the refusal)."""
    import torch

    if not available(device_index):
        return None
    if not _warned:
        _warned.append(True)
        warnings.warn("compass fused operators: COMPASS_REPLAY_LAUNCH=device is experimental: the host launches "
                      "less, but the GPU runs a device-launched graph's copies to and from host memory without "
                      "overlapping the GEMMs (slower calls on the GPU); see compass_fx/kernels/cuda/device_launch.py",
                      RuntimeWarning, stacklevel=3)
    lk = _linker()
    work = _ptr()
    try:
        driver.check(lk["instantiate"](ctypes.byref(work), _ptr(captured.raw_cuda_graph()), _INSTANTIATE_DEVICE_LAUNCH),
                     "cuGraphInstantiateWithFlags")
    except driver.DriverError as e:
        turn_off(f"the driver would not instantiate a replay graph for device launch ({e}: a node kind a device "
                 "graph cannot hold, such as a stream wait; COMPASS_REPLAY_WAITS=kernel makes the flag waits kernels)")
        return None
    try:
        driver.check(lk["upload"](work, capture_stream.cuda_stream), "cuGraphUpload")
        # the upload runs on the capture stream, the first launch on the caller's: a graph the GPU
        # launches before its upload has finished is not run (nor refused), so wait for it here
        capture_stream.synchronize()
        kick = driver.launcher(_launch_function(device_index), [_u64(work.value), _u64(refusal_word(device_index))])
        launcher = torch.cuda.CUDAGraph()
        with torch.cuda.stream(capture_stream):
            launcher.capture_begin(capture_error_mode="thread_local")
            try:
                kick(capture_stream.cuda_stream)
            finally:
                launcher.capture_end()
    except BaseException:
        lk["exec_destroy"](work)
        raise
    return DeviceGraph(work.value, captured, launcher)
