"""What the cost model needs to know about one matmul<->collective pair, free of any FX graph."""
from __future__ import annotations

from dataclasses import dataclass, field

PAIR_KINDS = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")


@dataclass(frozen=True)
class Workload:
    """One pair, reduced to numbers.

    m is the row count of the full (gathered / pre-scatter) activation, n and k the local weight
    shard's columns and rows (so one rank's GEMM is m x n x k, 2*m*n*k FLOPs).  ``matmuls`` counts
    GEMM launches that share the collective (a gather feeding w1 and w3, or a reduce-scatter of a
    sum of two mms); n and k already include them: a gather feeding several GEMMs sums their
    output columns into n, a reduced sum of GEMMs sums their inner dims into k, so 2*m*n*k stays
    the pair's total FLOP count.  ``extra_n`` optionally gives the columns of all but the first of
    a gather's GEMMs when they differ (q, k, v projections: n = q + k + v, extra_n = (k, v));
    without it the launches are taken as equal.  ``feasible_parts`` lists the part counts the
    graph allows (each divides the split dimension); None means every divisor of the local row count.
    ``gemm_dtype`` is the matmuls' operand dtype when it differs from ``dtype``, what travels (a
    float8 ``_scaled_mm`` after a bf16 gather, or producing the bf16 sum a reduce-scatter moves):
    the GEMMs are priced at its rate (float8: about twice bf16's on Hopper).
    ``cuda_graphs`` says that the step runs as CUDA graph replays (Inductor's "reduce-overhead"):
    the host then issues nothing per pair, so an extra InterDecom part costs only what it costs the
    device, and a fused call has no host floor.  ``parts_replayed`` says that an eager step gathers
    a decomposed gather's parts from one CUDA graph (``lowering.parts_replay``, the default on
    NCCL): an extra part then costs the host its GEMM and an event wait, not a collective's issue
    (``cuda_graphs`` takes precedence: a replayed step issues nothing).  ``deferred`` says that a
    fused call of this pair would run deferred (``fused_async``, with work to overlap: a
    ``*_start`` call), which replays on a stream of its own and costs the host more than a plain
    replayed call (``cost.strategies.FUSED_DEFERRED_S``): its host is priced so.
    """

    kind: str
    m: int
    n: int
    k: int
    dtype: str = "bfloat16"
    group_size: int = 8
    matmuls: int = 1
    feasible_parts: tuple[int, ...] | None = None
    extra_n: tuple[int, ...] = field(default=())
    gemm_dtype: str | None = None
    cuda_graphs: bool = False
    parts_replayed: bool = False
    deferred: bool = False

    @property
    def matmul_dtype(self) -> str:
        """The dtype the GEMMs run in."""
        return self.gemm_dtype or self.dtype

    def __post_init__(self) -> None:
        if self.kind not in PAIR_KINDS:
            raise ValueError(f"Workload.kind must be one of {PAIR_KINDS}, got {self.kind!r}")
        for name in ("m", "n", "k", "group_size", "matmuls"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Workload.{name} must be a positive int, got {value!r}")

    @property
    def local_rows(self) -> int:
        """Rows each rank holds before a gather or after a scatter (all_reduce: all of them)."""
        if self.kind == "matmul_all_reduce":
            return self.m
        return self.m // self.group_size

    def parts_allowed(self) -> tuple[int, ...]:
        """Part counts this workload may be decomposed into, ascending; 1 means not decomposed."""
        if self.feasible_parts is not None:
            return tuple(sorted(set(self.feasible_parts) | {1}))
        rows = self.local_rows
        return tuple(parts for parts in range(1, rows + 1) if rows % parts == 0)
