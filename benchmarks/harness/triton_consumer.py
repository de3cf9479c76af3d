"""A Triton GEMM that waits per tile for its rows to arrive: the consumer design issue 9 offers
beside chunked cuBLAS ("a persistent Triton GEMM that waits per tile").

One launch over the whole product; before its K loop each program waits until the row block
holding its tile's rows is marked ready (``ready[block] >= epoch``, read with acquire semantics,
as a copy engine's stream write would set it).  So tiles of blocks already here run while later
blocks travel, and nothing is cut into thin GEMMs.  The wait is bounded: after ``max_spins``
polls the program records the miss in ``missed`` and goes on (the caller checks it), so a
protocol bug is an error, never a frozen GPU.  Grouped tile order (``GROUP`` row tiles share
column tiles in L2), tiles autotuned per shape over a few Hopper configurations.

Benchmark code: ``chunked_gemm.py`` measures it against one cuBLAS call and against the chunked
cuBLAS consumer the CUDA path uses, all blocks ready (the wait's own cost is what is measured).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BM, BN, BK, stages, warps): Hopper tiles that divide the 12 TP = 8 Llama shapes
TILES = ((128, 128, 64, 3, 8), (128, 256, 64, 3, 8), (128, 128, 64, 4, 4), (128, 64, 64, 4, 4),
         (64, 128, 64, 4, 4), (256, 128, 64, 3, 8), (64, 64, 64, 5, 4), (128, 256, 64, 4, 8))


@triton.autotune(configs=[triton.Config({"BM": bm, "BN": bn, "BK": bk, "GROUP": 8}, num_stages=s, num_warps=w)
                          for bm, bn, bk, s, w in TILES], key=["M", "N", "K"])
@triton.jit
def _gemm_waiting_per_tile(a, b, c, ready, missed, epoch, max_spins, M, N, K, stride_bk, stride_bn,
                           ROWS_PER_BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           GROUP: tl.constexpr):
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(M, BM)
    col_tiles = tl.cdiv(N, BN)
    per_group = GROUP * col_tiles
    first = (pid // per_group) * GROUP
    rows_in_group = tl.minimum(row_tiles - first, GROUP)
    tm = first + (pid % per_group) % rows_in_group
    tn = (pid % per_group) // rows_in_group
    flag = ready + (tm * BM) // ROWS_PER_BLOCK
    spins = 0
    while (tl.atomic_add(flag, 0, sem="acquire") < epoch) & (spins < max_spins):
        spins += 1
    if spins >= max_spins:
        tl.atomic_add(missed, 1)
    rm = tm * BM + tl.arange(0, BM)
    rn = tn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptr = a + rm[:, None] * K + rk[None, :]
    b_ptr = b + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, tl.cdiv(K, BK)):
        acc = tl.dot(tl.load(a_ptr), tl.load(b_ptr), acc)
        a_ptr += BK
        b_ptr += BK * stride_bk
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(c.dtype.element_ty))


def gemm_waiting_per_tile(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, ready: torch.Tensor,
                          missed: torch.Tensor, epoch: int = 1, max_spins: int = 1 << 26) -> None:
    """out = a @ b, each tile after ``ready`` marks its row block (``a.shape[0] // ready.numel()``
    rows).  ``a`` and ``out`` row-major; the shape must divide the tiles (the 12 TP = 8 shapes do)."""
    m, k = a.shape
    n = b.shape[1]
    if not (a.is_contiguous() and out.is_contiguous() and m % ready.numel() == 0):
        raise ValueError("gemm_waiting_per_tile needs contiguous a and out and whole row blocks")
    grid = lambda meta: (triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]),)  # noqa: E731
    _gemm_waiting_per_tile[grid](a, b, out, ready, missed, epoch, max_spins, m, n, k, b.stride(0), b.stride(1),
                                 ROWS_PER_BLOCK=m // ready.numel())


def best_tile() -> str:
    """The autotuned tile of the last shape run (for the results)."""
    cfg = _gemm_waiting_per_tile.best_config
    return f"{cfg.kwargs['BM']}x{cfg.kwargs['BN']}x{cfg.kwargs['BK']}/s{cfg.num_stages}/w{cfg.num_warps}"
