"""The schedules driven with the Triton kernels over buffers that every rank can address.

Backend-neutral on purpose: the CUDA implementation passes symmetric-memory buffers (peers' views
from ``get_buffer``) and one CUDA stream per ring direction; the interpreter tests pass CPU tensors
in shared memory (one process per rank) and no streams.  Same code, so the signalling that the
interpreter tests check is the signalling the GPU runs.

Launch order, chosen so that it is also a valid *sequential* order (the interpreter runs each
kernel to completion): every spin-wait is on a counter that an earlier launch on this rank, or
an earlier step on a peer, increments.

Counters (int32, zeroed by the caller at the start of every call, before a barrier):
* all-gather ``F[piece]``: reaches ``comm_programs(piece size)`` when the piece is in ``G``.
* reduce-scatter ``PF[piece]``: reaches ``tiles_per_piece`` when this rank's partial product of
  the piece is in ``P``; ``AF[piece]``: reaches ``comm_programs`` (times the number of adds, for
  the direct schedule's own block) when the running sum is in ``ACC`` (or in ``out``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Sequence

import torch

from . import triton_gemm as tg
from .schedules import Piece, all_gather_schedule, reduce_scatter_schedule, split_rows


@dataclass
class RankBuffers:
    """What one rank addresses: its own buffers and views of the same buffers on its peers."""

    rank: int
    world_size: int
    local: dict[str, torch.Tensor]
    peer: Callable[[int, str], torch.Tensor]
    stream: Callable[[int], ContextManager] = field(default=lambda i: contextlib.nullcontext())
    gemm_programs: int | None = None
    gemm_config: tg.GemmConfig | None = None

    def view(self, owner: int, name: str) -> torch.Tensor:
        return self.local[name] if owner == self.rank else self.peer(owner, name)


def _rows(m: int, parts: int, p: Piece) -> tuple[int, int]:
    a, b = split_rows(m, parts)[p.part]
    return p.block * m + a, p.block * m + b


def _flag(t: torch.Tensor, idx: int) -> torch.Tensor:
    return t[idx:idx + 1]


def all_gather_matmul(a_shard: torch.Tensor, bs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                      schedule: str, buf: RankBuffers) -> None:
    """Fill ``buf.local['G']`` with the gathered rows and ``outs[j] = G @ bs[j]``.

    The own block is copied in first; each received piece is pulled from the neighbour that the
    schedule names once that neighbour's counter says it holds the piece; the GEMM visits pieces
    in the schedule's consume order and waits on each one's counter."""
    w, r = buf.world_size, buf.rank
    sched = all_gather_schedule(schedule, w, r)
    m, k = a_shard.shape
    g, f = buf.local["G"], buf.local["F"]
    zero = torch.zeros(1, dtype=torch.int32, device=g.device)

    def idx(p: Piece) -> int:
        return p.block * sched.parts + p.part

    with buf.stream(-1):
        for part in range(sched.parts):
            p = Piece(r, part)
            s, e = _rows(m, sched.parts, p)
            tg.copy_piece(a_shard[s - r * m:e - r * m].reshape(-1), zero, 0,
                          g[s:e].reshape(-1), _flag(f, idx(p)))
    for step in sched.steps:
        for t in step.recvs:
            s, e = _rows(m, sched.parts, t.piece)
            with buf.stream(t.piece.part):
                tg.copy_piece(buf.view(t.peer, "G")[s:e].reshape(-1), _flag(buf.view(t.peer, "F"), idx(t.piece)),
                              tg.comm_programs((e - s) * k), g[s:e].reshape(-1), _flag(f, idx(t.piece)))
    if not bs:
        return
    variant = "tma" if all(tg.tma_ok(g, b) for b in bs) else "ptr"
    cfg = buf.gemm_config or tg.default_config(g.shape[0], bs[0].shape[1], k, g.device, g.dtype, variant,
                                               buf.gemm_programs)
    spans = []
    for p in sched.order:
        s, e = _rows(m, sched.parts, p)
        spans.append((s, e, idx(p), tg.comm_programs((e - s) * k)))
    tiles = tg.tile_table(spans, cfg.block_m, g.device)
    with buf.stream(-1):
        for b, out in zip(bs, outs):
            tg.gemm(g, b, out, tiles, f, "wait", cfg, buf.gemm_programs, variant)


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, schedule: str,
                          buf: RankBuffers) -> None:
    """``out = reduce_scatter(a @ b)`` for this rank's block.

    The GEMM writes the partial products into ``P`` in the schedule's produce order and counts
    finished tiles per piece; for each received piece an adder waits for the local partial and
    the sender's running sum (its ``P`` if it had received nothing for the piece yet, else its
    ``ACC``) and writes the new running sum into ``ACC`` (``out`` for the own block)."""
    w, r = buf.world_size, buf.rank
    sched = reduce_scatter_schedule(schedule, w, r)
    rows, n = a.shape[0], b.shape[1]
    m = rows // w
    p_buf, acc, pf, af = buf.local["P"], buf.local["ACC"], buf.local["PF"], buf.local["AF"]
    variant = "tma" if tg.tma_ok(a, b) else "ptr"
    cfg = buf.gemm_config or tg.default_config(rows, n, a.shape[1], a.device, a.dtype, variant,
                                               buf.gemm_programs)

    def idx(p: Piece) -> int:
        return p.block * sched.parts + p.part

    def tpp(s: int, e: int) -> int:
        return tg.tiles_per_piece(e - s, n, cfg)

    spans = []
    for p in sched.order:
        s, e = _rows(m, sched.parts, p)
        spans.append((s, e, idx(p), 0))
    with buf.stream(-1):
        tg.gemm(a, b, p_buf, tg.tile_table(spans, cfg.block_m, a.device), pf, "signal", cfg,
                buf.gemm_programs, variant)

    adds_into: dict[Piece, int] = {}
    for i, step in enumerate(sched.steps):
        for t in step.recvs:
            q = t.piece
            s, e = _rows(m, sched.parts, q)
            if e == s:
                continue
            cp = tg.comm_programs((e - s) * n)
            sender = reduce_scatter_schedule(schedule, w, t.peer)
            if sender.arrival_step().get(q, len(sender.steps)) < i:
                y, y_flag, y_target = buf.view(t.peer, "ACC"), buf.view(t.peer, "AF"), cp
            else:
                y, y_flag, y_target = buf.view(t.peer, "P"), buf.view(t.peer, "PF"), tpp(s, e)
            if q.block == r:
                z = out[s - r * m:e - r * m]
            else:
                z = acc[s:e]
            done = adds_into.get(q, 0)
            if done:  # direct: the own block is summed into ``out`` one sender at a time
                x, x_flag, x_target = z, af, done * cp
            else:
                x, x_flag, x_target = p_buf[s:e], pf, tpp(s, e)
            with buf.stream(q.part):
                tg.add_pieces(x.reshape(-1), _flag(x_flag, idx(q)), x_target,
                              y[s:e].reshape(-1), _flag(y_flag, idx(q)), y_target,
                              z.reshape(-1), _flag(af, idx(q)))
            adds_into[q] = done + 1
    for part in range(sched.parts):
        q = Piece(r, part)
        if q not in adds_into:  # nothing received for it (world size 1)
            s, e = _rows(m, sched.parts, q)
            with buf.stream(-1):
                tg.copy_piece(p_buf[s:e].reshape(-1), _flag(pf, idx(q)), tpp(s, e),
                              out[s - r * m:e - r * m].reshape(-1), _flag(af, idx(q)))
