"""The gathers of ``compass::all_gather_mm_parts`` replayed from one CUDA graph (issue 27; on by
default, ``COMPASS_PARTS_REPLAY=0`` turns it off).

Why: issued from Python, every extra part of a decomposed gather costs the host one c10d gather
(its work object, events and bookkeeping), one stream wait and one batched GEMM launch, 43-77 us on
the lent H200 hosts (``benchmarks/results/host_issue_profile/``, ``parts_replay_ranks/``), for ~2 us
of device work.  Here a call's gathers are one graph launch, and a part costs the host one event
wait and its GEMM (24-29 us on the same host as the 73-77 issued, with 2 and 4 NCCL ranks).

What NCCL requires, and how it is met.  Whether a collective is captured must be the same on every
rank, and every rank launches the graph of the same capture (NCCL's "Using NCCL with CUDA Graphs").
So nothing here depends on what differs between ranks (addresses, the allocator): a call
signature (device, group, parts, shard shape and dtype) gets fixed buffers of its own, a staging
copy of the shard and the gather buffer; its first call is issued as before (it may be the
communicator's first collective, which a capture cannot hold); its second call captures the
gathers from the staging buffer into the gather buffer, each followed by an event record node;
every later call copies its shard into the staging buffer, launches that graph on a side stream
and multiplies each part once its event fires, on the caller's stream.  Every rank calls the same
signatures in the same order (one program), so every rank captures the same call and replays the
same later ones; the setting is agreed across the group when a signature is first seen, and a
capture that fails raises (falling back on one rank only would leave the ranks' collectives
mismatched).  The buffers are reused call after call: the side stream waits for the caller's
stream (after the previous call's GEMMs read the gather buffer) before the graph writes it again.
Checked with 2 and 4 NCCL ranks sharing one H200 (``benchmarks/parts_replay_ranks.py``: each rank
its own NCCL host id, NCCL's socket transport): every replay bitwise equal to the call issued.

Teardown.  NCCL does not destroy a communicator while a graph holding its collectives lives (its
destruction waits for them forever: pytorch/pytorch#115388), so the graphs are released first:
:func:`release`, which ``torch.distributed.destroy_process_group`` calls once a graph exists (it is
wrapped then, see :func:`_release_before_destroy`) and which runs at interpreter exit too.

Bounded: c10d's watchdog does not see collectives replayed from a graph, so the graph's last node
counts the replays that finished (:class:`..kernels.cuda.watchdog.Progress`) and the fused
operators' watchdog reports one that makes no progress for ``COMPASS_FUSED_TIMEOUT_S`` (an NCCL
kernel cannot be released: the error says which op waits and why; every later call raises it).

Costs: the staging copy (the shard's bytes once more, on the device) and the two buffers per
signature until released (``(world + 1)`` shards).
"""
from __future__ import annotations

import logging
import os
import time
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from ..kernels.cuda.impl import _capturing, _raw_stream
from .row_blocks import multiply_parts

log = logging.getLogger("compass_fx")
_states: dict[tuple, "_Staged | None"] = {}  # per call signature; None: its calls are issued
_settings: dict[tuple, bool] = {}  # raw settings -> on
Gather = Callable[[Tensor, Tensor], object]  # (dst, src) -> c10d work of an asynchronous gather


def enabled() -> bool:
    """``COMPASS_PARTS_REPLAY`` (default 1) on, and NCCL's graph mixing (captured and eager calls
    of one communicator outstanding together) not turned off."""
    raw = (os.environ.get("COMPASS_PARTS_REPLAY"), os.environ.get("NCCL_GRAPH_MIXING_SUPPORT"))
    on = _settings.get(raw)
    if on is None:
        off = ("0", "false", "no", "off")
        on = _settings[raw] = ((raw[0] or "1").strip().lower() not in off
                               and (raw[1] or "1").strip().lower() not in off)
    return on


class _Staged:
    """One call signature's fixed buffers, side stream, events, graph and count of replays."""

    def __init__(self, shard: Tensor, parts: int, world: int, what: str) -> None:
        from ..kernels.cuda import driver, graph_flags, watchdog

        self.index = shard.get_device()
        rows, k = shard.shape
        c = rows // parts
        self.what, self.nbytes = what, shard.numel() * shard.element_size()
        self.staging = torch.empty_like(shard, memory_format=torch.contiguous_format)
        self.buffer = shard.new_empty((parts, world * c, k))  # part i's gather: buffer[i], rank-major
        self.sources = self.staging.view(parts, c, k).unbind(0)
        self.gathered = self.buffer.view(parts, world, c, k).unbind(0)  # the same as [world, c, k]
        self.side = torch.cuda.Stream(device=self.index)
        self.side_handle = self.side.cuda_stream
        self.start = driver.Event()  # the caller's stream, once the call's shard is staged
        self.arrived = [driver.Event() for _ in range(parts)]  # recorded by the graph, part by part
        self.memcpy = driver.raw("memcpy")
        self.calls = 0
        self.graph = None
        self.dog = watchdog.for_device(self.index)
        self.progress = watchdog.Progress()
        self.count = graph_flags.count(self.index, self.progress.address)
        self.watched = watchdog.Watched(self._diagnose, what=what)
        self.dog.watch_progress(self.watched, self.progress)

    def _diagnose(self, call: int) -> tuple[str, Callable[[], None]]:
        message = (f"{self.what}: replayed call {call} (a CUDA graph of its parts' NCCL gathers) has made no "
                   "progress: a peer rank is late, has died, or runs its collectives in another order. An NCCL "
                   "kernel cannot be released: abort the process group or the process. Every later call of a "
                   "compass operator on this rank raises this error.")
        return message, lambda: None

    def capture(self, gather: Gather) -> None:
        """The graph of every part's gather from the staging buffer, each followed by its event."""
        from ..kernels.cuda import replay

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                works = [gather(dst, src) for dst, src in zip(self.buffer.unbind(0), self.sources)]
                for work, event in zip(works, self.arrived):
                    work.wait()  # the capture's stream joins the gather's
                    event.record_external(self.side_handle)
                self.count(self.side_handle)  # the last node: one more replay finished
            finally:
                graph.capture_end()
        self.graph = replay.Captured(graph)

    def run(self, shard: Tensor, weights: list[Tensor], outs: list[Tensor]) -> None:
        """One call from the graph: stage the shard, launch the gathers, multiply part by part."""
        from ..kernels.cuda import driver

        caller = _raw_stream(self.index)
        driver.check(self.memcpy(self.staging.data_ptr(), shard.data_ptr(), self.nbytes, caller), "cuMemcpyAsync")
        self.start.record(caller)  # after the previous call's GEMMs read the buffers, and the staging
        self.start.wait_on(self.side_handle)
        progress = self.progress
        n = progress.issued  # counted issued before it can finish (the watchdog reads both)
        progress.epochs[n % progress.RING] = n + 1
        progress.issued = n + 1
        try:
            self.graph.launch(self.side_handle)
        except BaseException:
            progress.issued = n
            raise
        multiply_parts(self.gathered, weights, outs, [partial(event.wait_on, caller) for event in self.arrived])


def release(group_name: str | None = None) -> int:
    """Drop the graphs and buffers of ``group_name``'s signatures (every group's when None), once
    their replays have finished; the watchdog stops watching them, and a later call of such a
    signature starts over (issued, then captured).  Returns how many graphs were dropped.  NCCL
    does not destroy a communicator while a graph holding its collectives lives, so this runs
    before a process group is destroyed."""
    dropped = 0
    for signature in [s for s in _states if group_name is None or s[1] == group_name]:
        state = _states.pop(signature)
        if state is None:
            continue
        if not state.dog.failure and not _drained(state.side):  # its gathers write the buffers freed with it
            log.warning(f"{state.what}: its replays had not finished {DRAIN_S:g} s into the teardown; "
                        "its graph and buffers are dropped anyway")
        state.dog.forget(state.watched)
        dropped += state.graph is not None
        state.graph = None
    return dropped


DRAIN_S = 10.0  # the most a teardown waits for a signature's replays to finish


def _drained(stream: torch.cuda.Stream) -> bool:
    """Whether ``stream``'s work finishes within ``DRAIN_S`` (a bounded wait: a stuck collective must
    not hang the interpreter's exit; a failed process's graphs are not waited for at all)."""
    deadline = time.monotonic() + DRAIN_S
    while not stream.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(1e-3)
    return True


_guarded: list[bool] = []  # destroy_process_group wrapped, the exit hook registered


def _release_before_destroy() -> None:
    """Make ``torch.distributed.destroy_process_group`` release the destroyed group's graphs first
    (every group's when it destroys them all), and release them all at interpreter exit (before
    c10d's own teardown: exit hooks run last registered first).  Done once, when the first graph
    is captured: without it a training script's last line would hang in NCCL's destruction."""
    if _guarded:
        return
    _guarded.append(True)
    import atexit
    import functools

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group=None):
        release(None if group is None or group is c10d.GroupMember.WORLD else group.group_name)
        return original(group)

    c10d.destroy_process_group = dist.destroy_process_group = destroy_process_group
    atexit.register(release)


def _new_state(shard: Tensor, parts: int, world: int, group_name: str) -> "_Staged | None":
    """The state of a new call signature, or None: its calls are issued (the group's backend for
    the device is not NCCL's, whose collectives a graph can hold; our count kernel did not load, so
    a replay would have no bound; or replays are off).  Asked on every rank at the same call."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    from ..kernels.cuda import replay
    from ..kernels.cuda.impl import _agreed

    group = _resolve_process_group(group_name)
    try:
        nccl = type(group._get_backend(shard.device)).__name__ == "ProcessGroupNCCL"
    except (AttributeError, RuntimeError, ValueError):
        nccl = False
    if not nccl:
        return None
    wanted = _agreed(group, enabled(), "parts replay setting", "COMPASS_PARTS_REPLAY / NCCL_GRAPH_MIXING_SUPPORT")
    if not wanted or not replay.kernel_nodes(shard.get_device()):
        return None
    return _Staged(shard, parts, world, f"compass::all_gather_mm_parts ({parts} parts, group {group_name})")


def replayed(shard: Tensor, weights: list[Tensor], outs: list[Tensor], parts: int, world: int,
             group_name: str, gather: Callable[[], Gather]) -> bool:
    """Run the call from its signature's graph (captured now at its second call): True; or False,
    the caller issues it as before.  ``gather()``: the gather to capture (asked only then)."""
    if _capturing():  # the caller's own capture (Inductor's CUDA graphs) takes the issued launches
        return False
    signature = (shard.get_device(), group_name, parts, tuple(shard.shape), shard.dtype)
    state = _states.get(signature, False)
    if state is False:
        if not enabled():
            return False
        state = _states[signature] = _new_state(shard, parts, world, group_name)
    if state is None or not enabled():
        return False
    state.dog.check_failed()
    state.calls += 1
    if state.graph is None:
        if state.calls == 1:  # the communicator may not exist yet: a capture cannot create it
            return False
        try:
            _release_before_destroy()
            state.capture(gather())
        except Exception as e:
            raise RuntimeError(f"{state.what}: capturing its gathers in a CUDA graph failed ({e}); the other "
                               "ranks captured theirs, so this rank cannot go on issuing them: set "
                               "COMPASS_PARTS_REPLAY=0 on every rank") from e
    if state.progress.outstanding() >= state.progress.RING - 1:
        state.side.synchronize()  # rare: thousands of replays queued and unfinished
    state.run(shard, weights, outs)
    return True
