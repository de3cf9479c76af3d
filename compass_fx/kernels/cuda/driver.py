"""The few CUDA driver calls the fused operators' data movement needs, through ctypes.

Copies between device buffers (a peer's symmetric buffer included: its address is mapped into
this process), or between a device and registered host memory, are ``cuMemcpyAsync``, which the copy engines carry; arrival flags are stream
memory operations (``cuStreamWriteValue32`` fences the stream's earlier writes, then stores;
``cuStreamWaitValue32`` holds the stream until a 32-bit value reaches a bound).  None of them
runs on a multiprocessor, so none can be starved by a GEMM that fills the GPU, and each costs the
host a few microseconds instead of a kernel launch through Python.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Any

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, wrap-around safe
WAIT_AND = 0x2  # CU_STREAM_WAIT_VALUE_AND: (*addr & value) != 0
_u64, _u32, _ptr = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_void_p


class DriverError(RuntimeError):
    """A CUDA driver call failed."""


@lru_cache(maxsize=1)
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def driver_function(names: tuple[str, ...], argtypes: list) -> tuple[str, Any]:
    """The first of ``names`` (newest version first) that libcuda exports, typed with ``argtypes``
    and returning a ``CUresult``, with the name found."""
    lib = _libcuda()
    for name in names:
        f = getattr(lib, name, None)
        if f is not None:
            f.argtypes, f.restype = argtypes, ctypes.c_int
            return name, f
    raise DriverError(f"libcuda has none of {names}")


@lru_cache(maxsize=1)
def _lib() -> dict:
    def fn(names: tuple[str, ...], argtypes):
        return driver_function(names, argtypes)[1]

    return {
        "memcpy": fn(("cuMemcpyAsync",), [_u64, _u64, ctypes.c_size_t, _ptr]),
        "memcpy_2d": fn(("cuMemcpy2DAsync_v2", "cuMemcpy2DAsync"), [ctypes.c_void_p, _ptr]),
        "wait": fn(("cuStreamWaitValue32_v2", "cuStreamWaitValue32"), [_ptr, _u64, _u32, ctypes.c_uint]),
        "batch": fn(("cuStreamBatchMemOp_v2", "cuStreamBatchMemOp"), [_ptr, ctypes.c_uint, _ptr, ctypes.c_uint]),
        "write": fn(("cuStreamWriteValue32_v2", "cuStreamWriteValue32"), [_ptr, _u64, _u32, ctypes.c_uint]),
        "error_name": fn(("cuGetErrorName",), [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]),
        "host_register": fn(("cuMemHostRegister_v2", "cuMemHostRegister"), [_ptr, ctypes.c_size_t, ctypes.c_uint]),
        "host_device_pointer": fn(("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"),
                                  [ctypes.POINTER(_u64), _ptr, ctypes.c_uint]),
        "module_load": fn(("cuModuleLoadData",), [ctypes.POINTER(_ptr), ctypes.c_char_p]),
        "module_function": fn(("cuModuleGetFunction",), [ctypes.POINTER(_ptr), _ptr, ctypes.c_char_p]),
        "launch": fn(("cuLaunchKernel",), [_ptr, _u32, _u32, _u32, _u32, _u32, _u32, _u32, _ptr,
                                          ctypes.POINTER(_ptr), _ptr]),
        "capture_mode": fn(("cuThreadExchangeStreamCaptureMode",), [ctypes.POINTER(ctypes.c_int)]),
        "graph_launch": fn(("cuGraphLaunch",), [_ptr, _ptr]),
        "event_record": fn(("cuEventRecord",), [_ptr, _ptr]),
        "event_record_flags": fn(("cuEventRecordWithFlags",), [_ptr, _ptr, ctypes.c_uint]),
        "stream_wait_event": fn(("cuStreamWaitEvent",), [_ptr, _ptr, ctypes.c_uint]),
        "event_create": fn(("cuEventCreate",), [ctypes.POINTER(_ptr), ctypes.c_uint]),
        "event_query": fn(("cuEventQuery",), [_ptr]),
    }


def check(result: int, what: str) -> None:
    """Raise :class:`DriverError` for a non-zero result of a driver call (also of a :func:`raw` one)."""
    if result:
        name = ctypes.c_char_p()
        _lib()["error_name"](result, ctypes.byref(name))
        raise DriverError(f"{what} failed: CUDA driver error {result} ({(name.value or b'?').decode()})")


def raw(name: str):
    """The ctypes function behind ``memcpy`` / ``wait`` / ``write`` (arguments as those take them,
    the stream first for the stream operations), ``graph_launch`` (graph exec, stream) or
    ``event_record`` (event, stream), for callers that issue many calls and check the
    result themselves (:func:`check`): it skips a lookup and a Python frame per call."""
    return _lib()[name]


def memcpy(dst: int, src: int, nbytes: int, stream: int) -> None:
    """Copy ``nbytes`` from device address ``src`` to ``dst`` on ``stream`` (copy engine)."""
    check(_lib()["memcpy"](dst, src, nbytes, stream), "cuMemcpyAsync")


class _Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D``: both ends as unified addresses (device memory, or host memory mapped for
    the device), so only the ``*Device`` fields and the pitches matter."""
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", _u64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
                ("dstHost", ctypes.c_void_p), ("dstDevice", _u64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t), ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


_UNIFIED = 4  # CU_MEMORYTYPE_UNIFIED


def memcpy_lines(dst: int, src: int, width: int, height: int, dst_pitch: int, src_pitch: int, stream: int) -> None:
    """``height`` copies of ``width`` bytes, line ``i`` from ``src + i * src_pitch`` to
    ``dst + i * dst_pitch``, as one copy-engine copy on ``stream`` (one node of a captured graph)."""
    if height == 1:
        check(_lib()["memcpy"](dst, src, width, stream), "cuMemcpyAsync")
        return
    assert ctypes.sizeof(_Memcpy2D) == 128, "CUDA_MEMCPY2D is 128 bytes"
    params = _Memcpy2D(srcMemoryType=_UNIFIED, srcDevice=src, srcPitch=src_pitch,
                       dstMemoryType=_UNIFIED, dstDevice=dst, dstPitch=dst_pitch, WidthInBytes=width, Height=height)
    check(_lib()["memcpy_2d"](ctypes.addressof(params), stream), "cuMemcpy2DAsync")


def wait_at_least(addr: int, value: int, stream: int) -> None:
    """Hold ``stream`` until the int32 at ``addr`` is >= ``value`` (wrap-around safe)."""
    check(_lib()["wait"](stream, addr, value & 0xFFFFFFFF, WAIT_GEQ), "cuStreamWaitValue32")


def write(addr: int, value: int, stream: int) -> None:
    """Once ``stream``'s earlier work is done and visible: store ``value`` at ``addr``."""
    check(_lib()["write"](stream, addr, value & 0xFFFFFFFF, 0), "cuStreamWriteValue32")


class _WaitOp(ctypes.Structure):
    """``CUstreamBatchMemOpParams`` holding a 32-bit wait (the union is 48 bytes)."""
    _fields_ = [("operation", _u32), ("address", _u64), ("value", _u64), ("flags", ctypes.c_uint),
                ("alias", _u64), ("pad", _u64)]


_BATCH_WAIT_VALUE_32 = 1  # CU_STREAM_MEM_OP_WAIT_VALUE_32
_BATCH_MOST = 256  # ops cuStreamBatchMemOp takes at once


def wait_all(waits: list[tuple[int, int, int]]):
    """Issuing ``stream``'s wait until every ``(addr, value, flags)`` holds, as one
    ``cuStreamBatchMemOp`` (each as ``cuStreamWaitValue32`` would wait): one node in a captured
    graph instead of one per wait, which a graph's launch pays ~1 us each for
    (``benchmarks/results/graph_node_probe/graph_node_probe-h200-chain2.json``)."""
    if not waits:
        raise ValueError("wait_all needs at least one wait")
    assert ctypes.sizeof(_WaitOp) == 48, "CUstreamBatchMemOpParams is 48 bytes"
    batch = _lib()["batch"]
    arrays = []
    for first in range(0, len(waits), _BATCH_MOST):
        part = waits[first:first + _BATCH_MOST]
        ops = (_WaitOp * len(part))(*[_WaitOp(_BATCH_WAIT_VALUE_32, addr, value & 0xFFFFFFFF, flags, 0, 0)
                                       for addr, value, flags in part])
        arrays.append((len(part), ctypes.cast(ops, _ptr), ops))  # the array lives as long as the function

    def run(stream: int) -> None:
        for count, pointer, _ in arrays:
            result = batch(stream, count, pointer, 0)
            if result:
                check(result, "cuStreamBatchMemOp")
    return run


_HOST_REGISTER_PORTABLE, _HOST_REGISTER_DEVICEMAP = 0x01, 0x02


def host_register(addr: int, nbytes: int) -> int:
    """Page-lock the host memory at ``addr`` for every context and map it for the device; returns
    the address a GPU uses for it (DMA for copies, in-place flag reads and writes)."""
    check(_lib()["host_register"](addr, nbytes, _HOST_REGISTER_PORTABLE | _HOST_REGISTER_DEVICEMAP),
           "cuMemHostRegister")
    dptr = _u64()
    check(_lib()["host_device_pointer"](ctypes.byref(dptr), addr, 0), "cuMemHostGetDevicePointer")
    return dptr.value


def load_function(ptx: bytes, name: str) -> int:
    """The handle of kernel ``name`` in the compiled module ``ptx`` (loaded into the current context)."""
    return load_functions(ptx, (name,))[name]


def load_functions(ptx: bytes, names: tuple[str, ...]) -> dict[str, int]:
    """The handles of kernels ``names`` in the compiled module ``ptx``, loaded once into the current
    context (one module for all of them: each load is a module of its own in the context)."""
    module = _ptr()
    check(_lib()["module_load"](ctypes.byref(module), ptx), "cuModuleLoadData")
    out = {}
    for name in names:
        function = _ptr()
        check(_lib()["module_function"](ctypes.byref(function), module, name.encode()), "cuModuleGetFunction")
        out[name] = function.value
    return out


def launcher(function: int, args: list, blocks: int = 1, threads: int = 1):
    """A function ``launch(stream)`` that runs ``function`` on ``blocks`` x ``threads`` with
    ``args`` (ctypes values, kept alive here): the arguments are packed once, so a launch is one
    driver call (a caller may change an argument's ``.value`` between launches)."""
    kept = list(args)
    params = (_ptr * len(kept))(*[ctypes.cast(ctypes.byref(a), _ptr) for a in kept])
    launch = _lib()["launch"]

    def run(stream: int) -> None:
        check(launch(function, blocks, 1, 1, threads, 1, 1, 0, stream, params, None), "cuLaunchKernel")
    run.kept = (kept, params)  # the packed arguments live as long as the launcher
    return run


_EVENT_DISABLE_TIMING, _NOT_READY = 0x2, 600
_EVENT_RECORD_EXTERNAL = 0x1


class Event:
    """A CUDA event of the current context, recorded and queried by the driver directly (what the
    watchdog needs of an event: ``record`` on a stream handle, ``query``).  Never destroyed: the
    watchdog's pools reuse them for the life of the process."""

    __slots__ = ("handle",)

    def __init__(self) -> None:
        self.handle = _ptr()
        check(_lib()["event_create"](ctypes.byref(self.handle), _EVENT_DISABLE_TIMING), "cuEventCreate")

    def record(self, stream: int) -> None:
        check(_lib()["event_record"](self.handle, stream), "cuEventRecord")

    def record_external(self, stream: int) -> None:
        """Record on ``stream``; captured in a CUDA graph, an event record node of its own: every
        launch of the graph records this event, which streams outside the graph can wait for."""
        check(_lib()["event_record_flags"](self.handle, stream, _EVENT_RECORD_EXTERNAL), "cuEventRecordWithFlags")

    def wait_on(self, stream: int) -> None:
        """Make ``stream``'s later work wait for this event's last record."""
        check(_lib()["stream_wait_event"](stream, self.handle, 0), "cuStreamWaitEvent")

    def query(self) -> bool:
        result = _lib()["event_query"](self.handle)
        if result == _NOT_READY:
            return False
        check(result, "cuEventQuery")
        return True


_CAPTURE_MODE_RELAXED = 2


def relax_capture_mode() -> None:
    """Let this thread make CUDA calls (e.g. query events) while another thread captures a CUDA
    graph: in the default ("global") mode such a call fails and invalidates that capture."""
    mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
    check(_lib()["capture_mode"](ctypes.byref(mode)), "cuThreadExchangeStreamCaptureMode")
