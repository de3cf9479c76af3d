"""Inductor keeps a decomposed pair pipelined: in the code it generates, each part's collective
is issued before the previous part's wait (Inductor's peak-memory reordering would move every wait
right behind its collective, which serialized the parts on 2 H200s); and each part's GEMM reads and
writes its rows where they lie (no copy of rows, no cat of the parts).  Gathers on gloo are the
exception: they block (``lowering/blocking_gather.py`` says why)."""
from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.inductor  # reads the code Inductor generates


def _torchs_gloo_group():
    """A gloo group of every rank with torch's default two worker threads (the pools' have one)."""
    import torch.distributed as dist

    from compass_fx import gloo_worker_threads

    with gloo_worker_threads(2):
        return dist.new_group(backend="gloo")


def _one_pair(world: int, kind: str, group=None):
    """A one-pair program (an all-gather then a matmul, or a matmul then a reduce-scatter) on
    ``group`` (default: WORLD) and its input."""
    import torch.distributed as dist

    group = (group or dist.group.WORLD).group_name
    c10d = torch.ops._c10d_functional
    w = torch.randn(64, 32)

    def gather_mm(x):
        return c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, group)) @ w

    def mm_scatter(x):
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(x @ w, "sum", world, group))

    return (gather_mm, torch.randn(32, 64)) if kind == "all_gather" else (mm_scatter, torch.randn(64, 64))


def _generated_order(rank: int, world: int, kind: str, options: dict, check: bool = True,
                     torchs_gloo_threads: bool = False) -> tuple[list[str], list[str]]:
    """The collectives, waits and part matmuls in the order Inductor's generated code calls them,
    and the reports' notes; ``check``: the compiled result equals the uncompiled one.
    ``torchs_gloo_threads``: on a gloo group of torch's default two worker threads (the pools'
    groups have one)."""
    from torch._inductor.utils import run_and_get_code

    import compass_fx.backend

    torch._dynamo.reset()
    fn, x = _one_pair(world, kind, _torchs_gloo_group() if torchs_gloo_threads else None)
    before = len(compass_fx.backend.history)
    compiled = torch.compile(fn, backend="compass", options=options)
    with torch.no_grad():
        _, codes = run_and_get_code(compiled, x)
        if check:
            torch.testing.assert_close(compiled(x), fn(x), rtol=1e-4, atol=1e-4)
    calls = re.findall(r"(all_gather_into_tensor|all_gather_blocking|reduce_scatter_tensor|wait_tensor|"
                       r"mm_into_row_blocks|all_gather_mm_parts)\.default\(", "\n".join(codes))
    notes = [n for r in list(compass_fx.backend.history)[before:] for n in r.notes]
    return calls, notes


def _positions(calls: list[str]) -> tuple[list[int], list[int], list[int]]:
    """Where the collectives, the waits and the gather side's part matmuls are in ``calls``."""
    collectives = [i for i, c in enumerate(calls) if c in ("all_gather_into_tensor", "reduce_scatter_tensor")]
    waits = [i for i, c in enumerate(calls) if c == "wait_tensor"]
    matmuls = [i for i, c in enumerate(calls) if c == "mm_into_row_blocks"]
    return collectives, waits, matmuls


def test_decomposed_reduce_scatter_stays_pipelined_under_inductor(ranks):
    calls, notes = ranks(2).run(_generated_order, 2, "reduce_scatter", {"chunks": 2})[0]
    collectives, waits, _ = _positions(calls)
    assert len(collectives) == 2 and len(waits) == 2, calls
    assert collectives[1] < waits[0], f"the first part's wait comes before the second part's collective: {calls}"
    assert any("reorder_for_peak_memory" in n for n in notes)


def test_decomposed_gathers_on_gloo_of_two_threads_leave_nothing_in_flight(ranks):
    """On a gloo group of torch's two worker threads each part is gathered by
    compass::all_gather_blocking (torch 2.13's functional gathers corrupt the heap there now and
    then): no functional gather, no wait, and the result is right (``_generated_order`` checks it)."""
    calls, notes = ranks(2).run(_generated_order, 2, "all_gather", {"chunks": 2}, True, True)[0]
    assert calls.count("all_gather_blocking") == 2 and calls.count("mm_into_row_blocks") == 2, calls
    assert "all_gather_into_tensor" not in calls and "wait_tensor" not in calls, calls
    assert any("reorder_for_peak_memory" in n for n in notes)


def test_decomposed_gathers_on_gloo_of_one_thread_are_pipelined_and_right(ranks):
    """On the pools' groups (one gloo worker thread, where functional gathers in flight are safe:
    ``gloo_gather_soak --gloo-threads 1``) the gathers keep the form NCCL gets for pairs it does not
    run as one call: the next part's gather issued before the previous part's wait, and the numbers
    right with the gathers really in flight."""
    calls, _ = ranks(2).run(_generated_order, 2, "all_gather", {"chunks": 2})[0]
    collectives, waits, matmuls = _positions(calls)
    assert "all_gather_blocking" not in calls, calls
    assert len(collectives) == 2 and len(waits) == 2 and len(matmuls) == 2, calls
    assert collectives[1] < waits[0] < matmuls[0], calls


@pytest.fixture
def fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def test_decomposed_gathers_overlap_where_the_backend_allows(fake_group):
    """Elsewhere than gloo (here the fake group, whose numbers are garbage, so only the order is
    checked) the next part's gather is issued before the previous part's wait."""
    calls, _ = _generated_order(0, 2, "all_gather", {"chunks": 2}, check=False)
    collectives, waits, matmuls = _positions(calls)
    assert len(collectives) == 2 and len(waits) == 2 and len(matmuls) == 2, calls
    assert collectives[1] < waits[0] < matmuls[0], calls


def test_decomposed_gathers_are_one_call_on_nccl(fake_group, monkeypatch):
    """On NCCL (the fake group standing for it) a plain decomposed gather is one
    ``compass::all_gather_mm_parts`` call, which issues every part's gather before the first
    part's GEMM (``lowering/gather_parts.py``): the host pays one gather, one wait and one GEMM
    per part, not a chain of graph nodes."""
    from compass_fx.lowering import decompose

    monkeypatch.setattr(decompose, "backend_for", lambda group, device: "nccl")
    calls, _ = _generated_order(0, 2, "all_gather", {"chunks": 2}, check=False)
    assert calls == ["all_gather_mm_parts"], calls


def test_the_one_call_gathers_and_multiplies_every_part(ranks):
    """``compass::all_gather_mm_parts`` on gloo ranks equals the gathered tensor times each weight
    (a strided weight too), for 1, 2 and 4 parts, with two weights and with one; the graph passes
    no rank."""
    for out in ranks(2).run(_one_call_errors, 2):
        assert len(out) == 9 and max(out) < 1e-5, out


def _one_call_errors(rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    from compass_fx.lowering import gather_parts  # noqa: F401 - registers the op

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(8, 5, generator=g)
    weights = [torch.randn(5, 3, generator=g), torch.randn(7, 5, generator=g).t()]
    full = torch.empty(8 * world, 5)
    dist.all_gather_into_tensor(full, x)
    errors = []
    for parts in (1, 2, 4):
        outs = torch.ops.compass.all_gather_mm_parts(x, weights, parts, world, dist.group.WORLD.group_name)
        errors += [float((o - full @ w).abs().max()) for o, w in zip(outs, weights)]
        (out,) = torch.ops.compass.all_gather_mm_parts.default(x, weights[1:], parts, world,
                                                               dist.group.WORLD.group_name)
        errors.append(float((out - full @ weights[1]).abs().max()))
    return errors


def _notes_with(rank: int, world: int, options: dict, env: dict) -> list[str]:
    import os
    from unittest import mock

    with mock.patch.dict(os.environ, env):
        return _generated_order(rank, world, "reduce_scatter", options)[1]


def test_the_report_says_when_streams_share_hardware_queues(ranks):
    """Megatron's CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream on one hardware queue: a graph
    with a rewritten pair says that the predicted overlap assumes otherwise; a graph left alone,
    or enough queues, says nothing of it."""
    shared = ranks(2).run(_notes_with, 2, {"chunks": 2}, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})[0]
    assert any("CUDA_DEVICE_MAX_CONNECTIONS=1" in n for n in shared), shared
    untouched = ranks(2).run(_notes_with, 2, {"strategy": "off"}, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})[0]
    plenty = ranks(2).run(_notes_with, 2, {"chunks": 2}, {"CUDA_DEVICE_MAX_CONNECTIONS": "32"})[0]
    assert not any("CUDA_DEVICE_MAX_CONNECTIONS" in n for n in untouched + plenty), untouched + plenty


def test_graphs_without_decomposition_keep_inductors_defaults(ranks):
    calls, notes = ranks(2).run(_generated_order, 2, "reduce_scatter", {"strategy": "off"})[0]
    assert notes == [] and len(calls) == 2


def _generated_code(rank: int, world: int, kind: str, inner: str) -> str:
    """The code a decomposed pair (2 parts) runs as: Inductor's, or the eager inner compiler's graph."""
    from torch._inductor.utils import run_and_get_code

    import compass_fx.backend as backend

    fn, x = _one_pair(world, kind)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="compass", options={"chunks": 2, "inner": inner, "dump_dir": None})
    with torch.no_grad():
        if inner == "inductor":
            out, codes = run_and_get_code(compiled, x)
            code = "\n".join(codes)
        else:
            captured = []
            real = backend._eager_inner
            backend._eager_inner = lambda gm, inputs, **kw: (captured.append(gm), real(gm, inputs, **kw))[1]
            try:
                out = compiled(x)
            finally:
                backend._eager_inner = real
            code = "\n".join(gm.code for gm in captured)
    torch.testing.assert_close(out, fn(x), rtol=1e-4, atol=1e-4)
    return code


def test_the_gather_side_writes_each_part_into_the_result(ranks):
    """No cat of the parts: both parts' GEMMs write into the one buffer the graph returns."""
    code = ranks(2).run(_generated_code, 2, "all_gather", "inductor")[0]
    targets = re.findall(r"mm_into_row_blocks\.default\((\w+),", code)
    assert len(targets) == 2 and targets[0] == targets[1], code
    assert re.search(rf"return \((reinterpret_tensor\()?{targets[0]}\b", code), code


def test_the_reduce_side_reads_each_parts_rows_where_they_lie(ranks):
    """No copy of the parts' rows: each part's GEMM reads the graph's input through a strided view."""
    code = ranks(2).run(_generated_code, 2, "reduce_scatter", "inductor")[0]
    assert len(re.findall(r"bmm\(reinterpret_tensor\(arg0_1,", code)) == 2, code


def test_without_inductor_the_parts_are_written_in_place_too(ranks):
    """The eager inner compiler calls the in-place op itself (functionalized it would copy the
    whole result for every part)."""
    code = ranks(2).run(_generated_code, 2, "all_gather", "eager")[0]
    assert code.count("torch.ops.compass.mm_into_row_blocks.default(out = empty") == 2, code
    assert "auto_functionalized" not in code, code


def test_the_in_place_writer_multiplies_strided_rows_too():
    """``compass::mm_into_row_blocks`` with a part's rows given through a strided view (not as
    traced) still writes the right rows, and leaves the others alone."""
    from compass_fx.lowering import row_blocks  # noqa: F401 - registers the op

    blocks, per_block, parts, k, n = 2, 6, 3, 5, 4
    rows = torch.randn(k, blocks * per_block // parts).t()  # [4, 5], strided (a transpose)
    w = torch.randn(k, n)
    out = torch.full((blocks * per_block, n), 7.0)
    torch.ops.compass.mm_into_row_blocks(out, rows, w, blocks, 2, 4)
    want = (rows @ w).view(blocks, 2, n)
    got = out.view(blocks, per_block, n)
    torch.testing.assert_close(got[:, 2:4], want)
    assert torch.all(got[:, :2] == 7.0) and torch.all(got[:, 4:] == 7.0)
    with pytest.raises(ValueError, match="do not fit"):
        torch.ops.compass.mm_into_row_blocks(out, rows, w, blocks, 2, 5)


def test_the_report_says_what_cuda_graphs_do_with_the_fused_calls(ranks):
    """A mode that captures CUDA graphs ("reduce-overhead") and fused pairs: the report says that
    Inductor's graphs leave them out unless COMPASS_FUSED_GRAPHS=1 was set at import (it was not
    in these ranks); without such a mode, or with no fused pair, it says nothing of it.  Where the
    cost model chose under such a mode, the report says that it priced CUDA graph replays and kept
    the (uncapturable) fused operators out of the choice."""
    graphs = ranks(2).run(_notes_with, 2, {"strategy": "fuse", "mode": "reduce-overhead"}, {})[0]
    assert any("COMPASS_FUSED_GRAPHS=1" in n and "leave the 1 fused pair" in n for n in graphs), graphs
    plain = ranks(2).run(_notes_with, 2, {"strategy": "fuse"}, {})[0]
    decomposed = ranks(2).run(_notes_with, 2, {"chunks": 2, "mode": "reduce-overhead"}, {})[0]
    assert not any("CUDA graphs" in n for n in plain + decomposed), plain + decomposed
    # eagerly, the report says where to see how the fused calls ran; of no fused pair, nothing
    assert any("1 fused pair(s) run eagerly" in n and "compass_fx.fused_calls()" in n for n in plain), plain
    assert not any("fused_calls" in n for n in graphs + decomposed), graphs + decomposed
    chosen = ranks(2).run(_notes_with, 2, {"mode": "reduce-overhead"}, {})[0]
    assert any("priced without host issue costs" in n and "'auto' offers no fused operator" in n for n in chosen), chosen
