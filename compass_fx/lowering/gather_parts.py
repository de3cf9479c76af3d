"""``compass::all_gather_mm_parts``: a decomposed all-gather -> matmul pair as one call.

Why (issue 27): emitted as graph nodes, every extra InterDecom part of a gather cost the host about
123 us on the lent H200 machine (``benchmarks/results/host_issue_profile/``): the functional
gather's layers and its ``wait_tensor``, ``mm_into_row_blocks`` and the views around it, each a
trip through the dispatcher and Inductor's wrapper.  This op issues the same pipeline from one
call: every part's gather is issued first (c10d's own asynchronous gather, one work per part: on
NCCL they run back to back on its stream), then, part by part, the caller's stream waits for that
part's gather and multiplies it into its rows of each result (one GEMM per part and weight, written
where the rows lie, as :mod:`.row_blocks` does).  Issued, an extra part costs the host one gather,
one stream wait and one GEMM launch; with ``COMPASS_PARTS_REPLAY=1`` on an NCCL group, a call's
gathers are one CUDA graph launch instead (:mod:`.parts_replay`).

The graph is the same on every rank (the group's name and size, never a rank).  On CPU tensors
(gloo) each part's gather completes before the next is issued: gloo's gathers are not left in
flight (:mod:`.blocking_gather` says why); the lowering keeps ``compass::all_gather_blocking`` there
anyway, this op is for the other backends.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import parts_replay
from .row_blocks import multiply_parts

# Defined on the dispatcher directly (no custom_op wrapper: see row_blocks.py); graphs call it
# with nothing requiring grad.
_LIB = torch.library.Library("compass", "FRAGMENT")
_LIB.define("all_gather_mm_parts(Tensor shard, Tensor[] weights, int parts, int group_size, str group_name)"
            " -> Tensor[]")
_c10d: list = []  # (AllgatherOptions made asynchronous, _resolve_process_group): looked up once


def _gather_of(group_name: str, device: torch.device) -> tuple:
    """The asynchronous gather into one tensor of the process group's backend for ``device``
    (c10d's, called directly: the Python wrapper ``dist.all_gather_into_tensor`` checks and builds
    options on every call, and the group's own ``_allgather_base`` only hands the call through
    c10d's dispatcher op to this same backend method, ~5 us a part on the lent H200 host) and its
    options.  The group is resolved on every call (~0.5 us): a name is given again to a new group
    once its group is destroyed, so a group kept by name could be a destroyed one."""
    if not _c10d:
        from torch.distributed.distributed_c10d import AllgatherOptions, _resolve_process_group

        opts = AllgatherOptions()
        if hasattr(opts, "asyncOp"):
            opts.asyncOp = True
        _c10d.append((opts, _resolve_process_group))
    opts, resolve = _c10d[0]
    pg = resolve(group_name)
    try:
        return pg._get_backend(device)._allgather_base, opts
    except (AttributeError, RuntimeError):  # a torch without it, or a group without such a backend
        return getattr(pg, "all_gather_single", None) or pg._allgather_base, opts  # the newer name first


def _all_gather_mm_parts(shard: Tensor, weights: list[Tensor], parts: int, group_size: int,
                         group_name: str) -> list[Tensor]:
    """``[all_gather(shard, dim 0) @ w for w in weights]``, gathered and multiplied in ``parts``
    parts (part i: rows ``[i*c, (i+1)*c)`` of every rank's shard).  On CUDA, an eager call whose
    signature has been seen before may launch its gathers from one CUDA graph (:mod:`.parts_replay`)."""
    rows, k = shard.shape
    if parts < 1 or rows % parts:
        raise ValueError(f"all_gather_mm_parts: {rows} rows do not split into {parts} parts")
    world = group_size
    shard = shard.contiguous()
    outs = [shard.new_empty((rows * world, w.shape[1])) for w in weights]
    if not shard.is_cpu and parts_replay.replayed(shard, weights, outs, parts, world, group_name,
                                                  lambda: _gather_into(group_name, shard.device)):
        return outs
    buffer = shard.new_empty((parts, world * (rows // parts), k))  # part i's gather: buffer[i], rank-major
    _issue(shard, weights, outs, buffer, parts, world, group_name)
    return outs


def _gather_into(group_name: str, device: torch.device) -> "parts_replay.Gather":
    """``(dst, src) -> work``: the asynchronous gather a parts replay captures."""
    gather, opts = _gather_of(group_name, device)
    return lambda dst, src: gather(dst, src, opts)


def _issue(shard: Tensor, weights: list[Tensor], outs: list[Tensor], buffer: Tensor, parts: int, world: int,
           group_name: str) -> None:
    """Every launch of one call on the current stream: each part's gather into ``buffer[i]``, then
    part by part the stream's wait for it and its GEMMs into ``outs``."""
    rows, k = shard.shape
    c = rows // parts
    gather, opts = _gather_of(group_name, shard.device)
    blocking = shard.is_cpu
    works = []
    for dst, src in zip(buffer.unbind(0), shard.view(parts, c, k).unbind(0)):
        work = gather(dst, src, opts)
        if blocking:
            work.wait()
        works.append(work)
    # one call for every part's views (a view per part costs the host a few us each); part i's
    # gather, [world * c, k] rank-major, is the same as [world, c, k]; the caller's stream waits for
    # part i's gather (the host does not), unless it completed before the next was issued
    multiply_parts(buffer.view(parts, world, c, k).unbind(0), weights, outs,
                   None if blocking else [work.wait for work in works])


_LIB.impl("all_gather_mm_parts", _all_gather_mm_parts, "CompositeExplicitAutograd")


def _direct() -> None:
    """Let ``compass::all_gather_mm_parts``'s calls on plain CUDA tensors (what Inductor's wrapper
    makes: nothing requires grad, no mode, no transform) run the kernel above without the
    dispatcher's boxing of the arguments into the Python kernel and back (as the fused operators'
    ``.graph`` overloads do, :func:`..kernels.ops._direct`: this op has no kernel but the one
    above, so the dispatcher could pick nothing else for such a call).  Anything else takes the
    dispatcher as before."""
    from ..kernels.ops import _direct_possible, _plain_cuda_list

    if not _direct_possible():
        return
    overload = torch.ops.compass.all_gather_mm_parts.default
    through_dispatcher = overload._op

    def call(shard, weights, parts, group_size, group_name):
        if type(weights) is list and _plain_cuda_list(shard, weights):
            return _all_gather_mm_parts(shard, weights, parts, group_size, group_name)
        return through_dispatcher(shard, weights, parts, group_size, group_name)
    call.through_dispatcher = through_dispatcher
    overload._op = call


@torch.library.register_fake("compass::all_gather_mm_parts", lib=_LIB)
def _(shard: Tensor, weights: list[Tensor], parts: int, group_size: int, group_name: str) -> list[Tensor]:
    rows = shard.shape[0] * group_size
    return [shard.new_empty((rows, w.shape[1])) for w in weights]


_direct()
