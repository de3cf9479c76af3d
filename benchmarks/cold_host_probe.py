"""Is a rank's host code slow right after a wait because of the host, CUDA, or the ranks waking together?

Why (issue 27): a fused call issued right after its rank waited for the GPU costs the host 2-10x a
steady call in every phase, its plain C and Python checks too (``fused_host_time``'s first of 16,
ranks sharing one GPU under MPS, each pinned to a core), however the rank waited (CUDA's auto,
spinning, blocking, polling); one process alone pays 1.2-2x after a 10 ms wait
(``host_idle_probe``).  So what makes plain host code slow after a wait?  This probe times fixed
host work that touches no GPU, right after a wait of ``gap`` ms (``first``) and then back to back
(``steady``: the median of the next 15), in ``world`` processes pinned as ``fused_host_time``
pins its ranks (core ``rank + 1``, all of its hardware threads), which start each wait together
at a barrier, as ranks waiting for one GPU do:

* without CUDA in the process: the wait spins on the clock (``spin``) or sleeps (``sleep``);
* with a CUDA context (an MPS client where its daemon runs): the same two, and the GPU sleeping
  ``gap`` behind a synchronize (``sync``, CUDA's auto) or behind a busy poll of the stream (``poll``).

The work: ``loop``, 200 additions in Python (the core's speed: a few cache lines); ``walk``, one
attribute read from each of 512 objects picked at random among 8192 (the caches: ~1500 lines on
~400 pages, like a call's lookups); ``dense``, the same reads of 512 objects made side by side
(as many lines on a tenth of the pages: the address translation's share); with a CUDA context also
``mm launch``, issuing one 256 x 256 ``torch.mm`` (what any eager op's issue pays after a wait: the
unfused pair's share of the same effect).  Reading it: first / steady high without CUDA at world 1 says the
host itself (its clocks, or a virtual CPU whose caches others used meanwhile); high only at larger
worlds, the processes waking together; high only with CUDA, what CUDA does while a rank waits.

    python benchmarks/cold_host_probe.py                      # worlds 1, 2, 8; with CUDA where there is a GPU
    python benchmarks/cold_host_probe.py --worlds 1,2 --cuda off --tag cpu
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import output  # noqa: E402
from harness.ranks import pin  # noqa: E402
from harness.timing import python_loop, sleep_cycles_per_ms, spin, synchronize_polling  # noqa: E402

NAME = "cold_host_probe"
GAPS_MS = (0.1, 0.5, 2.0, 10.0)
STEADY_CALLS = 15
WAITS_PLAIN = ("spin", "sleep")
WAITS_CUDA = ("sync", "poll")


def make_walk(objects: int = 8192, touched: int = 512, seed: int = 0, scattered: bool = True):
    """One attribute read from each of ``touched`` objects: picked at random among ``objects``, so
    that they lie scattered over the heap's pages (``scattered``), or the first ``touched`` made,
    side by side on a few pages (as many cache lines, a tenth of the pages: a cost that only the
    scattered walk pays after a wait is the address translation's, not the caches')."""
    rng = random.Random(seed)
    made = [SimpleNamespace(value=i, pad=(i, i)) for i in range(objects)]
    picks = [made[rng.randrange(objects)] for _ in range(touched)] if scattered else made[:touched]
    rng.shuffle(picks)  # read in a random order either way (no prefetcher's help for the dense one)

    def walk() -> int:
        total = 0
        for o in picks:
            total += o.value
        return total

    walk.keep = made  # the objects stay alive (and in place) as long as the walk
    return walk


def _waiter(kind: str, gap_s: float):
    """The wait of kind ``kind`` for ``gap_s`` seconds, as a function of no arguments."""
    if kind == "spin":
        return lambda: spin(gap_s)
    if kind == "sleep":
        return lambda: time.sleep(gap_s)
    import torch

    cycles = int(sleep_cycles_per_ms() * gap_s * 1e3)
    if kind == "sync":
        def sync() -> None:
            torch.cuda._sleep(cycles)
            torch.cuda.synchronize()
        return sync

    def poll() -> None:
        torch.cuda._sleep(cycles)
        synchronize_polling()
    return poll


def _one_round(barrier, wait, fn) -> tuple[float, float]:
    """(first, steady) microseconds: ``fn`` right after the wait, then the median of the next calls."""
    barrier.wait()
    wait()
    stamps = [time.perf_counter()]
    for _ in range(1 + STEADY_CALLS):
        fn()
        stamps.append(time.perf_counter())
    each = [(b - a) * 1e6 for a, b in zip(stamps, stamps[1:])]
    return each[0], statistics.median(each[1:])


def worker(rank: int, cuda: bool, rounds: int, barrier, results) -> None:
    cpus = pin(rank)  # as fused_host_time pins its ranks: core rank + 1, core 0 left to the system
    waits = WAITS_PLAIN
    work = {"loop": python_loop, "dense": make_walk(scattered=False), "walk": make_walk()}
    if cuda:
        import torch

        torch.cuda.set_device(0)
        a = torch.randn(256, 256, device="cuda")  # the context (an MPS client where the daemon runs)
        torch.cuda.synchronize()
        waits = WAITS_PLAIN + WAITS_CUDA
        work["mm launch"] = lambda: torch.mm(a, a)  # what a plain op's issue pays: the baseline's share
    for fn in work.values():
        for _ in range(50):
            fn()
    rows = []
    for kind in waits:
        for gap_ms in GAPS_MS:
            wait = _waiter(kind, gap_ms / 1e3)
            for name, fn in work.items():
                firsts, steadies = zip(*(_one_round(barrier, wait, fn) for _ in range(rounds)))
                rows.append({"wait": kind, "gap_ms": gap_ms, "work": name, "first": list(firsts),
                             "steady": list(steadies)})
    results.put((rank, cpus, rows))


def steal_ticks() -> "int | None":
    """The host's stolen time so far (``/proc/stat``'s steal, in clock ticks: time a virtual CPU
    was ready but its hypervisor ran something else), or None where it is not kept."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8])
    except (OSError, IndexError, ValueError):
        return None


def run_world(world: int, cuda: bool, rounds: int) -> dict:
    """Every rank's rounds pooled: per wait, gap and work the median first and steady microseconds."""
    stolen_before = steal_ticks()
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, cuda, rounds, barrier, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = []
    while len(got) < world:  # a worker that dies is said at once, not after a long wait for its rows
        try:
            got.append(results.get(timeout=5))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"world {world}: a worker failed (exit codes {[p.exitcode for p in procs]})")
    for p in procs:
        p.join(timeout=60)
    got.sort(key=lambda g: g[0])
    rows = []
    for i, row in enumerate(got[0][2]):
        firsts = [x for _, _, rs in got for x in rs[i]["first"]]
        steadies = [x for _, _, rs in got for x in rs[i]["steady"]]
        first, steady = statistics.median(firsts), statistics.median(steadies)
        rows.append({"world": world, "cuda": cuda, "wait": row["wait"], "gap_ms": row["gap_ms"], "work": row["work"],
                     "first_us": first, "steady_us": steady, "first_over_steady": first / steady,
                     "first_p90_us": sorted(firsts)[int(0.9 * (len(firsts) - 1))]})
    stolen_after = steal_ticks()
    stolen = None if stolen_before is None or stolen_after is None else stolen_after - stolen_before
    return {"world": world, "cuda": cuda, "cpus": [g[1] for g in got], "rows": rows, "steal_ticks": stolen}


def summary(rows: list[dict]) -> list[str]:
    """First over steady after the longest wait, per work: without CUDA (spin) and with it (sync), by world."""
    gap = max(GAPS_MS)
    lines = []
    for work in ("loop", "dense", "walk", "mm launch"):
        for cuda, wait in ((False, "spin"), (True, "spin"), (True, "sync")):
            pick = [r for r in rows if r["work"] == work and r["cuda"] == cuda and r["wait"] == wait
                    and r["gap_ms"] == gap]
            if pick:
                said = ", ".join(f"world {r['world']} {r['first_over_steady']:.2f}x ({r['first_us']:.1f} us)"
                                 for r in sorted(pick, key=lambda r: r["world"]))
                lines.append(f"* {work}, {'CUDA context' if cuda else 'no CUDA'}, wait {wait} {gap:g} ms: {said}")
    return lines


def markdown(payload: dict) -> str:
    rows = [r for w in payload["worlds"] for r in w["rows"]]
    cpus = "; ".join(f"world {w['world']}{' (CUDA)' if w['cuda'] else ''}: {w['cpus']}, "
                     f"{w.get('steal_ticks')} ticks stolen" for w in payload["worlds"])
    return "\n".join([
        f"# {NAME} ({payload['tag']})", "",
        "Fixed host work that touches no GPU, timed right after a wait of `gap` ms (`first`) and back to back "
        f"(`steady`: median of the next {STEADY_CALLS}), in `world` processes pinned as fused_host_time pins its "
        "ranks, each wait started together at a barrier; medians over every rank's rounds "
        f"({payload['rounds']} a rank). loop: 200 additions in Python (the core's speed); walk: one attribute read "
        "from each of 512 objects picked at random among 8192 (the caches); dense: the same of 512 objects made "
        "side by side (as many lines, a tenth of the pages); mm launch (with CUDA): issuing one 256 x 256 torch.mm. "
        "Waits: spin on the clock, sleep; with a "
        "CUDA context also the GPU sleeping `gap` then a synchronize (sync) or a busy poll of the stream (poll).",
        "", f"CPUs, and the host's time stolen by its hypervisor meanwhile (/proc/stat): {cpus}.", "",
        *summary(rows), "",
        output.markdown_table(rows, [("world", "world"), ("cuda", "CUDA context"), ("wait", "wait"),
                                     ("gap_ms", "gap ms"), ("work", "work"), ("first_us", "first us"),
                                     ("first_p90_us", "first p90 us"), ("steady_us", "steady us"),
                                     ("first_over_steady", "first / steady")])])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="1,2,8", help="process counts (default 1,2,8)")
    p.add_argument("--cuda", default="auto", choices=("auto", "on", "off"),
                   help="with a CUDA context: on, off, or auto (both where there is a GPU, else off)")
    p.add_argument("--rounds", type=int, default=30, help="rounds per rank and condition (default 30)")
    p.add_argument("--tag", default=None, help="device tag in the file names (default h200, or cpu without a GPU)")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        p.error(f"--worlds: comma-separated process counts, got {args.worlds!r}")
    if min(worlds) < 1 or args.rounds < 1:
        p.error(f"--worlds and --rounds must be at least 1, got {args.worlds!r} and {args.rounds}")
    import torch

    has_gpu = torch.cuda.is_available()
    if args.cuda == "on" and not has_gpu:
        raise SystemExit("cold_host_probe --cuda on needs a CUDA GPU")
    sides = {"auto": (False, True) if has_gpu else (False,), "on": (True,), "off": (False,)}[args.cuda]
    payload = {"benchmark": NAME, "tag": args.tag or ("h200" if has_gpu else "cpu"), "rounds": args.rounds,
               "gaps_ms": list(GAPS_MS), "worlds": [], "environment": output.environment(not has_gpu),
               "mps": bool(os.path.exists("/tmp/nvidia-mps") or os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))}
    for world in worlds:
        for cuda in sides:
            print(f"world {world}, {'CUDA' if cuda else 'no CUDA'}", flush=True)
            payload["worlds"].append(run_world(world, cuda, args.rounds))
    args.tag = payload["tag"]
    return output.print_and_write(NAME, args, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
