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
