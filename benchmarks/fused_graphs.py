"""The fused operators captured in CUDA graphs: replays right under a late rank, bounded waits,
and what a call costs replayed against eager.

Why: an eager fused call costs the host 150-350 us of Python and driver calls, far more than a
small call's GPU time; a CUDA graph replays the call's launches with no host work.  A captured
call runs the twin workspace (``COMPASS_FUSED_GRAPHS=1``: one set of buffers behind the
protocol's fence, the epoch in GPU memory, flag waits as one-thread kernels bounded by
``COMPASS_FUSED_TIMEOUT_S``).  Per case (operator x schedule x shape, fresh processes): one eager
call (the warm-up that builds the workspaces), a graph of three calls captured and replayed
``--replays`` times with new inputs copied in before each replay and the last rank sleeping up to
2 ms before one replay in five, every output checked against a reference every rank computes from
all ranks' seeded inputs; then 20 calls timed eager and as one graph, and 20 GEMMs of the call's
full size as one graph.  Two more cases: a capture without the twin must fail with a clear error,
and a replay whose peer never replays must end in the watchdog's error naming the wait (and stop
that process's GPU work), not in a frozen job.

On one GPU the ranks are processes sharing it (meeting in host memory, as the host-staged regime
does); their kernels time-slice, so the timings there are only a rough bound.  With one GPU per
rank the ranks use peer-to-peer copies (tag e.g. ``h200x2``).

    python benchmarks/fused_graphs.py            # writes fused_graphs-h200.{json,md} on one GPU
"""
from __future__ import annotations

import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import launch, output  # noqa: E402  (sets the no-multicast environment first)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fused_host_stress import TOL, operands, reference  # noqa: E402

NAME = "fused_graphs"
PER_GRAPH = 3  # calls in the checked graph: odd, so replays cannot lean on alternating buffers
TIMED = 20
# (operator, rows of the full activation, n, k): a tiny gather (the per-call overhead), a mid one,
# a reduce-scatter and an all-reduce
SHAPES = [("all_gather_matmul", 256, 256, 256), ("all_gather_matmul", 4096, 3584, 4096),
          ("matmul_reduce_scatter", 1024, 1024, 1024), ("matmul_all_reduce", 1024, 1024, 1024)]


def _op(kind: str, schedule: str, group: str, world: int):
    if kind == "all_gather_matmul":
        return lambda a, b: torch.ops.compass.all_gather_matmul(a, [b], schedule, group, world)[1][0]
    fused = getattr(torch.ops.compass, kind)
    return lambda a, b: fused(a, b, schedule, group, world)


def _time_ms(fn, rounds: int = 5) -> tuple[float, float]:
    """(median GPU ms, median host ms) of ``fn()`` over ``rounds``, each after a synchronize."""
    gpu, host = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        host.append((time.perf_counter() - t0) * 1e3)
        end.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(gpu), statistics.median(host)


def _graph(fn) -> tuple[torch.cuda.CUDAGraph, object]:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def _nccl_ms(kind: str, a: torch.Tensor, n: int, world: int, nccl) -> float:
    """GPU ms of 20 NCCL collectives of the call's message, as one graph (comm alone)."""
    if kind == "all_gather_matmul":
        src, dst = a, a.new_empty((a.shape[0] * world, a.shape[1]))
        comm = lambda: dist.all_gather_into_tensor(dst, src, group=nccl)  # noqa: E731
    elif kind == "matmul_reduce_scatter":
        src = a.new_empty((a.shape[0], n))
        dst = src.new_empty((a.shape[0] // world, n))
        comm = lambda: dist.reduce_scatter_tensor(dst, src, group=nccl)  # noqa: E731
    else:
        buf = a.new_empty((a.shape[0], n))
        comm = lambda: dist.all_reduce(buf, group=nccl)  # noqa: E731
    comm()
    torch.cuda.synchronize()
    graph, _ = _graph(lambda: [comm() for _ in range(TIMED)])
    return _time_ms(graph.replay)[0]


def _staged_ms(kind: str, a: torch.Tensor, n: int, world: int) -> float:
    """GPU ms of 20 rounds of what one rank moves through host memory, as one graph: its message
    device -> pinned host -> device (the two crossings of the host-staged transport, with no
    flags: the communication alone, where the ranks share one GPU and no NCCL runs)."""
    rows = a.shape[0] if kind == "all_gather_matmul" else a.shape[0] // world
    cols = a.shape[1] if kind == "all_gather_matmul" else n
    rounds = 2 if kind == "matmul_all_reduce" else 1  # its sums travel back too
    src = a.new_empty((rows, cols))
    host = torch.empty((rows, cols), dtype=a.dtype, pin_memory=True)
    dst = torch.empty_like(src)

    def comm():
        for _ in range(rounds):
            host.copy_(src, non_blocking=True)
            dst.copy_(host, non_blocking=True)
    comm()
    torch.cuda.synchronize()
    graph, _ = _graph(lambda: [comm() for _ in range(TIMED)])
    return _time_ms(graph.replay)[0]


PROFILE_ENV = "FUSED_GRAPHS_PROFILE"  # set by --profile: where rank 0 writes its traces


def _profile(out_dir: str | None, case: dict, runs: dict) -> None:
    """Each of ``runs`` once more on every rank (the peers wait for each other's calls); where
    ``out_dir`` is given, its GPU activity (kernels, copies, stream memory operations) as a Chrome
    trace there: where a call's time goes on each stream, eager against replayed."""
    from torch.profiler import ProfilerActivity, profile

    for name, fn in runs.items():
        dist.barrier()
        if out_dir is None:
            fn()
            torch.cuda.synchronize()
            continue
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        prof.export_chrome_trace(os.path.join(
            out_dir, f"{case['kind']}-{case['schedule']}-m{case['m']}-{name}.json"))


def _checked_case(rank: int, world: int, case: dict, replays: int, group: str, nccl) -> dict:
    kind, m, n, k, schedule = case["kind"], case["m"], case["n"], case["k"], case["schedule"]
    op = _op(kind, schedule, group, world)
    sets = [operands(kind, m, n, k, world, rank, s) for s in range(3)]
    refs = [reference(kind, m, n, k, world, rank, s) for s in range(3)]
    a, b = (t.clone() for t in sets[0])
    rng = random.Random(rank)

    def error(out, s):
        return float((out.float() - refs[s]).abs().max() / refs[s].abs().max())

    eager_error = error(op(a, b), 0)  # the warm-up: builds the workspace and its twin
    torch.cuda.synchronize()
    graph, outs = _graph(lambda: [op(a, b) for _ in range(PER_GRAPH)])
    kept = []
    for i in range(replays):
        s = i % 3
        a.copy_(sets[s][0])
        b.copy_(sets[s][1])
        if rank == world - 1 and rng.random() < 0.2:
            time.sleep(rng.random() * 2e-3)
        graph.replay()
        kept.append((s, [o.clone() for o in outs]))
    torch.cuda.synchronize()
    worst = max(error(o, s) for s, group_outs in kept for o in group_outs)
    dist.barrier()
    # timing: 20 calls eager, the same 20 as one graph, and 20 GEMMs of the call's full size
    a.copy_(sets[0][0])
    b.copy_(sets[0][1])
    eager_ms, eager_host_ms = _time_ms(lambda: [op(a, b) for _ in range(TIMED)])
    dist.barrier()
    timed, _ = _graph(lambda: [op(a, b) for _ in range(TIMED)])
    dist.barrier()
    graph_ms, replay_host_ms = _time_ms(timed.replay)
    full = torch.randn(m, k, device="cuda", dtype=a.dtype)
    gemms, _ = _graph(lambda: [full @ b for _ in range(TIMED)])
    gemm_ms, _ = _time_ms(gemms.replay)
    # the communication alone: NCCL with one GPU per rank, else the host copies; and what the graph
    # adds to the larger of the two
    comm_ms = _nccl_ms(kind, a, n, world, nccl) if nccl is not None else _staged_ms(kind, a, n, world)
    if os.environ.get(PROFILE_ENV):  # every rank calls (the peers wait for each other), rank 0 records
        _profile(os.environ[PROFILE_ENV] if rank == 0 else None, case,
                 {"eager": lambda: [op(a, b) for _ in range(TIMED)], "graph": timed.replay})
    timings = dict(comm_us=round(comm_ms / TIMED * 1e3, 1),
                   overhead_us=round((graph_ms - max(gemm_ms, comm_ms)) / TIMED * 1e3, 1))
    return dict(**timings,status="pass" if max(worst, eager_error) < TOL else "FAIL", relative_error=max(worst, eager_error),
                replays=replays, calls_checked=replays * PER_GRAPH,
                eager_us=round(eager_ms / TIMED * 1e3, 1), eager_host_us=round(eager_host_ms / TIMED * 1e3, 1),
                graph_us=round(graph_ms / TIMED * 1e3, 1), replay_host_us=round(replay_host_ms / TIMED * 1e3, 2),
                gemm_us=round(gemm_ms / TIMED * 1e3, 1))


def _compiled_case(rank: int, world: int, group: str, steps: int) -> dict:
    """A sequence-parallel MLP block (all-gather -> matmul -> relu -> matmul -> reduce-scatter)
    compiled with ``backend="compass"`` and both pairs forced to the fused operators, with
    Inductor's default mode and with "reduce-overhead" (its CUDA graphs, which take the fused
    operators in when ``COMPASS_FUSED_GRAPHS=1``): outputs checked for new inputs every step, and
    the step time of each."""
    import torch._dynamo
    from torch.distributed import _functional_collectives as funcol

    from compass_fx.kernels.cuda import impl

    rows, dim, hidden = 128, 512, 1024

    def weights(r):
        g = torch.Generator(device="cuda").manual_seed(1000 + r)
        return ((torch.randn(dim, hidden, generator=g, device="cuda") / dim ** 0.5).bfloat16(),
                (torch.randn(hidden, dim, generator=g, device="cuda") / hidden ** 0.5).bfloat16())

    def shard(r, s):
        g = torch.Generator(device="cuda").manual_seed(10 * s + r)
        return torch.randn(rows, dim, generator=g, device="cuda").bfloat16()

    w1, w2 = weights(rank)
    every = [weights(r) for r in range(world)]

    def block(x):
        full = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, group))
        y = torch.relu(full @ w1) @ w2
        return funcol.wait_tensor(funcol.reduce_scatter_tensor(y, "sum", 0, group))

    def reference(s):
        full = torch.cat([shard(r, s) for r in range(world)]).float()
        total = sum(torch.relu(full @ a.float()).bfloat16().float() @ b.float() for a, b in every)
        return total.chunk(world)[rank]

    refs = [reference(s) for s in range(3)]
    inputs = [shard(rank, s) for s in range(3)]
    out: dict = {}
    with torch.no_grad():
        for mode in ("default", "reduce-overhead"):
            torch._dynamo.reset()
            fn = torch.compile(block, backend="compass",
                               options={"strategy": "fuse", "schedule": "direct", "mode": mode})
            worst = 0.0
            for step in range(steps):
                s = step % 3
                y = fn(inputs[s]).clone()  # a CUDA graph's output is overwritten by its next replay
                worst = max(worst, float((y.float() - refs[s]).abs().max() / refs[s].abs().max()))
            dist.barrier()
            ms, host_ms = _time_ms(lambda: [fn(inputs[0]) for _ in range(TIMED)])
            out[mode] = dict(relative_error=worst, step_us=round(ms / TIMED * 1e3, 1),
                             host_us=round(host_ms / TIMED * 1e3, 1))
    twins = sum(1 for key in impl._workspaces if key[1])
    ok = all(v["relative_error"] < TOL for v in out.values()) and twins > 0
    return dict(status="pass" if ok else "FAIL", relative_error=max(v["relative_error"] for v in out.values()),
                compiled=out, captured_workspaces=twins,
                eager_us=out["default"]["step_us"], graph_us=out["reduce-overhead"]["step_us"],
                eager_host_us=out["default"]["host_us"], replay_host_us=out["reduce-overhead"]["host_us"])


def _no_twin_case(rank: int, world: int, group: str) -> dict:
    """Without COMPASS_FUSED_GRAPHS the capture must fail with an error that says what to do."""
    os.environ["COMPASS_FUSED_GRAPHS"] = "0"
    op = _op("all_gather_matmul", "direct", group, world)
    a, b = operands("all_gather_matmul", 128, 128, 128, world, rank, 0)
    op(a, b)
    torch.cuda.synchronize()
    try:
        _graph(lambda: op(a, b))
    except RuntimeError as e:
        ok = "COMPASS_FUSED_GRAPHS=1" in str(e)
        return dict(status="pass" if ok else "FAIL", error_seen=str(e)[:300])
    return dict(status="FAIL", error_seen="the capture succeeded without a twin workspace")


def _timeout_case(rank: int, world: int, group: str) -> dict:
    """Rank 0 replays a graph its peers never replay: its wait must time out loudly."""
    from compass_fx.kernels.cuda import watchdog

    op = _op("all_gather_matmul", "direct", group, world)
    a, b = operands("all_gather_matmul", 128, 128, 128, world, rank, 0)
    op(a, b)
    torch.cuda.synchronize()
    graph, _ = _graph(lambda: op(a, b))
    graph.replay()  # every rank: one good replay
    torch.cuda.synchronize()
    dist.barrier()
    if rank != 0:
        time.sleep(float(os.environ["COMPASS_FUSED_TIMEOUT_S"]) + 8)
        return dict(status="pass", role="the peer that never replays")
    t0 = time.time()
    graph.replay()
    try:
        torch.cuda.synchronize()
        gpu_error = None
    except Exception as e:  # noqa: BLE001 - the trap's CUDA error is the expected outcome
        gpu_error = f"{type(e).__name__}: {str(e)[:200]}"
    waited = time.time() - t0
    time.sleep(2)  # the watchdog reads the status word about three times a second
    failure = watchdog.for_device(torch.cuda.current_device()).failure
    ok = gpu_error is not None and failure is not None and "captured in a CUDA graph" in failure
    return dict(status="pass" if ok else "FAIL", waited_s=round(waited, 1), gpu_error=gpu_error,
                watchdog_error=failure)


def worker(rank: int, world: int, case: dict, replays: int, init: str, out_path: str) -> None:
    import faulthandler

    faulthandler.enable()  # a crash in native code still says where
    gpus = torch.cuda.device_count()
    if gpus < world:
        os.environ["COMPASS_FUSED_TRANSPORT"] = "host"  # ranks sharing a GPU meet in host memory
    os.environ["COMPASS_FUSED_TIMEOUT_S"] = "3" if case["kind"] == "timeout" else "20"
    os.environ["COMPASS_FUSED_GRAPHS"] = "1"
    torch.cuda.set_device(rank % gpus)
    own_gpu = gpus >= world  # one GPU per rank: NCCL for CUDA tensors (the comparison, anything left unfused)
    dist.init_process_group("cpu:gloo,cuda:nccl" if own_gpu else "gloo", init_method=init, rank=rank,
                            world_size=world)
    import compass_fx.kernels  # noqa: F401  (registers torch.ops.compass)

    group = dist.group.WORLD.group_name
    nccl = dist.group.WORLD if own_gpu else None
    res: dict = {}
    try:
        if case["kind"] == "no_twin":
            res = _no_twin_case(rank, world, group)
        elif case["kind"] == "timeout":
            res = _timeout_case(rank, world, group)
        elif case["kind"] == "compiled":
            res = _compiled_case(rank, world, group, replays)
        else:
            res = _checked_case(rank, world, case, replays, group, nccl)
    except Exception as e:  # noqa: BLE001 - the case's outcome
        res.update(status="error", error=f"{type(e).__name__}: {e}"[:600], traceback=traceback.format_exc()[-800:])
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(res, f)
    os._exit(0)  # a rank whose GPU work was stopped (the timeout case) cannot tear down cleanly


def run_case(case: dict, replays: int, tmp: str, index: int, deadline_s: float) -> dict:
    t0 = time.time()
    ranks, killed = launch.fresh_ranks(worker, case["world"], (case, replays), tmp, index, deadline_s)
    statuses = {r["status"] for r in ranks}
    row = dict(case, status="pass" if statuses == {"pass"} else "FAIL" if "FAIL" in statuses else "error",
               wall_s=round(time.time() - t0, 1))
    first = ranks[0]
    for key in ("relative_error", "calls_checked", "eager_us", "eager_host_us", "graph_us", "replay_host_us",
                "gemm_us", "comm_us", "overhead_us", "compiled", "captured_workspaces", "error_seen", "waited_s",
                "gpu_error", "watchdog_error"):
        if key in first:
            row[key] = first[key]
    if "relative_error" in first:
        row["relative_error"] = max(r.get("relative_error", 0.0) for r in ranks)
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        row["error"] = errors[0]
    if killed:
        row["killed_ranks"] = killed
    return row


def cases(world: int, schedules: list[str], checks: bool = True) -> list[dict]:
    out = [dict(kind=kind, world=world, schedule=s, m=m, n=n, k=k)
           for kind, m, n, k in SHAPES for s in schedules]
    out.append(dict(kind="compiled", world=world, schedule="direct", m=128 * world, n=512, k=512))
    if not checks:
        return out
    return out + [dict(kind="no_twin", world=world, schedule="direct"),
                  dict(kind="timeout", world=world, schedule="direct")]


def markdown(payload: dict) -> str:
    rows = payload["rows"]
    checked = [r for r in rows if "graph_us" in r]
    comm = ("the rank's message device -> pinned host -> device, no flags" if "sharing one GPU" in payload["transport"]
            else "NCCL's collective")
    lines = [f"# {NAME} ({payload['tag']})", "",
             f"{payload['transport']}; a graph of {PER_GRAPH} calls replayed {payload['replays']} times per case with new "
             f"inputs, the last rank late before one replay in five, every output checked; then {TIMED} calls timed "
             "eager and as one graph (per call), 20 GEMMs of the call's full size as one graph, and 20 rounds of the "
             f"communication alone as one graph ({comm}).", "",
             f"* {sum(r['status'] == 'pass' for r in rows)} of {len(rows)} cases pass; captured calls on "
             f"{payload.get('graph_buffer_sets', 1)} set(s) of buffers (COMPASS_FUSED_GRAPH_BUFFERS)", ""]
    if payload.get("mps"):
        lines += ["* Under MPS: the two ranks' kernels run side by side on the GPU (without it their processes "
                  "time-slice it, and a spinning wait kernel holds its slice: milliseconds per replayed call).  The "
                  "ranks still share its copy engines and PCIe link.", ""]
    elif "sharing one GPU" in payload["transport"]:
        lines += ["* The ranks are processes time-slicing one GPU: a captured wait is a spinning kernel, which keeps "
                  "its process's time slice until the slice ends, so a replayed call here costs about two time "
                  "slices (milliseconds) where an eager call's stream waits let the GPU switch at once.  These graph "
                  "timings measure the sharing, not the call; the call's cost needs one GPU per rank.", ""]
    if checked:
        lines += ["* per call, graph vs eager (GPU time of back-to-back calls): "
                  + ", ".join(f"{r['kind']} {r['schedule']} m={r['m']}: {r['graph_us']} vs {r['eager_us']} us"
                              for r in checked), ""]
    for r in rows:
        if r["kind"] == "compiled" and "compiled" in r:
            lines += [f"* compiled SP MLP block (both pairs fused, `backend=\"compass\"`), per step: default mode "
                      f"{r['compiled']['default']['step_us']} us, \"reduce-overhead\" (Inductor's CUDA graphs) "
                      f"{r['compiled']['reduce-overhead']['step_us']} us (in the table: eager = default mode, "
                      "graph = reduce-overhead)", ""]
    lines.append(output.markdown_table(rows, ["kind", "world", "schedule", "m", "n", "k", "status",
                                              ("relative_error", "rel. error"), ("eager_us", "eager us/call"),
                                              ("eager_host_us", "eager host us/call"), ("graph_us", "graph us/call"),
                                              ("replay_host_us", "replay host us/call"), ("gemm_us", "GEMM us"),
                                              ("comm_us", "comm us"), ("overhead_us", "graph - max(GEMM, comm) us"),
                                              ("wall_s", "wall s"), "error"]))
    return "\n".join(lines)


def _transport() -> str:
    from compass_fx.kernels.cuda.impl import transport

    return {"peer": "peer-to-peer copies", "host": "pinned host memory"}[transport()]


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--schedules", default="direct,ring")
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--deadline", type=float, default=90.0, help="seconds a case may take before its ranks are killed")
    p.add_argument("--no-failure-cases", action="store_true",
                   help="leave out the capture without a twin and the peer that never replays (whose trap "
                        "would take down an MPS server shared by the ranks)")
    p.add_argument("--only", default=None, help="run only cases of these kinds (comma-separated)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="rank 0 writes Chrome traces of each checked case's timed eager calls and graph replay here")
    p.add_argument("--tag", default=None)
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fused_graphs runs the CUDA path: it needs a GPU")
    from compass_fx.kernels.cuda import graph_buffer_sets

    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ[PROFILE_ENV] = os.path.abspath(args.profile)
    shared = torch.cuda.device_count() < args.world
    tag = args.tag or ("h200" if shared else f"h200x{args.world}")
    todo = cases(args.world, args.schedules.split(","), not args.no_failure_cases)
    if args.only:
        todo = [c for c in todo if c["kind"] in args.only.split(",")]
    rows, t0 = [], time.time()
    payload = {"benchmark": NAME, "tag": tag, "replays": args.replays, "environment": output.environment(False),
               "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), "graph_buffer_sets": graph_buffer_sets(),
               "transport": (f"{args.world} ranks sharing one GPU, meeting in pinned host memory" if shared
                             else f"one GPU per rank, the fused operators' transport: {_transport()}"), "rows": rows}
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(todo):
            row = run_case(case, args.replays, tmp, i, args.deadline)
            rows.append(row)
            print(f"[{i + 1}/{len(todo)}] {case['kind']} {case['schedule']} m={case.get('m')}: {row['status']}"
                  + (f" ({row['error'][:300]})" if "error" in row else ""), flush=True)
            payload.update(seconds=round(time.time() - t0, 1), complete=i + 1 == len(todo))
            output.write_results(NAME, tag, payload, markdown(payload), args.out_dir)
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
