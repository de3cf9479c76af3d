"""The matmul<->collective pairs of one tensor-parallel transformer layer, planned together.

Llama-3 shapes (Megatron / torchtitan TP plan): attention's q, k, v projections and the MLP's
w1 and w3 are column-parallel, the attention output projection and w2 row-parallel.  With
sequence parallelism (default) each column-parallel group is fed by one all-gather and each
row-parallel GEMM ends in a reduce-scatter; without it, the row-parallel GEMMs end in an
all-reduce.  The backward pass mirrors it: the input gradient of a row-parallel GEMM needs the
gathered output gradient, that of a column-parallel group is reduce-scattered.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..machine.topology import Topology
from .decision import SCHEDULES, Decision
from .select import plan
from .workload import Workload


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int = 128


MODELS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(4096, 14336, 32, 8),
    "llama3-70b": ModelShape(8192, 28672, 64, 8),
    "llama3-405b": ModelShape(16384, 53248, 128, 8),
}


def model_shape(name: str) -> ModelShape:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    return MODELS[name]


def _split(value: int, tp: int, what: str) -> int:
    if value % tp:
        raise ValueError(f"tp={tp} does not divide the model's {what} ({value})")
    return value // tp


def layer_workloads(model: str, tp: int, tokens: int, dtype: str = "bfloat16", sequence_parallel: bool = True,
                    backward: bool = False, cuda_graphs: bool = False,
                    parts_replayed: bool = False) -> list[tuple[str, Workload]]:
    """(name, Workload) for every pair of one layer's forward (and, with ``backward``, backward)
    pass; ``tokens`` is batch x sequence, the m of every pair.  GEMMs sharing a collective are
    summed into n (gather) or k (reduced sum), as ``Workload`` counts them; ``cuda_graphs``: the
    step replays as CUDA graphs (no host issue costs); ``parts_replayed``: an eager step replays a
    decomposed gather's parts from one CUDA graph (``Workload.parts_replayed``, gathers only)."""
    s = model_shape(model)
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    if not isinstance(tokens, int) or tokens < 1:  # before the divisibility check: the sign is the problem
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    if sequence_parallel and tokens % tp:
        raise ValueError(f"tokens={tokens} must be divisible by tp={tp} with sequence parallelism")
    q = _split(s.heads * s.head_dim, tp, "query width")
    kv = max(1, s.kv_heads * s.head_dim // tp)
    ffn = _split(s.ffn, tp, "ffn width")
    h = s.hidden

    def w(kind: str, n: int, k: int, **kw) -> Workload:
        return Workload(kind=kind, m=tokens, n=n, k=k, dtype=dtype, group_size=tp, cuda_graphs=cuda_graphs,
                        parts_replayed=parts_replayed and kind == "all_gather_matmul", **kw)

    out_kind = "matmul_reduce_scatter" if sequence_parallel else "matmul_all_reduce"
    pairs: list[tuple[str, Workload]] = []
    if sequence_parallel:
        pairs.append(("attn.qkv", w("all_gather_matmul", q + 2 * kv, h, matmuls=3, extra_n=(kv, kv))))
    pairs.append(("attn.out", w(out_kind, h, q)))
    if sequence_parallel:
        pairs.append(("mlp.w1+w3", w("all_gather_matmul", 2 * ffn, h, matmuls=2)))
    pairs.append(("mlp.w2", w(out_kind, h, ffn)))
    if backward:
        grad_in_kind = "matmul_reduce_scatter" if sequence_parallel else "matmul_all_reduce"
        if sequence_parallel:
            pairs.append(("mlp.w2.grad_in", w("all_gather_matmul", ffn, h)))
        pairs.append(("mlp.w1+w3.grad_in", w(grad_in_kind, h, 2 * ffn, matmuls=2)))
        if sequence_parallel:
            pairs.append(("attn.out.grad_in", w("all_gather_matmul", q, h)))
        pairs.append(("attn.qkv.grad_in", w(grad_in_kind, h, q + 2 * kv, matmuls=3)))
    return pairs


@dataclass(frozen=True)
class LayerPlan:
    model: str
    tp: int
    tokens: int
    topology: str
    rows: tuple[tuple[str, Workload, Decision], ...]

    @property
    def sequential_s(self) -> float:
        return sum(decision.candidate("sequential").seconds for _, _, decision in self.rows)

    @property
    def planned_s(self) -> float:
        return sum(decision.predicted_s for _, _, decision in self.rows)

    @property
    def speedup(self) -> float:
        return self.sequential_s / self.planned_s


def plan_layer(model: str, tp: int, tokens: int, topology: Topology, *, dtype: str = "bfloat16",
               sequence_parallel: bool = True, backward: bool = False,
               fused_schedules: tuple[str, ...] | None = SCHEDULES, cuda_graphs: bool = False,
               parts_replayed: bool = False) -> LayerPlan:
    """Plan every pair of one layer on ``topology`` (``cuda_graphs``: as CUDA graph replays;
    ``parts_replayed``: a decomposed gather's parts replayed from one graph in an eager step)."""
    rows = tuple((name, wl, plan(wl, topology, fused_schedules=fused_schedules))
                 for name, wl in layer_workloads(model, tp, tokens, dtype, sequence_parallel, backward, cuda_graphs,
                                                 parts_replayed))
    return LayerPlan(model, tp, tokens, topology.name, rows)


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f}ms"
    return f"{seconds * 1e6:.1f}us"


def format_layer_plan(lp: LayerPlan) -> str:
    """A fixed-width table: one row per pair with every candidate's prediction."""
    lines = [f"{lp.model} tp={lp.tp} tokens={lp.tokens} on {lp.topology}",
             f"{'pair':20s} {'kind':22s} {'m x n x k':>20s}  {'choice':18s} {'predicted':>10s} {'speedup':>8s}  candidates"]
    for name, wl, decision in lp.rows:
        mnk = f"{wl.m}x{wl.n}x{wl.k}"
        cands = " ".join(f"{c.label}={format_seconds(c.seconds)}" for c in decision.candidates)
        lines.append(f"{name:20s} {wl.kind:22s} {mnk:>20s}  {decision.label:18s} "
                     f"{format_seconds(decision.predicted_s):>10s} {decision.speedup:7.2f}x  {cands}")
    lines.append(f"layer: sequential {format_seconds(lp.sequential_s)}, planned {format_seconds(lp.planned_s)}, "
                 f"speedup {lp.speedup:.2f}x")
    return "\n".join(lines)
