"""Host cost of launching a fused call's replay graph from the host or from the GPU itself.

Why (issue 27): a replayed fused call's host time is mostly ``cuGraphLaunch``, which grows with
the graph's nodes (~1 us each; ~1.8 us for copies to and from host memory and stream waits).  A
graph instantiated for device launch can be launched by a kernel, which a one-node host graph
runs: the host then pays one node whatever the plan (``compass_fx/kernels/cuda/device_launch.py``).
This measures both on graphs shaped like a host-staged call (per piece: a copy to pinned host
memory and back on a side branch, a kernel on the main branch waiting for it): the host's time
of one launch with the device idle (median of 200), the device's time per call back to back, and
that the results are right when the launched graph is held 20 ms behind a sleep (the work after
the launch on the caller's stream must wait for it).  ``wait_value``: the graph also holds a stream
wait (``cuStreamWaitValue32``), which a device graph cannot.

    python benchmarks/device_graph_launch.py      # one GPU, nvcc on PATH: device_graph_launch-h200.{json,md}
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import output  # noqa: E402  (sets the no-multicast environment first)

NAME = "device_graph_launch"
SOURCE = Path(__file__).resolve().with_suffix(".cu")
MODES = ("host", "tail", "fireforget")
PIECES = (2, 8, 32)


def build(tmp: str) -> str:
    """The probe compiled (relocatable device code, linked with the device runtime)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise SystemExit("device_graph_launch needs nvcc (CUDA's compiler) on PATH")
    exe = os.path.join(tmp, "device_graph_launch")
    subprocess.run([nvcc, "-O2", "-arch=sm_90", "-rdc=true", str(SOURCE), "-o", exe, "-lcudadevrt", "-lcuda"],
                   check=True)
    return exe


def run_case(exe: str, mode: str, pieces: int, wait_value: bool) -> dict:
    proc = subprocess.run([exe, mode, str(pieces), str(int(wait_value))], capture_output=True, text=True,
                          timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    row = json.loads(lines[-1]) if lines else {"error": proc.stderr[-500:] or f"exit {proc.returncode}"}
    return dict(row, mode=mode, pieces=pieces, wait_value=int(wait_value))


def markdown(payload: dict) -> str:
    rows = payload["rows"]
    ok = [r for r in rows if "error" not in r]
    refused = [r for r in rows if "error" in r and r["mode"] != "host"]
    lines = [f"# {NAME} ({payload['tag']})", "",
             "Host microseconds of one launch of a graph shaped like a host-staged fused call (per piece: a copy to "
             "pinned host memory and back on a side branch, a kernel waiting for it on the main branch), the device "
             "idle before each launch (median of 200, and the 10th percentile); the device's microseconds per call, "
             "50 back to back; mismatches: wrong results over 6 calls, every other one with the launched graph held "
             "20 ms behind a sleep (the check runs on the caller's stream after the launch). host: cuGraphLaunch of "
             "the graph; tail / fireforget: cuGraphLaunch of a one-node graph whose kernel launches the graph "
             "(instantiated for device launch) into the tail-launch or fire-and-forget stream.", ""]
    if refused:
        lines += [f"A graph holding a stream wait (`wait_value` 1) is refused for device launch: "
                  f"{refused[0]['error']}.", ""]
    lines.append(output.markdown_table(ok, ["mode", "pieces", "wait_value", ("work_graph_nodes", "graph nodes"),
                                            ("host_launch_us_median", "host us (median)"),
                                            ("host_launch_us_p10", "host us (p10)"),
                                            ("device_us_per_call", "device us per call"), "mismatches"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = output.one_gpu_args(__doc__, argv, "device_graph_launch needs a CUDA GPU")
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(tmp)
        rows = [run_case(exe, m, p, wv) for wv in (False, True) for p in PIECES for m in MODES]
    payload = {"benchmark": NAME, "tag": args.tag, "rows": rows, "environment": output.environment(False)}
    return output.print_and_write(NAME, args, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
