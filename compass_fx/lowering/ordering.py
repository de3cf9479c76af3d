"""``compass::copy_after``: an explicit data dependency where a rewrite needs an order.

An FX graph's node order is a wish, not a constraint, to a scheduler: Inductor issues a
collective as soon as its input is ready (seen on CPU: both gathers of a decomposed pair were
issued before the first wait although the graph placed the second after it).  Where the order
matters for correctness (on gloo, one gather in flight at a time, ``decompose.py``), the next
collective's input is made a copy taken after the tensor it must follow, so no scheduler can
move it earlier.  The copy is of one part's shard: small next to the part's matmul.
"""
from __future__ import annotations

import torch
from torch import Tensor

# Defined on the dispatcher directly (no custom_op wrapper: see row_blocks.py); graphs call it
# with nothing requiring grad.
_LIB = torch.library.Library("compass", "FRAGMENT")
_LIB.define("copy_after(Tensor x, Tensor after) -> Tensor")


def _copy_after(x: Tensor, after: Tensor) -> Tensor:
    """A contiguous copy of ``x``; ``after`` is only waited for (its producer runs first)."""
    return x.clone(memory_format=torch.contiguous_format)


_LIB.impl("copy_after", _copy_after, "CompositeExplicitAutograd")


@torch.library.register_fake("compass::copy_after", lib=_LIB)
def _(x: Tensor, after: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)
