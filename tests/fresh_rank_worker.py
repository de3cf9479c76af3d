"""A rank for ``test_bench_scripts.test_fresh_ranks_reports_every_rank``, in a module of its own.

Why a module of its own: a spawned process imports the module its target lives in, and the test
module imports torch and pytest (about 2 s a process on 2 busy cores); this one imports nothing
heavy, so the launcher's cases take a fraction of a second each and a short deadline is safe.
"""
from __future__ import annotations

import json
import os
import time


def fresh_rank(rank: int, world: int, how: str, init: str, out_path: str) -> None:
    """Rank 0 answers; rank 1 answers too, exits with code 3 (``dies``) or sleeps past any deadline
    (``hangs``).  ``agrees``: the ranks meet in a gloo group and take two cases as the GPU scripts'
    workers do (``harness.launch.save_and_agree``, then ``leave_group`` twice), rank 1's second
    case failing; each rank's file holds its cases and whether the ranks agreed to go on."""
    if how == "agrees":
        _agrees(rank, world, init, out_path)
        return
    if rank == 1 and how == "hangs":
        time.sleep(60)
    if rank == 1 and how == "dies":
        os._exit(3)
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"status": "pass", "rank": rank, "world": world}, f)


def _agrees(rank: int, world: int, init: str, out_path: str) -> None:
    import sys

    import torch.distributed as dist

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from harness import launch

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    cases = [{"status": "pass"}]
    went_on = [launch.save_and_agree(cases, out_path, rank)]
    cases.append({"status": "FAIL" if rank == 1 else "pass"})
    went_on.append(launch.save_and_agree(cases, out_path, rank))
    launch.leave_group()
    launch.leave_group()  # a group already gone: nothing raised
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"status": "pass", "cases": cases, "went_on": went_on}, f)
