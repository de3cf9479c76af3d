"""The fused operators' GEMM against one cuBLAS call: the same product cut into row pieces.

Why: a fused operator multiplies each shard as it arrives, one cuBLAS call per piece on the
caller's stream (``compass_fx.kernels.protocol``: ``world_size`` pieces, more when host-staged).
It only pays if those calls together are nearly as fast as one call over all rows.  Goal (issue 9):
>= 0.90 of the unsplit ``torch.mm`` on the 12 TP=8 Llama-3 shapes (tokens 4096 and 16384; QKV
N=(H+2*KV)/8, gate+up N=2*I/8 with K=H, down K=I/8 with N=H; 8B: H=4096, KV=1024, I=14336; 70B:
H=8192, KV=1024, I=28672).  Measured: N equal pieces (2, 4, 8), and the consumer as the fused
all-gather runs it at TP = 8 (``consumer``): the own block, then the 7 arriving blocks in the
groups that ``protocol.consumer_groups`` forms (GEMMs of at least two waves of tiles; one wave
for comparison), the rows and
GEMM calls of rank 0's plan.  The cost model's prediction of the 8-piece ratio
(``compass_fx.cost.split_gemm_seconds``) is printed beside it.

Also the consumer's GEMMs alternating over two streams (do cuBLAS calls of thin pieces run side
by side?) and its tail: the last GEMM alone, which is what a fused call adds to its
communication where communication is the longer.  Measured: two streams do not help (cuBLAS's
Hopper kernels launch about one CTA per SM, so thin pieces still run one after the other), and a
product of one wave of tiles (QKV at 4096 tokens) keeps 95-96% of its time in the tail however
its own block is split off.

And the other design issue 9 offers: one Triton GEMM over the whole product whose programs each
wait for their row block (``harness/triton_consumer.py``; bounded polls, a miss recorded), timed
with every block ready, so what it costs beside cuBLAS is its tiles and its wait.

Timing: CUDA events around 20 back-to-back repetitions queued before the first starts (the
device's time: a 512-row piece's GEMM is shorter than its launch on the host), median of 9
rounds in which every candidate is timed once (interleaved, so clock drift hits them alike);
bf16; one GPU.

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


def interleaved_seconds(fns: dict, reps: int = 20, rounds: int = 9) -> dict:
    """Per candidate, the median over ``rounds`` of the mean seconds of ``reps`` back-to-back
    calls, all queued before the first starts (the device's time: a 512-row piece's GEMM takes
    less than the host's launch of it); every round times each candidate once, so that clock
    drift hits them all alike."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(timing.queued_batch_seconds(fn, reps))
    return {name: statistics.median(t) for name, t in times.items()}


def pieces_fn(a, w, out, spans, streams: int = 1):
    """The GEMMs of ``spans`` in order, round robin over ``streams`` CUDA streams (the caller's
    first): each side stream starts after the caller's prior work and the caller waits for it at
    the end, as a fused call's streams do."""
    views = [(a[lo:hi], out[lo:hi]) for lo, hi in spans]
    side = [torch.cuda.Stream() for _ in range(streams - 1)]

    def run():
        main = torch.cuda.current_stream()
        for s in side:
            s.wait_stream(main)
        lanes = [main, *side]
        for i, (x, y) in enumerate(views):
            with torch.cuda.stream(lanes[i % streams]):
                torch.mm(x, w, out=y)
        for s in side:
            main.wait_stream(s)
    return run


def consumer_spans(m: int, n: int, sms: int, waves: int | None = None) -> list[tuple[int, int]]:
    """Output rows of each GEMM of rank 0's fused all-gather plan at TP = 8, its arrivals grouped
    into GEMMs of at least ``waves`` waves of tiles (default: the rule the CUDA path uses)."""
    from compass_fx.kernels import protocol

    group_rows = protocol.consumer_group_rows(n, sms, waves or protocol.CONSUMER_WAVES)
    plan = protocol.all_gather_plan("direct", TP, 0, m // TP, 1, 1, group_rows)
    return [(c.dst.start, c.dst.stop) for c in plan.commands if isinstance(c, protocol.Matmul)]


def triton_fn(a, w, out):
    """The Triton GEMM waiting per row block (``harness.triton_consumer``), every block marked
    ready: (the call, its checks: the error against torch.mm, the tile chosen, missed waits)."""
    from harness.triton_consumer import best_tile, gemm_waiting_per_tile

    ready = torch.ones(TP, device="cuda", dtype=torch.int32)
    missed = torch.zeros(1, device="cuda", dtype=torch.int32)
    gemm_waiting_per_tile(a, w, out, ready, missed)  # autotunes for this shape
    ref = torch.mm(a, w)
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    checks = {"triton_tile": best_tile(), "triton_error": err, "triton_missed_waits": int(missed.item())}
    if err > 1e-2 or checks["triton_missed_waits"]:
        raise RuntimeError(f"the Triton consumer is wrong on {tuple(a.shape)} x {tuple(w.shape)}: {checks}")
    return (lambda: gemm_waiting_per_tile(a, w, out, ready, missed)), checks


def bounded_wait_check() -> dict:
    """The wait gives up: no block ever ready, 1000 polls each, every program records a miss."""
    from harness.triton_consumer import gemm_waiting_per_tile

    a = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1024, 256, device="cuda", dtype=torch.bfloat16)
    missed = torch.zeros(1, device="cuda", dtype=torch.int32)
    start = time.time()
    gemm_waiting_per_tile(a, w, out, torch.zeros(TP, device="cuda", dtype=torch.int32), missed, max_spins=1000)
    torch.cuda.synchronize()
    return {"missed_waits": int(missed.item()), "seconds": round(time.time() - start, 2)}


def measure(shape: dict) -> dict:
    from compass_fx.cost import gemm_seconds, split_gemm_seconds

    m, n, k = shape["m"], shape["n"], shape["k"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()  # nn.Linear's layout, used transposed
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    spans = {"unsplit": [(0, m)]}
    spans.update({f"pieces{p}": [(i * m // p, (i + 1) * m // p) for i in range(p)] for p in PIECES})
    spans["consumer"] = consumer_spans(m, n, sms)
    spans["consumer_1wave"] = consumer_spans(m, n, sms, 1)
    spans["tail"] = spans["consumer"][-1:]  # what is left after the last arrival
    fns = {name: pieces_fn(a, w, out, s) for name, s in spans.items()}
    spans["consumer_2streams"] = spans["consumer"]
    fns["consumer_2streams"] = pieces_fn(a, w, out, spans["consumer"], 2)
    fns["triton_per_tile"], triton_checks = triton_fn(a, w, out)
    t = interleaved_seconds(fns)
    whole = t["unsplit"]
    row = dict(shape, unsplit_ms=whole * 1e3, **triton_checks)
    row["triton_per_tile_ms"], row["triton_per_tile_efficiency"] = t["triton_per_tile"] * 1e3, whole / t["triton_per_tile"]
    for name in spans:
        if name == "unsplit":
            continue
        if name == "tail":
            row["tail_ms"], row["tail_share"] = t[name] * 1e3, t[name] / whole
            continue
        row[f"{name}_ms"] = t[name] * 1e3
        row[f"{name}_efficiency"] = whole / t[name]
    for p in PIECES:
        row[f"pieces{p}_model_efficiency"] = (gemm_seconds(m, n, k, "bfloat16", "H200")
                                              / split_gemm_seconds(m, n, k, p, "bfloat16", "H200"))
    for name in ("consumer", "consumer_1wave"):
        row[f"{name}_groups"] = "+".join(str((hi - lo) // (m // TP)) for lo, hi in spans[name])
    return row


def markdown(payload: dict) -> str:
    lines = [f"# {NAME} ({payload['tag']})", "",
             f"Efficiency = one torch.mm over all rows / the same product as N row pieces (goal >= {GOAL} at "
             "8 pieces); bf16, device time: median of 9 rounds of 20 back-to-back calls queued before the first "
             "starts, the candidates interleaved in each round; "
             "model = cost model's prediction; consumer: own block + arrivals grouped into GEMMs of >= 2 waves of "
             "tiles (the CUDA path's rule, protocol.consumer_group_rows), 1-wave: the same with >= 1 wave.", "",
             f"* worst efficiency at 8 pieces: {payload['summary']['worst_8']:.3f}; median "
             f"{payload['summary']['median_8']:.3f}; goal met on {payload['summary']['met_8']} of "
             f"{len(payload['rows'])} shapes", "",
             f"* the consumer as grouped (own block, then groups of arrivals): worst "
             f"{payload['summary']['worst_consumer']:.3f}; median {payload['summary']['median_consumer']:.3f}; "
             f"goal met on {payload['summary']['met_consumer']} of {len(payload['rows'])} shapes; on two "
             f"streams (alternating): worst {payload['summary']['worst_consumer_2streams']:.3f}, median "
             f"{payload['summary']['median_consumer_2streams']:.3f}", "",
             f"* the Triton GEMM waiting per row block (one launch, harness/triton_consumer.py), every block "
             f"ready: worst {payload['summary']['worst_triton']:.3f}; median {payload['summary']['median_triton']:.3f}; "
             f"goal met on {payload['summary']['met_triton']} of {len(payload['rows'])} shapes; by the better of "
             f"the two consumers per shape: {payload['summary']['met_either']} of {len(payload['rows'])}; its "
             f"bounded wait, no block ever ready: {payload['summary']['bounded_wait_check']['missed_waits']} "
             "programs gave up and said so (the autotuner's trial runs included)", "",
             "* tail / unsplit: the consumer's last GEMM (what is left to do after the last arrival) against "
             "the whole product: what the fused call adds to its communication when communication is the longer", "",
             output.markdown_table(payload["rows"], [
                 "model", "proj", "m", "n", "k", ("unsplit_ms", "unsplit ms"), ("pieces2_efficiency", "eff. 2"),
                 ("pieces4_efficiency", "eff. 4"), ("pieces8_efficiency", "eff. 8"),
                 ("pieces8_model_efficiency", "model eff. 8"), ("consumer_groups", "consumer GEMMs (blocks)"),
                 ("consumer_efficiency", "consumer eff."), ("consumer_2streams_efficiency", "2 streams eff."),
                 ("triton_per_tile_efficiency", "Triton per-tile eff."), ("triton_tile", "Triton tile"),
                 ("tail_share", "tail / unsplit"), ("consumer_1wave_groups", "1-wave groups"),
                 ("consumer_1wave_efficiency", "1-wave eff.")])]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = output.one_gpu_args(__doc__, argv, "chunked_gemm measures cuBLAS on a CUDA GPU")
    t0 = time.time()
    wait_check = bounded_wait_check()
    if wait_check["missed_waits"] == 0:
        raise RuntimeError(f"the Triton consumer's bounded wait recorded no miss: {wait_check}")
    rows = [measure(s) for s in shapes()]
    eff8 = [r["pieces8_efficiency"] for r in rows]
    grouped = [r["consumer_efficiency"] for r in rows]
    payload = {"benchmark": NAME, "tag": args.tag, "environment": output.environment(False),
               "seconds": time.time() - t0, "rows": rows,
               "summary": {"worst_8": min(eff8), "median_8": statistics.median(eff8),
                           "met_8": sum(e >= GOAL for e in eff8),
                           "worst_consumer": min(grouped), "median_consumer": statistics.median(grouped),
                           "met_consumer": sum(e >= GOAL for e in grouped),
                           "worst_triton": min(r["triton_per_tile_efficiency"] for r in rows),
                           "median_triton": statistics.median(r["triton_per_tile_efficiency"] for r in rows),
                           "met_triton": sum(r["triton_per_tile_efficiency"] >= GOAL for r in rows),
                           "met_either": sum(max(r["triton_per_tile_efficiency"], r["consumer_efficiency"]) >= GOAL
                                             for r in rows),
                           "bounded_wait_check": wait_check,
                           "worst_consumer_2streams": min(r["consumer_2streams_efficiency"] for r in rows),
                           "median_consumer_2streams": statistics.median(r["consumer_2streams_efficiency"]
                                                                         for r in rows)}}
    return output.print_and_write(NAME, args, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
