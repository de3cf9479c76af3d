"""Where the time of one pair goes, as the project lowers it: a one-pair module compiled with
``backend="compass"`` (sequential, InterDecom(d), fused) and plain Inductor, run under
``torch.profiler``, its GPU kernels sorted into collectives (NCCL), GEMMs and the rest, per stream.

For each variant: the step time (CUDA events, back-to-back calls), the busy time of collectives
and of GEMMs, how much of the collectives' time ran beside a GEMM (overlap), the number of
kernels, and the gaps.  Also the NCCL collectives alone over message sizes (bus bandwidth), which
is what a topology of the machine at hand needs.  Run it in both regimes (``NCCL_P2P_DISABLE=1``
for host-staged communication).

    python benchmarks/profile_pair.py                           # 2 GPUs
    NCCL_P2P_DISABLE=1 python benchmarks/profile_pair.py --tag h200x2-hoststaged
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import launch, output, pairs, ranks, timing  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from compass_fx.cost.decision import strategy_label  # noqa: E402

NAME = "profile_pair"


class _OnePair(nn.Module):
    def __init__(self, k: int, n: int, world: int, group: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(k, n) / k ** 0.5)
        self.world, self.group = world, group


class GatherMatmul(_OnePair):
    """Sequence parallel w1: gather the tokens, multiply by the column shard of the weight."""

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        x = torch.ops._c10d_functional.all_gather_into_tensor(shard, self.world, self.group)
        return torch.ops._c10d_functional.wait_tensor(x) @ self.w


class MatmulReduceScatter(_OnePair):
    """Sequence parallel w2: multiply by the row shard of the weight, reduce-scatter the tokens."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops._c10d_functional.reduce_scatter_tensor(x @ self.w, "sum", self.world, self.group)
        return torch.ops._c10d_functional.wait_tensor(y)


def kernel_summary(prof, calls: int) -> dict:
    """Per call: busy time of collectives / GEMMs, their overlap, kernel counts, streams."""
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0]

    def kind(name: str) -> str:
        low = name.lower()
        if "nccl" in low:
            return "comm"
        if any(t in low for t in ("gemm", "sm90", "cutlass", "xmma", "nvjet", "matmul")):
            return "gemm"
        return "other"

    spans = {"comm": [], "gemm": [], "other": []}
    streams: dict[str, set] = {"comm": set(), "gemm": set(), "other": set()}
    for e in events:
        k = kind(e.name)
        spans[k].append((e.time_range.start, e.time_range.end))
        streams[k].add(getattr(e, "device_resource_id", None))

    def busy(iv):
        iv = sorted(iv)
        total, cur = 0.0, None
        for s, t in iv:
            if cur is None or s > cur[1]:
                if cur:
                    total += cur[1] - cur[0]
                cur = [s, t]
            else:
                cur[1] = max(cur[1], t)
        return total + (cur[1] - cur[0] if cur else 0.0), iv

    comm_busy, _ = busy(spans["comm"])
    gemm_busy, _ = busy(spans["gemm"])
    both_busy, _ = busy(spans["comm"] + spans["gemm"])
    overlap = comm_busy + gemm_busy - both_busy
    return {"comm_us": comm_busy / calls, "gemm_us": gemm_busy / calls, "overlap_us": overlap / calls,
            "comm_hidden_fraction": overlap / comm_busy if comm_busy else None,
            "kernels_per_call": {k: len(v) / calls for k, v in spans.items()},
            "streams": {k: len(v) for k, v in streams.items()}}


def variant(ctx, module_cls, k, n, rows, label, strategy):
    """One variant: plain Inductor (``strategy`` None), compass with the strategy label forced
    ("sequential", "decompose(d=4)", "fuse(direct)") or compass "auto" (its own choice)."""
    import compass_fx

    torch._dynamo.reset()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
    mod = module_cls(k, n, ctx.world, ctx.group_name).to(ctx.device, dtype)
    x = torch.randn(rows, k, device=ctx.device, dtype=dtype)
    options = None if strategy is None else {} if strategy == "auto" else pairs.lowered_options(strategy)
    # on the CPU (a dry run: the profile means nothing) no C++ compile per variant: aot_eager, eager inner
    plain = "inductor" if ctx.is_cuda else "aot_eager"
    if options is not None and not ctx.is_cuda:
        options = {**options, "inner": "eager"}
    fn = torch.compile(mod, backend=plain) if options is None else \
        torch.compile(mod, backend="compass", options=options)
    before = len(compass_fx.backend.history)
    with torch.no_grad():
        fn(x)
    done = pairs.pair_outcomes(before) if options is not None else None
    missed = pairs.not_applied(strategy, done) if strategy not in (None, "auto") else None
    if missed:  # not the variant it is named after: recorded as such, not profiled under that name
        return {"variant": label, "rewritten": done, "not_applied": missed}
    if not ctx.is_cuda:  # dry run: the rewrite only
        return {"variant": label, "rewritten": done}
    with torch.no_grad():
        seconds = timing.time_back_to_back(ctx, lambda: fn(x), batch=10, batches=5)
        ranks.barrier(ctx)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn(x)
            ranks.synchronize(ctx)
    out = {"variant": label, "ms": seconds * 1e3, "rewritten": done}
    out.update(kernel_summary(prof, 5))
    return out


def nccl_bandwidth(ctx) -> list[dict]:
    rows = []
    for mib in ((4, 16, 64, 256) if ctx.is_cuda else (1,)):
        numel = mib * 2 ** 20 // 2
        dtype = torch.bfloat16 if ctx.is_cuda else torch.float32
        shard = torch.randn(numel // ctx.world, device=ctx.device, dtype=dtype)
        full = torch.empty(numel, device=ctx.device, dtype=dtype)
        ag = timing.time_fn(ctx, lambda: dist.all_gather_into_tensor(full, shard), 3, 10)
        rs = timing.time_fn(ctx, lambda: dist.reduce_scatter_tensor(shard, full), 3, 10)
        factor = (ctx.world - 1) / ctx.world
        rows.append({"mib": mib, "all_gather_ms": ag * 1e3, "reduce_scatter_ms": rs * 1e3,
                     "all_gather_busbw_gbps": numel * 2 * factor / ag / 1e9,
                     "reduce_scatter_busbw_gbps": numel * 2 * factor / rs / 1e9})
    return rows


def worker(ctx: ranks.Ctx, args) -> dict:
    if args.sm_carveout:  # cuBLAS leaves this many SMs free, so NCCL's kernels can run beside a GEMM
        torch._C._set_sm_carveout_experimental(args.sm_carveout)
    out = {"nccl": nccl_bandwidth(ctx) if not args.skip_nccl else [], "pairs": []}
    ctx.log(f"NCCL: {out['nccl']}")
    div = 1 if ctx.is_cuda else 64
    shapes = [("all_gather_matmul", GatherMatmul, 4096 // div, 7168 // div, args.tokens // ctx.world // div),
              ("matmul_reduce_scatter", MatmulReduceScatter, 7168 // div, 4096 // div, args.tokens // div)]
    variants = [("inductor", None), ("compass off", "sequential")]
    variants += [(f"decompose d={parts}", strategy_label("decompose", parts)) for parts in (2, 4, 8)]
    if not args.decompose_only:
        variants += [("fuse direct", "fuse(direct)")]
    variants += [("auto", "auto")]
    for kind, cls, k, n, rows in shapes:
        for label, strategy in variants:
            res = variant(ctx, cls, k, n, rows, label, strategy)
            res["kind"] = kind
            out["pairs"].append(res)
            if "ms" in res:
                ctx.log(f"{kind} {label}: {res['ms']:.3f} ms, comm {res['comm_us']:.0f} us, gemm {res['gemm_us']:.0f} us, "
                        f"overlap {res['overlap_us']:.0f} us, kernels {res['kernels_per_call']}, streams {res['streams']}")
            else:
                ctx.log(f"{kind} {label}: {res}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    launch.add_launch_args(p, default_worlds="2")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--sm-carveout", type=int, default=0, help="SMs cuBLAS leaves free (0: none)")
    p.add_argument("--decompose-only", action="store_true")
    p.add_argument("--skip-nccl", action="store_true")
    args = p.parse_args(argv)
    launched = launch.launch(worker, args, launch.parse_worlds(args.worlds, args.dry_run))
    if launched is None:
        return 0
    results, tag, t0 = launched
    res = results[0][1]
    regime = "host-staged (NCCL_P2P_DISABLE=1)" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "peer-to-peer"
    payload = {"benchmark": NAME, "environment": output.environment(args.dry_run), "worlds": [w for w, _ in results],
               "regime": regime,
               "sm_carveout": args.sm_carveout, "nccl_high_priority": os.environ.get("TORCH_NCCL_HIGH_PRIORITY"),
               "tokens": args.tokens, "seconds": round(time.time() - t0, 1), **res}
    lines = [f"# One pair under the profiler ({tag}, {regime}; cuBLAS SM carveout {args.sm_carveout}, "
             f"TORCH_NCCL_HIGH_PRIORITY={os.environ.get('TORCH_NCCL_HIGH_PRIORITY')})", "", "## NCCL alone", "",
             output.markdown_table(res["nccl"], ["mib", "all_gather_ms", "reduce_scatter_ms", "all_gather_busbw_gbps",
                                             "reduce_scatter_busbw_gbps"]),
             "", f"## Pairs ({args.tokens} tokens, Llama-3-8B w1/w2 at TP={results[0][0]}, bf16; per call)", "",
             output.markdown_table(res["pairs"], ["kind", "variant", "ms", "comm_us", "gemm_us", "overlap_us",
                                              "comm_hidden_fraction", "kernels_per_call", "streams", "rewritten",
                                              "not_applied"])]
    text = "\n".join(lines)
    print(text)
    output.write_results(NAME, tag, payload, text, args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
