"""Row-local regions: what a graph computes from gathered rows one row at a time.

Float8 recipes quantize the gathered activations before their ``_scaled_mm``: torchao's row-wise
recipe takes each row's amax (``amax(abs(x), -1, keepdim)``), turns it into a scale and casts
``x * scale`` to float8; its tensor-parallel styles gather float8 data and give the matmul one
scale per row.  Every such step computes row r of its output from row r of its inputs only, so
a part of the gathered rows can be quantized and multiplied on its own, with its own scales,
as soon as it arrives.  A step that mixes rows (a tensorwise amax of the whole gathered tensor)
ends the region: nothing after it can start before every part has arrived.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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
    """The row-local nodes computed from ``logical`` (itself included), and everything computed
    from it at all (``downstream``), which is what an operand must not be to count as independent."""

    logical: fx.Node
    rows: int
    nodes: set[fx.Node]
    downstream: set[fx.Node]

    def independent(self, node: object) -> bool:
        """Computed without the gathered rows (a weight, a scale from before the gather)."""
        return not isinstance(node, fx.Node) or node not in self.downstream

    def row_aligned(self, node: object) -> bool:
        """A tensor with one row per gathered row: [rows, c] after flattening its leading dims."""
        shape = shape_of(node) if isinstance(node, fx.Node) else None
        return shape is not None and len(shape) >= 2 and math.prod(shape[:-1]) == self.rows

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
        order = {n: i for i, n in enumerate(self.logical.graph.nodes)}
        return tuple(sorted(seen, key=order.__getitem__))


def row_region(logical: fx.Node, rows: int) -> RowRegion:
    """Walk the graph once, in order, from ``logical``: a node joins the region when it is row-local
    in its region inputs and its other tensor inputs are independent of the gathered rows."""
    region = RowRegion(logical, rows, {logical}, {logical})
    started = False
    for node in logical.graph.nodes:
        if node is logical:
            started = True
            continue
        if not started or not any(a in region.downstream for a in node.all_input_nodes):
            continue
        region.downstream.add(node)
        if _row_local(node, region):
            region.nodes.add(node)
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
    if is_reshape(node):
        return src in region.nodes and shape_of(src)[-1] == shape[-1]
    if node.target in _CASTS or torch.Tag.pointwise in getattr(node.target, "tags", ()):
        tensors = [a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)]
        return all(a in region.nodes or _broadcasts_over_rows(a, shape, region) for a in tensors)
    return False


def _broadcasts_over_rows(node: fx.Node, shape: tuple[int, ...], region: RowRegion) -> bool:
    """An independent operand that broadcasts over the rows ([..1, c]) or has the node's rows."""
    other = shape_of(node)
    if not region.independent(node) or other is None:
        return False
    lead = other[:-1] if other else ()
    return all(d == 1 for d in lead) or (len(other) == len(shape) and tuple(lead) == tuple(shape[:-1]))
