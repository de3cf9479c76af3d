"""The host-staged fused operators at three and four ranks, on ONE GPU: back-to-back calls with a
late rank, every result checked.

Why: without peer access (PCIe cards, ``NCCL_P2P_DISABLE=1``) ``strategy="auto"`` runs every TP
pair through the fused operators, moving pieces through pinned host memory on the copy engines;
PCIe boxes run TP = 4 or 8, and the two-GPU machine only ever checked world 2, where the ring is
the very plan of "direct".  Here W ranks (processes in a gloo group) share one GPU and meet in
host memory, which runs the same plans on the same CUDA path, so every protocol step of a world
of 3 or 4 executes for real (the GPU timings are meaningless and are not recorded).

Every case (operator x schedule x world x shape) runs in fresh processes: ``--calls`` back-to-back
calls cycling over three input sets, the last rank sleeping up to 2 ms before one call in ten;
each output is compared with a reference every rank computes from all ranks' seeded inputs
(tolerance 2e-2 of the largest element, bf16).  A stalled case ends in the operators' watchdog
error (``COMPASS_FUSED_TIMEOUT_S``, 10 s here), recorded as the case's outcome, never a frozen
run.  "direct" is what the compiler runs without peer access (a forced ring is run as direct);
the rings are run too, to record how they behave here.

    python benchmarks/fused_host_stress.py      # one GPU: writes fused_host_stress-h200.{json,md}
"""
from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import launch, output  # noqa: E402  (sets the no-multicast environment first)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

NAME = "fused_host_stress"
TOL = 2e-2
TIMEOUT_S = "10"
# (operator, rows of the full activation per rank of the world, n, k): a gather of 512-row shards
# into a narrow and a wide GEMM, a reduce-scatter and an all-reduce
SHAPES = [("all_gather_matmul", 512, 256, 256), ("all_gather_matmul", 512, 7168, 256),
          ("matmul_reduce_scatter", 256, 512, 256), ("matmul_all_reduce", 512, 512, 256)]


def operands(kind: str, m: int, n: int, k: int, world: int, rank: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed * 100 + rank)
    rows = m // world if kind == "all_gather_matmul" else m
    a = (torch.randn(rows, k, generator=g, device="cuda") / k ** 0.25).bfloat16()
    shared = kind == "all_gather_matmul"  # the gather's weight is the same on every rank
    gw = torch.Generator(device="cuda").manual_seed(seed * 100 + 99 + (0 if shared else rank))
    b = (torch.randn(k, n, generator=gw, device="cuda") / k ** 0.25).bfloat16()
    return a, b


def reference(kind: str, m: int, n: int, k: int, world: int, rank: int, seed: int) -> torch.Tensor:
    ins = [operands(kind, m, n, k, world, r, seed) for r in range(world)]
    if kind == "all_gather_matmul":
        return torch.cat([a for a, _ in ins]).float() @ ins[0][1].float()
    total = sum(a.float() @ b.float() for a, b in ins)
    return total.chunk(world)[rank] if kind == "matmul_reduce_scatter" else total


def worker(rank: int, world: int, case: dict, calls: int, init: str, out_path: str) -> None:
    os.environ["COMPASS_FUSED_TRANSPORT"] = "host"  # the ranks share one GPU: meet in host memory
    os.environ["COMPASS_FUSED_TIMEOUT_S"] = TIMEOUT_S
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import compass_fx.kernels  # noqa: F401  (registers torch.ops.compass)

    kind, m, n, k, schedule = case["kind"], case["m"], case["n"], case["k"], case["schedule"]
    group = dist.group.WORLD.group_name
    rng = random.Random(rank)
    res: dict = {}
    try:
        sets = [operands(kind, m, n, k, world, rank, s) for s in range(3)]
        refs = [reference(kind, m, n, k, world, rank, s) for s in range(3)]
        if kind == "all_gather_matmul":
            def op(a, b):
                return torch.ops.compass.all_gather_matmul(a, [b], schedule, group, world)[1][0]
        else:
            fused = getattr(torch.ops.compass, kind)

            def op(a, b):
                return fused(a, b, schedule, group, world)
        t0, outs = time.time(), []
        for c in range(calls):
            if rank == world - 1 and rng.random() < 0.1:
                time.sleep(rng.random() * 2e-3)
            outs.append((c % 3, op(*sets[c % 3])))
        torch.cuda.synchronize()
        err = max(float((o.float() - refs[s]).abs().max() / refs[s].abs().max()) for s, o in outs)
        res.update(status="pass" if err < TOL else "FAIL", relative_error=err, seconds=round(time.time() - t0, 2))
    except Exception as e:  # noqa: BLE001 - the case's outcome (a watchdog error names op, rank, piece)
        res.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-600:])
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(res, f)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a rank of a stalled case may leave the group unusable
        pass


def run_case(case: dict, calls: int, tmp: str, index: int, deadline_s: float) -> dict:
    """One case in fresh processes; ranks still running after ``deadline_s`` (a stall whose
    streams stay blocked after the watchdog's error) are killed and the case says so."""
    t0 = time.time()
    ranks, killed = launch.fresh_ranks(worker, case["world"], (case, calls), tmp, index, deadline_s)
    statuses = {r["status"] for r in ranks}
    status = "pass" if statuses == {"pass"} else "FAIL" if "FAIL" in statuses else "error"
    row = dict(case, status=status, calls=calls, wall_s=round(time.time() - t0, 1),
               relative_error=max((r.get("relative_error", 0.0) for r in ranks), default=None))
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        row["error"] = errors[0]
    if killed:
        row["killed_ranks"] = killed  # still blocked on the GPU after the error: ended by this script
    return row


def cases(worlds: list[int]) -> list[dict]:
    out = []
    for world in worlds:
        for kind, rows, n, k in SHAPES:
            for schedule in ("direct", "ring", "double_ring"):
                out.append(dict(kind=kind, world=world, schedule=schedule, m=rows * world, n=n, k=k))
    return out


def markdown(payload: dict) -> str:
    rows = payload["rows"]
    ok = sum(r["status"] == "pass" for r in rows)
    direct = [r for r in rows if r["schedule"] == "direct"]
    lines = [f"# {NAME} ({payload['tag']})", "",
             f"W ranks sharing one GPU meet in pinned host memory (the host-staged fused operators); "
             f"{payload['calls']} back-to-back calls per case, the last rank late before one call in ten, every "
             f"result against a reference; each case in fresh processes; watchdog timeout {TIMEOUT_S} s.", "",
             f"* {ok} of {len(rows)} cases pass; schedule direct (what the compiler runs without peer access): "
             f"{sum(r['status'] == 'pass' for r in direct)} of {len(direct)}", "",
             output.markdown_table(rows, ["kind", "world", "schedule", "m", "n", "k", "status",
                                          ("relative_error", "rel. error"), ("wall_s", "wall s"), "error"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="3,4")
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--deadline", type=float, default=60.0, help="seconds a case may take before its ranks are killed")
    p.add_argument("--tag", default="h200")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fused_host_stress runs the CUDA path: it needs a GPU")
    todo = cases([int(w) for w in args.worlds.split(",")])
    rows, t0 = [], time.time()
    payload = {"benchmark": NAME, "tag": args.tag, "calls": args.calls, "environment": output.environment(False),
               "rows": rows}
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(todo):
            row = run_case(case, args.calls, tmp, i, args.deadline)
            rows.append(row)
            print(f"[{i + 1}/{len(todo)}] {case['kind']} world={case['world']} {case['schedule']} n={case['n']}: "
                  f"{row['status']}" + (f" ({row['error'][:160]})" if "error" in row else ""), flush=True)
            payload.update(seconds=round(time.time() - t0, 1), complete=i + 1 == len(todo))
            output.write_results(NAME, args.tag, payload, markdown(payload), args.out_dir)  # what is done so far
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
