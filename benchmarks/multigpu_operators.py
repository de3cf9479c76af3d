"""Operator-level evaluation over the paper's 288-configuration grid, restricted to the machine at
hand: the topology is the detected one (``Topology.detect()``, recorded in the JSON), the group
size is the world size of each launch, and the grid of ``compass_fx.tools.sweep`` (pair kinds x
token counts x group sizes x Llama-3 8B/70B widths) supplies the shapes.

For every configuration every candidate is measured — sequential, InterDecom(d) for each feasible
d in {2, 4, ..., 64} and the cost model's d, IntraFusion with each fused schedule this device has —
each as compass_fx's own rewrite emits it: the one-pair graph ``harness.pairs.PairGraph``
(functional collective + wait + mm) compiled with ``backend="compass"`` and the strategy forced
(strategy off for sequential), ``--inner`` compiling the rewritten graph (default eager: the parts
launch as the rewrite emits them).  Each candidate's ``compiler`` entry in the JSON says what the
compiler did with the pair; a strategy it did not apply is recorded as that candidate's error and
is not timed (never a sequential pair timed under another name).  Besides: PyTorch's own
``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter`` called directly,
as a baseline column, the GEMM alone and the collective alone.
Reported: the cost model's pick, the best measured candidate, the hit rate (pick within 3% of the
best; goal >= 95%), the worst regression of the pick against sequential (goal <= 2%), the model's
prediction error, speedup over symm_mem (goal >= 1.1x) and over sequential where communication is
at least a third of the time (goal >= 1.3x), and the overlap efficiency
max(GEMM alone, collective alone) / time of the pick (goal >= 0.9 on large shapes).

    python benchmarks/multigpu_operators.py                      # worlds 2, 4, 8 (as many as there are GPUs)
    python benchmarks/multigpu_operators.py --worlds 8 --models llama3-8b
    torchrun --nproc-per-node 8 benchmarks/multigpu_operators.py
    python benchmarks/multigpu_operators.py --dry-run            # 2 gloo ranks, shapes / 64, fp32

Timing (``--timing interleaved``, the default): every candidate is compiled and warmed up, then
``--rounds`` rounds each time one batch of ``--repeats`` back-to-back calls of every candidate (the
host running ahead of the GPU, as in a training step), in an order rotated by one each round so
that no candidate always follows the same one; per candidate the median over rounds of the mean
per call, the slowest rank's.  Candidates measured side by side this way see the same machine
(clocks, host load), which candidates measured one after another did not: at two ranks the ring and
"direct" fused operators run identical plans and still differed by up to 40% in the earlier runs.
At two ranks the ring is therefore measured once, as "direct" (``distinct_schedules``).  The JSON
keeps each candidate's spread (interquartile range over rounds / median).
``--timing barrier``: each call alone after a barrier, median of ``--repeats`` after ``--warmup``
calls: a call's host issue time is exposed (the fused operators' 0.1-0.7 ms of Python shows at
small shapes).  ``--timing back-to-back``: each candidate's batches one after another, median of 3.
Dry run: wall clock.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from itertools import product

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import launch, output, pairs, ranks, timing  # noqa: E402  (sets the no-multicast environment first)
import torch  # noqa: E402
from compass_fx.cost.decision import strategy_label  # noqa: E402

NAME = "multigpu_operators"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DECOMPOSE_DS = (2, 4, 8, 16, 32, 64)
HIT_MARGIN = 1.03
LARGE_TOKENS = 8192  # grid token counts (before --scale) taken as large enough to hide one part's fill and drain


def parse_args(argv=None) -> argparse.Namespace:
    from compass_fx.tools.sweep import DEFAULT_MODELS, DEFAULT_TOKENS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    launch.add_launch_args(p)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bfloat16 (float32 with --dry-run)")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--kinds", default=",".join(pairs.PAIR_KINDS))
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)))
    p.add_argument("--scale", type=int, default=None,
                   help="divide m, n and k of every configuration by this (default 1; 64 with --dry-run)")
    p.add_argument("--decompose-ds", default=",".join(map(str, DECOMPOSE_DS)),
                   help="InterDecom part counts measured (where feasible), besides the cost model's")
    p.add_argument("--warmup", type=int, default=None, help="default 5 (1 with --dry-run)")
    p.add_argument("--repeats", type=int, default=None, help="default 25 (2 with --dry-run)")
    p.add_argument("--no-symm-mem", action="store_true", help="leave out PyTorch's symm_mem fused ops")
    p.add_argument("--timing", default="interleaved", choices=("interleaved", "barrier", "back-to-back"),
                   help="interleaved (default): rounds of back-to-back batches, one batch of every candidate "
                        "per round; barrier: each call alone after a barrier; back-to-back: each candidate's "
                        "batches one after another")
    p.add_argument("--rounds", type=int, default=None, help="rounds of --timing interleaved (default 7; 2 dry run)")
    p.add_argument("--pick-fused", default="auto", choices=("auto", "all"),
                   help="auto (default): the model's pick prices the fused operators only where strategy='auto' "
                        "does by default (no peer access); all: everywhere (as auto_fuse=True)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="capture every candidate (and the GEMM, collective and symm_mem baselines) in a CUDA graph "
                        "and time its replays; the model prices the pairs as replays (Workload.cuda_graphs).  The "
                        "fused operators need COMPASS_FUSED_GRAPHS=1")
    p.add_argument("--inner", default="eager", choices=("eager", "inductor"),
                   help="compiler of the rewritten one-pair graphs (default eager: one pair has nothing for "
                        "Inductor to fuse, and the decomposed parts run as the rewrite emits them)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.dry_run else "bfloat16")
    args.scale = args.scale or (64 if args.dry_run else 1)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 5)
    args.repeats = args.repeats or (2 if args.dry_run else 25)
    args.rounds = args.rounds or (2 if args.dry_run else 7)
    if args.cuda_graphs:  # the fused calls' twin workspaces (read when the ranks import compass_fx)
        os.environ.setdefault("COMPASS_FUSED_GRAPHS", "1")
    return args


def feasible(kind: str, m: int, world: int, parts: int) -> bool:
    if kind == "all_gather_matmul":
        return (m // world) % parts == 0
    if kind == "matmul_reduce_scatter":
        return m % (world * parts) == 0
    return m % parts == 0


def configurations(args, world: int) -> list[dict]:
    from compass_fx.tools.sweep import grid_workload

    out = []
    for model, kind, tokens in product(args.models.split(","), args.kinds.split(","), map(int, args.tokens.split(","))):
        w = grid_workload(kind, model, tokens, world, args.dtype)
        m, n, k = w.m // args.scale, w.n // args.scale, w.k // args.scale
        if min(m, n, k) < 1 or m % world:
            continue
        out.append({"model": model, "kind": kind, "tokens": tokens, "group_size": world, "m": m, "n": n, "k": k,
                    "full_m": w.m, "full_n": w.n, "full_k": w.k})
    return out


def timed(ctx: ranks.Ctx, args, fn) -> float:
    """Seconds per call: each call alone after a barrier (``--timing barrier``: the host's issue
    time of a call is exposed), or back to back (``--timing back-to-back``: the host runs ahead of
    the GPU, as in a training step)."""
    if args.timing in ("back-to-back", "interleaved"):
        return timing.time_back_to_back(ctx, fn, batch=max(2, args.repeats), batches=3)
    return timing.time_fn(ctx, fn, args.warmup, args.repeats)


def replayed(ctx: ranks.Ctx, args, fn):
    """``fn`` as timed: with ``--cuda-graphs`` warmed up and replayed from a CUDA graph."""
    if not args.cuda_graphs:
        return fn
    timing.warm_up(ctx, fn, args.warmup)
    return timing.graphed(ctx, fn)


def measure_config(ctx: ranks.Ctx, args, cfg: dict, topo, fused: tuple) -> dict:
    from compass_fx.cost import Workload, plan
    from compass_fx.cost.select import fuses_by_default
    from compass_fx.kernels.schedules import distinct_schedules

    kind, m, n, k = cfg["kind"], cfg["m"], cfg["n"], cfg["k"]
    dtype = DTYPES[args.dtype]
    wl = Workload(kind, m, n, k, args.dtype, ctx.world, cuda_graphs=args.cuda_graphs)
    priced = plan(wl, topo, fused_schedules=fused)  # every candidate measured here, for the prediction errors
    # the pick is strategy='auto''s: fused operators only where it prices them by default (or --pick-fused all)
    by_default = fuses_by_default(topo, ctx.world) or args.pick_fused == "all"
    decision = priced if by_default else plan(wl, topo, fused_schedules=())
    predicted = {c.label: c.seconds for c in priced.candidates}
    decs = [c for c in decision.candidates if c.strategy == "decompose"]
    model_parts = min(decs, key=lambda c: c.seconds).parts if decs else None

    labels = ["sequential"]
    part_counts = sorted({int(x) for x in args.decompose_ds.split(",") if x}
                         | ({model_parts} if model_parts else set()))
    labels += [strategy_label("decompose", parts) for parts in part_counts if parts > 1 and feasible(kind, m, ctx.world, parts)]
    labels += [strategy_label("fuse", schedule=s) for s in distinct_schedules(fused, ctx.world)]  # the operators the model tells apart
    if decision.label not in labels:
        labels.append(decision.label)
    a, b = pairs.pair_operands(kind, m, n, k, ctx.world, ctx.rank, dtype, ctx.device, seed=cfg["tokens"])
    times, errors, spread = {}, {}, {}
    lowered: dict[str, list[str]] = {}
    with torch.no_grad():
        ready = {}
        for label in labels:  # each strategy as compass_fx's rewrite emits it
            fn, outcomes = pairs.lowered_fn(kind, label, ctx.world, ctx.group_name, args.inner)
            call = (lambda f: lambda: f(a, b))(fn)
            if args.cuda_graphs:  # warm up (compile, build the workspaces), then capture: time the replays
                call, err = ranks.guarded(ctx, label, lambda: replayed(ctx, args, call))
                t = None
                if not err and args.timing != "interleaved":
                    t, err = ranks.guarded(ctx, label, lambda: timed(ctx, args, call))
            elif args.timing == "interleaved":  # compile and warm up now, time below with the others
                t, err = ranks.guarded(ctx, label, lambda: timing.warm_up(ctx, call, args.warmup))
            else:
                t, err = ranks.guarded(ctx, label, lambda: timed(ctx, args, call))
            lowered[label] = outcomes()
            # a strategy the compiler did not apply is not that candidate: an error, never timed under its name
            err = err or pairs.not_applied(label, lowered[label])
            if err:
                errors[label] = err
            elif args.timing == "interleaved":
                ready[label] = call
            else:
                times[label] = t
        if ready:
            times, spread = timing.time_interleaved(ctx, ready, batch=args.repeats, rounds=args.rounds)
        baseline = {}
        if kind != "matmul_all_reduce" and not args.no_symm_mem:
            fn = pairs.strategy_fn(kind, "symm_mem", ctx.world, ctx.group_name)
            t, err = ranks.guarded(ctx, "symm_mem", lambda: timed(ctx, args, replayed(ctx, args, lambda: fn(a, b))))
            baseline = {"symm_mem_s": t, "symm_mem_error": err,
                        "symm_mem_impl": "torch.ops.symm_mem (CUDA)" if ctx.is_cuda else "Python fallback (not a baseline)"}
        gemm_s = timed(ctx, args, replayed(ctx, args, pairs.gemm_only_fn(kind, a, b, ctx.world)))
        comm_s = timed(ctx, args, replayed(ctx, args, pairs.comm_only_fn(kind, a, b, ctx.world, ctx.group_name)))
    a = b = None  # free the operands before the next configuration
    if ctx.is_cuda:
        torch.cuda.empty_cache()

    row = dict(cfg)
    row.update(candidates={lbl: {"measured_s": times.get(lbl), "predicted_s": predicted.get(lbl),
                                 "error": errors.get(lbl), "spread": spread.get(lbl), "compiler": lowered.get(lbl)}
                           for lbl in labels},
               gemm_s=gemm_s, comm_s=comm_s, comm_fraction=comm_s / (comm_s + gemm_s),
               pick=decision.label, pick_predicted_s=decision.predicted_s, model_d=model_parts, d_star=decision.d_star,
               predicted_sequential_s=predicted.get("sequential"), inner=args.inner, cuda_graphs=args.cuda_graphs,
               **baseline)
    seq = times.get("sequential")
    pick_s = times.get(decision.label)
    if times:
        best = min(times, key=times.get)
        row.update(best=best, best_s=times[best])
    if pick_s is not None and times:
        row.update(pick_s=pick_s, hit=pick_s <= HIT_MARGIN * row["best_s"], pick_over_best=pick_s / row["best_s"],
                   overlap_efficiency=max(gemm_s, comm_s) / pick_s,
                   pred_err=(decision.predicted_s - pick_s) / pick_s)
        if seq:
            row.update(regression_vs_sequential=pick_s / seq - 1.0, speedup_vs_sequential=seq / pick_s)
        if baseline.get("symm_mem_s"):
            row["speedup_vs_symm_mem"] = baseline["symm_mem_s"] / pick_s
    errs = [abs(c["predicted_s"] - c["measured_s"]) / c["measured_s"] for c in row["candidates"].values()
            if c["predicted_s"] is not None and c["measured_s"]]
    row["median_abs_pred_err_all"] = statistics.median(errs) if errs else None
    return row


def worker(ctx: ranks.Ctx, args) -> dict:
    from compass_fx.kernels import fused_schedules_available

    topo, how = pairs.model_topology(ctx)
    fused = fused_schedules_available(ctx.device.type, DTYPES[args.dtype])
    configs = configurations(args, ctx.world)
    ctx.log(f"world {ctx.world}, {ctx.backend}, {args.dtype}, topology {topo.name} ({how}); "
            f"fused schedules {fused or 'none'}; {len(configs)} configurations")
    progress = output.Progress(ctx, len(configs), f"w{ctx.world}")
    rows = []
    for cfg in configs:
        row = measure_config(ctx, args, cfg, topo, fused)
        rows.append(row)
        progress.step(f"{cfg['model']} {cfg['kind']} tokens={cfg['tokens']} m={cfg['m']} n={cfg['n']} k={cfg['k']}: "
                      f"pick {row['pick']} {ms(row.get('pick_s'))} ms, best {row.get('best')} {ms(row.get('best_s'))} ms, "
                      f"sequential {ms(row['candidates']['sequential']['measured_s'])} ms")
    return {"world": ctx.world, "topology": topo.name, "topology_source": how, "topology_description": topo.to_dict(),
            "fused_schedules": list(fused), "rows": rows}


def ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.3f}"


def summarize(rows: list[dict]) -> dict:
    def vals(key, where=lambda r: True):
        return [r[key] for r in rows if r.get(key) is not None and where(r)]

    hits = vals("hit")
    regress = vals("regression_vs_sequential")
    pred = [abs(x) for x in vals("pred_err")]
    symm = vals("speedup_vs_symm_mem")
    comm_heavy = vals("speedup_vs_sequential", lambda r: r["comm_fraction"] >= 1 / 3)
    eff = vals("overlap_efficiency")
    eff_large = vals("overlap_efficiency", lambda r: r["tokens"] >= LARGE_TOKENS)
    out = {
        "configurations": len(rows),
        "hit_rate": sum(hits) / len(hits) if hits else None,
        "worst_regression_vs_sequential": max(regress) if regress else None,
        "median_abs_prediction_error_pick": statistics.median(pred) if pred else None,
        "max_abs_prediction_error_pick": max(pred) if pred else None,
        "median_abs_prediction_error_all": statistics.median(vals("median_abs_pred_err_all")) if vals("median_abs_pred_err_all") else None,
        "speedup_vs_symm_mem_min": min(symm) if symm else None,
        "speedup_vs_symm_mem_median": statistics.median(symm) if symm else None,
        "speedup_vs_sequential_comm_heavy_min": min(comm_heavy) if comm_heavy else None,
        "speedup_vs_sequential_comm_heavy_median": statistics.median(comm_heavy) if comm_heavy else None,
        "comm_heavy_configurations": len(comm_heavy),
        "overlap_efficiency_min": min(eff) if eff else None,
        "overlap_efficiency_median": statistics.median(eff) if eff else None,
        f"overlap_efficiency_min_tokens_ge_{LARGE_TOKENS}": min(eff_large) if eff_large else None,
        f"overlap_efficiency_median_tokens_ge_{LARGE_TOKENS}": statistics.median(eff_large) if eff_large else None,
        "picks": {}, "bests": {},
    }
    for r in rows:
        out["picks"][r["pick"]] = out["picks"].get(r["pick"], 0) + 1
        if r.get("best"):
            out["bests"][r["best"]] = out["bests"].get(r["best"], 0) + 1
    out["goals"] = {
        "hit_rate >= 0.95": None if out["hit_rate"] is None else out["hit_rate"] >= 0.95,
        "worst regression <= 2%": None if out["worst_regression_vs_sequential"] is None else out["worst_regression_vs_sequential"] <= 0.02,
        ">= 1.1x over symm_mem (min)": None if not symm else min(symm) >= 1.1,
        ">= 1.3x over sequential where comm >= 1/3 (min)": None if not comm_heavy else min(comm_heavy) >= 1.3,
        f"overlap efficiency >= 0.9 at tokens >= {LARGE_TOKENS} (min)": None if not eff_large else min(eff_large) >= 0.9,
    }
    return out


def _short(label: str) -> str:
    return (label.replace("decompose(d=", "d").replace("fuse(", "").replace(")", "")
            .replace("sequential", "seq").replace("double_ring", "dring"))


def markdown(tag: str, args, results, summary: dict) -> str:
    lines = [f"# Operator evaluation ({tag}{', dry run on CPU: times are meaningless' if args.dry_run else ''})", ""]
    for w, res in results:
        lines.append(f"* world {w}: topology `{res['topology']}` ({res['topology_source']}); fused schedules "
                     f"{res['fused_schedules'] or 'none'}")
    lines += ["", f"{args.dtype}; shapes of `compass_fx.tools.sweep.grid_workload`"
              + (f" divided by {args.scale}" if args.scale > 1 else "")
              + {"back-to-back": f"; back-to-back batches of {args.repeats}, median of 3",
                 "interleaved": f"; {args.rounds} rounds of one back-to-back batch of {args.repeats} calls per "
                                "candidate (order rotated each round), median over rounds",
                 "barrier": f"; median of {args.repeats} after {args.warmup} warm-up, each call after a barrier"}[args.timing]
              + ("; every candidate and baseline replayed from a CUDA graph (no host issue), priced so"
                 if args.cuda_graphs else "")
              + "; slowest rank; hit = pick within 3% of the best "
              "measured; overlap eff. = max(GEMM alone, collective alone) / pick.", "", "## Summary", ""]
    for key, value in summary.items():
        if key not in ("goals", "picks", "bests"):
            lines.append(f"* {key}: {output.fmt(value)}")
    lines.append(f"* picks: {summary['picks']}")
    lines.append(f"* best measured: {summary['bests']}")
    for goal, ok in summary["goals"].items():
        if args.dry_run:
            lines.append(f"* goal {goal}: not judged on a dry run")
        else:
            lines.append(f"* goal {goal}: {'-' if ok is None else ('met' if ok else 'NOT met')}")
    rows = []
    for _, res in results:
        for r in res["rows"]:
            cand = ", ".join(f"{_short(lbl)} {ms(c['measured_s'])}" if c["measured_s"] is not None else
                             f"{_short(lbl)} {'not applied' if 'not applied' in (c['error'] or '') else 'err'}"
                             for lbl, c in r["candidates"].items())
            rows.append(dict(r, seq_ms=ms(r["candidates"]["sequential"]["measured_s"]), pick_ms=ms(r.get("pick_s")),
                             best_ms=ms(r.get("best_s")), symm_ms=ms(r.get("symm_mem_s")), gemm_ms=ms(r["gemm_s"]),
                             comm_ms=ms(r["comm_s"]), pred_ms=ms(r.get("pick_predicted_s")), all_ms=cand))
    cols = [("group_size", "g"), "model", "kind", "tokens", "m", "n", "k", ("gemm_ms", "GEMM ms"), ("comm_ms", "comm ms"),
            ("seq_ms", "seq ms"), "pick", ("pick_ms", "pick ms"), ("pred_ms", "predicted ms"), "best", ("best_ms", "best ms"),
            "hit", ("speedup_vs_sequential", "vs seq"), ("symm_ms", "symm_mem ms"), ("speedup_vs_symm_mem", "vs symm_mem"),
            ("overlap_efficiency", "overlap eff."), ("all_ms", "all candidates (ms)")]
    lines += ["", "## Configurations", "", output.markdown_table(rows, cols)]
    return "\n".join(lines)


def grid_description(args, worlds: list[int]) -> dict:
    """The paper's grid and the part of it this run measured."""
    from compass_fx.tools.sweep import SweepConfig

    full = SweepConfig()
    return {"full": {"topologies": list(full.topologies), "models": list(full.models), "kinds": list(full.kinds),
                     "tokens": list(full.tokens), "group_sizes": list(full.group_sizes), "size": full.size()},
            "measured": {"topology": "this machine's (see 'topology')", "models": args.models.split(","),
                         "kinds": args.kinds.split(","), "tokens": [int(t) for t in args.tokens.split(",")],
                         "group_sizes": worlds, "scale": args.scale}}


def main(argv=None) -> int:
    args = parse_args(argv)
    launched = launch.launch(worker, args, launch.group_size_worlds(args.worlds, args.dry_run))
    if launched is None:
        return 0
    results, tag, t0 = launched
    rows = launch.gathered(results)
    summary = summarize(rows)
    payload = {"benchmark": NAME, "argv": sys.argv[1:] if argv is None else list(argv),
               "environment": output.environment(args.dry_run), "dtype": args.dtype, "scale": args.scale,
               "warmup": args.warmup, "repeats": args.repeats, "timing": args.timing, "worlds": [w for w, _ in results],
               "topology": {str(w): {"name": res["topology"], "source": res["topology_source"],
                                     "description": res["topology_description"],
                                     "fused_schedules": res["fused_schedules"]} for w, res in results},
               "grid": grid_description(args, [w for w, _ in results]),
               "summary": summary, "seconds": round(time.time() - t0, 1), "rows": rows}
    text = markdown(tag, args, results, summary)
    print(text)
    output.write_results(NAME, tag, payload, text, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
