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
    (``hangs``)."""
    if rank == 1 and how == "hangs":
        time.sleep(60)
    if rank == 1 and how == "dies":
        os._exit(3)
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump({"status": "pass", "rank": rank, "world": world}, f)
