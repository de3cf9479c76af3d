"""Failure behaviour: a rewritten pair whose peer times out or dies ends the step with the
process group's error, within a bounded time, instead of hanging.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import time

import pytest
import torch
import torch.distributed as dist

from rank_pool import RankPool, fork_context

pytestmark = pytest.mark.slow  # fresh ranks killed or timed out on purpose

TIMEOUT_S = 3


def _compiled_step_fn(group):
    import wild_models

    model = wild_models.build("reshape_chain", group)
    compiled = torch.compile(model, backend="compass", options={"chunks": 2, "inner": "eager"}, fullgraph=True)
    return compiled


def timeout_step(rank: int) -> dict:
    """Both ranks run one step of a rewritten model over a group with a 3 s timeout; then rank 1
    stays away from the second step."""
    import wild_models

    import compass_fx.backend

    torch._dynamo.reset()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    compiled = _compiled_step_fn(group)
    x = wild_models.shard_input("reshape_chain", rank)
    compiled(x)  # step 1: everyone is there
    rewritten = sum(p.status == "rewritten" for r in list(compass_fx.backend.history)[-2:] for p in r.pairs)
    if rank == 1:
        return {"rewritten": rewritten, "error": "", "seconds": 0.0}
    start = time.monotonic()
    try:
        compiled(x)  # step 2: rank 1 never joins
        error = ""
    except Exception as e:  # noqa: BLE001 - the test checks the error
        error = f"{type(e).__name__}: {e}"
    return {"rewritten": rewritten, "error": error, "seconds": time.monotonic() - start}


def test_collective_timeout_in_a_rewritten_pair_raises():
    # Ranks of its own: rank 0 leaves collectives of a timed-out group behind in gloo, which the
    # session's shared pool must not carry into other tests.
    pool = RankPool(2)
    try:
        res = pool.run(timeout_step)
    finally:
        pool.close(force=True)
    assert res[0]["rewritten"] > 0, "the step must go through a rewritten pair"
    assert res[0]["error"], "a step whose peer never joined must fail, not return"
    assert "timed out" in res[0]["error"].lower() or "timeout" in res[0]["error"].lower(), res[0]["error"]
    assert res[0]["seconds"] < 60


def _dying_peer(rank: int, port: int, results) -> None:
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    torch.set_num_threads(1)
    from compass_fx import gloo_worker_threads

    with gloo_worker_threads(1):  # as the pools' ranks (tests/rank_pool.py)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30))
    import wild_models

    compiled = _compiled_step_fn(dist.group.WORLD)
    x = wild_models.shard_input("reshape_chain", rank)
    compiled(x)
    dist.barrier()
    if rank == 1:
        os._exit(3)  # the peer dies between steps
    time.sleep(1.0)
    start = time.monotonic()
    try:
        compiled(x)
        results.put(("returned", time.monotonic() - start))
    except Exception as e:  # noqa: BLE001
        results.put((f"{type(e).__name__}: {e}", time.monotonic() - start))


def test_peer_death_during_a_rewritten_pair_raises():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = fork_context()  # fresh processes, forked from a server that imported torch once
    results = ctx.Queue()
    procs = [ctx.Process(target=_dying_peer, args=(r, port, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        outcome, seconds = results.get(timeout=240)
    except queue.Empty:
        outcome, seconds = "hung", None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    assert outcome not in ("hung", "returned"), outcome
    assert procs[1].exitcode == 3
    assert seconds is not None and seconds < 60


def _harmless(rank: int, value: int) -> int:
    return value + rank


def _abort_on_rank_1(rank: int) -> None:
    if rank == 1:
        os.abort()  # what the C allocator does when it finds its heap corrupted
    time.sleep(30)  # rank 0 would wait in a collective with the dead rank


def test_a_pool_rank_dying_names_the_pools_history():
    """A rank killed in native code fails the test at once, and the error lists what the pool's
    ranks ran before: the task that corrupted a process's memory may be any earlier one."""
    pool = RankPool(2, timeout_s=60)
    try:
        assert pool.run(_harmless, 5) == [5, 6]
        assert pool.run(_harmless, 7) == [7, 8]
        start = time.monotonic()
        with pytest.raises(RuntimeError) as err:
            pool.run(_abort_on_rank_1)
        assert time.monotonic() - start < 20, "a dead rank must fail the run without waiting for the others"
    finally:
        pool.close(force=True)
    text = str(err.value)
    assert "_abort_on_rank_1: rank(s) died with exit codes {1: -6}" in text, text
    assert "last 3 of 3 tasks" in text, text
    assert text.index("test_failures._harmless(5)") < text.index("test_failures._harmless(7)") \
        < text.index("test_failures._abort_on_rank_1()"), text
    assert not pool.alive
