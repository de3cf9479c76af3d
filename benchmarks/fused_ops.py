"""The fused operators on real GPUs: a stress test (back-to-back calls, a late rank, every result
checked) and their speed against NCCL + cuBLAS and PyTorch's symm_mem fused ops.

Stress: for every operator x schedule x shape (the world's grid shapes of
``compass_fx.tools.sweep`` plus a small 512-row case), ``--calls`` back-to-back calls cycling over
three input sets, with a random host delay (up to 2 ms, one call in ten) on the last rank.  Every
output is compared on the device, without synchronising, with the operator's first output for the
same inputs (must be bitwise equal: a race shows as a difference) and that first output with
NCCL + ``torch.mm`` (tolerance 2e-2 of the largest element in bf16).

Speed: per configuration, the GEMM alone, the collective alone (NCCL), sequential NCCL + cuBLAS
as compass_fx emits it (the one-pair graph ``harness.pairs.PairGraph`` compiled with
``backend="compass"``, strategy off, ``--inner`` eager by default; the row's
``sequential_compiler`` says what the compiler did with the pair: kept it), the fused operators
``torch.ops.compass.*`` with each schedule and ``torch.ops.symm_mem.fused_*`` (all-gather and
reduce-scatter kinds), both called directly.  Timing: back-to-back calls between two CUDA events
(as in a training step, where the host runs ahead of the GPU), the per-call mean of a batch, the
median of batches, the slowest rank.

    python benchmarks/fused_ops.py                 # 2 GPUs: writes fused_ops-h200x2.{json,md}
    python benchmarks/fused_ops.py --dry-run       # 2 gloo ranks on CPU (the p2p reference ops)
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import launch, output, pairs, ranks, timing  # noqa: E402  (sets the no-multicast environment first)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

NAME = "fused_ops"
TOL = 2e-2


def parse_args(argv=None) -> argparse.Namespace:
    from compass_fx.tools.sweep import DEFAULT_MODELS, DEFAULT_TOKENS
    from compass_fx.kernels.schedules import SCHEDULES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    launch.add_launch_args(p, default_worlds="2")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--kinds", default=",".join(pairs.PAIR_KINDS))
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--calls", type=int, default=None, help="stress calls per case (default 500; 6 dry run)")
    p.add_argument("--batch", type=int, default=None, help="calls per timed batch (default 20; 2 dry run)")
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--inner", default="eager", choices=("eager", "inductor"),
                   help="compiler of the sequential pair, compiled with backend='compass', strategy off "
                        "(default eager)")
    p.add_argument("--skip-stress", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--timeout-check", action="store_true",
                   help="last: the last rank skips a call; the others must report it within seconds, not hang")
    args = p.parse_args(argv)
    args.calls = args.calls or (6 if args.dry_run else 500)
    args.batch = args.batch or (2 if args.dry_run else 20)
    if args.dry_run:
        args.batches = 2
    return args


def shapes(args, world: int) -> list[dict]:
    from compass_fx.tools.sweep import grid_workload

    scale = 64 if args.dry_run else 1
    out = []
    for kind in args.kinds.split(","):
        out.append({"model": "small", "kind": kind, "tokens": 512, "m": 512, "n": 1024, "k": 1024})
        for model in args.models.split(","):
            for tokens in map(int, args.tokens.split(",")):
                w = grid_workload(kind, model, tokens, world)
                out.append({"model": model, "kind": kind, "tokens": tokens,
                            "m": w.m // scale, "n": w.n // scale, "k": w.k // scale})
    if args.dry_run:
        for s in out:
            s.update(m=max(s["m"] // 8, 4 * world), n=max(s["n"] // 16, 8), k=max(s["k"] // 16, 8))
    return out


def transport() -> str:
    from compass_fx.kernels.cuda.impl import transport as chosen

    return chosen()


def fused(kind: str, schedule: str, world: int, group: str):
    """``torch.ops.compass.<kind>`` with ``schedule``, called directly."""
    return pairs.strategy_fn(kind, f"fuse({schedule})", world, group)


def stress_case(ctx: ranks.Ctx, args, s: dict, schedule: str, dtype) -> dict:
    kind, m, n, k = s["kind"], s["m"], s["n"], s["k"]
    rng = random.Random(1234 + ctx.rank)
    sets = [pairs.pair_operands(kind, m, n, k, ctx.world, ctx.rank, dtype, ctx.device, seed=i) for i in range(3)]
    ref_fn = pairs.PairGraph(kind, ctx.world, ctx.group_name)  # uncompiled: functional collective + torch.mm
    op = fused(kind, schedule, ctx.world, ctx.group_name)
    refs = [ref_fn(a, b) for a, b in sets]
    firsts = [op(a, b) for a, b in sets]
    rel = max(float(((f.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-12)).item())
              for f, r in zip(firsts, refs))
    diff = torch.zeros((), dtype=torch.int64, device=ctx.device)
    late = ctx.rank == ctx.world - 1
    t0 = time.time()
    for i in range(args.calls):
        if late and rng.random() < 0.1:
            time.sleep(rng.uniform(0, 2e-3))
        a, b = sets[i % 3]
        diff += (op(a, b) != firsts[i % 3]).sum()
    ranks.synchronize(ctx)
    seconds = time.time() - t0
    differing = int(ranks.max_over_ranks(ctx, float(diff.item())))
    rel = ranks.max_over_ranks(ctx, rel)
    return {"kind": kind, "schedule": schedule, "model": s["model"], "tokens": s["tokens"], "m": m, "n": n, "k": k,
            "calls": args.calls, "seconds": round(seconds, 2), "max_rel_error_vs_nccl": rel,
            "elements_differing_between_calls": differing, "ok": rel <= TOL and differing == 0}


def speed_case(ctx: ranks.Ctx, args, s: dict, dtype) -> dict:
    kind, m, n, k = s["kind"], s["m"], s["n"], s["k"]
    a, b = pairs.pair_operands(kind, m, n, k, ctx.world, ctx.rank, dtype, ctx.device, seed=0)
    t = {}
    with torch.no_grad():
        t["gemm"] = timing.time_back_to_back(ctx, pairs.gemm_only_fn(kind, a, b, ctx.world), args.batch, args.batches)
        t["comm"] = timing.time_back_to_back(ctx, pairs.comm_only_fn(kind, a, b, ctx.world, ctx.group_name), args.batch,
                                      args.batches)
        seq, outcomes = pairs.lowered_fn(kind, "sequential", ctx.world, ctx.group_name, args.inner)
        t["sequential"] = timing.time_back_to_back(ctx, lambda: seq(a, b), args.batch, args.batches)
        compiler = outcomes()
        if pairs.not_applied("sequential", compiler):  # the pair is not what was meant to be timed
            raise RuntimeError(pairs.not_applied("sequential", compiler))
        for schedule in args.schedules.split(","):
            op = fused(kind, schedule, ctx.world, ctx.group_name)
            t[f"fuse({schedule})"] = timing.time_back_to_back(ctx, lambda: op(a, b), args.batch, args.batches)
        if kind != "matmul_all_reduce" and ctx.is_cuda and transport() == "peer":  # symm_mem needs peer access
            sm = pairs.strategy_fn(kind, "symm_mem", ctx.world, ctx.group_name)
            t["symm_mem"] = timing.time_back_to_back(ctx, lambda: sm(a, b), args.batch, args.batches)
        if s["model"] == "small" and ctx.is_cuda:  # the fixed overhead, without the host's launch cost
            t["sequential, device only"] = timing.time_back_to_back(ctx, lambda: seq(a, b), args.batch, args.batches, True)
            op = fused(kind, "direct", ctx.world, ctx.group_name)
            t["fuse(direct), device only"] = timing.time_back_to_back(ctx, lambda: op(a, b), args.batch, args.batches, True)
    fused_times = {lbl: v for lbl, v in t.items() if lbl.startswith("fuse(") and "only" not in lbl}
    best = min(fused_times, key=fused_times.get)
    row = dict(s, times_s=t, sequential_compiler=compiler, best_fused=best, best_fused_s=fused_times[best],
               comm_fraction=t["comm"] / (t["comm"] + t["gemm"]),
               overlap_efficiency=max(t["gemm"], t["comm"]) / fused_times[best],
               speedup_vs_sequential=t["sequential"] / fused_times[best],
               overhead_s=fused_times[best] - max(t["gemm"], t["comm"]))
    if "fuse(direct), device only" in t:
        row["device_overhead_s"] = t["fuse(direct), device only"] - max(t["gemm"], t["comm"])
    if "symm_mem" in t:
        row["speedup_vs_symm_mem"] = t["symm_mem"] / fused_times[best]
    a = b = None
    if ctx.is_cuda:
        torch.cuda.empty_cache()
    return row


def timeout_check(ctx: ranks.Ctx, dtype) -> dict:
    """The last rank stops calling the operator; rank 0's next call must come back (the watchdog
    releases the wait after 3 s) and the call after it must raise a RuntimeError naming the wait."""
    from compass_fx.kernels.cuda import watchdog

    a, b = pairs.pair_operands("all_gather_matmul", 256 * ctx.world, 512, 512, ctx.world, ctx.rank, dtype,
                            ctx.device, seed=5)
    op = fused("all_gather_matmul", "direct", ctx.world, ctx.group_name)
    dog = watchdog.for_device(ctx.device.index)
    dog.timeout = 3.0
    op(a, b)
    ranks.synchronize(ctx)
    dist.barrier()
    result = {"released_after_s": None, "error": None}
    if ctx.rank != ctx.world - 1:
        t0 = time.time()
        op(a, b)  # the last rank never makes this call
        ranks.synchronize(ctx)
        result["released_after_s"] = round(time.time() - t0, 1)
        try:
            op(a, b)
        except RuntimeError as e:
            result["error"] = str(e)
    else:
        time.sleep(8)
    dist.barrier()
    return result


def worker(ctx: ranks.Ctx, args) -> dict:
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    cases = shapes(args, ctx.world)
    out = {"world": ctx.world, "stress": [], "speed": []}
    if not args.skip_stress:
        schedules = args.schedules.split(",")
        progress = output.Progress(ctx, len(cases) * len(schedules), f"stress w{ctx.world}")
        for s in cases:
            for schedule in schedules:
                row = stress_case(ctx, args, s, schedule, dtype)
                out["stress"].append(row)
                progress.step(f"{s['kind']} {schedule} {s['model']} {s['tokens']}: "
                              f"{'ok' if row['ok'] else 'FAILED'} (rel err {row['max_rel_error_vs_nccl']:.2e}, "
                              f"{row['elements_differing_between_calls']} differing, {row['seconds']} s)")
    if not args.skip_speed:
        progress = output.Progress(ctx, len(cases), f"speed w{ctx.world}")
        for s in cases:
            row = speed_case(ctx, args, s, dtype)
            out["speed"].append(row)
            progress.step(f"{s['kind']} {s['model']} {s['tokens']}: " + ", ".join(
                f"{lbl} {v * 1e3:.3f}" for lbl, v in row["times_s"].items()) + " ms")
    if args.timeout_check and ctx.is_cuda:
        out["timeout_check"] = timeout_check(ctx, dtype)
        ctx.log(f"timeout check: {out['timeout_check']}")
    return out


def summarize(stress: list[dict], speed: list[dict]) -> dict:
    big = [r for r in speed if r["model"] != "small" and r["tokens"] >= 4096]
    agrs = [r for r in big if r["kind"] != "matmul_all_reduce"]
    ars = [r for r in big if r["kind"] == "matmul_all_reduce"]
    heavy = [r for r in agrs if r["comm_fraction"] >= 0.25]
    symm = [r["speedup_vs_symm_mem"] for r in speed if "speedup_vs_symm_mem" in r and r["model"] != "small"]
    small = [r for r in speed if r["model"] == "small"]
    at2048 = [r for r in speed if r["tokens"] == 2048]

    def lo(xs):
        return min(xs) if xs else None

    out = {
        "stress_cases": len(stress), "stress_failures": [r for r in stress if not r["ok"]],
        "stress_calls": sum(r["calls"] for r in stress),
        "efficiency_min_ag_rs_tokens_ge_4096": lo([r["overlap_efficiency"] for r in agrs]),
        "speedup_vs_sequential_min_where_comm_ge_quarter": lo([r["speedup_vs_sequential"] for r in heavy]),
        "comm_heavy_cases": len(heavy),
        "speedup_vs_symm_mem_min": lo(symm),
        "speedup_vs_symm_mem_median": statistics.median(symm) if symm else None,
        "all_reduce_speedup_min_where_comm_ge_quarter": lo([r["speedup_vs_sequential"] for r in ars
                                                             if r["comm_fraction"] >= 0.25]),
        "all_reduce_efficiency_min_elsewhere": lo([r["overlap_efficiency"] for r in ars if r["comm_fraction"] < 0.25]),
        "vs_sequential_min_at_2048_tokens": lo([r["speedup_vs_sequential"] for r in at2048]),
        "fixed_overhead_s_small_shape_max": max((r["overhead_s"] for r in small), default=None),
        "fixed_device_overhead_s_small_shape_max": max((r["device_overhead_s"] for r in small
                                                        if "device_overhead_s" in r), default=None),
    }
    out["goals"] = {
        "stress clean": not out["stress_failures"] if stress else None,
        "efficiency >= 0.85 (AG/RS, tokens >= 4096)": _ge(out["efficiency_min_ag_rs_tokens_ge_4096"], 0.85),
        ">= 1.20x over sequential where comm >= 1/4": _ge(out["speedup_vs_sequential_min_where_comm_ge_quarter"], 1.2),
        "never slower than symm_mem": _ge(out["speedup_vs_symm_mem_min"], 1.0),
        "median >= 1.10x over symm_mem": _ge(out["speedup_vs_symm_mem_median"], 1.1),
        "all-reduce >= 1.15x where comm >= 1/4": _ge(out["all_reduce_speedup_min_where_comm_ge_quarter"], 1.15),
        "all-reduce efficiency >= 0.85 elsewhere": _ge(out["all_reduce_efficiency_min_elsewhere"], 0.85),
        "2048 tokens: >= 0.98x of sequential": _ge(out["vs_sequential_min_at_2048_tokens"], 0.98),
        "fixed overhead <= 20 us (device time)": None if out["fixed_device_overhead_s_small_shape_max"] is None
        else out["fixed_device_overhead_s_small_shape_max"] <= 20e-6,
    }
    return out


def _ge(x, bound):
    return None if x is None else x >= bound


def markdown(tag: str, args, summary: dict, stress: list[dict], speed: list[dict]) -> str:
    lines = [f"# Fused operators ({tag}{', dry run on CPU: times are meaningless' if args.dry_run else ''})", "",
             f"Transport of the fused operators: {transport()} ('host': through pinned host memory, as on GPUs "
             "without peer access; PyTorch's symm_mem ops need peer access and are then not measured).", "",
             "Timing: back-to-back calls between CUDA events, per-call mean of a batch of "
             f"{args.batch}, median of {args.batches} batches, slowest rank.", "", "## Summary", ""]
    for key, value in summary.items():
        if key not in ("goals", "stress_failures"):
            lines.append(f"* {key}: {output.fmt(value)}")
    lines.append(f"* stress failures: {len(summary['stress_failures'])}")
    for goal, ok in summary["goals"].items():
        verdict = "not judged on a dry run" if args.dry_run else ("-" if ok is None else ("met" if ok else "NOT met"))
        lines.append(f"* goal {goal}: {verdict}")
    rows = []
    for r in speed:
        row = {k: v for k, v in r.items() if k != "times_s"}
        for lbl, v in r["times_s"].items():
            row[lbl] = v * 1e3
        rows.append(row)
    labels = list(speed[0]["times_s"]) if speed else []
    lines += ["", "## Speed (ms)", "", output.markdown_table(rows, ["model", "kind", "tokens", "m", "n", "k", *labels,
                                                              "best_fused", "speedup_vs_sequential",
                                                              "speedup_vs_symm_mem", "overlap_efficiency",
                                                              "comm_fraction"])]
    lines += ["", "## Stress", "", output.markdown_table(stress, ["kind", "schedule", "model", "tokens", "calls", "ok",
                                                              "max_rel_error_vs_nccl",
                                                              "elements_differing_between_calls", "seconds"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    launched = launch.launch(worker, args, launch.parse_worlds(args.worlds, args.dry_run))
    if launched is None:
        return 0
    results, tag, t0 = launched
    stress, speed = launch.gathered(results, "stress"), launch.gathered(results, "speed")
    summary = summarize(stress, speed)
    payload = {"benchmark": NAME, "argv": sys.argv[1:] if argv is None else list(argv),
               "environment": output.environment(args.dry_run), "worlds": [w for w, _ in results], "summary": summary,
               "seconds": round(time.time() - t0, 1), "stress": stress, "speed": speed,
               "timeout_check": {w: res.get("timeout_check") for w, res in results}}
    text = markdown(tag, args, summary, stress, speed)
    print(text)
    output.write_results(NAME, tag, payload, text, args.out_dir)
    return 1 if summary["stress_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
