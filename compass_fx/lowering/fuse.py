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
from typing import Iterator

import torch
import torch.fx as fx

from ..graph.pairs import GatherPair, Pair, ReducePair, mm_operands
from ..graph.nodes import shape_of
from .graph_edit import NodeBuilder, RewriteFailed, stable_toposort
from .rows import ranks_side_by_side, ranks_stacked

aten = torch.ops.aten
log = logging.getLogger("compass_fx")


def all_gather(b: NodeBuilder, pair: GatherPair, schedule: str) -> None:
    """all_gather -> matmul as one call of ``compass.all_gather_matmul``."""
    _build(b, _all_gather, pair, schedule, False)


def reduce_scatter(b: NodeBuilder, pair: ReducePair, schedule: str, asynchronous: bool = False) -> None:
    """matmul -> reduce_scatter as one call of ``compass.matmul_reduce_scatter`` (its ``*_start`` form
    and a wait when ``asynchronous``: :func:`spread` then moves them apart)."""
    _build(b, _reduce_scatter, pair, schedule, asynchronous)


def all_reduce(b: NodeBuilder, pair: ReducePair, schedule: str, asynchronous: bool = False) -> None:
    """matmul -> all_reduce as one call of ``compass.matmul_all_reduce`` (``asynchronous``: as above)."""
    _build(b, _all_reduce, pair, schedule, asynchronous)


def _build(b: NodeBuilder, build, pair: Pair, schedule: str, asynchronous: bool) -> None:
    import compass_fx.kernels  # noqa: F401 - registers torch.ops.compass

    try:
        replacements = build(b, pair, schedule, asynchronous)
    except Exception as e:  # noqa: BLE001 - metadata refused the rewrite: the transaction undoes it
        raise RewriteFailed(f"fused rewrite not applicable: {e}") from e
    for old, new in replacements:
        b.replace(old, new)


def spread(graph: fx.Graph, created: list[fx.Node], described: str) -> bool:
    """Give an asynchronous fused call (the nodes ``created`` by its rewrite, in a graph sorted since)
    its overlap; if that fails, the call stays where the rewrite put it (it is correct there: only
    the overlap is lost) and the reason is logged.  Whether the call stays asynchronous: one with
    nothing between its start and its wait becomes the plain call (:func:`_plain_if_idle`)."""
    try:
        _spread(graph, created)
    except Exception as e:  # noqa: BLE001 - the call is correct wherever it sits; only overlap is lost
        stable_toposort(graph)  # in case a move was half done (see _spread: it should not be)
        log.warning("compass_fx: asynchronous fused call of %s left where it was: %s", described, e)
    return not _plain_if_idle(graph, _start_of(graph, created), described)


def _while_deferred(start: fx.Node) -> Iterator[fx.Node]:
    """The nodes between an asynchronous call's ``start`` and its wait, in graph order."""
    wait = next(iter(start.users))
    node = start.next
    while node is not wait:
        yield node
        node = node.next


def would_defer(pair: ReducePair) -> bool:
    """Whether ``fused_async`` would leave ``pair``'s fused call deferred, read off the graph before
    any rewrite, as :func:`spread` and :func:`_plain_if_idle` will find it: something besides views
    lies between the last input of the pair's own nodes (its matmuls and what leads from them to the
    collective's wait) and the first reader of its result.  The cost model prices a deferred call's
    host as replayed on a stream of its own (events around the replay).  Walks the graph from that
    input only until the first node that runs something."""
    own = _between(pair.terms, pair.wait)
    own |= _feeding_views(own)  # they travel up with the call
    inputs = [i for n in own for i in n.all_input_nodes if i not in own]
    readers = list(pair.wait.users)
    if not inputs or not readers:
        return False
    first = min(readers)
    node = max(inputs).next
    while node is not first and node.op != "root":
        if node not in own and node.op == "call_function" and not _runs_nothing(node):
            return True
        node = node.next
    return False


def _feeding_views(nodes: set[fx.Node]) -> set[fx.Node]:
    """The views (nodes that run nothing) outside ``nodes`` that they read, and the views those
    read, and so on: a weight's transposes, placed by AOTAutograd just before its matmul, would
    otherwise hold a call's start there."""
    out: set[fx.Node] = set()
    todo = [i for n in nodes for i in n.all_input_nodes if i not in nodes]
    while todo:
        n = todo.pop()
        if n not in out and _runs_nothing(n):
            out.add(n)
            todo += n.all_input_nodes
    return out


def _between(sources: list[fx.Node], sink: fx.Node) -> set[fx.Node]:
    """The nodes on a path from one of ``sources`` to ``sink``, both ends included (walking only what
    lies downstream of the sources, up to the sink's place)."""
    ahead: set[fx.Node] = set()
    todo = list(sources)
    while todo:
        n = todo.pop()
        if n not in ahead and not sink < n:
            ahead.add(n)
            todo += n.users
    return _upstream(sink, ahead)


def _start_of(graph: fx.Graph, created: list[fx.Node]) -> fx.Node:
    """The ``*_start`` call among the nodes a rewrite ``created``."""
    return next(n for n in created if not n._erased and n.graph is graph and n.target in _plain_forms())


def _runs_nothing(node: fx.Node) -> bool:
    """A node that gives the device no work: a view of a tensor, or an item of a tuple."""
    target = node.target
    return node.op == "call_function" and (target is operator.getitem or target is aten._unsafe_view.default
                                           or getattr(target, "is_view", False))


def _plain_forms() -> dict:
    """An asynchronous form -> the plain call of the same operator (what rewritten graphs call)."""
    compass = torch.ops.compass
    return {compass.matmul_reduce_scatter_start.default: compass.matmul_reduce_scatter.graph,
            compass.matmul_all_reduce_start.default: compass.matmul_all_reduce.graph}


def _plain_if_idle(graph: fx.Graph, start: fx.Node, described: str) -> bool:
    """Turn ``start`` into its operator's plain call where nothing but views lies between it and its
    wait: nothing would run while it travels, and a deferred call costs the host more than a plain one
    (it replays on a stream of its own, with events to order that stream with the caller's, and waits
    through ``wait_tensor``: ``kernels/cuda/impl._Workspace._replay_apart``).  Whether it did."""
    if not all(_runs_nothing(node) for node in _while_deferred(start)):
        return False
    wait = next(iter(start.users))
    start.target = _plain_forms()[start.target]
    wait.replace_all_uses_with(start)
    graph.erase_node(wait)
    log.info("compass_fx: %s: nothing runs between the start of its fused call and its first use: "
             "a plain call instead (it costs the host less)", described)
    return True


def _spread(graph: fx.Graph, created: list[fx.Node]) -> None:
    """Move the start of an asynchronous call (with the nodes that prepare its operands, and the views
    of other nodes they read) up to just after the last of its inputs, and its wait (with the views
    of the result) down to just before the first node that reads the result.  Every rank moves the
    same nodes the same way.

    Both places are found before anything moves, by comparing the few nodes involved (FX keeps
    every node's place as a sort key), so a failure leaves the graph as it was."""
    alive = [n for n in created if not n._erased and n.graph is graph]
    start = _start_of(graph, created)
    wait = next(iter(start.users))
    feeding = _upstream(start, set(alive))
    views = _feeding_views(feeding)  # they run nothing: those below the start's new place move up with it
    outside = {i for n in feeding | views for i in n.all_input_nodes if i not in feeding | views}
    after = max(outside)
    if after.op == "placeholder":
        after = max(graph.find_nodes(op="placeholder", sort=False))
    feeding |= {v for v in views if after < v}
    result = _downstream(wait, set(alive))
    readers = [u for n in result for u in n.users if u not in result]
    first = min(readers) if readers else None
    for node in sorted(feeding):
        after.append(node)
        after = node
    if first is not None:
        for node in sorted(result):
            first.prepend(node)


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


def _local_shape(pair: Pair) -> list[int]:
    shape = list(pair.layout.shape[:-1])
    shape[pair.layout.dim] //= pair.layout.world
    return shape


def _rank_major_to_logical(b: NodeBuilder, t2d: fx.Node, pair: Pair) -> fx.Node:
    """Rows ``(rank, lead, local, mid)`` -> ``(lead, rank, local, mid)`` for a gather on dim g > 0."""
    cols, local, world = shape_of(t2d)[-1], _local_shape(pair), pair.layout.world
    stacked = b.view(t2d, [world * local[0], *local[1:], cols])
    return b.view(ranks_side_by_side(b, stacked, world, pair.layout.dim), [pair.layout.rows, cols])


def _logical_to_rank_major(b: NodeBuilder, t2d: fx.Node, pair: Pair) -> fx.Node:
    """Inverse of ``_rank_major_to_logical``."""
    cols = shape_of(t2d)[-1]
    logical = b.view(t2d, [*pair.layout.shape[:-1], cols])
    return b.view(ranks_stacked(b, logical, pair.layout.world, pair.layout.dim), [pair.layout.rows, cols])


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
    if pair.scatter_perm is not None:  # the collective scattered the permuted sum (torchtitan's Shard(1))
        local = b.view(out, _local_shape(pair) + [pair.layout.shape[-1]])
        return [(pair.wait, b.call(aten.permute.default, local, list(pair.scatter_perm)))]
    return [(pair.wait, b.view(out, list(shape_of(pair.wait))))]


def _all_reduce(b: NodeBuilder, pair: ReducePair, schedule: str, asynchronous: bool = False) -> Replacements:
    a, w = _concat_terms(b, pair)
    op = (torch.ops.compass.matmul_all_reduce_start.default if asynchronous
          else torch.ops.compass.matmul_all_reduce.graph)
    out = b.call(op, a, w, schedule, pair.group_name, pair.group_size)
    if asynchronous:
        out = b.wait(out)
    return [(pair.wait, b.view(out, list(shape_of(pair.wait))))]
