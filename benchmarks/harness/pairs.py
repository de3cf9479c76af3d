"""The three pair kinds for the benchmarks.  Sequential and InterDecom(d) exist only as compass_fx's
own rewrite emits them (``lowered_fn``: a one-pair module compiled with ``backend="compass"``,
the strategy forced; differentiable, the backward graph rewritten too), and ``pair_outcomes`` /
``not_applied`` say what the compiler actually did with the pair.  Operators called directly
(``strategy_fn``): IntraFusion through ``torch.ops.compass.*`` and PyTorch's ``torch.ops.symm_mem``
fused ops.  Also operands, the GEMM and the collective alone, and the topology the model plans for."""
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


def strategy_fn(kind: str, label: str, world: int, group: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The pair ``kind`` as an operator called directly: "fuse(ring)" (``torch.ops.compass.*``,
    differentiable) or "symm_mem" (PyTorch's fused op, forward only; CUDA, or its Python fallback
    elsewhere).  Sequential and InterDecom(d) have no operator of their own: they exist as what
    compass_fx's rewrite emits, ``lowered_fn``.  Operands: all_gather_matmul (a_shard [m/w, k],
    b [k, n]) -> [m, n]; matmul_reduce_scatter (a [m, k], b) -> [m/w, n]; matmul_all_reduce
    (a [m, k], b) -> [m, n]."""
    if kind not in PAIR_KINDS:
        raise ValueError(kind)
    if label == "sequential" or label.startswith("decompose"):
        raise ValueError(f"{label!r} is not an operator: run it as compass_fx lowers it (lowered_fn)")
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


class _RowParallelAllReduce(torch.autograd.Function):
    """all_reduce(x) whose backward is the identity: the row-parallel convention (Megatron's,
    DTensor's Partial -> Replicate, ``compass::matmul_all_reduce``'s), where the output and its
    gradient are replicated.  (The functional collective's own backward, the literal adjoint,
    all-reduces the gradient again.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: str) -> torch.Tensor:
        return _wait(_ar(x, group))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


class PairGraph(torch.nn.Module):
    """One pair as a model would trace it: functional collective + wait + mm, so that
    ``backend="compass"`` finds it and rewrites it exactly as in a real graph.  Differentiable:
    the gathers' and reduce-scatters' backward is the mirror pair (mm -> reduce_scatter,
    all_gather -> mm), which the backend rewrites in the backward graph; the all-reduce's is the
    identity (row-parallel), so its backward graph has no pair.  Run uncompiled, it is the plain
    sequential pair."""

    def __init__(self, kind: str, world: int, group: str) -> None:
        super().__init__()
        if kind not in PAIR_KINDS:
            raise ValueError(kind)
        self.kind, self.world, self.group = kind, world, group

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.kind == "all_gather_matmul":
            return _wait(_ag(a, self.world, self.group)) @ b
        if self.kind == "matmul_reduce_scatter":
            return _wait(_rs(a @ b, self.world, self.group))
        return _RowParallelAllReduce.apply(a @ b, self.group)


def lowered_options(label: str) -> dict:
    """backend="compass" options that force the strategy ``label`` names."""
    from compass_fx.cost.decision import Candidate

    c = Candidate.from_label(label)
    if c.strategy == "sequential":
        return {"strategy": "off"}
    if c.strategy == "decompose":
        return {"strategy": "decompose", "chunks": c.parts}
    return {"strategy": "fuse", "schedule": c.schedule}


def lowered_fn(kind: str, label: str, world: int, group: str, inner: str = "eager"
               ) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], Callable[[], list[str]]]:
    """The pair run as compass_fx's own rewrite emits it for strategy ``label`` (``torch.compile``
    of ``PairGraph`` with backend="compass" forcing that strategy, ``inner`` compiling the result),
    and a function that returns what the compiler did with the pair in every graph compiled so far
    (``pair_outcomes``): call it after the calls (and the backward) of interest, since each graph
    is compiled on its first use.  Operands that require grad give a forward and a backward graph,
    both rewritten; under ``torch.no_grad`` one inference graph."""
    import compass_fx

    torch._dynamo.reset()
    compiled = torch.compile(PairGraph(kind, world, group), backend="compass", dynamic=False,
                             options={**lowered_options(label), "inner": inner})
    before = len(compass_fx.backend.history)
    return compiled, lambda: pair_outcomes(before)


def pair_outcomes(before: int) -> list[str]:
    """What the compiler did with each pair of the graphs compiled since ``len(backend.history)``
    was ``before``, as "<graph>: <status> <strategy>(<parts or schedule>)[: why]", e.g.
    "forward: rewritten decompose(4)", "backward: rewritten fuse(direct)",
    "inference: kept sequential(1): strategy='off'", "forward: skipped sequential(1): <why>"."""
    import compass_fx

    return [f"{p.graph}: {p.status} {p.strategy}({p.schedule if p.strategy == 'fuse' else p.parts})"
            + (f": {p.reason}" if p.status != "rewritten" else "")
            for r in list(compass_fx.backend.history)[before:] for p in r.pairs]


def expected_outcome(label: str) -> str:
    """What ``pair_outcomes`` says (after the graph) for a pair that took strategy ``label``."""
    opts = lowered_options(label)
    if opts["strategy"] == "off":
        return "kept sequential(1)"
    if opts["strategy"] == "decompose":
        return f"rewritten decompose({opts['chunks']})"
    return f"rewritten fuse({opts['schedule']})"


def not_applied(label: str, outcomes: list[str]) -> str | None:
    """None when the compiler did to every pair it found what ``label`` forces (and found one);
    otherwise why not: such a candidate is not ``label`` and must not be timed or checked as it."""
    if not outcomes:
        return f"{label} not applied: the compiler found no pair in the graph"
    want = expected_outcome(label)
    off = [o for o in outcomes if o.split(": ", 1)[1].split(":", 1)[0] != want]
    return f"{label} not applied by the compiler: {'; '.join(off)}" if off else None


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
