"""Where a replayed fused call's device time goes, variant against variant (one GPU, ranks sharing it).

Why: the graph guards (``kernels/graph_order.py``: each flag wait of a replay graph after every flag
its rank set before it) cost the small two-rank reductions ~1.1-1.2x of their period on one H200
against an unguarded replay, and the period alone does not say where.  This traces every rank's
device work (torch.profiler's CUDA activities, exported as a Chrome trace) over back-to-back replayed
calls of one case in each variant (a set of settings, its own processes: a setting is read when a
workspace is built), cuts the trace into calls at each replay graph's last node (``compass_count``:
replays of one stream run one after another) and gives, per kind of work (GEMMs, copies to and from
host memory, the sums, the flag kernels), the median offsets of its first start and last end from
the call's first event, the call's span, and the time in it when nothing of the call ran: rank 0's
in a table, the others' in a line each, and where the peers' calls lie against rank 0's on the
machine's clock (each trace's base time plus its events' times).

    python benchmarks/replay_trace.py --op matmul_reduce_scatter --rows 512   # guards against none

Variants: ``guards`` (the default settings) and ``no-guards`` (``COMPASS_GRAPH_GUARDS=0``) unless
``--variants`` names others from :data:`VARIANTS`.  Host-staged transport; start MPS first where
the ranks should run side by side (``nvidia-cuda-mps-control -d``).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import sys
import tempfile
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import output  # noqa: E402  (sets the no-multicast environment first)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

NAME = "replay_trace"
VARIANTS = {"guards": {}, "no-guards": {"COMPASS_GRAPH_GUARDS": "0"}, "stream-waits": {"COMPASS_REPLAY_WAITS": "stream"},
            "kernel-waits": {"COMPASS_REPLAY_WAITS": "kernel"},
            "kernel-waits-no-guards": {"COMPASS_REPLAY_WAITS": "kernel", "COMPASS_GRAPH_GUARDS": "0"},
            "stream-flag-writes": {"COMPASS_REPLAY_FLAG_WRITES": "stream"},
            "sets-last-guards": {"COMPASS_GRAPH_GUARD_SEQUENCE": "sets-last"}}
KINDS = (  # (kind, how a device event's name shows it), first match wins
    ("count", re.compile(r"compass_count")),
    ("flag", re.compile(r"compass_(set_flag|write_code|bump_epoch)")),
    ("wait", re.compile(r"compass_wait")),
    ("d2h", re.compile(r"DtoH|Device -> Pinned|Device -> Pageable")),
    ("h2d", re.compile(r"HtoD|Pinned -> Device|Pageable -> Device")),
    ("d2d", re.compile(r"DtoD|Device -> Device")),
    ("gemm", re.compile(r"gemm|nvjet|sm90|xmma|cutlass|cublas", re.I)),
    ("sum", re.compile(r"elementwise|add", re.I)),
)
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def calls_of(trace_events: list[dict]) -> list[list[dict]]:
    """The device events of a Chrome trace cut into calls: each call ends with its replay graph's
    ``compass_count`` kernel (graphs launched on one stream run one after another, so every event
    of a call starts after the previous call's count ended).  Events before the first count end
    belong to the first call; events after the last count (an unfinished call) are dropped."""
    device = sorted((e for e in trace_events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e),
                    key=lambda e: e["ts"])
    calls, current = [], []
    for e in device:
        current.append(e)
        if kind_of(e["name"]) == "count":
            calls.append(current)
            current = []
    return calls


def call_summary(events: list[dict]) -> dict:
    """One call: its span (first event's start to the count's end), the idle time in it (no event of
    the call running), and per kind the offsets of its first start and last end from the call's
    first start, and its busy time."""
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    busy, last = 0.0, t0
    for e in sorted(events, key=lambda e: e["ts"]):  # the union of the events' intervals
        start, end = max(e["ts"], last), e["ts"] + e["dur"]
        if end > start:
            busy += end - start
            last = end
    kinds: dict[str, dict] = {}
    for e in events:
        k = kinds.setdefault(kind_of(e["name"]), {"first_start": float("inf"), "last_end": 0.0, "busy": 0.0, "n": 0})
        k["first_start"] = min(k["first_start"], e["ts"] - t0)
        k["last_end"] = max(k["last_end"], e["ts"] + e["dur"] - t0)
        k["busy"] += e["dur"]
        k["n"] += 1
    return {"span_us": t1 - t0, "idle_us": (t1 - t0) - busy, "kinds": kinds}


def timeline(trace_events: list[dict], base_us: float = 0.0, skip: int = 2) -> list[dict]:
    """Each traced call (the first ``skip`` left out) on the machine's clock (``base_us``: the
    trace's ``baseTimeNanoseconds`` / 1000, which its events' times count from): its start and, per
    kind, its first start and last end; the ranks' timelines compare call by call."""
    out = []
    for events in calls_of(trace_events)[skip:]:
        t0 = min(e["ts"] for e in events)
        one = call_summary(events)
        out.append({"start": base_us + t0, "kinds": {k: (base_us + t0 + f["first_start"], base_us + t0 + f["last_end"])
                                                      for k, f in one["kinds"].items()}})
    return out


def peer_lags(mine: list[dict], peer: list[dict]) -> dict:
    """How a peer's calls lie against this rank's (medians over this rank's calls, each matched with
    the peer's call that started nearest it): the peer's start after this rank's, and this rank's
    first pull (``h2d``) after the peer's last flag set (the peer's publication it waits for; near
    0: the pull waited for the peer, well above 0: something else held it back)."""
    if not mine or not peer:
        return {}
    lags, pulls = [], []
    for call in mine:
        near = min(peer, key=lambda c: abs(c["start"] - call["start"]))
        lags.append(near["start"] - call["start"])
        if "h2d" in call["kinds"] and "flag" in near["kinds"]:
            pulls.append(call["kinds"]["h2d"][0] - near["kinds"]["flag"][1])
    res = {"start_lag_us": statistics.median(lags)}
    if pulls:
        res["pull_after_peer_flag_us"] = statistics.median(pulls)
    return res


def summarize(trace_events: list[dict], skip: int = 2) -> dict:
    """Medians over the traced calls (the first ``skip`` left out: the profiler's start) of
    :func:`call_summary`'s figures."""
    calls = [call_summary(c) for c in calls_of(trace_events)[skip:]]
    if not calls:
        return {"calls": 0}
    kinds = sorted({k for c in calls for k in c["kinds"]})
    per_kind = {}
    for k in kinds:
        have = [c["kinds"][k] for c in calls if k in c["kinds"]]
        per_kind[k] = {field: statistics.median(h[field] for h in have)
                       for field in ("first_start", "last_end", "busy", "n")}
        per_kind[k]["in_calls"] = len(have)
    return {"calls": len(calls), "span_us": statistics.median(c["span_us"] for c in calls),
            "idle_us": statistics.median(c["idle_us"] for c in calls), "kinds": per_kind}


def worker(rank: int, world: int, init: str, out_dir: str, op: str, rows: int, k: int, n: int, calls: int) -> None:
    from fused_host_time import TOLERANCE, operands, relative_error

    os.environ["COMPASS_FUSED_TRANSPORT"] = "host"
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        import compass_fx.kernels  # noqa: F401  (registers torch.ops.compass)
        from compass_fx.kernels.cuda import replay

        a, b = operands(op, rows, k, n, rank)
        args = ([b] if op == "all_gather_matmul" else b, "direct", dist.group.WORLD.group_name, world)
        graph_op = getattr(torch.ops.compass, op).graph
        for _ in range(2 * replay.PERIOD + 1):  # every residue of the epoch captured for these addresses
            graph_op(a, *args)
        err = relative_error(op, graph_op(a, *args), rows, k, n, rank, world)
        if err > TOLERANCE:
            raise RuntimeError(f"{op} rows={rows}: replayed result off by {err:.3g} (rank {rank})")
        torch.cuda.synchronize()
        dist.barrier()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:  # every rank: their calls compare
            for _ in range(calls):
                graph_op(a, *args)
            torch.cuda.synchronize()
        path = os.path.join(out_dir, f"trace{rank}.json")
        prof.export_chrome_trace(path)
        trace = json.load(open(path))
        events = trace.get("traceEvents", [])
        result = {"relative_error": err, "replayed": replay.stats["replayed"], **summarize(events),
                  "timeline": timeline(events, trace.get("baseTimeNanoseconds", 0) / 1e3)}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def markdown(payload: dict) -> str:
    lines = [f"# {NAME} ({payload['tag']})", "",
             f"Rank 0's device work over {payload['calls']} back-to-back replayed calls of {payload['op']} "
             f"({payload['rows']} rows, k {payload['k']}, n {payload['n']}), {payload['world']} ranks sharing one "
             "GPU through host memory; per variant, medians over the calls: the call's span (its first event's "
             "start to its replay graph's last node's end), the time in it when nothing of it ran, and per kind "
             "of work its first start and last end after the call's first event (us).", ""]
    for name, v in payload["variants"].items():
        if not v.get("calls"):
            lines += [f"**{name}** ({v.get('settings')}): no calls traced ({v.get('error', 'no device events')})", ""]
            continue
        lines += [f"**{name}** ({v['settings'] or 'defaults'}): span {v['span_us']:.1f} us, idle {v['idle_us']:.1f} us, "
                  f"{v['calls']} calls", "",
                  output.markdown_table([dict(kind=k, **f) for k, f in v["kinds"].items()],
                                        ["kind", ("n", "events"), ("first_start", "first start us"),
                                         ("last_end", "last end us"), ("busy", "busy us")]), ""]
        for peer, summary in v.get("peer_summaries", {}).items():
            if summary.get("calls"):
                lines += [f"Rank {peer}: span {summary['span_us']:.1f} us, idle {summary['idle_us']:.1f} us; "
                          + ", ".join(f"{k} {f['first_start']:.0f}-{f['last_end']:.0f}" for k, f in summary["kinds"].items())
                          + " us after its call's first event.", ""]
        for peer, lag in v.get("peers", {}).items():
            if lag:
                pull = lag.get("pull_after_peer_flag_us")
                lines += [f"Rank {peer}'s calls start {lag['start_lag_us']:.1f} us after rank 0's"
                          + (f"; rank 0's first pull starts {pull:.1f} us after rank {peer}'s last flag set" if pull is not None
                             else "") + ".", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", default="matmul_reduce_scatter",
                   choices=("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"))
    p.add_argument("--rows", type=int, default=512, help="rows of A on one rank")
    p.add_argument("--k", type=int, default=7168)
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--calls", type=int, default=24, help="back-to-back replayed calls traced")
    p.add_argument("--variants", default="guards,no-guards", help=f"comma-separated, of {sorted(VARIANTS)}")
    p.add_argument("--tag", default="h200")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {sorted(VARIANTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("replay_trace needs a CUDA GPU (it traces the CUDA path's replays)")
    payload = {"benchmark": NAME, "tag": args.tag, "op": args.op, "rows": args.rows, "k": args.k, "n": args.n,
               "world": args.world, "calls": args.calls, "variants": {}}
    for name in names:
        # the spawned ranks inherit the variant's settings; the parent's return after it
        with mock.patch.dict(os.environ, VARIANTS[name]), tempfile.TemporaryDirectory() as tmp:
            mp.spawn(worker, args=(args.world, f"file://{os.path.join(tmp, 'store')}", tmp, args.op, args.rows,
                                   args.k, args.n, args.calls), nprocs=args.world)
            ranks = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(args.world)]
        timelines = [rank.pop("timeline") for rank in ranks]
        got = {**ranks[0], "peers": {str(r): peer_lags(timelines[0], timelines[r]) for r in range(1, args.world)},
               "peer_summaries": {str(r): ranks[r] for r in range(1, args.world)}}
        payload["variants"][name] = {"settings": VARIANTS[name], **got}
        print(f"{name}: span {got.get('span_us', 0):.1f} us, idle {got.get('idle_us', 0):.1f} us over "
              f"{got.get('calls', 0)} calls", flush=True)
    payload["environment"] = output.environment(False)
    output.write_results(NAME, args.tag, payload, markdown(payload), args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
