"""What the test suite costs, module by module, on this machine's CPU: where CI's 10 minutes go.

CI runs the whole suite on two cores (``.ci/run``) and must finish within 10 minutes; sessions have
measured it at 8-10.  Cutting it starts with knowing where the CPU goes, which the suite under
``pytest -n 2`` does not say (two workers and their rank processes share the cores).  This runs
each test module alone, one after another, in one fresh ``TMPDIR`` and ``TORCH_EXTENSIONS_DIR``
(Inductor's caches and the fast path's build cold at the start, then shared, as in one CI run),
and reports per module:

* the machine's busy CPU seconds while it ran (``/proc/stat``: run it on an otherwise idle
  machine) and its wall seconds; their sum over the modules is the CPU a CI run must fit in
  2 cores x 10 minutes;
* pytest's outcome and the module's slowest tests (``--durations``);
* the g++ builds it started, by kind: Inductor's kernels (about 0.7 s each on 2 cores, most of it
  loading Inductor's precompiled header), that header, the fast path's extension and the rest.  A
  wrapper named ``g++`` (Inductor names its precompiled header for gcc only when the compiler's
  name says gcc) is put in ``CXX`` (replacing any set before: the g++ on ``PATH`` builds, as it
  does by default for Inductor and for torch's extension builder) and logs every call.

    python benchmarks/suite_cost.py                          # every tests/test_*.py: ~18 min on 2 cores
    python benchmarks/suite_cost.py tests/test_cli.py --tag cpu-cli

``--collector`` adds, per module, the seconds every Python process spent in the garbage collector
(a ``sitecustomize`` put first on ``PYTHONPATH`` times each collection through ``gc.callbacks``;
it replaces any other ``sitecustomize`` for the run), and ``--collector-defaults`` runs the tests
with CPython's own collector settings instead of ``tests/gc_tuning.py``'s: the two in turns say
what that setting saves.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import output  # noqa: E402
from harness.deadline import run_until  # noqa: E402

NAME = "suite_cost"
ROOT = Path(__file__).resolve().parent.parent
BUILD_KINDS = ("Inductor kernel", "precompiled header", "fast path extension", "other")

_WRAPPER = """#!/usr/bin/env bash
# g++, timed: each call's milliseconds and arguments appended to $COMPASS_SUITE_GXX_LOG
start=$(date +%s%N)
{real} "$@"
status=$?
echo "$(( ($(date +%s%N) - start) / 1000000 )) $*" >> "$COMPASS_SUITE_GXX_LOG"
exit $status
"""


def timed_compiler(folder: Path) -> Path | None:
    """A ``g++`` in ``folder`` that runs this machine's g++ and appends each call's milliseconds and
    arguments to ``$COMPASS_SUITE_GXX_LOG``; None where there is no g++ (nothing is built then)."""
    real = shutil.which("g++")
    if real is None:
        return None
    wrapper = folder / "g++"
    wrapper.write_text(_WRAPPER.format(real=shlex.quote(real)))
    wrapper.chmod(0o755)
    return wrapper


_GC_HOOK = """# suite_cost's collector timing: each process adds the seconds of its collections to its own file
import atexit, gc, os, time

_folder = os.environ.get("COMPASS_SUITE_GC_LOG")
if _folder:
    _state = {"seconds": 0.0, "count": 0, "start": 0.0, "written": 0.0}

    def _forked():  # a forked rank starts its own count, not its server's
        _state.update(seconds=0.0, count=0, written=0.0)

    def _write():
        with open(os.path.join(_folder, str(os.getpid())), "w") as f:
            f.write(f"{_state['seconds']} {_state['count']}\\n")

    def _timed(phase, info):
        now = time.perf_counter()
        if phase == "start":
            _state["start"] = now
            return
        _state["seconds"] += now - _state["start"]
        _state["count"] += 1
        if now - _state["written"] > 0.2:  # ranks end by os._exit: no atexit, so write as it goes
            _state["written"] = now
            _write()

    gc.callbacks.append(_timed)
    os.register_at_fork(after_in_child=_forked)
    atexit.register(_write)
"""


def collector_seconds(folder: Path) -> dict[str, float | int]:
    """The collections the hook logged in ``folder``: seconds and count over every process, and
    how many processes collected."""
    seconds, count = 0.0, 0
    files = list(folder.iterdir()) if folder.exists() else []
    for f in files:
        s, c = f.read_text().split()
        seconds, count = seconds + float(s), count + int(c)
    return {"seconds": seconds, "collections": count, "processes": len(files)}


def busy_cpu_s() -> float | None:
    """The machine's busy CPU seconds since boot (user, nice, system, irq, softirq, steal), or None
    where ``/proc/stat`` is missing."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def build_kind(args: str) -> str:
    """Which of :data:`BUILD_KINDS` a g++ call with these arguments is."""
    if "-x c++-header" in args or "/header.hpp " in args:  # the header built, or read for its hash
        return "precompiled header"
    if "compass_lane" in args or "lane.cpp" in args:
        return "fast path extension"
    if re.search(r"torchinductor\S*\.cpp\b", args):
        return "Inductor kernel"
    return "other"


def builds(log: Path) -> dict[str, dict[str, float]]:
    """Per build kind, how many g++ calls the wrapper logged and their wall seconds."""
    got = {kind: {"count": 0, "seconds": 0.0} for kind in BUILD_KINDS}
    if log.exists():
        for line in log.read_text().splitlines():
            ms, _, args = line.partition(" ")
            entry = got[build_kind(args)]
            entry["count"] += 1
            entry["seconds"] += int(ms) / 1000
    return got


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s (call|setup|teardown)\s+(\S+)$")


def slowest(pytest_output: str) -> list[dict]:
    """The tests ``--durations`` listed: seconds, phase, test id."""
    return [{"seconds": float(m[1]), "phase": m[2], "test": m[3]}
            for m in map(_DURATION.match, pytest_output.splitlines()) if m]


def outcome(pytest_output: str) -> str:
    """pytest's summary (``12 passed, 1 skipped``), or the last line it wrote."""
    lines = [line.strip("= ") for line in pytest_output.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"\d+ (passed|failed|error|skipped|deselected)", line):
            return line.rsplit(" in ", 1)[0]
    return lines[-1] if lines else "(no output)"


def run_module(module: str, env: dict[str, str], scratch: Path, slowest_n: int, timeout_s: float) -> dict:
    """One module alone under pytest (no xdist, no random order): its CPU, wall, outcome, slowest
    tests and g++ builds (the wrapper's log, ``gxx.log`` in ``scratch``); a module that runs out of
    time is killed with the ranks it spawned (status None)."""
    gxx_log, pytest_log = scratch / "gxx.log", scratch / "pytest.log"
    gxx_log.unlink(missing_ok=True)
    gc_log = Path(env["COMPASS_SUITE_GC_LOG"]) if "COMPASS_SUITE_GC_LOG" in env else None
    if gc_log is not None:
        shutil.rmtree(gc_log, ignore_errors=True)
        gc_log.mkdir()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:randomly", "-p", "no:cacheprovider",
           f"--durations={slowest_n}", module]
    cpu0, t0 = busy_cpu_s(), time.monotonic()
    with open(pytest_log, "w") as out:
        rc, timed_out = run_until(cmd, ROOT, env, out, timeout_s)
    wall, cpu1 = time.monotonic() - t0, busy_cpu_s()
    text = pytest_log.read_text() + (f"\ntimed out after {timeout_s:g} s" if timed_out else "")
    return {"module": module, "status": None if timed_out else rc, "outcome": outcome(text),
            "cpu_s": None if cpu0 is None or cpu1 is None else cpu1 - cpu0, "wall_s": wall,
            "slowest": slowest(text)[:slowest_n], "builds": builds(gxx_log),
            **({"collector": collector_seconds(gc_log)} if gc_log is not None else {})}


def measure(modules: list[str], slowest_n: int, timeout_s: float, collector: bool = False,
            collector_defaults: bool = False) -> list[dict]:
    """Every module in turn, in one fresh temporary tree (removed after) and the g++ wrapper; with
    ``collector``, the collector's time of every process; with ``collector_defaults``, CPython's
    own collector settings in the tests."""
    scratch = Path(tempfile.mkdtemp(prefix="suite_cost-"))
    try:
        tools, tmp, extensions = scratch / "bin", scratch / "tmp", scratch / "extensions"
        for d in (tools, tmp, extensions):
            d.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}  # not a pytest's worker
        env.update(TMPDIR=str(tmp), TORCH_EXTENSIONS_DIR=str(extensions), COMPASS_SUITE_GXX_LOG=str(scratch / "gxx.log"))
        wrapper = timed_compiler(tools)
        if wrapper is not None:
            env["CXX"] = str(wrapper)
        if collector:
            site = scratch / "site"
            site.mkdir()
            (site / "sitecustomize.py").write_text(_GC_HOOK)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
            env["COMPASS_SUITE_GC_LOG"] = str(scratch / "gc")
        if collector_defaults:
            env["COMPASS_TEST_GC"] = "default"
        rows = []
        for i, module in enumerate(modules, 1):
            row = run_module(module, env, scratch, slowest_n, timeout_s)
            rows.append(row)
            cpu = "?" if row["cpu_s"] is None else f"{row['cpu_s']:.0f}"
            gc_note = f", collector {row['collector']['seconds']:.1f} s" if "collector" in row else ""
            print(f"[{i}/{len(modules)}] {module}: {cpu} CPU-s, {row['wall_s']:.0f} s{gc_note}, {row['outcome']}",
                  flush=True)
        return rows
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def totals(rows: list[dict]) -> dict:
    """The sums over the modules: CPU, wall, and the builds by kind."""
    known = [r["cpu_s"] for r in rows if r["cpu_s"] is not None]
    timed = [r["collector"] for r in rows if "collector" in r]
    return {"cpu_s": sum(known) if known else None, "wall_s": sum(r["wall_s"] for r in rows),
            **({"collector_s": sum(t["seconds"] for t in timed)} if timed else {}),
            "builds": {kind: {"count": sum(r["builds"][kind]["count"] for r in rows),
                              "seconds": sum(r["builds"][kind]["seconds"] for r in rows)} for kind in BUILD_KINDS}}


def markdown(payload: dict) -> str:
    rows, total = payload["modules"], payload["totals"]
    kernels = total["builds"]["Inductor kernel"]
    lines = [f"# {NAME} ({payload['tag']})", "",
             "Each test module alone, one after another (no xdist, no random order), in one fresh TMPDIR and "
             "TORCH_EXTENSIONS_DIR: the machine's busy CPU seconds while it ran (read from /proc/stat), its wall "
             "seconds, pytest's outcome, the g++ builds it started (wall seconds of each call, as a wrapper timed "
             "them) and its slowest test.  CI runs them all with `pytest -n 2` on 2 cores within 10 minutes: "
             "1200 CPU-s at the most.", ""]
    if "collector_s" in total:
        settings = ("CPython's own" if payload.get("collector_defaults") else "tests/gc_tuning.py's (imports frozen, "
                    "the youngest generation collected after 50,000 allocations)")
        lines += [f"The collector timed in every Python process (`--collector`), with {settings} settings in the tests: "
                  f"{total['collector_s']:.1f} s over the modules.", ""]
    if total["cpu_s"] is not None:
        lines.append(f"Total: {total['cpu_s']:.0f} CPU-s, {total['wall_s']:.0f} s one module at a time; "
                     f"Inductor's kernels {kernels['count']} builds, {kernels['seconds']:.0f} s; "
                     + ", ".join(f"{kind} {b['count']} ({b['seconds']:.0f} s)" for kind, b in total["builds"].items()
                                 if kind != "Inductor kernel" and b["count"]) + ".")
        lines.append("")
    table = []
    for r in sorted(rows, key=lambda r: -(r["cpu_s"] or 0)):
        b = r["builds"]
        top = r["slowest"][0] if r["slowest"] else None
        table.append({"module": r["module"], "CPU s": r["cpu_s"], "wall s": r["wall_s"], "outcome": r["outcome"],
                      "kernels": f"{b['Inductor kernel']['count']} ({b['Inductor kernel']['seconds']:.1f} s)",
                      "other builds": sum(b[k]["count"] for k in BUILD_KINDS if k != "Inductor kernel"),
                      "slowest test": f"{top['test'].split('::', 1)[-1]} {top['seconds']:.1f} s" if top else "-",
                      "collector s": r["collector"]["seconds"] if "collector" in r else None})
    columns = ["module", "CPU s", "wall s", "outcome", "kernels", "other builds", "slowest test"]
    lines.append(output.markdown_table(table, columns[:3] + ["collector s"] * ("collector_s" in total) + columns[3:]))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("modules", nargs="*", help="test files (default: every tests/test_*.py)")
    p.add_argument("--slowest", type=int, default=3, help="the slowest tests kept per module")
    p.add_argument("--timeout-s", type=float, default=900.0, help="most seconds one module may run")
    p.add_argument("--collector", action="store_true", help="time the garbage collector of every process")
    p.add_argument("--collector-defaults", action="store_true",
                   help="the tests with CPython's own collector settings instead of tests/gc_tuning.py's")
    p.add_argument("--tag", default="cpu")
    p.add_argument("--out-dir", default=str(output.RESULTS))
    args = p.parse_args(argv)
    modules = args.modules or sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py"))
    missing = [m for m in modules if not (ROOT / m).is_file()]
    if missing:
        p.error(f"no such test file (paths are relative to {ROOT}): {', '.join(missing)}")
    if args.slowest < 1 or args.timeout_s <= 0:
        p.error("--slowest and --timeout-s must be positive")
    rows = measure(modules, args.slowest, args.timeout_s, args.collector, args.collector_defaults)
    payload = {"benchmark": NAME, "tag": args.tag, "collector_defaults": args.collector_defaults,
               "modules": rows, "totals": totals(rows),
               "environment": output.environment(True)}
    return output.print_and_write(NAME, args, payload, markdown(payload))


if __name__ == "__main__":
    sys.exit(main())
