"""gloo has no float8 collectives ("Invalid scalar type"): torchao's float8 TP styles gather float8
data, so on gloo ranks these tests move those gathers' bytes as uint8, which is exactly what a
gather of float8 values is (a gather adds nothing up).

``float8_gathers_on_gloo()`` overrides the CPU kernel of ``_c10d_functional.all_gather_into_tensor``
while it is active (a synchronous gloo gather of the input's bytes; ``wait_tensor`` on its result
is then a no-op) and gives the original kernel back when it ends.  Tracing is untouched: it runs
the op's fake kernel.

``float8_gemms_as_cuda_takes_them()`` holds the CPU's float8 GEMMs to the layouts CUDA's take
(the CPU kernel takes any): A row-major, B column-major, row-wise scales of A with a last stride
of 1.  A rewrite that hands Inductor a part it lays out otherwise fails on the CPU as it would on
a GPU ("Only multiplication of row-major and column-major matrices is supported by cuBLASLt").
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _gather_bytes(inp: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    out = inp.new_empty((inp.shape[0] * group_size, *inp.shape[1:]))
    dist.all_gather_into_tensor(out.view(torch.uint8), inp.contiguous().view(torch.uint8),
                                group=_resolve_process_group(group_name))
    return out


@contextlib.contextmanager
def float8_gathers_on_gloo() -> Iterator[None]:
    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_gather_into_tensor", _gather_bytes, "CPU")
    try:
        yield
    finally:
        lib._destroy()


def _check_cuda_layouts(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor) -> None:
    if a.stride(1) != 1 or b.stride(0) != 1:
        raise AssertionError(f"float8 GEMM with A strides {a.stride()} (shape {tuple(a.shape)}) and B strides "
                             f"{b.stride()} (shape {tuple(b.shape)}): CUDA takes only a row-major A and a "
                             "column-major B")
    if scale_a.numel() > 1 and scale_a.stride(-1) != 1:
        raise AssertionError(f"float8 GEMM with row scales of A strided {scale_a.stride()}: CUDA takes only a "
                             "last stride of 1")


@contextlib.contextmanager
def float8_gemms_as_cuda_takes_them() -> Iterator[None]:
    """Inductor's float8 GEMMs (``extern_kernels._scaled_mm``, what its compiled code calls) check
    their operands' layouts first.  (A dispatch mode would see eager's too, but dynamo does not
    compile under one.)"""
    from torch._inductor.select_algorithm import extern_kernels

    original = extern_kernels._scaled_mm

    def checked(a, b, scale_a, *args, **kwargs):
        _check_cuda_layouts(a, b, scale_a)
        return original(a, b, scale_a, *args, **kwargs)

    extern_kernels._scaled_mm = checked
    try:
        yield
    finally:
        extern_kernels._scaled_mm = original
