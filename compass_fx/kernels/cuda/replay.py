"""Eager fused calls replayed from CUDA graphs: the host's cost of a call stops growing with its plan.

Why: issued one by one from Python, a call's commands cost the host 300-1500 us on the lent H200
machine (a GEMM launch ~20 us, a copy ~8 us, a flag operation ~4 us, each with its Python around
it), more than the device needs for a call below 8192 tokens.  A captured graph of the same
commands is one launch (``benchmarks/results/host_issue_profile/host_issue_profile-h200.json``: 8 waits, copies and
flag writes on a side stream and 4 GEMMs replay in 35 us against 169 us issued one by one).

What a graph may bake in.  Its commands address the call's tensors (its input, weights and
outputs) and the workspace's buffers, and its flag operations carry numbers.  So a workspace
keeps one graph per set of the call's addresses and per residue of the epoch mod 4: the flags
hold the epoch as one bit of four (:mod:`..flag_codes`) and the buffers alternate with the
epoch's parity, so the four graphs of a set replay every later call with those addresses.  The
caching allocator hands a training step's tensors the same addresses step after step, so the
sets recur; a set is captured on its second sighting (a tensor seen once costs no capture), at
most ``COMPASS_FUSED_REPLAY_GRAPHS`` sets per workspace (default :data:`MOST_SETS`; the least
recently used goes; a workspace whose sets are evicted before they pay back their captures stops
capturing).  Each call site of a step is a set of its own (its weight, input and output): a layer
has one per workspace, or two where the attention's output and the MLP's are reduced alike (the
same rows and width: one workspace), and activation checkpointing doubles them (the recomputed
forward's inputs are new): 504 for Llama-3.1-405B's 126 layers.
With fewer places than that, the least recently used set is always the next one called: each
capture is evicted before it replays, until the workspace stops capturing, and the sets it did not
keep are issued from Python from then on (the limit of 64 until 2026-12-07 against 80 layers: 20%
of a step's calls, 49% against 126; ``tests/test_replay.py``, ``benchmarks/fused_replay_scale.py``).
Before a graph is instantiated its memset nodes become kernel nodes (:mod:`.graph_edit`: cuBLAS's
workspace clears cost the launch ~2 us each; ``COMPASS_REPLAY_MEMSETS=memset`` keeps them).  A
graph keeps what its capture allocated, in a private pool of its own for its life: nothing (a sum
of more than two terms accumulates in the workspace's float32 rows, :func:`.impl.sum_scratch`).

Nothing changes for the peers: a replay runs the very commands an eager call issues, on the same
buffers and flags, so whether a rank replays or issues is its own business (two ranks may well
differ: their addresses do) and every guarantee of the eager path holds: the same flag waits on
the same streams (no kernel spins), the watchdog's bounded waits (the replay graph's last node
counts it done: watchdog.Progress), and the issue order's safety where streams share a hardware
queue (a graph's launch queues its nodes in an order of their dependencies alone, so the graph
holds :mod:`..graph_order`'s guards besides).  ``COMPASS_FUSED_REPLAY=0`` issues every call
one command at a time, as before.  A capture that fails turns replays off for the process, with a
warning, and the call is issued as before.
"""
from __future__ import annotations

import functools
import warnings
from collections import OrderedDict
from typing import Callable, Hashable

import torch

from ..flag_codes import PERIOD
from ..protocol import positive_integer
from . import device_launch, driver, env, env_raw

_capture_streams: dict[int, torch.cuda.Stream] = {}
_disabled: list[str] = []  # why replays were turned off in this process (a capture failed)
# calls of this process served from graphs (of which issued from C: .lane), eager calls issued command by
# command (impl), graphs captured, memset nodes made kernels (graph_edit)
stats = {"replayed": 0, "lane": 0, "issued": 0, "captured": 0, "memsets_replaced": 0, "device_launched": 0}


_settings: dict = {}  # raw COMPASS_FUSED_REPLAY -> on (read on every call: one dict lookup when unchanged)


def enabled() -> bool:
    """``COMPASS_FUSED_REPLAY`` (default 1): eager calls of the fused operators replay captured graphs."""
    if _disabled:
        return False
    raw = env_raw(b"COMPASS_FUSED_REPLAY")
    on = _settings.get(raw)
    if on is None:
        on = _settings[raw] = env("COMPASS_FUSED_REPLAY", "1").strip().lower() not in ("0", "false", "no", "off")
    return on


def deferred_enabled() -> bool:
    """``COMPASS_FUSED_REPLAY_DEFERRED`` (default 1): deferred calls (``fused_async``'s ``*_start``)
    replay too, on a stream of their own (``impl._Workspace._replay_apart``); ``0`` issues them
    command by command, as before (read when a workspace first defers a call)."""
    return enabled() and env("COMPASS_FUSED_REPLAY_DEFERRED", "1").strip().lower() not in ("0", "false", "no", "off")


def _switch(name: str, default: str, choices: tuple[str, str]) -> bool:
    value = env(name, default).strip().lower()
    if value not in choices:
        raise ValueError(f"{name} must be {' or '.join(choices)}, got {value!r}")
    return value == choices[0]


def wait_mode() -> str:
    """``COMPASS_REPLAY_WAITS`` = ``batch``, ``stream`` or ``kernel``: how a replay graph waits for
    a flag (read when a workspace is built; see ``impl._Workspace._compile_replay`` for why stream
    waits are the default).  ``batch``: stream waits, those a plan may wait for together
    (:meth:`..protocol.Plan.wait_runs`, an all-reduce's pulls from every peer) as one node, which
    costs the graph's launch ~1 us less per wait; ``stream``: a node per wait.  The default is
    ``kernel`` where replay graphs are launched by the GPU (:mod:`.device_launch`: a device graph
    cannot hold a stream wait), else ``batch``."""
    value = env("COMPASS_REPLAY_WAITS", "kernel" if device_launch.wanted() else "batch").strip().lower()
    if value not in ("batch", "stream", "kernel"):
        raise ValueError(f"COMPASS_REPLAY_WAITS must be batch, stream or kernel, got {value!r}")
    return value


def waits_as_kernels() -> bool:
    """Whether a replay graph waits for flags with spinning kernels (:func:`wait_mode`)."""
    return wait_mode() == "kernel"


def wait_batches() -> bool:
    """Whether a replay graph waits for a run of flags as one node (:func:`wait_mode`)."""
    return wait_mode() == "batch"


def host_copies_as_kernels() -> bool:
    """``COMPASS_REPLAY_HOST_COPIES`` = ``engine`` (default) or ``kernel``: how a replay graph copies
    to and from host memory (read when a workspace is built).  A copy kernel saves ~3 us of launch
    per copy but does not overlap a cuBLAS GEMM that fills the GPU: on one H200, 8 x 4 MiB to or
    from host memory beside an 8192x4096x7168 GEMM (0.62 ms) took 1.24-1.41 ms as a kernel of 4-64
    blocks against 0.66 ms on the copy engines (``graph_node_probe-h200-copy``), and overlapping
    those copies with the GEMMs is what the fused operators are for."""
    return _switch("COMPASS_REPLAY_HOST_COPIES", "engine", ("kernel", "engine"))


def graph_guards() -> bool:
    """``COMPASS_GRAPH_GUARDS`` = ``1`` (default) or ``0``: whether the CUDA graphs of fused calls
    (replays, and calls captured in a graph of the caller's) hold :mod:`..graph_order`'s guards,
    which keep a graph's launch from queueing a flag wait ahead of an earlier publication of its
    rank on a shared hardware queue (read when a workspace is built; ``0`` only to measure what
    they cost)."""
    return _switch("COMPASS_GRAPH_GUARDS", "1", ("1", "0"))


def guards_from_sets_last() -> bool:
    """``COMPASS_GRAPH_GUARD_SEQUENCE`` = ``capture`` (default) or ``sets-last``: whether a fused
    call's CUDA graph takes its guards from the order it is captured in or from
    :func:`..graph_order.guard_sequence` (each pull then waits for its matching publication only;
    on one shared H200 4-7% faster for the 8192-row four-rank all-reduce, 4-10% slower for the
    small reduce-scatters, so opt-in until a GPU per rank decides; read when a workspace is built)."""
    return _switch("COMPASS_GRAPH_GUARD_SEQUENCE", "capture", ("sets-last", "capture"))


def flag_writes_as_kernels() -> bool:
    """``COMPASS_REPLAY_FLAG_WRITES`` = ``kernel`` (default) or ``stream``: how a replay graph sets
    a flag (a one-thread kernel, or the stream memory operation an issued call uses)."""
    return _switch("COMPASS_REPLAY_FLAG_WRITES", "kernel", ("kernel", "stream"))


def memsets_as_kernels() -> bool:
    """``COMPASS_REPLAY_MEMSETS`` = ``kernel`` (default) or ``memset``: whether a replay graph's
    memset nodes (cuBLAS clears its workspace with one before many GEMMs) become kernel nodes
    (:mod:`.graph_edit`: ~2 us less host per memset at each launch)."""
    return _switch("COMPASS_REPLAY_MEMSETS", "kernel", ("kernel", "memset"))


def memset_kernel(device_index: int) -> int:
    """The ``compass_memset`` kernel to put in place of a replay graph's memsets on
    ``device_index``, or 0: keep them (asked for, or this torch cannot edit a graph before it is
    instantiated, or our kernels did not load)."""
    if not memsets_as_kernels() or not _editable():
        return 0
    from . import graph_flags

    try:
        return graph_flags._functions(device_index)["compass_memset"]
    except Exception:  # noqa: BLE001 - kernel_nodes() warns about this already
        return 0


@functools.cache
def _editable() -> bool:
    """Whether ``torch.cuda.CUDAGraph`` keeps the graph it captured for editing (``keep_graph``,
    ``raw_cuda_graph``, ``instantiate``)."""
    try:
        torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        return False
    return all(hasattr(torch.cuda.CUDAGraph, name) for name in ("raw_cuda_graph", "instantiate"))


def edit(graph_handle: int, memset: int) -> int:
    """What a replay graph becomes before it is instantiated: its memset nodes as launches of
    ``memset`` (:func:`.graph_edit.memsets_as_kernels`); returns how many were replaced."""
    from .graph_edit import memsets_as_kernels as replace

    return replace(graph_handle, memset)


def kernel_nodes(device_index: int) -> bool:
    """Whether replay graphs may hold our kernels (flag writes, host-memory copies): their module
    compiles and loads on ``device_index`` (NVRTC through torch); else they hold the stream memory
    operations and copy-engine copies an issued call makes, with a warning."""
    from . import graph_flags

    try:
        graph_flags._functions(device_index)  # compiled now: never while a graph is captured
    except Exception as e:  # noqa: BLE001 - the commands as issued are right, only slower to launch
        if "kernels" not in _warned:
            _warned.append("kernels")
            warnings.warn(f"compass fused operators: replay graphs keep stream memory operations and copy-engine "
                          f"copies (the flag and copy kernels did not load: {e})", RuntimeWarning, stacklevel=3)
        return False
    return True


_warned: list[str] = []


MOST_SETS = 512  # sets of addresses a workspace keeps graphs for: four per layer of a 128-layer model


def limit() -> int:
    """``COMPASS_FUSED_REPLAY_GRAPHS`` (default :data:`MOST_SETS`): sets of addresses a workspace keeps graphs for."""
    return positive_integer("COMPASS_FUSED_REPLAY_GRAPHS", env("COMPASS_FUSED_REPLAY_GRAPHS", str(MOST_SETS)).strip())


def _capture_stream(device_index: int) -> torch.cuda.Stream:
    """A stream to capture on (a capture cannot start on the legacy default stream), whose cuBLAS
    workspace exists before any capture (allocated inside one, it would belong to that graph)."""
    if device_index not in _capture_streams:
        stream = torch.cuda.Stream(device=device_index)
        with torch.cuda.device(device_index), torch.cuda.stream(stream):
            a = torch.zeros(16, 16, device=f"cuda:{device_index}", dtype=torch.bfloat16)
            torch.mm(a, a)
        stream.synchronize()
        _capture_streams[device_index] = stream
    return _capture_streams[device_index]


class Captured:
    """A captured call, launched by the driver directly: ``CUDAGraph.replay`` also refreshes the
    random number generators' offsets (two fills on the GPU, ~15 us of host on the lent machine),
    which a graph without random numbers does not need."""

    __slots__ = ("graph", "exec", "_launch", "keep")

    def __init__(self, graph: torch.cuda.CUDAGraph, keep: object = None) -> None:
        self.graph = graph  # owns the executable graph
        self.keep = keep  # what the graph's launch needs alive (a device-launched graph: its DeviceGraph)
        self._launch = driver.raw("graph_launch")
        try:
            self.exec = graph.raw_cuda_graph_exec()
        except (AttributeError, RuntimeError):  # an older torch: replay() it is
            self.exec = None

    def launch(self, stream: int) -> None:
        """Run the call on ``stream`` (the caller's current stream's handle)."""
        if self.exec:
            result = self._launch(self.exec, stream)
            if result:
                driver.check(result, "cuGraphLaunch")
        else:
            self.graph.replay()


class Replays:
    """One workspace's graphs: ``graphs[addresses][epoch % PERIOD]``."""

    label = "compass fused operators"  # who warns (the workspace's operator where it names one)
    stopped = False  # whether this workspace stopped capturing (:meth:`thrashing`), said once

    def __init__(self, device_index: int, label: str = label, disabled: list[str] | None = None) -> None:
        self.device_index = device_index
        self.label = label  # who warns when a capture fails
        self.disabled = _disabled if disabled is None else disabled  # whose replays a failed capture turns off
        self.most = limit()
        self.graphs: OrderedDict[Hashable, list] = OrderedDict()
        self.seen: OrderedDict[Hashable, None] = OrderedDict()  # sets of addresses seen once
        self.captures = self.evicted = 0

    def thrashing(self) -> bool:
        """Whether sets are evicted before they pay back their captures: more sets recur than
        ``most`` holds (say more call sites of one shape per step than the limit).  A capture costs
        about two eager issues, so then this workspace stops capturing (its graphs still replay)."""
        return self.evicted > self.most and self.evicted * PERIOD * 2 > self.captures

    def _say_stopped(self) -> None:
        """Warn, once, that this workspace stopped capturing: its later calls without a graph cost the
        host hundreds of microseconds each, which a user can undo by raising the limit."""
        if self.stopped:
            return
        self.stopped = True
        warnings.warn(f"{self.label}: a step calls more sets of addresses (call sites of one operator and shape) "
                      f"than the {self.most} this workspace keeps replay graphs for, so each capture was evicted "
                      f"before it replayed; it stops capturing, and the calls it holds no graph for are issued "
                      f"command by command from now on (hundreds of microseconds of host each). Set "
                      f"COMPASS_FUSED_REPLAY_GRAPHS above the call sites a step has "
                      f"(compass_fx.fused_calls() lists the workspaces)", RuntimeWarning, stacklevel=4)

    def graph(self, addresses: Hashable, epoch: int, issue: Callable[[torch.cuda.Stream], None]):
        """The graph that runs this call (captured now if these addresses were seen before), or
        None: issue the call eagerly.  ``issue(stream)`` issues the call's commands with ``stream``
        as the caller's."""
        phase = epoch % PERIOD
        graphs = self.graphs.get(addresses)
        if graphs is not None:
            self.graphs.move_to_end(addresses)
            if graphs[phase] is not None:
                stats["replayed"] += 1
                return graphs[phase]
        elif addresses in self.seen:
            if self.thrashing():
                self._say_stopped()
                return None
            del self.seen[addresses]
            graphs = self.graphs[addresses] = [None] * PERIOD
            while len(self.graphs) > self.most:
                self.graphs.popitem(last=False)
                self.evicted += 1
        else:
            self.seen[addresses] = None
            while len(self.seen) > 4 * self.most:
                self.seen.popitem(last=False)
            return None
        graphs[phase] = self._capture(issue)
        if graphs[phase] is not None:
            self.captures += 1
            stats["captured"] += 1
            stats["replayed"] += 1
        return graphs[phase]

    def _capture(self, issue: Callable[[torch.cuda.Stream], None]):
        stream = _capture_stream(self.device_index)
        memset = memset_kernel(self.device_index)  # before the capture: it may compile
        by_device = device_launch.wanted() and device_launch.available(self.device_index)  # may compile too
        keep = bool(memset) or by_device
        graph = torch.cuda.CUDAGraph(keep_graph=True) if keep else torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    issue(stream)
                finally:
                    graph.capture_end()
            if memset:
                stats["memsets_replaced"] += edit(graph.raw_cuda_graph(), memset)
            on_device = device_launch.instantiate(graph, self.device_index, stream) if by_device else None
            if on_device is not None:  # the GPU launches it: one node of host launch whatever the plan
                stats["device_launched"] += 1
                captured = Captured(on_device.launcher, keep=on_device)
            else:
                if keep:
                    graph.instantiate()
                captured = Captured(graph)
        except Exception as e:  # noqa: BLE001 - replays off, the call goes on eagerly
            self.disabled.append(f"{type(e).__name__}: {e}")
            warnings.warn(f"{self.label}: capturing a call in a CUDA graph failed ({e}); eager calls "
                          "are issued one command at a time from now on", RuntimeWarning, stacklevel=3)
            self.graphs.clear()
            return None
        return captured
