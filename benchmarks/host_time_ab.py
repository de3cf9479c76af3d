"""Compare ``fused_host_time`` runs taken in turns: per case, each run's host time and period over the
first run's, and how far the cases whose plans did not change moved (the noise of that machine start).

Why: the lent hosts drift 1.5-2x between runs of the same code, so a change reads as a ratio only
against the spread of the cases it did not touch.  A case's plan counts as changed where its plan
digest (``fused_host_time``'s ``plan_digest``: the commands in order) differs from the base run's,
for runs without one where its commands by kind differ; ``--changed OPS`` names the operators a
change touched instead.  The spread of the unchanged cases' ratios is printed beside the changed.

    python benchmarks/host_time_ab.py h200-rs-ag-allreduce-ab3-host-pin-mps50 h200-pair-allreduce-ab3-host-pin-mps50

Each argument is a run's tag (``fused_host_time-<tag>.json`` under benchmarks/results/fused_host_time)
or a path to its JSON; the first is the base.  Prints a markdown table (``--json`` for the rows).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "fused_host_time"


def load(run: str) -> dict:
    """A run's payload, by tag or path."""
    path = Path(run)
    if not path.suffix == ".json":
        path = RESULTS / f"fused_host_time-{run}.json"
    if not path.is_file():
        raise SystemExit(f"no fused_host_time result at {path}")
    return json.loads(path.read_text())


def _case(row: dict) -> tuple:
    return row["world"], row["op"], row["rows"]


def plan_changed(base: dict, other: dict, changed_ops: frozenset[str] = frozenset()) -> bool:
    """Whether ``other``'s plan for a case differs from ``base``'s (see the module's docstring)."""
    if changed_ops:
        return base["op"] in changed_ops
    if "plan_digest" in base and "plan_digest" in other:
        return base["plan_digest"] != other["plan_digest"]
    return base["commands"] != other["commands"]


def compare(runs: list[dict], changed_ops: frozenset[str] = frozenset()) -> dict:
    """Per case present in every run: each run's commands, .graph host time and period, their ratios
    to the base (``runs[0]``), and whether the plan changed; and per run the spread (min, median,
    max) of the unchanged cases' ratios."""
    base = {_case(r): r for r in runs[0]["rows"]}
    others = [{_case(r): r for r in run["rows"]} for run in runs[1:]]
    cases = [c for c in base if all(c in o for o in others)]
    rows, unchanged = [], [{"host": [], "period": []} for _ in others]
    for case in cases:
        b = base[case]
        row = {"world": case[0], "op": case[1], "rows": case[2], "commands": [sum(b["commands"].values())],
               "host_us": [b["host_us_graph"]], "period_us": [b["period_us"]], "host_ratio": [], "period_ratio": [],
               "changed": []}
        for i, other in enumerate(others):
            o = other[case]
            host, period = o["host_us_graph"] / b["host_us_graph"], o["period_us"] / b["period_us"]
            changed = plan_changed(b, o, changed_ops)
            row["commands"].append(sum(o["commands"].values()))
            row["host_us"].append(o["host_us_graph"])
            row["period_us"].append(o["period_us"])
            row["host_ratio"].append(host)
            row["period_ratio"].append(period)
            row["changed"].append(changed)
            if not changed:
                unchanged[i]["host"].append(host)
                unchanged[i]["period"].append(period)
        rows.append(row)
    spread = [{k: (min(v), statistics.median(v), max(v)) if v else None for k, v in u.items()} for u in unchanged]
    return {"runs": [r.get("tag", "?") for r in runs], "changed_ops": sorted(changed_ops),
            "packages": [r.get("environment", {}).get("package") for r in runs], "rows": rows, "unchanged": spread}


def markdown(result: dict) -> str:
    tags = result["runs"]
    lines = [f"Base: `{tags[0]}`; against it: " + ", ".join(f"`{t}`" for t in tags[1:]) + ".", "",
             "| world | op | rows | commands | .graph host us | period us | host / base | period / base |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        mark = ["*" if c else "" for c in r["changed"]]
        lines.append(f"| {r['world']} | {r['op']} | {r['rows']} | {' / '.join(map(str, r['commands']))} | "
                     + " / ".join(f"{v:.0f}" for v in r["host_us"]) + " | "
                     + " / ".join(f"{v:.0f}" for v in r["period_us"]) + " | "
                     + " / ".join(f"{v:.3f}{m}" for v, m in zip(r["host_ratio"], mark)) + " | "
                     + " / ".join(f"{v:.3f}{m}" for v, m in zip(r["period_ratio"], mark)) + " |")
    lines += ["", "`*`: the plan changed (" + (f"the operators named: {', '.join(result['changed_ops'])}"
                                               if result.get("changed_ops") else "its commands differ from the base run's")
              + ")."]
    for tag, spread in zip(tags[1:], result["unchanged"]):
        if spread["period"] is None:
            lines.append(f"`{tag}`: every case's plan changed (no noise reference in this run).")
            continue
        (hl, hm, hh), (pl, pm, ph) = spread["host"], spread["period"]
        lines.append(f"`{tag}`, the unchanged cases (the noise between these runs): host {hl:.3f}-{hh:.3f} "
                     f"(median {hm:.3f}), period {pl:.3f}-{ph:.3f} (median {pm:.3f}).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="tags (or JSON paths) of fused_host_time runs; the first is the base")
    p.add_argument("--changed", default="", help="the operators the change touched, comma-separated "
                                                 "(default: told from each case's plan digest or commands)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    args = p.parse_args(argv)
    if len(args.runs) < 2:
        raise SystemExit("give a base run and at least one run to compare with it")
    changed = frozenset(op.strip() for op in args.changed.split(",") if op.strip())
    result = compare([load(r) for r in args.runs], changed)
    print(json.dumps(result, indent=1) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
