"""The fused operators' GEMM against one cuBLAS call: the same product cut into row pieces.

Why: a fused operator multiplies each shard as it arrives, one cuBLAS call per piece on the
caller's stream (``compass_fx.kernels.protocol``: ``world_size`` pieces, more when host-staged).
It only pays if those calls together are nearly as fast as one call over all rows.  Goal (issue 9):
>= 0.90 of the unsplit ``torch.mm`` on the 12 TP=8 Llama-3 shapes (tokens 4096 and 16384; QKV
N=(H+2*KV)/8, gate+up N=2*I/8 with K=H, down K=I/8 with N=H; 8B: H=4096, KV=1024, I=14336; 70B:
H=8192, KV=1024, I=28672), at 8 pieces (TP=8) and, for reference, 2 and 4.  The cost model's
prediction of the same ratio (``compass_fx.cost.split_gemm_seconds``) is printed beside it.

Timing: CUDA events around 20 back-to-back repetitions, median of 7; bf16; one GPU.

    python benchmarks/chunked_gemm.py        # writes chunked_gemm-h200.{json,md}
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import output, timing  # noqa: E402  (sets the no-multicast environment first)
import torch  # noqa: E402

NAME = "chunked_gemm"
TP = 8
MODELS = {"llama3-8b": (4096, 1024, 14336), "llama3-70b": (8192, 1024, 28672)}
TOKENS = (4096, 16384)
PIECES = (2, 4, 8)
GOAL = 0.90


def shapes() -> list[dict]:
    out = []
    for model, (h, kv, inter) in MODELS.items():
        for m in TOKENS:
            out += [dict(model=model, proj="qkv", m=m, n=(h + 2 * kv) // TP, k=h),
                    dict(model=model, proj="gate_up", m=m, n=2 * inter // TP, k=h),
                    dict(model=model, proj="down", m=m, n=h, k=inter // TP)]
    return out


def seconds(fn, reps: int = 20, rounds: int = 7) -> float:
    """Median over rounds of the mean seconds of ``reps`` back-to-back calls."""
    for _ in range(3):
        fn()
    return timing.median_batch_seconds(fn, reps, rounds)


def measure(shape: dict) -> dict:
    from compass_fx.cost import gemm_seconds, split_gemm_seconds

    m, n, k = shape["m"], shape["n"], shape["k"]
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()  # nn.Linear's layout, used transposed
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    whole = seconds(lambda: torch.mm(a, w, out=out))
    row = dict(shape, unsplit_ms=whole * 1e3)
    for pieces in PIECES:
        step = m // pieces
        views = [(a[i * step:(i + 1) * step], out[i * step:(i + 1) * step]) for i in range(pieces)]

        def chunked():
            for x, y in views:
                torch.mm(x, w, out=y)
        t = seconds(chunked)
        row[f"pieces{pieces}_ms"] = t * 1e3
        row[f"pieces{pieces}_efficiency"] = whole / t
        row[f"pieces{pieces}_model_efficiency"] = (gemm_seconds(m, n, k, "bfloat16", "H200")
                                                   / split_gemm_seconds(m, n, k, pieces, "bfloat16", "H200"))
    return row


def markdown(payload: dict) -> str:
    lines = [f"# {NAME} ({payload['tag']})", "",
             f"Efficiency = one torch.mm over all rows / the same product as N row pieces (goal >= {GOAL} at "
             "8 pieces); bf16, median of 7 x 20 back-to-back calls; model = cost model's prediction.", "",
             f"* worst efficiency at 8 pieces: {payload['summary']['worst_8']:.3f}; median "
             f"{payload['summary']['median_8']:.3f}; goal met on {payload['summary']['met_8']} of "
             f"{len(payload['rows'])} shapes", "",
             output.markdown_table(payload["rows"], [
                 "model", "proj", "m", "n", "k", ("unsplit_ms", "unsplit ms"), ("pieces2_efficiency", "eff. 2"),
                 ("pieces4_efficiency", "eff. 4"), ("pieces8_efficiency", "eff. 8"),
                 ("pieces8_model_efficiency", "model eff. 8")])]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = output.one_gpu_args(__doc__, argv, "chunked_gemm measures cuBLAS on a CUDA GPU")
    t0 = time.time()
    rows = [measure(s) for s in shapes()]
    eff8 = [r["pieces8_efficiency"] for r in rows]
    payload = {"benchmark": NAME, "tag": args.tag, "environment": output.environment(False),
               "seconds": time.time() - t0, "rows": rows,
               "summary": {"worst_8": min(eff8), "median_8": statistics.median(eff8),
                           "met_8": sum(e >= GOAL for e in eff8)}}
    return output.print_and_write(NAME, args, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
