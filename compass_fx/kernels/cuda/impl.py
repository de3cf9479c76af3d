"""CUDA implementation of the fused operators: :mod:`..protocol`'s plans on real streams, issued in
the order of :mod:`..issue_order` (safe when streams share a hardware queue).

Compute (cuBLAS GEMMs, the sums of a reduce-scatter) runs on the caller's stream, one GEMM per
piece, own rows first, so it keeps every multiprocessor.  Everything else runs on a high-priority
side stream as CUDA driver calls (:mod:`.driver`): peer-to-peer copies out of the peers'
symmetric-memory buffers (copy engines) and the epoch flags (stream memory operations).  The two
streams of a rank meet at CUDA events; the ranks meet only at flags.  The watchdog
(:mod:`.watchdog`) bounds every wait.

Per (operator, schedule, group, shape, dtype) a workspace is built once (collectively, on first
use, in the same order on every rank): the double-buffered symmetric buffers, the flags, the
staging buffers, the peers' addresses and the events (ranks sharing one GPU, as in tests and
benchmarks, map each other's buffers with CUDA IPC instead of symmetric memory, which refuses
them).  A call then does no host synchronisation
and no allocation beyond its outputs, and issues a fixed list of launches, or replays them from a
CUDA graph captured for the call's addresses (:mod:`.replay`: the host's cost then no longer grows
with the plan; a deferred call's graph runs on a stream of its workspace's own, which the caller's
stream waits for where the call's GEMMs end: ``_Workspace._replay_apart``); the flags hold the epoch as one bit of four (:mod:`..flag_codes`), so that the
replayed flag operations are right for every fourth call.

CUDA graphs.  An eager call passes its epoch to the flag operations as a number, which a graph
would replay stale, and picks its buffers by the epoch's parity, which a graph would replay
fixed (two calls in a row may use the same buffers).  So a call captured in a graph runs a twin
workspace: the protocol's fence (:func:`..protocol.fenced`) on the last call that used the same
buffers (one set, or two: :func:`.graph_buffer_sets`), the epoch and that fence's target in GPU
memory, and its small messages moved by kernels (:mod:`.graph_flags`).
The twin is built beside the eager workspace when ``COMPASS_FUSED_GRAPHS=1`` (the first call with
those shapes must run outside the capture, as a graph's warm-up does: building a workspace
allocates and meets the peers, which a capture forbids).
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Callable

import torch

from ..protocol import (COMM, MAIN, PUB, SELF, TAIL, Copy, Matmul, Plan, Record, Reduce, Region, SetFlag, WaitEvent,
                        WaitFlag, all_reduce_pull_chunks, consumer_group_rows, host_most_pieces_setting,
                        host_piece_bytes, join_start)
from .. import flag_codes
from ..graph_order import graph_plans
from ..issue_order import call_plans
from ..reference import resolve_group
from . import copy_runs, driver, env, env_raw, graph_buffer_sets, graph_flags, graphs_enabled, lane, replay, watchdog
from .host_memory import Layout, SharedHostArena

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
# the caller's current stream as a handle, without a Stream object (Inductor's generated code uses it too)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)
_workspaces: dict[tuple, "_Workspace"] = {}
_side_streams: dict[tuple[int, str], torch.cuda.Stream] = {}
Step = Callable[[dict, int, dict], None]


def _issue_nothing(tensors: dict, epoch: int, streams: dict) -> None:
    """A step with nothing to issue (a wait a batch before it already covers)."""


def supported(dtype: torch.dtype) -> bool:
    """True where this path runs: a CUDA device and a supported dtype.
    ``COMPASS_CUDA_FUSED=p2p`` sends CUDA tensors to the point-to-point implementation instead."""
    if env("COMPASS_CUDA_FUSED", "copy_engine") == "p2p":
        return False
    return dtype in _SUPPORTED and _cuda_available()


@functools.cache
def _cuda_available() -> bool:
    return torch.cuda.is_available()  # asked on every call otherwise (~1 us); it cannot change


_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _side_stream(index: int, role: str) -> torch.cuda.Stream:
    """The high-priority stream of ``role`` on device ``index`` (COMM: pulls and flag waits; PUB:
    host-staged publications; TAIL: a detached call's sums), one per process, shared by every
    workspace."""
    key = (index, role)
    if key not in _side_streams:
        _side_streams[key] = torch.cuda.Stream(device=index, priority=-1)
    return _side_streams[key]


def _arena_for(group, nbytes: int) -> SharedHostArena:
    return SharedHostArena(group, nbytes, register=driver.host_register)


_transports: dict[tuple, str] = {}  # (raw COMPASS_FUSED_TRANSPORT, raw NCCL_P2P_DISABLE) -> transport


def transport() -> str:
    """How this process's fused operators move data: ``"peer"`` (copies out of the peers' GPU
    memory) or ``"host"`` (through pinned host memory, for GPUs without peer access).
    ``COMPASS_FUSED_TRANSPORT`` = auto (default: host where NCCL is told not to use peer access,
    as the cost model assumes), peer or host.  Read on every call (two dict lookups when the
    settings are unchanged: the answer is kept per pair of raw values)."""
    raw = (env_raw(b"COMPASS_FUSED_TRANSPORT"), env_raw(b"NCCL_P2P_DISABLE"))
    got = _transports.get(raw)
    if got is None:
        got = _transports[raw] = _transport()
    return got


def _transport() -> str:
    wanted = env("COMPASS_FUSED_TRANSPORT", "auto").strip().lower()
    if wanted not in ("auto", "peer", "host"):
        raise ValueError(f"COMPASS_FUSED_TRANSPORT must be auto, peer or host, got {wanted!r}")
    if wanted == "auto":  # machine.detect.host_staged, read as fast as the per-call settings are
        return "host" if env("NCCL_P2P_DISABLE", "0").strip().lower() in ("1", "true", "yes") else "peer"
    return wanted


def _agreed(group, mine, what: str, settings: str):
    """``mine``, checked to be every rank's: the peers address each other's buffers by it."""
    seen: list = [None] * group.size()
    torch.distributed.all_gather_object(seen, mine, group=group)
    if len(set(seen)) > 1:
        raise RuntimeError(f"the ranks disagree on the fused operators' {what} ({seen}): set {settings} alike on "
                           "every rank")
    return mine


def _agreed_transport(group) -> str:
    """This process's transport, and for the host-staged one its pieces' settings, checked to be
    every rank's: a rank that cut a block into other pieces would read rows its peer has not
    published yet under a flag that announced others."""
    mine = transport()
    settings = (mine, host_piece_bytes(), host_most_pieces_setting()) if mine == "host" else (mine,)
    return _agreed(group, settings, "transport and host-staged pieces",
                   "COMPASS_FUSED_TRANSPORT / NCCL_P2P_DISABLE / COMPASS_HOST_PIECE_MIB / COMPASS_HOST_MOST_PIECES")[0]


def _agreed_graph_guards(group) -> tuple[bool, bool]:
    """Whether this process's CUDA graphs of fused calls hold guards and take them from the sets-last
    sequence, checked to be every rank's: each rank's guards must come from one global order for
    shared queues not to deadlock (:mod:`..graph_order`)."""
    return _agreed(group, (replay.graph_guards(), replay.guards_from_sets_last()), "CUDA graph guards",
                   "COMPASS_GRAPH_GUARDS / COMPASS_GRAPH_GUARD_SEQUENCE")


def _gpu_id(device_index: int) -> str:
    """What tells this GPU apart from every other: its UUID (else host name and index)."""
    props = torch.cuda.get_device_properties(device_index)
    return str(getattr(props, "uuid", "")) or f"{os.uname().nodename}:{device_index}"


def _ranks_share_a_gpu(group, device_index: int, gpu_id: Callable[[int], str] = _gpu_id) -> bool:
    """Whether two ranks of ``group`` run on one GPU (every rank learns every rank's GPU, so all
    reach the same answer)."""
    seen: list = [None] * group.size()
    torch.distributed.all_gather_object(seen, gpu_id(device_index), group=group)
    return len(set(seen)) < len(seen)


def sum_scratch(plans: tuple[Plan, ...], cols: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Float32 rows where a sum of more than two terms accumulates, one block per stream that runs
    such sums (the caller's, or ``TAIL`` for a detached reduction), as many rows as its largest.

    Why the workspace holds them: a sum allocated in the call lands, in a call captured for replay,
    in that graph's private memory pool, which keeps it for the graph's life: one block per graph,
    up to four graphs per set of addresses and a set per call site of a model's layers, and the pool
    gives a sum under 10 MiB a 20 MiB segment (20-25 MiB a graph at four and eight ranks, 10.5 GiB
    for 64 layers of one operator at eight: ``benchmarks/results/fused_replay_scale``).  Sums of one
    stream never overlap: the stream runs them one after another, and a workspace runs its calls one
    after another (``run``: at most one outstanding)."""
    rows: dict[str, int] = {}
    for plan in plans:
        for cmd in plan.commands:
            if isinstance(cmd, Reduce) and len(cmd.srcs) > 2:
                rows[cmd.stream] = max(rows.get(cmd.stream, 0), cmd.dst.rows)
    return {side: torch.empty((n, cols), dtype=torch.float32, device=device) for side, n in rows.items()}


def add_terms(dst: torch.Tensor, terms: list[torch.Tensor], acc: torch.Tensor | None) -> None:
    """``dst = sum(terms)``: two terms added in their dtype, more accumulated in float32 in ``acc``
    (rows of :func:`sum_scratch`, as many as ``dst``'s), then rounded once into ``dst``."""
    if len(terms) == 2:
        torch.add(terms[0], terms[1], out=dst)
        return
    acc.copy_(terms[0])
    for t in terms[1:]:
        acc += t
    dst.copy_(acc)


class _Workspace:
    """One rank's buffers, flags, peer addresses and events for one plan."""

    def __init__(self, plan: Plan, group_name: str, cols: int, dtype: torch.dtype,
                 device: torch.device, captured: bool = False, graph_plan: Plan | None = None) -> None:
        """``graph_plan``: what a replay graph of an eager call captures (``plan`` with
        :mod:`..graph_order`'s guards; a captured workspace's ``plan`` is one already)."""
        group = resolve_group(group_name, plan.world_size)[0]
        self.transport = _agreed_transport(group)  # the plan was built for this process's transport
        _agreed_graph_guards(group)  # and its graphs' guards from this process's settings
        index = self.device_index = _device_index(device)
        graph_plan = plan if graph_plan is None else graph_plan
        self.plan, self.rank, self.epoch, self.cols = plan, plan.rank, 0, cols
        self.captured = captured  # replayed from CUDA graphs: the epoch and the fence's target on the GPU
        self.copies = (_agreed(group, graph_buffer_sets(), "buffer sets in CUDA graphs", "COMPASS_FUSED_GRAPH_BUFFERS")
                       if captured else 2)
        self.comm = _side_stream(index, COMM)
        self.pub = _side_stream(index, PUB)
        self.tail = _side_stream(index, TAIL)
        self._side_streams = {COMM: self.comm, PUB: self.pub, TAIL: self.tail}
        self.pending: "Join | None" = None  # a deferred call whose join has not run yet
        self.dog = watchdog.for_device(index)
        peers = [p for p in range(plan.world_size) if p != self.rank]
        self.peer_buffers: dict[tuple[str, int], torch.Tensor] = {}
        if self.transport == "host":
            self._host_memory(group, peers, cols, dtype)
        else:
            self._peer_memory(group, group_name, peers, cols, dtype, device)
        self.private = {name: torch.empty((self.copies, rows, cols), dtype=dtype, device=device)
                        for name, rows in plan.private_rows.items()}
        # one tensor, so that the slots step evenly (a round of pulls fills several: copy_runs)
        self.stage = list(torch.empty((plan.stage_slots, plan.stage_rows, cols), dtype=dtype, device=device))
        self.sums = sum_scratch((plan, graph_plan), cols, device)
        self.events = {c.event: torch.cuda.Event() for c in graph_plan.commands if isinstance(c, Record)}
        if captured:
            self.device_epoch = torch.zeros(1, dtype=torch.int32, device=device)
            self.status = torch.zeros(1, dtype=torch.int32).pin_memory()  # a timed-out wait's code, 0: none
            # the last call that used each set of buffers, and the fence's target for the running call
            self.last_use = torch.zeros(self.copies + 1, dtype=torch.int32, device=device)
            self.fence_target = self.last_use[self.copies:]
            self.bumps = [graph_flags.bump(index, self.device_epoch.data_ptr(), self.last_use[p:].data_ptr(),
                                           self.fence_target.data_ptr()) for p in range(self.copies)]
            self.dog.watch_status(self.status, self._explain_timeout)
            self.row_bytes = cols * dtype.itemsize
            self.engines = graph_flags.engines(plan, self.row_bytes)
            # the copy kernels' counts of finished blocks, one per command
            self.arrived = torch.zeros(len(plan.commands), dtype=torch.int32, device=device)
        # an eager call's commands per residue of its epoch mod PERIOD (its flags' codes, its buffers'
        # parity); a captured call's per set of buffers (its epoch is on the GPU)
        self.phases = self.copies if captured else flag_codes.PERIOD
        self.steps = [[self._compile(c, phase, i) for i, c in enumerate(plan.commands)]
                      for phase in range(self.phases)]
        if not captured:  # a captured call's copies may be kernels (graph_flags.engines)
            self._join_copies(plan, self.steps)
        self.join_at = join_start(plan)
        self.replays = (None if captured or not replay.enabled() else
                        replay.Replays(index, label=f"compass::{plan.op} ({cols} columns, {plan.world_size} ranks)"))
        # what a replay graph is captured from: the same commands, the flag writes, the copies to and
        # from host memory (and, opted in, the flag waits) as kernels (replay.node_kinds)
        self.replay_steps = self.steps
        self.watched = watchdog.Watched(self._diagnose, what=f"compass::{plan.op} on rank {plan.rank}")
        # a replay graph's last node counts the replays that finished (the watchdog reads the count
        # from host memory); without our kernels, a replayed call records an event from a pool
        self.progress: watchdog.Progress | None = None
        self.count = None
        if self.replays is not None and replay.kernel_nodes(index):
            self.replay_steps = [[self._compile(c, phase, i, for_replay=True)
                                  for i, c in enumerate(graph_plan.commands)] for phase in range(self.phases)]
            if replay.wait_batches():
                for phase, steps in enumerate(self.replay_steps):
                    self._batch_waits(graph_plan, steps, phase)
            if not replay.host_copies_as_kernels():
                self._join_copies(graph_plan, self.replay_steps)
            self.progress = watchdog.Progress()
            self.count = graph_flags.count(index, self.progress.address)
            self.dog.watch_progress(self.watched, self.progress)
        elif self.replays is not None:
            if graph_plan is not plan:  # the guarded order's steps, their pulls joined as the eager steps'
                self.replay_steps = [[self._compile(c, phase, i) for i, c in enumerate(graph_plan.commands)]
                                     for phase in range(self.phases)]
                self._join_copies(graph_plan, self.replay_steps)
            self.dog.prefill(self.watched, 16)
        # where a replay graph's caller-stream work ends and its join begins (a deferred replay's release);
        # a replay captures graph_plan's commands (plan's own where the two are one)
        self.replay_join_at = join_start(graph_plan)
        self.apart: _Apart | None = None  # a deferred call's replays, built on its first call

    def _peer_memory(self, group, group_name: str, peers: list[int], cols: int, dtype: torch.dtype,
                     device: torch.device) -> None:
        """Flags and buffers in symmetric GPU memory, the peers' mapped into this process."""
        import torch.distributed._symmetric_memory as symm_mem

        if _ranks_share_a_gpu(group, self.device_index):
            self._ipc_memory(group, peers, cols, dtype, device)
            return
        plan = self.plan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group_name)
        flags = symm_mem.empty((plan.n_flags,), dtype=torch.int32, device=device)
        flags.zero_()
        self.buffers = {name: symm_mem.empty((self.copies, rows, cols), dtype=dtype, device=device)
                        for name, rows in plan.symmetric_rows.items()}
        torch.cuda.synchronize(device)  # the zeroed flags are in memory before any peer can look
        handle = symm_mem.rendezvous(flags, group_name)
        self.memory = (flags, handle)  # the addresses below stay valid only while these live
        self.flag_address = flags.data_ptr()
        self.peer_flags = {p: handle.get_buffer(p, (plan.n_flags,), torch.int32) for p in peers}
        self.peer_flag_address = {p: f.data_ptr() for p, f in self.peer_flags.items()}
        for name, buf in self.buffers.items():
            h = symm_mem.rendezvous(buf, group_name)
            for p in peers:
                self.peer_buffers[(name, p)] = h.get_buffer(p, tuple(buf.shape), dtype)

    def _ipc_memory(self, group, peers: list[int], cols: int, dtype: torch.dtype, device: torch.device) -> None:
        """:meth:`_peer_memory` for ranks sharing a GPU, whose allocations torch's symmetric memory
        refuses ("allocations from overlapping devices"): the flags and buffers are this rank's
        own GPU memory, the peers' mapped into this process with CUDA IPC (as torch.multiprocessing
        shares a CUDA tensor), so the peer transport's plans run on one GPU as on an NVLink machine."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        plan = self.plan
        flags = torch.zeros((plan.n_flags,), dtype=torch.int32, device=device)
        self.buffers = {name: torch.empty((self.copies, rows, cols), dtype=dtype, device=device)
                        for name, rows in plan.symmetric_rows.items()}
        torch.cuda.synchronize(device)  # the zeroed flags are in memory before any peer can look
        mine = {name: reduce_tensor(t)[1] for name, t in (("flags", flags), *self.buffers.items())}
        everyone: list = [None] * group.size()
        torch.distributed.all_gather_object(everyone, mine, group=group)
        mapped = {p: {name: rebuild_cuda_tensor(*args) for name, args in everyone[p].items()} for p in peers}
        self.memory = (flags, mapped)  # the addresses below stay valid only while these live
        self.flag_address = flags.data_ptr()
        self.peer_flags = {p: mapped[p]["flags"] for p in peers}
        self.peer_flag_address = {p: f.data_ptr() for p, f in self.peer_flags.items()}
        for name in self.buffers:
            for p in peers:
                self.peer_buffers[(name, p)] = mapped[p][name]

    def _host_memory(self, group, peers: list[int], cols: int, dtype: torch.dtype) -> None:
        """Flags and buffer mirrors in host memory shared by the ranks (one machine, no peer access)."""
        plan = self.plan
        layout = Layout()
        layout.add("flags", 4 * plan.n_flags)
        for name, rows in plan.symmetric_rows.items():
            layout.add(name, self.copies * rows * cols * dtype.itemsize)
        arena = _arena_for(group, layout.nbytes)  # fresh files: the flags read zero
        self.memory = arena  # the addresses below stay valid only while the mappings live
        flags_at = layout.offsets["flags"]
        self.flag_address = arena.device_address(self.rank, flags_at)
        self.peer_flags = {p: arena.view(p, flags_at, (plan.n_flags,), torch.int32) for p in peers}
        self.peer_flag_address = {p: arena.device_address(p, flags_at) for p in peers}
        self.buffers = {}
        for name, rows in plan.symmetric_rows.items():
            at = layout.offsets[name]
            self.buffers[name] = arena.view(self.rank, at, (self.copies, rows, cols), dtype)
            for p in peers:
                self.peer_buffers[(name, p)] = arena.view(p, at, (self.copies, rows, cols), dtype)

    # -- addressing -------------------------------------------------------------------------
    def _fixed(self, region: Region, parity: int) -> torch.Tensor | None:
        if region.buf in self.plan.symmetric_rows:
            whole = (self.buffers[region.buf] if region.owner == SELF
                     else self.peer_buffers[(region.buf, region.owner)])
            return whole[parity, region.start:region.stop]
        if region.buf in self.private:
            return self.private[region.buf][parity, region.start:region.stop]
        if region.buf == "STAGE":
            return self.stage[region.index][:region.rows]
        return None

    def _tensor(self, region: Region, parity: int) -> Callable[[dict], torch.Tensor]:
        fixed = self._fixed(region, parity)
        if fixed is not None:
            return lambda tensors: fixed
        buf, index, start, stop = region.buf, region.index, region.start, region.stop
        return lambda tensors: tensors[buf][index][start:stop]

    def _address(self, region: Region, parity: int) -> Callable[[dict], int]:
        fixed = self._fixed(region, parity)
        if fixed is not None:
            ptr = fixed.data_ptr()
            return lambda tensors: ptr
        buf, index, start = region.buf, region.index, region.start

        def address(tensors):
            t = tensors[buf][index]
            return t.data_ptr() + start * t.stride(0) * t.element_size()
        return address

    # -- one command -> one closure over what stays fixed -----------------------------------
    def _compile(self, cmd, phase: int, index: int, for_replay: bool = False) -> Step:
        """One command as a closure over everything that stays fixed between calls of epochs
        ``phase`` mod ``self.phases``: addresses of the workspace's buffers (their parity), the
        flags' codes, the side streams' handles, the driver functions (the host issues every
        call's commands one after another, so each closure keeps its work to the launch)."""
        parity = phase % self.copies
        side = cmd.stream
        if isinstance(cmd, Matmul) and side != MAIN or isinstance(cmd, Reduce) and side not in (MAIN, TAIL):
            raise ValueError(f"{cmd} must run on the caller's stream" + (" or TAIL" if isinstance(cmd, Reduce) else ""))
        fixed_stream = self._side_streams.get(side)
        stream_of = self._stream_of(side)
        if self.captured and isinstance(cmd, (WaitFlag, SetFlag, Copy)):
            step = self._compile_captured(cmd, parity, index, stream_of)
            if step is not None:
                return step
        if for_replay and isinstance(cmd, (WaitFlag, SetFlag, Copy)):
            step = self._compile_replay(cmd, phase, parity, stream_of)
            if step is not None:
                return step
        if isinstance(cmd, WaitFlag):  # the flag holds a code (flag_codes): wait for either accepted bit
            wait, addr, delta = driver.raw("wait"), self._awaited_flag(cmd), cmd.delta
            bits = flag_codes.mask(phase + delta)

            def wait_flag(tensors, epoch, streams):
                if epoch + delta >= 1:
                    driver.check(wait(stream_of(streams), addr, bits, driver.WAIT_AND), "cuStreamWaitValue32")
            return wait_flag
        if isinstance(cmd, SetFlag):
            write, addr, value = driver.raw("write"), self.flag_address + 4 * cmd.slot, flag_codes.code(phase)

            def set_flag(tensors, epoch, streams):
                driver.check(write(stream_of(streams), addr, value, 0), "cuStreamWriteValue32")
            return set_flag
        if isinstance(cmd, Copy):
            memcpy = driver.raw("memcpy")
            dst, src = self._address(cmd.dst, parity), self._address(cmd.src, parity)
            rows = cmd.dst.rows
            row_bytes = self._row_bytes(cmd)

            def copy(tensors, epoch, streams):
                driver.check(memcpy(dst(tensors), src(tensors), rows * row_bytes(tensors), stream_of(streams)),
                             "cuMemcpyAsync")
            return copy
        if isinstance(cmd, Matmul):
            dst, src, w = self._tensor(cmd.dst, parity), self._tensor(cmd.src, parity), cmd.weight
            return lambda tensors, epoch, streams: torch.mm(src(tensors), tensors["W"][w], out=dst(tensors))
        if isinstance(cmd, Reduce):
            dst = self._tensor(cmd.dst, parity)
            srcs = [self._tensor(r, parity) for r in cmd.srcs]
            acc = self.sums[side][:cmd.dst.rows] if len(srcs) > 2 else None

            def reduce(tensors, epoch, streams):
                add_terms(dst(tensors), [f(tensors) for f in srcs], acc)
            if fixed_stream is None:
                return reduce

            def reduce_on_side(tensors, epoch, streams):
                with torch.cuda.stream(fixed_stream):
                    reduce(tensors, epoch, streams)
            return reduce_on_side
        if isinstance(cmd, Record):
            event = self.events[cmd.event]
            if fixed_stream is not None:
                return lambda tensors, epoch, streams: event.record(fixed_stream)
            return lambda tensors, epoch, streams: event.record(streams[MAIN])
        if isinstance(cmd, WaitEvent):
            event = self.events[cmd.event]
            if fixed_stream is not None:
                return lambda tensors, epoch, streams: fixed_stream.wait_event(event)
            return lambda tensors, epoch, streams: streams[MAIN].wait_event(event)
        raise TypeError(f"no CUDA lowering for {cmd!r}")

    def _awaited_flag(self, cmd: WaitFlag) -> int:
        """The address of the peer's flag ``cmd`` waits for, as this process maps it."""
        return self.peer_flag_address[cmd.peer] + 4 * cmd.slot

    def _stream_of(self, side: str) -> Callable[[dict], int]:
        """The handle of the stream a command names: a side stream's is fixed, the caller's is
        the running call's (``streams[MAIN]``)."""
        fixed_stream = self._side_streams.get(side)
        if fixed_stream is not None:
            handle = fixed_stream.cuda_stream
            return lambda streams: handle
        return lambda streams: streams[MAIN].cuda_stream

    def _batch_waits(self, plan: Plan, steps: list[Step], phase: int) -> None:
        """A replay's runs of flag waits (:meth:`..protocol.Plan.wait_runs`) as one batch of
        stream waits each, at the run's first wait (the run's other waits issue nothing): one
        node of the replay graph instead of one per wait.  Each wait is the eager call's (the
        same flag, the same accepted bits), so the watchdog bounds and releases it as before."""
        for run in plan.wait_runs():
            waits = [plan.commands[i] for i in run]
            launch = driver.wait_all([(self._awaited_flag(c), flag_codes.mask(phase + c.delta), driver.WAIT_AND)
                                      for c in waits])
            stream_of = self._stream_of(waits[0].stream)
            steps[run[0]] = lambda tensors, epoch, streams, launch=launch, stream_of=stream_of: launch(stream_of(streams))
            for i in run[1:]:
                steps[i] = _issue_nothing

    def _join_copies(self, plan: Plan, steps_by_phase: list[list[Step]]) -> None:
        """A call's runs of pulls out of the peers' host mirrors (:meth:`..protocol.Plan.copy_runs`)
        as the fewest copies their addresses allow (:func:`.copy_runs.strided`: one 2D copy per
        progression), issued at the run's first position (the run's other copies issue nothing), in
        the steps of every phase.  The addresses are the call's (its output's rows may be among
        them), worked out per call."""
        if self.transport != "host":
            return
        for phase, steps in enumerate(steps_by_phase):
            self._join_phase_copies(plan, steps, phase % self.copies)

    def _join_phase_copies(self, plan: Plan, steps: list[Step], parity: int) -> None:
        """:meth:`_join_copies` for one phase's steps, whose buffers are those of ``parity``."""
        for run in plan.copy_runs():
            cmds = [plan.commands[i] for i in run]
            ends = [(self._address(c.dst, parity), self._address(c.src, parity), c.dst.rows, self._row_bytes(c))
                    for c in cmds]
            stream_of = self._stream_of(cmds[0].stream)

            def copy_all(tensors, epoch, streams, ends=ends, stream_of=stream_of):
                stream = stream_of(streams)
                for s in copy_runs.strided([(dst(tensors), src(tensors), rows * row_bytes(tensors))
                                            for dst, src, rows, row_bytes in ends]):
                    driver.memcpy_lines(s.dst, s.src, s.width, s.height, s.dst_pitch, s.src_pitch, stream)
            steps[run[0]] = copy_all
            for i in run[1:]:
                steps[i] = _issue_nothing

    def _compile_captured(self, cmd, parity: int, index: int, stream_of) -> Step | None:
        """A flag wait, flag set or small copy of a captured call (:mod:`.graph_flags`); None for a
        copy that stays on the copy engines."""
        counter = self.device_epoch.data_ptr()
        if isinstance(cmd, WaitFlag):
            fence = cmd.slot == self.plan.n_flags - 1  # the fenced plan's "done" flag: its target is on the GPU
            launch = graph_flags.wait(self.device_index, self._awaited_flag(cmd),
                                      self.fence_target.data_ptr() if fence else counter, 0 if fence else cmd.delta,
                                      self.status.data_ptr(), index + 1, self.dog.timeout)
            return lambda tensors, epoch, streams: launch(stream_of(streams))
        how = self.engines.get(index)
        if isinstance(cmd, SetFlag):
            addr = self.flag_address + 4 * cmd.slot
            if how == graph_flags.DONE_BY_COPY:
                return lambda tensors, epoch, streams: None
            if how == graph_flags.KERNEL_FLAG:
                launch = graph_flags.set_flag(self.device_index, addr, counter)
                return lambda tensors, epoch, streams: launch(stream_of(streams))
            memcpy = driver.raw("memcpy")

            def copy_epoch(tensors, epoch, streams):  # after a copy-engine copy: the counter copied onto the flag
                driver.check(memcpy(addr, counter, 4, stream_of(streams)), "cuMemcpyAsync")
            return copy_epoch
        if how is None:
            return None
        flag = 0
        if how == graph_flags.KERNEL_COPY_AND_FLAG:
            following = next(c for c in self.plan.commands[index + 1:]
                             if isinstance(c, SetFlag) and c.stream == cmd.stream)
            flag = self.flag_address + 4 * following.slot
        launch, aim = graph_flags.copy(self.device_index, cmd.dst.rows * self.row_bytes, flag, counter,
                                       self.arrived.data_ptr() + 4 * index)
        dst, src = self._address(cmd.dst, parity), self._address(cmd.src, parity)

        def copy(tensors, epoch, streams):
            aim(dst(tensors), src(tensors))
            launch(stream_of(streams))
        return copy

    def _compile_replay(self, cmd, phase: int, parity: int, stream_of) -> Step | None:
        """A command of an eager call as it is captured for a replay graph (:mod:`.replay`), where
        a kernel node is cheaper to launch than the stream memory operation or host-memory copy it
        replaces (``benchmarks/results/graph_node_probe``); None: captured as issued.

        * A flag write: a one-thread kernel that stores the flag's code (the same value
          ``cuStreamWriteValue32`` stores, after the stream's earlier work, fenced system-wide).
        * A copy to or from host memory (the host-staged transport's publications and pulls), with
          ``COMPASS_REPLAY_HOST_COPIES=kernel``: a copy kernel over the mapped host memory
          (:func:`.graph_flags.copy_wide`; a copy whose size or addresses are not whole 16-byte
          words stays on the copy engines).  Not the default: such a kernel does not overlap a
          GEMM that fills the GPU (:func:`.replay.host_copies_as_kernels`).
        * A flag wait stays a stream wait unless ``COMPASS_REPLAY_WAITS=kernel``; a run of them
          (:meth:`..protocol.Plan.wait_runs`) is one batch, one node (:meth:`_batch_waits`), unless
          ``COMPASS_REPLAY_WAITS=stream``.  A spinning wait
          kernel would save ~3 us of launch per wait, but where ranks time-slice one GPU (several
          processes without MPS: how this project tests on one GPU) a spinning kernel keeps its
          process's time slice until the slice ends, milliseconds per wait
          (``fused_graphs-h200``: ~4.4 ms per replayed call against 0.38 ms with stream waits),
          while a stream wait lets the GPU switch at once.  The kernel is bounded like a stream
          wait: the watchdog releases a late one by storing the awaited code into the flag."""
        dev = self.device_index
        if isinstance(cmd, SetFlag):
            if not replay.flag_writes_as_kernels():
                return None
            launch = graph_flags.write_code(dev, self.flag_address + 4 * cmd.slot, flag_codes.code(phase))
            return lambda tensors, epoch, streams: launch(stream_of(streams))
        if isinstance(cmd, WaitFlag):
            if replay.waits_as_kernels():
                delta = cmd.delta
                launch = graph_flags.wait_code(dev, self._awaited_flag(cmd), flag_codes.mask(phase + delta))

                def wait_kernel(tensors, epoch, streams):
                    if epoch + delta >= 1:
                        launch(stream_of(streams))
                return wait_kernel
            return None
        in_host = self.transport == "host" and self.plan.crosses_symmetric(cmd)
        if not in_host or not replay.host_copies_as_kernels():
            return None
        memcpy = driver.raw("memcpy")
        dst, src = self._address(cmd.dst, parity), self._address(cmd.src, parity)
        rows = cmd.dst.rows
        row_bytes = self._row_bytes(cmd)
        kernels: dict[int, tuple] = {}  # bytes -> (launch, set_addresses)

        def copy(tensors, epoch, streams):  # runs while a replay graph is captured
            to, frm, nbytes = dst(tensors), src(tensors), rows * row_bytes(tensors)
            if (to | frm | nbytes) % 16 or nbytes <= 0:
                driver.check(memcpy(to, frm, nbytes, stream_of(streams)), "cuMemcpyAsync")
                return
            if nbytes not in kernels:
                kernels[nbytes] = graph_flags.copy_wide(dev, nbytes)
            launch, aim = kernels[nbytes]
            aim(to, frm)
            launch(stream_of(streams))
        return copy

    def _row_bytes(self, cmd: Copy) -> Callable[[dict], int]:
        """Bytes per row of a copy: every buffer involved is contiguous with the same width."""
        for region in (cmd.src, cmd.dst):
            fixed = self._fixed(region, 0)
            if fixed is not None:
                n = fixed.stride(0) * fixed.element_size()
                return lambda tensors: n
        buf, index = cmd.src.buf, cmd.src.index
        return lambda tensors: tensors[buf][index].stride(0) * tensors[buf][index].element_size()

    # -- running ----------------------------------------------------------------------------
    def run(self, tensors: dict[str, list[torch.Tensor]], deferred: bool = False) -> "Join | None":
        """Issue one call.  ``deferred``: leave the join out and return it (the caller's stream
        goes on with other work while the call's side streams finish; the results are valid after
        ``Join.wait``).  A call still waiting for its join is joined first: at most one call of a
        workspace is ever outstanding, which the double-buffering argument needs.  An eager call
        replays a graph of its commands where :mod:`.replay` has one (a deferred one on a stream of
        its own: :meth:`_replay_apart`), unless a deferred call issued command by command is
        outstanding (:class:`Join`)."""
        if self.pending is not None:
            self.pending.wait()
        if self.dog.failure:  # eager or captured: _workspace chose this workspace for the call
            self.dog.check_failed()
        if not tensors["A"][0].is_contiguous():  # the outputs are the call's own, contiguous
            raise ValueError(f"compass::{self.plan.op}: A must be contiguous")
        self.epoch += 1
        epoch = self.epoch
        if self.replays is not None and not Join.outstanding and replay.enabled():
            if deferred:
                join = self._replay_apart(tensors, epoch)
                if join is not None:
                    return join
            elif self._replay(tensors, epoch):
                return None
        main = torch.cuda.current_stream(self.device_index)  # an index: no device lookup (~30 us)
        if self.captured:
            self.bumps[epoch % self.copies](main.cuda_stream)  # before anything of the call
        else:
            replay.stats["issued"] += 1
        steps = self.steps[epoch % self.phases]
        streams = {MAIN: main}
        for step in steps[:self.join_at]:
            step(tensors, epoch, streams)
        if not self.captured:  # a captured call's waits bound themselves (graph_flags)
            self._watch(self.comm)
        if not deferred:
            for step in steps[self.join_at:]:
                step(tensors, epoch, streams)
            return None
        self.pending = Join(self, steps[self.join_at:], tensors, epoch)
        return self.pending

    def _replay(self, tensors: dict[str, list[torch.Tensor]], epoch: int) -> bool:
        """The call replayed from a graph on the caller's stream, or False: issue it."""
        stream = _raw_stream(self.device_index)
        progress = self.progress
        if progress is not None and not progress.room(stream):
            return False
        graph = self.replays.graph(self._addresses(tensors), epoch, lambda s: self._issue(tensors, s))
        if graph is None:
            return False
        self._launch(graph, stream, epoch)  # on the caller's stream: after its earlier work, before its later work
        return True

    def _launch(self, graph, stream: int, epoch: int) -> None:
        """Launch a replay graph on ``stream``, bounded by the watchdog: counted in the workspace's
        :class:`.watchdog.Progress` (the graph's last node counts it done), or without our kernels
        by an event after it."""
        progress = self.progress
        if progress is None:
            graph.launch(stream)
            self._watch_replay(stream)
            return
        n = progress.issued  # counted issued before it can finish (the watchdog reads both)
        progress.epochs[n % progress.RING] = epoch
        progress.issued = n + 1
        try:
            graph.launch(stream)
        except BaseException:
            progress.issued = n
            raise

    def _replay_apart(self, tensors: dict[str, list[torch.Tensor]], epoch: int) -> "GraphJoin | None":
        """A deferred call replayed from a graph on a stream of the workspace's own (:class:`_Apart`),
        or None: issue it.  The graph waits for the caller's earlier work; the caller's stream waits
        only for the graph's release, the end of the call's work on the caller's stream of an issued
        call (its GEMMs: after them nothing reads the call's input or weights, which the caller's
        later work may then overwrite, as an issued deferred call allows; only a gather's copies of
        its own shard may, and only the ring all-reduce defers a gather, of sums it holds itself:
        ``tests/test_protocol.py``); the join waits for the rest.  Unlike an issued deferred call,
        one outstanding lets other calls replay: its whole graph is queued at its launch, ahead of
        anything a later call queues, so no later call's wait can hold it up on a shared hardware
        queue, and its own waits are released by the peers' same call, queued as early (the issue
        order's argument, a call at a time)."""
        apart = self.apart
        if apart is None:
            apart = self.apart = _Apart(self.device_index)
        if apart.replays is None:
            return None
        progress = self.progress
        if progress is not None and not progress.room(apart.handle):
            return None
        graph = apart.replays.graph(self._addresses(tensors), epoch,
                                    lambda s: self._issue(tensors, s, apart.released))
        if graph is None:
            return None
        caller, side = _raw_stream(self.device_index), apart.handle
        record, wait = apart.record, apart.wait
        result = record(apart.started.handle, caller) or wait(side, apart.started.handle, 0)
        if result:  # the graph runs after the caller's earlier work (its inputs)
            driver.check(result, "ordering a deferred call's stream after the caller's")
        self._launch(graph, side, epoch)
        result = wait(caller, apart.released.handle, 0) or record(apart.finished.handle, side)
        if result:
            driver.check(result, "joining a deferred call's release or recording its end")
        self.pending = GraphJoin(self, apart.finished, tensors)
        return self.pending

    def _issue(self, tensors: dict[str, list[torch.Tensor]], main: torch.cuda.Stream,
               released: driver.Event | None = None) -> None:
        """Every command of the running call, ``main`` standing for the caller's stream (a capture);
        ``released``: recorded on ``main`` at the join's start (a deferred call's release)."""
        streams = {MAIN: main}
        steps = self.replay_steps[self.epoch % self.phases]
        at = len(steps) if released is None else self.replay_join_at
        for step in steps[:at]:
            step(tensors, self.epoch, streams)
        if released is not None:
            released.record_external(main.cuda_stream)  # a node of its own, which the caller's stream waits for
        for step in steps[at:]:
            step(tensors, self.epoch, streams)
        if self.count is not None:  # the last node: after every command of the call (capture joins the streams)
            self.count(main.cuda_stream)

    @staticmethod
    def _addresses(tensors: dict[str, list[torch.Tensor]]) -> tuple:
        """What a graph of a call bakes in besides the workspace: where the call's tensors lie (and
        the weights' strides, which pick cuBLAS's transposes; the rest is contiguous)."""
        ws, outs = tensors["W"], tensors["OUT"]
        gathered = tensors.get("GATHERED")
        if len(ws) == 1 and len(outs) == 1:  # the common call, in one expression
            w = ws[0]
            return (tensors["A"][0].data_ptr(), w.data_ptr(), w.stride(), -1, outs[0].data_ptr(),
                    gathered[0].data_ptr() if gathered else None)
        key = [t.data_ptr() for t in tensors["A"]]
        for w in ws:
            key += (w.data_ptr(), w.stride())
        key += [-1] + [t.data_ptr() for t in outs]  # -1: the outputs' addresses follow
        key.append(gathered[0].data_ptr() if gathered else None)
        return tuple(key)

    def _watch_replay(self, handle: int) -> None:
        """:meth:`_watch` for a replay: a driver event from the watchdog's pool, recorded on the
        caller's stream (``handle``) after the graph."""
        dog = self.dog
        done = dog.reusable(self.watched)
        if done is None or not isinstance(done, driver.Event):
            done = driver.Event()
        done.record(handle)
        dog.add(self.watched, self.epoch, done)

    def _watch(self, stream: torch.cuda.Stream | None, handle: int | None = None) -> None:
        """Let the watchdog bound the running call: an event after its last wait, on ``stream``,
        or on the stream whose ``handle`` a replay passes (a driver event, recorded directly:
        torch's ``Event.record()`` looks the current stream up again, ~20 us on the lent host)."""
        done = self.dog.reusable(self.watched)
        if handle is not None:
            done = done if isinstance(done, driver.Event) else driver.Event()
            done.record(handle)
        else:
            done = done if isinstance(done, torch.cuda.Event) else torch.cuda.Event()
            done.record(stream)
        self.dog.add(self.watched, self.epoch, done)

    def _explain_timeout(self, code: int) -> str:
        """What the captured wait that stored ``code`` (its command's position + 1) waited for."""
        cmd = self.plan.commands[code - 1]
        return (f"compass::{self.plan.op} on rank {self.rank}, captured in a CUDA graph, waited for rank "
                f"{cmd.peer}'s {self.plan.slot_names[cmd.slot]} (flag {cmd.slot}); that rank is late, has died, "
                f"or replays its graphs in another order (the wait lasted longer than COMPASS_FUSED_TIMEOUT_S="
                f"{self.dog.timeout:g} s and stopped the GPU's work)")

    def _diagnose(self, epoch: int) -> tuple[str, Callable[[], None]]:
        """Which flag the call of ``epoch`` still waits for, and a way to release it."""
        in_host_memory = self.transport == "host"  # then the host reads and writes the flags itself
        side = None if in_host_memory else torch.cuda.Stream(device=self.comm.device)  # off the blocked streams
        if in_host_memory:
            seen = {p: f.tolist() for p, f in self.peer_flags.items()}
        else:
            with torch.cuda.stream(side):
                seen = {p: f.cpu().tolist() for p, f in self.peer_flags.items()}
        stuck = [c for c in self.plan.commands if isinstance(c, WaitFlag)
                 and not flag_codes.satisfied(seen[c.peer][c.slot], epoch + c.delta)]
        if not stuck:
            what = "its own streams (every flag it waits for is set)"
        else:
            c = stuck[0]
            target = epoch + c.delta
            what = (f"rank {c.peer}'s {self.plan.slot_names[c.slot]} (flag {c.slot} "
                    f"{flag_codes.decoded(seen[c.peer][c.slot])}, needs call {target}'s code "
                    f"{flag_codes.code(target)})")
        message = (f"compass::{self.plan.op}: rank {self.rank} waits in call {epoch} for {what}; that rank "
                   f"is late, has died, or calls the fused operators in another order. Every later call "
                   f"of a compass fused operator on this rank raises this error.")

        def release() -> None:
            """Raise the awaited flags.  Host-memory flags take a store from the host, which no GPU
            queue can hold up; a flag in GPU memory takes a stream write, which a wait sharing its
            hardware queue could (the issue order, :mod:`..issue_order`, keeps the plan's own waits
            from doing so)."""
            for c in stuck:
                value = flag_codes.code(epoch + c.delta)
                if in_host_memory:
                    self.peer_flags[c.peer][c.slot] = value
                    continue
                addr = self._awaited_flag(c)
                driver.write(addr, value, side.cuda_stream)
            if side is not None:
                side.synchronize()

        return message, release


class Join:
    """The end of a deferred call issued command by command: the caller's stream waits for the
    call's side streams.  Holds the call's tensors until then (the side streams write its outputs).
    While any is outstanding, eager calls are issued, not replayed: a graph's side-stream work would
    not queue behind the deferred call's on the shared side streams, as the issue order assumes (a
    deferred call replayed from a graph is a :class:`GraphJoin`, which holds nothing up)."""

    outstanding = 0  # deferred calls of this process not yet joined

    def __init__(self, workspace: _Workspace, steps: list[Step], tensors: dict, epoch: int) -> None:
        self.workspace, self.steps, self.tensors, self.epoch = workspace, steps, tensors, epoch
        Join.outstanding += 1

    def wait(self) -> None:
        if self.steps is None:
            return
        streams = {MAIN: torch.cuda.current_stream(self.workspace.device_index)}
        for step in self.steps:
            step(self.tensors, self.epoch, streams)
        self.steps = self.tensors = None
        Join.outstanding -= 1
        if self.workspace.pending is self:
            self.workspace.pending = None


class GraphJoin:
    """The end of a deferred call replayed from a graph (``_Workspace._replay_apart``): the caller's
    stream waits for the event after the graph.  Holds the call's tensors until then."""

    __slots__ = ("workspace", "finished", "tensors")

    def __init__(self, workspace: _Workspace, finished: driver.Event, tensors: dict) -> None:
        self.workspace, self.finished, self.tensors = workspace, finished, tensors

    def wait(self) -> None:
        if self.finished is None:
            return
        self.finished.wait_on(_raw_stream(self.workspace.device_index))
        self.finished = self.tensors = None
        if self.workspace.pending is self:
            self.workspace.pending = None


class _Apart:
    """What a workspace replays its deferred calls with: their graphs (each records ``released``
    where the caller's stream may go on), a high-priority stream they run on (the caller's stream
    ran an issued deferred call's GEMMs first; so do these), and the events that order that stream
    with the caller's.  Deferred calls are issued, not replayed, where replay graphs are launched by
    the GPU (``COMPASS_REPLAY_LAUNCH=device``: a device graph cannot hold the event node) or
    ``COMPASS_FUSED_REPLAY_DEFERRED=0`` says so."""

    def __init__(self, device_index: int) -> None:
        from . import device_launch

        wanted = replay.deferred_enabled() and not device_launch.wanted()
        self.replays = replay.Replays(device_index) if wanted else None
        self.stream = torch.cuda.Stream(device=device_index, priority=-1)
        self.handle = self.stream.cuda_stream
        self.started, self.released, self.finished = driver.Event(), driver.Event(), driver.Event()
        self.record, self.wait = driver.raw("event_record"), driver.raw("stream_wait_event")  # (checked by the caller)


@functools.cache
def _join_work() -> tuple[type, Callable]:
    """A c10d ``Work`` whose wait runs a join, and c10d's registration of a work for a tensor: made
    once (with a class made per call, a registration and its wait cost ~24 us of host on the CPU
    machine, against 8-12)."""
    from torch._C._distributed_c10d import Work, _register_work

    class JoinWork(Work):
        def __init__(self, join) -> None:
            super().__init__()
            self.join = join

        def wait(self, timeout=None) -> bool:  # noqa: ARG002 - the flag waits are bounded by the watchdog
            self.join.wait()
            return True

    return JoinWork, _register_work


def _register_join(out: torch.Tensor, join: "Join | GraphJoin") -> None:
    """Let ``_c10d_functional.wait_tensor(out)`` run ``join`` (as it waits for a collective)."""
    work, register = _join_work()
    register(out, work(join))


_pull_chunks: dict[tuple, list] = {}  # matmul_all_reduce's pull chunks per (shape, settings)
_OP_NAMES = {"ag": "all_gather_matmul", "rs": "matmul_reduce_scatter", "ar": "matmul_all_reduce"}


def _workspace(key: tuple, make_plan: Callable[[bool, bool], Plan], group_name: str, cols: int,
               like: torch.Tensor) -> _Workspace:
    """The workspace of ``key`` for an eager call, or its twin while a CUDA graph is captured: one
    dict lookup once built.  ``make_plan(fence, graph)``: the plan, fenced for the twin's one set of
    buffers, as a CUDA graph captures it where ``graph`` (:func:`..graph_order.graph_plans`);
    ``like``: a tensor of the call's dtype and device (read only when building: a device object
    per call costs ~1 us)."""
    captured = _capturing()
    ws = _workspaces.get((key, captured))
    if ws is not None:
        return ws
    if captured:
        raise RuntimeError(
            f"compass::{_OP_NAMES[key[0]]} captured in a CUDA graph with no workspace built for it: set "
            "COMPASS_FUSED_GRAPHS=1 on every rank and run the same call (same shapes) once before the capture, "
            "as a graph's warm-up does (building a workspace allocates memory and meets the peers, which a "
            "capture forbids)")
    dtype, device = like.dtype, like.device
    watchdog.for_device(_device_index(device)).check_failed()  # a collective rendezvous: not after a failure
    guards = replay.graph_guards()  # CUDA graphs of the calls hold graph_order's guards
    ws = _workspaces[(key, False)] = _Workspace(make_plan(False, False), group_name, cols, dtype, device,
                                                graph_plan=make_plan(False, guards))
    if graphs_enabled():
        _workspaces[(key, True)] = _Workspace(make_plan(True, guards), group_name, cols, dtype, device, captured=True)
    if ws.progress is not None:
        # built now, with the workspace (never during a step's later calls), handed what it reads of this module
        lane.module(transports=_transports, join=Join, raw_stream=_raw_stream, capturing=_capturing)
    return ws


def _plans(graph: bool):
    """:func:`..issue_order.call_plans`, or where a CUDA graph captures the call
    :func:`..graph_order.graph_plans` (same arguments; its guards as
    ``COMPASS_GRAPH_GUARD_SEQUENCE`` sets)."""
    if not graph:
        return call_plans
    return functools.partial(graph_plans, sets_last=True) if replay.guards_from_sets_last() else graph_plans


def _group_rows(cols: tuple[int, ...], device: torch.device) -> int:
    """Rows per consumer GEMM for weights of these widths on this GPU (0: no GEMM, no grouping)."""
    if not cols:
        return 0
    return consumer_group_rows(sum(cols) // len(cols), torch.cuda.get_device_properties(device).multi_processor_count)


def _rank(group_name: str, group_size: int) -> int:
    """This process's rank in the group (looked up when a workspace is built, not per call: the
    workspace's key holds the group's name and size)."""
    return resolve_group(group_name, group_size)[1]


def all_gather_matmul(a_shard: torch.Tensor, bs: list[torch.Tensor], schedule: str, group_name: str,
                      group_size: int, deferred: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """See ``compass::all_gather_matmul``.  ``deferred`` only without weights (the ring
    all-reduce's gather of its sums): a GEMM needs the gathered rows."""
    m, k = a_shard.shape
    if group_size == 1:
        return a_shard.clone(), [a_shard @ b for b in bs]
    deferred = deferred and not bs
    host = transport() == "host"
    cols = tuple([b.shape[1] for b in bs])
    # the device as its index: a torch.device object per call costs ~1 us
    key = ("ag", schedule, group_name, group_size, m, k, cols, a_shard.dtype, a_shard.get_device(), host, deferred)
    ws = _workspaces.get((key, _capturing()))  # built: one lookup, no closure
    if ws is None:
        ws = _workspace(key, lambda fence, graph: _plans(graph)("all_gather_matmul", schedule, group_size,
                                                      _rank(group_name, group_size), m, k, len(bs),
                                                      a_shard.element_size(), host, host_piece_bytes(),
                                                      detach=deferred, group_rows=_group_rows(cols, a_shard.device),
                                                      fence=fence, most_pieces=host_most_pieces_setting())[0],
                        group_name, k, a_shard)
    rows = m * group_size
    gathered = a_shard.new_empty((rows, k))
    outs = [a_shard.new_empty((rows, c)) for c in cols]
    join = ws.run({"A": [a_shard], "W": list(bs), "OUT": outs, "GATHERED": [gathered]}, deferred)
    if join is not None:
        _register_join(gathered, join)
    else:  # without weights: a ring all-reduce's gather of its sums (lane.register_ring_all_reduce)
        lane.register("all_gather_matmul", a_shard, bs, schedule, group_name, group_size, ws)
    return gathered, outs


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, schedule: str, group_name: str,
                          group_size: int, deferred: bool = False) -> torch.Tensor:
    """See ``compass::matmul_reduce_scatter``; ``deferred``: ``compass::matmul_reduce_scatter_start``
    (returns once the GEMMs are issued; ``_c10d_functional.wait_tensor`` on the result joins)."""
    rows, n = a.shape[0], b.shape[1]
    if group_size == 1:
        return a @ b
    host = transport() == "host"
    a = a.contiguous()
    key = ("rs", schedule, group_name, group_size, rows, n, a.dtype, a.get_device(), host, deferred)
    ws = _workspaces.get((key, _capturing()))  # built: one lookup, no closure
    if ws is None:
        ws = _workspace(key, lambda fence, graph: _plans(graph)("matmul_reduce_scatter", schedule, group_size,
                                                      _rank(group_name, group_size), rows, n, 1, a.element_size(),
                                                      host, host_piece_bytes(), detach=deferred, fence=fence,
                                                      most_pieces=host_most_pieces_setting())[0],
                        group_name, n, a)
    out = a.new_empty((rows // group_size, n))
    join = ws.run({"A": [a], "W": [b], "OUT": [out]}, deferred)
    if join is not None:
        _register_join(out, join)
    else:
        lane.register("matmul_reduce_scatter", a, b, schedule, group_name, group_size, ws)
    return out


def matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, schedule: str, group_name: str,
                      group_size: int, deferred: bool = False) -> torch.Tensor:
    """See ``compass::matmul_all_reduce``: direct pulls pipelined over row chunks; the ring
    schedules run the fused reduce-scatter, then the gather, on the same ring.  ``deferred``: as
    :func:`matmul_reduce_scatter` (on the ring route only the gather is deferred: it reads the
    reduce-scatter's sums)."""
    rows, n = a.shape[0], b.shape[1]
    if group_size == 1:
        return a @ b
    host = transport() == "host"
    chunk_key = (schedule, group_size, rows, rows * n * a.element_size(), host, env_raw(b"COMPASS_HOST_PIECE_MIB"),
                 env_raw(b"COMPASS_HOST_MOST_PIECES"))
    chunks = _pull_chunks.get(chunk_key)
    if chunks is None:  # asked per call otherwise (~5 us of Python)
        chunks = _pull_chunks[chunk_key] = all_reduce_pull_chunks(*chunk_key[:5], host_piece_bytes(),
                                                                  host_most_pieces_setting())
    if not chunks:
        scattered = matmul_reduce_scatter(a, b, schedule, group_name, group_size)
        gathered, _ = all_gather_matmul(scattered, [], schedule, group_name, group_size, deferred)
        if not deferred:
            lane.register_ring_all_reduce(a, b, scattered, schedule, group_name, group_size)
        return gathered
    a = a.contiguous()
    key = ("ar", group_name, group_size, rows, n, a.dtype, a.get_device(), host, deferred)
    ws = _workspaces.get((key, _capturing()))  # built: one lookup, no closure
    if ws is None:
        ws = _workspace(key, lambda fence, graph: _plans(graph)("matmul_all_reduce", schedule, group_size,
                                                      _rank(group_name, group_size), rows, n, 1, a.element_size(),
                                                      host, host_piece_bytes(), detach=deferred, fence=fence,
                                                      most_pieces=host_most_pieces_setting())[0],
                        group_name, n, a)
    out = a.new_empty((rows, n))
    join = ws.run({"A": [a], "W": [b], "OUT": [out]}, deferred)
    if join is not None:
        _register_join(out, join)
    else:
        lane.register("matmul_all_reduce", a, b, schedule, group_name, group_size, ws)
    return out
