"""A float8 tensor gathered as its bytes (``all_gather(xq.view(torch.uint8))``, then
``.view(torch.float8_e4m3fn)`` before ``_scaled_mm``): what gloo, which has no float8 collectives,
and Transformer Engine, which keeps float8 data in uint8 tensors, do.  A view that reinterprets the
dtype keeps every row's bytes in that row, so the pair is row-local: found, decomposed, and equal
to eager on real gloo ranks, forward and backward (issue 26).

The block is ``test_float8_backward.py``'s (Megatron-style sequence-parallel float8 linears,
tensorwise delayed scales), except that each rank quantizes its own rows before the gather and the
gather moves their bytes: forward, the tokens before w1; backward, the output gradient before w2's
input and weight gradients.  Tolerances as there (bf16 outputs and gradients).
"""
from __future__ import annotations

import pytest
import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DIM, HIDDEN, TOKENS = 32, 64, 32
c10d = torch.ops._c10d_functional


def _gather_bytes(x8: torch.Tensor, world: int, group: str) -> torch.Tensor:
    """Gather float8 rows as uint8 and read them back as float8."""
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x8.view(torch.uint8), world, group))
    return gathered.view(x8.dtype)


def _reduce_scatter(x: torch.Tensor, world: int, group: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", world, group))


def _f8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


def _col_major(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


def _mm(a8: torch.Tensor, b8: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(a8, b8, sa.reciprocal(), sb.reciprocal(), out_dtype=torch.bfloat16)


class ColwiseBytes(torch.autograd.Function):
    """y = gather(x) @ w.t() in float8, each rank's rows quantized before their bytes are gathered."""

    @staticmethod
    def forward(ctx, shard, w, sx, sw, sg, world, group):
        x8 = _gather_bytes(_f8(shard, sx, E4M3), world, group)
        ctx.save_for_backward(x8, w, sx, sw, sg)
        ctx.world, ctx.group = world, group
        return _mm(x8, _f8(w, sw, E4M3).t(), sx, sw)

    @staticmethod
    def backward(ctx, g):
        x8, w, sx, sw, sg = ctx.saved_tensors
        g8 = _f8(g, sg, E5M2)
        grad_x = _reduce_scatter(_mm(g8, _col_major(_f8(w, sw, E4M3)), sg, sw), ctx.world, ctx.group)
        grad_w = _mm(g8.t().contiguous(), _col_major(x8), sg, sx)
        return grad_x, grad_w, None, None, None, None, None


class RowwiseBytes(torch.autograd.Function):
    """y = reduce_scatter(h @ w.t()) in float8; backward gathers the quantized output gradient's bytes."""

    @staticmethod
    def forward(ctx, h, w, sh, sw, sg, world, group):
        ctx.save_for_backward(h, w, sh, sw, sg)
        ctx.world, ctx.group = world, group
        return _reduce_scatter(_mm(_f8(h, sh, E4M3), _f8(w, sw, E4M3).t(), sh, sw), world, group)

    @staticmethod
    def backward(ctx, g):
        h, w, sh, sw, sg = ctx.saved_tensors
        g8 = _gather_bytes(_f8(g, sg, E5M2), ctx.world, ctx.group)
        grad_h = _mm(g8, _col_major(_f8(w, sw, E4M3)), sg, sw)
        grad_w = _mm(g8.t().contiguous(), _col_major(_f8(h, sh, E4M3)), sg, sh)
        return grad_h, grad_w, None, None, None, None, None


class BytesBlock(torch.nn.Module):
    """norm -> w1 (column-parallel) -> relu -> w2 (row-parallel), tokens sharded on every rank."""

    def __init__(self, world: int, group: str) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.norm = torch.nn.LayerNorm(DIM).to(torch.bfloat16)
        self.w1 = torch.nn.Parameter((torch.randn(HIDDEN // world, DIM, generator=g) / DIM ** 0.5).to(torch.bfloat16))
        self.w2 = torch.nn.Parameter((torch.randn(DIM, HIDDEN // world, generator=g) / HIDDEN ** 0.5).to(torch.bfloat16))
        for name, value in (("sx", 64.0), ("sw", 128.0), ("sh", 128.0), ("sg", 2.0 ** 12)):
            self.register_buffer(name, torch.tensor(value))
        self.world, self.group = world, group

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        h = ColwiseBytes.apply(self.norm(shard), self.w1, self.sx, self.sw, self.sg, self.world, self.group)
        return RowwiseBytes.apply(torch.relu(h), self.w2, self.sh, self.sw, self.sg, self.world, self.group)


def _step(model: torch.nn.Module, x: torch.Tensor, options: dict | None) -> dict[str, torch.Tensor]:
    run = model if options is None else torch.compile(model, backend="compass", options=options, fullgraph=True)
    x = x.clone().requires_grad_(True)
    out = run(x)
    (out.float() ** 2).sum().backward()
    return {"out": out.detach(), "x.grad": x.grad, **{n: p.grad for n, p in model.named_parameters()}}


def _run(rank: int, world: int, strategy: str) -> dict:
    import torch.distributed as dist

    import compass_fx.backend

    torch._dynamo.reset()
    group = dist.group.WORLD.group_name
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    x = x.chunk(world)[rank].contiguous()
    options = {"inner": "eager", **({"chunks": 2} if strategy == "decompose" else {"strategy": strategy})}
    before = len(compass_fx.backend.history)
    expected = _step(BytesBlock(world, group), x, None)
    got = _step(BytesBlock(world, group), x, options)
    for name, ref in expected.items():
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(got[name].float(), ref.float(), rtol=1e-2, atol=1e-2 * scale,
                                   msg=lambda m: f"{name} (largest magnitude {scale:.3g}): {m}")
    reports = list(compass_fx.backend.history)[before:]
    return {"pairs": sorted((p.graph, p.kind, p.matmuls, p.dtype, p.gemm_dtype, p.status, p.parts)
                            for r in reports for p in r.pairs),
            "skipped": [s.reason for r in reports for s in r.skipped],
            "refused": sorted({r["strategy"] for r0 in reports for p in r0.pairs for r in p.refused})}


# forward: the tokens' byte gather before w1, the reduce-scatter after w2; backward: the output
# gradient's byte gather (w2's input and weight gradients), the reduce-scatter of w1's input gradient
FOUND = [("backward", "all_gather_matmul", 2, "uint8", "float8_e5m2"),
         ("backward", "matmul_reduce_scatter", 1, "bfloat16", "float8_e5m2"),
         ("forward", "all_gather_matmul", 1, "uint8", "float8_e4m3fn"),
         ("forward", "matmul_reduce_scatter", 1, "bfloat16", "float8_e4m3fn")]


@pytest.mark.parametrize("world,strategy", [(2, "decompose"), (2, "auto"),
                                            pytest.param(4, "decompose", marks=pytest.mark.slow)])
def test_a_float8_gather_of_bytes_is_decomposed_and_equal_eager(ranks, world, strategy):
    res = ranks(world).run(_run, world, strategy)[0]
    assert [p[:5] for p in res["pairs"]] == FOUND, res
    assert res["skipped"] == [], res  # was: "the float8 _scaled_mm ... takes the gathered rows only after a step ..."
    assert res["refused"] == ["fuse"], res  # the fused operators take no float8
    if strategy == "decompose":
        assert {p[5:] for p in res["pairs"]} == {("rewritten", 2)}, res
