"""A captured replay graph's memset nodes become kernel nodes before it is instantiated.

Why (issue 27): every node of a graph that is not a kernel or a device-to-device copy costs
``cuGraphLaunch`` about 2 us of host per launch (``benchmarks/results/host_cost_probe``: 64 cuBLAS
GEMMs with their memsets launch in 137 us, 64 tiny kernels in 4.3), and cuBLAS clears its workspace
with a memset before many of its GEMMs, so an eager fused call replayed from a graph paid ~2 us per
GEMM of its plan for memsets alone.  Here each memset node is replaced by a kernel node
(``compass_memset`` in :mod:`.graph_flags`) that stores the same value into the same bytes, with the
same dependencies before and after it: the graph computes exactly what it did, in the same order.
``COMPASS_REPLAY_MEMSETS=memset`` keeps the memset nodes.

Everything is read first (every memset's parameters and edges) and the graph is changed only
after, so a driver call that fails leaves the graph as captured; a failure in the middle of the
changes raises, and :mod:`.replay` then turns replays off (the call is issued as before).
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

from . import driver

_MEMSET_NODE = 2  # CU_GRAPH_NODE_TYPE_MEMSET
THREADS = 256
MOST_BLOCKS = 264  # two per multiprocessor of an H200: a workspace clear is a few KiB to MiB
_ptr, _u64, _u32, _size = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_size_t


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", _u64), ("pitch", _size), ("value", _u32), ("elementSize", _u32), ("width", _size),
                ("height", _size)]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2 (v1 is its first nine fields)
    _fields_ = [("func", _ptr), ("gridDimX", _u32), ("gridDimY", _u32), ("gridDimZ", _u32),
                ("blockDimX", _u32), ("blockDimY", _u32), ("blockDimZ", _u32), ("sharedMemBytes", _u32),
                ("kernelParams", ctypes.POINTER(_ptr)), ("extra", ctypes.POINTER(_ptr)), ("kern", _ptr),
                ("ctx", _ptr)]


class _Uint4(ctypes.Structure):
    _fields_ = [("x", _u32), ("y", _u32), ("z", _u32), ("w", _u32)]


@lru_cache(maxsize=1)
def _api() -> dict:
    fn = driver.driver_function
    nodes = ctypes.POINTER(_ptr)
    return {
        "nodes": fn(("cuGraphGetNodes",), [_ptr, nodes, ctypes.POINTER(_size)])[1],
        "type": fn(("cuGraphNodeGetType",), [_ptr, ctypes.POINTER(ctypes.c_int)])[1],
        "memset": fn(("cuGraphMemsetNodeGetParams",), [_ptr, ctypes.POINTER(_MemsetParams)])[1],
        "deps": fn(("cuGraphNodeGetDependencies",), [_ptr, nodes, ctypes.POINTER(_size)])[1],
        "dependents": fn(("cuGraphNodeGetDependentNodes",), [_ptr, nodes, ctypes.POINTER(_size)])[1],
        "add_kernel": fn(("cuGraphAddKernelNode_v2", "cuGraphAddKernelNode"),
                         [ctypes.POINTER(_ptr), _ptr, nodes, _size, ctypes.POINTER(_KernelParams)]),
        "add_edges": fn(("cuGraphAddDependencies",), [_ptr, nodes, nodes, _size])[1],
        "destroy": fn(("cuGraphDestroyNode",), [_ptr])[1],
    }


def _listed(call, *head) -> list[int]:
    """A driver list query (``call(*head, array, &count)``, asked for the count first)."""
    n = _size(0)
    driver.check(call(*head, None, ctypes.byref(n)), "a cuGraph query")
    if not n.value:
        return []
    array = (_ptr * n.value)()
    driver.check(call(*head, array, ctypes.byref(n)), "a cuGraph query")
    return [array[i] for i in range(n.value)]


def _pattern(value: int, size: int) -> int:
    """The 32-bit word that ``size``-byte elements of ``value`` repeat."""
    if size == 1:
        return (value & 0xFF) * 0x01010101
    if size == 2:
        return (value & 0xFFFF) * 0x00010001
    return value & 0xFFFFFFFF


def kernel_arguments(p: _MemsetParams) -> tuple[list, int]:
    """``compass_memset``'s arguments for memset ``p`` (ctypes values) and its number of blocks."""
    row_bytes = p.width * p.elementSize
    aligned = int(row_bytes % 16 == 0 and p.dst % 16 == 0 and (p.height == 1 or p.pitch % 16 == 0))
    word = _pattern(p.value, p.elementSize)
    units = (row_bytes // 16 if aligned else p.width) * p.height
    blocks = max(1, min(MOST_BLOCKS, -(-units // (THREADS * 4))))
    args = [_u64(p.dst), _u64(p.pitch), _u32(p.value), _u32(p.elementSize), _u64(p.width), _u64(p.height),
            _Uint4(word, word, word, word), ctypes.c_int(aligned)]
    return args, blocks


skipped: list[str] = []  # why a graph kept its memsets (a query the driver refused), the first time


def _memsets(api: dict, graph: int) -> list[tuple]:
    """(node, parameters, dependencies, dependents) of every memset node of ``graph``."""
    found = []
    for node in _listed(api["nodes"], graph):
        kind = ctypes.c_int()
        driver.check(api["type"](node, ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value != _MEMSET_NODE:
            continue
        params = _MemsetParams()
        driver.check(api["memset"](node, ctypes.byref(params)), "cuGraphMemsetNodeGetParams")
        if params.elementSize not in (1, 2, 4):
            raise driver.DriverError(f"a memset node of element size {params.elementSize}")
        found.append((node, params, _listed(api["deps"], node), _listed(api["dependents"], node)))
    return found


def memsets_as_kernels(graph: int, function: int) -> int:
    """Replace every memset node of ``graph`` (a ``CUgraph``, not instantiated) by a launch of
    ``function`` (``compass_memset``, loaded in the current context) with the same edges; returns
    how many were replaced."""
    api = _api()
    try:
        found = _memsets(api, graph)
    except driver.DriverError as e:  # nothing changed: the graph keeps its memsets
        if not skipped:
            skipped.append(str(e))
        return 0
    add_name, add_kernel = api["add_kernel"]
    for node, params, before, after in found:
        args, blocks = kernel_arguments(params)
        pointers = (_ptr * len(args))(*[ctypes.cast(ctypes.byref(a), _ptr) for a in args])
        kp = _KernelParams(func=function, gridDimX=blocks, gridDimY=1, gridDimZ=1, blockDimX=THREADS,
                           blockDimY=1, blockDimZ=1, sharedMemBytes=0, kernelParams=pointers, extra=None,
                           kern=None, ctx=None)
        new = _ptr()
        deps = (_ptr * max(1, len(before)))(*before)
        driver.check(add_kernel(ctypes.byref(new), graph, deps if before else None, len(before), ctypes.byref(kp)),
                     add_name)  # the arguments are copied into the node here
        for dependent in after:
            driver.check(api["add_edges"](graph, ctypes.byref(new), (_ptr * 1)(dependent), 1),
                         "cuGraphAddDependencies")
        driver.check(api["destroy"](node), "cuGraphDestroyNode")
    return len(found)
