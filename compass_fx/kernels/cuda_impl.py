"""CUDA implementation of the fused operators: symmetric memory + the Triton kernels.

Per call: zero the signal counters and pass a barrier (so no rank signals before every peer has
zeroed, and no rank overwrites a buffer a peer still reads from the previous call), then run
:mod:`.pipeline` with one CUDA stream per ring direction for the movers/adders and the current
stream for the GEMM.  The persistent GEMM leaves ``COMM_SMS`` multiprocessors free so that the
movers, which spin on their peers' counters, always find room next to it.

Buffers live in symmetric memory (``torch.distributed._symmetric_memory``), allocated once per
(group, shape, dtype) and reused; results are copied out of them because the next call
overwrites them.  A group of size 1 without a process group uses plain device memory.
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Sequence

import torch

from .cpu_impl import resolve_group

COMM_SMS = int(os.environ.get("COMPASS_COMM_SMS", "16"))
_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
_workspaces: dict[tuple, "_Workspace"] = {}
_streams: dict[tuple[int, int], torch.cuda.Stream] = {}


def supported(dtype: torch.dtype) -> bool:
    """True where the Triton path runs: a CUDA device, Triton importable, a supported dtype.

    ``COMPASS_CUDA_FUSED=p2p`` sends CUDA tensors to the point-to-point implementation instead
    (a safety valve: the symmetric-memory path has been run on one GPU only so far)."""
    if os.environ.get("COMPASS_CUDA_FUSED", "triton") == "p2p":
        return False
    return (dtype in _SUPPORTED and torch.cuda.is_available()
            and importlib.util.find_spec("triton") is not None)


def _stream(device: torch.device, i: int) -> torch.cuda.Stream:
    key = (device.index or 0, i)
    if key not in _streams:
        _streams[key] = torch.cuda.Stream(device=device)
    return _streams[key]


class _Workspace:
    """Named buffers of one rank, symmetric across the group, plus one int32 counter array."""

    def __init__(self, group_name: str, group, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 device: torch.device) -> None:
        self.group = group
        self.local: dict[str, torch.Tensor] = {}
        self.handles: dict[str, object] = {}
        if group is None or device.type != "cuda":
            if group is not None and group.size() > 1:
                raise RuntimeError("symmetric memory needs CUDA for more than one rank")
            for name, (shape, dtype) in shapes.items():
                self.local[name] = torch.zeros(shape, dtype=dtype, device=device)
            return
        import torch.distributed._symmetric_memory as symm_mem

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group_name)
        for name, (shape, dtype) in shapes.items():
            t = symm_mem.empty(shape, dtype=dtype, device=device)
            if dtype == torch.int32:
                t.zero_()
            self.local[name] = t
            self.handles[name] = symm_mem.rendezvous(t, group_name)

    def peer(self, rank: int, name: str) -> torch.Tensor:
        t = self.local[name]
        return self.handles[name].get_buffer(rank, tuple(t.shape), t.dtype)

    def start_call(self, counters: Sequence[str], stream: torch.cuda.Stream) -> None:
        """Zero this rank's counters, then wait until every rank has done the same."""
        with torch.cuda.stream(stream):
            for name in counters:
                self.local[name].zero_()
            if self.handles:
                self.handles[counters[0]].barrier(channel=0)


def _workspace(key: tuple, group_name: str, group, shapes, device) -> _Workspace:
    ws = _workspaces.get(key)
    if ws is None:
        ws = _workspaces[key] = _Workspace(group_name, group, shapes, device)
    return ws


def _run(ws: _Workspace, rank: int, world: int, counters: Sequence[str], device: torch.device, body) -> None:
    """Zero counters + barrier, then ``body(RankBuffers)`` with a stream per ring direction.

    On a non-CUDA device (the Triton interpreter, for dry runs) everything runs in order."""
    from .pipeline import RankBuffers

    if device.type != "cuda":
        for name in counters:
            ws.local[name].zero_()
        body(RankBuffers(rank, world, ws.local, ws.peer, gemm_programs=4))
        return
    main = torch.cuda.current_stream(device)
    comm = [_stream(device, 0), _stream(device, 1)]
    for s in comm:
        s.wait_stream(main)
    ws.start_call(counters, comm[0])
    main.wait_stream(comm[0])
    comm[1].wait_stream(comm[0])

    def stream(i: int):
        return torch.cuda.stream(main if i < 0 else comm[i])

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    buf = RankBuffers(rank, world, ws.local, ws.peer, stream,
                      gemm_programs=sms - COMM_SMS if world > 1 else sms)
    body(buf)
    for s in comm:
        main.wait_stream(s)


def all_gather_matmul(a_shard: torch.Tensor, bs: Sequence[torch.Tensor], schedule: str, group_name: str,
                      group_size: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """See ``compass::all_gather_matmul``; the gathered rows are assembled in symmetric memory."""
    from . import pipeline
    from .schedules import parts_of

    group, rank = resolve_group(group_name, group_size)
    m, k = a_shard.shape
    rows = m * group_size
    n_pieces = group_size * parts_of(schedule)
    key = ("ag", group_name, group_size, rows, k, a_shard.dtype, a_shard.device, n_pieces)
    ws = _workspace(key, group_name, group, {"G": ((rows, k), a_shard.dtype),
                                             "F": ((n_pieces,), torch.int32)}, a_shard.device)
    outs = [torch.empty((rows, b.shape[1]), dtype=a_shard.dtype, device=a_shard.device) for b in bs]
    _run(ws, rank, group_size, ["F"], a_shard.device,
         lambda buf: pipeline.all_gather_matmul(a_shard, bs, outs, schedule, buf))
    return ws.local["G"].clone(), outs


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, schedule: str, group_name: str,
                          group_size: int) -> torch.Tensor:
    """See ``compass::matmul_reduce_scatter``; partial products and running sums in symmetric memory."""
    from . import pipeline
    from .schedules import parts_of

    group, rank = resolve_group(group_name, group_size)
    rows, n = a.shape[0], b.shape[1]
    n_pieces = group_size * parts_of(schedule)
    key = ("rs", group_name, group_size, rows, n, a.dtype, a.device, n_pieces)
    ws = _workspace(key, group_name, group, {"P": ((rows, n), a.dtype), "ACC": ((rows, n), a.dtype),
                                             "PF": ((n_pieces,), torch.int32),
                                             "AF": ((n_pieces,), torch.int32)}, a.device)
    out = torch.empty((rows // group_size, n), dtype=a.dtype, device=a.device)
    _run(ws, rank, group_size, ["PF", "AF"], a.device,
         lambda buf: pipeline.matmul_reduce_scatter(a, b, out, schedule, buf))
    return out


def matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, schedule: str, group_name: str,
                      group_size: int) -> torch.Tensor:
    """See ``compass::matmul_all_reduce``: the fused reduce-scatter, then a gather on the same rings."""
    scattered = matmul_reduce_scatter(a, b, schedule, group_name, group_size)
    gathered, _ = all_gather_matmul(scattered, [], schedule, group_name, group_size)
    return gathered
