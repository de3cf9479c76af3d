"""matmul -> all_reduce: a sum of matmuls all-reduced (plain tensor parallelism's row-parallel
layer; in the backward, the input gradient of a column-parallel layer).

* Matching: from ``all_reduce`` and its one wait down through casts, reshapes, adds and row
  factors to the matmul terms (``passes.match.reduced_sum``).  Every rank keeps every row, so a
  part is a run of the rows themselves.
* Strategies: InterDecom (``lowering.decompose.all_reduce``) for every matched pair; the fused
  operator (``lowering.fuse.all_reduce``) on the same conditions as the reduce-scatter's.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..cost.decision import Decision
from ..graph.pairs import MATMUL_ALL_REDUCE, ReducePair, RowLayout
from ..groups import find_group
from ..lowering import decompose, fuse
from ..lowering.graph_edit import NodeBuilder
from .match import LINEAR_REDUCE_OPS, NoMatch, dtype_of, reduced_sum, single_wait, static_shape
from .matmul_reduce_scatter import fused_refusals
from .pair_kind import PairKind

c10d = torch.ops._c10d_functional


def match(ar: fx.Node, graph_kind: str) -> ReducePair:
    """The pair at the all-reduce ``ar``, or ``NoMatch`` with the reason."""
    inp, op = ar.args[0], ar.args[1]
    if op not in LINEAR_REDUCE_OPS:
        raise NoMatch(f"reduce op {op!r} does not distribute over row blocks")
    wait = single_wait(ar)
    shape = static_shape(inp, "all_reduce input")
    if len(shape) < 2:
        raise NoMatch("all_reduce of a 1-D tensor")
    found = reduced_sum(inp, shape, ar)
    try:
        world = find_group(str(ar.args[2])).size()
    except ValueError as e:  # an unknown group is a reason to leave the pair alone
        raise NoMatch(f"cannot resolve process group {ar.args[2]!r}: {e}") from None
    return ReducePair(graph_name=graph_kind, collective=ar, wait=wait, layout=RowLayout(shape, 0, world),
                      group_name=str(ar.args[2]), group_size=world, dtype=dtype_of(inp), all_reduce=True,
                      reduce_op=op, terms=found.terms, reduced=inp, reduce_casts=found.casts,
                      batched_weights=found.batched_weights, shared_partial_sums=found.shared_partial_sums,
                      row_factors=found.factors, added_biases=found.biases,
                      footprint=frozenset(found.seen | {ar, wait}))


def lower(b: NodeBuilder, pair: ReducePair, decision: Decision, asynchronous: bool = False) -> bool:
    """Build ``decision``'s rewrite of ``pair``; a fused call may run asynchronously."""
    if decision.strategy == "decompose":
        decompose.all_reduce(b, pair, decision.parts)
        return False
    fuse.all_reduce(b, pair, decision.schedule or "ring", asynchronous)
    return asynchronous


KIND = PairKind(MATMUL_ALL_REDUCE, c10d.all_reduce.default, match, fused_refusals, lower)
