"""Row-local regions: what a graph computes from gathered rows one row at a time.

Float8 recipes quantize the gathered activations before their ``_scaled_mm``: torchao's row-wise
recipe takes each row's amax (``amax(abs(x), -1, keepdim)``), turns it into a scale and casts
``x * scale`` to float8; its tensor-parallel styles gather float8 data and give the matmul one
scale per row.  Every such step computes row r of its output from row r of its inputs only, so
a part of the gathered rows can be quantized and multiplied on its own, with its own scales,
as soon as it arrives.  A step that mixes rows (a tensorwise amax of the whole gathered tensor)
ends the region: nothing after it can start before every part has arrived.

A float8 tensor gathered as its bytes (``all_gather(xq.view(torch.uint8))`` then
``.view(torch.float8_e4m3fn)``: gloo has no float8 collectives, and Transformer Engine keeps
float8 data in uint8 tensors) is row-local too: a view that reinterprets the dtype keeps every
row's bytes in that row.

Everything here looks only at the region and its edge: a pass matches many pairs per graph, and a
walk to the end of the graph per pair would make the pass quadratic in the model's depth.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from .nodes import is_reshape, shape_of

aten = torch.ops.aten
prims = torch.ops.prims

# Elementwise ops torch does not tag pointwise: dtype conversions.
_CASTS = (aten._to_copy.default, prims.convert_element_type.default)
_ROW_REDUCTIONS = (aten.amax.default,)


@dataclass
class RowRegion:
    """The row-local nodes computed from ``logical`` (itself included).

    Whether an operand is computed from the gathered rows is answered by a walk back from it that
    stops at nodes placed before ``logical`` (FX keeps every node's place in the graph as a sort
    key: comparing two nodes costs nothing), remembered across questions."""

    logical: fx.Node
    rows: int
    nodes: set[fx.Node]
    _from_rows: dict[fx.Node, bool] = field(default_factory=dict, repr=False)

    def computed_from_rows(self, node: object) -> bool:
        """Whether ``node`` is computed (through any path) from the gathered rows."""
        if not isinstance(node, fx.Node):
            return False
        stack = [node]
        while stack:
            n = stack[-1]
            if n in self._from_rows:
                stack.pop()
                continue
            if n is self.logical or n in self.nodes:
                self._from_rows[n] = True
                stack.pop()
                continue
            if n < self.logical:
                self._from_rows[n] = False
                stack.pop()
                continue
            todo = [a for a in n.all_input_nodes if a not in self._from_rows]
            if todo:
                stack.extend(todo)
                continue
            self._from_rows[n] = any(self._from_rows[a] for a in n.all_input_nodes)
            stack.pop()
        return self._from_rows[node]

    def independent(self, node: object) -> bool:
        """Computed without the gathered rows (a weight, a scale from before the gather)."""
        return not self.computed_from_rows(node)

    def row_aligned(self, node: object) -> bool:
        """A tensor with one row per gathered row: [rows, c] after flattening its leading dims."""
        shape = shape_of(node) if isinstance(node, fx.Node) else None
        return shape is not None and len(shape) >= 2 and math.prod(shape[:-1]) == self.rows

    @staticmethod
    def in_order(nodes: object) -> list[fx.Node]:
        """``nodes`` in graph order."""
        return sorted(nodes)

    def ancestors_in_region(self, *targets: object) -> tuple[fx.Node, ...]:
        """The region's nodes that ``targets`` are computed from (graph order, ``logical`` excluded)."""
        seen: set[fx.Node] = set()
        stack = [t for t in targets if isinstance(t, fx.Node) and t in self.nodes]
        while stack:
            node = stack.pop()
            if node in seen or node is self.logical:
                continue
            seen.add(node)
            stack.extend(a for a in node.all_input_nodes if a in self.nodes)
        return tuple(self.in_order(seen))

    def edge(self) -> list[fx.Node]:
        """The users of the region's nodes that are not in it, in graph order."""
        return self.in_order({u for n in self.nodes for u in n.users if u not in self.nodes})


def row_region(logical: fx.Node, rows: int) -> RowRegion:
    """Grow the region from ``logical`` through its users, in graph order: a node joins when it is
    row-local in its region inputs and its other tensor inputs are independent of the gathered
    rows.  (Graph order makes every region input of a node decided before the node is.)"""
    region = RowRegion(logical, rows, {logical})
    heap = list(logical.users)
    heapq.heapify(heap)
    seen: set[fx.Node] = set()
    while heap:
        node = heapq.heappop(heap)
        if node in seen:
            continue
        seen.add(node)
        if _row_local(node, region):
            region.nodes.add(node)
            for user in node.users:
                if user not in seen:
                    heapq.heappush(heap, user)
    return region


def _row_local(node: fx.Node, region: RowRegion) -> bool:
    if node.op != "call_function" or not region.row_aligned(node):
        return False
    shape = shape_of(node)
    src = node.args[0] if node.args else None
    if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
        return False  # a random op replayed per part would draw other numbers than the whole
    if node.target in _ROW_REDUCTIONS:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", [])
        dims = [dims] if isinstance(dims, int) else list(dims)
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return src in region.nodes and keepdim and [d % len(shape) for d in dims] == [len(shape) - 1]
    if node.target is aten.view.dtype:
        return src in region.nodes and _keeps_rows_as_bytes(src, node)
    if is_reshape(node):
        return src in region.nodes and shape_of(src)[-1] == shape[-1]
    if node.target is aten.expand.default:  # a row's values broadcast along the row ([r, 1] -> [r, c])
        return src in region.nodes and tuple(shape_of(src)[:-1]) == tuple(shape[:-1])
    if node.target in _CASTS or torch.Tag.pointwise in getattr(node.target, "tags", ()):
        tensors = [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)]
        return all(a in region.nodes or _broadcasts_over_rows(a, shape, region) for a in tensors)
    return False


def _keeps_rows_as_bytes(src: fx.Node, view: fx.Node) -> bool:
    """``view`` reinterprets ``src``'s bytes as another dtype: the same element size keeps the
    shape; another size scales the last dim only (each row's bytes stay in that row)."""
    before, after = shape_of(src), shape_of(view)
    if before is None or after is None or len(before) != len(after) or before[:-1] != after[:-1]:
        return False
    size_in = src.meta["val"].dtype.itemsize
    size_out = view.meta["val"].dtype.itemsize
    return before[-1] * size_in == after[-1] * size_out


def _broadcasts_over_rows(node: fx.Node, shape: tuple[int, ...], region: RowRegion) -> bool:
    """An independent operand that broadcasts over the rows ([..1, c]) or has the node's rows."""
    other = shape_of(node)
    if other is None or not region.independent(node):
        return False
    lead = other[:-1] if other else ()
    return all(d == 1 for d in lead) or (len(other) == len(shape) and tuple(lead) == tuple(shape[:-1]))
