"""Hand-built float8 ``_scaled_mm`` pairs (forward graphs) on real gloo ranks: found, decomposed,
equal to eager; float8 GEMMs priced at the float8 rate.  Tensorwise scales, and row-wise scales
on both sides: a reduce-scatter's local A splits its row scales with its rows, a gather's rows take
their scales with them (repeated per row, or computed from each row as torchao's row-wise recipe
does); a scale computed from all the gathered rows is left alone with the reason.  torchao's own
forward and backward graphs are in ``test_float8_torchao.py``.

Tolerance: a decomposed part multiplies the very same float8 rows with the same scales, so each
output element is the same dot product as in eager; only the bf16 output's rounding and the
reduce-scatter's bf16 sums could differ, hence 1e-2 relative (bf16 has 8 bits of mantissa)."""
from __future__ import annotations

import pytest
import torch

F8 = torch.float8_e4m3fn


class GatherScaled(torch.nn.Module):
    """Sequence parallel w1 in float8: gather bf16 tokens, cast to float8, scaled matmul.

    ``scaling`` of A: "tensorwise" (one scale, from before the gather), "rowwise" (one scale per
    gathered row, repeated from a buffer), "rowwise_of_gathered" (torchao's row-wise recipe: each
    gathered row's amax gives its scale) or "tensorwise_of_gathered" (one amax over all the
    gathered rows: no part can be cast before every part has arrived); "rowwise_expanded_of_gathered"
    is the row-wise recipe with its scales passed through an expand to their own shape."""

    def __init__(self, k: int, n: int, world: int, group: str, scaling: str = "tensorwise") -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.register_buffer("w", torch.randn(n, k, generator=g).to(F8))
        self.register_buffer("sa", torch.rand(1, 1, generator=g) + 0.5)
        self.register_buffer("sb", torch.rand(1, 1, generator=g) + 0.5)
        self.world, self.group, self.scaling = world, group, scaling

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        c10d = torch.ops._c10d_functional
        x = c10d.wait_tensor(c10d.all_gather_into_tensor(shard, self.world, self.group))
        rowwise = self.scaling != "tensorwise"
        sb = self.sb.expand(1, self.w.shape[0]).contiguous() if rowwise else self.sb.reshape(())
        if self.scaling.endswith("of_gathered"):
            dim = -1 if self.scaling.startswith("rowwise") else None
            amax = x.abs().amax(dim=dim, keepdim=True) if dim else x.abs().amax().reshape(1, 1)
            sa = amax.float().clamp_min(1e-6) / 448.0
            x8 = (x.float() / sa).to(F8)
            sa = sa.expand(x.shape[0], 1) if not dim or self.scaling.endswith("_expanded_of_gathered") else sa
            return torch._scaled_mm(x8, self.w.t(), sa.contiguous(), sb, out_dtype=torch.bfloat16)
        sa = self.sa.expand(x.shape[0], 1).contiguous() if rowwise else self.sa.reshape(())
        return torch._scaled_mm(x.to(F8), self.w.t(), sa, sb, out_dtype=torch.bfloat16)


class ScaledReduceScatter(torch.nn.Module):
    """Sequence parallel w2 in float8: scaled matmul, reduce-scatter the bf16 output (or, without
    sequence parallelism, ``all_reduce`` it: plain TP's row-parallel layer)."""

    def __init__(self, k: int, n: int, world: int, group: str, rowwise: bool = False, all_reduce: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.register_buffer("w", torch.randn(n, k, generator=g).to(F8))
        self.register_buffer("sa", torch.tensor(0.75))
        self.register_buffer("sb", torch.tensor(1.25))
        self.world, self.group, self.rowwise, self.all_reduce = world, group, rowwise, all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c10d = torch.ops._c10d_functional
        if self.rowwise:  # torchao's row-wise recipe: one scale per row of A, one per column of B
            sa = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-6) / 448.0
            sb = self.sb.expand(1, self.w.shape[0]).contiguous()
            y = torch._scaled_mm((x / sa).to(F8), self.w.t(), sa, sb, out_dtype=torch.bfloat16)
        else:
            y = torch._scaled_mm(x.to(F8), self.w.t(), self.sa, self.sb, out_dtype=torch.bfloat16)
        if self.all_reduce:
            return c10d.wait_tensor(c10d.all_reduce(y, "sum", self.group))
        return c10d.wait_tensor(c10d.reduce_scatter_tensor(y, "sum", self.world, self.group))


def _run(rank: int, world: int, kind: str, rowwise: bool, options: dict | None = None) -> dict:
    import torch.distributed as dist

    import compass_fx.backend

    torch._dynamo.reset()
    group = dist.group.WORLD.group_name
    g = torch.Generator().manual_seed(10 + rank)
    if kind == "all_gather":
        scaling = rowwise if isinstance(rowwise, str) else ("rowwise" if rowwise else "tensorwise")
        mod, x = GatherScaled(32, 48, world, group, scaling), torch.randn(16, 32, generator=g).to(torch.bfloat16)
    else:
        mod = ScaledReduceScatter(32, 48, world, group, rowwise, all_reduce=kind == "all_reduce")
        x = torch.randn(32, 32, generator=g).to(torch.bfloat16)
    before = len(compass_fx.backend.history)
    compiled = torch.compile(mod, backend="compass", options=options or {"inner": "eager", "chunks": 2},
                             fullgraph=True)
    with torch.no_grad():
        ref, out = mod(x), compiled(x)
    # An all-reduce of parts sums the ranks' bf16 partials in another order than one of the whole
    # tensor (gloo cuts a message by its size), so an element that cancels keeps one bf16 ulp of the
    # largest partial: the absolute bound scales with the output (1e-2 of its largest element).
    atol = 1e-2 * max(1.0, ref.float().abs().max().item()) if kind == "all_reduce" else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=atol)
    pairs = [p for r in list(compass_fx.backend.history)[before:] for p in r.pairs]
    skips = [s.reason for r in list(compass_fx.backend.history)[before:] for s in r.skipped]
    return {"pairs": [(p.kind, p.status, p.strategy, p.parts) for p in pairs], "skipped": skips,
            "reasons": [p.reason for p in pairs], "gemm_dtypes": [p.gemm_dtype for p in pairs],
            "dtypes": [p.dtype for p in pairs], "shapes": [(p.m, p.n, p.k, p.group_size) for p in pairs]}


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_tensorwise_float8_pairs_are_decomposed_and_equal_eager(ranks, kind):
    res = ranks(2).run(_run, 2, kind, False)[0]
    assert res["pairs"] == [(f"{kind}_matmul" if kind == "all_gather" else "matmul_reduce_scatter",
                             "rewritten", "decompose", 2)], res


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("rowwise", [False, True])
def test_float8_matmul_all_reduce_is_decomposed_and_equal_eager(ranks, world, rowwise):
    """Plain TP (no sequence parallelism): the row-parallel float8 GEMM's all-reduce, tensorwise and
    with row scales of its local operand (each part's rows keep their own scales)."""
    res = ranks(world).run(_run, world, "all_reduce", rowwise)[0]
    assert res["pairs"] == [("matmul_all_reduce", "rewritten", "decompose", 2)], res
    assert res["gemm_dtypes"] == ["float8_e4m3fn"], res


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter"])
def test_the_cost_model_prices_float8_gemms_at_the_float8_rate(ranks, kind):
    """The bf16 tensor travels, the GEMM runs in float8: the pair's workload says both, and the
    sequential GEMM is priced at about half the bf16 time at a large size of the same shape."""
    from compass_fx.cost import Topology, Workload, gemm_seconds, sequential_seconds

    res = ranks(2).run(_run, 2, kind, False, {"inner": "eager", "strategy": "auto"})[0]
    assert res["dtypes"] == ["bfloat16"] and res["gemm_dtypes"] == ["float8_e4m3fn"], res
    (m, n, k, g), = res["shapes"]
    big = dict(kind=f"{kind}_matmul" if kind == "all_gather" else "matmul_reduce_scatter",
               m=m * 512, n=n * 128, k=k * 128, group_size=g)
    topo = Topology.preset("h200-nvswitch-8")
    bf16 = sequential_seconds(Workload(**big), topo)
    f8 = sequential_seconds(Workload(**big, gemm_dtype="float8_e4m3fn"), topo)
    gemm_bf16 = gemm_seconds(big["m"], big["n"], big["k"], "bfloat16", "H200")
    # the same collective either way: the difference is the GEMM's, at about half the bf16 time
    assert 0.3 < 1 + (f8 - bf16) / gemm_bf16 < 0.7


def test_rowwise_float8_scales_of_a_local_operand_split_with_its_rows(ranks):
    """Reduce-scatter side: A is local, so its per-row scales are cut into parts with its rows."""
    res = ranks(2).run(_run, 2, "reduce_scatter", True)[0]
    assert res["pairs"] == [("matmul_reduce_scatter", "rewritten", "decompose", 2)], res


@pytest.mark.parametrize("scaling", ["rowwise", "rowwise_of_gathered", "rowwise_expanded_of_gathered"])
def test_rowwise_float8_scales_of_gathered_rows_split_with_their_rows(ranks, scaling):
    """Gather side: one scale per gathered row, repeated from elsewhere or computed from each row
    (torchao's row-wise recipe, also through an expand that keeps the rows: the float8 fuzzer's
    find, once left alone): each part takes (or computes) its own rows' scales."""
    res = ranks(2).run(_run, 2, "all_gather", scaling)[0]
    assert res["pairs"] == [("all_gather_matmul", "rewritten", "decompose", 2)], res


def test_a_float8_scale_from_all_the_gathered_rows_is_left_alone_with_the_reason(ranks):
    res = ranks(2).run(_run, 2, "all_gather", "tensorwise_of_gathered")[0]
    assert res["pairs"] == [], res
    assert any("mixes rows" in why for why in res["skipped"]), res


def test_the_fused_operators_are_not_offered_for_float8(ranks):
    res = ranks(2).run(_run, 2, "reduce_scatter", False, {"inner": "eager", "strategy": "fuse"})[0]
    assert [p[1] for p in res["pairs"]] == ["skipped"], res
    assert "float8 _scaled_mm" in res["reasons"][0] and "not offered" in res["reasons"][0], res
