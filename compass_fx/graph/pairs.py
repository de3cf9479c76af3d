"""The dataclasses that describe one matched matmul<->collective site in an FX graph."""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from ..cost.workload import PAIR_KINDS, Workload

ALL_GATHER_MATMUL, MATMUL_REDUCE_SCATTER, MATMUL_ALL_REDUCE = PAIR_KINDS  # the names, defined once there


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


@dataclass(kw_only=True)
class Pair(ABC):
    """What every matched site has: the collective, its wait, the row layout around it, the group.

    Two kinds of site, two types: :class:`GatherPair` (a gather whose rows feed matmuls) and
    :class:`ReducePair` (a sum of matmuls reduced by a reduce-scatter or an all-reduce): each
    holds only the fields that mean something for it, so no field sits unset for the other kind.
    ``kind`` names the site with one of ``PAIR_KINDS`` for the report, the cost model and the CLI.
    """

    graph_name: str         # "forward" / "backward": the AOTAutograd graph the site is in
    collective: fx.Node
    wait: fx.Node
    layout: RowLayout
    group_name: str
    group_size: int
    dtype: torch.dtype      # what the collective moves
    # Every node the match looked at (the collective, the nodes between it and the matmuls, their
    # users): a rewrite of another pair that touches one of them changes what this match saw.
    footprint: frozenset[fx.Node] = field(default=frozenset(), repr=False, compare=False)

    @property
    @abstractmethod
    def kind(self) -> str:
        """One of ``PAIR_KINDS``."""

    @property
    @abstractmethod
    def matmuls(self) -> list[fx.Node]:
        """Every matmul node that shares the collective."""

    @property
    @abstractmethod
    def logical_tensor(self) -> fx.Node:
        """The tensor the collective moves, in its logical shape (gathered, or summed before the reduction)."""

    @property
    @abstractmethod
    def split_extent(self) -> int:
        """The extent a decomposition divides into parts (every part count must divide it)."""

    @abstractmethod
    def mnk(self) -> tuple[int, int, int]:
        """m = full rows; n, k such that 2*m*n*k is the FLOP count of all matmuls sharing the collective."""

    def feasible_parts(self) -> tuple[int, ...]:
        """Every part count the site can be split into: the divisors of ``split_extent``."""
        n = self.split_extent
        return tuple(parts for parts in range(1, n + 1) if n % parts == 0)

    def workload(self) -> Workload:
        """The pair as numbers, free of the graph, for the cost model."""
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
        """One line naming the pair, for logs and errors (ranks compare it to agree on a pair)."""
        m, n, k = self.mnk()
        return f"{self.kind}[{self.collective.name}] m={m} n={n} k={k} dim={self.layout.dim}"

    def _has_scaled_mm(self) -> bool:
        return any(mm.target is torch.ops.aten._scaled_mm.default for mm in self.matmuls)


@dataclass(kw_only=True)
class GatherPair(Pair):
    """An all_gather whose gathered rows feed matmuls (``all_gather_matmul``).

    Each rank's shard is split along ``layout.dim``, so a part is a slice of every rank's shard.
    """

    shard: fx.Node          # the collective's input (this rank's shard)
    logical: fx.Node        # the gathered tensor in its logical shape
    row_consumers: list[RowConsumer] = field(default_factory=list)
    contraction_consumers: list[ContractionConsumer] = field(default_factory=list)
    whole_tensor_uses: int = 0  # uses that need the whole gathered tensor (rebuilt from the parts)

    @property
    def kind(self) -> str:
        return ALL_GATHER_MATMUL

    @property
    def matmuls(self) -> list[fx.Node]:
        return [c.mm for c in self.row_consumers] + [c.mm for c in self.contraction_consumers]

    @property
    def logical_tensor(self) -> fx.Node:
        return self.logical

    @property
    def split_extent(self) -> int:
        return self.layout.local_extent

    def mnk(self) -> tuple[int, int, int]:
        """A gather feeding several GEMMs sums their output columns into n (same K)."""
        m, k = self.layout.rows, self.layout.shape[-1]
        n = sum(int(c.mm.meta["val"].shape[-1]) for c in self.row_consumers)
        n += sum(int(c.other.meta["val"].shape[-1]) for c in self.contraction_consumers)
        return m, n, k


@dataclass(kw_only=True)
class ReducePair(Pair):
    """A sum of matmuls reduced by a reduce_scatter (``matmul_reduce_scatter``) or, with
    ``all_reduce``, by an all_reduce (``matmul_all_reduce``).

    A reduce-scatter's parts are slices of each rank's block of ``layout.dim``; an all-reduce
    keeps every row, so its parts are runs of the rows themselves.
    """

    all_reduce: bool
    reduce_op: str
    terms: list[fx.Node]    # the mm/addmm/bmm/_scaled_mm nodes whose sum is reduced
    reduced: fx.Node        # the collective's input in its logical shape
    # Wild-graph details (empty for the plain DTensor shapes):
    reduce_casts: tuple[torch.dtype, ...] = ()  # every dtype conversion between the terms and ``reduced``
    batched_weights: dict[fx.Node, BatchedWeight] = field(default_factory=dict)  # bmm terms -> their weight
    shared_partial_sums: list[fx.Node] = field(default_factory=list)  # nodes of the sum used elsewhere too
    scatter_perm: tuple[int, ...] | None = None  # the collective sees permute(reduced, perm), its
    #                                              output is permute(scatter of reduced on dim, perm)
    row_factors: dict[fx.Node, fx.Node] = field(default_factory=dict)  # mul(term, f) -> f (f scales rows/cols)
    added_biases: list[fx.Node] = field(default_factory=list)  # x + bias[N] on the way to the terms: each
    #                                                          rank's bias is summed with the products

    @property
    def kind(self) -> str:
        return MATMUL_ALL_REDUCE if self.all_reduce else MATMUL_REDUCE_SCATTER

    @property
    def matmuls(self) -> list[fx.Node]:
        return list(self.terms)

    @property
    def logical_tensor(self) -> fx.Node:
        return self.reduced

    @property
    def split_extent(self) -> int:
        return self.layout.rows if self.all_reduce else self.layout.local_extent

    def mnk(self) -> tuple[int, int, int]:
        """A reduced sum of several GEMMs sums their inner dims into k (same N)."""
        m, n = self.layout.rows, self.layout.shape[-1]
        k = sum(int(mm_operands(t)[0].meta["val"].shape[-1]) for t in self.terms)
        return m, n, k


def mm_operands(mm: fx.Node) -> tuple[fx.Node, fx.Node]:
    """The two matrix operands of an mm or addmm node."""
    if mm.target is torch.ops.aten.addmm.default:
        return mm.args[1], mm.args[2]
    return mm.args[0], mm.args[1]
