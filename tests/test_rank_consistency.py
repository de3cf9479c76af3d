"""Ranks that see different local information still rewrite their graphs identically.

Each rank registers a cost hook fed by "its own measurements" (rank 0 finds decompose(d=2)
fastest, rank 1 finds sequential fastest): left alone they would rewrite differently and the
collectives would not match.  The graphs each rank hands to the inner compiler must be identical
text.  Graphs that really differ between ranks, or a rank that never compiles, end in a clear
``RankDisagreement`` on the ranks involved, not a hang.
"""
from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

WORLD = 2


def _prefer(label: str):
    def hook(workload, topology, candidate):
        return 1e-6 if candidate.label == label else 1.0  # (0.0 trips a division in select._reason)
    return hook


def disagreeing_hooks_step(rank: int, dump_dir: str) -> dict:
    import wild_models

    import compass_fx
    import compass_fx.backend
    from compass_fx.cost import Workload, select

    torch._dynamo.reset()
    hook = compass_fx.register_cost_hook(_prefer("decompose(d=2)" if rank == 0 else "sequential"))
    try:
        probe = Workload(kind="all_gather_matmul", m=16, n=32, k=16, dtype="float32", group_size=WORLD,
                         feasible_parts=(1, 2, 4))
        local_choice = select(probe).label
        x = wild_models.shard_input("reshape_chain", rank)
        eager, model = (wild_models.build("reshape_chain", dist.group.WORLD) for _ in range(2))
        ref = eager(x)
        before = len(compass_fx.backend.history)
        out = torch.compile(model, backend="compass", options={"inner": "eager", "dump_dir": dump_dir},
                            fullgraph=True)(x)
        (ref ** 2).sum().backward()
        (out ** 2).sum().backward()
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
    finally:
        compass_fx.unregister_cost_hook(hook)
    reports = list(compass_fx.backend.history)[before:]
    graphs = {f.name.split("_", 1)[1]: f.read_text() for f in Path(dump_dir).glob(f"rank{rank}_*_after.py")}
    return {"local_choice": local_choice, "graphs": graphs,
            "decisions": [(p.collective, p.strategy, p.parts, p.status) for r in reports for p in r.pairs]}


def test_different_local_costs_give_identical_graphs(ranks, tmp_path):
    res = ranks(WORLD).run(disagreeing_hooks_step, str(tmp_path))
    assert res[0]["local_choice"] == "decompose(d=2)" and res[1]["local_choice"] == "sequential", \
        "the premise: on their own the ranks would decide differently"
    assert res[0]["graphs"] and res[0]["graphs"].keys() == res[1]["graphs"].keys()
    for name, text in res[0]["graphs"].items():
        assert res[1]["graphs"][name] == text, f"rank 1's {name} differs from rank 0's"
    assert res[0]["decisions"] == res[1]["decisions"]
    assert all(s == "decompose" and p == 2 and st == "rewritten" for _, s, p, st in res[0]["decisions"])


def _compile_error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        return f"{type(e).__name__}: {e}"
    return ""


def different_graphs_step(rank: int) -> str:
    import wild_models

    torch._dynamo.reset()
    model = wild_models.build("reshape_chain", dist.group.WORLD)
    x = torch.randn(2, 4 if rank == 0 else 6, wild_models.D)  # the ranks trace different shapes
    compiled = torch.compile(model, backend="compass", options={"chunks": 2, "inner": "eager"}, fullgraph=True)
    return _compile_error(lambda: compiled(x))  # the compile fails before any collective runs


def test_graphs_that_differ_between_ranks_raise_clearly(ranks):
    errors = ranks(WORLD).run(different_graphs_step)
    for err in errors:
        assert "RankDisagreement" in err and "ranks disagree" in err and "graphs differ" in err, err


def missing_rank_step(rank: int) -> str:
    import wild_models

    torch._dynamo.reset()
    if rank == 1:
        return "skipped"  # this rank never compiles the graph
    store = dist.distributed_c10d._get_default_store()
    old = store.timeout
    store.set_timeout(datetime.timedelta(seconds=3))
    try:
        model = wild_models.build("reshape_chain", dist.group.WORLD)
        compiled = torch.compile(model, backend="compass", options={"chunks": 2, "inner": "eager"},
                                 fullgraph=True)
        return _compile_error(lambda: compiled(wild_models.shard_input("reshape_chain", rank)))
    finally:
        store.set_timeout(old)


def test_a_rank_that_never_arrives_raises_instead_of_hanging(ranks):
    """It leaves the ranks' agreement counters out of step: the pool is discarded afterwards."""
    import time

    start = time.monotonic()
    try:
        errors = ranks(WORLD).run(missing_rank_step)
    finally:
        ranks.discard(WORLD)
    assert errors[1] == "skipped"
    assert "RankDisagreement" in errors[0] and "did not reach" in errors[0], errors[0]
    assert time.monotonic() - start < 120
