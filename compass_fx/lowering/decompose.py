"""InterDecom: rewrite one pair into a pipeline of ``parts`` smaller collectives and matmuls.

Consumer side (all_gather_matmul): the gather of part i+1 is issued before the matmul of part i,
and each wait sits just before its first use.  Producer side (matmul_reduce_scatter,
matmul_all_reduce): the collective of part i is issued right after its matmul, so it travels
while the matmul of part i+1 runs; the waits sit where the result is first needed.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..passes.pairs import Pair, mm_operands
from .graph_edit import PART_MARK, NodeBuilder, shape_of, stable_toposort
from .rows import interleave, interleave_rows, select_rows

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def decompose(gm: fx.GraphModule, pair: Pair, parts: int) -> None:
    """Rewrite ``pair`` in place into ``parts`` pipelined parts (``parts`` must be feasible)."""
    if parts not in pair.feasible_parts():
        raise ValueError(f"parts={parts} does not divide the split dimension of {pair.describe()}")
    lower = {"all_gather_matmul": _all_gather, "matmul_reduce_scatter": _reduce_scatter,
             "matmul_all_reduce": _all_reduce}[pair.kind]
    b = NodeBuilder(gm.graph, pair.collective)
    lower(b, pair, parts)
    for node in b.created:
        node.meta[PART_MARK] = True
    # Operands defined after the anchor (weights permuted late) force a stable re-sort.  Then the
    # replaced matmuls, views and the original collective are dead; collectives are not
    # side-effectful in FX, so dead-code elimination removes them and the old communication never runs.
    stable_toposort(gm.graph)
    gm.graph.eliminate_dead_code()
    for node in (pair.wait, pair.collective):  # FX keeps wait_tensor (impure); drop it by hand
        if not node.users:
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()


def _matmul_like(b: NodeBuilder, mm: fx.Node, rows: fx.Node) -> fx.Node:
    """The same mm/addmm as ``mm`` with its row operand replaced by ``rows``."""
    if mm.target is aten.addmm.default:
        return b.call(aten.addmm.default, mm.args[0], rows, mm.args[2], **mm.kwargs)
    return b.call(aten.mm.default, rows, mm.args[1])


def _all_gather(b: NodeBuilder, pair: Pair, parts: int) -> None:
    layout, world, g = pair.layout, pair.group_size, pair.layout.dim
    shard_shape = shape_of(pair.shard)
    c = shard_shape[g] // parts
    flat = [layout.rows // parts, layout.shape[-1]]

    shard_parts = []
    for i in range(parts):
        piece = b.slice(pair.shard, g, i * c, (i + 1) * c)
        shard_parts.append(b.contiguous(piece) if g > 0 else piece)
    gathers: list[fx.Node] = []

    def issue(i: int) -> None:
        gathers.append(b.call(c10d.all_gather_into_tensor.default, shard_parts[i], world, pair.group_name))

    issue(0)
    logical_parts: list[fx.Node] = []
    row_outs: list[list[fx.Node]] = [[] for _ in pair.row_consumers]
    sums: list[fx.Node | None] = [None for _ in pair.contraction_consumers]
    for i in range(parts):
        if i + 1 < parts:
            issue(i + 1)
        gathered = b.wait(gathers[i])
        if g > 0:
            gathered = b.cat(b.split(gathered, shard_shape[0], 0, world), g)
        logical_parts.append(gathered)
        rows = gathered if len(layout.shape) == 2 else b.view(gathered, flat)
        for j, rc in enumerate(pair.row_consumers):
            row_outs[j].append(_matmul_like(b, rc.mm, rows))
        for j, cc in enumerate(pair.contraction_consumers):
            other = select_rows(b, cc.other, layout, parts, i)
            if cc.gathered_on_left:
                part = b.call(aten.mm.default, b.call(aten.permute.default, rows, [1, 0]), other)
            else:
                part = b.call(aten.mm.default, b.call(aten.permute.default, other, [1, 0]), rows)
            sums[j] = part if sums[j] is None else b.add(sums[j], part)

    for rc, outs in zip(pair.row_consumers, row_outs):
        rc.mm.replace_all_uses_with(interleave_rows(b, outs, layout))
    for cc, total in zip(pair.contraction_consumers, sums):
        cc.mm.replace_all_uses_with(total)
    if pair.other_users:
        full = b.view(interleave(b, logical_parts, layout, [layout.shape[-1]]), list(layout.shape))
        pair.logical.replace_all_uses_with(full)


def _row_parts(b: NodeBuilder, pair: Pair, parts: int, i: int) -> fx.Node:
    """The sum of the pair's matmul terms over the rows of part ``i``."""
    total = None
    for term in pair.terms:
        a, _ = mm_operands(term)
        if pair.kind == "matmul_all_reduce":
            r = pair.layout.rows // parts
            rows = b.slice(a, 0, i * r, (i + 1) * r)
        else:
            rows = select_rows(b, a, pair.layout, parts, i)
        out = _matmul_like(b, term, rows)
        total = out if total is None else b.add(total, out)
    return total


def _reduce_scatter(b: NodeBuilder, pair: Pair, parts: int) -> None:
    layout, world, g = pair.layout, pair.group_size, pair.layout.dim
    c = layout.local_extent // parts
    part_shape = list(layout.shape)
    part_shape[g] //= parts
    pending = []
    for i in range(parts):
        total = _row_parts(b, pair, parts, i)
        logical = total if len(layout.shape) == 2 else b.view(total, part_shape)
        if g > 0:
            logical = b.cat(b.split(logical, c, g, world), 0)
        pending.append(b.call(c10d.reduce_scatter_tensor.default, logical, pair.reduce_op, world,
                              pair.group_name))
    out = b.cat([b.wait(p) for p in pending], g)
    pair.wait.replace_all_uses_with(out)


def _all_reduce(b: NodeBuilder, pair: Pair, parts: int) -> None:
    pending = [b.call(c10d.all_reduce.default, _row_parts(b, pair, parts, i), pair.reduce_op,
                      pair.group_name) for i in range(parts)]
    out = b.cat([b.wait(p) for p in pending], 0)
    if len(pair.layout.shape) != 2:
        out = b.view(out, list(pair.layout.shape))
    pair.wait.replace_all_uses_with(out)
