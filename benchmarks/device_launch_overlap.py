"""Do a replay graph's copies to and from pinned host memory overlap its GEMM when the GPU itself
launches the graph (``COMPASS_REPLAY_LAUNCH=device``)?

Why (issue 27): device launch makes a replayed fused call's host cost flat (one node of launch
whatever the plan), yet with two ranks sharing one H200 the calls' back-to-back period grew by up
to 83% against the host-launched graphs (``fused_host_time``'s period column, with and without an
SM partition and a cuBLAS carveout), and the flag waits, kernels in both, were not the cause.  The
host-staged transport exists to overlap its copies with the GEMMs; this asks whether a
device-launched graph keeps them on the copy engines beside the GEMM.

One process, one GPU: a graph of one GEMM (8192 x 4096 x 7168, bf16) on the caller's stream and
8 copies of 4 MiB between device and pinned host memory on a side branch, launched from the host
(``cuGraphLaunch``) or by the GPU (the launcher of ``compass_fx.kernels.cuda.device_launch``),
against graphs of the GEMM alone and of the copies alone: device microseconds per launch (20
back to back behind a sleeping kernel, so the launches are not the pace; median of 5).
overlap = (GEMM + copies - both) / the shorter: 1 when the copies hide entirely, 0 when they
run one after the other.  apart: the copies' graph alone, launched either way on a stream of its
own, beside a host-launched graph of the GEMM (does the GPU serialise the branches of one device
graph, or its copies whatever runs beside them?).

    python benchmarks/device_launch_overlap.py      # one GPU: writes device_launch_overlap-h200.{json,md}
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import output  # noqa: E402  (sets the no-multicast environment first)
from harness.timing import sleep_cycles_per_ms  # noqa: E402
import torch  # noqa: E402

NAME = "device_launch_overlap"
M, K, N = 8192, 4096, 7168
PIECES, PIECE_ELEMENTS = 8, 2 << 20  # 8 x 4 MiB of bf16


class Probe:
    """The tensors and streams of the graphs, and how to capture one."""

    def __init__(self, device: torch.device) -> None:
        self.a = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(K, N, device=device, dtype=torch.bfloat16)
        self.c = torch.empty(M, N, device=device, dtype=torch.bfloat16)
        self.src = torch.randn(PIECES, PIECE_ELEMENTS, device=device, dtype=torch.bfloat16)
        self.host = torch.randn(PIECES, PIECE_ELEMENTS, dtype=torch.bfloat16).pin_memory()
        self.dst = torch.empty(PIECES, PIECE_ELEMENTS, device=device, dtype=torch.bfloat16)
        self.capture_stream, self.side = torch.cuda.Stream(), torch.cuda.Stream()
        self.side_launch = torch.cuda.Stream()  # where side_by_side launches the copies' graph

    def body(self, gemm: bool, copies: bool, direction: str) -> None:
        main = torch.cuda.current_stream()
        if copies:
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                for i in range(PIECES):
                    if direction == "d2h":
                        self.host[i].copy_(self.src[i], non_blocking=True)
                    else:
                        self.dst[i].copy_(self.host[i], non_blocking=True)
        if gemm:
            torch.mm(self.a, self.b, out=self.c)
        if copies:
            main.wait_stream(self.side)

    def graph(self, gemm: bool, copies: bool, direction: str, launch: str):
        from compass_fx.kernels.cuda import device_launch
        from compass_fx.kernels.cuda.replay import Captured

        stream = self.capture_stream
        with torch.cuda.stream(stream):
            self.body(gemm, copies, direction)  # warm-up outside the capture (cuBLAS's workspace)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph(keep_graph=launch == "device")
        with torch.cuda.stream(stream):
            g.capture_begin(capture_error_mode="thread_local")
            self.body(gemm, copies, direction)
            g.capture_end()
        if launch == "host":
            return Captured(g)
        on_device = device_launch.instantiate(g, torch.cuda.current_device(), stream)
        if on_device is None:
            raise SystemExit("device_launch_overlap: the driver would not launch the graph from the GPU "
                             "(no libcudadevrt found, or the graph refused); see device_launch.py")
        return Captured(on_device.launcher, keep=on_device)


def side_by_side(copies, gemm, side: torch.cuda.Stream):
    """A launch of the copies' graph on ``side`` beside the GEMM's graph on the caller's stream,
    both after the caller's earlier work and before its later work (two graphs: the GPU may run
    two launches side by side that it runs one after the other within one graph)."""

    class Pair:
        def launch(self, stream: int) -> None:
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            copies.launch(side.cuda_stream)
            gemm.launch(stream)
            main.wait_stream(side)

    return Pair()


def device_us(captured, cycles_per_ms: float, calls: int = 20, rounds: int = 5) -> float:
    stream = torch.cuda.current_stream().cuda_stream
    for _ in range(3):
        captured.launch(stream)
    torch.cuda.synchronize()
    per_round = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(2 * cycles_per_ms))  # the host runs ahead: the launches are not the pace
        start.record()
        for _ in range(calls):
            captured.launch(stream)
        end.record()
        end.synchronize()
        per_round.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(per_round)


def markdown(payload: dict) -> str:
    return "\n".join([
        f"# {NAME} ({payload['tag']})", "",
        f"One process, one GPU: a graph of one {M} x {K} x {N} bf16 GEMM and {PIECES} copies of 4 MiB between "
        "device and pinned host memory on a side branch, launched from the host or by the GPU (device launch); "
        "device microseconds per launch, 20 back to back (median of 5). overlap = (GEMM + copies - both) / the "
        "shorter: 1 hidden entirely, 0 one after the other.", "",
        "apart: the copies' graph, launched that way, on a stream of its own beside a host-launched graph of "
        "the GEMM (two launches instead of one graph holding both).", "",
        output.markdown_table(payload["rows"], ["direction", "launch", ("gemm_us", "GEMM us"),
                                                ("copies_us", "copies us"), ("both_us", "both us"), "overlap",
                                                ("apart_us", "apart us"), ("apart_overlap", "apart overlap")])])


def main(argv=None) -> int:
    args = output.one_gpu_args(__doc__, argv, "device_launch_overlap needs a CUDA GPU")
    os.environ["COMPASS_REPLAY_LAUNCH"] = "device"  # device_launch.instantiate asks for it
    torch.cuda.init()
    cycles_per_ms = sleep_cycles_per_ms()
    probe = Probe(torch.device("cuda", torch.cuda.current_device()))
    rows = []
    for direction in ("d2h", "h2d"):
        for launch in ("host", "device"):
            row = {"direction": direction, "launch": launch}
            for name, gemm, copies in (("gemm", True, False), ("copies", False, True), ("both", True, True)):
                row[f"{name}_us"] = device_us(probe.graph(gemm, copies, direction, launch), cycles_per_ms)
            row["overlap"] = ((row["gemm_us"] + row["copies_us"] - row["both_us"])
                              / min(row["gemm_us"], row["copies_us"]))
            # the copies' graph launched this way beside a host-launched GEMM graph on another stream
            copies, gemm = probe.graph(False, True, direction, launch), probe.graph(True, False, direction, "host")
            pair = side_by_side(copies, gemm, probe.side_launch)
            row["apart_us"] = device_us(pair, cycles_per_ms)
            row["apart_overlap"] = ((row["gemm_us"] + row["copies_us"] - row["apart_us"])
                                    / min(row["gemm_us"], row["copies_us"]))
            rows.append(row)
            print(row, flush=True)
    payload = {"benchmark": NAME, "tag": args.tag, "rows": rows, "environment": output.environment(False)}
    return output.print_and_write(NAME, args, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
