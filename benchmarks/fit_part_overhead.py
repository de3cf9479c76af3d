"""InterDecom's per-part overhead fitted to the operator grids measured on a machine (no GPU needed).

Why: the decomposition model charges every extra part a software cost (``GpuSpec.part_overhead_s``,
the A term of T(d) = A*d + B + C/d).  The grids (``multigpu_operators.py``) measured every part
count of every pair; this script re-prices their decompose candidates with each value of the
constant and reports, per regime, the median and 90th percentile of |predicted - measured| /
measured, how often the model's best part count is within 3% of the best measured one, and
whether the picks of ``strategy="auto"`` change (hit rate, worst regression against sequential).
The value the cost model uses is the one that is best on both regimes together: the model's
part count most often within 3% of the best measured one, then the lowest median errors.

    python benchmarks/fit_part_overhead.py     # the committed h200x2 grids, both regimes
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import output  # noqa: E402

NAME = "part_overhead_fit"
CANDIDATE_US = (182, 120, 70, 50, 30, 20, 10, 5)


def _priced(overhead_s: float):
    """A context in which the cost model prices with ``part_overhead_s = overhead_s``."""
    import contextlib

    import compass_fx.cost.strategies as strategies

    @contextlib.contextmanager
    def patch():
        real = strategies.gpu_spec
        strategies.gpu_spec = lambda gpu: dataclasses.replace(real(gpu), part_overhead_s=overhead_s)
        try:
            yield
        finally:
            strategies.gpu_spec = real
    return patch()


def evaluate(grid: dict, overhead_s: float) -> dict:
    """The decompose predictions and the picks of one grid priced with ``overhead_s``."""
    from compass_fx.cost import Workload, plan
    from compass_fx.cost.decision import SCHEDULES
    from compass_fx.machine.topology import Topology

    topo = Topology.from_dict(grid["topology"]["2"]["description"])
    fused = tuple(grid["topology"]["2"].get("fused_schedules") or SCHEDULES)
    errors, d_hits, pick_hits, regressions = [], 0, 0, []
    with _priced(overhead_s):
        for row in grid["rows"]:
            measured = {label: c["measured_s"] for label, c in row["candidates"].items() if c.get("measured_s")}
            w = Workload(row["kind"], row["m"], row["n"], row["k"], "bfloat16", row["group_size"])
            decision = plan(w, topo, fused_schedules=fused)
            decomposed = [c for c in decision.candidates if c.strategy == "decompose" and c.label in measured]
            errors += [abs(c.seconds - measured[c.label]) / measured[c.label] for c in decomposed]
            model_d = min(decomposed, key=lambda c: c.seconds)
            d_hits += measured[model_d.label] <= 1.03 * min(measured[c.label] for c in decomposed)
            picked = measured.get(decision.label)
            if picked is not None:
                pick_hits += picked <= 1.03 * min(measured.values())
                regressions.append(picked / measured["sequential"] - 1)
    n = len(grid["rows"])
    return {"decompose_median_error": statistics.median(errors),
            "decompose_p90_error": sorted(errors)[int(0.9 * (len(errors) - 1))],
            "model_d_within_3pct": d_hits / n, "pick_hit_rate": pick_hits / n,
            "worst_regression_vs_sequential": max(regressions)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grids", default="multigpu_operators-h200x2.json,multigpu_operators-h200x2-hoststaged.json",
                   help="grid JSON files under --results")
    p.add_argument("--results", default=str(output.RESULTS), help="where the grids are")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    p.add_argument("--tag", default="h200x2")
    args = p.parse_args(argv)
    grids = {name: json.loads((Path(args.results) / name).read_text()) for name in args.grids.split(",")}
    rows = [{"grid": name, **evaluate(grid, us * 1e-6), "part_overhead_us": us}
            for us in CANDIDATE_US for name, grid in grids.items()]
    by_value = {us: [r for r in rows if r["part_overhead_us"] == us] for us in CANDIDATE_US}
    # issue 11's measure first (the model's d within 3% of the best measured d), then the errors
    best = max(CANDIDATE_US, key=lambda us: (statistics.mean(r["model_d_within_3pct"] for r in by_value[us]),
                                             -statistics.mean(r["decompose_median_error"] for r in by_value[us])))
    payload = {"benchmark": NAME, "grids": list(grids), "rows": rows, "best_part_overhead_us": best,
               "calibration": os.environ.get("COMPASS_FX_CALIBRATION")}
    lines = [f"# InterDecom's per-part overhead fitted to the operator grids ({args.tag})", "",
             f"Grids: {', '.join(grids)}; calibration: {payload['calibration'] or 'none (datasheet)'}.  "
             f"Best (the model's d most often within 3% of the best measured d, then the lowest median "
             f"errors, both regimes together): **{best} us**.", "",
             output.markdown_table(rows, ["grid", ("part_overhead_us", "us"), ("decompose_median_error", "median err"),
                                          ("decompose_p90_error", "p90 err"), ("model_d_within_3pct", "model d ok"),
                                          ("pick_hit_rate", "pick hit rate"),
                                          ("worst_regression_vs_sequential", "worst regression")])]
    print("\n".join(lines))
    output.write_results(NAME, args.tag, payload, "\n".join(lines), args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
