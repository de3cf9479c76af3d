"""A sequence-parallel float8 block built by hand (no torchao), for the float8 tests on gloo ranks.

norm -> ``w1`` (column-parallel) -> relu -> ``w2`` (row-parallel), tokens sharded on every rank,
whose autograd Functions do what Megatron-LM's sequence-parallel linears do, with tensorwise
``_scaled_mm`` and per-tensor constant scales (delayed scaling), so that a test is about the
rewrite.  Two ways to gather (``gather_bytes``):

* ``False``: gather the bf16 rows, then cast them to float8 (``test_float8_backward.py``);
* ``True``: each rank casts its own rows, and the gather moves their bytes as uint8
  (``xq.view(torch.uint8)``, read back with ``.view(float8)``): what gloo, which has no float8
  collectives, and Transformer Engine, which keeps float8 data in uint8 tensors, do
  (``test_float8_bytes.py``).

Forward: the gather before ``w1``, the reduce-scatter after ``w2``.  Backward: the output
gradient's gather (``w2``'s input and weight gradients, the latter's contraction dim the gathered
rows) and the reduce-scatter of ``w1``'s input gradient; ``w1``'s weight gradient uses the float8
tokens the forward saved.
"""
from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DIM, HIDDEN, TOKENS = 32, 64, 32
c10d = torch.ops._c10d_functional


def _gather(x: torch.Tensor, world: int, group: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.all_gather_into_tensor(x, world, group))


def _gather_bytes(x8: torch.Tensor, world: int, group: str) -> torch.Tensor:
    """Gather float8 rows as uint8 and read them back as float8."""
    return _gather(x8.view(torch.uint8), world, group).view(x8.dtype)


def _gather_f8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, world: int, group: str,
               gather_bytes: bool) -> torch.Tensor:
    """The gathered rows of ``x`` in float8: cast after the gather, or each rank's before its bytes move."""
    if gather_bytes:
        return _gather_bytes(_f8(x, scale, dtype), world, group)
    return _f8(_gather(x, world, group), scale, dtype)


def _reduce_scatter(x: torch.Tensor, world: int, group: str) -> torch.Tensor:
    return c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", world, group))


def _f8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


def _col_major(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


def _mm(a8: torch.Tensor, b8: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    return torch._scaled_mm(a8, b8, sa.reciprocal(), sb.reciprocal(), out_dtype=torch.bfloat16)


class ColwiseF8(torch.autograd.Function):
    """y = gather(x) @ w.t() in float8; backward reduce-scatters the input gradient."""

    @staticmethod
    def forward(ctx, shard, w, sx, sw, sg, world, group, gather_bytes):
        x8 = _gather_f8(shard, sx, E4M3, world, group, gather_bytes)
        ctx.save_for_backward(x8, w, sx, sw, sg)
        ctx.world, ctx.group = world, group
        return _mm(x8, _f8(w, sw, E4M3).t(), sx, sw)

    @staticmethod
    def backward(ctx, g):
        x8, w, sx, sw, sg = ctx.saved_tensors
        g8 = _f8(g, sg, E5M2)
        grad_x = _reduce_scatter(_mm(g8, _col_major(_f8(w, sw, E4M3)), sg, sw), ctx.world, ctx.group)
        grad_w = _mm(g8.t().contiguous(), _col_major(x8), sg, sx)
        return grad_x, grad_w, None, None, None, None, None, None


class RowwiseF8(torch.autograd.Function):
    """y = reduce_scatter(h @ w.t()) in float8; backward gathers the output gradient."""

    @staticmethod
    def forward(ctx, h, w, sh, sw, sg, world, group, gather_bytes):
        ctx.save_for_backward(h, w, sh, sw, sg)
        ctx.world, ctx.group, ctx.gather_bytes = world, group, gather_bytes
        return _reduce_scatter(_mm(_f8(h, sh, E4M3), _f8(w, sw, E4M3).t(), sh, sw), world, group)

    @staticmethod
    def backward(ctx, g):
        h, w, sh, sw, sg = ctx.saved_tensors
        g8 = _gather_f8(g, sg, E5M2, ctx.world, ctx.group, ctx.gather_bytes)
        grad_h = _mm(g8, _col_major(_f8(w, sw, E4M3)), sg, sw)
        grad_w = _mm(g8.t().contiguous(), _col_major(_f8(h, sh, E4M3)), sg, sh)
        return grad_h, grad_w, None, None, None, None, None, None


class Float8Block(torch.nn.Module):
    """norm -> w1 (column-parallel) -> relu -> w2 (row-parallel), tokens sharded on every rank."""

    def __init__(self, world: int, group: str, gather_bytes: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.norm = torch.nn.LayerNorm(DIM).to(torch.bfloat16)
        self.w1 = torch.nn.Parameter((torch.randn(HIDDEN // world, DIM, generator=g) / DIM ** 0.5).to(torch.bfloat16))
        self.w2 = torch.nn.Parameter((torch.randn(DIM, HIDDEN // world, generator=g) / HIDDEN ** 0.5).to(torch.bfloat16))
        for name, value in (("sx", 64.0), ("sw", 128.0), ("sh", 128.0), ("sg", 2.0 ** 12)):
            self.register_buffer(name, torch.tensor(value))
        self.world, self.group, self.gather_bytes = world, group, gather_bytes

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        how = (self.world, self.group, self.gather_bytes)
        h = ColwiseF8.apply(self.norm(shard), self.w1, self.sx, self.sw, self.sg, *how)
        return RowwiseF8.apply(torch.relu(h), self.w2, self.sh, self.sw, self.sg, *how)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def training_step(model: torch.nn.Module, x: torch.Tensor, run=None) -> dict[str, torch.Tensor]:
    """One forward and backward of ``model`` (through ``run``, its compiled form, when given): the
    output, the input gradient and the local weight gradients (this block's, or a DTensor model's)."""
    for p in model.parameters():
        p.grad = None
    x = x.clone().requires_grad_(True)
    out = _local((model if run is None else run)(x))
    (out.float() ** 2).sum().backward()
    return {"out": out.detach(), "x.grad": x.grad, **{n: _local(p.grad) for n, p in model.named_parameters()}}


def compiled_equals_eager(rank: int, world: int, strategy: str, gather_bytes: bool, inner: str = "eager") -> list:
    """One training step of the block compiled with ``strategy`` (``decompose``: 2 parts) against
    eager, output and every gradient compared; returns the graph reports of the compile.

    Tolerances: the input-side GEMMs of a part multiply the same float8 values by the same scales
    as eager; a weight gradient's parts are float32 partial sums added before its one bf16
    rounding.  Outputs and gradients are bf16 (relative step 2**-8 = 0.4%): 1e-2 relative, and
    1e-2 of the tensor's largest magnitude absolute, allow a couple of roundings landing the other
    way."""
    import torch.distributed as dist

    import compass_fx.backend

    torch._dynamo.reset()
    group = dist.group.WORLD.group_name
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    x = x.chunk(world)[rank].contiguous()
    options = {"inner": inner, **({"chunks": 2} if strategy == "decompose" else {"strategy": strategy})}
    before = len(compass_fx.backend.history)
    expected = training_step(Float8Block(world, group, gather_bytes), x)
    model = Float8Block(world, group, gather_bytes)
    got = training_step(model, x, torch.compile(model, backend="compass", options=options, fullgraph=True))
    assert_step_close(got, expected)
    return list(compass_fx.backend.history)[before:]


def assert_step_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """A float8 training step's output and gradients against eager's, each tensor within 1e-2
    relative and 1e-2 of its largest magnitude (why: :func:`compiled_equals_eager`)."""
    for name, ref in expected.items():
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(got[name].float(), ref.float(), rtol=1e-2, atol=1e-2 * scale,
                                   msg=lambda m: f"{name} (largest magnitude {scale:.3g}): {m}")
