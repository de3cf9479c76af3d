"""matmul -> reduce_scatter: a sum of matmuls whose rows are reduce-scattered (the row-parallel
side of sequence parallelism; in the backward, the input gradient of a column-parallel layer).

* Matching: from ``reduce_scatter_tensor`` and its one wait back to the tensor it scatters in its
  logical shape (through the split/cat or the permute that express a scatter on a dim > 0), then
  down through casts, reshapes, adds and row factors to the matmul terms
  (``passes.match.reduced_sum``).
* Strategies: InterDecom (``lowering.decompose.reduce_scatter``) for every matched pair; the fused
  operator (``lowering.fuse.reduce_scatter``) for a plain sum of mm terms reduced with "sum".
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
import torch
import torch.fx as fx

from ..cost.decision import Decision
from ..graph.pairs import MATMUL_REDUCE_SCATTER, ReducePair, RowLayout, mm_operands
from ..lowering import decompose, fuse
from ..lowering.graph_edit import NodeBuilder
from .match import LINEAR_REDUCE_OPS, NoMatch, dtype_of, reduced_sum, single_wait, static_shape
from .pair_kind import PairKind

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def match(rs: fx.Node, graph_kind: str) -> ReducePair:
    """The pair at the reduce-scatter ``rs``, or ``NoMatch`` with the reason."""
    inp, op, world = rs.args[0], rs.args[1], int(rs.args[2])
    if op not in LINEAR_REDUCE_OPS:
        raise NoMatch(f"reduce op {op!r} does not distribute over row blocks")
    wait = single_wait(rs)
    scatter = _scatter_logical(inp, world, rs)
    logical, dim = scatter.logical, scatter.dim
    shape = static_shape(logical, "reduce-scatter input")
    if len(shape) < 2 or dim == len(shape) - 1:
        raise NoMatch("scatter on the last dim (the matmul's columns) is not a row scatter")
    if shape[dim] % world:
        raise NoMatch("scatter dim does not divide by the group size")
    found = reduced_sum(logical, shape, scatter.side)
    footprint = found.seen | scatter.seen | {rs, wait}
    return ReducePair(graph_name=graph_kind, collective=rs, wait=wait, layout=RowLayout(shape, dim, world),
                      group_name=str(rs.args[3]), group_size=world, dtype=dtype_of(logical), all_reduce=False,
                      reduce_op=op, terms=found.terms, reduced=logical, reduce_casts=found.casts,
                      batched_weights=found.batched_weights, shared_partial_sums=found.shared_partial_sums,
                      scatter_perm=scatter.perm, row_factors=found.factors, added_biases=found.biases,
                      footprint=frozenset(footprint))


def fused_refusals(pair: ReducePair) -> dict[str, str]:
    """What the fused matmul-reduce operators (reduce-scatter and all-reduce) cannot take: one GEMM
    over the concatenated inner dims of plain mm terms, reduced with "sum"."""
    details = [what for what, present in (  # decompose only (a permuted scatter is the fused call's, permuted)
        ("dtype casts", pair.reduce_casts), ("bmm form", pair.batched_weights),
        ("extra uses of a partial sum", pair.shared_partial_sums), ("row factors", pair.row_factors),
        ("float8 _scaled_mm", pair._has_scaled_mm())) if present]
    if details:
        return {"fuse": f"the pair has wild-graph details ({', '.join(details)}); "
                        "the fused operators are not offered for it"}
    if pair.reduce_op != "sum":
        return {"fuse": f"the fused operators reduce with 'sum', this pair with {pair.reduce_op!r}"}
    if pair.added_biases or any(t.target is aten.addmm.default for t in pair.terms):
        return {"fuse": "a bias added inside the reduction differs per rank; the fused GEMM has no bias"}
    if len({mm_operands(t)[0].meta["val"].dtype for t in pair.terms}) != 1:
        return {"fuse": "the reduced matmuls differ in dtype"}
    return {}


def lower(b: NodeBuilder, pair: ReducePair, decision: Decision, asynchronous: bool = False) -> bool:
    """Build ``decision``'s rewrite of ``pair``; a fused call may run asynchronously."""
    if decision.strategy == "decompose":
        decompose.reduce_scatter(b, pair, decision.parts)
        return False
    fuse.reduce_scatter(b, pair, decision.schedule or "ring", asynchronous)
    return asynchronous


KIND = PairKind(MATMUL_REDUCE_SCATTER, c10d.reduce_scatter_tensor.default, match, fused_refusals, lower)


@dataclass
class _Scatter:
    """How the reduce-scatter's input relates to the logical tensor it scatters."""

    logical: fx.Node
    dim: int
    side: fx.Node                        # the node through which ``logical`` reaches the collective
    perm: tuple[int, ...] | None = None  # the collective sees permute(logical, perm)
    seen: frozenset[fx.Node] = frozenset()


def _scatter_logical(inp: fx.Node, world: int, rs: fx.Node) -> _Scatter:
    """The reduce-scatter input in its logical shape and the scatter dim.

    A scatter on dim g > 0 appears as ``split(x, local, g) -> getitem x world -> cat(dim 0)``
    (DTensor) or as ``clone(permute(x, perm))`` with ``perm`` swapping dims 0 and g (torchtitan).
    """
    if inp.target is aten.cat.default and (len(inp.args) < 2 or inp.args[1] == 0):
        pieces = list(inp.args[0])
        split = pieces[0].args[0] if pieces and pieces[0].target is operator.getitem else None
        if (split is not None and split.target is aten.split.Tensor and len(pieces) == world
                and all(p.target is operator.getitem and p.args[0] is split and p.args[1] == i
                        and len(p.users) == 1 for i, p in enumerate(pieces))
                and len(split.users) == world):
            logical = split.args[0]
            shape = static_shape(logical, "reduce-scatter input")
            dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % len(shape)
            if dim == 0 or split.args[1] * world != shape[dim]:
                raise NoMatch("split/cat before the reduce-scatter is not a scatter-dim change")
            return _Scatter(logical, dim, split, seen=frozenset({inp, split, *pieces}))
        if split is not None and split.target is aten.split.Tensor:
            raise NoMatch("split/cat before the reduce-scatter is not a scatter-dim change")
    permute = inp
    if inp.target is aten.clone.default and isinstance(inp.args[0], fx.Node) and len(inp.args) == 1:
        permute = inp.args[0] if len(inp.users) == 1 else inp
    if permute.target is aten.permute.default and len(permute.users) == 1:
        perm = tuple(int(p) for p in permute.args[1])
        g = perm[0] % len(perm)
        swap = list(range(len(perm)))
        swap[0], swap[g] = g, 0
        if g == 0 or list(perm) != swap:
            raise NoMatch(f"permute {perm} before the reduce-scatter is not a swap of dim 0 with another")
        return _Scatter(permute.args[0], g, permute, perm, seen=frozenset({inp, permute}))
    return _Scatter(inp, 0, rs)
