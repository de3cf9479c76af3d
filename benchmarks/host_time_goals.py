"""Where issue 27's host-time goals stand across every committed run of the default fused path, run by
run (no GPU needed: it reads ``benchmarks/results/fused_host_time/``).

Why: one eager fused call's host time depends on the lent machine as much as on our code (the launch
of one ``torch.mm`` alone read 8-18 us on starts of the same kind of machine), so one run says little
about whether the goal holds.  This lists, for each run of the default path (calls issued from C, the
"direct" schedule, no setting changed but how the ranks wait), per world and transport: the card, the
host's launch of one ``torch.mm`` alone (how fast that start's host was), and for each form of the call
(``.graph``: four calls after the device went idle; steady: each call issued while the ones before it
run; between a step's ops) how many rows were within the goal (60 us at two ranks, 150 beyond) and the
worst row; then per world and transport how many runs had every row within the goal in each form, over
every card and on the H200 alone (the card the goals name), and where a form missed it in some run, how
the runs split by the host's speed.

    python benchmarks/host_time_goals.py      # writes benchmarks/results/host_time_goals/host_time_goals-cpu.*
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import output  # noqa: E402
from fused_host_time import GOAL_FORMS, goal_us  # noqa: E402
from fused_host_time import NAME as RUN_NAME  # noqa: E402
from results_index import machine_and_variant  # noqa: E402

NAME = "host_time_goals"
RUNS = output.RESULTS / RUN_NAME
# the forms of a call the goals are read in (fused_host_time's, less the back-to-back average, which
# the steady form and the first call after a wait split)
FORMS = tuple(form for form in GOAL_FORMS if form[0] != "host_us_back_to_back")
# settings a run may have and still be of the default path: the transport, the watchdog's timeout, how
# the ranks wait for the device (fused_host_time --sync)
NEUTRAL_SETTINGS = frozenset({"COMPASS_FUSED_TRANSPORT", "COMPASS_FUSED_TIMEOUT_S", "sync"})


def default_path(payload: dict) -> bool:
    """Whether a run measured the default path on the goals' cases: the steady form, calls issued from
    C, the direct schedule, no setting changed but the neutral ones, ``fused_host_time``'s default cases
    (a run of another set, ``--cases weights``, has other rows: its own markdown says where they stand)."""
    rows = payload.get("rows") or []
    return (payload.get("schedule", "direct") == "direct" and payload.get("cases", "default") == "default"
            and not set(payload.get("settings") or {}) - NEUTRAL_SETTINGS
            and any(r.get("host_us_steady") is not None and r.get("fast_path_calls") for r in rows))


def _median_ratio(rows: list[dict], top: str, bottom: str) -> "float | None":
    """The median over rows of ``top / bottom`` where a row has both (None where none has)."""
    ratios = [r[top] / r[bottom] for r in rows if r.get(top) is not None and r.get(bottom)]
    return statistics.median(ratios) if ratios else None


def run_rows(stem: str, payload: dict) -> list[dict]:
    """One row per world of a run: the card, when, the host's ``torch.mm`` launch alone, and per
    form the rows within the goal, the rows measured and the worst."""
    out = []
    for world in sorted({r["world"] for r in payload["rows"]}):
        rows = [r for r in payload["rows"] if r["world"] == world]
        env = payload.get("environment") or {}
        row = {"run": stem, "card": machine_and_variant(RUN_NAME, stem)[0], "world": world,
               "transport": payload.get("transport", "host"),
               "sync": (payload.get("settings") or {}).get("sync", "auto"),
               "date": str(env.get("date_utc", ""))[:10],
               "commit": str(env.get("commit") or "")[:7],
               "mm_launch_us": (payload.get("launch_us") or {}).get(str(world), {}).get("Matmul")}
        row["first_over_steady"] = _median_ratio(rows, "host_us_first_of_16", "host_us_steady")
        row["first_over_steady_mm"] = _median_ratio(rows, "host_us_first_of_16_mm", "host_us_steady_mm")
        for key, _ in FORMS:
            got = [r[key] for r in rows if r.get(key) is not None]
            row[f"{key}_within"] = sum(v <= goal_us(world) for v in got) if got else None
            row[f"{key}_rows"] = len(got) or None
            row[f"{key}_max"] = max(got) if got else None
        out.append(row)
    return out


def collect(folder: Path = RUNS) -> list[dict]:
    """Every default-path run's rows, by transport, world and the host's launch speed."""
    rows = []
    for path in sorted(folder.glob(f"{RUN_NAME}-*.json")):
        payload = json.loads(path.read_text())
        if default_path(payload):
            rows += run_rows(path.stem, payload)
    return sorted(rows, key=lambda r: (r["transport"], r["world"], r["mm_launch_us"] or 0.0, r["run"]))


def _groups(rows: list[dict]):
    """``(transport, world, its rows)`` for each transport and world of ``rows``, in that order."""
    for transport, world in sorted({(r["transport"], r["world"]) for r in rows}):
        yield transport, world, [r for r in rows if r["transport"] == transport and r["world"] == world]


def _measured(group: list[dict], key: str) -> list[dict]:
    """The runs of ``group`` that measured form ``key``."""
    return [r for r in group if r[f"{key}_rows"]]


def _all_within(run: dict, key: str) -> bool:
    """Whether every row that ``run`` measured in form ``key`` was within the goal."""
    return run[f"{key}_within"] == run[f"{key}_rows"]


def tally(rows: list[dict]) -> list[dict]:
    """Per transport and world: the runs, and per form how many had every row within the goal."""
    out = []
    for transport, world, group in _groups(rows):
        line = {"transport": transport, "world": world, "runs": len(group)}
        for key, _ in FORMS:
            measured = _measured(group, key)
            line[f"{key}_runs"] = len(measured)
            line[f"{key}_all_within"] = sum(_all_within(r, key) for r in measured)
        out.append(line)
    return out


def by_host_speed(rows: list[dict]) -> list[dict]:
    """Per transport, world and form where some run missed the goal: how the runs split by their host's
    speed (its launch of one ``torch.mm``), fastest first: how many of the fastest hosts had every row
    within (and the slowest of them), then from the first run that missed it on (and its host's
    speed), how many runs still had every row within.  A form met on every fast host and on no slow
    one is a property of the host, not the call."""
    out = []
    for transport, world, group in _groups([r for r in rows if r["mm_launch_us"] is not None]):
        group.sort(key=lambda r: r["mm_launch_us"])
        for key, label in FORMS:
            measured = _measured(group, key)
            met = [_all_within(r, key) for r in measured]
            if all(met):
                continue
            fast = met.index(False)
            out.append({"transport": transport, "world": world, "form": label, "fast_runs": fast,
                        "fast_up_to_us": measured[fast - 1]["mm_launch_us"] if fast else None,
                        "slower_runs": len(measured) - fast, "slower_within": sum(met[fast:]),
                        "slower_from_us": measured[fast]["mm_launch_us"]})
    return out


def host_speed_lines(splits: list[dict]) -> list[str]:
    """One line per split of ``by_host_speed``."""
    lines = []
    for s in splits:
        fast = (f"every row within on the {s['fast_runs']} fastest hosts (torch.mm launched in up to "
                f"{s['fast_up_to_us']:.1f} us)" if s["fast_runs"] else "not every row within on the fastest host")
        lines.append(f"* {s['transport']}, world {s['world']}, {s['form']}: {fast}; from the first that missed it "
                     f"({s['slower_from_us']:.1f} us) on, in {s['slower_within']} of {s['slower_runs']} runs.")
    return lines


GOAL_CARD = "h200"  # the card the goals name


def tally_lines(tallies: list[dict], prefix: str = "") -> list[str]:
    """One line per transport and world: per form, the runs with every row within the goal."""
    lines = []
    for t in tallies:
        parts = [f"{label} every row within in {t[f'{key}_all_within']} of {t[f'{key}_runs']} runs"
                 for key, label in FORMS if t[f"{key}_runs"]]
        lines.append(f"* {prefix}{t['transport']}, world {t['world']} ({t['runs']} runs): " + "; ".join(parts) + ".")
    return lines


def markdown(payload: dict) -> str:
    lines = [f"# {NAME} ({payload['tag']})", "",
             "Issue 27's host-time goals (one eager fused call: 60 us at two ranks, 150 at four and eight) in every "
             "committed `fused_host_time` run of the default path (calls issued from C, schedule direct, no setting "
             "changed but how the ranks wait), read from `benchmarks/results/fused_host_time/` on the CPU. "
             ".graph: four calls after the device went idle; steady: each issued while the ones before it run (as "
             "a step issues them); between a step's ops: each after a step's own eager ops. mm launch: that start's "
             "host launching one torch.mm alone (us): how fast the lent host was. First after a wait / steady: the first of 16 "
             "calls back to back (right after the wait for the device) over the steady ones, median over the rows, for "
             "the .graph call and for a plain torch.mm of the same operands timed in the same rounds (runs since "
             "fused_host_time timed it): how much slower this host runs any op right after a wait.", ""]
    lines += tally_lines(payload["tally"])
    if payload.get("by_host_speed"):
        lines += ["", "By the host's speed (the runs of each world and transport from the fastest host, by its "
                      "launch of one torch.mm alone), where some run missed the goal:", "",
                  *host_speed_lines(payload["by_host_speed"])]
    if payload.get("tally_goal_card"):
        lines += ["", f"On the {GOAL_CARD.upper()} alone (the card the goals name; the other runs had an H100):", "",
                  *tally_lines(payload["tally_goal_card"], f"{GOAL_CARD}: ")]
    lines.append("")
    table = [dict(r, **{f"{key}_cell": (f"{r[f'{key}_within']}/{r[f'{key}_rows']} (max {r[f'{key}_max']:.0f})"
                                         if r[f"{key}_rows"] else "-") for key, _ in FORMS})
             for r in payload["rows"]]
    lines.append(output.markdown_table(table, [
        "transport", "world", "card", "run", "date", "commit", "sync", ("mm_launch_us", "mm launch us"),
        *((f"{key}_cell", f"{label} within (max us)") for key, label in FORMS),
        ("first_over_steady", "first after a wait / steady: .graph"),
        ("first_over_steady_mm", "first after a wait / steady: torch.mm")]))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default=str(RUNS), help="the folder of fused_host_time results to read")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    rows = collect(Path(args.runs))
    payload = {"benchmark": NAME, "tag": args.tag, "rows": rows, "tally": tally(rows),
               "tally_goal_card": tally([r for r in rows if r["card"] == GOAL_CARD]),
               "by_host_speed": by_host_speed(rows),
               "environment": output.environment(True)}
    text = markdown(payload)
    output.write_results(NAME, args.tag, payload, text, args.out_dir)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
