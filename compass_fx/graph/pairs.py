"""The dataclasses that describe one matched matmul<->collective site in an FX graph."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..cost.workload import Workload


@dataclass(frozen=True)
class RowLayout:
    """How the rows of the 2-D matmul operands map onto the logical tensor around a collective.

    ``shape`` is the full logical tensor (gathered, or before the scatter), e.g. ``[B, S, D]`` with
    ``dim`` = 1 for sequence parallelism over S.  The 2-D matmul operands are that tensor with the
    leading dims flattened, so row r of the matmul is a multi-index into ``shape[:-1]``; splitting
    ``shape[dim]`` into ``[world, parts, rows]`` tells which rows belong to which rank and part.
    """

    shape: tuple[int, ...]
    dim: int
    world: int

    @property
    def rows(self) -> int:
        return math.prod(self.shape[:-1])

    @property
    def local_extent(self) -> int:
        """Extent of ``dim`` that one rank holds."""
        return self.shape[self.dim] // self.world

    def feasible_parts(self) -> tuple[int, ...]:
        n = self.local_extent
        return tuple(d for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True)
class BatchedWeight:
    """The right operand of a ``bmm`` that is one matrix broadcast over the batch.

    Such a bmm (what ``einsum``/``matmul`` on 3-D activations trace to) is a plain row matmul in
    disguise: ``bmm(X[B,M,K], W)`` equals ``mm(X.view(B*M, K), W2d).view(B, M, N)``.
    """

    source: fx.Node     # a [K', N'] tensor or a [1, K', N'] tensor
    transpose: bool     # the bmm sees the source's transpose


@dataclass
class RowConsumer:
    """``mm(V, B)`` / ``addmm(bias, V, B)`` / ``bmm(V3, broadcast B)``: output rows follow the gathered rows.

    ``casts`` are the dtype conversions between the gathered tensor and ``view`` (applied in
    order, e.g. a bf16 gather feeding an fp32 matmul); ``weight`` is set only for the bmm form.
    """

    mm: fx.Node
    view: fx.Node
    casts: tuple[torch.dtype, ...] = ()
    weight: BatchedWeight | None = None
    # float8 ``_scaled_mm`` only: the row-local nodes (graph order) that compute its A operand
    # (``view``) and its scales of A from the gathered rows; each part replays them on its rows.
    region: tuple[fx.Node, ...] = ()


@dataclass
class ContractionConsumer:
    """``mm(t(V), Y)`` or ``mm(t(Y), V)``: the gathered rows are the contraction dim (weight grad)."""

    mm: fx.Node
    view: fx.Node
    other: fx.Node          # Y, whose rows pair with V's rows (a float8 _scaled_mm: its column-major B)
    gathered_on_left: bool  # True for mm(t(V), Y) and _scaled_mm(clone(t(V)), Y)
    casts: tuple[torch.dtype, ...] = ()  # dtype conversions between the gathered tensor and V
    region: tuple[fx.Node, ...] = ()     # float8: the row-local nodes computing V (see RowConsumer)


@dataclass
class Pair:
    """One matched site, everything the lowering and the cost model need.

    For ``all_gather_matmul`` the collective's logical result feeds the consumers; for the
    producer kinds, ``terms`` are the mm/addmm nodes whose sum is reduced.
    """

    kind: str
    graph: str
    collective: fx.Node
    wait: fx.Node
    layout: RowLayout
    group_name: str
    group_size: int
    dtype: torch.dtype
    reduce_op: str | None = None
    # all_gather_matmul
    shard: fx.Node | None = None            # the collective's input (this rank's shard)
    logical: fx.Node | None = None          # the gathered tensor in its logical shape
    row_consumers: list[RowConsumer] = field(default_factory=list)
    contraction_consumers: list[ContractionConsumer] = field(default_factory=list)
    other_users: int = 0                    # uses that need the whole gathered tensor
    # matmul_reduce_scatter / matmul_all_reduce
    terms: list[fx.Node] = field(default_factory=list)
    reduced: fx.Node | None = None          # the collective's input in its logical shape
    # Wild-graph details (empty for the plain DTensor shapes):
    reduce_casts: tuple[torch.dtype, ...] = ()  # every dtype conversion between the terms and ``reduced``
    forms: dict[fx.Node, BatchedWeight] = field(default_factory=dict)  # bmm terms -> their weight
    escapes: list[fx.Node] = field(default_factory=list)  # nodes of the reduced sum used elsewhere too
    scatter_perm: tuple[int, ...] | None = None  # the collective sees permute(reduced, perm), its
    #                                              output is permute(scatter of reduced on dim, perm)
    row_factors: dict[fx.Node, fx.Node] = field(default_factory=dict)  # mul(term, f) -> f (f scales rows/cols)

    @property
    def plain(self) -> bool:
        """True when every matmul is a plain mm/addmm (not a float8 _scaled_mm) fed (or feeding)
        without casts or extra uses.

        Lowerings that only know the plain DTensor shapes must check this and leave the pair
        alone when it is False.
        """
        consumers = list(self.row_consumers) + list(self.contraction_consumers)
        return (not self.reduce_casts and not self.forms and not self.escapes and self.scatter_perm is None
                and not self.row_factors and all(not c.casts for c in consumers)
                and all(not c.region for c in consumers)
                and all(c.weight is None for c in self.row_consumers)
                and not any(mm.target is torch.ops.aten._scaled_mm.default for mm in self.matmuls))

    @property
    def matmuls(self) -> list[fx.Node]:
        if self.kind == "all_gather_matmul":
            return [c.mm for c in self.row_consumers] + [c.mm for c in self.contraction_consumers]
        return list(self.terms)

    def mnk(self) -> tuple[int, int, int]:
        """m = full rows; n, k such that 2*m*n*k is the FLOP count of all matmuls sharing the collective.

        A gather feeding several GEMMs sums their output columns into n (same K); a reduced sum of
        several GEMMs sums their inner dims into k (same N).
        """
        m = self.layout.rows
        if self.kind == "all_gather_matmul":
            k = self.layout.shape[-1]
            n = sum(int(c.mm.meta["val"].shape[-1]) for c in self.row_consumers)
            n += sum(int(c.other.meta["val"].shape[-1]) for c in self.contraction_consumers)
            return m, n, k
        n = self.layout.shape[-1]
        k = sum(int(mm_operands(t)[0].meta["val"].shape[-1]) for t in self.terms)
        return m, n, k

    def feasible_parts(self) -> tuple[int, ...]:
        if self.kind == "matmul_all_reduce":
            m = self.layout.rows
            return tuple(d for d in range(1, m + 1) if m % d == 0)
        return self.layout.feasible_parts()

    def workload(self) -> Workload:
        m, n, k = self.mnk()
        dtype = str(self.dtype).replace("torch.", "")
        gemm = self.gemm_dtype()
        return Workload(kind=self.kind, m=m, n=max(n, 1), k=max(k, 1), dtype=dtype,
                        group_size=self.group_size, matmuls=len(self.matmuls),
                        feasible_parts=self.feasible_parts(), gemm_dtype=gemm if gemm != dtype else None)

    def gemm_dtype(self) -> str:
        """The dtype the pair's GEMMs multiply in: that of the first matmul's left operand (float8
        for a ``_scaled_mm``), else the collective's."""
        for mm in self.matmuls:
            val = mm_operands(mm)[0].meta.get("val")
            if val is not None:
                return str(val.dtype).replace("torch.", "")
        return str(self.dtype).replace("torch.", "")

    def describe(self) -> str:
        m, n, k = self.mnk()
        return f"{self.kind}[{self.collective.name}] m={m} n={n} k={k} dim={self.layout.dim}"


def mm_operands(mm: fx.Node) -> tuple[fx.Node, fx.Node]:
    """The two matrix operands of an mm or addmm node."""
    if mm.target is torch.ops.aten.addmm.default:
        return mm.args[1], mm.args[2]
    return mm.args[0], mm.args[1]
