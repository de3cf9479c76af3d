"""Correctness of every strategy on real process groups: NCCL on GPUs (bf16), gloo on CPU (fp32).

For each pair kind (all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce) and each
strategy — sequential, InterDecom with the cost model's d and with forced d, IntraFusion with the
ring / double_ring / direct schedules, and PyTorch's symm_mem fused op (forward only) — the
forward output and the gradients of both operands are compared with a reference computed by
plain ``torch.distributed`` collectives (NCCL on GPUs) and ``torch.mm`` in fp32 (fp64 on CPU).

Two levels:
* ``ops``: one pair alone.  Sequential and InterDecom(d) run as compass_fx's own rewrite emits
  them: the one-pair module ``harness.pairs.PairGraph`` (functional collective + wait + mm)
  compiled with ``backend="compass"`` and the strategy forced (``harness.pairs.lowered_fn``;
  inner compiler ``--inner``), operands requiring grad, so that the backward graph holds the
  mirror pair (mm -> reduce_scatter for a gather, all_gather -> mm for a reduce-scatter) and is
  rewritten too; the all-reduce's row-parallel backward has no collective, so only its forward
  pair is.  The ``applied`` column lists what the compiler did with each pair of each graph; a
  forced strategy it did not apply to every pair (or a backward pair it did not find) is a FAIL
  whatever the numbers.  IntraFusion and symm_mem are the operators called directly
  (``torch.ops.compass.*``, ``torch.ops.symm_mem.*``).
* ``compiled``: one tensor-parallel ``nn.Linear`` per pair kind (DTensor plan: colwise with a
  sequence-sharded input, rowwise to a reduce-scatter, rowwise to an all-reduce) compiled with
  ``backend="compass"`` and options strategy off / auto / decompose(chunks) / fuse(schedule),
  compared with the same module run eagerly (DTensor: NCCL + mm); forward and backward graphs are
  both rewritten, and what the backend did is recorded from ``compass_fx.last_report()``.

    python benchmarks/multigpu_correctness.py                         # worlds 2, 4, 8 (up to the GPU count)
    torchrun --nproc-per-node 8 benchmarks/multigpu_correctness.py    # one world
    python benchmarks/multigpu_correctness.py --dry-run               # 2 gloo ranks on CPU, fp32

Writes benchmarks/results/multigpu_correctness/multigpu_correctness-<device>.json and .md; exits 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import launch, output, pairs, ranks  # noqa: E402  (sets the no-multicast environment first)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from compass_fx.cost.decision import strategy_label  # noqa: E402

NAME = "multigpu_correctness"
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    launch.add_launch_args(p)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bfloat16 (float32 with --dry-run)")
    p.add_argument("--m", type=int, default=None, help="rows of the full activation (default 8192; 256 dry run)")
    p.add_argument("--n", type=int, default=None, help="local output columns (default 2048; 32 dry run)")
    p.add_argument("--k", type=int, default=None, help="local inner dim (default 4096; 64 dry run)")
    p.add_argument("--forced-d", default="2,4,8", help="InterDecom part counts forced besides the model's")
    p.add_argument("--kinds", default=",".join(pairs.PAIR_KINDS))
    p.add_argument("--levels", default="ops,compiled", help="ops, compiled or both")
    p.add_argument("--compiled-strategies", default="off,auto,decompose,fuse",
                   help="strategies of the compiled level (decompose: the model's d and each forced d; "
                        "fuse: every schedule)")
    p.add_argument("--inner", default=None, choices=("inductor", "eager"),
                   help="compass' inner compiler, both levels (default inductor; eager with --dry-run)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="max |x - ref| / max |ref| allowed (default by dtype: bf16 2e-2, fp32 1e-4)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.dry_run else "bfloat16")
    small = args.dry_run
    args.m = args.m or (256 if small else 8192)
    args.n = args.n or (32 if small else 2048)
    args.k = args.k or (64 if small else 4096)
    args.inner = args.inner or ("eager" if args.dry_run else "inductor")
    return args


# ---------------------------------------------------------------------------------------------
# references: plain torch.distributed collectives + torch.mm in high precision
# ---------------------------------------------------------------------------------------------
def _all_gather_rows(x: torch.Tensor, world: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, 0)


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x)
    return x


def _reduce_scatter_rows(x: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    return _all_reduce(x).chunk(world, 0)[rank].contiguous()


def reference(kind: str, a: torch.Tensor, b: torch.Tensor, g: torch.Tensor, world: int, rank: int):
    """(out, d a, d b) of the pair for the loss sum(out * g); all-reduce in the row-parallel
    convention (its backward is the identity on the replicated gradient)."""
    if kind == "all_gather_matmul":
        gathered = _all_gather_rows(a, world)
        return gathered @ b, _reduce_scatter_rows(g @ b.t(), world, rank), gathered.t() @ g
    if kind == "matmul_reduce_scatter":
        gg = _all_gather_rows(g, world)
        return _reduce_scatter_rows(a @ b, world, rank), gg @ b.t(), a.t() @ gg
    return _all_reduce(a @ b), g @ b.t(), a.t() @ g


def rel_err(x: torch.Tensor | None, ref: torch.Tensor) -> float:
    if x is None:
        return float("inf")
    ref = ref.double()
    return float((x.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------
def model_choice(ctx: ranks.Ctx, kind: str, args, topo) -> tuple[str, int | None, list]:
    """(the cost model's pick, its best InterDecom part count, the candidates) for this pair."""
    from compass_fx.cost import Workload, plan
    from compass_fx.kernels import fused_schedules_available

    dtype = DTYPES[args.dtype]
    w = Workload(kind, args.m, args.n, args.k, args.dtype, ctx.world)
    dec = plan(w, topo, fused_schedules=fused_schedules_available(ctx.device.type, dtype))
    decs = [c for c in dec.candidates if c.strategy == "decompose"]
    best_parts = min(decs, key=lambda c: c.seconds).parts if decs else None
    return dec.label, best_parts, [(c.label, c.seconds) for c in dec.candidates]


def op_labels(ctx: ranks.Ctx, kind: str, args, best_parts: int | None) -> list[tuple[str, str]]:
    """(label, role) of every strategy to check for ``kind``."""
    from compass_fx.kernels import fused_schedules_available

    labels = [("sequential", "sequential")]
    local = args.m // ctx.world if kind == "all_gather_matmul" else args.m
    step = ctx.world if kind == "matmul_reduce_scatter" else 1
    if best_parts:
        labels.append((strategy_label("decompose", best_parts), "model's d"))
    for parts in (int(x) for x in args.forced_d.split(",") if x):
        if parts != best_parts and parts > 1 and local % (parts * step) == 0:
            labels.append((strategy_label("decompose", parts), "forced d"))
    fused = fused_schedules_available(ctx.device.type, DTYPES[args.dtype])
    for s in ("ring", "double_ring", "direct"):
        labels.append((f"fuse({s})", "fused" if s in fused else "fused (no implementation here)"))
    if kind != "matmul_all_reduce":
        labels.append(("symm_mem", "PyTorch fused op" if ctx.is_cuda else "PyTorch fused op (Python fallback)"))
    return labels


def lowering_missed(kind: str, label: str, outcomes: list[str]) -> str | None:
    """Why the compiled pair is not ``label`` in both directions, or None: every pair the backend
    found took the strategy, and it found the forward pair and, but for the all-reduce (whose
    row-parallel backward has no collective), the backward one."""
    missed = pairs.not_applied(label, outcomes)
    graphs = {o.split(":", 1)[0] for o in outcomes}
    wanted = {"forward"} if kind == "matmul_all_reduce" else {"forward", "backward"}
    if not missed and not wanted <= graphs:
        missed = f"{label}: no pair found in the {' and '.join(sorted(wanted - graphs))} graph"
    return missed


def check_ops(ctx: ranks.Ctx, args, kind: str, topo, progress: output.Progress) -> list[dict]:
    dtype = DTYPES[args.dtype]
    ref_dtype = torch.float64 if not ctx.is_cuda else torch.float32
    tol = args.tolerance or TOLERANCE[dtype]
    pick, best_parts, _ = model_choice(ctx, kind, args, topo)
    a0, b0 = pairs.pair_operands(kind, args.m, args.n, args.k, ctx.world, ctx.rank, dtype, ctx.device, seed=1)
    gen = torch.Generator().manual_seed(7 + (0 if kind == "matmul_all_reduce" else ctx.rank))
    g = torch.randn(pairs.output_rows(kind, args.m, ctx.world), args.n, generator=gen).to(dtype=dtype, device=ctx.device)
    ref = reference(kind, a0.to(ref_dtype), b0.to(ref_dtype), g.to(ref_dtype), ctx.world, ctx.rank)
    rows = []
    for label, role in op_labels(ctx, kind, args, best_parts):
        row = {"level": "ops", "world": ctx.world, "kind": kind, "strategy": label, "role": role,
               "model_pick": pick, "dtype": args.dtype, "tolerance": tol}
        if "no implementation" in role:
            row.update(status="skipped", note="fused_schedules_available() offers no fused schedule here")
            rows.append(row)
            progress.step(f"ops {kind} {label}: skipped")
            continue
        forward_only = label == "symm_mem"
        compiled = label == "sequential" or label.startswith("decompose(")

        def run():
            a, b = a0.detach().clone().requires_grad_(not forward_only), b0.detach().clone().requires_grad_(not forward_only)
            if compiled:  # as compass_fx's rewrite emits it, forward and backward graphs
                fn, outcomes = pairs.lowered_fn(kind, label, ctx.world, ctx.group_name, args.inner)
            else:  # the operator called directly
                fn, outcomes = pairs.strategy_fn(kind, label, ctx.world, ctx.group_name), None
            out = fn(a, b)
            if forward_only:
                return out.detach(), None, None, None
            (out.float() * g.float()).sum().backward()
            return out.detach(), a.grad, b.grad, outcomes() if outcomes else None

        res, err = ranks.guarded(ctx, label, run)
        if err:
            row.update(status="error", note=err)
        else:
            out, ga, gb, outcomes = res
            errs = {"err_out": rel_err(out, ref[0])}
            if not forward_only:
                errs.update(err_grad_a=rel_err(ga, ref[1]), err_grad_b=rel_err(gb, ref[2]))
            worst = max(errs.values())
            worst_all = ranks.max_over_ranks(ctx, worst)
            errs = {k: ranks.max_over_ranks(ctx, v) for k, v in errs.items()}
            missing = compiled and lowering_missed(kind, label, outcomes)
            row.update(errs, max_err=worst_all, status="pass" if worst_all <= tol and not missing else "FAIL",
                       note=missing or ("forward only" if forward_only else ""))
            if compiled:
                row["applied"] = "; ".join(outcomes)
        rows.append(row)
        progress.step(f"ops {kind} {label}: {row['status']} (max err {output.fmt(row.get('max_err'))})")
    return rows


# ---------------------------------------------------------------------------------------------
# compiled level: backend="compass" on a TP linear per pair kind
# ---------------------------------------------------------------------------------------------
def build_linear(kind: str, args, mesh, dtype):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world = mesh.size()
    torch.manual_seed(1234)
    if kind == "all_gather_matmul":  # sequence-sharded input -> all_gather -> mm (colwise)
        lin = torch.nn.Linear(args.k, args.n * world, bias=False)
        style = ColwiseParallel(input_layouts=Shard(0))
    elif kind == "matmul_reduce_scatter":  # rowwise -> reduce_scatter to a sequence-sharded output
        lin = torch.nn.Linear(args.k * world, args.n, bias=False)
        style = RowwiseParallel(output_layouts=Shard(0))
    else:  # rowwise -> all_reduce
        lin = torch.nn.Linear(args.k * world, args.n, bias=False)
        style = RowwiseParallel()
    lin = lin.to(device=mesh.device_type, dtype=dtype)
    return parallelize_module(lin, mesh, style)


def compiled_options(args, best_parts: int | None, ctx: ranks.Ctx, kind: str) -> list[tuple[str, dict]]:
    from compass_fx.kernels import fused_schedules_available

    wanted = [s.strip() for s in args.compiled_strategies.split(",") if s.strip()]
    out = []
    base = {"inner": args.inner}
    local = args.m // ctx.world if kind == "all_gather_matmul" else args.m
    for s in wanted:
        if s in ("off", "auto"):
            out.append((s, dict(base, strategy=s)))
        elif s == "decompose":
            part_counts = [best_parts] if best_parts else []
            part_counts += [int(x) for x in args.forced_d.split(",") if x and int(x) not in part_counts]
            for parts in part_counts:
                if parts > 1 and local % (parts * ctx.world) == 0:
                    out.append((strategy_label("decompose", parts), dict(base, strategy="decompose", chunks=parts)))
        elif s == "fuse":
            if fused_schedules_available(ctx.device.type, DTYPES[args.dtype]):
                for sched in ("ring", "double_ring", "direct"):
                    out.append((strategy_label("fuse", schedule=sched), dict(base, strategy="fuse", schedule=sched)))
        else:
            raise SystemExit(f"unknown compiled strategy {s!r}")
    return out


def _report_summary() -> tuple[str, int]:
    import compass_fx

    rep = compass_fx.last_report()
    items, rewritten = [], 0
    for p in rep.pairs:
        label = strategy_label(p.strategy, p.parts, p.schedule)
        items.append(f"{p.graph}:{p.kind}:{label}:{p.status}")
        rewritten += p.status == "rewritten"
    return "; ".join(items), rewritten


def check_compiled(ctx: ranks.Ctx, args, kind: str, topo, progress: output.Progress, mesh) -> list[dict]:
    import compass_fx  # noqa: F401 - registers the backend

    dtype = DTYPES[args.dtype]
    tol = args.tolerance or TOLERANCE[dtype]
    pick, best_parts, _ = model_choice(ctx, kind, args, topo)
    gen = torch.Generator().manual_seed(11 + ctx.rank)
    rows_in = args.m // ctx.world if kind == "all_gather_matmul" else args.m
    k_in = args.k
    x0 = torch.randn(rows_in, k_in, generator=gen).to(dtype=dtype, device=ctx.device)
    gseed = torch.Generator().manual_seed(13 + (0 if kind == "matmul_all_reduce" else ctx.rank))
    g = torch.randn(pairs.output_rows(kind, args.m, ctx.world), args.n, generator=gseed).to(ctx.device)

    def step(model_fn, model):
        x = x0.clone().requires_grad_(True)
        out = model_fn(x)
        out = out.to_local() if hasattr(out, "to_local") else out
        (out.float() * g).sum().backward()
        wg = model.weight.grad
        wg = wg.to_local() if hasattr(wg, "to_local") else wg
        return out.detach(), x.grad, wg

    eager = build_linear(kind, args, mesh, dtype)
    ref = step(eager, eager)
    rows = []
    for label, opts in compiled_options(args, best_parts, ctx, kind):
        row = {"level": "compiled", "world": ctx.world, "kind": kind, "strategy": label, "role": f"options {opts}",
               "model_pick": pick, "dtype": args.dtype, "tolerance": tol}
        t0 = time.time()

        def run():
            torch._dynamo.reset()
            model = build_linear(kind, args, mesh, dtype)
            compiled = torch.compile(model, backend="compass", options=opts, fullgraph=True)
            return step(compiled, model)

        res, err = ranks.guarded(ctx, label, run)
        if err:
            row.update(status="error", note=err)
        else:
            out, gx, gw = res
            errs = {"err_out": rel_err(out, ref[0]), "err_grad_a": rel_err(gx, ref[1]), "err_grad_b": rel_err(gw, ref[2])}
            errs = {k: ranks.max_over_ranks(ctx, v) for k, v in errs.items()}
            worst = max(errs.values())
            applied, rewritten = _report_summary()
            ok = worst <= tol and (label == "off" or label == "auto" or rewritten > 0)
            row.update(errs, max_err=worst, status="pass" if ok else "FAIL", rewritten=rewritten, applied=applied,
                       note="" if (rewritten or label in ("off", "auto")) else "nothing was rewritten")
        row["seconds"] = round(time.time() - t0, 2)
        rows.append(row)
        progress.step(f"compiled {kind} {label}: {row['status']} (max err {output.fmt(row.get('max_err'))})")
    return rows


def worker(ctx: ranks.Ctx, args) -> dict:
    kinds = [k for k in args.kinds.split(",") if k]
    levels = [lv for lv in args.levels.split(",") if lv]
    topo, how = pairs.model_topology(ctx)
    ctx.log(f"world {ctx.world}, {ctx.backend}, {args.dtype}, m={args.m} n={args.n} k={args.k}, topology "
            f"{topo.name} ({how})")
    # progress total: a rough count (ops: ~8 per kind; compiled: ~8 per kind)
    progress = output.Progress(ctx, len(kinds) * (9 * ("ops" in levels) + 8 * ("compiled" in levels)), f"w{ctx.world}")
    mesh = None
    if "compiled" in levels:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    rows = []
    for kind in kinds:
        if "ops" in levels:
            rows += check_ops(ctx, args, kind, topo, progress)
        if "compiled" in levels:
            rows += check_compiled(ctx, args, kind, topo, progress, mesh)
    return {"world": ctx.world, "topology": topo.name, "topology_source": how, "topology_description": topo.to_dict(),
            "rows": rows}


COLUMNS = ["world", "level", "kind", "strategy", "role", "status", "err_out", "err_grad_a", "err_grad_b",
           "tolerance", "model_pick", "applied", "note"]


def main(argv=None) -> int:
    args = parse_args(argv)
    launched = launch.launch(worker, args, launch.group_size_worlds(args.worlds, args.dry_run))
    if launched is None:
        return 0
    results, tag, t0 = launched
    rows = launch.gathered(results)
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "FAIL", "error", "skipped")}
    payload = {
        "benchmark": NAME, "argv": sys.argv[1:] if argv is None else list(argv), "environment": output.environment(args.dry_run),
        "dtype": args.dtype, "shape": {"m": args.m, "n": args.n, "k": args.k}, "worlds": [w for w, _ in results],
        "topology": {str(w): {"name": res["topology"], "source": res["topology_source"],
                              "description": res["topology_description"]} for w, res in results},
        "counts": counts, "seconds": round(time.time() - t0, 1), "rows": rows,
    }
    md = [f"# Multi-GPU correctness ({tag}{', dry run on CPU' if args.dry_run else ''})", "",
          (f"{args.dtype}, m={args.m}, n={args.n}, k={args.k}; worlds {payload['worlds']}; "
           f"reference: torch.distributed collectives + torch.mm in {'fp64' if args.dry_run else 'fp32'}; "
           f"error = max|x - ref| / max|ref| over ranks."), "",
          f"**{counts['pass']} pass, {counts['FAIL']} fail, {counts['error']} error, {counts['skipped']} skipped**", "",
          output.markdown_table(rows, COLUMNS)]
    text = "\n".join(md)
    print(text)
    output.write_results(NAME, tag, payload, text, args.out_dir)
    return 1 if counts["FAIL"] or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
