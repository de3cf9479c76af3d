"""Copy-engine bandwidth between the GPUs and pinned host memory: what host-staged transport can reach.

The host-staged fused operators move every byte twice, device -> pinned host memory -> device,
on the copy engines.  This measures, per message size: one GPU's device-to-host and host-to-device
copies alone, both directions of one GPU at once, and the same on every visible GPU at once (the
host's memory and PCIe root shared by all).  Timing: CUDA events around a batch of copies.

    python benchmarks/host_copy.py                 # every visible GPU: writes host_copy-<gpu>x<n>.{json,md}
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402  (sets the no-multicast environment first)
from harness import output  # noqa: E402
import torch  # noqa: E402

NAME = "host_copy"
SIZES_MIB = (1, 4, 16, 64, 256)


def _buffers(devices: list[int], nbytes: int) -> list[dict]:
    out = []
    for d in devices:
        out.append({"dev": torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{d}"),
                    "dev2": torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{d}"),
                    "host": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
                    "host2": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
                    "streams": [torch.cuda.Stream(device=d), torch.cuda.Stream(device=d)]})
    return out


def _time(bufs: list[dict], directions: tuple[str, ...], repeats: int) -> float:
    """Seconds per round of copies (every buffer set, every direction at once)."""
    def issue():
        for b in bufs:
            for i, direction in enumerate(directions):
                with torch.cuda.stream(b["streams"][i]):
                    if direction == "d2h":
                        b["host"].copy_(b["dev"], non_blocking=True)
                    else:
                        b["dev2"].copy_(b["host2"], non_blocking=True)

    def sync():
        for b in bufs:
            for s in b["streams"]:
                s.synchronize()

    issue()
    sync()
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            issue()
        sync()
        samples.append((time.perf_counter() - t0) / repeats)
    return statistics.median(samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--out-dir", default=str(harness.RESULTS))
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_copy.py needs CUDA GPUs", file=sys.stderr)
        return 2
    devices = list(range(torch.cuda.device_count()))
    rows = []
    for mib in SIZES_MIB:
        nbytes = mib << 20
        bufs = _buffers(devices, nbytes)
        repeats = max(3, min(50, (256 // mib)))
        cases = {"d2h, one GPU": (bufs[:1], ("d2h",)), "h2d, one GPU": (bufs[:1], ("h2d",)),
                 "both directions, one GPU": (bufs[:1], ("d2h", "h2d"))}
        if len(bufs) > 1:
            cases["d2h, every GPU"] = (bufs, ("d2h",))
            cases["both directions, every GPU"] = (bufs, ("d2h", "h2d"))
        for label, (group, directions) in cases.items():
            s = _time(group, directions, repeats)
            row = {"case": label, "mib": mib, "seconds": s,
                   "gb_per_s_per_direction_per_gpu": nbytes / s / 1e9}
            rows.append(row)
            print(f"{mib:4d} MiB {label:28s} {s * 1e6:9.1f} us  {row['gb_per_s_per_direction_per_gpu']:6.1f} GB/s",
                  flush=True)
        del bufs
        torch.cuda.empty_cache()
    tag = args.tag or output.device_tag(False, len(devices))
    payload = {"benchmark": NAME, "environment": output.environment(False), "rows": rows}
    md = [f"# Copy engines to and from pinned host memory ({tag})", "",
          "GB/s per direction per GPU; host clock around synchronised batches of copies, median of three.", "",
          output.markdown_table(rows, ["case", "mib", "seconds", "gb_per_s_per_direction_per_gpu"])]
    output.write_results(NAME, tag, payload, "\n".join(md), args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
