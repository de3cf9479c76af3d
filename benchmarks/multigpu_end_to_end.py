"""End-to-end training step of a Llama-3-style model with tensor parallelism over every GPU, with
and without sequence parallelism, timed under:

* ``inductor``   — ``torch.compile`` with Inductor (NCCL collectives, then cuBLAS);
* ``async_tp``   — Inductor + PyTorch's async-TP: ``torch._inductor.config._micro_pipeline_tp = True``
                   and symmetric memory enabled for the TP group (CUDA only; it has nothing to
                   rewrite without sequence parallelism, where it is run anyway for the record);
* ``compass``    — ``torch.compile(backend="compass")`` (cost model chooses per pair; Inductor inside);
* ``eager``      — optional (``--modes``), DTensor eager;
* ``megatron``   — optional: Megatron-core's tensor-parallel GPT layers at the same sizes, with
                   and without its communication overlap, when ``megatron.core`` is importable
                   (recorded as "not installed" otherwise).

The model is the demo Llama (``compass_fx.demo``) at Llama-3 8B layer sizes (hidden 4096, FFN 14336,
32 heads of 128, 8 KV heads: grouped-query attention replaces the demo's attention), the TP/SP plan
is the demo's torchtitan-style plan.  Tokens/s and step time are the median of ``--steps`` steps
after ``--warmup`` steps (the first includes compilation, reported separately); the loss of the
first step is recorded per mode as a sanity check (same seed, same data).

    python benchmarks/multigpu_end_to_end.py                              # every GPU, SP and non-SP
    python benchmarks/multigpu_end_to_end.py --layers 32 --seq 8192
    torchrun --nproc-per-node 8 benchmarks/multigpu_end_to_end.py
    python benchmarks/multigpu_end_to_end.py --dry-run                    # 2 gloo ranks, tiny model, fp32
    python benchmarks/multigpu_end_to_end.py --dry-run --fast             # aot_eager / compass inner eager
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import launch, output, profiling, ranks  # noqa: E402  (sets the no-multicast environment first)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from compass_fx.cost.decision import strategy_label  # noqa: E402

NAME = "multigpu_end_to_end"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
MODES = ("inductor", "async_tp", "compass", "eager", "megatron")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    launch.add_launch_args(p)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bfloat16 (float32 with --dry-run)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; 2 with --dry-run)")
    p.add_argument("--dim", type=int, default=None, help="hidden size (default 4096)")
    p.add_argument("--ffn", type=int, default=None, help="FFN hidden size (default 14336)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 8)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default 128256)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 8192)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; 2 with --dry-run)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps, the first compiles (default 3; 1 dry run)")
    p.add_argument("--modes", default="inductor,async_tp,compass,megatron", help=f"any of {MODES}")
    p.add_argument("--sp", default="both", choices=("both", "on", "off"), help="sequence parallelism")
    p.add_argument("--compass-options", default='{"strategy": "auto"}',
                   help="JSON options of backend='compass' (inner defaults to inductor)")
    p.add_argument("--compass-variants", default=None,
                   help='JSON {name: options}: run mode "compass" once per variant, as "compass:<name>" '
                        '(e.g. \'{"auto": {}, "fuse": {"strategy": "fuse", "schedule": "direct"}}\')')
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after timing, run STEPS more steps under torch.profiler and record where rank 0's GPU "
                        "time goes (busy ms per category: GEMM, NCCL, copies by direction, other kernels; idle)")
    p.add_argument("--compile-mode", default="default", choices=("default", "reduce-overhead", "max-autotune"),
                   help="Inductor's mode for every compiled mode (compass: its 'mode' option). 'reduce-overhead' "
                        "replays each step's graphs as CUDA graphs; the fused operators join them only with "
                        "COMPASS_FUSED_GRAPHS=1 in the environment (recorded per row)")
    p.add_argument("--fast", action="store_true",
                   help="dry-run helper: aot_eager instead of Inductor and compass inner='eager' (quick CPU check)")
    args = p.parse_args(argv)
    small = args.dry_run
    args.dtype = args.dtype or ("float32" if small else "bfloat16")
    defaults = dict(layers=(2, 8), dim=(64, 4096), ffn=(128, 14336), heads=(8, 32), kv_heads=(4, 8),
                    vocab=(256, 128256), seq=(32, 8192), batch=(2, 1), steps=(2, 10), warmup=(1, 3))
    for key, (tiny, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if small else full)
    args.compass_options = json.loads(args.compass_options)
    variants = json.loads(args.compass_variants) if args.compass_variants else None
    args.compass_variants = ({f"compass:{name}": opts for name, opts in variants.items()} if variants
                             else {"compass": args.compass_options})
    for m in args.modes.split(","):
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; choose from {MODES}")
    return args


# ---------------------------------------------------------------------------------------------
# the model: the demo Llama with grouped-query attention at Llama-3 sizes
# ---------------------------------------------------------------------------------------------
class GQAttention(nn.Module):
    """Llama-3 attention: ``kv_heads`` key/value heads shared by ``heads / kv_heads`` query heads.
    Head counts are inferred from the local weight widths, so it runs unchanged under TP."""

    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


def build_model(args, mesh, sequence_parallel: bool, device: torch.device) -> nn.Module:
    from compass_fx.demo import ModelArgs, Transformer, parallelize

    margs = ModelArgs(dim=args.dim, n_layers=args.layers, n_heads=args.heads, vocab_size=args.vocab,
                      ffn_hidden=args.ffn)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(margs)
        for block in model.layers:
            block.attention = GQAttention(args.dim, args.heads, args.kv_heads)
    model = model.to(DTYPES[args.dtype])
    return parallelize(model, mesh, sequence_parallel=sequence_parallel)


def batches(args, device: torch.device, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)  # the same on every rank: TP ranks see the same tokens
    out = []
    for _ in range(count):
        t = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


# ---------------------------------------------------------------------------------------------
# modes
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def inductor_config(**changes):
    import torch._inductor.config as cfg

    old = {k: getattr(cfg, k) for k in changes}
    for k, v in changes.items():
        setattr(cfg, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(cfg, k, v)


def skip_reason(ctx: ranks.Ctx, mode: str, sp: bool, args) -> str | None:
    if mode == "async_tp":
        if not ctx.is_cuda:
            return "async-TP needs CUDA: symmetric memory allocates only on CUDA and Inductor's " \
                   "_micro_pipeline_tp pass is skipped off NCCL"
        if args.fast:
            return "--fast replaces Inductor"
    if mode == "megatron":
        try:
            import megatron.core  # noqa: F401
        except ImportError:
            return "not installed (megatron-core is not importable)"
        if not ctx.is_cuda:
            return "Megatron-core needs CUDA"
    return None


def compile_model(ctx: ranks.Ctx, mode: str, model: nn.Module, args, group_name: str):
    if mode == "eager":
        return model
    inductor_mode = None if args.compile_mode == "default" or args.fast else args.compile_mode
    if mode.startswith("compass"):
        opts = dict(args.compass_variants[mode])
        if args.fast:
            opts.setdefault("inner", "eager")
        if inductor_mode:
            opts.setdefault("mode", inductor_mode)
        return torch.compile(model, backend="compass", options=opts)
    if mode == "async_tp":
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group
        enable_symm_mem_for_group(group_name)  # the TP mesh's group (the world here)
    if args.fast:
        return torch.compile(model, backend="aot_eager")
    return torch.compile(model, backend="inductor", mode=inductor_mode)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with DTensor and plain parameters in separate groups: without sequence parallelism
    the norms stay plain tensors, and the foreach kernels refuse a list mixing the two."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return torch.optim.AdamW([{"params": g} for g in groups if g], lr=1e-4)


def train_step(fn, opt, inputs: torch.Tensor, labels: torch.Tensor, flags: dict, graphs: bool = False
               ) -> torch.Tensor:
    """Forward, loss, backward, optimizer step; returns the loss.  ``graphs``: the compiled
    graphs replay as CUDA graphs ("reduce-overhead"), told that a new step begins."""
    if graphs:
        torch.compiler.cudagraph_mark_step_begin()
    with inductor_config(**flags):
        logits = fn(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def profile_steps(ctx: ranks.Ctx, args, step, batch) -> dict | None:
    """``args.profile`` steps under torch.profiler on every rank; rank 0's GPU time by category."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.is_cuda else [])
    ranks.synchronize(ctx)
    with profile(activities=activities) as prof:
        for _ in range(args.profile):
            step(*batch)
        ranks.synchronize(ctx)
    return profiling.gpu_time_summary(prof, args.profile) if ctx.is_cuda and ctx.rank == 0 else None


def run_mode(ctx: ranks.Ctx, args, mode: str, sp: bool, mesh) -> dict:
    """Warm up (compiling), then time ``args.steps`` steps; the slowest rank's time per step."""
    model = build_model(args, mesh, sp, ctx.device)
    opt = make_optimizer(model)
    fn = compile_model(ctx, mode, model, args, mesh.get_group().group_name)
    data = batches(args, ctx.device, args.warmup + args.steps)
    step_times, losses = [], []
    if ctx.is_cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    flags = {"_micro_pipeline_tp": True} if mode == "async_tp" else {}
    graphs = args.compile_mode == "reduce-overhead" and mode != "eager" and not args.fast
    for i, (inputs, labels) in enumerate(data):
        ranks.synchronize(ctx)
        t0 = time.perf_counter()
        loss = train_step(fn, opt, inputs, labels, flags, graphs)
        ranks.synchronize(ctx)
        dt = ranks.max_over_ranks(ctx, time.perf_counter() - t0)
        step_times.append(dt)
        losses.append(float(loss.detach().float().item()))
        if i == 0:
            ctx.log(f"    first step (compiles) {dt:.1f}s, loss {losses[0]:.5f}")
    timed = step_times[args.warmup:]
    step_s = statistics.median(timed)
    profile = profile_steps(ctx, args, partial(train_step, fn, opt, flags=flags, graphs=graphs), data[-1]) if args.profile else None
    out = {"first_step_s": step_times[0], "step_s": step_s, "step_s_min": min(timed), "step_s_max": max(timed),
           "tokens_per_s": args.batch * args.seq / step_s, "loss_first": losses[0], "loss_last": losses[-1],
           "step_times_s": timed}
    if ctx.is_cuda:
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2 ** 30
    if profile is not None:
        out["profile"] = profile
    if mode.startswith("compass"):
        import compass_fx
        rep = compass_fx.last_report()
        out["compass_pairs"] = len(rep.pairs)
        out["compass_rewritten"] = sum(p.status == "rewritten" for p in rep.pairs)
        decisions: dict[str, int] = {}
        for p in rep.pairs:
            label = strategy_label(p.strategy, p.parts, p.schedule, p.asynchronous)
            key = f"{p.graph}:{p.kind}:{label}"
            decisions[key] = decisions.get(key, 0) + 1
        out["compass_decisions"] = decisions
        left: dict[str, int] = {}
        for p in rep.pairs:
            if p.status != "rewritten":
                key = f"{p.graph}:{p.kind}: {p.status}: {p.reason}"
                left[key] = left.get(key, 0) + 1
        out["compass_left_alone"] = left
    del fn, model, opt, data
    return out


def run_megatron(ctx: ranks.Ctx, args, sp: bool, overlap: bool) -> dict:
    """Megatron-core GPT layers (local spec, no Transformer Engine) at the same sizes; best effort.

    ``overlap`` turns on the overlap Megatron-core offers without Transformer Engine (the
    asynchronous weight-gradient all-reduce/all-gather overlap of its linear layers); the
    userbuffer-based TP overlap (``tp_comm_overlap``) needs Transformer Engine and is not run."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=ctx.world)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    import dataclasses

    dtype = DTYPES[args.dtype]
    wanted = dict(
        num_layers=args.layers, hidden_size=args.dim, ffn_hidden_size=args.ffn, num_attention_heads=args.heads,
        num_query_groups=args.kv_heads, kv_channels=args.dim // args.heads, tensor_model_parallel_size=ctx.world,
        sequence_parallel=sp, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        add_bias_linear=False, bf16=dtype == torch.bfloat16, params_dtype=dtype, pipeline_dtype=dtype,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
        async_tensor_model_parallel_allreduce=overlap,
    )
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    if overlap and "async_tensor_model_parallel_allreduce" not in fields:
        raise RuntimeError("this megatron-core has no TE-free TP overlap (async_tensor_model_parallel_allreduce); "
                           "its tp_comm_overlap needs Transformer Engine")
    config = TransformerConfig(**{k: v for k, v in wanted.items() if k in fields})
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                     max_sequence_length=args.seq, position_embedding_type="rope").to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = batches(args, ctx.device, args.warmup + args.steps)
    pos = torch.arange(args.seq, device=ctx.device).unsqueeze(0).expand(args.batch, -1)
    mask = torch.ones(1, 1, args.seq, args.seq, device=ctx.device, dtype=torch.bool).tril().logical_not()
    times, losses = [], []
    for inputs, labels in data:
        ranks.synchronize(ctx)
        t0 = time.perf_counter()
        loss = model(inputs, pos, mask, labels=labels).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ranks.synchronize(ctx)
        times.append(ranks.max_over_ranks(ctx, time.perf_counter() - t0))
        losses.append(float(loss.item()))
    timed = times[args.warmup:]
    step_s = statistics.median(timed)
    return {"first_step_s": times[0], "step_s": step_s, "step_s_min": min(timed), "step_s_max": max(timed),
            "tokens_per_s": args.batch * args.seq / step_s, "loss_first": losses[0], "loss_last": losses[-1],
            "step_times_s": timed, "note": "Megatron-core local layers (no Transformer Engine), own init/loss"}


def _free(ctx: ranks.Ctx) -> None:
    torch._dynamo.reset()
    gc.collect()
    if ctx.is_cuda:
        torch.cuda.empty_cache()


def worker(ctx: ranks.Ctx, args) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    for what, value in (("heads", args.heads), ("kv-heads", args.kv_heads), ("ffn", args.ffn), ("vocab", args.vocab),
                        ("seq", args.seq)):
        if value % ctx.world:
            raise SystemExit(f"--{what} {value} is not divisible by the world size {ctx.world}")
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    sps = {"both": [True, False], "on": [True], "off": [False]}[args.sp]
    modes = [v for m in args.modes.split(",") for v in (list(args.compass_variants) if m == "compass" else [m])]
    ctx.log(f"world {ctx.world}, {ctx.backend}, {args.dtype}: {args.layers} layers, dim {args.dim}, ffn {args.ffn}, "
            f"heads {args.heads}/{args.kv_heads}, vocab {args.vocab}, batch {args.batch} x seq {args.seq}; "
            f"{args.warmup} warm-up + {args.steps} timed steps")
    runs = [(sp, m) for sp in sps for m in modes]
    progress = output.Progress(ctx, len(runs), f"w{ctx.world}")
    rows = []
    for sp, mode in runs:
        base = {"world": ctx.world, "sequence_parallel": sp, "mode": mode, "compile_mode": args.compile_mode}
        if mode.startswith("compass") and args.compile_mode == "reduce-overhead":
            from compass_fx.kernels.cuda import graphs_enabled
            base["fused_in_cuda_graphs"] = graphs_enabled()
        reason = skip_reason(ctx, mode, sp, args)
        if reason:
            rows.append(dict(base, status="skipped", note=reason))
            progress.step(f"SP={sp} {mode}: skipped ({reason})")
            continue
        if mode == "megatron":
            for overlap in (False, True):
                res, err = ranks.guarded(ctx, mode, lambda: run_megatron(ctx, args, sp, overlap))
                rows.append(dict(base, mode=f"megatron{'+overlap' if overlap else ''}",
                                 **(res or {}), status="error" if err else "ok", note=err or (res or {}).get("note", "")))
                _free(ctx)
            progress.step(f"SP={sp} megatron")
            continue
        ctx.log(f"  SP={sp} {mode} ...")
        res, err = ranks.guarded(ctx, mode, lambda: run_mode(ctx, args, mode, sp, mesh))
        _free(ctx)
        row = dict(base, **(res or {}), status="error" if err else "ok", note=err or "")
        if mode == "async_tp" and not sp and not err:
            row["note"] = "no all_gather/reduce_scatter pairs without SP: async-TP has nothing to rewrite"
        rows.append(row)
        progress.step(f"SP={sp} {mode}: " + (f"error {err}" if err else
                                              f"{res['step_s'] * 1e3:.1f} ms/step, {res['tokens_per_s']:.0f} tokens/s"))
    # speedups within each SP setting
    for sp in sps:
        by_mode = {r["mode"]: r for r in rows if r["sequence_parallel"] == sp and r.get("step_s")}
        for r in by_mode.values():
            for ref in ("inductor", "async_tp"):
                if ref in by_mode and r is not by_mode[ref]:
                    r[f"speedup_vs_{ref}"] = by_mode[ref]["step_s"] / r["step_s"]
            for ref in ("inductor", "eager"):
                if ref in by_mode and r.get("loss_first") is not None and not r["mode"].startswith("megatron"):
                    ref_loss = by_mode[ref]["loss_first"]
                    r[f"loss_rel_diff_vs_{ref}"] = abs(r["loss_first"] - ref_loss) / max(abs(ref_loss), 1e-12)
    return {"world": ctx.world, "rows": rows}


COLUMNS = ["world", ("sequence_parallel", "SP"), "mode", "status", ("step_ms", "step ms"), ("tokens_per_s", "tokens/s"),
           ("speedup_vs_inductor", "vs Inductor"), ("speedup_vs_async_tp", "vs async-TP"),
           ("first_step_s", "first step s"), ("peak_memory_gib", "peak GiB"), ("loss_first", "loss (step 1)"),
           ("loss_rel_diff_vs_inductor", "loss diff vs Inductor"), ("compass_pairs", "pairs found"), ("compass_rewritten", "pairs rewritten"), "note"]


def main(argv=None) -> int:
    args = parse_args(argv)
    launched = launch.launch(worker, args, launch.parse_worlds(args.worlds, args.dry_run))
    if launched is None:
        return 0
    results, tag, t0 = launched
    rows = launch.gathered(results)
    for r in rows:
        if r.get("step_s"):
            r["step_ms"] = r["step_s"] * 1e3
    goals = {}
    for r in rows:
        if r["mode"].startswith("compass") and r.get("step_s"):
            key = "SP" if r["sequence_parallel"] else "no SP"
            goals[f"w{r['world']} {key} {r['mode']}: >= 1.00x of Inductor"] = (r.get("speedup_vs_inductor") or 0) >= 0.99
            if r["sequence_parallel"] and r.get("speedup_vs_async_tp") is not None:
                goals[f"w{r['world']} {key} {r['mode']}: >= async-TP"] = r["speedup_vs_async_tp"] >= 0.99
    model = {k: getattr(args, k) for k in ("layers", "dim", "ffn", "heads", "kv_heads", "vocab", "seq", "batch")}
    payload = {"benchmark": NAME, "argv": sys.argv[1:] if argv is None else list(argv),
               "environment": output.environment(args.dry_run), "dtype": args.dtype, "model": model,
               "warmup": args.warmup, "steps": args.steps, "compass_variants": args.compass_variants, "fast": args.fast,
               "compile_mode": args.compile_mode,
               "worlds": [w for w, _ in results], "goals": goals, "seconds": round(time.time() - t0, 1), "rows": rows}
    md = [f"# End-to-end training step ({tag}{', dry run on CPU: times are meaningless' if args.dry_run else ''})", "",
          (f"Llama-3-style model: {args.layers} layers, hidden {args.dim}, FFN {args.ffn}, {args.heads} heads / "
           f"{args.kv_heads} KV heads, vocab {args.vocab}; batch {args.batch} x seq {args.seq}; {args.dtype}; TP over "
           f"all ranks; median of {args.steps} steps after {args.warmup} warm-up (slowest rank per step); "
           f"compass variants {json.dumps(args.compass_variants)}; Inductor mode {args.compile_mode}"
           f"{'; --fast: aot_eager and compass inner eager' if args.fast else ''}."),
          ""]
    if args.dry_run:
        md += ["* goals: not judged on a dry run"]
    else:
        md += [f"* goal {g}: {'met' if ok else 'NOT met'}" for g, ok in goals.items()]
    md += ["", output.markdown_table(rows, COLUMNS)]
    decided = [r for r in rows if r.get("compass_decisions")]
    if decided:
        md += ["", "compass decisions (graph:pair:strategy: count):", ""]
        md += [f"* w{r['world']} SP={'on' if r['sequence_parallel'] else 'off'} {r['mode']}: "
               + ", ".join(f"{k}: {v}" for k, v in r["compass_decisions"].items()) for r in decided]
        md += ["", "pairs left as they were, with the reason (graph:pair: status: reason: count):", ""]
        md += [f"* w{r['world']} SP={'on' if r['sequence_parallel'] else 'off'} {r['mode']}: {k}: {v}"
               for r in decided for k, v in r.get("compass_left_alone", {}).items()]
    profiled = [r for r in rows if r.get("profile") and r["profile"].get("busy_ms_by_category")]
    if profiled:
        md += ["", "GPU time per step on rank 0 under torch.profiler (ms; each category's busy time, copies "
               "by direction; 'beside GEMM' = communication running while a GEMM runs):", ""]
        for r in profiled:
            p = r["profile"]
            cats = ", ".join(f"{k} {v:.1f}" for k, v in p["busy_ms_by_category"].items())
            md.append(f"* w{r['world']} SP={'on' if r['sequence_parallel'] else 'off'} {r['mode']}: span "
                      f"{p['span_ms']:.1f}, busy {p['busy_ms']:.1f}, idle {p['idle_ms']:.1f}; {cats}; communication "
                      f"beside GEMM {p['communication_beside_gemm_ms']:.1f}; costliest: "
                      + "; ".join(f"{k['name'][:48]} {k['ms']:.1f} ({k['count']:g}x)" for k in p["top_kernels"][:5]))
    text = "\n".join(md)
    print(text)
    output.write_results(NAME, tag, payload, text, args.out_dir)
    return 1 if any(r["status"] == "error" and not r["mode"].startswith("megatron") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
