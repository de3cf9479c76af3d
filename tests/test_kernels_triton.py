"""The Triton kernels and the pipeline that drives them, under TRITON_INTERPRET=1 on the CPU.

One spawned process per rank (the interpreter runs one kernel program after another, so a rank
can only wait on another *process*); the ranks' buffers are CPU tensors in shared memory, which
is what symmetric memory is on the GPU.  Buffers and outputs are poisoned with NaN, so a kernel
that reads a piece before its counter says it is there, or leaves a row unwritten, fails.
"""
import os
import sys
import time

import importlib.metadata
import importlib.util

import pytest
import torch

# Not pytest.importorskip: importing triton here would import it into the spawned ranks too,
# before _interp() can switch them to the interpreter.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if tuple(int(x) for x in importlib.metadata.version("triton").split(".")[:2]) < (3, 7):
    # seen with 3.6.0: its interpreter cannot take tensors as range() bounds (compiled kernels can)
    pytest.skip("the Triton interpreter before 3.7 cannot run these kernels", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
from rank_pool import RankPool  # noqa: E402

from compass_fx.kernels.schedules import SCHEDULES, parts_of  # noqa: E402


@pytest.fixture(scope="module")
def pools():
    made = {}

    def get(world):
        if world not in made or not made[world].alive:
            made[world] = RankPool(world, timeout_s=180)
        return made[world]

    yield get
    for p in made.values():
        p.close()


def _interp():
    """Make this (spawned) process run Triton kernels in the interpreter; before any import of them."""
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    from compass_fx.kernels import triton_gemm

    return triton_gemm


def _nan(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype).share_memory_()


def _zeros_i32(n):
    return torch.zeros(n, dtype=torch.int32).share_memory_()


# ---------------------------------------------------------------------------------------------
def _gemm_modes(rank):
    tg = _interp()
    torch.manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.float16):
        for (m, k, n) in ((50, 40, 37), (32, 32, 48), (7, 16, 5)):
            a, b = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype).t()  # b column-major
            ref = a.double() @ b.double()
            spans = [(m // 2, m, 1, 2), (0, m // 2, 0, 2)]  # second half first, both already signalled
            tiles = tg.tile_table(spans, 16, a.device)
            variants = ("ptr", "tma", "tma+sk") if dtype == torch.float16 and k % 8 == 0 else ("ptr",)
            for mode, variant in [(mo, v) for mo in ("none", "wait", "signal") for v in variants]:
                flags = torch.full((2,), 2 if mode == "wait" else 0, dtype=torch.int32)
                c = torch.full((m, n), float("nan"), dtype=dtype)
                # 5 programs: stream-K splits tiles between ranges (and leaves ranges empty for m=7)
                tg.gemm(a, b, c, tiles, flags, mode, tg.INTERPRETER_CONFIG, num_programs=5,
                        variant=variant.split("+")[0], stream_k=variant.endswith("+sk"))
                err = ((c.double() - ref).norm() / ref.norm()).item()
                out[(dtype, m, mode, variant)] = err
                if mode == "signal":
                    expect = [tg.tiles_per_piece(m // 2, n, tg.INTERPRETER_CONFIG),
                              tg.tiles_per_piece(m - m // 2, n, tg.INTERPRETER_CONFIG)]
                    assert flags.tolist() == expect, (flags, expect)
    for ws, count in tg._workspaces.values():  # stream-K leaves its workspace clean
        assert not ws.any() and not count.any()
    return out


def test_gemm_matches_torch_in_every_mode(pools):
    errs = pools(1).run(_gemm_modes)[0]
    assert {key[-1] for key in errs} == {"ptr", "tma", "tma+sk"}
    for (dtype, m, mode, variant), err in errs.items():
        assert err < (1e-6 if dtype == torch.float32 else 2e-3), (dtype, m, mode, variant, err)


# ---------------------------------------------------------------------------------------------
def _gemm_waits(rank, g, flags, b, c, pieces, full):
    """Rank 0 runs the consumer GEMM; rank 1 delivers the pieces late, in reverse order."""
    tg = _interp()
    if rank == 0:
        spans = [(s, e, i, 1) for i, (s, e) in enumerate(pieces)]
        tg.gemm(g, b, c, tg.tile_table(spans, 16, g.device), flags, "wait", tg.INTERPRETER_CONFIG,
                num_programs=2)
        return time.time()
    time.sleep(0.5)
    zero = torch.zeros(1, dtype=torch.int32)
    for i, (s, e) in reversed(list(enumerate(pieces))):
        time.sleep(0.1)
        tg.copy_piece(full[s:e].reshape(-1), zero, 0, g[s:e].reshape(-1), flags[i:i + 1])
    return time.time()


def test_gemm_waits_for_each_piece(pools):
    torch.manual_seed(1)
    full = torch.randn(40, 24)
    g, c = _nan(40, 24), _nan(40, 20)
    b = torch.randn(24, 20)
    flags = _zeros_i32(3)
    pieces = [(0, 13), (13, 30), (30, 40)]
    done, delivered = pools(2).run(_gemm_waits, g, flags, b, c, pieces, full)
    assert done >= delivered, "the GEMM finished before the last piece arrived"
    torch.testing.assert_close(c, full @ b)
    assert flags.tolist() == [1, 1, 1]


# ---------------------------------------------------------------------------------------------
def _ag_rank(rank, world, schedule, a_shards, bs, gs, fs, outs, late):
    _interp()
    from compass_fx.kernels import triton_gemm as tg
    from compass_fx.kernels.pipeline import RankBuffers, all_gather_matmul

    if rank == late:
        time.sleep(0.5)
    named = {"G": gs, "F": fs}
    buf = RankBuffers(rank, world, {"G": gs[rank], "F": fs[rank]}, lambda p, name: named[name][p],
                      gemm_programs=3, gemm_config=tg.INTERPRETER_CONFIG)
    all_gather_matmul(a_shards[rank], bs[rank], outs[rank], schedule, buf)
    return True


def _rs_rank(rank, world, schedule, a, b, bufs, outs, late):
    _interp()
    from compass_fx.kernels import triton_gemm as tg
    from compass_fx.kernels.pipeline import RankBuffers, matmul_reduce_scatter

    if rank == late:
        time.sleep(0.5)
    buf = RankBuffers(rank, world, {k: v[rank] for k, v in bufs.items()}, lambda p, name: bufs[name][p],
                      gemm_programs=3, gemm_config=tg.INTERPRETER_CONFIG)
    matmul_reduce_scatter(a[rank], b[rank], outs[rank], schedule, buf)
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_all_gather_matmul_pipeline_across_processes(pools, world, schedule):
    torch.manual_seed(world)
    m, k, ns = (5 if world == 2 else 3), 24, (20, 9)
    a_shards = [torch.randn(m, k) for _ in range(world)]
    bs = [[torch.randn(k, n) for n in ns] for _ in range(world)]
    gs = [_nan(world * m, k) for _ in range(world)]
    fs = [_zeros_i32(world * parts_of(schedule)) for _ in range(world)]
    outs = [[_nan(world * m, n) for n in ns] for _ in range(world)]
    late = world - 1  # a deliberately late peer: everyone else waits on its pieces
    assert pools(world).run(_ag_rank, world, schedule, a_shards, bs, gs, fs, outs, late) == [True] * world
    gathered = torch.cat(a_shards)
    for r in range(world):
        assert torch.equal(gs[r], gathered)
        for out, b in zip(outs[r], bs[r]):
            torch.testing.assert_close(out, gathered @ b)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_matmul_reduce_scatter_pipeline_across_processes(pools, world, schedule):
    torch.manual_seed(10 + world)
    m, k, n = (5 if world == 2 else 3), 16, 20
    rows = m * world
    a = [torch.randn(rows, k) for _ in range(world)]
    b = [torch.randn(k, n) for _ in range(world)]
    npieces = world * parts_of(schedule)
    bufs = {"P": [_nan(rows, n) for _ in range(world)], "ACC": [_nan(rows, n) for _ in range(world)],
            "PF": [_zeros_i32(npieces) for _ in range(world)], "AF": [_zeros_i32(npieces) for _ in range(world)]}
    outs = [_nan(m, n) for _ in range(world)]
    assert pools(world).run(_rs_rank, world, schedule, a, b, bufs, outs, 0) == [True] * world
    total = sum(x.double() @ y.double() for x, y in zip(a, b))
    for r in range(world):
        torch.testing.assert_close(outs[r].double(), total[r * m:(r + 1) * m], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
def _cuda_impl_glue(rank):
    """The CUDA implementation's own code (workspaces, counters, pipeline) at world size 1, run on
    the CPU through the interpreter, twice per op so that reused workspaces are covered."""
    _interp()
    from compass_fx.kernels import cuda_impl as ci

    torch.manual_seed(3)
    for schedule in SCHEDULES:
        for scale in (1.0, -2.0):
            a = scale * torch.randn(37, 24)
            b1, b2 = torch.randn(24, 20), torch.randn(9, 24).t()
            g, (o1, o2) = ci.all_gather_matmul(a, [b1, b2], schedule, "0", 1)
            assert torch.equal(g, a)
            torch.testing.assert_close(o1, a @ b1)
            torch.testing.assert_close(o2, a @ b2)
            torch.testing.assert_close(ci.matmul_reduce_scatter(a, b1, schedule, "0", 1), a @ b1)
            torch.testing.assert_close(ci.matmul_all_reduce(a, b1, schedule, "0", 1), a @ b1)
    return True


def test_cuda_impl_glue_at_world_one(pools):
    assert pools(1).run(_cuda_impl_glue) == [True]


def _default_tiles(rank):
    tg = _interp()
    cuda = torch.device("cuda")  # a device object only: nothing touches a GPU with num_programs given
    pick = {name: tg.default_config(m, n, k, cuda, torch.bfloat16, "tma", 132)
            for name, (m, n, k) in {"70b_qkv_4k": (4096, 1280, 8192), "8b_qkv_4k": (4096, 768, 4096),
                                    "8b_gate_up_4k": (4096, 3584, 4096)}.items()}
    return {name: (c.block_m, c.block_n, c.num_warps) for name, c in pick.items()}, \
        tg.default_config(4096, 1280, 8192, cuda, torch.float32, "ptr", 132).block_k


def test_default_tiles_follow_the_h200_measurements(pools):
    """128x128 only where 128x256 tiles would leave most of a wave idle (70B QKV, 4096 tokens)."""
    tiles, fp32_block_k = pools(1).run(_default_tiles)[0]
    assert tiles == {"70b_qkv_4k": (128, 128, 4), "8b_qkv_4k": (128, 256, 8), "8b_gate_up_4k": (128, 256, 8)}
    assert fp32_block_k == 32
