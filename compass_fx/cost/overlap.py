"""How much a GEMM slows down while communication runs beside it on the same GPU.

Two effects, both assumptions stated as numbers:

* **SMs taken.** A communication kernel (NCCL's, ``GpuSpec.nccl_sms`` of them) occupies SMs, so
  the GEMM's tiles run on fewer: the GEMM model is re-evaluated with that many SMs, which also
  re-does its wave quantization.  The fused operators are assumed to move data with the copy
  engine (symmetric-memory puts and gets) and take no SMs.
* **Memory bandwidth taken.** Every byte a GPU sends is read from its HBM and every byte it
  receives is written to it; that traffic (``comm_hbm_bytes_per_s``) is subtracted from the
  bandwidth the GEMM's own reads and writes get.
"""
from __future__ import annotations

from ..machine.calibration import gpu_spec
from ..machine.gpus import GpuSpec, with_overrides
from .gemm import GemmTime, gemm_time

# The GEMM never gets less than this share of HBM bandwidth, however busy the links are.
MIN_MEMORY_SHARE = 0.25


def overlapped_gemm_time(m: int, n: int, k: int, dtype: str, gpu: "str | GpuSpec",
                         comm_sms: int = 0, comm_hbm_bytes_per_s: float = 0.0) -> GemmTime:
    """The GEMM model's prediction while communication takes ``comm_sms`` SMs and
    ``comm_hbm_bytes_per_s`` of memory bandwidth."""
    spec = gpu_spec(gpu)
    if not 0 <= comm_sms < spec.sms:
        raise ValueError(f"comm_sms must be in [0, {spec.sms}), got {comm_sms!r}")
    if comm_hbm_bytes_per_s < 0:
        raise ValueError(f"comm_hbm_bytes_per_s must be >= 0, got {comm_hbm_bytes_per_s!r}")
    left = spec.sms - comm_sms
    reduced = with_overrides(spec, sms=left,
                             peak_tflops={c: v * left / spec.sms for c, v in spec.peak_tflops.items()})
    base = gemm_time(m, n, k, dtype, reduced)
    hbm = spec.hbm_gbps * 1e9 * spec.memory_efficiency
    share = max(MIN_MEMORY_SHARE, 1.0 - comm_hbm_bytes_per_s / hbm)
    return GemmTime(base.compute_s, base.memory_s / share, base.overhead_s, base.tile, base.waves, base.split_k)


def slowdown(m: int, n: int, k: int, dtype: str, gpu: "str | GpuSpec", comm_sms: int = 0,
             comm_hbm_bytes_per_s: float = 0.0) -> float:
    """Overlapped time over stand-alone time (>= 1)."""
    alone = gemm_time(m, n, k, dtype, gpu).seconds
    return overlapped_gemm_time(m, n, k, dtype, gpu, comm_sms, comm_hbm_bytes_per_s).seconds / alone
