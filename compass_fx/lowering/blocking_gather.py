"""``compass::all_gather_blocking``: a part's gather on gloo, run to completion before it returns.

torch 2.13's functional ``all_gather_into_tensor`` on gloo corrupts the process's heap now and then
when it is in flight while other work runs: two in flight at once crashed a rank within a few
thousand calls (``benchmarks/funcol_gloo_inflight.py``), and one in flight at a time, overlapped
with the previous part's matmul, still crashed once in about 50,000 decomposed gathers
(``benchmarks/gloo_gather_soak.py``).  c10d's own blocking ``all_gather_into_tensor`` ran clean in
every such test, so on gloo each part is gathered by this op: nothing is in flight across other
work, the graph is the same on every rank, and the part's values are the same bytes.  A gather on
CPU ranks gains nothing from overlap (gloo is the correctness platform); NCCL keeps the functional
collective and its pipeline.  Since found: the crashes take a group's two gloo worker threads
running two collectives at once; on groups made inside :func:`..groups.gloo_worker_threads` with one
thread the lowering's functional form ran 108,000 decomposed gathers clean
(``gloo_gather_soak --functional --gloo-threads 1``), so there the lowering keeps that form
(``decompose.gathers_blocking``; the ranks agree on the threads), and this op serves groups of
torch's two threads and the dtypes gloo has no type for (float8, moved as bytes).
"""
from __future__ import annotations

import torch
from torch import Tensor

# Defined on the dispatcher directly (no custom_op wrapper: see row_blocks.py); graphs call it
# with nothing requiring grad.
_LIB = torch.library.Library("compass", "FRAGMENT")
_LIB.define("all_gather_blocking(Tensor x, int group_size, str group_name) -> Tensor")


def _all_gather_blocking(x: Tensor, group_size: int, group_name: str) -> Tensor:
    """Every rank's ``x`` stacked along dim 0 in rank order (what ``all_gather_into_tensor`` gives),
    moved as bytes: exact for every dtype, float8 included (gloo has no float8 collectives)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    x = x.contiguous()
    out = x.new_empty((x.shape[0] * group_size, *x.shape[1:]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name, where it exists
    gather(out.view(-1).view(torch.uint8), x.view(-1).view(torch.uint8), group=_resolve_process_group(group_name))
    return out


_LIB.impl("all_gather_blocking", _all_gather_blocking, "CompositeExplicitAutograd")


@torch.library.register_fake("compass::all_gather_blocking", lib=_LIB)
def _(x: Tensor, group_size: int, group_name: str) -> Tensor:
    return x.new_empty((x.shape[0] * group_size, *x.shape[1:]))
