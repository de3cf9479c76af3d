"""Where the host's microseconds go: one extra InterDecom part as lowered, and a CUDA graph
replay of stream commands like a fused call's.

Why (issue 27): an extra InterDecom part costs the host 81-267 us of issue in the default mode
(``compass-fx calibrate``), a fused call 300-1500 us.  This breaks the part down on one GPU (a
one-rank NCCL group, calibrate's pair: Llama-3 8B's gate projection at TP = 8, compiled whole and
in 4 parts under Inductor): torch.profiler's host time per op per call, cProfile's Python frames,
and each launch the generated code makes, alone.  Then it times what a graph replay of a fused
call's commands costs the host (copies, stream memory writes and waits on two streams, GEMMs on
the caller's stream, captured once) against issuing the same commands one by one.

    python benchmarks/host_issue_profile.py        # one GPU: writes host_issue_profile-h200.{json,md}
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import output  # noqa: E402  (sets the no-multicast environment first)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

NAME = "host_issue_profile"


def host_us(fn, calls: int = 20, rounds: int = 7, busy_s: float = 0.05) -> float:
    """Median over rounds of host microseconds per call while the GPU sleeps (nothing waits for it)."""
    from compass_fx.tools.timing import issue_seconds

    return issue_seconds(fn, calls, True, busy_s=busy_s, rounds=rounds) * 1e6


def profile_ops(fn, calls: int = 20) -> dict[str, float]:
    """Host microseconds per call of each op (torch.profiler's CPU self time, summed per name)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    torch.cuda._sleep(int(0.2 * 1.98e9))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        out[e.key] = {"self_us": e.self_cpu_time_total / calls, "total_us": e.cpu_time_total / calls,
                      "count": e.count / calls}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["self_us"])[:40])


def python_frames(fn, calls: int = 20) -> list[dict]:
    torch.cuda.synchronize()
    torch.cuda._sleep(int(0.2 * 1.98e9))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, name), (cc, nc, tt, ct, _) in stats.stats.items():
        rows.append({"where": f"{os.path.basename(file)}:{line}:{name}", "calls": nc / calls,
                     "self_us": tt / calls * 1e6, "cum_us": ct / calls * 1e6})
    rows.sort(key=lambda r: -r["self_us"])
    return rows[:30]


def paired_issue_us(fns: dict, calls: int = 20, rounds: int = 15, busy_s: float = 0.05) -> dict[object, list[float]]:
    """Host microseconds per call of each function, every round timing each in turn (each behind a
    GPU sleep, as :func:`host_us`).  The lent hosts' speed drifts by up to 2x within minutes (the same
    extra part measured 36.9 us, then 121 us by this script and 4 us by calibrate on one machine,
    each form timed in its own minute), so a difference between two forms is read per round."""
    from compass_fx.tools.timing import issue_seconds

    per_round: dict[object, list[float]] = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            per_round[key].append(issue_seconds(fn, calls, True, busy_s=busy_s, rounds=1) * 1e6)
    return per_round


def part_profile(shard_rows: int = 2048, k: int = 4096, n: int = 3584, parts: int = 4) -> dict:
    """Calibrate's pair whole and in ``parts`` parts: issue time (the two compiled forms taking turns
    in every round; the extra part's cost is the median of the rounds' differences), per-op and
    per-frame host time."""
    group = dist.group.WORLD
    shard = torch.randn(shard_rows, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)

    def whole(x, w):  # two functions, so that the two compiled forms keep their own caches and coexist
        return torch.mm(funcol.all_gather_tensor(x, 0, group), w)

    def in_parts(x, w):
        return torch.mm(funcol.all_gather_tensor(x, 0, group), w)

    def issued(fn):  # the parts op's launches issued from Python (no graph replay), as before
        def call():
            os.environ["COMPASS_PARTS_REPLAY"] = "0"
            try:
                return fn(shard, weight)
            finally:
                os.environ["COMPASS_PARTS_REPLAY"] = "1"
        return call

    os.environ["COMPASS_PARTS_REPLAY"] = "1"  # the parts' gathers from one graph (the default)

    torch._dynamo.reset()
    calls, results = {}, {}
    with torch.no_grad():
        for p, pair in ((1, whole), (parts, in_parts)):
            options = {"strategy": "off"} if p == 1 else {"chunks": p}
            fn = torch.compile(pair, backend="compass", options=options)
            for _ in range(3):
                results[p] = fn(shard, weight)
            calls[p] = lambda fn=fn: fn(shard, weight)
        calls["issued"] = issued(fn)
        # a replay computes what the issued launches compute, on new values at the same addresses
        shard.copy_(torch.randn_like(shard))
        replayed_out, issued_out = calls[parts]().clone(), calls["issued"]()
        rounds = paired_issue_us(calls)
        res = {p: {"issue_us": statistics.median(rounds[p]), "issue_us_rounds": rounds[p],
                   "ops": profile_ops(call), "frames": python_frames(call)} for p, call in calls.items()}
    diffs = [(b - a) / (parts - 1) for a, b in zip(rounds[1], rounds[parts])]
    res["extra_part_issue_us"] = statistics.median(diffs)
    res["extra_part_issue_us_rounds"] = diffs
    issued_diffs = [(b - a) / (parts - 1) for a, b in zip(rounds[1], rounds["issued"])]
    res["extra_part_issued_us"] = statistics.median(issued_diffs)
    res["extra_part_issued_us_rounds"] = issued_diffs
    res["replay_equals_issued"] = bool(torch.equal(replayed_out, issued_out))
    os.environ.pop("COMPASS_PARTS_REPLAY")
    from compass_fx.lowering import parts_replay

    res["replay_stats"] = {str(key): {"calls": st.calls, "replays": st.progress.issued}
                           for key, st in parts_replay._states.items() if st is not None}
    res["parts"] = parts
    # the parts' products against the whole's (bf16; cuBLAS may sum a batched GEMM in another order)
    whole_out = results[1].float()
    res["parts_rel_error_vs_whole"] = float((results[parts].float() - whole_out).abs().max() / whole_out.abs().max())
    torch._dynamo.reset()
    return res


def component_costs(shard_rows: int = 2048, k: int = 4096, n: int = 3584, parts: int = 4) -> dict:
    """Host microseconds of each launch a part's generated code makes, alone."""
    from compass_fx.lowering import row_blocks  # noqa: F401 - registers compass::mm_into_row_blocks
    from torch._C._dynamo.guards import assert_size_stride

    group_name = dist.group.WORLD.group_name
    c10d = torch.ops._c10d_functional
    rows = shard_rows // parts
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    buf = torch.empty(shard_rows, n, device="cuda", dtype=torch.bfloat16)
    out_ag = torch.empty(rows, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)

    def gather_and_wait():
        c10d.wait_tensor(c10d.all_gather_into_tensor(x, 1, group_name))

    def gather_out_and_wait():
        c10d.wait_tensor(c10d.all_gather_into_tensor_out(x, 1, group_name, out=out_ag))

    def eager_c10d():
        dist.all_gather_into_tensor(out_ag, x, async_op=True).wait()

    pending = []

    def gather_only():
        pending.append(c10d.all_gather_into_tensor(x, 1, group_name))

    tests = {
        "funcol_all_gather_into_tensor+wait_tensor": gather_and_wait,
        "funcol_all_gather_into_tensor_out+wait_tensor": gather_out_and_wait,
        "funcol_all_gather_into_tensor_alone": gather_only,
        "c10d_all_gather_into_tensor_async+wait": eager_c10d,
        "compass.mm_into_row_blocks": lambda: torch.ops.compass.mm_into_row_blocks.default(buf, x, w, 1, 0, rows),
        "torch.bmm_out_on_views": lambda: torch.bmm(x.view(1, rows, k), w.expand(1, k, n),
                                                    out=buf.view(1, shard_rows, n)[:, :rows]),
        "torch.mm_out": lambda: torch.mm(x, w, out=y),
        "torch.mm": lambda: torch.mm(x, w),
        "assert_size_stride": lambda: assert_size_stride(x, (rows, k), (k, 1)),
        "torch.empty": lambda: torch.empty(rows, n, device="cuda", dtype=torch.bfloat16),
        "event_record": lambda: torch.cuda.Event().record(),
    }
    out = {}
    for name, fn in tests.items():
        try:
            fn()
            out[name] = host_us(fn)
        except Exception as e:  # noqa: BLE001 - recorded
            out[name] = f"{type(e).__name__}: {e}"[:200]
        for t in pending:
            c10d.wait_tensor(t)
        pending.clear()
    return out


# ---- a graph replay of fused-call-like commands ---------------------------------------------------
_AND = 0x2  # CU_STREAM_WAIT_VALUE_AND: (*addr & value) != 0


def graph_replay(ks=(2, 8, 32, 128)) -> dict:
    """Host us of replaying a captured graph of ``k`` (wait value, copy, write value) triples on a
    side stream and k/2 GEMMs on the caller's stream, against issuing them one by one; and
    whether the replayed flag operations did what they say."""
    from compass_fx.kernels.cuda import driver

    wait = driver.raw("wait")
    write = driver.raw("write")
    memcpy = driver.raw("memcpy")
    gate = torch.full((1,), 0b0110, dtype=torch.int32).pin_memory()  # the awaited word (host memory, as
    # the host transport's flags): bits 1 and 2
    src = torch.randn(1 << 20, device="cuda")
    dst = torch.empty_like(src)
    marks = torch.zeros(4096, dtype=torch.int32, device="cuda")
    a = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(256, 1024, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream(priority=-1)
    cap = torch.cuda.Stream()
    fork, join = torch.cuda.Event(), torch.cuda.Event()
    res = {}

    def issue(k: int, main: torch.cuda.Stream, value: int) -> None:
        fork.record(main)
        side.wait_event(fork)
        h = side.cuda_stream
        for i in range(k):
            driver.check(wait(h, gate.data_ptr(), 0b0010, _AND), "wait")
            driver.check(memcpy(dst.data_ptr() + 4096 * i, src.data_ptr() + 4096 * i, 4096, h), "memcpy")
            driver.check(write(h, marks.data_ptr() + 4 * i, value, 0), "write")
            if i % 2 == 0:
                torch.mm(a, b, out=c)
        join.record(side)
        main.wait_event(join)

    with torch.cuda.stream(cap):
        torch.mm(a, b, out=c)  # the cuBLAS workspace of this stream, outside the capture
    torch.cuda.synchronize()
    for k in ks:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(cap):
            t0 = time.perf_counter()
            g.capture_begin(capture_error_mode="thread_local")
            issue(k, cap, 7)
            g.capture_end()
            capture_us = (time.perf_counter() - t0) * 1e6
        torch.cuda.synchronize()
        marks.zero_()
        g.replay()
        torch.cuda.synchronize()
        ok = bool((marks[:k] == 7).all()) and torch.equal(dst[:1024 * k], src[:1024 * k])
        main = torch.cuda.current_stream()
        res[k] = {"capture_us": capture_us, "replay_us": host_us(g.replay), "replay_correct": ok,
                  "eager_us": host_us(lambda: issue(k, main, 5)), "gemms": (k + 1) // 2}
        del g
    torch.cuda.synchronize()
    return res


def main(argv=None) -> int:
    args = output.one_gpu_args(__doc__, argv, "host_issue_profile needs a CUDA GPU")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    import compass_fx.backend  # noqa: F401

    payload = {"benchmark": NAME, "tag": args.tag, "environment": output.environment(False)}
    t0 = time.time()
    for name, fn in (("components", component_costs), ("part", part_profile), ("graph_replay", graph_replay)):
        try:
            payload[name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded, the other sections still run
            payload[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
        print(f"{name} done ({time.time() - t0:.0f} s)", flush=True)
    payload["seconds"] = time.time() - t0
    dist.destroy_process_group()
    return output.print_and_write(NAME, args, payload, markdown(payload))


def markdown(payload: dict) -> str:
    lines = [f"# {NAME} ({payload['tag']})", ""]
    part = payload.get("part", {})
    if "extra_part_issue_us" in part:
        p = part["parts"]
        spread = sorted(part.get("extra_part_issue_us_rounds", []))
        quartiles = (f"; rounds' quartiles {spread[len(spread) // 4]:.1f}-{spread[3 * len(spread) // 4]:.1f} us, "
                     f"{len(spread)} rounds, the two forms taking turns" if len(spread) >= 4 else "")
        lines += [f"One extra InterDecom part as lowered (Inductor, one-rank NCCL): "
                  f"{part['extra_part_issue_us']:.1f} us of host issue "
                  f"(whole {part[1]['issue_us']:.0f} us, {p} parts {part[p]['issue_us']:.0f} us per call{quartiles})"
                  + (f"; parts against whole: max error {part['parts_rel_error_vs_whole']:.2g} of the largest entry."
                     if "parts_rel_error_vs_whole" in part else "."),
                  ""]
        if "extra_part_issued_us" in part:
            lines += [f"The parts' gathers replayed from one CUDA graph in the figures above "
                      f"(`COMPASS_PARTS_REPLAY=1`); issued from Python instead (`=0`, timed in the same rounds): {part['extra_part_issued_us']:.1f} us "
                      f"per extra part ({part['issued']['issue_us']:.0f} us per call); the replay's result equals the "
                      f"issued one on new inputs: {part['replay_equals_issued']}; graphs {part['replay_stats']}.", ""]
        lines += ["Host us per call by op (torch.profiler self time), whole vs parts:", ""]
        names = list(part[p]["ops"])[:20]
        rows = [{"op": nm, "whole": part[1]["ops"].get(nm, {}).get("self_us", 0.0),
                 "parts": part[p]["ops"][nm]["self_us"], "count": part[p]["ops"][nm]["count"]} for nm in names]
        lines += [output.markdown_table(rows, ["op", "whole", "parts", "count"]), ""]
    comp = payload.get("components", {})
    if comp and "error" not in comp:
        lines += ["Launches alone (host us): " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                         for k, v in comp.items()), ""]
    gr = payload.get("graph_replay", {})
    if gr and "error" not in gr:
        rows = [dict(v, k=k) for k, v in gr.items()]
        lines += ["Graph replay of k (wait, copy, write) triples on a side stream + GEMMs:", "",
                  output.markdown_table(rows, ["k", "gemms", "eager_us", "replay_us", "capture_us", "replay_correct"])]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
