"""Validate the GEMM model on one real GPU: the sweep grid's GEMMs, unsplit and split into
d in {2, 4, 8, 16, 32} parts, measured against the model's prediction.

    python benchmarks/gemm_model_validation.py --out benchmarks/results/gemm_model_validation-h200.json
    python benchmarks/gemm_model_validation.py --dry-run      # a few small shapes on CPU

Reports the median relative error on absolute times and on split/unsplit ratios (the quantity
InterDecom's choice of d depends on) for the built-in constants, then fits the constants to the
measurements (compass_fx.cost.gemm_fit.fit_gpu_spec) and reports the fitted errors, in-sample and
on held-out shapes (fit on every other shape, test on the rest).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from compass_fx.cost.gemm_fit import fit_gpu_spec, model_errors  # noqa: E402
from compass_fx.machine.calibration import gpu_spec  # noqa: E402
from compass_fx.machine.gpus import gpu_name_from_device  # noqa: E402
from compass_fx.tools.calibrate import grid_shapes, measure_gemms  # noqa: E402

PARTS = (1, 2, 4, 8, 16, 32)


def _summary(errors: dict) -> dict:
    return {k: v for k, v in errors.items() if k != "rows"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/gemm_model_validation-h200.json")
    p.add_argument("--gpu", default=None, help="GPU constants to compare with (default: from the device name)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, to check the script")
    p.add_argument("--min-time", type=float, default=0.02, help="seconds of repetitions per measurement")
    args = p.parse_args(argv)

    import torch

    if args.dry_run:
        device, shapes, device_name = "cpu", [(256, 128, 64), (512, 256, 128)], "cpu (dry run)"
        gpu = args.gpu or "H200"
        dtype = "float32"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --dry-run on a CPU machine", file=sys.stderr)
            return 2
        device, shapes, dtype = "cuda", grid_shapes(), "bfloat16"
        device_name = torch.cuda.get_device_name()
        gpu = args.gpu or gpu_name_from_device(device_name) or "H100"
    spec = gpu_spec(gpu)
    t0 = time.time()
    print(f"measuring {len(shapes)} shapes x parts {PARTS} on {device_name}", flush=True)
    meas = measure_gemms(shapes, PARTS, dtype=dtype, device=device, min_time_s=args.min_time, progress=True)
    measure_s = time.time() - t0

    builtin = model_errors(meas, spec, dtype)
    fitted_spec = fit_gpu_spec(meas, spec, dtype)
    fitted = model_errors(meas, fitted_spec, dtype)
    keys = sorted({(r.m, r.n, r.k) for r in meas})
    train = {s for i, s in enumerate(keys) if i % 2 == 0}
    train_spec = fit_gpu_spec([r for r in meas if (r.m, r.n, r.k) in train], spec, dtype)
    holdout = model_errors([r for r in meas if (r.m, r.n, r.k) not in train], train_spec, dtype)

    result = {
        "device": device_name, "gpu_constants": gpu, "dtype": dtype, "torch": torch.__version__,
        "python": platform.python_version(), "parts": list(PARTS), "shapes": [list(s) for s in shapes],
        "measure_seconds": measure_s,
        "builtin": {"constants": spec.to_dict(), **_summary(builtin)},
        "fitted_all": {"constants": fitted_spec.to_dict(), **_summary(fitted)},
        "fitted_holdout": {"constants": train_spec.to_dict(), **_summary(holdout),
                           "note": "fitted on every other shape, errors on the other half"},
        "rows": [dict(r, fitted_model_s=f["model_s"], fitted_ratio_error=f.get("ratio_error"))
                 for r, f in zip(builtin["rows"], fitted["rows"])],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    for name in ("builtin", "fitted_all", "fitted_holdout"):
        r = result[name]
        print(f"{name:15s} median |abs err| {r['median_abs_error']:.3f}  median |ratio err| "
              f"{r['median_ratio_error']:.3f}  p90 ratio {r['p90_ratio_error']:.3f}")
    c = fitted_spec
    print(f"fitted: efficiency {c.efficiency:.2f} kernel_overhead {c.kernel_overhead_s * 1e6:.2f}us "
          f"wave_overhead {c.wave_overhead_s * 1e6:.2f}us tiles {c.tiles} max_split_k {c.max_split_k}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
