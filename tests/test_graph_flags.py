"""The CUDA source of the kernels that calls captured in CUDA graphs run (``graph_flags``)
compiles: NVRTC (NVIDIA's runtime compiler, from its wheel) needs no GPU, so a slip in the source
fails here rather than on the scarce GPU machine.  Which kernel a captured call runs for each copy
and flag is tested with the plans (``tests/test_protocol.py``)."""
from __future__ import annotations

import ctypes
import glob
import os
import re

import pytest

from compass_fx.kernels.cuda import graph_flags

def _nvrtc() -> ctypes.CDLL:
    try:
        import nvidia.cuda_nvrtc as wheel
    except ImportError:
        pytest.skip("no NVRTC wheel (nvidia-cuda-nvrtc-cu12, in the test extra)")
    found = sorted(glob.glob(os.path.join(list(wheel.__path__)[0], "lib", "libnvrtc.so*")))
    if not found:
        pytest.skip("the NVRTC wheel holds no libnvrtc.so")
    return ctypes.CDLL(found[0])


def _compile(source: str, arch: str = "compute_90", *extra: str) -> tuple[int, str, str]:
    """(NVRTC's result code, its log, the PTX) for ``source``."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"graph_flags.cu", 0, None, None) == 0
    flags = [f"--gpu-architecture={arch}", *extra]
    options = (ctypes.c_char_p * len(flags))(*[f.encode() for f in flags])
    result = lib.nvrtcCompileProgram(prog, len(flags), options)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    ptx = ""
    if result == 0:
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, buf)
        ptx = buf.value.decode()
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return result, log.value.decode(), ptx


def test_the_captured_calls_kernels_compile_for_hopper_in_one_module():
    """One compile of SOURCE holds every kernel under its own name (``graph_flags._functions``
    compiles and loads once): each is extern "C", and KERNELS lists them all."""
    declared = re.findall(r'(extern "C" )?__global__ void (\w+)', graph_flags.SOURCE)
    assert declared and all(extern for extern, _ in declared), declared
    assert sorted(name for _, name in declared) == sorted(graph_flags.KERNELS)
    result, log, ptx = _compile(graph_flags.SOURCE)
    assert result == 0, log
    for name in graph_flags.KERNELS:
        assert f".entry {name}(" in ptx, name
    assert "globaltimer" in ptx and "trap" in ptx  # the bounded wait reads the clock and stops on timeout


def test_a_slip_in_the_source_fails_the_check():
    result, log, _ = _compile(graph_flags.SOURCE + '\nextern "C" __global__ void slip(int* p) { *p = q; }\n')
    assert result != 0 and "undefined" in log


def test_the_device_launcher_compiles_as_relocatable_code_calling_the_device_runtime():
    """``device_launch``'s kernel: relocatable (the driver links it with libcudadevrt.a), its one
    call the device runtime's graph launch into the tail-launch stream, a refusal trapping."""
    from compass_fx.kernels.cuda import device_launch

    result, log, ptx = _compile(device_launch.LAUNCH_SOURCE, "compute_90", "-rdc=true")
    assert result == 0, log
    assert ".entry compass_tail_launch(" in ptx and ".extern .func" in ptx and "cudaGraphLaunch" in ptx
    assert "72057594037927936" in ptx  # cudaStreamGraphTailLaunch: the launcher's graph finishes first
    assert "trap" in ptx
