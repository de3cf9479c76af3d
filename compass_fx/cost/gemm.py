"""How long one GEMM takes on one GPU: roofline plus tile/wave quantization plus fixed overheads.

Assumptions (each one a constant of :class:`~compass_fx.machine.gpus.GpuSpec`):

* The library tiles the m x n output into tiles of one of a few shapes; each SM computes one tile
  (or one K-slice of a tile, with split-K) per *wave*, and a GEMM takes ``ceil(units / SMs)``
  waves.  This is why each of ``parts`` parts of M costs more than 1/parts of the whole: a part
  with fewer tiles than SMs still pays a whole wave.  The library is assumed to pick the fastest
  tiling.
* A wave runs at the sustained per-SM rate (``efficiency`` of peak, times the tile's relative
  efficiency) plus a fixed ``wave_overhead_s`` (pipeline fill and epilogue).
* Memory: each operand is read once and the output written once at ``memory_efficiency`` of
  HBM bandwidth; split-K adds fp32 partials written and read back.  The GEMM takes the larger
  of compute and memory time (roofline), plus ``kernel_overhead_s`` per launch.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..machine.calibration import gpu_spec
from ..machine.gpus import GpuSpec, dtype_bytes


@dataclass(frozen=True)
class GemmTime:
    """A GEMM prediction, kept in parts so that the overlap model can slow each part separately."""

    compute_s: float
    memory_s: float
    overhead_s: float
    tile: tuple[int, int]
    waves: int
    split_k: int

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s) + self.overhead_s


def _check_dims(m: int, n: int, k: int) -> None:
    if type(m) is int and type(n) is int and type(k) is int and m > 0 and n > 0 and k > 0:
        return  # the common case, checked in one line (a fit prices millions of GEMMs)
    for name, value in (("m", m), ("n", n), ("k", k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"gemm {name} must be a positive int, got {value!r}")


_rates_of: dict[tuple[int, str], tuple] = {}  # (id(spec), dtype) -> (spec, element bytes, HBM B/s, flop/s per SM)


def _rates(spec: GpuSpec, dtype: str) -> tuple[int, float, float]:
    """What a GEMM's time needs of ``spec`` for ``dtype``, worked out once per spec object (the
    spec is kept in the entry, so an id cannot be reused by another spec while it is cached)."""
    key = (id(spec), dtype)
    entry = _rates_of.get(key)
    if entry is None or entry[0] is not spec:
        if len(_rates_of) > 256:
            _rates_of.clear()
        hbm = spec.hbm_gbps * 1e9 * spec.memory_efficiency
        entry = _rates_of[key] = (spec, dtype_bytes(dtype), hbm, spec.peak_flops(dtype) * spec.efficiency / spec.sms)
    return entry[1], entry[2], entry[3]


def gemm_time(m: int, n: int, k: int, dtype: str = "bfloat16", gpu: "str | GpuSpec" = "H200") -> GemmTime:
    """The model's breakdown for an (m x k) @ (k x n) GEMM."""
    return GemmTime(*_gemm(m, n, k, dtype, gpu))


def _gemm(m: int, n: int, k: int, dtype: str, gpu: "str | GpuSpec") -> tuple:
    """:class:`GemmTime`'s fields (a tuple: :func:`gemm_seconds` needs no object)."""
    _check_dims(m, n, k)
    spec = gpu_spec(gpu)
    elt, hbm, rate_sm = _rates(spec, dtype)
    sms, wave_overhead, max_split = spec.sms, spec.wave_overhead_s, spec.max_split_k
    best: tuple[float, tuple[int, int], int, int] | None = None
    for tm, tn, rel in spec.tiles:
        tiles = -(-m // tm) * -(-n // tn)  # ceilings of exact integer division
        split = 1
        while split <= max_split:
            # Split-K only to fill the machine (the choice depends on the tile count alone, which
            # keeps the model monotonic in k).
            if split == 1 or tiles * split <= 2 * sms:
                waves = -(-(tiles * split) // sms)
                per_wave = 2.0 * tm * tn * -(-k // split) / (rate_sm * rel) + wave_overhead
                t = waves * per_wave
                if split > 1:
                    t += m * n * 4 * (split + 1) / hbm
                if best is None or t < best[0]:
                    best = (t, (tm, tn), waves, split)
            split *= 2
    assert best is not None
    memory = (m * k + k * n + m * n) * elt / hbm
    return best[0], memory, spec.kernel_overhead_s, best[1], best[2], best[3]


def gemm_seconds(m: int, n: int, k: int, dtype: str = "bfloat16", gpu: "str | GpuSpec" = "H200") -> float:
    """Predicted seconds of one (m x k) @ (k x n) GEMM on ``gpu`` (a key of ``GPUS``)."""
    compute, memory, overhead = _gemm(m, n, k, dtype, gpu)[:3]
    return max(compute, memory) + overhead


def split_gemm_seconds(m: int, n: int, k: int, parts: int, dtype: str = "bfloat16",
                       gpu: "str | GpuSpec" = "H200") -> float:
    """Seconds of the same GEMM run as ``parts`` back-to-back GEMMs of m/parts rows each."""
    if not isinstance(parts, int) or parts < 1 or m % parts:
        raise ValueError(f"parts must be a positive divisor of m={m}, got {parts!r}")
    return parts * gemm_seconds(m // parts, n, k, dtype, gpu)
