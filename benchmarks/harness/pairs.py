"""The three pair kinds as operator-level functions, one per strategy: sequential and InterDecom(d)
written with functional collectives exactly as ``compass_fx.lowering.decompose`` emits them,
IntraFusion through ``torch.ops.compass.*``, PyTorch's ``torch.ops.symm_mem`` fused ops, each with
its backward; the same pair compiled through compass_fx's own rewrite (``lowered_fn``); operands,
the GEMM and the collective alone, and the topology the model plans for."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from compass_fx.cost.workload import PAIR_KINDS  # noqa: F401 - the scripts take the kinds from here

from .ranks import Ctx

c10d = torch.ops._c10d_functional


def _ag(x: torch.Tensor, world: int, group: str) -> torch.Tensor:
    return c10d.all_gather_into_tensor(x.contiguous(), world, group)


def _rs(x: torch.Tensor, world: int, group: str) -> torch.Tensor:
    return c10d.reduce_scatter_tensor(x.contiguous(), "sum", world, group)


def _ar(x: torch.Tensor, group: str) -> torch.Tensor:
    return c10d.all_reduce(x.contiguous(), "sum", group)


def _wait(x: torch.Tensor) -> torch.Tensor:
    return c10d.wait_tensor(x)


def ag_mm_decomposed(a_shard: torch.Tensor, b: torch.Tensor, parts: int, world: int, group: str) -> torch.Tensor:
    """InterDecom of all_gather -> mm on dim 0: the gather of part i+1 is issued before the mm of
    part i; the outputs are interleaved back to rank-major rows (as the lowering's interleave_rows)."""
    rows = a_shard.shape[0]
    if rows % parts:
        raise ValueError(f"parts={parts} does not divide the {rows} local rows")
    if parts == 1:
        return _wait(_ag(a_shard, world, group)) @ b
    c = rows // parts
    pending = [_ag(a_shard[:c], world, group)]
    outs = []
    for i in range(parts):
        if i + 1 < parts:
            pending.append(_ag(a_shard[(i + 1) * c:(i + 2) * c], world, group))
        outs.append(_wait(pending[i]) @ b)  # [world * c, n], rank-major blocks of part i
    n = b.shape[1]
    return torch.stack(outs).view(parts, world, c, n).transpose(0, 1).reshape(world * rows, n)


def _part_rows(a: torch.Tensor, world: int, parts: int, i: int) -> torch.Tensor:
    """Rows of part i for a reduce-scatter on dim 0: sub-block i of every rank's block."""
    m, k = a.shape
    c = m // (world * parts)
    return a.view(world, parts, c, k)[:, i].reshape(world * c, k)


def mm_rs_decomposed(a: torch.Tensor, b: torch.Tensor, parts: int, world: int, group: str) -> torch.Tensor:
    """InterDecom of mm -> reduce_scatter on dim 0: the collective of part i is issued right
    after its mm, so it travels while the mm of part i+1 runs; waits at the end."""
    m = a.shape[0]
    if m % (world * parts):
        raise ValueError(f"parts={parts} x world={world} does not divide the {m} rows")
    if parts == 1:
        return _wait(_rs(a @ b, world, group))
    pending = [_rs(_part_rows(a, world, parts, i) @ b, world, group) for i in range(parts)]
    return torch.cat([_wait(p) for p in pending], 0)


def mm_ar_decomposed(a: torch.Tensor, b: torch.Tensor, parts: int, world: int, group: str) -> torch.Tensor:
    m = a.shape[0]
    if m % parts:
        raise ValueError(f"parts={parts} does not divide the {m} rows")
    if parts == 1:
        return _wait(_ar(a @ b, group))
    c = m // parts
    pending = [_ar(a[i * c:(i + 1) * c] @ b, group) for i in range(parts)]
    return torch.cat([_wait(p) for p in pending], 0)


class _AgMmDecomposed(torch.autograd.Function):
    """Forward InterDecom(d) of all_gather->mm; backward: its mirror pair, mm->reduce_scatter,
    decomposed the same way (d a = RS(g @ b^T)), and d b = gathered^T @ g."""

    @staticmethod
    def forward(ctx, a_shard, b, parts, world, group):
        ctx.save_for_backward(a_shard, b)
        ctx.args = (parts, world, group)
        return ag_mm_decomposed(a_shard, b, parts, world, group)

    @staticmethod
    def backward(ctx, g):
        a_shard, b = ctx.saved_tensors
        parts, world, group = ctx.args
        grad_a = mm_rs_decomposed(g, b.t(), parts, world, group)
        grad_b = None
        if ctx.needs_input_grad[1]:
            grad_b = _wait(_ag(a_shard, world, group)).t() @ g
        return grad_a, grad_b, None, None, None


class _MmRsDecomposed(torch.autograd.Function):
    """Forward InterDecom(d) of mm->reduce_scatter; backward: all_gather->mm decomposed the same way."""

    @staticmethod
    def forward(ctx, a, b, parts, world, group):
        ctx.save_for_backward(a, b)
        ctx.args = (parts, world, group)
        return mm_rs_decomposed(a, b, parts, world, group)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        parts, world, group = ctx.args
        g_gathered = _wait(_ag(g, world, group))
        grad_a = ag_mm_decomposed(g, b.t(), parts, world, group)
        return grad_a, a.t() @ g_gathered, None, None, None


class _MmArDecomposed(torch.autograd.Function):
    """Forward InterDecom(d) of mm->all_reduce; backward in the row-parallel convention (the
    replicated output gradient needs no collective), as compass::matmul_all_reduce does."""

    @staticmethod
    def forward(ctx, a, b, parts, world, group):
        ctx.save_for_backward(a, b)
        return mm_ar_decomposed(a, b, parts, world, group)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g @ b.t(), a.t() @ g, None, None, None


def strategy_fn(kind: str, label: str, world: int, group: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The pair ``kind`` run by strategy ``label``: "sequential", "decompose(d=4)", "fuse(ring)",
    "symm_mem" (PyTorch's fused op; CUDA, or its Python fallback elsewhere).  Differentiable
    (symm_mem: forward only).  Operands: all_gather_matmul (a_shard [m/w, k], b [k, n]) -> [m, n];
    matmul_reduce_scatter (a [m, k], b) -> [m/w, n]; matmul_all_reduce (a [m, k], b) -> [m, n]."""
    if kind not in PAIR_KINDS:
        raise ValueError(kind)
    if label == "sequential" or label.startswith("decompose"):
        parts = 1 if label == "sequential" else int(label.split("=")[1].rstrip(")"))
        fn = {"all_gather_matmul": _AgMmDecomposed, "matmul_reduce_scatter": _MmRsDecomposed,
              "matmul_all_reduce": _MmArDecomposed}[kind]
        return lambda a, b: fn.apply(a, b, parts, world, group)
    if label.startswith("fuse("):
        import compass_fx.kernels  # noqa: F401 - registers torch.ops.compass
        schedule = label[5:-1]
        if kind == "all_gather_matmul":
            return lambda a, b: torch.ops.compass.all_gather_matmul(a, [b], schedule, group, world)[1][0]
        op = getattr(torch.ops.compass, kind)
        return lambda a, b: op(a, b, schedule, group, world)
    if label == "symm_mem":
        if kind == "matmul_all_reduce":
            raise ValueError("PyTorch has no fused matmul + all-reduce")
        if torch.cuda.is_available() and dist.get_backend() == "nccl":
            from torch.distributed._symmetric_memory import enable_symm_mem_for_group
            enable_symm_mem_for_group(group)
            if kind == "all_gather_matmul":
                return lambda a, b: torch.ops.symm_mem.fused_all_gather_matmul(a, [b], 0, group)[1][0]
            return lambda a, b: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group)
        from torch.distributed import _symmetric_memory as sm
        if kind == "all_gather_matmul":
            return lambda a, b: sm._fused_all_gather_matmul_fallback(a, [b], 0, group)[1][0]
        return lambda a, b: sm._fused_matmul_reduce_scatter_fallback(a, b, "sum", 0, group)
    raise ValueError(f"unknown strategy label {label!r}")


class PairGraph(torch.nn.Module):
    """One pair as a model would trace it: functional collective + wait + mm, so that
    ``backend="compass"`` finds it and rewrites it exactly as in a real graph."""

    def __init__(self, kind: str, world: int, group: str) -> None:
        super().__init__()
        self.kind, self.world, self.group = kind, world, group

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.kind == "all_gather_matmul":
            return _wait(_ag(a, self.world, self.group)) @ b
        if self.kind == "matmul_reduce_scatter":
            return _wait(_rs(a @ b, self.world, self.group))
        return _wait(_ar(a @ b, self.group))


def lowered_options(label: str) -> dict:
    """backend="compass" options that force the strategy ``label`` names."""
    if label == "sequential":
        return {"strategy": "off"}
    if label.startswith("decompose(d="):
        return {"strategy": "decompose", "chunks": int(label.split("=")[1].rstrip(")"))}
    if label.startswith("fuse("):
        return {"strategy": "fuse", "schedule": label[5:-1]}
    raise ValueError(f"unknown strategy label {label!r}")


def lowered_fn(kind: str, label: str, world: int, group: str, inner: str = "eager"
               ) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], Callable[[], list[str]]]:
    """The pair run as compass_fx's own rewrite emits it for strategy ``label`` (``torch.compile``
    with backend="compass" forcing that strategy, ``inner`` compiling the result), and a function
    that returns what the compiler did with the pair once it has been called (e.g. "rewritten
    decompose(4)" or "left alone ...": a forced strategy the pair cannot take shows there)."""
    import compass_fx

    torch._dynamo.reset()
    compiled = torch.compile(PairGraph(kind, world, group), backend="compass", dynamic=False,
                             options={**lowered_options(label), "inner": inner})
    before = len(compass_fx.backend.history)
    return compiled, lambda: pair_outcomes(before)


def pair_outcomes(before: int) -> list[str]:
    """What the compiler did with each pair of the graphs compiled since ``len(backend.history)``
    was ``before``: "rewritten decompose(4)", "rewritten fuse(direct)", "kept sequential(1): why"."""
    import compass_fx

    return [f"{p.status} {p.strategy}({p.schedule if p.strategy == 'fuse' else p.parts})"
            + (f": {p.reason}" if p.status != "rewritten" else "")
            for r in list(compass_fx.backend.history)[before:] for p in r.pairs]


def pair_operands(kind: str, m: int, n: int, k: int, world: int, rank: int, dtype: torch.dtype,
                  device: torch.device, seed: int = 0, requires_grad: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's operands of a pair whose full activation has ``m`` rows (distinct per rank)."""
    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)  # on the device: fast at 70B widths
    rows = m // world if kind == "all_gather_matmul" else m
    a = (torch.randn(rows, k, generator=g, device=device) / k ** 0.25).to(dtype=dtype)
    b = (torch.randn(k, n, generator=g, device=device) / k ** 0.25).to(dtype=dtype)
    return a.requires_grad_(requires_grad), b.requires_grad_(requires_grad)


def output_rows(kind: str, m: int, world: int) -> int:
    return m // world if kind == "matmul_reduce_scatter" else m


def gemm_only_fn(kind: str, a: torch.Tensor, b: torch.Tensor, world: int) -> Callable[[], Any]:
    """The pair's GEMM alone, at the shape it has in the sequential version."""
    if kind == "all_gather_matmul":
        full = a.new_empty((a.shape[0] * world, a.shape[1])).normal_()
        return lambda: full @ b
    return lambda: a @ b


def comm_only_fn(kind: str, a: torch.Tensor, b: torch.Tensor, world: int, group: str) -> Callable[[], Any]:
    """The pair's collective alone, on a tensor of the size it moves in the sequential version."""
    if kind == "all_gather_matmul":
        return lambda: _wait(_ag(a, world, group))
    out = a.new_empty((a.shape[0], b.shape[1])).normal_()
    if kind == "matmul_reduce_scatter":
        return lambda: _wait(_rs(out, world, group))
    return lambda: _wait(_ar(out, group))


def model_topology(ctx: Ctx):
    """(Topology, how it was obtained): detected on GPUs, the default preset on a CPU dry run."""
    from compass_fx.machine import Topology
    if ctx.is_cuda:
        try:
            return Topology.detect(), "Topology.detect()"
        except Exception as e:  # noqa: BLE001
            topo = Topology.default()
            return topo, f"Topology.default() after detect() failed: {e}"
    return Topology.default(), "Topology.default() (CPU dry run: no GPU to detect)"
