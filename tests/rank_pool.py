"""A pool of real torch.distributed ranks (gloo), spawned once and reused by many tests.

Spawning and initialising a process group costs seconds, so the test session starts one pool per
world size and sends it functions to run.  A function must be importable (module level); it runs
on every rank at once with the rank's number as first argument, and its return values come back
as a list indexed by rank.  A failure on any rank raises here with that rank's traceback.
"""
from __future__ import annotations

import faulthandler
import os
import queue
import time
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

import gc_tuning


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    # A rank that dies in native code (a signal, an abort from the allocator) prints every thread's
    # Python stack to its stderr, which pytest shows under the failing test.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    gc_tuning.settle_imports()  # the forkserver's imports, frozen in every rank it forks
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    from compass_fx import gloo_worker_threads

    # Every gloo group of these ranks (the default one and any a test makes) runs one worker thread:
    # with torch's two, functional gathers in flight corrupt the heap now and then (a rank of the
    # shared pool died with that allocator abort in CI; compass_fx/groups.py says why).
    with gloo_worker_threads(1):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)
        while True:
            item = tasks.get()
            if item is None:
                break
            fn, args, kwargs = item
            try:
                results.put((rank, True, fn(rank, *args, **kwargs)))
            except BaseException:  # noqa: BLE001 - the traceback goes back to the test
                results.put((rank, False, traceback.format_exc()))
        dist.destroy_process_group()


# What every rank imports: loaded once into the forkserver that forks the ranks (one per test
# process), instead of once per rank (~4 s of CPU each on 2 cores; a test session starts 10-20 ranks).
# The server imports them before it forks anything and starts no threads, so forking it is safe.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "compass_fx.backend",
            "gc_tuning", "rank_pool"]
_context = None


def fork_context():
    """The forkserver context the pools' ranks come from (started on first use)."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


_HISTORY = 40  # tasks a dead pool's error lists


def _brief(args: tuple) -> str:
    """A task's arguments in one short line (tensors and long reprs cut)."""
    text = ", ".join(repr(a) if len(repr(a)) <= 40 else repr(a)[:37] + "..." for a in args)
    return f"({text})"


class RankPool:
    """``world_size`` spawned processes in one gloo group, taking work until closed."""

    def __init__(self, world_size: int, timeout_s: float = 600.0) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._stopping = False
        self._ran: list[str] = []  # what the ranks were given, oldest first: a death names its history
        ctx = fork_context()
        port = _free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [ctx.Process(target=_worker, args=(r, world_size, port, self._tasks[r], self._results),
                                   daemon=True) for r in range(world_size)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, *args, **kwargs)`` on every rank; return the results by rank."""
        for q in self._tasks:
            q.put((fn, args, kwargs))
        self._ran.append(f"{getattr(fn, '__module__', '?')}.{fn.__name__}{_brief(args)}")
        out: dict[int, Any] = {}
        failures = []
        deadline = time.monotonic() + self.timeout_s
        while len(out) + len(failures) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive() and r not in out]
                if dead or time.monotonic() > deadline:
                    codes = {r: self._procs[r].exitcode for r in dead}
                    self.close(force=True)
                    why = f"rank(s) died with exit codes {codes}" if dead else f"timed out after {self.timeout_s}s"
                    # A rank killed by corrupted memory may have been corrupted by any earlier task
                    # in the same processes: name them, newest last.
                    history = "\n  ".join(self._ran[-_HISTORY:])
                    raise RuntimeError(f"{fn.__name__}: {why}; the pool's last {min(len(self._ran), _HISTORY)} "
                                       f"of {len(self._ran)} tasks:\n  {history}")
                continue
            if ok:
                out[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            # The other ranks may be stuck in a collective with the failed one: start afresh.
            self.close(force=True)
            raise RuntimeError(f"{fn.__name__} failed:\n" + "\n".join(failures))
        return [out[r] for r in range(self.world_size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def stop(self) -> None:
        """Ask every rank to leave its group and exit (without waiting: pools stop side by side)."""
        if not self._stopping:
            self._stopping = True
            for q in self._tasks:
                q.put(None)

    def close(self, force: bool = False) -> None:
        if not force:
            self.stop()
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
