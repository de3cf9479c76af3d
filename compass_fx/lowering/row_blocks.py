"""A part's rows as rank blocks, read and written in place: InterDecom without row copies.

Part i of a decomposed pair owns, on every rank's slab, the i-th run of rows; in the whole tensor
these runs lie at a stride (one per rank block).  Gathering them into a contiguous operand, or
putting the parts' products back in order with a cat, copies a whole operand or result once
more: at 16384 tokens of Llama-3 8B's gate+up projection a 117 MB result, about 50 us of an H200
per pair, more than the decomposition can win back.  A batched GEMM does not need them together:
the part's rows are ``blocks`` equally strided matrices, which cuBLAS reads and writes where they
lie, the weight broadcast over the blocks with batch stride 0 (measured on an H200: one GEMM
kernel and no copy, in eager mode and under Inductor).

* Reading (the reduce side): :func:`part_row_blocks` views a part's rows of a 2-D operand as
  ``[blocks, rows, cols]`` and :func:`block_matmul` multiplies them (a plain ``bmm``).
* Writing (the gather side): ``compass::mm_into_row_blocks`` multiplies a part into its rows of a
  result buffer.  It mutates that buffer, so the graph carries it functionalized
  (``auto_functionalized``), one call per part chained through the buffer; Inductor's
  re-inplacing turns the chain into in-place calls on one buffer (no copy: the buffer is a fresh
  ``empty`` that nothing else reads).
"""
from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch import Tensor
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from ..graph.nodes import shape_of
from ..graph.pairs import RowLayout
from .graph_edit import NodeBuilder
from .rows import block_shape

aten = torch.ops.aten


# Defined on the dispatcher directly, not through ``torch.library.custom_op``: that wrapper
# (defaults filled in, Python autograd and in-place-view kernels, an aliasing check) cost 55 us of
# host time per call on the CPU machine against 2 us here, paid once per part of every decomposed
# gather.  A graph calls it with nothing requiring grad, so it needs no autograd.
_LIB = torch.library.Library("compass", "FRAGMENT")
_LIB.define("mm_into_row_blocks(Tensor(a!) out, Tensor a, Tensor b, int blocks, int start, int stop) -> ()")


def _mm_into_row_blocks(out: Tensor, a: Tensor, b: Tensor, blocks: int, start: int, stop: int) -> None:
    """``out`` viewed as ``[blocks, rows_per_block, N]``: rows ``[start, stop)`` of every block
    become ``a @ b``, where ``a`` holds those rows block after block (``blocks * (stop - start)``
    rows)."""
    rows = stop - start
    if out.dim() != 2 or a.dim() != 2 or b.dim() != 2 or a.shape[0] != blocks * rows or out.shape[0] % blocks:
        raise ValueError(f"mm_into_row_blocks: out {tuple(out.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)} "
                         f"do not fit {blocks} blocks of rows [{start}, {stop})")
    target = out.view(blocks, out.shape[0] // blocks, out.shape[1])[:, start:stop]
    # splitting a's rows into blocks is a view whatever a's strides
    torch.bmm(a.view(blocks, rows, a.shape[1]), b.expand(blocks, *b.shape), out=target)


_LIB.impl("mm_into_row_blocks", _mm_into_row_blocks, "CompositeExplicitAutograd")


@torch.library.register_fake("compass::mm_into_row_blocks", lib=_LIB)
def _(out: Tensor, a: Tensor, b: Tensor, blocks: int, start: int, stop: int) -> None:
    return None


def multiply_parts(gathered: Sequence[Tensor], weights: list[Tensor], outs: list[Tensor],
                   waits: Sequence[Callable[[], object]] | None) -> None:
    """Part by part, every result's rows of part ``i`` become ``gathered[i] @ w`` (one batched GEMM
    per part and weight, written where the rows lie).  ``gathered[i]``: part ``i``'s rows as
    ``[world, c, k]``, rank-major, as an all-gather of the part leaves them; ``outs``: the whole
    ``[world * parts * c, n]`` results; ``waits[i]()``, when given, makes the current stream wait
    for part ``i`` before its GEMMs (once per part, however many weights).  Shared by the issued and
    the replayed decomposed gather (:mod:`.gather_parts`, :mod:`.parts_replay`)."""
    world, c, k = gathered[0].shape
    parts, bmm = len(gathered), torch.bmm
    if len(weights) == 1:  # the common call: no list of targets per weight
        w = weights[0]
        targets = outs[0].view(world, parts, c, w.shape[1]).unbind(1)
        w = w.expand(world, k, w.shape[1])
        for i, (a, t) in enumerate(zip(gathered, targets)):
            if waits is not None:
                waits[i]()
            bmm(a, w, out=t)
        return
    targets = [out.view(world, parts, c, out.shape[1]).unbind(1) for out in outs]
    broadcast = [w.expand(world, k, w.shape[1]) for w in weights]
    for i, a in enumerate(gathered):
        if waits is not None:
            waits[i]()
        for target, w in zip(targets, broadcast):
            bmm(a, w, out=target[i])


def part_row_blocks(b: NodeBuilder, x2d: fx.Node, layout: RowLayout, parts: int, i: int) -> fx.Node:
    """Part ``i``'s rows of a 2-D tensor aligned with the layout's rows, as ``[blocks, rows, cols]``
    views of where they lie (no copy; ``x2d`` must be contiguous, as ``select_rows`` needs too)."""
    blocks, rows = block_shape(layout, parts)
    v = b.view(x2d, [blocks, parts, rows, shape_of(x2d)[-1]])
    return b.call(aten.select.int, v, 1, i)


def block_matmul(b: NodeBuilder, blocks3d: fx.Node, weight: fx.Node) -> fx.Node:
    """``blocks3d @ weight`` for every block, as 2-D rows (one batched GEMM, the weight broadcast)."""
    nb, rows, k = shape_of(blocks3d)
    n = shape_of(weight)[-1]
    out = b.call(aten.bmm.default, blocks3d, b.call(aten.expand.default, weight, [nb, k, n]))
    return b.view(out, [nb * rows, n])


def result_buffer(b: NodeBuilder, layout: RowLayout, like: fx.Node) -> fx.Node:
    """An uninitialised ``[layout.rows, N]`` buffer for the whole result of the matmul ``like``
    (every row is written by exactly one part)."""
    val = like.meta["val"]
    return b.call(aten.empty.memory_format, [layout.rows, val.shape[-1]], dtype=val.dtype, device=val.device,
                  pin_memory=False)


def matmul_into_rows(b: NodeBuilder, buf: fx.Node, rows: fx.Node, weight: fx.Node, layout: RowLayout,
                     parts: int, i: int) -> fx.Node:
    """``buf`` with part ``i``'s rows set to ``rows @ weight`` (``rows`` in the part's row order)."""
    blocks, per_block = block_shape(layout, parts)
    written = b.call(auto_functionalized, torch.ops.compass.mm_into_row_blocks.default, out=buf, a=rows,
                     b=weight, blocks=blocks, start=i * per_block, stop=(i + 1) * per_block)
    return b.call(operator.getitem, written, 1)


def run_in_place(gm: fx.GraphModule) -> None:
    """Call this package's functionalized mutating ops in place where nothing reads the tensor they
    mutate afterwards (what Inductor's re-inplacing does), for graphs that run without Inductor
    (``inner="eager"``): ``auto_functionalized`` alone would copy the whole result for every part."""
    from torch._higher_order_ops.auto_functionalize import get_mutable_args

    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.find_nodes(op="call_function", target=auto_functionalized)):
        op = node.args[0]
        if op.namespace != "compass" or op._schema.returns:
            continue
        names, _ = get_mutable_args(op)
        bases = [node.kwargs[k] for k in names]
        if any(not isinstance(b, fx.Node) or b.op == "placeholder"
               or any(order.get(u, -1) > order[node] for u in b.users if u is not node) for b in bases):
            continue
        if any(u.target is not operator.getitem or not 1 <= u.args[1] <= len(bases) for u in node.users):
            continue
        with graph.inserting_before(node):
            call = graph.call_function(op, (), dict(node.kwargs))
        order[call] = order[node]
        for user in list(node.users):
            user.replace_all_uses_with(bases[user.args[1] - 1])
            graph.erase_node(user)
        graph.erase_node(node)
    gm.recompile()
