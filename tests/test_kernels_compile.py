"""The Triton kernels compile for Hopper (sm_90) on a machine without a GPU.

The interpreter tests check what the kernels compute, not whether Triton's compiler accepts them
for the GPU; this compiles each kernel the operators launch down to a cubin (Triton ships ptxas)
and checks that the GEMMs use Hopper's matrix and bulk-copy instructions.
"""
import importlib.metadata
import importlib.util
import os

import pytest

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if tuple(int(x) for x in importlib.metadata.version("triton").split(".")[:2]) < (3, 7):
    pytest.skip("signature syntax checked with Triton >= 3.7", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiling needs the real Triton compiler, not the interpreter", allow_module_level=True)

def _compile(fn, signature, constexprs, **options):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    sig.update({name: "constexpr" for name in constexprs})
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options=options)


_GEMM_ARGS = {"tiles_ptr": "*i32", "flags_ptr": "*i32", "N": "i32", "K": "i32", "num_m_tiles": "i32",
              "num_programs": "i32"}


@pytest.mark.parametrize("stream_k,mode", [(False, 1), (True, 2)])
def test_tma_gemm_compiles_to_wgmma_and_tma(stream_k, mode):
    from compass_fx.kernels import triton_gemm as tg

    sig = {"a_desc": "tensordesc<bf16[128, 64]>", "b_desc": "tensordesc<bf16[256, 64]>", "c_ptr": "*bf16",
           **{k: v for k, v in _GEMM_ARGS.items() if k in ("tiles_ptr", "flags_ptr")},
           "ws_ptr": "*fp32", "ws_count_ptr": "*i32",
           **{k: v for k, v in _GEMM_ARGS.items() if k not in ("tiles_ptr", "flags_ptr")},
           "dp_tiles": "i32", "stride_cm": "i32", "stride_cn": "i32"}
    k = _compile(tg._gemm_tma_kernel, sig, dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, MODE=mode,
                                               B_T=True, STREAM_K=stream_k), num_warps=8, num_stages=4)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    # the spin-wait is a system-scope acquire load, the signal a system-scope release add
    assert ("ld.global.sys.acquire" in ptx) == (mode == 1 or stream_k)  # stream-K waits for partials too
    assert ("red.global.sys.release.add" in ptx) == (mode == 2)
    assert k.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("dtype,ieee", [("bf16", False), ("fp32", True)])
def test_pointer_gemm_compiles(dtype, ieee):
    from compass_fx.kernels import triton_gemm as tg

    sig = {"a_ptr": f"*{dtype}", "b_ptr": f"*{dtype}", "c_ptr": f"*{dtype}", **_GEMM_ARGS,
           **{s: "i32" for s in ("stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_cm", "stride_cn")}}
    cfg = tg.GemmConfig(128, 128, 32, 8, 8, 3) if ieee else tg.GemmConfig(128, 256, 64, 8, 8, 3)
    k = _compile(tg._gemm_kernel, sig, dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                           GROUP_M=8, MODE=1, EVEN_K=True, IEEE=ieee),
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert ("wgmma.mma_async" in k.asm["ptx"]) == (not ieee)
    assert k.metadata.shared <= 227 * 1024


def test_mover_and_adder_compile():
    from compass_fx.kernels import triton_gemm as tg

    k = _compile(tg._copy_piece_kernel, {"src_ptr": "*bf16", "src_flag_ptr": "*i32", "src_target": "i32",
                                         "dst_ptr": "*bf16", "dst_flag_ptr": "*i32", "n_elem": "i32"},
                 dict(BLOCK=tg.COPY_BLOCK), num_warps=4)
    assert "ld.global.sys.acquire" in k.asm["ptx"] and "red.global.sys.release.add" in k.asm["ptx"]
    k = _compile(tg._add_pieces_kernel, {"x_ptr": "*bf16", "x_flag_ptr": "*i32", "x_target": "i32",
                                         "y_ptr": "*bf16", "y_flag_ptr": "*i32", "y_target": "i32",
                                         "z_ptr": "*bf16", "z_flag_ptr": "*i32", "n_elem": "i32"},
                 dict(BLOCK=tg.COPY_BLOCK), num_warps=4)
    assert "ld.global.sys.acquire" in k.asm["ptx"] and "red.global.sys.release.add" in k.asm["ptx"]
