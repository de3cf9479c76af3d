"""Several functional all-gathers in flight at once on a gloo group: does the process survive?

Why: CI runs of InterDecom on gloo CPU ranks died now and then with ``malloc(): unaligned tcache
chunk detected`` or a segmentation fault in a rank, in tests that had nothing else in common
than decomposed gathers.  This isolates it with no compass_fx code at all: two gloo ranks issue
``parts`` gathers of a 32 x 32 tensor's row chunks, then wait for them, ``--calls`` times, in
fresh processes for every run; a run ends clean, or with the signal that killed a rank and the
last call rank 0 reached.  Every 100 calls the gathered rows are checked.

Variants: ``_c10d_functional.all_gather_into_tensor`` (the functional op) with 1, 2 and 4 in
flight; its out variant ``all_gather_into_tensor_out``; ``dist.all_gather_into_tensor`` with
``async_op=True``; the functional reduce-scatter.  Measured with torch 2.13 (CPU build).
``--gloo-threads`` runs each variant with the gloo group's worker threads as torch makes them
(``default``: two) and with the counts given (``compass_fx.gloo_worker_threads``, the workaround).

    python benchmarks/funcol_gloo_inflight.py       # writes funcol_gloo_inflight-cpu.{json,md}
    python benchmarks/funcol_gloo_inflight.py --variants funcol:2,funcol:4 --gloo-threads default,1 \\
        --runs 4 --tag cpu-threads
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import launch, output  # noqa: E402
import torch  # noqa: E402

NAME = "funcol_gloo_inflight"
VARIANTS = (("functional all_gather", "funcol", 1), ("functional all_gather", "funcol", 2),
            ("functional all_gather", "funcol", 4), ("functional all_gather, out variant", "funcol_out", 4),
            ("c10d all_gather_into_tensor, async_op", "c10d", 4), ("functional reduce_scatter", "funcol_rs", 4))


def _issue(api: str, parts: list, world: int) -> list:
    c10d = torch.ops._c10d_functional
    if api == "funcol":
        return [c10d.wait_tensor(o) for o in [c10d.all_gather_into_tensor(p, world, "0") for p in parts]]
    if api == "funcol_out":
        outs = [torch.empty(world * p.shape[0], p.shape[1]) for p in parts]
        issued = [c10d.all_gather_into_tensor_out(p, world, "0", out=o) for p, o in zip(parts, outs)]
        return [c10d.wait_tensor(o) for o in issued]
    if api == "funcol_rs":
        return [c10d.wait_tensor(o) for o in [c10d.reduce_scatter_tensor(p, "sum", world, "0") for p in parts]]
    import torch.distributed as dist

    outs = [torch.empty(world * p.shape[0], p.shape[1]) for p in parts]
    works = [dist.all_gather_into_tensor(o, p, async_op=True) for o, p in zip(outs, parts)]
    for w in works:
        w.wait()
    return outs


def _rank(rank: int, world: int, api: str, inflight: int, calls: int, threads: int | None, init_method: str,
          out_path: str) -> None:
    """One rank of a run (``harness.launch.fresh_ranks``): every 100 calls it checks the gathered
    rows and writes how far it got to ``out_path.<rank>.progress``; its result at the end.  Its
    group runs ``threads`` gloo worker threads (None: torch's default)."""
    import contextlib
    import json

    import torch.distributed as dist

    from compass_fx import gloo_worker_threads

    with gloo_worker_threads(threads) if threads else contextlib.nullcontext():
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    x = torch.arange(32 * 32, dtype=torch.float32).view(32, 32) + 1000 * rank
    parts = list(x.chunk(inflight))
    progress = Path(f"{out_path}.{rank}.progress")
    for i in range(calls):
        outs = _issue(api, parts, world)
        if i % 100 == 0:
            if api != "funcol_rs":  # every rank's chunk, in rank order
                for p, o in zip(parts, outs):
                    want = torch.cat([p - 1000 * rank + 1000 * r for r in range(world)])
                    if not torch.equal(o, want):
                        raise RuntimeError(f"{api}: call {i} gathered wrong rows")
            progress.write_text(str(i))
    progress.write_text(str(calls))
    dist.destroy_process_group()
    Path(f"{out_path}.{rank}").write_text(json.dumps({"status": "pass"}))


def _variants(text: str) -> tuple:
    """``api:in_flight`` pairs, comma-separated, each one of :data:`VARIANTS`."""
    known = {f"{api}:{n}": (op, api, n) for op, api, n in VARIANTS}
    wanted = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in known]
    if unknown or not wanted:
        raise argparse.ArgumentTypeError(f"unknown variants {unknown or text!r}; choose from {', '.join(known)}")
    return tuple(known[v] for v in wanted)


def _threads(text: str) -> list:
    """Worker thread counts, comma-separated: ``default`` (None) or positive ints."""
    out = []
    for v in (v.strip() for v in text.split(",")):
        if v == "default":
            out.append(None)
        elif v.isdigit() and int(v) > 0:
            out.append(int(v))
        else:
            raise argparse.ArgumentTypeError(f"gloo threads: {v!r} is neither 'default' nor a positive count")
    return out


def run_once(api: str, inflight: int, calls: int, threads: int | None, deadline_s: float, tmp: str,
             index: int) -> dict:
    """One run in fresh processes: clean, or the signal that killed a rank and rank 0's last check."""
    start = time.time()
    ranks, killed = launch.fresh_ranks(_rank, 2, (api, inflight, calls, threads), tmp, index, deadline_s)
    status, reached = launch.soak_outcome(ranks, killed, str(Path(tmp, f"case{index}.0.progress")), calls, deadline_s)
    return {"status": status, "calls_reached": reached, "seconds": round(time.time() - start, 1)}


def markdown(payload: dict) -> str:
    lines = [f"# {NAME} ({payload['tag']})", "",
             f"Two gloo ranks on one machine (torch {payload['environment']['torch']}); per run: fresh processes, "
             f"up to {payload['calls']} calls, each issuing `in flight` gathers then waiting for them; "
             "`reached`: the last call rank 0 passed (checked every 100); `gloo threads`: the group's worker "
             "threads (`default`: as torch makes them, two).", "",
             output.markdown_table(payload["rows"], ["op", ("in_flight", "in flight"), ("gloo_threads", "gloo threads"),
                                                      "run", "status", ("calls_reached", "reached"), "seconds"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=10000)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--deadline", type=float, default=120.0, help="seconds a run may take before its ranks are killed")
    p.add_argument("--variants", type=_variants, default=VARIANTS,
                   help="which variants, as api:in_flight pairs (" + ", ".join(f"{a}:{n}" for _, a, n in VARIANTS)
                   + "); default all")
    p.add_argument("--gloo-threads", type=_threads, default=[None],
                   help="the groups' gloo worker threads, comma-separated: 'default' (torch's, two) or counts")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    rows, t0 = [], time.time()
    total = len(args.variants) * len(args.gloo_threads) * args.runs
    with tempfile.TemporaryDirectory(prefix="funcol_gloo_inflight-") as tmp:
        for op, api, inflight in args.variants:
            for threads in args.gloo_threads:
                for run in range(1, args.runs + 1):
                    row = {"op": op, "in_flight": inflight, "gloo_threads": threads or "default", "run": run,
                           **run_once(api, inflight, args.calls, threads, args.deadline, tmp, len(rows))}
                    print(f"[{len(rows) + 1}/{total}] {op}, {inflight} in flight, gloo threads {row['gloo_threads']}: "
                          f"{row['status']} after {row['calls_reached']} calls ({row['seconds']} s)", flush=True)
                    rows.append(row)
    payload = {"benchmark": NAME, "tag": args.tag, "environment": output.environment(False), "calls": args.calls,
               "seconds": round(time.time() - t0, 1), "rows": rows}
    return output.print_and_write(NAME, args, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
