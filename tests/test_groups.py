"""``compass_fx.gloo_worker_threads``: gloo groups made inside it run the worker threads asked for,
the groups made outside keep torch's two, and the test pools' ranks use it (a functional gather
workload that kills a rank with torch's two threads runs clean)."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import compass_fx

TORCHS_CLASS = torch._C._distributed_c10d.ProcessGroupGloo


def _threads_of_a_new_group() -> int:
    """Make a one-rank gloo backend the way ``init_process_group`` and ``new_group`` do (through
    the name ``distributed_c10d.ProcessGroupGloo``, with a timeout) and read its thread count."""
    backend = c10d.ProcessGroupGloo(dist.HashStore(), 0, 1, timeout=datetime.timedelta(seconds=5))
    assert isinstance(backend, TORCHS_CLASS)
    return backend.options._threads


def test_groups_made_inside_run_the_threads_asked_for_and_outside_torchs_default():
    default = _threads_of_a_new_group()
    assert default == 2, "torch's gloo groups start two worker threads per device"
    with compass_fx.gloo_worker_threads(1):
        assert _threads_of_a_new_group() == 1
        with compass_fx.gloo_worker_threads(3):  # nested: the inner count, then the outer again
            assert _threads_of_a_new_group() == 3
        assert _threads_of_a_new_group() == 1
    assert c10d.ProcessGroupGloo is TORCHS_CLASS
    assert _threads_of_a_new_group() == default


def test_settings_newer_torch_passes_reach_the_options_and_unknown_ones_are_refused():
    """torch 2.14 passes ``enable_reconfigure=`` when it makes a group: a keyword the options hold
    is set on them (``group_name`` on every torch here); one they lack is refused as torch would."""
    store, timeout = dist.HashStore(), datetime.timedelta(seconds=5)
    with compass_fx.gloo_worker_threads(1):
        backend = c10d.ProcessGroupGloo(store, 0, 1, timeout=timeout, group_name="named")
        assert (backend.options.group_name, backend.options._threads) == ("named", 1)
        with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_setting'"):
            c10d.ProcessGroupGloo(store, 0, 1, timeout=timeout, no_such_setting=1)


def test_the_class_is_restored_when_the_body_raises():
    with pytest.raises(KeyError):
        with compass_fx.gloo_worker_threads(1):
            raise KeyError("boom")
    assert c10d.ProcessGroupGloo is TORCHS_CLASS


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1"])
def test_a_bad_thread_count_is_refused(bad):
    with pytest.raises(ValueError, match="threads must be a positive int"):
        with compass_fx.gloo_worker_threads(bad):
            pass
    assert c10d.ProcessGroupGloo is TORCHS_CLASS


def _pool_threads(rank: int) -> dict:
    cpu = torch.device("cpu")
    group = dist.new_group(backend="gloo")
    return {"world": dist.group.WORLD._get_backend(cpu).options._threads,
            "new_group": group._get_backend(cpu).options._threads}


def test_the_pools_groups_run_one_worker_thread(ranks):
    assert ranks(2).run(_pool_threads) == [{"world": 1, "new_group": 1}] * 2


def _gathers_in_flight(rank: int, calls: int, in_flight: int) -> int:
    """``calls`` rounds of ``in_flight`` functional all-gathers issued before any is waited for
    (what killed a rank with two worker threads: ``benchmarks/funcol_gloo_inflight.py``), every
    gathered row checked."""
    world, c10d_ops = dist.get_world_size(), torch.ops._c10d_functional
    group_name = dist.group.WORLD.group_name
    x = torch.arange(32 * 32, dtype=torch.float32).view(32, 32) + 1000 * rank
    parts = list(x.chunk(in_flight))
    wants = [torch.cat([p - 1000 * rank + 1000 * r for r in range(world)]) for p in parts]
    for _ in range(calls):
        outs = [c10d_ops.wait_tensor(o) for o in
                [c10d_ops.all_gather_into_tensor(p, world, group_name) for p in parts]]
        for o, want in zip(outs, wants):
            if not torch.equal(o, want):
                raise AssertionError("a gather returned wrong rows")
    return calls


@pytest.mark.slow  # ~5 s: 2000 rounds of four gathers
def test_functional_gathers_in_flight_on_the_pools_ranks(ranks):
    # With torch's two threads four gathers in flight killed a rank within 300-4800 rounds in each
    # of 6 runs (results funcol_gloo_inflight-cpu and -cpu-threads); 2000 rounds here.
    assert ranks(2).run(_gathers_in_flight, 2000, 4) == [2000, 2000]


def _gloo_notes(rank: int) -> dict:
    """Compile a rewritten model on the pool's one-thread WORLD group, then on a group of torch's
    default two threads; return each compile's report notes about gloo threads."""
    import wild_models

    import compass_fx.backend

    with compass_fx.gloo_worker_threads(2):
        two_threads = dist.new_group(backend="gloo")
    notes = {}
    for label, group in (("one thread", dist.group.WORLD), ("two threads", two_threads)):
        torch._dynamo.reset()
        before = len(compass_fx.backend.history)
        model = torch.compile(wild_models.build("reshape_chain", group), backend="compass",
                              options={"chunks": 2, "inner": "eager"})
        model(wild_models.shard_input("reshape_chain", rank)).sum().backward()
        reports = list(compass_fx.backend.history)[before:]
        notes[label] = [n for r in reports for n in r.notes if "gloo" in n]
        notes[label + " graphs"] = len(reports)
    notes["two threads name"] = two_threads.group_name
    return notes


@pytest.mark.slow  # two small compiles on 2 ranks
def test_the_report_says_when_a_graphs_collectives_run_on_two_gloo_threads(ranks):
    res = ranks(2).run(_gloo_notes)[0]
    assert res["one thread graphs"] == 2 and res["one thread"] == [], res
    assert res["two threads graphs"] == 2, res
    assert res["two threads"], f"no note for a group of two gloo threads: {res}"
    for note in res["two threads"]:
        assert f"group {res['two threads name']!r} runs gloo with 2 worker threads" in note, note
        assert "compass_fx.gloo_worker_threads(1)" in note, note


def _threads_disagree(rank: int) -> str:
    """Rank 0 makes a group of two gloo threads (torch's default), rank 1 of the pool's one;
    compiling a decomposed gather on it must fail on both ranks: the gather's form follows the
    threads, so ranks that differ would lower it differently."""
    with compass_fx.gloo_worker_threads(2 if rank == 0 else 1):
        group = dist.new_group(backend="gloo")
    name, world = group.group_name, dist.get_world_size()
    w = torch.randn(64, 32)

    def gather_mm(x):
        ops = torch.ops._c10d_functional
        return ops.wait_tensor(ops.all_gather_into_tensor(x, world, name)) @ w

    torch._dynamo.reset()
    try:
        torch.compile(gather_mm, backend="compass", options={"chunks": 2, "inner": "eager"})(torch.randn(32, 64))
    except Exception as e:  # noqa: BLE001 - the test reads the error
        return f"{type(e).__name__}: {e}"
    return "compiled"


@pytest.mark.slow  # a compile on 2 ranks
def test_ranks_whose_gloo_threads_differ_get_a_clear_error(ranks):
    errors = ranks(2).run(_threads_disagree)
    for error in errors:
        assert "RankDisagreement" in error and "gloo worker thread" in error, errors
    assert "runs 1 gloo worker thread(s) on rank 1 and 2 on rank 0" in errors[1], errors
