"""IntraFusion: replace a pair by one call of a fused ``torch.ops.compass`` operator.

The fused operators work on 2-D matrices whose rows are rank-major blocks (as
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on dim 0 lay them out).  A pair gathered or
scattered on a dim g > 0 keeps its rows in logical order (``lead, rank, local, mid``), so rows are
permuted on the way in or out; several matmuls reduced together become one GEMM over the
concatenated inner dim.
"""
from __future__ import annotations

import logging
import operator

import torch
import torch.fx as fx

from ..cost.decision import Decision
from ..graph.pairs import GatherPair, Pair, ReducePair, mm_operands
from ..graph.nodes import shape_of
from .graph_edit import NodeBuilder, RewriteFailed, finish_rewrite, stable_toposort

aten = torch.ops.aten
log = logging.getLogger("compass_fx")


def lower(gm: fx.GraphModule, pair: Pair, decision: Decision, asynchronous: bool = False) -> None:
    """Rewrite ``pair`` into a fused call, or raise ``RewriteFailed``.  Called through
    :func:`compass_fx.lowering.rewrite`, which has already turned down a pair :func:`unsupported`
    names, restores the graph on failure, and asks for ``asynchronous`` on reductions only.

    ``asynchronous`` (reduce-scatter and all-reduce pairs): the ``*_start`` form of the operator,
    moved up to just after its inputs, and a ``wait_tensor`` on its result just before the first
    use, so that the work between them (a weight gradient beside an input gradient's all-reduce)
    runs while the pieces travel."""
    import compass_fx.kernels  # noqa: F401 - registers torch.ops.compass

    described = pair.describe()  # the pair's nodes are gone once it is rewritten
    b = NodeBuilder(gm.graph, pair.collective)
    if isinstance(pair, GatherPair):
        build = _all_gather
    else:
        build = _all_reduce if pair.all_reduce else _reduce_scatter
    try:
        replacements = build(b, pair, decision.schedule or "ring", asynchronous)
    except Exception as e:  # noqa: BLE001 - metadata refused the rewrite: the transaction undoes it
        raise RewriteFailed(f"fused rewrite not applicable: {e}") from e
    for old, new in replacements:
        old.replace_all_uses_with(new)
    finish_rewrite(gm, b.created, (pair.wait, pair.collective))
    if asynchronous:
        try:
            _spread(gm.graph, b.created)
        except Exception as e:  # noqa: BLE001 - the call is correct wherever it sits; only overlap is lost
            stable_toposort(gm.graph)
            log.warning("compass_fx: asynchronous fused call of %s left where it was: %s", described, e)




def _spread(graph: fx.Graph, created: list[fx.Node]) -> None:
    """Move the start of an asynchronous call (with the nodes that prepare its operands) up to
    just after the last of its inputs, and its wait (with the views of the result) down to just
    before the first node that reads the result.  Every rank moves the same nodes the same way."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    alive = [n for n in created if n.graph is graph and n in order]
    starts = (torch.ops.compass.matmul_reduce_scatter_start.default, torch.ops.compass.matmul_all_reduce_start.default)
    start = next(n for n in alive if n.target in starts)
    wait = next(iter(start.users))
    feeding = _upstream(start, set(alive))
    outside = {i for n in feeding for i in n.all_input_nodes if i not in feeding}
    after = max(outside, key=order.__getitem__)
    if after.op == "placeholder":
        after = max((n for n in graph.nodes if n.op == "placeholder"), key=order.__getitem__)
    for node in sorted(feeding, key=order.__getitem__):
        after.append(node)
        after = node
    result = _downstream(wait, set(alive))
    readers = [u for n in result for u in n.users if u not in result]
    first = min(readers, key=lambda n: order[n]) if readers else None
    if first is not None:
        for node in sorted(result, key=order.__getitem__):
            first.prepend(node)
    graph.lint()


def _upstream(node: fx.Node, among: set[fx.Node]) -> set[fx.Node]:
    """``node`` and the nodes of ``among`` it is computed from."""
    return _reachable(node, among, lambda n: n.all_input_nodes)


def _downstream(node: fx.Node, among: set[fx.Node]) -> set[fx.Node]:
    """``node`` and the nodes of ``among`` computed from it."""
    return _reachable(node, among, lambda n: n.users)


def _reachable(node: fx.Node, among: set[fx.Node], step) -> set[fx.Node]:
    out, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo += [m for m in step(n) if m in among]
    return out


def unsupported(pair: Pair) -> str:
    """Why the fused operators cannot take ``pair`` ("" when they can): checked before anything
    is built, so a refused pair costs no copy of the graph."""
    if not pair.is_plain_dtensor_shape:  # bmm form, casts, float8, shared partial sums: decompose only
        return ("the pair has wild-graph details (bmm form, casts, float8 _scaled_mm, extra uses or a permuted "
                "scatter); the fused operators are not offered for it")
    if isinstance(pair, ReducePair):
        if pair.reduce_op != "sum":
            return f"the fused operators reduce with 'sum', this pair with {pair.reduce_op!r}"
        if any(t.target is aten.addmm.default for t in pair.terms):
            return "a bias added inside the reduction differs per rank; the fused GEMM has no bias"
        dtypes = {mm_operands(t)[0].meta["val"].dtype for t in pair.terms}
        if len(dtypes) != 1:
            return "the reduced matmuls differ in dtype"
    return ""


def _local_shape(pair: Pair) -> list[int]:
    shape = list(pair.layout.shape[:-1])
    shape[pair.layout.dim] //= pair.layout.world
    return shape


def _rank_major_to_logical(b: NodeBuilder, t2d: fx.Node, pair: Pair) -> fx.Node:
    """Rows ``(rank, lead, local, mid)`` -> ``(lead, rank, local, mid)`` for a gather on dim g > 0."""
    g, cols = pair.layout.dim, shape_of(t2d)[-1]
    local = _local_shape(pair)
    v = b.view(t2d, [pair.layout.world] + local + [cols])
    order = list(range(1, g + 1)) + [0] + list(range(g + 1, len(local) + 2))
    return b.view(b.contiguous(b.call(aten.permute.default, v, order)), [pair.layout.rows, cols])


def _logical_to_rank_major(b: NodeBuilder, t2d: fx.Node, pair: Pair) -> fx.Node:
    """Inverse of ``_rank_major_to_logical``."""
    g, cols = pair.layout.dim, shape_of(t2d)[-1]
    local = _local_shape(pair)
    split = local[:g] + [pair.layout.world] + local[g:] + [cols]
    order = [g] + list(range(g)) + list(range(g + 1, len(split)))
    return b.view(b.contiguous(b.call(aten.permute.default, b.view(t2d, split), order)),
                  [pair.layout.rows, cols])


Replacements = list[tuple[fx.Node, fx.Node]]


def _all_gather(b: NodeBuilder, pair: GatherPair, schedule: str, asynchronous: bool = False) -> Replacements:
    cols = pair.layout.shape[-1]
    shard = b.view(pair.shard, [pair.layout.rows // pair.layout.world, cols])
    weights = [mm_operands(rc.mm)[1] for rc in pair.row_consumers]
    fused = b.call(torch.ops.compass.all_gather_matmul.graph, shard, weights, schedule,
                   pair.group_name, pair.group_size)
    outs = b.call(operator.getitem, fused, 1)
    replacements = []
    for j, rc in enumerate(pair.row_consumers):
        out = b.call(operator.getitem, outs, j)
        if pair.layout.dim > 0:
            out = _rank_major_to_logical(b, out, pair)
        if rc.mm.target is aten.addmm.default:
            out = b.add(out, rc.mm.args[0])
        replacements.append((rc.mm, out))
    if pair.contraction_consumers or pair.whole_tensor_uses:
        gathered = b.call(operator.getitem, fused, 0)
        if pair.layout.dim > 0:
            gathered = _rank_major_to_logical(b, gathered, pair)
        replacements.append((pair.logical, b.view(gathered, list(shape_of(pair.logical)))))
    return replacements


def _concat_terms(b: NodeBuilder, pair: ReducePair) -> tuple[fx.Node, fx.Node]:
    """One GEMM for a sum of GEMMs: concatenate the row operands on K and the weights on K."""
    lhs = [mm_operands(t)[0] for t in pair.terms]
    rhs = [mm_operands(t)[1] for t in pair.terms]
    if len(lhs) == 1:
        return lhs[0], rhs[0]
    return b.cat(lhs, 1), b.cat(rhs, 0)


def _reduce_scatter(b: NodeBuilder, pair: ReducePair, schedule: str, asynchronous: bool = False) -> Replacements:
    a, w = _concat_terms(b, pair)
    if pair.layout.dim > 0:
        a = _logical_to_rank_major(b, a, pair)
    op = (torch.ops.compass.matmul_reduce_scatter_start.default if asynchronous
          else torch.ops.compass.matmul_reduce_scatter.graph)
    out = b.call(op, a, w, schedule, pair.group_name, pair.group_size)
    if asynchronous:
        out = b.wait(out)
    return [(pair.wait, b.view(out, list(shape_of(pair.wait))))]


def _all_reduce(b: NodeBuilder, pair: ReducePair, schedule: str, asynchronous: bool = False) -> Replacements:
    a, w = _concat_terms(b, pair)
    op = (torch.ops.compass.matmul_all_reduce_start.default if asynchronous
          else torch.ops.compass.matmul_all_reduce.graph)
    out = b.call(op, a, w, schedule, pair.group_name, pair.group_size)
    if asynchronous:
        out = b.wait(out)
    return [(pair.wait, b.view(out, list(shape_of(pair.wait))))]
