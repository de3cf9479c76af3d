"""Launching a benchmark: one process per GPU, spawned here (one launch per world size, one after
another) or under ``torchrun`` (one world, from the environment); NCCL on CUDA, gloo on CPU
(``--dry-run``).  Rank 0's result comes back to the process that writes the files."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from compass_fx import gloo_worker_threads

from . import NO_MULTICAST_ENV, RESULTS
from .output import TEARDOWN_WARNINGS, device_tag
from .ranks import Ctx, barrier


def add_launch_args(p, default_worlds: str = "") -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="CPU ranks over gloo, tiny shapes, fp32: checks the script end to end")
    p.add_argument("--worlds", default=default_worlds,
                   help="comma-separated world sizes to launch one after another (default: correctness and "
                        "operators 2,4,8 up to the GPU count, end to end every GPU; 2 with --dry-run). "
                        "Ignored under torchrun.")
    p.add_argument("--out-dir", default=str(RESULTS), help="where the JSON and markdown go")
    p.add_argument("--tag", default=None, help="device tag in the file names (default: e.g. h200x8 or cpu)")


def parse_worlds(text: str, dry_run: bool) -> list[int]:
    if text:
        return [int(w) for w in text.replace(" ", "").split(",") if w]
    if dry_run:
        return [2]
    n = torch.cuda.device_count()
    if n < 2:
        raise SystemExit(f"found {n} GPU(s); these benchmarks need at least 2 (or --dry-run on CPU)")
    return [n]


def group_size_worlds(text: str, dry_run: bool) -> list[int]:
    """``--worlds`` if given, else every group size of the paper's grid (2, 4, 8) that fits the GPUs."""
    if text or dry_run:
        return parse_worlds(text, dry_run)
    n = torch.cuda.device_count()
    worlds = [g for g in (2, 4, 8) if g <= n]
    if not worlds:
        raise SystemExit(f"found {n} GPU(s); these benchmarks need at least 2 (or --dry-run on CPU)")
    return worlds


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, local_rank: int, dry_run: bool, init_method: str | None) -> Ctx:
    for k, v in NO_MULTICAST_ENV.items():
        os.environ[k] = v
    if dry_run:
        backend, device = "gloo", torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: use --dry-run on a CPU machine")
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {"rank": rank, "world_size": world}
    if init_method:
        kwargs["init_method"] = init_method
    # CPU ranks: one gloo worker thread, so that functional gathers in flight cannot corrupt the heap
    # (compass_fx.gloo_worker_threads); the GPU runs' groups are NCCL's
    with gloo_worker_threads(1) if backend == "gloo" else contextlib.nullcontext():
        dist.init_process_group(backend, **kwargs)
    return Ctx(rank, world, local_rank, device, backend, dry_run)


def _teardown() -> None:
    """Release finished work objects, then destroy the process group (gloo's worker threads can
    otherwise hold the last references to tensors while the interpreter shuts down)."""
    import gc

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, dry_run: bool, fn, args, out_path: str) -> None:
    ctx = _init(rank, world, rank, dry_run, f"tcp://127.0.0.1:{port}")
    try:
        result = fn(ctx, args)
        barrier(ctx)  # every rank finished its work before rank 0 declares the run complete
        if rank == 0:
            with open(out_path + ".tmp", "w") as fh:
                json.dump(result, fh, default=str)
            os.replace(out_path + ".tmp", out_path)
    finally:
        _teardown()


def run_worlds(fn: Callable[[Ctx, Any], Any], args, worlds: Sequence[int]) -> list[tuple[int, Any]]:
    """Run ``fn(ctx, args)`` on every rank of each world size; return [(world, rank 0's result)].

    Under torchrun this process is one rank: the result list holds this world only, and is
    meaningful on rank 0 only (other ranks get their own return values).  So it is in a process
    that already belongs to a process group (a dry run called on ranks that exist, as the tests'
    gloo pools do): the worker runs on that group, which is left as it was."""
    if dist.is_initialized():
        return [(world_of_existing_group(args, worlds), _run_on_existing_group(fn, args))]
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        ctx = _init(rank, world, int(os.environ["LOCAL_RANK"]), args.dry_run, None)
        import atexit

        atexit.register(_teardown)  # after rank 0 has written its files
        result = fn(ctx, args)
        barrier(ctx)
        return [(world, result)]
    import torch.multiprocessing as mp

    if not args.dry_run and max(worlds) > torch.cuda.device_count():
        raise SystemExit(f"asked for worlds {list(worlds)} but only {torch.cuda.device_count()} GPU(s) are visible")
    out = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "rank0.json")
            print(f"== launching {world} ranks ({'gloo/CPU' if args.dry_run else 'NCCL/CUDA'})", flush=True)
            try:
                mp.spawn(_spawned, args=(world, _free_port(), args.dry_run, fn, args, path), nprocs=world, join=True)
            except mp.ProcessExitedException as e:
                if not os.path.exists(path):
                    raise
                # Every rank had finished (rank 0 writes after a final barrier): a crash while
                # tearing the process group down loses nothing; say so and keep the results.
                msg = f"world {world}: a rank died while tearing down after the run completed ({e})"
                TEARDOWN_WARNINGS.append(msg)
                print(f"WARNING: {msg}", file=sys.stderr, flush=True)
            with open(path) as fh:
                out.append((world, json.load(fh)))
    return out


def world_of_existing_group(args, worlds: Sequence[int]) -> int:
    """The size of the group this process already belongs to, where a script may run on it: a dry
    run (``args.dry_run``) on gloo asking for that one world; refused otherwise."""
    world = dist.get_world_size()
    if not args.dry_run or dist.get_backend() != "gloo":
        raise SystemExit("a benchmark runs on an existing process group only as a dry run on gloo")
    if list(worlds) != [world]:
        raise SystemExit(f"asked for worlds {list(worlds)} on an existing group of {world} ranks")
    return world


def _run_on_existing_group(fn: Callable[[Ctx, Any], Any], args) -> Any:
    rank = dist.get_rank()
    ctx = Ctx(rank, dist.get_world_size(), rank, torch.device("cpu"), "gloo", True)
    result = fn(ctx, args)
    barrier(ctx)
    return result


def launch(fn: Callable[[Ctx, Any], Any], args, worlds: Sequence[int]) -> tuple[list[tuple[int, Any]], str, float] | None:
    """``run_worlds`` plus what every script's writer needs next: (results, device tag, start
    time); None in a process that does not write the files."""
    t0 = time.time()
    results = run_worlds(fn, args, worlds)
    if not is_writer():
        return None
    return results, args.tag or device_tag(args.dry_run, max(w for w, _ in results)), t0


def gathered(results: list[tuple[int, Any]], key: str = "rows") -> list:
    """The ``key`` lists of every world's result, one after another."""
    return [r for _, res in results for r in res[key]]


def is_writer() -> bool:
    """The process that writes the files: rank 0 under torchrun or of a group that existed before
    the run, the parent otherwise."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return not under_torchrun() or int(os.environ["RANK"]) == 0


def fresh_ranks(worker: Callable, world: int, args: tuple, tmp: str, index: int,
                deadline_s: float) -> tuple[list[dict], list[int]]:
    """Run ``worker(rank, world, *args, init_method, out_path)`` in ``world`` freshly spawned
    processes, each writing its result as JSON to ``out_path.<rank>``; ranks still running after
    ``deadline_s`` (streams still blocked after a watchdog's error) are killed.  Returns each rank's
    result (an error for a rank that wrote none, with its exit code) and the ranks killed."""
    import multiprocessing as mp

    out = os.path.join(tmp, f"case{index}")
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=worker, args=(r, world, *args, f"file://{tmp}/store{index}", out))
             for r in range(world)]
    t0 = time.time()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(max(0.0, deadline_s - (time.time() - t0)))
    killed = [r for r, proc in enumerate(procs) if proc.is_alive()]
    for r in killed:
        procs[r].kill()
        procs[r].join()
    ranks = []
    for r in range(world):
        try:
            with open(f"{out}.{r}") as f:
                ranks.append(json.load(f))
        except FileNotFoundError:
            ranks.append({"status": "error", "error": f"rank {r} wrote no result (exit code {procs[r].exitcode})",
                          "exit_code": procs[r].exitcode})
    return ranks, killed


def save_and_agree(results: list[dict], out_path: str, rank: int) -> bool:
    """A ``fresh_ranks`` worker's step after each case: write this rank's results so far (they stay
    should a later case stall) and agree with the other ranks whether to go on: only where every
    rank's last case passed (the cases after one that did not run in fresh processes)."""
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(results, f)
    agreed = torch.tensor([1 if results[-1]["status"] == "pass" else 0])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return bool(agreed.item())


def leave_group() -> None:
    """Destroy the process group, which a rank of a stalled case may have left unusable."""
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the rank's outcome is written already
        pass


def world_outcome(world: int, ranks: list[dict], killed: list[int], deadline_s: float) -> dict:
    """A world's row from its ranks' results (``fresh_ranks``): "pass" only if every rank passed and
    none was killed, with the first error (ranks still running at the deadline first)."""
    passed = all(r.get("status") == "pass" for r in ranks) and not killed
    row = {"world": world, "status": "pass" if passed else "FAIL"}
    errors = [r["error"] for r in ranks if r.get("error")]
    if killed:
        errors.insert(0, f"ranks {killed} still running after {deadline_s} s")
    if errors:
        row["error"] = errors[0]
    return row


def soak_outcome(ranks: list[dict], killed: list[int], progress: str, calls: int, deadline_s: float
                 ) -> tuple[str, int]:
    """How a soak run in fresh processes (``fresh_ranks``) ended, and the last call rank 0 reported
    in its ``progress`` file: "clean" (every rank passed every call), the signal that killed a rank,
    the ranks still running at the deadline, or the ranks' errors."""
    reached = int(open(progress).read() or 0) if os.path.exists(progress) else 0
    signals = [str(-r["exit_code"]) for i, r in enumerate(ranks) if i not in killed and (r.get("exit_code") or 0) < 0]
    if all(r["status"] == "pass" for r in ranks) and reached == calls:
        return "clean", reached
    if signals:
        return "killed by signal " + ",".join(signals), reached
    if killed:
        return f"ranks {killed} still running after {deadline_s} s", reached
    return "; ".join(r.get("error", r["status"]) for r in ranks if r["status"] != "pass"), reached
