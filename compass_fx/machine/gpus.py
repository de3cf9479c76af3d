"""GPU datasheets: per-GPU constants for the GEMM and overlap models, and the dtypes they price.

The figures are datasheet peaks (dense, no sparsity) times a sustained fraction that cuBLAS
reaches on large GEMMs; the sustained fraction, the per-kernel overhead and the per-wave overhead
are what ``compass-fx calibrate`` re-fits on a real GPU (``machine.calibration`` applies the
fitted figures).  Everything here is plain data so that every rank computes the same predictions.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

# uint8 / int8: what a collective moves when it gathers float8 data as its bytes (gloo has no float8
# collectives; Transformer Engine keeps float8 data in uint8 tensors); the GEMMs then run in float8.
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "uint8": 1, "int8": 1}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32", "fp64": "float64", "double": "float64", "fp8": "float8_e4m3fn"}


def canonical_dtype(dtype: object) -> str:
    """``torch.bfloat16``, ``"torch.bfloat16"``, ``"bf16"`` -> ``"bfloat16"``; ValueError if unknown."""
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return name


def dtype_bytes(dtype: object) -> int:
    return DTYPE_BYTES[canonical_dtype(dtype)]


@dataclass(frozen=True)
class GpuSpec:
    """What the models need to know about one GPU model.

    ``peak_tflops`` maps a dtype class (``"16bit"``, ``"fp32"``, ``"fp8"``) to the dense tensor-core
    peak.  ``efficiency`` is the fraction of that peak a large, well-shaped cuBLAS GEMM sustains
    per SM; ``tiles`` lists the output tile shapes (rows, cols, relative efficiency) the library
    chooses between, so that a GEMM with few tiles leaves SMs idle (wave quantization).
    """

    name: str
    sms: int
    peak_tflops: dict[str, float]
    hbm_gbps: float
    efficiency: float = 0.8
    memory_efficiency: float = 0.85
    kernel_overhead_s: float = 4e-6
    wave_overhead_s: float = 1e-6
    tiles: tuple[tuple[int, int, float], ...] = ((128, 256, 1.0), (128, 128, 0.9), (64, 128, 0.7))
    max_split_k: int = 4
    nccl_sms: int = 16
    pcie_gen: int = 4
    # Software cost of each extra InterDecom part beyond its GEMM: one more collective launched
    # and waited on through the functional-collective runtime, plus the row-shuffle kernels.
    part_overhead_s: float = 10e-6
    # The same when the step replays as CUDA graphs: no host issue, only the device's cost of one
    # more collective and GEMM launch in the stream.
    graph_part_overhead_s: float = 5e-6
    # The same in an eager step whose decomposed gather replays its parts' gathers from one CUDA
    # graph (lowering.parts_replay): the host issues one GEMM and one event wait per extra part.
    # Never below the graph's (the device's cost is the same); without a measurement, the graph's
    # plus 0.4 of what issuing adds to it (the replayed/issued host ratio measured on an H200).
    replayed_part_overhead_s: float = 7e-6
    source: str = "datasheet"

    def peak_flops(self, dtype: str) -> float:
        dt = canonical_dtype(dtype)
        cls = {"float32": "fp32", "float64": "fp64"}.get(dt, "fp8" if dt.startswith("float8") else "16bit")
        fallback = self.peak_tflops["fp32"] if cls == "fp64" else self.peak_tflops["16bit"]
        return self.peak_tflops.get(cls, fallback) * 1e12

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tiles"] = [list(t) for t in self.tiles]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "GpuSpec":
        d = dict(d)
        if "tiles" in d:
            d["tiles"] = tuple(tuple(t) for t in d["tiles"])
        return cls(**d)


# Hopper's cuBLAS picks among many tile shapes (its kernels are named nvjet_sm90_tst_192x128,
# _320x128, _64x64 ...), so it loses far less to wave quantization than a model with three tiles
# predicts for thin parts.  The seven tile shapes, their relative efficiencies, the overheads and
# split-K are fitted jointly to two sets of bf16 GEMMs measured in device time on one H200 (the
# row splits into 2-8 parts of benchmarks/results/gemm_families/gemm_families-h200.json: 8 model
# families, TP 2/4/8, 2048-16384 tokens; and issue 11's 16 TP = 8 Llama-3 projections split into
# 1-64 parts, gemm_model_validation-h200-tp8.json).  The sweep grid's gemm_model_validation-h200.json
# is left out: it timed each call from an idle GPU, the host's launch latency included (1.08-1.52x
# the device-time files' times on the GEMMs they share), while the model predicts device time.
# `gemm_model_validation.py --fit-jointly` refits them and tests/test_bench_scripts.py checks that
# it gives these.  The H100 is the same processor.
# part_overhead_s, the software cost the decomposition model charges per extra part in the default
# (eager) mode, is fitted to every decompose candidate of the two world-2 operator grids measured
# on two H200s (benchmarks/fit_model_constants.py -> results/model_constants_fit/): it is mostly the
# host's issue of each part's launches, which an eager step pays while the host keeps ahead of the
# GPU.  Under CUDA graphs (Inductor's "reduce-overhead") that issue is gone: graph_part_overhead_s
# is the median device cost per extra part measured by benchmarks/decompose_overhead.py in that mode.
# replayed_part_overhead_s prices a part whose gather is replayed from one CUDA graph (the default on
# NCCL) in that eager step: part_overhead_s scaled by what replaying saves of an extra part's host
# issue in one run, the larger ratio of two (parts_replay_ranks-h200-mps, 2 NCCL ranks: 26.9 us
# replayed / 93.4 issued = 0.29; the run before it 29.0 / 72.7 = 0.40), so 50 us x 0.4 = 20 us.
_HOPPER = dict(sms=132, peak_tflops={"16bit": 989.0, "fp32": 67.0, "fp8": 1979.0}, pcie_gen=5,
               efficiency=0.84, kernel_overhead_s=3.0e-6, wave_overhead_s=0.6e-6, max_split_k=1,
               part_overhead_s=50e-6, graph_part_overhead_s=4.4e-6, replayed_part_overhead_s=20e-6,
               tiles=((128, 256, 1.0), (256, 128, 1.0), (192, 128, 1.0), (128, 128, 0.95), (128, 64, 0.95),
                      (64, 128, 0.55), (64, 64, 1.0)), source="fitted on an H200")

GPUS: dict[str, GpuSpec] = {
    "H100": GpuSpec("H100", hbm_gbps=3350.0, **_HOPPER),
    "H200": GpuSpec("H200", hbm_gbps=4800.0, **_HOPPER),
    "A100": GpuSpec("A100", sms=108, peak_tflops={"16bit": 312.0, "fp32": 19.5}, hbm_gbps=2039.0,
                    tiles=((128, 256, 1.0), (128, 128, 0.92), (64, 128, 0.75)), nccl_sms=16),
    "A6000": GpuSpec("A6000", sms=84, peak_tflops={"16bit": 154.8, "fp32": 38.7}, hbm_gbps=768.0,
                     efficiency=0.75, tiles=((128, 128, 1.0), (128, 64, 0.9), (64, 64, 0.7)),
                     nccl_sms=8),
    "L40S": GpuSpec("L40S", sms=142, peak_tflops={"16bit": 362.0, "fp32": 91.6, "fp8": 733.0},
                    hbm_gbps=864.0, efficiency=0.7,
                    tiles=((128, 128, 1.0), (128, 64, 0.9), (64, 64, 0.7)), nccl_sms=8),
    "RTX4090": GpuSpec("RTX4090", sms=128, peak_tflops={"16bit": 165.2, "fp32": 82.6, "fp8": 330.3},
                       hbm_gbps=1008.0, efficiency=0.75,
                       tiles=((128, 128, 1.0), (128, 64, 0.9), (64, 64, 0.7)), nccl_sms=8),
}

_NAME_HINTS = (("H200", "H200"), ("H100", "H100"), ("H800", "H100"), ("A100", "A100"),
               ("A800", "A100"), ("A6000", "A6000"), ("L40S", "L40S"), ("4090", "RTX4090"))


def gpu_name_from_device(device_name: str) -> str | None:
    """Map a driver name ("NVIDIA H200", "NVIDIA RTX A6000") to a key of GPUS, or None."""
    upper = device_name.upper()
    for hint, key in _NAME_HINTS:
        if hint in upper:
            return key
    return None


def with_overrides(spec: GpuSpec, **fields) -> GpuSpec:
    """A copy of ``spec`` with some constants replaced (used by calibration fits)."""
    return replace(spec, **fields)
