"""A replayed eager fused call whose peer stops calling ends in the watchdog's error, on ONE GPU.

Why (issue 27): an eager call replayed from a CUDA graph registers no event with the watchdog; the
graph's last node counts the finished replays in pinned host memory and the call notes its epoch
in a ring (``compass_fx.kernels.cuda.watchdog.Progress``).  This checks on the GPU what the unit
tests check with stand-ins: two ranks (gloo, host transport, sharing the GPU) make enough calls
that the calls replay, then rank 1 stops calling while rank 0 makes one more (and four ranks of an
all-reduce, whose replay waits for each chunk's pulls from three peers as one batch, the last
rank stopping).  Rank 0's call must
end in the watchdog's error naming that call's epoch within ``COMPASS_FUSED_TIMEOUT_S`` (3 s here)
plus a scan, its GPU work must finish (the watchdog releases the wait), and its next call must
raise that error.

    python benchmarks/fused_watchdog_replay.py   # one GPU: writes fused_watchdog_replay-h200.{json,md}
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import launch, output  # noqa: E402  (sets the no-multicast environment first)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

NAME = "fused_watchdog_replay"
TIMEOUT_S = 3.0
CASES = [("all_gather_matmul", 256, 1024, 2048, 2), ("matmul_reduce_scatter", 512, 2048, 1024, 2),
         ("matmul_all_reduce", 512, 2048, 1024, 2), ("matmul_all_reduce", 512, 2048, 1024, 4)]  # (..., ranks)


def worker(rank: int, world: int, case: tuple, init: str, out_path: str) -> None:
    import json

    os.environ["COMPASS_FUSED_TRANSPORT"] = "host"
    os.environ["COMPASS_FUSED_TIMEOUT_S"] = str(TIMEOUT_S)
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import compass_fx.kernels  # noqa: F401
    from compass_fx.kernels.cuda import impl, replay, watchdog

    op, rows, k, n, _ = case
    a = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    fn = getattr(torch.ops.compass, op).graph
    args = ([b] if op == "all_gather_matmul" else b, "direct", dist.group.WORLD.group_name, world)
    for _ in range(12):
        fn(a, *args)
    torch.cuda.synchronize()
    dist.barrier()
    res = {"status": "pass", "replayed_before": replay.stats["replayed"]}
    if rank == world - 1:  # the peer that stops calling
        time.sleep(TIMEOUT_S + 8)
        res["role"] = "stopped calling"
    else:
        ws = next(w for (key, captured), w in impl._workspaces.items() if not captured)
        before = replay.stats["replayed"]
        fn(a, *args)  # waits for the peer's flags, which never come
        res.update(stuck_epoch=ws.epoch, stuck_call_replayed=replay.stats["replayed"] == before + 1,
                   progress_counted=ws.progress is not None)
        dog = watchdog.for_device(0)
        t0 = time.monotonic()
        while dog.failure is None and time.monotonic() - t0 < TIMEOUT_S + 6:
            time.sleep(0.05)
        res["error_after_s"] = round(time.monotonic() - t0, 2)
        res["watchdog_error"] = dog.failure
        synced = threading.Event()
        threading.Thread(target=lambda: (torch.cuda.synchronize(), synced.set()), daemon=True).start()
        res["gpu_work_finished"] = synced.wait(10)
        try:
            fn(a, *args)
            res["next_call"] = "returned"
        except RuntimeError as e:
            res["next_call"] = f"RuntimeError: {str(e)[:200]}"
        ok = (dog.failure is not None and f"call {res['stuck_epoch']} " in dog.failure and res["gpu_work_finished"]
              and res["next_call"].startswith("RuntimeError") and res["stuck_call_replayed"])
        res["status"] = "pass" if ok else "FAIL"
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(res, f)
    os._exit(0)  # the group's peer is gone: no orderly teardown


def main(argv=None) -> int:
    args = output.one_gpu_args(__doc__, argv, "fused_watchdog_replay needs a CUDA GPU")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, case in enumerate(CASES):
            ranks, killed = launch.fresh_ranks(worker, case[4], (case,), tmp, i, TIMEOUT_S + 60)
            row = dict(ranks[0], op=case[0], rows=case[1], world=case[4], killed_ranks=killed,
                       peer=ranks[-1].get("role", ranks[-1].get("error")))
            if any(r.get("status") != "pass" for r in ranks):
                row["status"] = "FAIL"
            rows.append(row)
            print(f"{case[0]} rows={case[1]} ranks={case[4]}: {row['status']} (epoch {row.get('stuck_epoch')}, error after "
                  f"{row.get('error_after_s')} s: {str(row.get('watchdog_error'))[:200]})", flush=True)
    payload = {"benchmark": NAME, "tag": args.tag, "timeout_s": TIMEOUT_S, "rows": rows,
               "environment": output.environment(False)}
    md = "\n".join([f"# {NAME} ({args.tag})", "", __doc__.split("\n\n")[1].replace("\n", " "), "",
                    output.markdown_table(rows, ["op", "rows", "world", "status", "stuck_epoch", "stuck_call_replayed",
                                                 "progress_counted", "error_after_s", "gpu_work_finished",
                                                 "next_call", "watchdog_error"])])
    return output.print_and_write(NAME, args, payload, md)


if __name__ == "__main__":
    sys.exit(main())
