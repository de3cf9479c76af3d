"""Decomposed gathers on gloo, as the backend lowers them, called many times: does a rank survive?

Why: torch 2.13's functional ``all_gather_into_tensor`` on gloo corrupts the heap now and then:
two in flight at once killed a rank within a few thousand calls (``funcol_gloo_inflight.py``, no
compass_fx code), and an InterDecom pipeline issues part i+1's gather before part i's wait.  So on
gloo the lowering gathers each part with ``compass::all_gather_blocking`` (c10d's blocking gather,
``lowering/blocking_gather.py``).  This soak compiles an all-gather -> matmul pair with
``backend="compass"`` split into 2, 3 and 4 parts, under Inductor and under the eager inner
compiler, on two gloo ranks in fresh processes, calls each thousands of times and checks the result
against an uncompiled reference every 100 calls.  ``--functional`` runs the form NCCL gets
(functional gathers in flight while the previous part is multiplied) on gloo instead, to show what
the blocking form avoids.

    python benchmarks/gloo_gather_soak.py                  # writes gloo_gather_soak-cpu.{json,md}
    python benchmarks/gloo_gather_soak.py --functional     # writes gloo_gather_soak-cpu-functional.*
    python benchmarks/gloo_gather_soak.py --functional --gloo-threads 1 --tag cpu-functional-threads1

``--gloo-threads N`` makes the ranks' group with N gloo worker threads (``compass_fx.gloo_worker_threads``;
torch starts two): whether the functional form survives on a group of one thread.  On such a group
the lowering itself emits the functional form (``decompose.gathers_blocking``), so there
``--functional`` changes nothing.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import launch, output  # noqa: E402

NAME = "gloo_gather_soak"
ROWS, COLS, OUT_COLS = 48, 32, 16   # each rank's shard [48, 32] (divisible by 2, 3 and 4 parts)


def _rank(rank: int, world: int, parts: int, inner: str, calls: int, functional: bool, threads: int | None,
          init_method: str, out_path: str) -> None:
    """One rank: compile the pair, call it ``calls`` times, check every 100th call; progress in
    ``out_path.<rank>.progress``, the result (with what the compiled graphs hold) at the end."""
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import contextlib

    from compass_fx import gloo_worker_threads

    with gloo_worker_threads(threads) if threads else contextlib.nullcontext():
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    import compass_fx.backend
    import compass_fx.lowering.decompose as decompose

    if functional:  # the form NCCL gets: functional gathers, part i+1's issued before part i's wait
        decompose.gathers_blocking = lambda pair: False
    group = dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional
    weight = torch.randn(COLS, OUT_COLS, generator=torch.Generator().manual_seed(1))

    def gather_mm(x: torch.Tensor) -> torch.Tensor:
        return c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, group)) @ weight

    x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(100 + rank))
    before = len(compass_fx.backend.history)
    compiled = torch.compile(gather_mm, backend="compass", options={"chunks": parts, "inner": inner})
    progress = Path(f"{out_path}.{rank}.progress")
    with torch.no_grad():
        want = gather_mm(x)
        t0 = time.time()
        for i in range(calls):
            got = compiled(x)
            if i % 100 == 0:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                progress.write_text(str(i))
        seconds = time.time() - t0
    reports = list(compass_fx.backend.history)[before:]
    gathers = sum(r.collectives_after for r in reports)
    progress.write_text(str(calls))
    dist.destroy_process_group()
    Path(f"{out_path}.{rank}").write_text(json.dumps({"status": "pass", "gathers_per_call": gathers,
                                                      "us_per_call": round(seconds / calls * 1e6, 1)}))


def run_case(parts: int, inner: str, calls: int, functional: bool, deadline_s: float, tmp: str, index: int,
             threads: int | None = None) -> dict:
    """One case in fresh processes: clean (every rank passed every check), or why not."""
    start = time.time()
    ranks, killed = launch.fresh_ranks(_rank, 2, (parts, inner, calls, functional, threads), tmp, index, deadline_s)
    status, reached = launch.soak_outcome(ranks, killed, str(Path(tmp, f"case{index}.0.progress")), calls, deadline_s)
    per_call = ranks[0].get("gathers_per_call")
    return {"status": status, "calls_reached": reached, "gathers_per_call": per_call,
            "gathers": reached * per_call if per_call else None, "us_per_call": ranks[0].get("us_per_call"),
            "seconds": round(time.time() - start, 1)}


def markdown(payload: dict) -> str:
    form = ("functional gathers in flight, as NCCL gets them (`--functional`: what the blocking form replaces)"
            if payload["functional"] else
            "functional gathers in flight, as the lowering emits them on a gloo group of one worker thread"
            if payload.get("gloo_threads") == 1 else
            "each part gathered by `compass::all_gather_blocking` (the lowering on gloo with torch's two threads)")
    lines = [f"# {NAME} ({payload['tag']})", "",
             f"Two gloo ranks (torch {payload['environment']['torch']}), fresh processes per case: an all-gather -> "
             f"matmul pair compiled with `backend=\"compass\"` into `parts` parts, {form}; gloo worker threads: "
             f"{payload.get('gloo_threads') or 'as torch makes them (two)'}; up to "
             f"{payload['calls']} calls per case, every 100th checked against the uncompiled pair.", "",
             f"**{payload['gathers_clean']} decomposed gathers in clean cases, {payload['crashed']} case(s) crashed.**",
             "", output.markdown_table(payload["rows"], ["parts", "inner", "status", ("calls_reached", "calls"),
                                                          ("gathers", "gathers run"), ("us_per_call", "us/call"),
                                                          "seconds"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3000, help="calls per case")
    p.add_argument("--parts", default="2,3,4")
    p.add_argument("--inner", default="inductor,eager")
    p.add_argument("--functional", action="store_true",
                   help="functional gathers in flight, as on NCCL (what the lowering no longer emits on gloo)")
    p.add_argument("--gloo-threads", type=int, default=None,
                   help="the ranks' gloo worker threads (default: torch's, two)")
    p.add_argument("--deadline", type=float, default=600.0, help="seconds a case may take before its ranks are killed")
    p.add_argument("--tag", default=None, help="file name tag (default: cpu, or cpu-functional)")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    if args.gloo_threads is not None and args.gloo_threads < 1:
        p.error("--gloo-threads must be a positive count")
    args.tag = args.tag or ("cpu-functional" if args.functional else "cpu")
    cases = [(int(n), inner) for inner in args.inner.split(",") for n in args.parts.split(",")]
    rows, t0 = [], time.time()
    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as tmp:
        for parts, inner in cases:
            row = {"parts": parts, "inner": inner,
                   **run_case(parts, inner, args.calls, args.functional, args.deadline, tmp, len(rows),
                            args.gloo_threads)}
            print(f"[{len(rows) + 1}/{len(cases)}] {parts} parts, {inner}: {row['status']} after "
                  f"{row['calls_reached']} calls ({row['gathers']} gathers, {row['seconds']} s)", flush=True)
            rows.append(row)
    payload = {"benchmark": NAME, "tag": args.tag, "environment": output.environment(False), "calls": args.calls,
               "functional": args.functional, "gloo_threads": args.gloo_threads, "seconds": round(time.time() - t0, 1), "rows": rows,
               "gathers_clean": sum(r["gathers"] or 0 for r in rows if r["status"] == "clean"),
               "crashed": sum(1 for r in rows if r["status"] != "clean")}
    return output.print_and_write(NAME, args, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
