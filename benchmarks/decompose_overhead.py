"""What InterDecom costs when communication is free: compiled pair, sequential vs d parts.

Why: on a single device the collectives of a one-rank group move nothing, so the time of the
decomposed pipeline over the sequential one is the pure overhead the rewrite adds (smaller GEMMs,
the collectives' launches, and what still copies rows: the cat of the reduce-scatter and
all-reduce outputs; a part's GEMM reads and writes its rows in place, ``lowering.row_blocks``).  The cost model must
charge exactly this, so the script prints the model's predicted GEMM split ratio beside the
measured ratio.  Each variant is timed alone (each call synchronised: the host's issue time shows)
and back to back; the per-part overhead (issue 10's goal: <= 15 us) is the back-to-back time
beyond sequential less what splitting the GEMM alone costs, per extra part, once as issued
(where the host's issue is slower than the GPU, that is what shows) and once on the device
alone (every call queued behind a GPU sleep first: the cost when the host runs ahead, as it does
in a training step of long GEMMs); and the kernels one call launches are counted (torch.profiler).
With ``--compile-mode reduce-overhead`` every variant runs as Inductor's CUDA graph replays: the
host's issue of each part is gone, and what an extra part costs is the device's alone.

    python benchmarks/decompose_overhead.py                       # CUDA: one-rank NCCL group, bf16
    python benchmarks/decompose_overhead.py --compile-mode reduce-overhead   # the same under CUDA graphs
    python benchmarks/decompose_overhead.py --dry-run             # CPU: one-rank gloo, tiny fp32, eager inner
    python benchmarks/decompose_overhead.py --render benchmarks/results/decompose_overhead/decompose_overhead-h200.json  # its .md
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compass_fx.backend  # noqa: E402
from compass_fx.cost import gemm_seconds, split_gemm_seconds  # noqa: E402
from compass_fx.tools.timing import issue_seconds, median_queued_seconds, seconds_of_one_call  # noqa: E402
from harness.output import markdown_table  # noqa: E402
from harness.timing import median_batch_seconds  # noqa: E402

# Llama-3 8B at TP=8: gate+up projection (gathered rows), down projection (scattered / reduced rows).
SHAPES = {"all_gather_matmul": (4096, 3584), "matmul_reduce_scatter": (1792, 4096),
          "matmul_all_reduce": (1792, 4096)}
TOKENS = (4096, 16384)
PARTS = (2, 4, 8)


def pair_fn(kind: str):
    group = dist.group.WORLD

    def all_gather_matmul(x, w):
        return torch.mm(funcol.all_gather_tensor(x, 0, group), w)

    def matmul_reduce_scatter(a, w):
        return funcol.reduce_scatter_tensor(torch.mm(a, w), "sum", 0, group)

    def matmul_all_reduce(a, w):
        return funcol.all_reduce(torch.mm(a, w), "sum", group)

    return {"all_gather_matmul": all_gather_matmul, "matmul_reduce_scatter": matmul_reduce_scatter,
            "matmul_all_reduce": matmul_all_reduce}[kind]


def timed(fn, args, device: str, iters: int) -> float:
    for _ in range(3):
        fn(*args)
    return statistics.median(seconds_of_one_call(lambda: fn(*args), device == "cuda") for _ in range(iters))


def back_to_back(fn, args, device: str, iters: int) -> float:
    """Seconds per call of ``iters`` calls issued back to back (the host ahead of the device, as in
    a training step), median of 5 batches: the device's time when the host keeps up."""
    if device != "cuda":
        return timed(fn, args, device, iters)
    return median_batch_seconds(lambda: fn(*args), iters, rounds=5)


def device_only(fn, args, device: str, iters: int) -> float | None:
    """Seconds per call of ``iters`` back-to-back calls that the host has all queued before the
    first starts (the GPU sleeps first), median of 5 batches: the device's time alone, whatever
    the host costs (in a training step the host runs ahead of long GEMMs)."""
    if device != "cuda":
        return None
    for _ in range(3):
        fn(*args)
    return median_queued_seconds(lambda: fn(*args), iters, sleep_s=40e-3)


def host_issue(fn, args, device: str, iters: int) -> float | None:
    """Host seconds to issue one call while the GPU is busy (:func:`issue_seconds`): what each part
    adds to the host's side of a step."""
    return issue_seconds(lambda: fn(*args), iters, True) if device == "cuda" else None


def kernels_per_call(fn, args, device: str) -> int | None:
    """GPU kernels and copies one call launches (torch.profiler)."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def step_marked(fn, compile_mode: str):
    """``fn``, each call starting a new step for Inductor's CUDA graph trees where the mode
    captures graphs (the previous call's outputs may then be overwritten, as in training steps)."""
    if compile_mode == "default" or not torch._inductor.list_mode_options(compile_mode).get("triton.cudagraphs"):
        return fn

    def call(*args):
        torch.compiler.cudagraph_mark_step_begin()
        return fn(*args)
    return call


def split_gemm(a: torch.Tensor, w: torch.Tensor, parts: int):
    """The pair's GEMM alone as ``parts`` row pieces (what the decomposition multiplies)."""
    step = a.shape[0] // parts
    return lambda: [torch.mm(a[i * step:(i + 1) * step], w) for i in range(parts)]


def run(args: argparse.Namespace) -> dict:
    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    tokens = (64,) if args.dry_run else TOKENS
    rows = []
    part_counts = tuple(int(x) for x in args.parts.split(",") if x.strip())
    total = len(SHAPES) * len(tokens) * (1 + len(part_counts))
    done = 0
    for kind, (k, n) in SHAPES.items():
        if args.dry_run:
            k, n = 32, 48
        for m in tokens:
            a = torch.randn(m, k, device=device, dtype=dtype)
            w = torch.randn(k, n, device=device, dtype=dtype)
            base = None
            for parts in (None,) + part_counts:
                options = {"strategy": "off"} if parts is None else {"chunks": parts}
                if args.dry_run:  # the script's every step, without a C++ compile per graph on the CPU
                    options["inner"] = "eager"
                if args.compile_mode != "default":
                    options["mode"] = args.compile_mode
                torch._dynamo.reset()
                before = len(compass_fx.backend.history)
                fn = step_marked(torch.compile(pair_fn(kind), backend="compass", options=options), args.compile_mode)
                with torch.no_grad():
                    result = fn(a, w)
                    if parts is None:
                        expected = result.clone()  # a CUDA graph replay may overwrite its output
                    # the rewrite must not change the result (same GEMM per row, summed the same way)
                    error = ((result.float() - expected.float()).abs().max() /
                             expected.float().abs().max().clamp_min(1e-30)).item()
                    seconds = timed(fn, (a, w), device, args.iters)
                    streamed = back_to_back(fn, (a, w), device, args.iters)
                    kernels = kernels_per_call(fn, (a, w), device)
                    gemm = back_to_back(lambda x, y: split_gemm(x, y, parts or 1)(), (a, w), device, args.iters)
                    queued = device_only(fn, (a, w), device, args.iters)
                    host = host_issue(fn, (a, w), device, args.iters)
                    gemm_queued = device_only(lambda x, y: split_gemm(x, y, parts or 1)(), (a, w), device, args.iters)
                rewritten = sum(p.status == "rewritten" for r in list(compass_fx.backend.history)[before:]
                                for p in r.pairs)
                if parts is None:
                    base, base_streamed, base_gemm, base_kernels = seconds, streamed, gemm, kernels
                    base_queued, base_gemm_queued, base_host = queued, gemm_queued, host
                gpu = "H200"
                predicted = (split_gemm_seconds(m, n, k, parts, "bfloat16", gpu=gpu) /
                             gemm_seconds(m, n, k, "bfloat16", gpu=gpu)) if parts else 1.0
                # what a part costs beyond its share of the GEMM (measured split) when the host keeps up
                per_part = ((streamed - base_streamed) - (gemm - base_gemm)) / (parts - 1) if parts else 0.0
                # the same on the device alone (every call queued before the first runs)
                per_part_device = (((queued - base_queued) - (gemm_queued - base_gemm_queued)) / (parts - 1)
                                   if parts and queued is not None else (0.0 if queued is not None else None))
                rows.append({"kind": kind, "compile_mode": args.compile_mode, "m": m, "n": n, "k": k, "parts": parts or 1,
                             "rewritten": rewritten, "relative_error": error, "seconds": seconds, "ratio": seconds / base,
                             "back_to_back_seconds": streamed, "back_to_back_ratio": streamed / base_streamed,
                             "split_gemm_seconds": gemm, "per_part_overhead_s": per_part,
                             "device_only_seconds": queued, "split_gemm_device_only_seconds": gemm_queued,
                             "per_part_device_overhead_s": per_part_device,
                             "host_issue_seconds": host,
                             "host_issue_per_extra_part_s": ((host - base_host) / (parts - 1)
                                                             if parts and host is not None else None),
                             "kernels_per_call": kernels,
                             "kernels_per_extra_part": ((kernels - base_kernels) / (parts - 1)
                                                        if parts and kernels is not None else None),
                             "model_gemm_ratio": predicted})
                done += 1
                print(f"[{done}/{total}] {kind:22s} m={m:<6d} d={parts or 1}: {seconds * 1e6:9.1f} us alone, "
                      f"{streamed * 1e6:9.1f} us back to back ({streamed / base_streamed:.2f}x of sequential; "
                      f"split GEMM {gemm / base_gemm:.2f}x, model {predicted:.2f}x); per extra part "
                      f"{per_part * 1e6:.1f} us (device alone: "
                      f"{'-' if per_part_device is None else f'{per_part_device * 1e6:.1f} us'}; host issue "
                      f"{'-' if host is None else f'{host * 1e6:.1f} us'}), kernels {kernels}, "
                      f"error {error:.1e}",
                      flush=True)
    wrong = [r for r in rows if r["relative_error"] > (2e-2 if dtype == torch.bfloat16 else 1e-4)]
    if wrong:
        raise SystemExit(f"decompose_overhead: {len(wrong)} rewritten pairs disagree with the sequential result: "
                         + ", ".join(f"{r['kind']} m={r['m']} d={r['parts']} ({r['relative_error']:.1e})" for r in wrong))
    device_overheads = sorted(r["per_part_device_overhead_s"] for r in rows
                              if r["parts"] > 1 and r["per_part_device_overhead_s"] is not None)
    host_parts = sorted(r["host_issue_per_extra_part_s"] for r in rows
                        if r["parts"] > 1 and r["host_issue_per_extra_part_s"] is not None)
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "median_host_issue_per_extra_part_s": statistics.median(host_parts) if host_parts else None,
            "torch": torch.__version__, "dtype": str(dtype), "compile_mode": args.compile_mode,
            "median_per_part_device_overhead_s": statistics.median(device_overheads) if device_overheads else None,
            "rows": rows}


def markdown(result: dict, title: str) -> str:
    """The result as the markdown file beside its JSON."""
    us = ("seconds", "back_to_back_seconds", "split_gemm_seconds", "per_part_overhead_s", "device_only_seconds",
          "per_part_device_overhead_s", "host_issue_seconds", "host_issue_per_extra_part_s")
    rows = [dict(r, **{k + "_us": r[k] * 1e6 for k in us if r.get(k) is not None}) for r in result["rows"]]
    device, host = (result.get(k) for k in ("median_per_part_device_overhead_s", "median_host_issue_per_extra_part_s"))
    lines = [f"# {title}", "",
             f"{result['device']}, torch {result['torch']}, {result['dtype']}, one-rank group, Inductor mode "
             f"{result.get('compile_mode', 'default')}.  Per extra part: what a part costs beyond its share of the "
             "GEMM (the split GEMM timed alone), as issued back to back and on the device alone (calls queued "
             "behind a GPU sleep), and the host's issue.", "",
             "* median per extra part on the device alone: " + ("-" if device is None else f"{device * 1e6:.1f} us"),
             "* median host issue per extra part: " + ("-" if host is None else f"{host * 1e6:.1f} us"), "",
             markdown_table(rows, ["kind", "m", "n", "k", "parts", ("back_to_back_seconds_us", "back to back us"),
                                   ("back_to_back_ratio", "x sequential"), ("per_part_overhead_s_us", "per part us"),
                                   ("per_part_device_overhead_s_us", "per part, device us"),
                                   ("host_issue_seconds_us", "host issue us"),
                                   ("host_issue_per_extra_part_s_us", "host issue per part us"),
                                   ("kernels_per_call", "kernels"), ("relative_error", "rel. error")])]
    return "\n".join(lines) + "\n"


def write_markdown(json_path: Path) -> Path:
    md = json_path.with_suffix(".md")
    md.write_text(markdown(json.loads(json_path.read_text()), json_path.stem))
    return md


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, gloo")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--parts", default=",".join(map(str, PARTS)), help="part counts to decompose into (default 2,4,8)")
    p.add_argument("--compile-mode", default="default", choices=("default", "reduce-overhead", "max-autotune"),
                   help="Inductor mode of every compiled variant (reduce-overhead: CUDA graphs)")
    p.add_argument("--out", default=None,
                   help="JSON path (default benchmarks/results/decompose_overhead/decompose_overhead-<device>[-<mode>].json)")
    p.add_argument("--render", default=None, metavar="FILE",
                   help="no GPU: write the markdown beside a result file (JSON) and exit")
    args = p.parse_args()
    if args.render:
        print(f"wrote {write_markdown(Path(args.render))}")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo" if args.dry_run else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    if not args.dry_run:
        torch.cuda.set_device(0)
    try:
        result = run(args)
    finally:
        dist.destroy_process_group()
    mode = "" if args.compile_mode == "default" else f"-{args.compile_mode}"
    out = Path(args.out or f"benchmarks/results/decompose_overhead/decompose_overhead-{'cpu' if args.dry_run else 'h200'}{mode}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} and {write_markdown(out)}")


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    main()
