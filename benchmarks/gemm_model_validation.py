"""Validate the GEMM model on one real GPU: GEMMs unsplit and split into d parts, measured
against the model's prediction.

* ``--shapes grid`` (default): the sweep grid's MLP GEMMs, d in {2, 4, 8, 16, 32}, each call
  timed from an idle GPU (thin parts then also pay the host's launches, as an issued
  decomposition does);
* ``--shapes tp8``: issue 11's set, the 16 TP = 8 Llama-3 8B / 70B projections (QKV, attention
  output, gate+up, down) at 4096 and 16384 tokens, d in {2, ..., 64}, in device time (calls
  queued behind a GPU sleep: what the model predicts); goal: split/unsplit ratio error median
  <= 10%, p90 <= 25%.

    python benchmarks/gemm_model_validation.py --out benchmarks/results/gemm_model_validation/gemm_model_validation-h200.json
    python benchmarks/gemm_model_validation.py --shapes tp8   # gemm_model_validation-h200-tp8.json
    python benchmarks/gemm_model_validation.py --dry-run      # a few small shapes on CPU
    python benchmarks/gemm_model_validation.py --reprice benchmarks/results/gemm_model_validation/gemm_model_validation-h200-tp8.json
                                                              # no GPU: the same measurements, the code's constants
    python benchmarks/gemm_model_validation.py --fit-jointly benchmarks/results/gemm_families/gemm_families-h200.json,\
        benchmarks/results/gemm_model_validation/gemm_model_validation-h200-tp8.json --held-out \
        benchmarks/results/gemm_model_validation/gemm_model_validation-h200-tp8.json  # how the built-in H200
                                  # constants were fitted: device time only (a families file gives its row splits)

Writes the JSON and a markdown file beside it.  Reports the median relative error on absolute
times and on split/unsplit ratios (the quantity InterDecom's choice of d depends on) for the
built-in constants, then fits the constants to the measurements
(compass_fx.cost.gemm_fit.fit_gpu_spec) and reports the fitted errors, in-sample and on held-out
shapes (fit on every other shape, test on the rest).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compass_fx.cost.gemm_fit import GemmMeasurement, fit_gpu_spec, model_errors  # noqa: E402
from compass_fx.machine.calibration import gpu_spec  # noqa: E402
from compass_fx.machine.gpus import gpu_name_from_device  # noqa: E402
from compass_fx.tools.calibrate import grid_shapes, measure_gemms  # noqa: E402
from harness.output import markdown_table  # noqa: E402

PARTS = (1, 2, 4, 8, 16, 32)
TP8_PARTS = (1, 2, 4, 8, 16, 32, 64)
TP8_MODELS = {"llama3-8b": (4096, 1024, 14336), "llama3-70b": (8192, 1024, 28672)}  # hidden, KV width, FFN
GOAL_MEDIAN, GOAL_P90 = 0.10, 0.25


def tp8_shapes(tokens=(4096, 16384), tp: int = 8) -> list[tuple[int, int, int]]:
    """(m, n, k) of each rank's GEMM: QKV (n = (H + 2 KV) / tp, k = H), attention output
    (n = H, k = H / tp), gate+up (n = 2 I / tp, k = H), down (n = H, k = I / tp)."""
    return [shape for hidden, kv, ffn in TP8_MODELS.values() for m in tokens
            for shape in ((m, (hidden + 2 * kv) // tp, hidden), (m, hidden, hidden // tp),
                          (m, 2 * ffn // tp, hidden), (m, hidden, ffn // tp))]


def _summary(errors: dict) -> dict:
    return {k: v for k, v in errors.items() if k != "rows"}


def _halves(meas: list) -> tuple[list, list]:
    """The measurements of every other shape (sorted by m, n, k), and those of the rest."""
    keys = sorted({(r.m, r.n, r.k) for r in meas})
    first = {s for i, s in enumerate(keys) if i % 2 == 0}
    return [r for r in meas if (r.m, r.n, r.k) in first], [r for r in meas if (r.m, r.n, r.k) not in first]


def evaluate(meas: list, spec, dtype: str, info: dict) -> dict:
    """The model's errors on ``meas`` with the constants ``spec`` (built in), fitted to all of
    them, and fitted to every other shape and tested on the rest; ``info``: what was measured."""
    builtin = model_errors(meas, spec, dtype)
    fitted_spec = fit_gpu_spec(meas, spec, dtype)
    fitted = model_errors(meas, fitted_spec, dtype)
    train, test = _halves(meas)
    train_spec = fit_gpu_spec(train, spec, dtype)
    holdout = model_errors(test, train_spec, dtype)
    result = dict(info, **{
        "builtin": {"constants": spec.to_dict(), **_summary(builtin)},
        "fitted_all": {"constants": fitted_spec.to_dict(), **_summary(fitted)},
        "fitted_holdout": {"constants": train_spec.to_dict(), **_summary(holdout),
                           "note": "fitted on every other shape, errors on the other half"},
        "rows": [dict(r, fitted_model_s=f["model_s"], fitted_ratio_error=f.get("ratio_error"))
                 for r, f in zip(builtin["rows"], fitted["rows"])],
    })
    if info.get("shapes_set") == "tp8" and not info.get("dry_run"):
        b = result["builtin"]
        result["goal"] = {"median_ratio_error <= 10%": b["median_ratio_error"] <= GOAL_MEDIAN,
                          "p90_ratio_error <= 25%": b["p90_ratio_error"] <= GOAL_P90}
    return result


def _measured(args, tp8: bool) -> tuple[list, str, str, dict]:
    """(measurements, GPU constants' name, dtype, what was measured) on this machine's GPU."""
    import torch

    parts = TP8_PARTS if tp8 else PARTS
    if args.dry_run:
        device, shapes, device_name = "cpu", [(256, 128, 64), (512, 256, 128)], "cpu (dry run)"
        gpu = args.gpu or "H200"
        dtype = "float32"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: use --dry-run on a CPU machine (or --reprice a committed file)")
        device, shapes, dtype = "cuda", tp8_shapes() if tp8 else grid_shapes(), "bfloat16"
        device_name = torch.cuda.get_device_name()
        gpu = args.gpu or gpu_name_from_device(device_name) or "H100"
    t0 = time.time()
    print(f"measuring {len(shapes)} shapes x parts {parts} on {device_name}", flush=True)
    meas = measure_gemms(shapes, parts, dtype=dtype, device=device, min_time_s=args.min_time, progress=True,
                         device_only=tp8)
    info = {"device": device_name, "gpu_constants": gpu, "dtype": dtype, "torch": torch.__version__,
            "python": platform.python_version(), "shapes_set": args.shapes, "dry_run": args.dry_run,
            "timing": "device time (queued calls)" if tp8 else "each call from an idle GPU (host launches included)",
            "parts": list(parts), "shapes": [list(s) for s in shapes], "measure_seconds": time.time() - t0}
    return meas, gpu, dtype, info


def _reprice(path: str) -> tuple[list, str, str, dict]:
    """The measurements of a committed result file, to price them with the code's constants."""
    with open(path) as fh:
        old = json.load(fh)
    meas = [GemmMeasurement(r["m"], r["n"], r["k"], r["parts"], r["measured_s"]) for r in old["rows"]]
    info = {k: v for k, v in old.items() if k not in ("builtin", "fitted_all", "fitted_holdout", "rows", "goal")}
    info.setdefault("shapes_set", "grid")
    if info["shapes_set"] == "grid":  # as _measured says of it (files measured before it did)
        info.setdefault("timing", "each call from an idle GPU (host launches included)")
    info["repriced_with_the_code_of"] = "this commit (measurements unchanged)"
    return meas, old["gpu_constants"], old["dtype"], info


def _fit_measurements(path: str) -> list:
    """A file's measurements for :func:`fit_jointly`: a result file of this script (every row), or
    a ``gemm_families.py`` file (its row splits, the split the fit models; its contraction splits
    are its analysis's out-of-sample check)."""
    with open(path) as fh:
        data = json.load(fh)
    if data.get("benchmark") == "gemm_families":
        return [GemmMeasurement(r["gemm_m"], r["gemm_n"], r["gemm_k"], r["parts"], r["seconds"])
                for r in data["rows"] if r["split"] == "rows"]
    return _reprice(path)[0]


def fit_jointly(paths: list[str], gpu: str = "H200", held_out: list[str] | None = None) -> dict:
    """The code's constants for ``gpu`` refitted to the measurements of all ``paths`` together
    (how the built-in H200 constants were derived), and an out-of-sample check per file of
    ``held_out`` (default every file): fitted to the other files and one half of its shapes, the
    errors on the other half (each such check is a fit of its own, ~15 s on 1600 measurements)."""
    sets = {path: _fit_measurements(path) for path in paths}
    every = [r for meas in sets.values() for r in meas]
    spec = gpu_spec(gpu)
    fitted = fit_gpu_spec(every, spec, rounds=2)
    out = {"constants": fitted.to_dict(), "in_sample": {}, "held_out_half": {}}
    for path, meas in sets.items():
        out["in_sample"][path] = _summary(model_errors(meas, fitted))
        if held_out is not None and path not in held_out:
            continue
        train, test = _halves(meas)
        others = [r for other, m in sets.items() if other != path for r in m]
        out["held_out_half"][path] = _summary(model_errors(test, fit_gpu_spec(others + train, spec, rounds=2)))
    return out


def markdown(result: dict, title: str) -> str:
    """The result as the markdown file beside its JSON: the three sets of constants' errors, the
    goal, then every measurement beside the model's price."""
    lines = [f"# {title}", "",
             f"{result.get('device')}; constants of {result.get('gpu_constants')}; {result.get('dtype')}; shapes "
             f"{result.get('shapes_set')}; timing: {result.get('timing', 'each call from an idle GPU')}.", "",
             markdown_table([dict(r, constants=name) for name, r in
                             ((n, result[n]) for n in ("builtin", "fitted_all", "fitted_holdout"))],
                            ["constants", ("median_abs_error", "median abs err"),
                             ("median_ratio_error", "median ratio err"), ("p90_ratio_error", "p90 ratio err")]),
             ""]
    lines += [f"* goal {goal} (built-in constants): {'met' if ok else 'NOT met'}" for goal, ok in
              result.get("goal", {}).items()]
    rows = [dict(r, measured_us=r["measured_s"] * 1e6, model_us=r["model_s"] * 1e6,
                 fitted_model_us=r["fitted_model_s"] * 1e6) for r in result["rows"]]
    lines += ["", markdown_table(rows, ["m", "n", "k", "parts", ("measured_us", "measured us"),
                                        ("model_us", "model us"), ("abs_error", "abs err"),
                                        ("fitted_model_us", "fitted model us"),
                                        ("fitted_ratio_error", "fitted ratio err")])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=("grid", "tp8"), default="grid",
                   help="the sweep grid's MLP GEMMs (host launches included), or issue 11's TP = 8 set in device time")
    p.add_argument("--out", default=None,
                   help="default benchmarks/results/gemm_model_validation/gemm_model_validation-h200.json (-tp8.json with --shapes tp8; "
                        "the file itself with --reprice)")
    p.add_argument("--reprice", default=None, metavar="FILE",
                   help="no GPU: price the measurements of a result file again with the code's constants")
    p.add_argument("--fit-jointly", default=None, metavar="FILES",
                   help="no GPU: refit the code's constants to these result files together (comma-separated) and "
                        "check each out of sample; prints JSON")
    p.add_argument("--held-out", default=None, metavar="FILES",
                   help="with --fit-jointly: the files (comma-separated) checked on a held-out half (default all)")
    p.add_argument("--gpu", default=None, help="GPU constants to compare with (default: from the device name)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, to check the script")
    p.add_argument("--min-time", type=float, default=0.02, help="seconds of repetitions per measurement")
    args = p.parse_args(argv)
    tp8 = args.shapes == "tp8"
    if args.fit_jointly:
        held_out = args.held_out.split(",") if args.held_out else None
        print(json.dumps(fit_jointly(args.fit_jointly.split(","), args.gpu or "H200", held_out), indent=1))
        return 0
    if args.reprice:
        meas, gpu, dtype, info = _reprice(args.reprice)
        args.out = args.out or args.reprice
    else:
        meas, gpu, dtype, info = _measured(args, tp8)
        args.out = args.out or f"benchmarks/results/gemm_model_validation/gemm_model_validation-h200{'-tp8' if tp8 else ''}.json"
    result = evaluate(meas, gpu_spec(gpu), dtype, info)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    md = os.path.splitext(args.out)[0] + ".md"
    with open(md, "w") as fh:
        fh.write(markdown(result, os.path.basename(os.path.splitext(args.out)[0])))
    for name in ("builtin", "fitted_all", "fitted_holdout"):
        r = result[name]
        print(f"{name:15s} median |abs err| {r['median_abs_error']:.3f}  median |ratio err| "
              f"{r['median_ratio_error']:.3f}  p90 ratio {r['p90_ratio_error']:.3f}")
    c = result["fitted_all"]["constants"]
    print(f"fitted: efficiency {c['efficiency']:.2f} kernel_overhead {c['kernel_overhead_s'] * 1e6:.2f}us "
          f"wave_overhead {c['wave_overhead_s'] * 1e6:.2f}us tiles {c['tiles']} max_split_k {c['max_split_k']}")
    for goal, ok in result.get("goal", {}).items():
        print(f"goal {goal} (built-in constants): {'met' if ok else 'NOT met'}")
    print(f"wrote {args.out} and {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
