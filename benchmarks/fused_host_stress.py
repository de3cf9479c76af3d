"""The host-staged fused operators at three and four ranks, on ONE GPU: back-to-back calls with a
late rank, every result checked.

Why: without peer access (PCIe cards, ``NCCL_P2P_DISABLE=1``) ``strategy="auto"`` runs every TP
pair through the fused operators, moving pieces through pinned host memory on the copy engines;
PCIe boxes run TP = 4 or 8, and the two-GPU machine only ever checked world 2, where the ring is
the very plan of "direct".  Here W ranks (processes in a gloo group) share one GPU and meet in
host memory, which runs the same plans on the same CUDA path, so every protocol step of a world
of 3 or 4 executes for real (the GPU timings are meaningless and are not recorded).
``--transport peer``: the ranks map each other's buffers of the GPU with CUDA IPC and run the peer
transport's plans (device-to-device pulls, flags in GPU memory) instead.

The cases (operator x schedule x shape) of a world run one after another in one set of fresh
processes (a case that does not pass ends that set; the cases after it run in fresh processes):
``--calls`` back-to-back calls cycling over three input sets, the last rank sleeping up to 2 ms
before one call in ten; each output is compared with a reference every rank computes from all
ranks' seeded inputs (tolerance 2e-2 of the largest element, bf16), then dropped, so that eager
calls replay their captured graphs (the rows count the replays per rank; ``--mix``: rank 0 issues
one call in five command by command, meeting peers that replay).  A stalled case ends in the operators' watchdog
error (``COMPASS_FUSED_TIMEOUT_S``, 10 s here), recorded as the case's outcome, never a frozen
run.  "direct" is what the compiler runs without peer access (a forced ring is run as direct);
the rings are run too, to record how they behave here.

    python benchmarks/fused_host_stress.py      # one GPU: writes fused_host_stress-h200.{json,md}
    COMPASS_HOST_MOST_PIECES=2 python benchmarks/fused_host_stress.py --worlds 2 --schedules direct \
        --shapes matmul_reduce_scatter:8192:4096:7168 --calls 60   # chosen cases (replay-order)
"""
from __future__ import annotations

import os
import random
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import launch, output  # noqa: E402  (sets the no-multicast environment first)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from fused_host_time import weight_list, widths  # noqa: E402  (a case's weights, as that script's)

NAME = "fused_host_stress"
TOL = 2e-2
TIMEOUT_S = "10"
# (operator, rows of the full activation per rank of the world, n, k): a gather of 512-row shards
# into a narrow and a wide GEMM, a reduce-scatter and an all-reduce
SHAPES = [("all_gather_matmul", 512, 256, 256), ("all_gather_matmul", 512, 7168, 256),
          ("matmul_reduce_scatter", 256, 512, 256), ("matmul_all_reduce", 512, 512, 256)]


def operands(kind: str, m: int, n, k: int, world: int, rank: int, seed: int):
    """A rank's input and its weight, or a gather's list of weights where ``n`` holds several widths."""
    g = torch.Generator(device="cuda").manual_seed(seed * 100 + rank)
    rows = m // world if kind == "all_gather_matmul" else m
    a = (torch.randn(rows, k, generator=g, device="cuda") / k ** 0.25).bfloat16()
    shared = kind == "all_gather_matmul"  # the gather's weight is the same on every rank
    gw = torch.Generator(device="cuda").manual_seed(seed * 100 + 99 + (0 if shared else rank))
    bs = [(torch.randn(k, width, generator=gw, device="cuda") / k ** 0.25).bfloat16() for width in widths(n)]
    return a, (bs if isinstance(n, (tuple, list)) else bs[0])


def reference(kind: str, m: int, n, k: int, world: int, rank: int, seed: int) -> list[torch.Tensor]:
    """The call's outputs from every rank's inputs: one per weight of a gather, the one otherwise."""
    ins = [operands(kind, m, n, k, world, r, seed) for r in range(world)]
    if kind == "all_gather_matmul":
        gathered = torch.cat([a for a, _ in ins]).float()
        return [gathered @ b.float() for b in weight_list(ins[0][1])]
    total = sum(a.float() @ b.float() for a, b in ins)
    return [total.chunk(world)[rank] if kind == "matmul_reduce_scatter" else total]


def run_one(rank: int, world: int, case: dict, calls: int, mix: bool, overload: str = "op") -> dict:
    """One case on this rank: ``calls`` back-to-back calls, each output checked as it comes and then
    dropped (so the caching allocator hands the next call of the same input set the same
    addresses and eager calls replay their graphs, :mod:`compass_fx.kernels.cuda.replay`);
    ``mix``: rank 0 issues one call in five one command at a time (COMPASS_FUSED_REPLAY=0), so
    ranks that replay and ranks that issue meet in the same call; ``overload``: ``op`` calls the custom
    ops (autograd and all), ``graph`` their ``.graph`` overloads, what rewritten graphs call (their
    eager calls entered from C, :func:`compass_fx.kernels.cuda.lane.enter_from_c`), ``start`` (a
    reduction only) the asynchronous form ``fused_async`` calls, with a ``.graph`` call of the same
    operator (another workspace) while it is outstanding, both results checked."""
    from compass_fx import fused_calls

    kind, m, n, k, schedule = case["kind"], case["m"], case["n"], case["k"], case["schedule"]
    group = dist.group.WORLD.group_name
    rng = random.Random(rank)
    res: dict = {}
    try:
        sets = [operands(kind, m, n, k, world, rank, s) for s in range(3)]
        refs = [reference(kind, m, n, k, world, rank, s) for s in range(3)]
        packet = getattr(torch.ops.compass, kind)
        fused = packet.graph if overload == "graph" else packet
        if kind == "all_gather_matmul":
            def op(a, b):
                return fused(a, weight_list(b), schedule, group, world)[1]
        elif overload == "start":
            # the overloads a rewritten graph calls (the start's .default skips the dispatcher)
            start = getattr(torch.ops.compass, f"{kind}_start").default
            wait = torch.ops._c10d_functional.wait_tensor.default

            def op(a, b):
                out = start(a, b, schedule, group, world)
                inside = packet.graph(a, b, schedule, group, world)  # replayed while the deferred call is out
                return [wait(out), inside]
        else:
            def op(a, b):
                return [fused(a, b, schedule, group, world)]
        errors = torch.zeros(calls, device="cuda")
        before = fused_calls()
        t0 = time.time()
        for c in range(calls):
            if rank == world - 1 and rng.random() < 0.1:
                time.sleep(rng.random() * 2e-3)
            issue_one = mix and rank == 0 and rng.random() < 0.2
            if issue_one:
                os.environ["COMPASS_FUSED_REPLAY"] = "0"
            out = op(*sets[c % 3])
            if issue_one:
                os.environ["COMPASS_FUSED_REPLAY"] = "1"
            wants = refs[c % 3] * (len(out) // len(refs[c % 3]))  # a start and the call inside: one reference
            errors[c] = torch.stack([(got.float() - want).abs().max() / want.abs().max()  # no wait for the GPU
                                     for got, want in zip(out, wants)]).max()
            del out
        torch.cuda.synchronize()
        err = float(errors.max())
        during = fused_calls().since(before)
        res.update(status="pass" if err < TOL else "FAIL", relative_error=err, seconds=round(time.time() - t0, 2),
                   replayed=during.replayed, from_c=during.from_c, captured=during.captured)
    except Exception as e:  # noqa: BLE001 - the case's outcome (a watchdog error names op, rank, piece)
        res.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-600:])
    return res


def worker(rank: int, world: int, todo: list[dict], calls: int, mix: bool, transport: str, overload: str,
           init: str, out_path: str) -> None:
    """The cases ``todo`` one after another in this set of processes, until one does not pass
    (what follows a stalled case is run in fresh processes)."""
    # the ranks share one GPU: they meet in pinned host memory, or (peer) map each other's buffers of
    # that GPU with CUDA IPC, as the peer transport does on an NVLink machine with symmetric memory
    os.environ["COMPASS_FUSED_TRANSPORT"] = transport
    os.environ["COMPASS_FUSED_TIMEOUT_S"] = TIMEOUT_S
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import compass_fx.kernels  # noqa: F401  (registers torch.ops.compass)

    results = []
    for case in todo:
        res = run_one(rank, world, case, calls, mix, overload)
        results.append(res)
        if not launch.save_and_agree(results, out_path, rank):  # every rank goes on to the next case, or none
            break
    launch.leave_group()


def run_cases(todo: list[dict], calls: int, tmp: str, index: int, deadline_s: float, mix: bool,
              transport: str = "host", overload: str = "op") -> list[dict]:
    """``todo`` (one world) in one set of fresh processes, then whatever a stalled case left undone
    in another; ranks still running after ``deadline_s`` per case (a stall whose streams stay
    blocked after the watchdog's error) are killed and the case says so."""
    rows: list[dict] = []
    while todo:
        t0 = time.time()
        world = todo[0]["world"]
        ranks, killed = launch.fresh_ranks(worker, world, (todo, calls, mix, transport, overload), tmp,
                                           index * 1000 + len(rows), deadline_s * len(todo))
        per_rank = [r if isinstance(r, list) else [r] for r in ranks]
        done = max(len(r) for r in per_rank)
        for i in range(max(done, 1)):
            got = [r[i] if i < len(r) else {"status": "error", "error": "rank stopped before this case"}
                   for r in per_rank]
            statuses = {r["status"] for r in got}
            status = "pass" if statuses == {"pass"} else "FAIL" if "FAIL" in statuses else "error"
            row = dict(todo[i], status=status, calls=calls, wall_s=round(time.time() - t0, 1),
                       relative_error=max((r.get("relative_error", 0.0) for r in got), default=None),
                       replayed=[r.get("replayed") for r in got], from_c=[r.get("from_c") for r in got],
                       captured=[r.get("captured") for r in got])
            errors = [r["error"] for r in got if "error" in r]
            if errors:
                row["error"] = errors[0]
            if killed and status != "pass":
                row["killed_ranks"] = killed  # still blocked on the GPU after the error: ended by this script
            rows.append(row)
            print(f"[{len(rows)}] {row['kind']} world={world} {row['schedule']} n={row['n']}: {status}"
                  + (f" ({row['error'][:160]})" if "error" in row else "") + f" replayed {row['replayed']}", flush=True)
        todo = todo[max(done, 1):]
    return rows


def cases(worlds: list[int], shapes: str = "", schedules: tuple[str, ...] = ("direct", "ring", "double_ring")
          ) -> list[dict]:
    """Every world x shape x schedule.  ``shapes``: ``kind:m:n:k`` cases, comma-separated (``m``: the
    rows of A, every rank's together for a gather; a gather's ``n`` may name several weights' widths,
    ``2048+512+512``), instead of :data:`SHAPES` (whose rows are per rank)."""
    chosen = [(kind, rows, n, k, False) for kind, rows, n, k in SHAPES]
    if shapes:
        chosen = []
        for spec in shapes.split(","):
            kind, *sizes = spec.split(":")
            if kind not in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce") or len(sizes) != 3:
                raise SystemExit(f"--shapes: {spec!r} is not kind:m:n:k with a fused operator's kind")
            m, n, k = sizes
            several = "+" in n
            if several and kind != "all_gather_matmul":
                raise SystemExit(f"--shapes: {spec!r}: only a gather takes several weights (n as a+b+...)")
            try:
                chosen.append((kind, int(m), [int(w) for w in n.split("+")] if several else int(n), int(k), True))
            except ValueError:
                raise SystemExit(f"--shapes: {spec!r} is not kind:m:n:k with whole numbers") from None
    out = []
    for world in worlds:
        for kind, rows, n, k, whole in chosen:
            for schedule in schedules:
                out.append(dict(kind=kind, world=world, schedule=schedule, m=rows if whole else rows * world, n=n, k=k))
    return out


def markdown(payload: dict) -> str:
    rows = payload["rows"]
    ok = sum(r["status"] == "pass" for r in rows)
    direct = [r for r in rows if r["schedule"] == "direct"]
    lines = [f"# {NAME} ({payload['tag']})", "",
             ("W ranks sharing one GPU map each other's buffers of it with CUDA IPC (the peer transport's "
                "plans and device-to-device copies, as on an NVLink machine); " if payload.get("transport") == "peer"
                else "W ranks sharing one GPU meet in pinned host memory (the host-staged fused operators); ") +
             f"{payload['calls']} back-to-back calls per case"
             + (" of the `.graph` overloads (what rewritten graphs call)" if payload.get("overload") == "graph" else
                " of the asynchronous `*_start` forms (what `fused_async` calls), each with a `.graph` call of "
                "the same operator while it is outstanding, both results checked"
                if payload.get("overload") == "start" else "")
             + ", the last rank late before one call in ten, every "
             f"result against a reference and dropped; the cases of a world one after another in one set of "
             f"processes{' (rank 0 issuing one call in five command by command)' if payload.get('mix') else ''}; "
             f"watchdog timeout {TIMEOUT_S} s. replayed: per rank, the calls served from captured CUDA graphs; from C: of those, the ones the host "
             f"fast path issued (compass_fx/kernels/cuda/lane.cpp).", "",
             f"* {ok} of {len(rows)} cases pass; schedule direct"
             + ("" if payload.get("transport") == "peer" else " (what the compiler runs without peer access)")
             + f": {sum(r['status'] == 'pass' for r in direct)} of {len(direct)}", "",
             output.markdown_table(rows, ["kind", "world", "schedule", "m", "n", "k", "status",
                                          ("relative_error", "rel. error"), "replayed", ("from_c", "from C"), ("wall_s", "wall s"), "error"])]
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="3,4")
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--deadline", type=float, default=60.0, help="seconds a case may take before its ranks are killed")
    p.add_argument("--mix", action="store_true", help="rank 0 issues one call in five instead of replaying it")
    p.add_argument("--transport", choices=("host", "peer"), default="host",
                   help="how the ranks meet: pinned host memory (default) or each other's GPU buffers (CUDA IPC)")
    p.add_argument("--shapes", default="", help="kind:m:n:k cases, comma-separated, instead of the default ones "
                   "(m: rows of A, every rank's together for a gather)")
    p.add_argument("--schedules", default="direct,ring,double_ring")
    p.add_argument("--overload", choices=("op", "graph", "start"), default="op",
                   help="call the custom ops (default) or their .graph overloads, what rewritten graphs call, or "
                   "(the reductions only) their *_start forms, what fused_async calls, a .graph call inside each")
    p.add_argument("--tag", default="h200")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fused_host_stress runs the CUDA path: it needs a GPU")
    todo = cases([int(w) for w in args.worlds.split(",")], args.shapes, tuple(args.schedules.split(",")))
    if args.overload == "start":  # only the reductions have an asynchronous form
        todo = [c for c in todo if c["kind"] != "all_gather_matmul"]
        if not todo:
            raise SystemExit("--overload start: no reduction among the cases")
    rows, t0 = [], time.time()
    payload = {"benchmark": NAME, "tag": args.tag, "calls": args.calls, "mix": args.mix, "transport": args.transport,
               "overload": args.overload,
               "environment": output.environment(False), "rows": rows}
    with tempfile.TemporaryDirectory() as tmp:
        for i, world in enumerate(sorted({c["world"] for c in todo}, key=[c["world"] for c in todo].index)):
            rows += run_cases([c for c in todo if c["world"] == world], args.calls, tmp, i, args.deadline, args.mix,
                              args.transport, args.overload)
            payload.update(seconds=round(time.time() - t0, 1), complete=len(rows) == len(todo))
            output.write_results(NAME, args.tag, payload, markdown(payload), args.out_dir)  # what is done so far
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
