"""Bounded waits for the fused operators: a watchdog thread instead of a spinning kernel.

A stream memory wait cannot time out by itself.  Every call of a fused operator registers an
event recorded after its last wait (an event of its own, from a pool: an event re-recorded by a
later call would hide whether an earlier one finished); a daemon thread checks, about once a second, whether the oldest
unfinished call has been waiting longer than ``COMPASS_FUSED_TIMEOUT_S`` (default 300 s, like a
collective timeout: a peer whose host is busy for minutes, e.g. saving a checkpoint, is not an
error).  When one has, it reads the flags the call waits for, logs which rank and which piece it
waits on, releases the wait (so that nothing stays frozen), and marks the process failed: every
later call of a fused operator raises a ``RuntimeError`` with that message.  Reading and
releasing a flag in GPU memory take GPU work of their own, which a blocked hardware queue can hold
up too; each gets ``DIAGNOSE_S`` seconds, after which the error is reported without the detail.

An eager call replayed from a CUDA graph (:mod:`.replay`) registers no event either: the graph's
last node adds one to a word of pinned host memory (:class:`Progress`) and the call only notes its
epoch in a ring, so the thread sees which replayed call is the oldest unfinished one, and since
when it has made no progress, without any GPU work (an event per call cost ~10-20 us of host).

A call captured in a CUDA graph has no host work per replay to register: its waits bound
themselves on the GPU (:mod:`.graph_flags`) and report into a host word, which the thread reads
too (:meth:`Watchdog.watch_status`).  The thread may query events while the caller captures a
graph, so it runs in the relaxed capture mode (in the default mode that query would invalidate
the capture).
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("compass_fx")
DIAGNOSE_S = 10.0  # the most the watchdog waits to read (or release) a stuck call's flags


def timeout_s() -> float:
    """``COMPASS_FUSED_TIMEOUT_S`` (default 300)."""
    value = float(os.environ.get("COMPASS_FUSED_TIMEOUT_S", "300"))
    if value <= 0:
        raise ValueError(f"COMPASS_FUSED_TIMEOUT_S must be > 0, got {value}")
    return value


@dataclass(slots=True)
class _Pending:
    epoch: int
    event: object  # anything with query() -> bool (a torch.cuda.Event)
    since: float


class Progress:
    """The replayed calls of one workspace: ``issued`` of them so far, the epoch of replay ``i`` in
    ``epochs[i % RING]``, and ``done``: the word (uint32, pinned host memory, read by the host with
    no GPU work) that each replay graph's last node raises by one (:func:`.graph_flags.count`).
    At most ``RING - 1`` replays are outstanding (:meth:`room`), so the oldest unfinished one's
    epoch is always in the ring.  ``stream``: the stream the replays run on (a plain increment on
    the GPU is exact only while they run one after another)."""

    RING = 4096
    __slots__ = ("word", "done", "address", "issued", "epochs", "stream", "seen", "since")

    def __init__(self, word=None) -> None:
        if word is None:
            import torch

            word = torch.zeros(1, dtype=torch.int32).pin_memory()
        self.word = word  # keeps the memory alive
        self.address = word.data_ptr()
        self.done = ctypes.c_uint32.from_address(self.address)
        self.issued = 0
        self.epochs = [0] * self.RING
        self.stream = None
        self.seen = -1  # the done count the watchdog saw last, and when it first saw it
        self.since = 0.0

    def outstanding(self) -> int:
        """Replays issued and not finished yet (modulo 2**32, as the word counts)."""
        return (self.issued - self.done.value) & 0xFFFFFFFF

    def room(self, stream: int) -> bool:
        """Whether a replay may be issued now on ``stream`` (else the call is issued, not replayed):
        the ring has room, and the stream is the replays' own, or every earlier replay has finished
        (then ``stream`` becomes theirs)."""
        if stream == self.stream:
            return (self.issued - self.done.value) & 0xFFFFFFFF < self.RING - 1
        if self.outstanding():
            return False
        self.stream = stream
        return True

    def oldest(self, now: float, timeout: float) -> "tuple[int, float] | None":
        """(epoch, since) of the oldest unfinished replay when it has made no progress for longer
        than ``timeout`` (seen by the watchdog's scans), else None."""
        issued = self.issued  # read before the word: a replay is counted issued before it can finish
        done = self.done.value
        pending = (issued - done) & 0xFFFFFFFF
        if not pending or pending >= self.RING:  # nothing outstanding (or a count read mid-update)
            self.seen = -1
            return None
        if done != self.seen:
            self.seen, self.since = done, now
            return None
        if now - self.since <= timeout:
            return None
        return self.epochs[done % self.RING], self.since


@dataclass
class Watched:
    """What the watchdog needs of one workspace: its pending calls, how to diagnose one, and the
    events of finished calls, ready for reuse."""

    diagnose: Callable[[int], tuple[str, Callable[[], None]]]  # epoch -> (message, release)
    pending: list[_Pending] = field(default_factory=list)
    pool: list = field(default_factory=list)
    what: str = "a compass fused operator"  # named in the error when the diagnosis itself is stuck
    registered: bool = False  # in its watchdog's list (asked on every call: a flag, not a list search)
    progress: Progress | None = None  # its replayed calls, counted on the GPU


class Watchdog:
    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self.timeout = timeout_s()
        self.watched: list[Watched] = []
        self.failure: str | None = None
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.statuses: list[tuple[object, Callable[[int], str]]] = []  # (host int32 word, code -> message)

    def check_failed(self) -> None:
        if self.failure:
            raise RuntimeError(self.failure)

    def reusable(self, w: Watched):
        """An event of ``w``'s finished calls, or None: from the pool, else, the pool empty, the
        events of every finished call at the head of the pending list go to the pool (so that
        back-to-back calls between two scans reuse events instead of making new ones, and query
        each finished call's event once)."""
        with self.lock:
            if w.pool:
                return w.pool.pop()
            pending = w.pending
            while pending and pending[0].event.query():
                w.pool.append(pending.pop(0).event)
            if w.pool:
                return w.pool.pop()
        return None

    def prefill(self, w: Watched, n: int) -> None:
        """Put ``n`` new driver events in ``w``'s pool (replayed calls record driver events)."""
        from . import driver

        events = [driver.Event() for _ in range(n)]
        with self.lock:
            w.pool.extend(events)

    def add(self, w: Watched, epoch: int, event) -> None:
        with self.lock:
            w.pending.append(_Pending(epoch, event, time.monotonic()))
            if not w.registered:
                w.registered = True
                self.watched.append(w)
        if self.thread is None:
            self._start()

    def watch_progress(self, w: Watched, progress: Progress) -> None:
        """Bound ``w``'s replayed calls through ``progress`` (no per-call registration)."""
        with self.lock:
            w.progress = progress
            if not w.registered:
                w.registered = True
                self.watched.append(w)
        self._start()

    def forget(self, w: Watched) -> None:
        """Stop watching ``w`` (its calls are gone with what ran them: a released graph)."""
        with self.lock:
            if w.registered:
                self.watched.remove(w)
                w.registered = False

    def watch_status(self, status, explain: Callable[[int], str]) -> None:
        """Watch a host int32 word (``status[0]``) that the GPU sets to a nonzero code when it stops
        a call's work (a captured wait timed out, a replay graph's launch was refused);
        ``explain(code)`` is the error every later call raises."""
        with self.lock:
            self.statuses.append((status, explain))
        self._start()

    def _start(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="compass-fused-watchdog", daemon=True)
            self.thread.start()

    def _loop(self) -> None:
        import torch

        from . import driver

        torch.cuda.set_device(self.device_index)  # the driver calls below need this thread's context
        driver.relax_capture_mode()
        while self.failure is None:
            time.sleep(min(1.0, self.timeout / 10))
            self.scan()

    def scan(self) -> None:
        """Drop finished calls; diagnose and release the oldest one past the timeout."""
        now = time.monotonic()
        with self.lock:
            for status, explain in self.statuses:
                code = int(status[0])
                if code:
                    self.failure = explain(code)
                    log.error(self.failure)
                    return
            for w in self.watched:
                while w.pending and w.pending[0].event.query():
                    w.pool.append(w.pending.pop(0).event)
                late = [(p.epoch, p.since) for p in w.pending if now - p.since > self.timeout][:1]
                replayed = w.progress.oldest(now, self.timeout) if w.progress is not None else None
                if replayed is not None:
                    late = sorted(late + [replayed])  # the older of the two (calls finish in order)
                if late:
                    epoch, since = late[0]
                    diagnosis = _within(DIAGNOSE_S, lambda: w.diagnose(epoch))
                    message, release = diagnosis if diagnosis is not None else (
                        f"{w.what}: call {epoch} waits for a peer that is late, has died, or calls the fused "
                        f"operators in another order (its flags could not be read within {DIAGNOSE_S:g} s: the "
                        f"GPU's queues are blocked). Every later call of a compass fused operator on this rank "
                        f"raises this error.", None)
                    self.failure = (f"{message} (no progress for {now - since:.0f} s, "
                                    f"COMPASS_FUSED_TIMEOUT_S={self.timeout:g})")
                    log.error(self.failure)
                    if release is not None and _within(DIAGNOSE_S, lambda: release() or True) is None:
                        log.error(f"{w.what}: the stuck wait of call {epoch} could not be released within "
                                  f"{DIAGNOSE_S:g} s")
                    return


def _within(seconds: float, fn: Callable[[], object]) -> object | None:
    """``fn()``'s result, or None when it has not returned within ``seconds`` (it runs on in a daemon
    thread; an exception it raises is re-raised here)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name="compass-fused-diagnosis", daemon=True)
    thread.start()
    thread.join(seconds)
    if "error" in box:
        raise box["error"]
    return box.get("value")


_dogs: dict[int, Watchdog] = {}


def for_device(index: int) -> Watchdog:
    if index not in _dogs:
        _dogs[index] = Watchdog(index)
    return _dogs[index]
