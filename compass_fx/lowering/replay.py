"""Replay, on one part's gathered rows, the row-local nodes between a gather and a float8 matmul.

torchao's row-wise float8 recipe quantizes the gathered rows (per-row amax, scale, cast) before
its ``_scaled_mm``; each step computes a row from the same row only (``graph.row_local``), so a
part's rows give exactly the part's float8 rows and per-row scales.  Operands computed without the
gathered rows come in whole when they broadcast over the rows, or as the part's rows when they
have one row per gathered row (scales repeated per row).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from ..graph.nodes import is_reshape, shape_of
from ..graph.pairs import GatherPair
from .graph_edit import NodeBuilder
from .rows import select_rows

aten = torch.ops.aten


class RowReplay:
    """Part ``i``'s value of every row-local node of a gathered pair, as 2-D row blocks."""

    def __init__(self, b: NodeBuilder, pair: GatherPair, parts: int, i: int, rows: fx.Node) -> None:
        self.b, self.pair, self.parts, self.i = b, pair, parts, i
        self.memo: dict[fx.Node, fx.Node] = {pair.logical: rows}

    def value(self, node: fx.Node, region: set[fx.Node]) -> fx.Node:
        """This part's rows of ``node`` (``pair.logical`` or a node of ``region``)."""
        if node not in self.memo:
            self.memo[node] = self._compute(node, region)
        return self.memo[node]

    def scale(self, scale: fx.Node, region: set[fx.Node]) -> fx.Node:
        """A float8 scale of A for this part: one scale stays as it is, row scales are the part's."""
        if scale in region:
            return self.value(scale, region)
        if math.prod(shape_of(scale)) == 1:
            return scale
        return self._rows_of(scale)

    def _compute(self, node: fx.Node, region: set[fx.Node]) -> fx.Node:
        src = node.args[0]
        if is_reshape(node):  # keeps the rows and the last dim: the same 2-D block
            return self.value(src, region)
        if node.target is aten.amax.default:  # the row's amax (the matcher checked dim and keepdim)
            return self.b.call(aten.amax.default, self.value(src, region), [-1], True)
        if node.target is aten.expand.default:  # along the rows only (the matcher checked): the part's rows
            return self.b.call(aten.expand.default, self.value(src, region), [-1, shape_of(node)[-1]])

        def operand(x: object) -> object:
            if not isinstance(x, fx.Node):
                return x
            return self.value(x, region) if x in region or x is self.pair.logical else self._independent(x)

        return self.b.call(node.target, *tree_map(operand, node.args), **tree_map(operand, node.kwargs))

    def _independent(self, x: fx.Node) -> fx.Node:
        """An operand computed without the gathered rows: whole if it broadcasts over the rows
        (flattened to its last dim, so that it broadcasts over a 2-D block), else the part's rows."""
        shape = shape_of(x)
        if all(d == 1 for d in shape[:-1]):
            return self.b.view(x, [shape[-1]]) if len(shape) > 1 else x
        return self._rows_of(x)

    def _rows_of(self, x: fx.Node) -> fx.Node:
        flat = self.b.view(self.b.contiguous(x), [self.pair.layout.rows, shape_of(x)[-1]])
        return select_rows(self.b, flat, self.pair.layout, self.parts, self.i)
