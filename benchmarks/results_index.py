"""Write ``benchmarks/results/INDEX.md``: every result run, where and when it ran, what it measured.

Each benchmark keeps its files in ``benchmarks/results/<benchmark>/`` (``harness.output``); a run is
one stem (``<benchmark>-<machine>[-<variant>]``) with its ``.json`` and ``.md`` (and a ``.log``).
The index gives, per run: the machine (``h200``: one H200; ``h200x2``: two; ``h100``: one H100, where
no H200 could be had; ``cpu``), the date and commit it ran at (from the JSON's ``environment`` where
it recorded them: for a dirty checkout, the commit whose package ran, ``+dirty`` where no commit holds it;
else the commit that added the file), one line of what it measured (the
markdown's first line of text, else the script's docstring), and its status: ``current``, or
``fixture`` where a test reads it.  Runs a newer run replaces are deleted (git keeps them), so what
is listed is what stands.

    python benchmarks/results_index.py            # rewrites benchmarks/results/INDEX.md
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from harness.digest import package_digest as digest_of_sources

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "INDEX.md"
MACHINES = ("h200x2", "h200", "h100", "cpu")  # longest first: h200x2 before h200
# benchmarks whose results a script of another name writes
WRITERS = {"calibration": "compass-fx calibrate", "model_constants_fit": "benchmarks/fit_model_constants.py"}


def runs() -> dict[str, list[Path]]:
    """Every run's files, by run (``<benchmark>/<stem>``), in order."""
    found: dict[str, list[Path]] = {}
    for path in sorted(RESULTS.glob("*/*")):
        if path.is_file() and path.suffix in (".json", ".md", ".log"):
            found.setdefault(f"{path.parent.name}/{path.stem}", []).append(path)
    return found


def machine_and_variant(benchmark: str, stem: str) -> tuple[str, str]:
    tail = stem[len(benchmark) + 1:] if stem.startswith(benchmark + "-") else stem.split("-", 1)[-1]
    for machine in MACHINES:
        if tail == machine or tail.startswith(machine + "-"):
            return machine, tail[len(machine) + 1:]
    return "-", tail


def package_digest(commit: str) -> str:
    """``harness.output.source_digest()`` of ``commit``'s package: its ``compass_fx/**/*.py`` read from
    git, hashed by the same rule (:func:`harness.digest.package_digest`)."""
    if commit not in _digests:
        listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit, "--", "compass_fx"], cwd=ROOT,
                                capture_output=True, text=True, timeout=60).stdout.split("\n")
        names = [n for n in listed if n.endswith(".py")]
        batch = subprocess.run(["git", "cat-file", "--batch"], cwd=ROOT, capture_output=True, timeout=60,
                               input="".join(f"{commit}:{n}\n" for n in names).encode()).stdout
        sources, at = [], 0
        for name in names:
            header_end = batch.index(b"\n", at)
            size = int(batch[at:header_end].split()[2])
            sources.append((name, batch[header_end + 1:header_end + 1 + size]))
            at = header_end + 1 + size + 1  # the object, then a newline
        _digests[commit] = digest_of_sources(sources)
    return _digests[commit]


_digests: dict[str, str] = {}


def code_commit(recorded: str, source_sha1: str) -> str:
    """The commit whose package ran, for a run that recorded a dirty checkout: a working tree copied
    to a lent machine keeps the ``.git`` it was first copied with, so its HEAD (``recorded``) may be
    older than the code.  The first commit from ``recorded`` on whose package hashes to the run's
    ``source_sha1``, else ``recorded`` marked ``+dirty`` (code that no commit holds)."""
    try:
        later = subprocess.run(["git", "rev-list", "--reverse", f"{recorded}..HEAD"], cwd=ROOT, capture_output=True,
                               text=True, timeout=60, check=True).stdout.split()
        for commit in [recorded, *later]:
            if package_digest(commit) == source_sha1:
                return commit[:7]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    return f"{recorded}+dirty"


def when_and_commit(files: list[Path]) -> tuple[str, str]:
    """From the JSON's environment (for a dirty checkout, the commit whose package ran: :func:`code_commit`),
    else from the commit that added the first file."""
    for path in files:
        if path.suffix == ".json":
            try:
                env = json.loads(path.read_text()).get("environment") or {}
            except (ValueError, AttributeError):
                env = {}
            if env.get("date_utc"):
                recorded = str(env.get("commit") or "-")[:7]
                if env.get("dirty") and env.get("source_sha1") and recorded != "-":
                    return env["date_utc"][:10], code_commit(recorded, env["source_sha1"])
                return env["date_utc"][:10], recorded
    try:
        log = subprocess.run(["git", "log", "--follow", "--diff-filter=A", "--format=%cs %h", "--", str(files[0])],
                             cwd=ROOT, capture_output=True, text=True, timeout=60).stdout.split("\n")
        added = [line for line in log if line.strip()]
        if added:
            date, commit = added[-1].split()
            return date, commit
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return "-", "-"


def measured(benchmark: str, files: list[Path]) -> str:
    """The markdown's first line of text below its title, else the writing script's first docstring line."""
    for path in files:
        if path.suffix == ".md":
            for line in path.read_text().splitlines()[1:]:
                text = line.strip()
                if text and not text.startswith(("|", "#", "```")):
                    return _short(text)
    script = ROOT / "benchmarks" / f"{benchmark}.py"
    if script.exists():
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        return _short(doc.splitlines()[0] if doc else "")
    return _short(f"written by {WRITERS.get(benchmark, benchmark)}")


def _short(text: str, width: int = 160) -> str:
    text = re.sub(r"\s+", " ", text).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 1].rstrip() + "…"


def readers(name: str) -> list[str]:
    """The tests that read a result file (a fixture: it must stay)."""
    return sorted(p.name for p in (ROOT / "tests").glob("*.py") if name in p.read_text())


def render() -> str:
    lines = ["# Benchmark results", "",
             "Generated by `python benchmarks/results_index.py` (do not edit by hand). One row per run: "
             "`machine` h200 = one H200, h200x2 = two H200s (NVLink; `hoststaged` = `NCCL_P2P_DISABLE=1`), h100 = one H100, "
             "cpu = the 2-core CPU machine. Runs that newer runs replace are deleted (git history keeps them).",
             "", "| run | machine | variant | date | commit | what it measured | status |", "|---|---|---|---|---|---|---|"]
    for run, files in runs().items():
        benchmark, stem = run.split("/")
        machine, variant = machine_and_variant(benchmark, stem)
        date, commit = when_and_commit(files)
        links = " ".join(f"[{p.suffix[1:]}]({p.relative_to(RESULTS).as_posix()})" for p in files)
        tests = sorted({t for p in files for t in readers(p.name)})
        status = f"fixture: {', '.join(tests)}" if tests else "current"
        lines.append(f"| `{stem}` {links} | {machine} | {variant or '-'} | {date} | {commit} | "
                     f"{measured(benchmark, files)} | {status} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.parse_args(argv)
    INDEX.write_text(render())
    print(f"wrote {INDEX} ({len(runs())} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
