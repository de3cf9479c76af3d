"""The decomposed gather's parts replayed from a CUDA graph (``COMPASS_PARTS_REPLAY=1``) with several
NCCL ranks on ONE GPU: every replayed call checked against the same call issued, and what an extra
part costs the host either way.

Why (issue 27): ``compass_fx.lowering.parts_replay`` captures a call's NCCL gathers in a CUDA graph,
and NCCL requires every rank to capture and replay the same collectives; only one-rank groups had
run it, because NCCL refuses two ranks on one GPU of one host ("duplicate GPU").  Here each rank has
a host id of its own (``NCCL_HOSTID``), so NCCL takes the ranks for separate machines and connects
them with its socket transport over the loopback interface: real multi-rank communicators, real
captured and replayed collectives, on one GPU (run it under MPS: each rank's NCCL kernels must run
beside the others').  The GPU timings are meaningless here; the host's are recorded.

Per world (2 and 4): cases of 1 and 2 weights in 2 and 4 parts, ``--calls`` calls each on three
input sets in turn (each rank's shards seeded by set and rank, so every rank can build the
reference), the last rank late now and then (the host sleeps up to 2 ms, or its GPU sleeps 1 ms
before the call); each call replayed (``COMPASS_PARTS_REPLAY=1``: the first call of a signature is
issued, the second captures) and then issued (``=0``): the two must be bitwise equal, and within
2e-2 of the reference (the gathered shards times the weights in float32).  Then the host
microseconds of one call in 1 and in 4 parts, issued and replayed (the forms in turns, 4 calls after
the device went idle, median of 15 rounds): an extra part = (4 parts - 1 part) / 3.

    python benchmarks/parts_replay_ranks.py --worlds 2,4   # one GPU, under MPS
    python benchmarks/parts_replay_ranks.py --dry-run       # CPU, gloo: the script end to end (issued only)
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

NAME = "parts_replay_ranks"
TOL = 2e-2
ROWS, K = 512, 1024  # rows of a rank's shard and its width (small: the socket transport is slow)
CASES = [(1, 2), (1, 4), (2, 4)]  # (weights, parts); each case's shards have rows of their own
TIMING = (1024, 4096, 3584)  # shard rows, k, n of the host-time forms (calibrate's pair at TP = 8, halved)


def shard_of(rank: int, seed: int, rows: int, k: int, device: str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(1000 * seed + rank)
    x = torch.randn(rows, k, generator=g, device=device) / k ** 0.25
    return x if device == "cpu" else x.bfloat16()


def weights_of(n_weights: int, k: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(777)
    ws = [torch.randn(k, 256 * (i + 1), generator=g, device=device) / k ** 0.25 for i in range(n_weights)]
    return ws if device == "cpu" else [w.bfloat16() for w in ws]


def set_replay(on: bool) -> None:
    os.environ["COMPASS_PARTS_REPLAY"] = "1" if on else "0"


def check_case(rank: int, world: int, n_weights: int, parts: int, calls: int, device: str, rows: int) -> dict:
    """``calls`` calls of one case, each replayed then issued; the largest differences seen."""
    from compass_fx.lowering import parts_replay

    group = dist.group.WORLD.group_name
    op = torch.ops.compass.all_gather_mm_parts.default
    weights = weights_of(n_weights, K, device)
    sets = [shard_of(rank, s, rows, K, device) for s in range(3)]  # a signature per case (rows)
    refs = [[torch.cat([shard_of(r, s, rows, K, device) for r in range(world)]).float() @ w.float()
             for w in weights] for s in range(3)]
    rng = random.Random(rank)
    worst_ref, mismatched = 0.0, 0
    for c in range(calls):
        if rank == world - 1 and rng.random() < 0.2:
            if device != "cpu" and rng.random() < 0.5:
                torch.cuda._sleep(int(1e-3 * 1.98e9))  # the GPU late: the staging copy waits behind it
            else:
                time.sleep(rng.random() * 2e-3)
        shard = sets[c % 3].clone()  # new values' address now and then, as a training step's
        set_replay(True)
        replayed = op(shard, weights, parts, world, group)
        set_replay(False)
        issued = op(shard, weights, parts, world, group)
        for r, i, ref in zip(replayed, issued, refs[c % 3]):
            mismatched += int(not torch.equal(r, i))
            worst_ref = max(worst_ref, float((r.float() - ref).abs().max() / ref.abs().max()))
    if device != "cpu":
        torch.cuda.synchronize()
    state = parts_replay._states.get((shard.get_device(), group, parts, tuple(shard.shape), shard.dtype))
    replays = state.progress.issued if state else 0
    finished = state.progress.done.value if state else 0
    ok = mismatched == 0 and worst_ref < TOL and (device == "cpu" or replays == calls - 1 == finished)
    return {"weights": n_weights, "parts": parts, "calls": calls, "status": "pass" if ok else "FAIL",
            "mismatched_outputs": mismatched, "relative_error": worst_ref, "replays": replays,
            "replays_finished": finished}


def host_times(rank: int, world: int, device: str, rounds: int) -> dict:
    """Host us per call of the op in 1 and 4 parts, issued and replayed, the forms in turns."""
    group = dist.group.WORLD.group_name
    op = torch.ops.compass.all_gather_mm_parts.default
    rows, k, n = TIMING if device != "cpu" else (64, 32, 16)
    shard = shard_of(rank, 9, rows, k, device)
    w = [(torch.randn(k, n, device=device) / k ** 0.5).to(shard.dtype)]
    forms = {(replay, parts): None for replay in (False, True) for parts in (1, 4)}
    for replay, parts in forms:  # first call issued, second captures: warm every form up
        set_replay(replay)
        for _ in range(3):
            op(shard, w, parts, world, group)
    per_round: dict = {f: [] for f in forms}
    for _ in range(rounds):
        for replay, parts in forms:
            set_replay(replay)
            if device != "cpu":
                torch.cuda.synchronize()
            dist.barrier()  # collectives: every rank times the same form at the same time
            t0 = time.perf_counter()
            for _ in range(4):
                op(shard, w, parts, world, group)
            per_round[(replay, parts)].append((time.perf_counter() - t0) / 4 * 1e6)
    if device != "cpu":
        torch.cuda.synchronize()
    med = {f: statistics.median(v) for f, v in per_round.items()}
    return {"rows": rows, "k": k, "n": n,
            "issued_1_us": med[(False, 1)], "issued_4_us": med[(False, 4)],
            "replayed_1_us": med[(True, 1)], "replayed_4_us": med[(True, 4)],
            "extra_part_issued_us": (med[(False, 4)] - med[(False, 1)]) / 3,
            "extra_part_replayed_us": (med[(True, 4)] - med[(True, 1)]) / 3}


def worker(rank: int, world: int, calls: int, rounds: int, dry_run: bool, deadline_s: float, how_to_end: str,
           init: str, out_path: str) -> None:
    """One rank: NCCL over loopback sockets with a host id of its own (gloo on CPU for a dry run)."""
    import faulthandler

    os.environ["COMPASS_FUSED_TIMEOUT_S"] = "30"
    faulthandler.dump_traceback_later(deadline_s - 15, exit=False)  # where a stuck rank is, before it is killed
    res: dict = {"rank": rank}

    def note(what: str) -> None:
        print(f"[rank {rank}/{world}] {what} ({time.time() - t0:.1f} s)", file=sys.stderr, flush=True)
    t0 = time.time()
    try:
        if dry_run:
            device, backend = "cpu", "gloo"
        else:
            os.environ.update(NCCL_HOSTID=f"compass-parts-replay-rank{rank}", NCCL_IB_DISABLE="1",
                              NCCL_SOCKET_IFNAME="lo", NCCL_DEBUG=os.environ.get("NCCL_DEBUG", "WARN"))
            torch.cuda.set_device(0)
            device, backend = "cuda", "nccl"
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
        import compass_fx.lowering.gather_parts  # noqa: F401  (registers compass::all_gather_mm_parts)

        note("group ready")
        res["cases"] = []
        for i, (nw, parts) in enumerate(CASES):
            res["cases"].append(check_case(rank, world, nw, parts, calls, device, ROWS + 64 * i))
            note(f"case weights={nw} parts={parts}: {res['cases'][-1]['status']}")
        res["host"] = host_times(rank, world, device, rounds)
        note("host times done")
        res["status"] = "pass" if all(c["status"] == "pass" for c in res["cases"]) else "FAIL"
    except Exception as e:  # noqa: BLE001 - the world's outcome
        res.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-800:])
    if how_to_end == "exit":  # no destroy_process_group: the interpreter's exit releases the graphs
        res["teardown"] = {"exit": True}
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(res, f)
        note("exiting without destroying the group")
        return
    res["teardown"] = teardown()
    note(f"teardown: {res['teardown']}")
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(res, f)
    os._exit(0)  # a group that could not be destroyed holds threads that would keep the process


def teardown(bound_s: float = 20.0) -> dict:
    """``dist.destroy_process_group()`` as a training script's last line calls it (the parts' graphs
    must be released before NCCL destroys the communicator: parts_replay does it), given
    ``bound_s``: how long it took and how many graphs were left, or that it did not return."""
    import threading

    from compass_fx.lowering import parts_replay

    graphs = sum(1 for state in parts_replay._states.values() if state is not None and state.graph is not None)
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        finally:
            done.set()
    threading.Thread(target=destroy, daemon=True).start()
    t1 = time.time()
    finished = done.wait(bound_s)
    return {"graphs_before": graphs, "graphs_after": len(parts_replay._states),
            "destroy_s": round(time.time() - t1, 3) if finished else None, "destroyed": finished}


def markdown(payload: dict) -> str:
    lines = [f"# {NAME} ({payload['tag']})", "",
             "Ranks sharing one GPU, each with its own NCCL_HOSTID (NCCL's socket transport over loopback), "
             "calling compass::all_gather_mm_parts: each call replayed from the parts' CUDA graph "
             "(COMPASS_PARTS_REPLAY=1) and issued (=0), on new values, the last rank late now and then; "
             "mismatched: outputs of a replay not bitwise equal to the issued call; rel. error: against the "
             "gathered shards times the weights in float32.", ""]
    checks = [dict(world=w["world"], rank=0, **c) for w in payload["worlds"] for c in w.get("cases", [])]
    lines.append(output.markdown_table(checks, ["world", "weights", "parts", "calls", "status",
                                                ("mismatched_outputs", "mismatched"), ("relative_error", "rel. error"),
                                                "replays", ("replays_finished", "finished")]))
    lines += ["", "Host microseconds of one call (rank 0; median of rounds of 4 calls after the device went idle, "
              "the forms in turns); an extra part = (4 parts - 1 part) / 3:", ""]
    hosts = [dict(world=w["world"], **w["host"]) for w in payload["worlds"] if "host" in w]
    lines.append(output.markdown_table(hosts, ["world", "rows", "k", "n", ("issued_1_us", "issued 1"),
                                               ("issued_4_us", "issued 4"), ("replayed_1_us", "replayed 1"),
                                               ("replayed_4_us", "replayed 4"),
                                               ("extra_part_issued_us", "extra part issued"),
                                               ("extra_part_replayed_us", "extra part replayed")]))
    if payload.get("end") == "exit":
        lines += ["", "Teardown: the ranks exit without destroy_process_group() (the interpreter's exit hook "
                  "releases the parts' graphs); a rank that does not exit is killed at the deadline and named "
                  "below.", ""]
    else:
        lines += ["", "Teardown (every rank: dist.destroy_process_group() as a script's last line, given 20 s; "
                  "parts_replay releases its graphs first):", ""]
        for w in payload["worlds"]:
            downs = [r.get("teardown") or {} for r in w["ranks"]]
            ok = all(d.get("destroyed") for d in downs)
            lines.append(f"* world {w['world']}: " + (
                f"destroyed on every rank, the slowest in {max(d['destroy_s'] for d in downs):.2f} s, "
                f"{max(d['graphs_before'] for d in downs)} graphs released, {max(d['graphs_after'] for d in downs)} left"
                if ok else f"not destroyed within 20 s on ranks "
                f"{[i for i, d in enumerate(downs) if not d.get('destroyed')]}"))
    errors = [f"* world {w['world']}: {w['error']}" for w in payload["worlds"] if w.get("error")]
    return "\n".join(lines + ([""] + errors if errors else []))


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--calls", type=int, default=24)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--deadline", type=float, default=240.0, help="seconds a world may take before its ranks are killed")
    p.add_argument("--dry-run", action="store_true", help="CPU ranks over gloo: the script end to end, issued only")
    p.add_argument("--end", choices=("destroy", "exit"), default="destroy",
                   help="how the ranks end: dist.destroy_process_group(), or exit without it (the exit hook's release)")
    p.add_argument("--tag", default=None)
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("parts_replay_ranks needs a CUDA GPU (or --dry-run)")
    tag = args.tag or ("cpu" if args.dry_run else "h200")
    calls, rounds = (4, 2) if args.dry_run else (args.calls, args.rounds)
    worlds = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i, world in enumerate(int(w) for w in args.worlds.split(",")):
            ranks, killed = launch.fresh_ranks(worker, world, (calls, rounds, args.dry_run, args.deadline, args.end), tmp, i,
                                              args.deadline)
            row = launch.world_outcome(world, ranks, killed, args.deadline)
            row.update(cases=ranks[0].get("cases", []), host=ranks[0].get("host"), ranks=ranks)
            worlds.append(row)
            print(f"world {world}: {row['status']}" + (f" ({row['error'][:200]})" if "error" in row else ""),
                  flush=True)
    payload = {"benchmark": NAME, "tag": tag, "calls": calls, "end": args.end, "worlds": worlds, "seconds": round(time.time() - t0, 1),
               "environment": output.environment(args.dry_run)}
    output.write_results(NAME, tag, payload, markdown(payload), args.out_dir)
    print(markdown(payload))
    return 0 if all(w["status"] == "pass" for w in worlds) else 1


if __name__ == "__main__":
    sys.exit(main())
