"""Can copy kernels overlap a GEMM once cuBLAS leaves them some SMs?  (issue 27, one GPU)

Why: in an eager call's replay graph every copy to or from host memory on the copy engines, and
every stream wait, costs ``cuGraphLaunch`` ~1.8 us of host, while a kernel node costs ~0.1-0.2
(``host_cost_probe``).  Copy kernels were measured not to overlap a large cuBLAS GEMM
(``graph_node_probe-h200-copy``: the sum of the two times): Hopper's GEMMs are persistent and hold
every SM.  ``torch._C._set_sm_carveout_experimental(c)`` asks cuBLAS to leave ``c`` SMs free.  This
measures, per carveout: the GEMM's device time alone (what the carveout costs it), and 8 x 4 MiB to
or from registered host memory as copy kernels of 4-32 blocks (and on the copy engines), alone and
beside the GEMM on a high-priority stream.  ``overlap`` = (GEMM + copies - both) / the shorter:
1 hides the shorter entirely, 0 is no overlap.

    python benchmarks/sm_carveout_probe.py --out X.json [--blas cublaslt] [--copies-first]
    python benchmarks/sm_carveout_probe.py --render X.json     # X.md beside it
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

PIECES, PIECE_BYTES = 8, 4 << 20
_kept: list = []


def host_buffer(nbytes: int) -> int:
    """Address of ``nbytes`` of registered (pinned, mapped) host memory, kept for the process."""
    from compass_fx.kernels.cuda import driver

    m = mmap.mmap(-1, nbytes)
    t = torch.frombuffer(m, dtype=torch.uint8)
    _kept.append((m, t))
    return driver.host_register(t.data_ptr(), nbytes)


def device_ms(fn, rounds: int = 9, per_round: int = 5) -> float:
    """Median device ms of ``fn`` (events around ``per_round`` calls, after one call to warm up)."""
    from compass_fx.tools.timing import batch_seconds

    fn()
    torch.cuda.synchronize()
    return statistics.median(batch_seconds(fn, per_round, True) for _ in range(rounds)) * 1e3


def allocation_us(calls: int = 2000) -> dict[str, float]:
    """Host us of the ways an eager call could allocate its two outputs (a gathered 8192 x 4096 and
    an 8192 x 7168 product, bf16): where ``--breakdown``'s 16-25 us of outputs could shrink."""
    import time

    like = torch.empty(8, 8, device="cuda", dtype=torch.bfloat16)
    dev, dt = like.device, like.dtype
    shapes = ((8192, 4096), (8192, 7168))
    sizes = [r * c for r, c in shapes]
    empty_mf = torch.ops.aten.empty.memory_format

    def flat():
        buf = torch.empty(sum(sizes), dtype=dt, device=dev)
        return buf[:sizes[0]].view(shapes[0]), buf[sizes[0]:].view(shapes[1])

    ways = {
        "new_empty x2": lambda: [like.new_empty(s) for s in shapes],
        "torch.empty x2": lambda: [torch.empty(s, dtype=dt, device=dev) for s in shapes],
        "aten.empty.memory_format x2": lambda: [empty_mf(s, dtype=dt, device=dev) for s in shapes],
        "one torch.empty + 2 views": flat,
        "torch.empty x1": lambda: torch.empty(shapes[0], dtype=dt, device=dev),
    }
    out = {}
    for name, fn in ways.items():
        best = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best.append((time.perf_counter() - t0) / calls * 1e6)
        out[name] = min(best)
    return out


def markdown(payload: dict, name: str) -> str:
    """The rows as a table, with what they say in one line above."""
    lines = [f"# {name}", "", f"{payload['device']}, torch {payload['torch']}, BLAS {payload['blas']}, "
             f"copies issued {'before' if payload['copies_first'] else 'after'} the GEMM; "
             f"{payload['pieces']} x {payload['piece_bytes'] >> 20} MiB to (d2h) or from (h2d) registered host memory; "
             "blocks 0 = the copy engines. overlap = (GEMM + copies - both) / the shorter.", "",
             "| carveout | m x k x n | kind | blocks | GEMM ms | copies ms | both ms | overlap | GB/s | correct |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        if "error" in r:
            lines.append(f"| {r['carveout']} | {r['m']}x{r['k']}x{r['n']} | {r['kind']} | {r['blocks']} | "
                         f"{r['error']} |||||")
            continue
        lines.append(f"| {r['carveout']} | {r['m']}x{r['k']}x{r['n']} | {r['kind']} | {r['blocks']} | "
                     f"{r['gemm_ms']:.3f} | {r['copy_ms']:.3f} | {r['both_ms']:.3f} | {r['overlap']:.2f} | "
                     f"{r['GBps']:.1f} | {r['correct']} |")
    alloc = payload.get("allocations_us", {})
    if alloc:
        lines += ["", "Host us to allocate two outputs (8192 x 4096 and 8192 x 7168 bf16): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in alloc.items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from compass_fx.kernels.cuda import driver, graph_flags

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--render", help="write the markdown of this JSON beside it, and stop")
    p.add_argument("--out")
    p.add_argument("--carveouts", default="0,8,16,32")
    p.add_argument("--blocks", default="4,8,16,32")
    p.add_argument("--blas", default="", help="torch.backends.cuda.preferred_blas_library (e.g. cublaslt)")
    p.add_argument("--copies-first", action="store_true", help="issue the copies before the GEMM")
    args = p.parse_args(argv)
    if args.render:
        path = os.path.splitext(args.render)[0]
        with open(path + ".md", "w") as f:
            f.write(markdown(json.load(open(args.render)), os.path.basename(path)))
        return 0
    if not args.out:
        p.error("--out is required")
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    memcpy = driver.raw("memcpy")
    total = PIECES * PIECE_BYTES
    src = torch.empty(total, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    host = host_buffer(total)
    side, main_stream = torch.cuda.Stream(priority=-1), torch.cuda.current_stream()
    blocks_list = [int(b) for b in args.blocks.split(",")]
    kernels = {(kind, b, i): graph_flags.copy_wide(dev, PIECE_BYTES, b)
               for kind in ("d2h", "h2d") for b in blocks_list for i in range(PIECES)}

    def copies(kind: str, blocks: int):
        def fn() -> None:
            h = side.cuda_stream
            for i in range(PIECES):
                off = i * PIECE_BYTES
                d, s = (host + off, src.data_ptr() + off) if kind == "d2h" else (dst.data_ptr() + off, host + off)
                if blocks == 0:
                    driver.check(memcpy(d, s, PIECE_BYTES, h), "cuMemcpyAsync")
                else:
                    launch, aim = kernels[(kind, blocks, i)]
                    aim(d, s)
                    launch(h)
        return fn

    shapes = [(8192, 4096, 7168), (4096, 4096, 7168)]
    rows = []
    for carveout in (int(c) for c in args.carveouts.split(",")):
        torch._C._set_sm_carveout_experimental(carveout or None)
        for m, k, n in shapes:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = a @ b
            gemm_ms = device_ms(lambda: torch.mm(a, b, out=c))
            for kind in ("d2h", "h2d"):
                for blocks in [0] + blocks_list:
                    fn = copies(kind, blocks)

                    def alone() -> None:
                        side.wait_stream(main_stream)
                        fn()
                        main_stream.wait_stream(side)

                    def beside() -> None:
                        side.wait_stream(main_stream)
                        if args.copies_first:
                            fn()
                        torch.mm(a, b, out=c)
                        if not args.copies_first:
                            fn()
                        main_stream.wait_stream(side)
                    row = {"carveout": carveout, "sms": sms, "m": m, "k": k, "n": n, "kind": kind, "blocks": blocks}
                    try:
                        copy_ms, both_ms = device_ms(alone), device_ms(beside)
                        torch.cuda.synchronize()
                        correct = bool(torch.equal(c, ref))
                        if kind == "h2d":
                            dst.zero_()
                            alone()
                            torch.cuda.synchronize()
                            correct = correct and bool(torch.equal(dst, src))  # the d2h rows ran first: host == src
                        shorter = min(gemm_ms, copy_ms)
                        row.update(gemm_ms=gemm_ms, copy_ms=copy_ms, both_ms=both_ms, GBps=total / copy_ms / 1e6,
                                   overlap=(gemm_ms + copy_ms - both_ms) / shorter, correct=correct)
                    except Exception as e:  # noqa: BLE001 - recorded, the matrix goes on
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    torch._C._set_sm_carveout_experimental(None)
    allocations = allocation_us()
    print(json.dumps(allocations), flush=True)
    payload = {"blas": str(torch.backends.cuda.preferred_blas_library()), "copies_first": args.copies_first,
               "allocations_us": allocations, "benchmark": "sm_carveout_probe", "device": torch.cuda.get_device_name(dev),
               "torch": torch.__version__, "pieces": PIECES, "piece_bytes": PIECE_BYTES, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
