""""auto" never chooses a strategy the lowering refuses (issue 26): what a pair's kind cannot lower is
known before anything is priced, so the cost model picks among the others and the runner-up wins.

The two cases the issue names, on the ``h200-host-staged-8`` topology with the fused schedules
offered (as on GPUs; on CPU "auto" offers none, so the offer is patched in): ``all_gather ->
.float() -> mm`` and ``mm -> cast -> reduce_scatter``.  The fused operators take no dtype cast;
at these shapes the cost model would choose ``fuse(direct)`` (the premise, checked), so before
the fix the pair fell back to sequential at rewrite time and decomposition was never tried.
Graphs are traced with fake tensors on a fake process group (large shapes, nothing computed).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from compass_fx.cost import Topology, Workload, select
from compass_fx.graph_pass import compass_pass
from compass_fx.options import parse_options
from compass_fx.report import Report

WORLD, M, N, K = 4, 32768, 1024, 1024
TOPOLOGY = "h200-host-staged-8"
c10d = torch.ops._c10d_functional


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def gather_float_mm(group: str):
    def fn(shard, w):  # shard [M/W, K] bf16 -> gathered, cast to fp32, times w [K, N]
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(shard, WORLD, group))
        return torch.mm(gathered.float(), w)
    return fn, (torch.empty(M // WORLD, K, dtype=torch.bfloat16), torch.empty(K, N))


def mm_cast_reduce_scatter(group: str):
    def fn(x, w):  # x [M, K] fp32 times w [K, N], cast to bf16, reduce-scattered
        y = torch.mm(x, w).to(torch.bfloat16)
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", WORLD, group))
    return fn, (torch.empty(M, K), torch.empty(K, N))


@pytest.mark.parametrize("build", [gather_float_mm, mm_cast_reduce_scatter])
def test_auto_takes_the_runner_up_when_the_fused_operator_is_refused(group, build, monkeypatch):
    import compass_fx.passes.decide as decide

    monkeypatch.setattr(decide, "offered_fused_schedules", lambda pair: ("direct",))  # as on GPUs
    fn, inputs = build(group)
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    topology = Topology.resolve(TOPOLOGY)
    report = compass_pass(gm, "forward", parse_options({"topology": TOPOLOGY}), topology)
    (pair,) = report.pairs
    # the premise: offered the fused operator, the cost model would choose it for this workload
    workload = Workload(pair.kind, m=pair.m, n=pair.n, k=pair.k, dtype=pair.dtype, group_size=WORLD,
                        gemm_dtype=pair.gemm_dtype)
    assert select(workload, topology, fused_schedules=("direct",)).strategy == "fuse"
    runner_up = select(workload, topology, fused_schedules=())
    assert runner_up.strategy == "decompose"
    # what happened: the fused operator was never priced, the runner-up was chosen and applied
    assert (pair.strategy, pair.parts, pair.status) == ("decompose", runner_up.parts, "rewritten"), pair
    assert not any(c["strategy"] == "fuse" for c in pair.candidates), pair.candidates
    assert [r["strategy"] for r in pair.refused] == ["fuse"] and "dtype casts" in pair.refused[0]["reason"]
    # and explain says so
    text = str(Report(graphs=[report]))
    assert f"refused forward/{pair.collective}: fuse: the pair has wild-graph details (dtype casts)" in text, text


def test_a_forced_strategy_the_lowering_refuses_is_skipped_with_the_reason(group):
    fn, inputs = gather_float_mm(group)
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    report = compass_pass(gm, "forward", parse_options({"strategy": "fuse", "schedule": "direct"}))
    (pair,) = report.pairs
    assert (pair.strategy, pair.status) == ("fuse", "skipped") and "not offered" in pair.reason, pair
    assert report.collectives_after == report.collectives_before
