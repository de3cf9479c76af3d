"""What slows the host's issue of a fused call down while the GPU works: fixed host work timed
beside different GPU work and beside a CPU neighbour, in one process on one GPU.

Why (issue 27): in ``fused_host_time`` a replayed call's allocations and its one-node graph
launch cost 2-3x more for a large call than for a small one, although the host's work is the same,
and ``host_idle_probe`` ruled out a host gone cold after waiting.  Candidates: the GPU's copies to
and from pinned host memory (host-staged transport moves ~50 GB/s each way through the host's
memory and its PCIe root, which the driver's doorbell writes cross too), the GPU's own memory
traffic (a GEMM), the GPU merely being busy (a sleeping kernel), or a second process spinning on
the other hardware thread of the same core (the peer rank waiting in ``torch.cuda.synchronize``).

Forms (median of 30 rounds of 4 calls): a fixed pure-Python loop; the two output allocations of a
large call (``torch.empty``); one launch of a one-kernel CUDA graph; one launch of a graph of 8
copies of 1 MiB to pinned host memory (the copy-engine nodes of a host-staged replay graph).
Backgrounds, started right before each round's calls and lasting longer than them: none (the GPU
idle), a 3 ms sleeping kernel, 5 GEMMs of 8192 x 4096 x 7168 (bf16, ~3 ms), 64 MiB each way
between device and pinned host memory twice (~2.6 ms), and a spinning process pinned to the
other hardware thread of this process's core, or to another core (the GPU idle), and another
process's GEMMs and host copies, without end (under MPS, as the ranks of ``fused_host_time``
share the GPU; else time-sliced).  This process is pinned to one CPU; ``--label`` names the run's
setting in the markdown (say "under MPS").

    python benchmarks/host_contention_probe.py      # one GPU: writes host_contention_probe-h200.{json,md}
"""
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import output  # noqa: E402  (sets the no-multicast environment first)
from harness.timing import host_us_per_call, python_loop, sleep_cycles_per_ms  # noqa: E402
from harness.ranks import physical_cores  # noqa: E402
import torch  # noqa: E402

NAME = "host_contention_probe"
LARGE = [(8192, 4096), (8192, 7168)]  # the outputs of a large fused call (bf16)
COPY_MIB = 64


def _spin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


def _gpu_load(cpu: int) -> None:
    """Another process's GPU work, until killed: GEMMs on one stream, copies to and from pinned
    host memory on two others (under MPS it shares the GPU with the timing process)."""
    os.sched_setaffinity(0, {cpu})
    device = torch.device("cuda", 0)
    a = torch.randn(8192, 4096, device=device, dtype=torch.bfloat16)
    b = torch.randn(4096, 7168, device=device, dtype=torch.bfloat16)
    dev = [torch.zeros(COPY_MIB << 19, device=device, dtype=torch.bfloat16) for _ in range(2)]
    host = [torch.zeros(COPY_MIB << 19, dtype=torch.bfloat16).pin_memory() for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(3)]
    while True:
        with torch.cuda.stream(streams[0]):
            for _ in range(4):
                torch.mm(a, b)
        with torch.cuda.stream(streams[1]):
            host[0].copy_(dev[0], non_blocking=True)
        with torch.cuda.stream(streams[2]):
            dev[1].copy_(host[1], non_blocking=True)
        torch.cuda.synchronize()


def forms(device: torch.device) -> dict:
    from compass_fx.kernels.cuda import driver
    from compass_fx.kernels.cuda.replay import Captured

    x = torch.zeros(1, device=device)
    src = torch.zeros(8, 1 << 19, device=device, dtype=torch.bfloat16)
    dst = torch.zeros(8, 1 << 19, dtype=torch.bfloat16).pin_memory()
    stream = torch.cuda.Stream()
    graphs = {}
    for name, body in (("kernel", lambda: x.add_(1)),
                       ("copies", lambda: [dst[i].copy_(src[i], non_blocking=True) for i in range(8)])):
        with torch.cuda.stream(stream):
            body()
            g = torch.cuda.CUDAGraph()
            g.capture_begin()
            body()
            g.capture_end()
        graphs[name] = Captured(g)
    torch.cuda.synchronize()
    handle = torch.cuda.current_stream().cuda_stream
    driver.raw("graph_launch")  # loaded before timing
    return {"python loop": python_loop,
            "outputs, large call": lambda: [torch.empty(s, device=device, dtype=torch.bfloat16) for s in LARGE],
            "one-kernel graph launch": lambda: graphs["kernel"].launch(handle),
            "8-copy graph launch": lambda: graphs["copies"].launch(handle),
            "_keep": (src, dst, graphs)}


class Backgrounds:
    """GPU work queued on other streams right before a round's calls."""

    def __init__(self, device: torch.device, cycles_per_ms: float) -> None:
        self.cycles_per_ms = cycles_per_ms
        self.streams = [torch.cuda.Stream() for _ in range(2)]
        self.a = torch.randn(8192, 4096, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(4096, 7168, device=device, dtype=torch.bfloat16)
        n = COPY_MIB << 19  # bf16 elements
        self.dev = [torch.zeros(n, device=device, dtype=torch.bfloat16) for _ in range(2)]
        self.host = [torch.zeros(n, dtype=torch.bfloat16).pin_memory() for _ in range(2)]

    def start(self, kind: str) -> None:
        if kind == "sleep":
            with torch.cuda.stream(self.streams[0]):
                torch.cuda._sleep(int(3 * self.cycles_per_ms))
        elif kind == "gemm":
            with torch.cuda.stream(self.streams[0]):
                for _ in range(5):
                    torch.mm(self.a, self.b)
        elif kind == "host copies":
            for _ in range(2):
                with torch.cuda.stream(self.streams[0]):
                    self.host[0].copy_(self.dev[0], non_blocking=True)
                with torch.cuda.stream(self.streams[1]):
                    self.dev[1].copy_(self.host[1], non_blocking=True)


def time_beside(fn, start, rounds: int = 30) -> float:
    per_round = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start()
        per_round.append(host_us_per_call(fn))
    torch.cuda.synchronize()
    return statistics.median(per_round)


def background_ms(bg: Backgrounds, kind: str) -> float:
    """How long a background keeps the GPU busy (ms), measured once."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    bg.start(kind)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def markdown(payload: dict) -> str:
    names = [n for n in payload["rows"][0]["us"]]
    rows = [dict({"background": r["background"], "lasts ms": r.get("ms")}, **r["us"]) for r in payload["rows"]]
    return "\n".join([f"# {NAME} ({payload['tag']})", "",
                      (payload.get("label") + ". " if payload.get("label") else "") +
                      f"This process pinned to CPU {payload['cpu']} (physical cores: {payload['cores']}). Host "
                      "microseconds per call (median of 30 rounds of 4 calls) issued right after the background "
                      "was started (the GPU idle before it).", "",
                      output.markdown_table(rows, ["background", "lasts ms"] + names)])


def main(argv=None) -> int:
    import argparse

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--label", default="")  # the run's setting, named in the markdown
    known, rest = own.parse_known_args(argv)
    label = known.label
    args = output.one_gpu_args(__doc__, rest, "host_contention_probe needs a CUDA GPU")
    cores = physical_cores()
    mine = cores[1] if len(cores) > 2 else cores[0]
    os.sched_setaffinity(0, {mine[0]})
    device = torch.device("cuda", 0)
    torch.cuda.init()
    cycles_per_ms = sleep_cycles_per_ms()
    fns = forms(device)
    keep = fns.pop("_keep")
    bg = Backgrounds(device, cycles_per_ms)
    rows = []
    for kind in ("none", "sleep", "gemm", "host copies"):
        ms = background_ms(bg, kind) if kind != "none" else 0.0
        rows.append({"background": kind, "ms": ms,
                     "us": {name: time_beside(fn, lambda: bg.start(kind)) for name, fn in fns.items()}})
    neighbours = {"spinner, same core": (_spin, mine[1] if len(mine) > 1 else None),
                  "spinner, other core": (_spin, cores[-1][0] if len(cores) > 2 else None),
                  "another process's GEMMs and host copies": (_gpu_load, cores[-1][0] if len(cores) > 2 else None)}
    ctx = mp.get_context("spawn")
    for name, (target, cpu) in neighbours.items():
        if cpu is None:
            rows.append({"background": name + " (none: no such CPU)", "us": {}})
            continue
        spinner = ctx.Process(target=target, args=(cpu,), daemon=True)
        spinner.start()
        time.sleep(0.5 if target is _spin else 8.0)  # the GPU load's process starts CUDA first
        try:
            rows.append({"background": f"{name} (CPU {cpu})",
                         "us": {name: time_beside(fn, lambda: None) for name, fn in fns.items()}})
        finally:
            spinner.kill()
            spinner.join()
    del keep
    payload = {"benchmark": NAME, "tag": args.tag, "label": label, "cpu": mine[0], "cores": cores, "rows": rows,
               "environment": output.environment(False)}
    return output.print_and_write(NAME, args, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
