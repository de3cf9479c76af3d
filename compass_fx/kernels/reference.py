"""Any-backend implementation of the fused operators: the schedule run with point-to-point messages.

Each step of the schedule is posted as one ``batch_isend_irecv`` and, while it is in flight, the
matmul of the pieces that are already there runs (all-gather), or the partial products that the
next step will send are computed (reduce-scatter).  It runs on gloo (CPU) and NCCL alike, at any
world size including 1, and is the reference the CUDA implementation is tested against.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..groups import find_group
from .schedules import Piece, all_gather_schedule, piece_rows, reduce_scatter_schedule, split_rows

Spans = Sequence[tuple[int, int]]


def resolve_group(group_name: str, group_size: int) -> tuple[dist.ProcessGroup | None, int]:
    """The process group behind ``group_name`` and this process's rank in it.

    A group of size 1 needs no process group at all (the operator then works without
    ``init_process_group``)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got group_size={group_size}")
    if group_size == 1 and not dist.is_initialized():
        return None, 0
    group = find_group(group_name)
    if group.size() != group_size:
        raise ValueError(f"group_size={group_size} but group {group_name!r} has {group.size()} ranks")
    return group, group.rank()


def equal_blocks(rows: int, world_size: int) -> list[tuple[int, int]]:
    """Row spans of ``world_size`` equal blocks, as all_gather/reduce_scatter_tensor lay them out."""
    if rows % world_size:
        raise ValueError(f"{rows} rows cannot be split into {world_size} equal blocks")
    m = rows // world_size
    return [(b * m, (b + 1) * m) for b in range(world_size)]


def _post(ops: list[dist.P2POp]) -> list:
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def all_gather_matmul(a_shard: torch.Tensor, bs: Sequence[torch.Tensor], schedule: str,
                      group_name: str, group_size: int,
                      blocks: Spans | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """gathered = all_gather(a_shard) on dim 0; outs[j] = gathered @ bs[j], piece by piece."""
    group, rank = resolve_group(group_name, group_size)
    w = group_size
    sched = all_gather_schedule(schedule, w, rank)
    if blocks is None:
        blocks = equal_blocks(a_shard.shape[0] * w, w)
    total = blocks[-1][1]
    gathered = a_shard.new_empty((total, a_shard.shape[1]))
    outs = [a_shard.new_empty((total, b.shape[1])) for b in bs]
    lo, hi = blocks[rank]
    gathered[lo:hi].copy_(a_shard)

    def rows(p: Piece) -> tuple[int, int]:
        return piece_rows(blocks, sched.parts, p)

    consumed = 0

    def consume(upto: int) -> None:
        nonlocal consumed
        for p in sched.order[consumed:upto]:
            s, e = rows(p)
            if e > s:
                for b, out in zip(bs, outs):
                    torch.mm(gathered[s:e], b, out=out[s:e])
        consumed = max(consumed, upto)

    available = sched.parts
    for step in sched.steps:
        ops = []
        for t in step.sends:
            s, e = rows(t.piece)
            if e > s:
                ops.append(dist.P2POp(dist.isend, gathered[s:e], dist.get_global_rank(group, t.peer), group))
        for t in step.recvs:
            s, e = rows(t.piece)
            if e > s:
                ops.append(dist.P2POp(dist.irecv, gathered[s:e], dist.get_global_rank(group, t.peer), group))
        works = _post(ops)
        consume(available)  # overlaps with the transfers just posted
        _wait(works)
        available += len(step.recvs)
    consume(len(sched.order))
    return gathered, outs


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, schedule: str, group_name: str,
                          group_size: int, blocks: Spans | None = None) -> torch.Tensor:
    """reduce_scatter(a @ b, "sum") on dim 0, producing each piece just before its step sends it."""
    group, rank = resolve_group(group_name, group_size)
    w = group_size
    sched = reduce_scatter_schedule(schedule, w, rank)
    if blocks is None:
        blocks = equal_blocks(a.shape[0], w)
    n = b.shape[1]

    def rows(p: Piece) -> tuple[int, int]:
        return piece_rows(blocks, sched.parts, p)

    partial: dict[Piece, torch.Tensor] = {}
    received: dict[Piece, list[torch.Tensor]] = {}
    produced = 0

    def produce(upto: int) -> None:
        nonlocal produced
        for p in sched.order[produced:upto]:
            s, e = rows(p)
            partial[p] = torch.mm(a[s:e], b)
        produced = max(produced, upto)

    def running_sum(p: Piece) -> torch.Tensor:
        acc = partial.pop(p)
        for r in received.pop(p, []):
            acc.add_(r)
        return acc

    sent = 0
    for i, step in enumerate(sched.steps):
        produce(sent + len(step.sends))
        sent += len(step.sends)
        ops, keep = [], []
        for t in step.sends:
            acc = running_sum(t.piece)
            keep.append(acc)
            if acc.numel():
                ops.append(dist.P2POp(dist.isend, acc, dist.get_global_rank(group, t.peer), group))
        for t in step.recvs:
            s, e = rows(t.piece)
            buf = a.new_empty((e - s, n))
            received.setdefault(t.piece, []).append(buf)
            if buf.numel():
                ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, t.peer), group))
        works = _post(ops)
        nxt = sched.steps[i + 1] if i + 1 < len(sched.steps) else None
        produce(sent + (len(nxt.sends) if nxt else sched.parts))  # overlaps with the transfers
        _wait(works)
    produce(len(sched.order))
    own = [running_sum(Piece(rank, p)) for p in range(sched.parts)]
    return torch.cat(own) if len(own) > 1 else own[0]


def matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, schedule: str, group_name: str,
                      group_size: int) -> torch.Tensor:
    """all_reduce(a @ b, "sum"): reduce-scatter then all-gather on the same rings.

    Rows need not divide by the group size: the blocks are then of nearly equal size."""
    rows = a.shape[0]
    blocks = []
    for b0, b1 in split_rows(rows, group_size):
        blocks.append((b0, b1))
    scattered = matmul_reduce_scatter(a, b, schedule, group_name, group_size, blocks=blocks)
    gathered, _ = all_gather_matmul(scattered, [], schedule, group_name, group_size, blocks=blocks)
    return gathered
