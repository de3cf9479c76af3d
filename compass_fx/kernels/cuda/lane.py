"""The fused calls' host fast path: a replayed eager call issued from C, not from Python.

Why (issue 27): with its commands replayed from a captured CUDA graph, what is left of a fused
call's host time is Python: the op's wrapper, the checks, the workspace's key and lookup, the
outputs' allocations, the replay's bookkeeping (19-42 us on the lent H200 host besides 4-19 us of
allocations, ``fused_host_time-h200-outputs-w2-breakdown-host-pin-mps``), while the graph's launch
itself costs 13-50 us.  ``lane.cpp`` does the same steps in C for a call whose graph is already
captured: one function reads the settings, finds the workspace, allocates the outputs, finds the
graph for their addresses, counts the call in the watchdog's ring and launches the graph.  On one
H200 shared by two host-staged ranks: 19-88 us a call against 42-126 through Python in the same
rounds (``fused_host_time-h200-lane-w2-breakdown-host-pin-mps``); the launch is then nearly all of it.

What it may skip, and why that is safe.  It runs only for a call the Python path has run before
with the same arguments' shapes, dtypes, device, schedule, group and settings (the Python path
registers the workspace under that key after it ran a call: :func:`register`), so the checks that
depend on nothing else passed then; it checks the rest itself (the weight's shape, dtype and device,
a contiguous input, no capture, no deferred call issued command by command outstanding, no failure,
replays on).  It reads and writes the Python path's own objects (the workspace's epoch, its
:class:`.watchdog.Progress`, the :class:`.replay.Replays`' graphs, :data:`.replay.stats`), so the
two paths take turns freely; whatever it does not expect sends the call to the Python path before
anything has changed.

It is compiled on the first workspace built in a process (torch's C++ extension builder, cached
on disk per torch version: ~20 s the first time on one core); without a compiler, or with
``COMPASS_FUSED_LANE=0`` (read on every call), calls take the Python path as before.
"""
from __future__ import annotations

import ctypes
import logging
import os
import warnings
from pathlib import Path

import torch

from . import env_raw

log = logging.getLogger("compass_fx")

OPS = {"all_gather_matmul": 0, "matmul_reduce_scatter": 1, "matmul_all_reduce": 2}
_SOURCE = Path(__file__).with_name("lane.cpp")
_state: dict = {}  # "module": the loaded extension, or "failed": why it is not used
lanes: dict = {}  # lane key -> workspace (read by lane.cpp)
fast_calls: list = []  # the extension's ``call`` once built (what ops' CUDA kernels try first)
_OFF_KEY = b"COMPASS_FUSED_LANE"
# the raw values that set the fast path aside (read on every call, as bytes: no parsing per call)
OFF = frozenset(v.encode() for word in ("0", "false", "no", "off") for v in (word, word.upper(), word.title()))


def wanted() -> bool:
    """``COMPASS_FUSED_LANE`` (default 1): replayed calls go through the C fast path."""
    return os.environ.get("COMPASS_FUSED_LANE", "1").strip().encode() not in OFF


def build_directory() -> Path:
    """Where the extension is built and cached: per torch version and Python (a build against
    another torch's headers must not be loaded)."""
    root = Path(_builder()._get_build_directory("compass_lane", verbose=False)).parent
    tag = f"compass_lane-torch{torch.__version__}".replace("+", "_")
    return root / tag


class _NoCudaRuntimeNote(logging.Filter):
    """Drops torch's note that it found a CUDA toolkit but no CUDA runtime."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


def _builder():
    """torch's C++ extension builder (``torch.utils.cpp_extension``), imported without its note "No CUDA
    runtime is found, using CUDA_HOME=...": a CUDA build of torch logs it on a machine without a GPU
    driver (as where ``compass-fx prepare`` builds ahead; once, on its first import), and this extension
    compiles no CUDA code."""
    quiet, logger = _NoCudaRuntimeNote(), logging.getLogger("torch.utils.cpp_extension")
    logger.addFilter(quiet)
    try:
        import torch.utils.cpp_extension as builder
    finally:
        logger.removeFilter(quiet)
    return builder


def is_cached() -> bool:
    """Whether a build of the extension newer than its source lies in :func:`build_directory` (the
    first workspace then loads it instead of compiling for ~20 s; a source changed since, as by an
    upgrade of this package, is built again)."""
    source = _SOURCE.stat().st_mtime
    return any(built.stat().st_mtime >= source for built in build_directory().glob("compass_lane*.so"))


STALE_LOCK_S = 600.0  # a build lock older than this was left by a build that died
LOCK_POLL_S = 0.5      # how often a process waiting for another's build looks at its lock
LOCK_PATIENCE_S = 30.0  # waiting longer than this for another's build is said


def builder_locks_by_flock() -> bool:
    """How torch's extension builder marks a build in progress in its ``lock`` file.  torch 2.14 holds an
    OS advisory lock on it (``filelock``: ``fcntl.flock``), released by the kernel if the builder dies,
    and leaves the file after every build; torch 2.13 and before (``FileBaton``) create the file, remove
    it when done, and wait for as long as it exists, forever for one a killed build left."""
    builder = _builder()
    return hasattr(builder, "FileLock") or not hasattr(builder, "FileBaton")


def _wait_for_another_build(lock: Path) -> None:
    """Wait while another process builds the extension, the way the running torch's builder marks a
    build (:func:`builder_locks_by_flock`), saying so once past ``LOCK_PATIENCE_S``."""
    if builder_locks_by_flock():
        _wait_while_flocked(lock)
    else:
        _wait_for_baton(lock)


def _wait_for_baton(lock: Path) -> None:
    """Wait while ``lock`` exists (a build in progress, torch 2.13's way), at most until it is
    ``STALE_LOCK_S`` old, then remove it with a warning: torch's builder itself would wait for as long
    as the lock exists, forever for one left by a build that was killed (say by Ctrl-C)."""
    import time

    said = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_S:
            warnings.warn(f"compass fused operators: removing the host fast path's build lock {lock}, left {age:.0f} s "
                          "ago by a build that did not finish", RuntimeWarning, stacklevel=4)
            lock.unlink(missing_ok=True)
            return
        if not said and age > LOCK_PATIENCE_S:
            log.warning("compass fused operators: waiting for another process's build of the host fast path (lock %s, "
                        "%.0f s old; taken as left by a killed build at %.0f s: remove it to go on now)", lock, age,
                        STALE_LOCK_S)
            said = True
        time.sleep(LOCK_POLL_S)


def _wait_while_flocked(lock: Path) -> None:
    """Wait while another process holds ``lock``'s advisory lock (torch 2.14's way; the file itself stays
    after every build, so its presence or age says nothing).  A dead builder's lock is let go by the
    kernel; one held ``STALE_LOCK_S`` by a process still alive raises ``TimeoutError`` (the calls then
    take the Python path) instead of waiting with torch for as long as it lives."""
    import time

    started, said = time.monotonic(), False
    while _flock_held(lock):
        waited = time.monotonic() - started
        if waited > STALE_LOCK_S:
            raise TimeoutError(f"another process has held the host fast path's build lock {lock} for {waited:.0f} s")
        if not said and waited > LOCK_PATIENCE_S:
            log.warning("compass fused operators: waiting for another process's build of the host fast path (it "
                        "holds %s, %.0f s so far; given up at %.0f s, the calls then take the Python path)", lock,
                        waited, STALE_LOCK_S)
            said = True
        time.sleep(LOCK_POLL_S)


def _flock_held(lock: Path) -> bool:
    """Whether another open file holds ``lock``'s advisory lock: a probe that gets it lets it go at once.
    False where the file is missing or its file system takes no ``flock`` (torch's lock then decides)."""
    import errno
    import fcntl

    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)
    finally:
        os.close(fd)  # lets a lock the probe got go
    return False


def compile_module():
    """Build (or load from the cache) the extension; raises where it cannot be built.  Ranks that
    start together wait for the one that builds (its lock in the build directory); a lock left by a
    build that was killed never stalls a first call (:func:`_wait_for_another_build`)."""
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    _wait_for_another_build(directory / "lock")
    return _builder().load("compass_lane", sources=[str(_SOURCE)], extra_cflags=["-O2"],
                           build_directory=str(directory), verbose=False)


def configure(module, *, transports: dict, join: type, raw_stream, capturing, launch_address: int,
              check) -> None:
    """Hand ``module`` the Python objects it reads and writes (the Python path's own): ``impl``'s
    transports by raw settings, its ``Join`` class (deferred calls outstanding), how it reads the
    current stream and whether it is captured; the driver's ``cuGraphLaunch`` and ``check``."""
    from . import _ENV_DATA, replay
    from ..flag_codes import PERIOD
    from .watchdog import Progress

    module.configure(lanes, transports, _ENV_DATA, replay._settings, replay._disabled, join, replay.stats,
                     capturing, raw_stream, check, launch_address, PERIOD, Progress.RING, OFF)


def module(*, transports: dict, join: type, raw_stream, capturing):
    """The extension, built and configured (arguments: :func:`configure`'s) on the first call, or
    None (not wanted, no POSIX environment dict, or the build failed: warned once)."""
    if "module" in _state:
        return _state["module"]
    if "failed" in _state or not wanted():
        return None
    from . import _ENV_DATA, driver

    try:
        if _ENV_DATA is None:
            raise RuntimeError("os.environ keeps no bytes dict on this platform")
        if not is_cached():  # a first call that stops for ~20 s says why
            log.warning("compass fused operators: building the host fast path (C++, once per torch version: about "
                        "20 s; cached in %s; `compass-fx prepare` builds it ahead, COMPASS_FUSED_LANE=0 skips it)",
                        build_directory())
        built = compile_module()
        launch = ctypes.cast(driver.raw("graph_launch"), ctypes.c_void_p).value
        configure(built, transports=transports, join=join, raw_stream=raw_stream, capturing=capturing,
                  launch_address=launch, check=driver.check)
    except Exception as e:  # noqa: BLE001 - the Python path is right, only slower on the host
        _state["failed"] = f"{type(e).__name__}: {e}"
        warnings.warn(f"compass fused operators: the host fast path is off ({_state['failed']}); replayed calls "
                      "are issued from Python (set COMPASS_FUSED_LANE=0 to skip building it)", RuntimeWarning,
                      stacklevel=2)
        return None
    _state["module"] = built
    fast_calls.append(built.call)
    install_entries(built)
    log.info("compass fused operators: host fast path built in %s", build_directory())
    return built


# The ``.graph`` overloads whose eager calls C may enter, as ops._direct offered them: (overload, op,
# the kernel's Python path, weights listed).
entries: list = []
_quiet_checks: list = []  # ops._direct's mode checks: () -> falsy where no mode or transform is on


def enter_from_c(overload, op: str, python_path, listed: bool, quiet_checks: tuple) -> None:
    """Let C take ``overload``'s eager calls once the extension is built (:func:`install_entries`).

    Why: ops._direct's entry and the kernel are two Python frames and a dozen checks around every
    call.  A hot host runs them in next to no time, but the first calls after a wait for the device
    find them cold: against the Python entry in the same rounds (``fused_host_time``'s Python-entry
    forms, three H100 starts, 2/4/8 ranks, both transports) the C entry's four calls after an idle
    device took 3-12 us less host time (median of the rows; less in 11 of 12 runs), its steady calls
    the same (``fused_host_time-h100-c-entry-run*``).  The C entry makes the same checks (exact
    tensors, the input on the GPU, ``quiet_checks`` all falsy, no gradient wanted, positional
    arguments) and issues the replay itself; a call it declines goes to ``python_path`` (the kernel
    without its try of C), anything else to the overload's entry as before."""
    entries.append((overload, op, python_path, listed))
    _quiet_checks[:] = quiet_checks


def install_entries(built, device_type: str = "cuda") -> None:
    """Make each offered overload's entry the C one, its Python entry kept as the fallback (once:
    installed again, the C entry replaces the C entry, not wraps it)."""
    built.configure_direct(torch.Tensor, tuple(_quiet_checks), fast_calls, device_type)
    for overload, op, python_path, listed in entries:
        python_entry = getattr(overload._op, "fallback", overload._op)
        overload._op = built.direct(OPS[op], python_entry, python_path, listed)


PHASES = ("checks", "outputs", "prepare", "launch", "bookkeeping")


def last_phases() -> "dict[str, float] | None":
    """Where the last call spent its host time, in us, if C issued it (else None): the checks, key
    and workspace lookup; the outputs' allocations; the replays' graphs found and the watchdog's room;
    the graphs' launches (``cuGraphLaunch``); the epoch, recency, stats and ring.  Clock reads in C,
    no profiler: what its overhead would hide in calls of tens of microseconds."""
    built = _state.get("module")
    got = built.phases() if built is not None else None
    return None if got is None else {name: ns / 1e3 for name, ns in zip(PHASES, got)}


def _registering():
    """The built extension where calls may be registered for it (built, and not set aside), else None."""
    built = _state.get("module")
    return None if built is None or env_raw(_OFF_KEY) in OFF else built


def register(op: str, a: torch.Tensor, b: "torch.Tensor | list[torch.Tensor]", schedule: str, group_name: str,
             group_size: int, workspace) -> None:
    """Let later calls of these arguments' key run ``workspace``'s replays from C (the Python path
    just ran such a call through it); ``b``: the gather's list of weights, the others' weight."""
    built = _registering()
    if built is None or workspace.progress is None or workspace.replays is None:
        return
    key = built.key(OPS[op], a, b, schedule, group_name, group_size)
    if key is not None:
        lanes[key] = workspace


def register_ring_all_reduce(a: torch.Tensor, b: torch.Tensor, scattered: torch.Tensor, schedule: str,
                             group_name: str, group_size: int) -> None:
    """Let later ring all-reduces of these arguments' key run from C: the Python path runs one as
    the fused reduce-scatter of ``a @ b`` into ``scattered``, then a gather of the sums without
    weights, and registered both workspaces (:func:`register`); the all-reduce's lane holds the pair,
    and ``lane.cpp`` replays both or neither.  Issued from Python, such a call cost the host 2-3x a
    single call (41-117 us as a step issues them at 2-8 ranks on one H200, peer transport)."""
    built = _registering()
    if built is None:
        return
    parts = (lanes.get(built.key(OPS["matmul_reduce_scatter"], a, b, schedule, group_name, group_size)),
             lanes.get(built.key(OPS["all_gather_matmul"], scattered, [], schedule, group_name, group_size)))
    key = built.key(OPS["matmul_all_reduce"], a, b, schedule, group_name, group_size)
    if key is not None and None not in parts:
        lanes[key] = parts

