"""The FX vocabulary that finding pairs and rewriting them share: node shapes and marks."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

# Marks nodes a rewrite created, so that the matcher never rewrites its own output again.
PART_MARK = "compass_part"


def shape_of(node: Any) -> tuple[int, ...] | None:
    """The static shape of a node's value, or None when unknown or symbolic."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    dims = []
    for d in val.shape:
        if not isinstance(d, int):
            try:
                d = int(d) if not isinstance(d, torch.SymInt) else None
            except TypeError:
                d = None
            if d is None:
                return None
        dims.append(d)
    return tuple(dims)


def slice_args(node: fx.Node) -> tuple[Any, Any, Any, Any, Any]:
    """(source, dim, start, end, step) of an ``aten.slice.Tensor`` node, with its defaults filled in."""
    args = list(node.args) + [0, None, None, 1][len(node.args) - 1:]
    return tuple(args[:5])


aten = torch.ops.aten
VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
# Ops that keep every element and the row-major element order (values and rows unchanged):
# reshapes, and copies (``clone``/``alias``, e.g. from ``.contiguous()``).
RESHAPE_OPS = VIEW_OPS + (aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
                          aten.flatten.using_ints, aten.clone.default, aten.alias.default)


def is_reshape(node: fx.Node) -> bool:
    """Reshapes keep the row-major element order, so rows survive any chain of them.

    A permute that moves only size-1 dims (what einsum traces around its bmm) is one too.
    """
    if shape_of(node) is None:
        return False
    if node.target is aten.permute.default and isinstance(node.args[0], fx.Node):
        src = shape_of(node.args[0])
        kept = [d % len(src) for d in node.args[1] if src is not None and src[d] != 1] if src else None
        return kept is not None and kept == sorted(kept)
    return node.target in RESHAPE_OPS
