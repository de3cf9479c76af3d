"""Triton kernels of the fused operators: a signal-aware GEMM, a piece mover and a piece adder.

Imported only by the CUDA implementation, the benchmark and the interpreter tests, so that
``compass_fx.kernels`` imports without Triton.  Under ``TRITON_INTERPRET=1`` (set before this
module is imported) the same kernels run on CPU tensors, which is how their signalling is tested.

Signals are int32 counters in (symmetric) memory.  A producer adds 1 with release semantics when
it has written its share of a piece; a consumer spins with acquire semantics until the counter
reaches the number of producers of that piece.  Counters are zeroed (and all ranks pass a
barrier) at the start of every operator call.

* :func:`gemm` -- ``c = a @ b`` over a persistent grid.  The M tiles are visited in the order of
  a tile table (the schedule's consume or produce order).  ``mode="wait"`` spins on each tile's
  piece counter before reading ``a`` (all-gather consumer); ``mode="signal"`` bumps the piece
  counter after writing each tile (reduce-scatter producer).
* :func:`copy_piece` -- wait for a source counter, copy a contiguous piece, signal.
* :func:`add_pieces` -- wait for two source counters, ``z = x + y`` in fp32, signal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

MODES = {"none": 0, "wait": 1, "signal": 2}
COPY_BLOCK = 4096
MAX_COMM_PROGRAMS = 8


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and pipelining of :func:`gemm` (Triton constexprs)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


INTERPRETER_CONFIG = GemmConfig(16, 16, 16, 2, 1, 1)


def wave_efficiency(tiles: int, programs: int) -> float:
    """Share of program-slots busy when ``tiles`` equal tiles run in whole waves of ``programs``."""
    return tiles / (triton.cdiv(tiles, programs) * programs)


# Measured on one H200 (benchmarks/results/kernel_consumer_gemm-h200.json): at equal wave
# efficiency a 128x128 tile (4 warps) does ~0.85 of the work rate of a 128x256 tile (8 warps).
SMALL_TILE_RATE = 0.85


def default_config(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                   variant: str = "tma", num_programs: int | None = None) -> GemmConfig:
    """Tiles the operators use (chosen from the H200 measurements in
    benchmarks/results/kernel_consumer_gemm-h200.json).

    16-bit: 128x256x64 / 8 warps, unless its tiles fill the programs' waves so badly that 128x128
    tiles (4 warps) finish sooner despite their lower rate (Llama-3 70B QKV at 4096 tokens: 160
    big tiles on 132 SMs); 4 stages with TMA loads, 3 with pointer loads.  fp32 (exact, no tf32):
    128x128x32.  The block shape depends on the shape and program count only, never on strides:
    a reduce-scatter peer counts this rank's finished tiles, so every rank must tile alike."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        return GemmConfig(128, 128, 32, 8, 8, 3)
    programs = num_programs or torch.cuda.get_device_properties(device).multi_processor_count
    big = wave_efficiency(triton.cdiv(m, 128) * triton.cdiv(n, 256), programs)
    small = wave_efficiency(triton.cdiv(m, 128) * triton.cdiv(n, 128), programs)
    if SMALL_TILE_RATE * small > big:
        return GemmConfig(128, 128, 64, 8, 4, 4)
    return GemmConfig(128, 256, 64, 8, 8, 4 if variant == "tma" else 3)


@triton.jit
def _spin_until(flag_ptr, target):
    flag = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    while flag < target:
        flag = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")


@triton.jit
def _tile_coords(tile, num_m_tiles, num_n_tiles, GROUP_M: tl.constexpr):
    """Grouped order over the tile table: consecutive tiles share A row panels / B column panels,
    and table order (the schedule's order) is kept at the granularity of GROUP_M M tiles."""
    tiles_per_group = GROUP_M * num_n_tiles
    first_m = (tile // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    mt = first_m + (tile % tiles_per_group) % group_rows
    nt = (tile % tiles_per_group) // group_rows
    return mt, nt


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, tiles_ptr, flags_ptr,
                 N, K, num_m_tiles, num_programs,
                 stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, MODE: tl.constexpr,
                 EVEN_K: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    for tile in range(pid, num_m_tiles * num_n_tiles, num_programs):
        mt, nt = _tile_coords(tile, num_m_tiles, num_n_tiles, GROUP_M)
        row0 = tl.load(tiles_ptr + 4 * mt)
        row1 = tl.load(tiles_ptr + 4 * mt + 1)
        piece = tl.load(tiles_ptr + 4 * mt + 2)
        if MODE == 1:
            _spin_until(flags_ptr + piece, tl.load(tiles_ptr + 4 * mt + 3))
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mask_m = offs_m < row1
        mask_n = offs_n < N
        a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                k_left = K - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
                b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & mask_n[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
        if MODE == 2:
            tl.debug_barrier()  # every thread's stores precede the release below
            tl.atomic_add(flags_ptr + piece, 1, sem="release", scope="sys")


@triton.jit
def _tma_tile(a_desc, b_desc, row0, col0, k_begin, k_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, B_T: tl.constexpr):
    """fp32 accumulator of one output tile over K blocks [k_begin, k_end)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(k_begin, k_end):
        a = a_desc.load([row0, kk * BLOCK_K])
        if B_T:
            b = b_desc.load([col0, kk * BLOCK_K]).T
        else:
            b = b_desc.load([kk * BLOCK_K, col0])
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _store_tile(c_ptr, acc, row0, row1, col0, N, stride_cm, stride_cn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = col0 + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < row1) & (offs_n[None, :] < N))


@triton.jit
def _range_start(j, total, num_programs):
    return j * total // num_programs


@triton.jit
def _gemm_tma_kernel(a_desc, b_desc, c_ptr, tiles_ptr, flags_ptr, ws_ptr, ws_count_ptr,
                     N, K, num_m_tiles, num_programs, dp_tiles, stride_cm, stride_cn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, MODE: tl.constexpr, B_T: tl.constexpr,
                     STREAM_K: tl.constexpr):
    """As _gemm_kernel, with A and B tiles fetched by the tensor-memory accelerator (Hopper).

    A tile may run past its piece's last row into the next piece: those rows only feed output
    rows that the masked store drops.  Tiles [0, dp_tiles) go round-robin to the programs; with
    STREAM_K the remaining tiles' K iterations are cut into one contiguous range per program
    (stream-K), which removes the idle tail of the last wave.  A tile split between ranges is
    finished by the range holding its first K block (which reaches it last, at the end of its
    range); the others add their partial sums into an fp32 workspace slot and count in.  Range j
    runs on program num_programs-1-j, so the finishing program always waits on lower-numbered
    programs: those are started first on the GPU, and run first in the interpreter."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    k_iters = tl.cdiv(K, BLOCK_K)
    for tile in range(pid, dp_tiles, num_programs):
        mt, nt = _tile_coords(tile, num_m_tiles, num_n_tiles, GROUP_M)
        row0 = tl.load(tiles_ptr + 4 * mt)
        row1 = tl.load(tiles_ptr + 4 * mt + 1)
        piece = tl.load(tiles_ptr + 4 * mt + 2)
        if MODE == 1:
            _spin_until(flags_ptr + piece, tl.load(tiles_ptr + 4 * mt + 3))
        acc = _tma_tile(a_desc, b_desc, row0, nt * BLOCK_N, 0, k_iters, BLOCK_M, BLOCK_N, BLOCK_K, B_T)
        _store_tile(c_ptr, acc, row0, row1, nt * BLOCK_N, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)
        if MODE == 2:
            tl.debug_barrier()
            tl.atomic_add(flags_ptr + piece, 1, sem="release", scope="sys")
    if STREAM_K:
        total = (num_m_tiles * num_n_tiles - dp_tiles) * k_iters
        j = num_programs - 1 - pid
        it = _range_start(j, total, num_programs)
        it_end = _range_start(j + 1, total, num_programs)
        offs_w = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        while it < it_end:
            local = it // k_iters
            t_begin = local * k_iters
            t_end = t_begin + k_iters
            seg_end = tl.minimum(it_end, t_end)
            mt, nt = _tile_coords(dp_tiles + local, num_m_tiles, num_n_tiles, GROUP_M)
            row0 = tl.load(tiles_ptr + 4 * mt)
            row1 = tl.load(tiles_ptr + 4 * mt + 1)
            piece = tl.load(tiles_ptr + 4 * mt + 2)
            if MODE == 1:
                _spin_until(flags_ptr + piece, tl.load(tiles_ptr + 4 * mt + 3))
            acc = _tma_tile(a_desc, b_desc, row0, nt * BLOCK_N, it - t_begin, seg_end - t_begin,
                            BLOCK_M, BLOCK_N, BLOCK_K, B_T)
            ws_tile = ws_ptr + local.to(tl.int64) * (BLOCK_M * BLOCK_N) + offs_w
            if it == t_begin:
                if seg_end < t_end:
                    # count the later ranges that hold part of this tile, wait for all of them
                    expected = 0
                    jj = j + 1
                    while (jj < num_programs) & (_range_start(jj, total, num_programs) < t_end):
                        if _range_start(jj + 1, total, num_programs) > _range_start(jj, total, num_programs):
                            expected += 1
                        jj += 1
                    _spin_until(ws_count_ptr + local, expected)
                    acc += tl.load(ws_tile, cache_modifier=".cg")
                    tl.store(ws_tile, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))  # clean for next call
                    tl.atomic_xchg(ws_count_ptr + local, 0)
                _store_tile(c_ptr, acc, row0, row1, nt * BLOCK_N, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)
                if MODE == 2:
                    tl.debug_barrier()
                    tl.atomic_add(flags_ptr + piece, 1, sem="release", scope="sys")
            else:
                tl.atomic_add(ws_tile, acc, sem="relaxed")
                tl.debug_barrier()
                tl.atomic_add(ws_count_ptr + local, 1, sem="release", scope="gpu")
            it = seg_end


@triton.jit
def _copy_piece_kernel(src_ptr, src_flag_ptr, src_target, dst_ptr, dst_flag_ptr, n_elem,
                       BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    chunk = tl.cdiv(tl.cdiv(n_elem, tl.num_programs(0)), BLOCK) * BLOCK
    start = pid * chunk
    stop = tl.minimum(start + chunk, n_elem)
    _spin_until(src_flag_ptr, src_target)
    for off in range(start, stop, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < stop
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)
    tl.debug_barrier()
    tl.atomic_add(dst_flag_ptr, 1, sem="release", scope="sys")


@triton.jit
def _add_pieces_kernel(x_ptr, x_flag_ptr, x_target, y_ptr, y_flag_ptr, y_target, z_ptr, z_flag_ptr,
                       n_elem, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    chunk = tl.cdiv(tl.cdiv(n_elem, tl.num_programs(0)), BLOCK) * BLOCK
    start = pid * chunk
    stop = tl.minimum(start + chunk, n_elem)
    _spin_until(x_flag_ptr, x_target)
    _spin_until(y_flag_ptr, y_target)
    for off in range(start, stop, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < stop
        x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
        tl.store(z_ptr + offs, (x + y).to(z_ptr.dtype.element_ty), mask=mask)
    tl.debug_barrier()
    tl.atomic_add(z_flag_ptr, 1, sem="release", scope="sys")


# ------------------------------------------------------------------------------------------------
def comm_programs(n_elem: int) -> int:
    """Programs that move (or add) a piece of ``n_elem`` elements; also the piece's signal target.

    A pure function of the piece size so that sender and receiver agree without talking."""
    return max(1, min(MAX_COMM_PROGRAMS, triton.cdiv(n_elem, COPY_BLOCK)))


def tile_table(spans: Sequence[tuple[int, int, int, int]], block_m: int,
               device: torch.device) -> torch.Tensor:
    """int32 [tiles, 4] (row0, row1, flag index, wait target) for pieces given in visiting order
    as (row0, row1, flag index, wait target); a piece is cut into M tiles of ``block_m`` rows."""
    rows = []
    for r0, r1, flag, target in spans:
        for s in range(r0, r1, block_m):
            rows.append((s, min(r1, s + block_m), flag, target))
    if not rows:
        rows.append((0, 0, 0, 0))
    return torch.tensor(rows, dtype=torch.int32, device=device)


def tiles_per_piece(rows: int, n: int, cfg: GemmConfig) -> int:
    """Signals the producer GEMM sends for a piece of ``rows`` rows (one per output tile)."""
    return triton.cdiv(rows, cfg.block_m) * triton.cdiv(n, cfg.block_n)


def tma_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the TMA kernel can take these operands: 16-bit, A row-major, B row- or
    column-major, 16-byte aligned rows, on a Hopper-or-newer GPU."""
    if a.device.type != "cuda" or a.dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.get_device_capability(a.device)[0] < 9:
        return False
    rowmajor_b = b.stride(1) == 1 and b.stride(0) % 8 == 0
    colmajor_b = b.stride(0) == 1 and b.stride(1) % 8 == 0
    return a.stride(1) == 1 and a.stride(0) % 8 == 0 and (rowmajor_b or colmajor_b)


_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def stream_k_split(tiles: int, num_programs: int) -> int:
    """Tiles done whole (round-robin) before the stream-K part: all but the last one-to-two waves."""
    return max(0, tiles // num_programs - 1) * num_programs


def _stream_k_workspace(device: torch.device, slots: int, cfg: GemmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed fp32 partial-sum slots and int32 counters; kernels leave them zeroed again."""
    key = (str(device), cfg.block_m, cfg.block_n)
    ws = _workspaces.get(key)
    slots = max(slots, 1)
    if ws is None or ws[1].numel() < slots:
        ws = _workspaces[key] = (torch.zeros(slots * cfg.block_m * cfg.block_n, dtype=torch.float32, device=device),
                                 torch.zeros(slots, dtype=torch.int32, device=device))
    return ws


def gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tiles: torch.Tensor,
         flags: torch.Tensor | None, mode: str = "none", cfg: GemmConfig | None = None,
         num_programs: int | None = None, variant: str = "auto",
         stream_k: bool = False) -> torch.Tensor:
    """c[rows of each tile] = a[rows] @ b, tiles visited in table order, with waits or signals.

    ``num_programs`` None: one program per SM (persistent); ``variant``: "ptr" (pointer loads,
    any strides and dtypes), "tma" (tensor descriptors, Hopper, 16-bit) or "auto"; ``stream_k``
    (tma only): split the last waves' K loops between programs.  Off by default: on the H200
    it was slower than whole tiles on 10 of 12 Llama-3 shapes, within 1% on two (fp32 atomic
    fix-up, register spills)."""
    m, k = a.shape
    n = b.shape[1]
    if variant == "auto":
        variant = "tma" if tma_ok(a, b) else "ptr"
    if num_programs is None:
        num_programs = (torch.cuda.get_device_properties(a.device).multi_processor_count
                        if a.device.type == "cuda" else 4)
    cfg = cfg or default_config(m, n, k, a.device, a.dtype, variant, num_programs)
    num_m_tiles = tiles.shape[0]
    total = num_m_tiles * triton.cdiv(n, cfg.block_n)
    num_programs = max(1, min(num_programs, total))
    if flags is None:
        flags = tiles  # never read in mode "none"
    meta = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                MODE=MODES[mode], num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if variant == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
        b_t = b.stride(0) == 1 and b.stride(1) != 1
        b_desc = (TensorDescriptor.from_tensor(b.t(), [cfg.block_n, cfg.block_k]) if b_t
                  else TensorDescriptor.from_tensor(b, [cfg.block_k, cfg.block_n]))
        dp_tiles = stream_k_split(total, num_programs) if stream_k else total
        ws, count = _stream_k_workspace(a.device, total - dp_tiles, cfg)
        _gemm_tma_kernel[(num_programs,)](a_desc, b_desc, c, tiles, flags, ws, count, n, k, num_m_tiles,
                                          num_programs, dp_tiles, c.stride(0), c.stride(1), B_T=b_t,
                                          STREAM_K=bool(stream_k), **meta)
        return c
    _gemm_kernel[(num_programs,)](
        a, b, c, tiles, flags, n, k, num_m_tiles, num_programs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        EVEN_K=k % cfg.block_k == 0, IEEE=a.dtype == torch.float32, **meta)
    return c


def copy_piece(src: torch.Tensor, src_flag: torch.Tensor, src_target: int, dst: torch.Tensor,
               dst_flag: torch.Tensor) -> None:
    """dst = src once src_flag >= src_target; dst_flag += programs.  Contiguous, same size."""
    n = src.numel()
    if n == 0:
        return
    _copy_piece_kernel[(comm_programs(n),)](src, src_flag, src_target, dst, dst_flag, n,
                                            BLOCK=COPY_BLOCK, num_warps=4)


def add_pieces(x: torch.Tensor, x_flag: torch.Tensor, x_target: int, y: torch.Tensor,
               y_flag: torch.Tensor, y_target: int, z: torch.Tensor, z_flag: torch.Tensor) -> None:
    """z = x + y (fp32 arithmetic) once both counters reach their targets; z_flag += programs."""
    n = z.numel()
    if n == 0:
        return
    _add_pieces_kernel[(comm_programs(n),)](x, x_flag, x_target, y, y_flag, y_target, z, z_flag, n,
                                            BLOCK=COPY_BLOCK, num_warps=4)
