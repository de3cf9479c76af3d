"""Does the host issue slower right after it waited for the GPU?  Fixed host work timed right after
a synchronize that followed GPU work of a given length, against the same work issued while the GPU
is busy behind it.

Why (issue 27): ``fused_host_time`` times each form's calls after the device went idle, and a
call's host time grew with the size of its GPU work although its host work does not.  If waiting
for the GPU left the host cold (caches, clocks), the first calls after a longer wait would cost more.
The forms: a fixed pure-Python loop; two output allocations of a small and of a large call
(``torch.empty``); one launch of a one-kernel CUDA graph; one small allocation.  ``gap``: the GPU
sleeps that long before the synchronize (0: no GPU work); "busy": no synchronize, the GPU sleeps
1 ms and the host issues the calls behind it; "spin": a 10 ms sleep waited for by polling an event.
Median of 30 rounds of 4 calls, one process, one GPU.

    python benchmarks/host_idle_probe.py      # one GPU: writes host_idle_probe-h200.{json,md}
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import output  # noqa: E402  (sets the no-multicast environment first)
from harness.timing import host_us_per_call, python_loop, sleep_cycles_per_ms  # noqa: E402
import torch  # noqa: E402

NAME = "host_idle_probe"
SMALL = [(256, 4096), (512, 7168)]  # the outputs of a small and a large fused call (bf16)
LARGE = [(8192, 4096), (8192, 7168)]
GAPS = ["busy", 0.0, 0.05, 0.5, 2.0, 10.0]


def forms(device: torch.device) -> dict:
    def alloc(shapes):
        return [torch.empty(s, device=device, dtype=torch.bfloat16) for s in shapes]

    x = torch.zeros(1, device=device)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)
        graph.capture_begin()
        x.add_(1)
        graph.capture_end()
    torch.cuda.synchronize()
    return {"python loop": python_loop, "outputs, small call": lambda: alloc(SMALL),
            "outputs, large call": lambda: alloc(LARGE), "one-kernel graph launch": graph.replay,
            "one small allocation": lambda: torch.empty((256, 4096), device=device)}


def time_after(fn, gap, cycles_per_ms: float, rounds: int = 30) -> float:
    per_round = []
    for _ in range(rounds):
        if gap == "busy":
            torch.cuda._sleep(int(cycles_per_ms))  # the host issues behind a busy GPU
            for _ in range(3):
                fn()
        elif gap == "spin":
            torch.cuda._sleep(int(10 * cycles_per_ms))
            event = torch.cuda.Event()
            event.record()
            while not event.query():
                pass
        else:
            if gap:
                torch.cuda._sleep(int(gap * cycles_per_ms))
            torch.cuda.synchronize()
        per_round.append(host_us_per_call(fn))
    torch.cuda.synchronize()
    return statistics.median(per_round)


def markdown(payload: dict) -> str:
    names = list(payload["rows"][0]["us"])
    rows = [dict({"gap": r["gap"]}, **r["us"]) for r in payload["rows"]]
    return "\n".join([f"# {NAME} ({payload['tag']})", "",
                      "Host microseconds per call (median of 30 rounds of 4 calls) right after the host waited for "
                      "GPU work of `gap` ms (busy: no wait, the GPU busy behind the host; spin: 10 ms waited for by "
                      "polling an event).", "",
                      output.markdown_table(rows, ["gap"] + names)])


def main(argv=None) -> int:
    args = output.one_gpu_args(__doc__, argv, "host_idle_probe needs a CUDA GPU")
    device = torch.device("cuda", 0)
    torch.cuda.init()
    cycles_per_ms = sleep_cycles_per_ms()
    fns = forms(device)
    rows = [{"gap": gap, "us": {name: time_after(fn, gap, cycles_per_ms) for name, fn in fns.items()}}
            for gap in GAPS + ["spin"]]
    payload = {"benchmark": NAME, "tag": args.tag, "rows": rows, "environment": output.environment(False)}
    return output.print_and_write(NAME, args, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
