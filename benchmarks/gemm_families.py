"""The GEMM model's thin parts on a broad set of shapes: several model families, TP 2, 4 and 8,
2048-16384 tokens, each projection's GEMM split into 2-8 parts along its rows (a forward pair's
InterDecom) and its weight gradient split along the contraction (the gathered rows of a
backward pair's weight gradient), in device time on one GPU.

Why (issue 27): the built-in constants were fitted to Llama-3 shapes only; a family held out of
the fit says whether they carry over.  This script only measures (every call queued behind a GPU
sleep: the GEMMs' own time, what the model predicts); ``--analyse FILE`` (no GPU) prices every
measurement with the code's constants and fits them with each family held out in turn.

    python benchmarks/gemm_families.py --deadline 240     # one GPU: gemm_families-h200.json
    python benchmarks/gemm_families.py --analyse benchmarks/results/gemm_families/gemm_families-h200.json
    python benchmarks/gemm_families.py --analyse benchmarks/results/gemm_families/gemm_families-h200.json \
        --constants FIT.json --tag h200-devicetime-fit    # priced with a --fit-jointly result's constants
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness.output import RESULTS, markdown_table  # noqa: E402

NAME = "gemm_families"
# hidden, attention width (query heads x head dim), KV width, FFN (public model configs)
FAMILIES = {"llama3-8b": (4096, 4096, 1024, 14336), "llama3-70b": (8192, 8192, 1024, 28672),
            "llama3.1-405b": (16384, 16384, 1024, 53248), "qwen2.5-7b": (3584, 3584, 512, 18944),
            "qwen2.5-72b": (8192, 8192, 1024, 29568), "gemma2-9b": (3584, 4096, 2048, 14336),
            "gemma2-27b": (4608, 4096, 2048, 36864), "mistral-nemo-12b": (5120, 4096, 1024, 14336)}
TPS, TOKENS, PARTS = (2, 4, 8), (2048, 4096, 8192, 16384), (1, 2, 4, 8)


def shapes() -> list[dict]:
    """Every (family, tp, tokens, projection): the forward GEMM (m = tokens, n, k)."""
    out = []
    for family, (hidden, attn, kv, ffn) in FAMILIES.items():
        for tp in TPS:
            for m in TOKENS:
                for proj, n, k in (("qkv", (attn + 2 * kv) // tp, hidden), ("attn_out", hidden, attn // tp),
                                   ("gate_up", 2 * ffn // tp, hidden), ("down", hidden, ffn // tp)):
                    out.append(dict(family=family, tp=tp, tokens=m, proj=proj, m=m, n=n, k=k))
    return out


def device_seconds(fn, sleep_s: float = 5e-3, rounds: int = 3) -> float:
    """Median over rounds of the device seconds of ``fn`` queued behind a GPU sleep."""
    import torch

    from compass_fx.tools.timing import H200_CLOCK_HZ

    fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        torch.cuda._sleep(int(sleep_s * H200_CLOCK_HZ))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        per.append(start.elapsed_time(end) / 1e3)
    return statistics.median(per)


def measure(shape: dict, device: str, dtype) -> list[dict]:
    """Rows: the forward GEMM split along its rows, its weight gradient along the contraction."""
    import torch

    m, n, k = shape["m"], shape["n"], shape["k"]
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(k, n, device=device, dtype=dtype)
    dy = torch.randn(m, n, device=device, dtype=dtype)
    y = torch.empty(m, n, device=device, dtype=dtype)
    rows = []
    for parts in PARTS:
        r = m // parts
        pieces = [(x[i * r:(i + 1) * r], y[i * r:(i + 1) * r]) for i in range(parts)]

        def forward(pieces=pieces):
            for a, out in pieces:
                torch.mm(a, w, out=out)
        xt = x.t()
        grads = torch.empty(parts, k, n, device=device, dtype=dtype)
        cuts = [(xt[:, i * r:(i + 1) * r], dy[i * r:(i + 1) * r], grads[i]) for i in range(parts)]

        def weight_grad(cuts=cuts):  # the parts' partial products (their sum is elementwise, not timed)
            for a, b, out in cuts:
                torch.mm(a, b, out=out)
        rows.append(dict(shape, split="rows", gemm_m=m, gemm_n=n, gemm_k=k, parts=parts,
                         seconds=device_seconds(forward)))
        rows.append(dict(shape, split="contraction", gemm_m=k, gemm_n=n, gemm_k=m, parts=parts,
                         seconds=device_seconds(weight_grad)))
        del grads, cuts
    return rows


def run(args) -> int:
    import torch

    from harness.output import environment

    todo = shapes()
    random.Random(0).shuffle(todo)  # every family measured early, should the deadline come first
    device, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    if args.dry_run:
        todo = [dict(s, m=64, n=48, k=32) for s in todo[:3]]
    payload = {"benchmark": NAME, "tag": args.tag, "environment": environment(args.dry_run), "rows": [],
               "complete": False}
    out = os.path.join(args.out_dir, f"{NAME}-{args.tag}.json")
    t0 = time.time()
    for i, shape in enumerate(todo):
        if time.time() - t0 > args.deadline:
            break
        if args.dry_run:
            payload["rows"] += [dict(shape, split=s, parts=p, gemm_m=shape["m"], gemm_n=shape["n"], gemm_k=shape["k"],
                                     seconds=1e-3) for s in ("rows", "contraction") for p in PARTS]
        else:
            payload["rows"] += measure(shape, device, dtype)
            torch.cuda.empty_cache()
        if i % 20 == 0:
            print(f"[{i + 1}/{len(todo)}] {time.time() - t0:.0f} s", flush=True)
    payload["complete"] = len(payload["rows"]) == 2 * len(PARTS) * len(todo)
    payload["seconds"] = time.time() - t0
    os.makedirs(args.out_dir, exist_ok=True)
    with open(out, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {out}: {len(payload['rows'])} measurements", flush=True)
    return 0


# ---- analysis, no GPU --------------------------------------------------------------------------
def _errors(rows: list[dict], spec) -> dict:
    """Split/unsplit ratio errors (per split kind) and unsplit time errors of the model with ``spec``."""
    from compass_fx.cost.gemm import gemm_seconds

    unsplit = {(r["split"], r["gemm_m"], r["gemm_n"], r["gemm_k"]): r["seconds"] for r in rows if r["parts"] == 1}
    ratio = {"rows": [], "contraction": []}
    times = []
    for r in rows:
        m, n, k, p = r["gemm_m"], r["gemm_n"], r["gemm_k"], r["parts"]
        whole = gemm_seconds(m, n, k, "bfloat16", spec)
        if p == 1:
            if r["split"] == "rows":  # each forward GEMM once (the contraction's unsplit is another GEMM)
                times.append(abs(whole / r["seconds"] - 1))
            continue
        part = gemm_seconds(m // p, n, k, "bfloat16", spec) if r["split"] == "rows" else \
            gemm_seconds(m, n, k // p, "bfloat16", spec)
        base = unsplit.get((r["split"], m, n, k))
        if base:
            ratio[r["split"]].append(abs((p * part / whole) / (r["seconds"] / base) - 1))

    def q(v, f):
        v = sorted(v)
        return v[min(len(v) - 1, int(f * len(v)))] if v else None
    return {"ratio_median": q(ratio["rows"] + ratio["contraction"], 0.5),
            "ratio_p90": q(ratio["rows"] + ratio["contraction"], 0.9),
            "rows_ratio_median": q(ratio["rows"], 0.5), "rows_ratio_p90": q(ratio["rows"], 0.9),
            "contraction_ratio_median": q(ratio["contraction"], 0.5),
            "contraction_ratio_p90": q(ratio["contraction"], 0.9),
            "unsplit_median": q(times, 0.5), "n_ratios": len(ratio["rows"]) + len(ratio["contraction"])}


def analyse(path: str, out_dir: str, constants: str | None = None, tag: str | None = None) -> int:
    """Price every measurement with the code's H200 constants, or with those of ``constants`` (a
    ``gemm_model_validation.py --fit-jointly`` JSON: constants proposed, not yet built in), and
    fit them with each family held out in turn (each fit starts from those constants)."""
    from compass_fx.cost.gemm_fit import GemmMeasurement, fit_gpu_spec
    from compass_fx.machine.gpus import GPUS, GpuSpec

    payload = json.load(open(path))
    rows = payload["rows"]
    builtin = GPUS["H200"] if constants is None else GpuSpec.from_dict(json.load(open(constants))["constants"])
    which = "Built-in constants" if constants is None else f"Constants of {os.path.basename(constants)} (not built in)"
    result = {"source": os.path.basename(path), "constants": constants and os.path.basename(constants),
              "measurements": len(rows), "builtin": _errors(rows, builtin), "held_out": []}
    for family in sorted({r["family"] for r in rows}):
        train = [GemmMeasurement(r["gemm_m"], r["gemm_n"], r["gemm_k"], r["parts"], r["seconds"])
                 for r in rows if r["family"] != family and r["split"] == "rows"]
        spec = fit_gpu_spec(train, builtin)
        test = [r for r in rows if r["family"] == family]
        result["held_out"].append(dict(family=family, **_errors(test, spec), builtin=_errors(test, builtin)))
        print(f"held out {family}: {result['held_out'][-1]}", flush=True)
    keys = ("ratio_median", "ratio_p90", "rows_ratio_median", "contraction_ratio_median", "unsplit_median")
    for k in keys:
        vals = [h[k] for h in result["held_out"] if h[k] is not None]
        result[f"held_out_median_of_{k}"] = statistics.median(vals) if vals else None
    stem = os.path.join(out_dir, f"{NAME}-analysis-{tag or payload['tag']}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# {NAME} analysis ({payload['tag']})", "",
             f"{len(rows)} device-time measurements ({'complete' if payload.get('complete') else 'cut by the deadline'}"
             "): each projection's GEMM split into 2-8 parts along its rows, its weight gradient along the "
             "contraction. Errors of the split/unsplit ratio and of the unsplit time.", "",
             f"{which}, every family: " + ", ".join(f"{k} {v:.3f}" for k, v in result["builtin"].items()
                                                               if isinstance(v, float)), "",
             "Each family held out of a fit of the constants to the others' row splits:", "",
             markdown_table(result["held_out"], ["family", "n_ratios", ("ratio_median", "ratio median"),
                                                 ("ratio_p90", "ratio p90"), ("rows_ratio_median", "rows median"),
                                                 ("contraction_ratio_median", "contraction median"),
                                                 ("unsplit_median", "unsplit median")])]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deadline", type=float, default=240.0, help="seconds of measuring (the rest is left out)")
    p.add_argument("--tag", default="h200")
    p.add_argument("--out-dir", default=str(RESULTS / NAME))
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--analyse", default=None, metavar="FILE")
    p.add_argument("--constants", default=None, metavar="FIT_JSON",
                   help="with --analyse: price with the constants of a gemm_model_validation.py --fit-jointly "
                        "JSON instead of the built-in ones (the analysis is then named after --tag)")
    args = p.parse_args(argv)
    if args.analyse:
        if args.constants and args.tag == p.get_default("tag"):
            p.error("--constants needs a --tag of its own (the built-in analysis is gemm_families-analysis-h200)")
        return analyse(args.analyse, args.out_dir, args.constants, args.tag if args.constants else None)
    if args.dry_run:
        args.tag = "cpu"
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
