"""benchmarks/results/INDEX.md lists every result file, each in its benchmark's folder."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _results_index():
    """benchmarks/results_index.py, imported as a module."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import results_index
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return results_index


def test_the_index_lists_every_result_file_and_nothing_else():
    index = (RESULTS / "INDEX.md").read_text()
    linked = set(re.findall(r"\]\(([\w./-]+)\)", index))
    files = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file() and p.name != "INDEX.md"}
    assert linked == files, (f"not in INDEX.md (run python benchmarks/results_index.py): {sorted(files - linked)}; "
                             f"listed but missing: {sorted(linked - files)}")


def test_results_sit_in_their_benchmark_folder():
    loose = [p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "INDEX.md"]
    assert not loose, loose
    for folder in (p for p in RESULTS.iterdir() if p.is_dir()):
        assert all(f.name.startswith(folder.name + "-") for f in folder.iterdir()), folder


def test_a_fixture_is_marked_as_such():
    results_index = _results_index()
    rows = {line.split("`")[1]: line for line in (RESULTS / "INDEX.md").read_text().splitlines()
            if line.startswith("| `")}
    assert "fixture: test_bench_scripts.py" in rows["calibration-h200x2"]
    assert results_index.readers("gemm_model_validation-h200.json")  # test_cost_models reads it


def test_each_machine_is_read_from_the_name():
    results_index = _results_index()
    read = results_index.machine_and_variant
    assert read("fused_ops", "fused_ops-h200x2-hoststaged") == ("h200x2", "hoststaged")
    assert read("fused_host_time", "fused_host_time-h200-lane-w2") == ("h200", "lane-w2")
    assert read("fused_host_time", "fused_host_time-h100-lane-w2") == ("h100", "lane-w2")
    assert read("compile_time", "compile_time-cpu") == ("cpu", "")
    assert read("compile_time", "compile_time-laptop-x") == ("-", "laptop-x")


def test_a_run_on_a_stale_checkout_names_the_commit_whose_package_ran():
    """A working tree copied to a lent machine keeps the ``.git`` it was first copied with, so a run
    there records an older HEAD and ``dirty``; the index names the first commit from that HEAD on
    whose package hashes to the run's ``source_sha1`` (as ``harness.output.source_digest`` hashes the
    imported package), and marks code that no commit holds."""
    import subprocess

    import pytest

    results_index = _results_index()

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)

    if git("diff", "--quiet", "HEAD", "--", "compass_fx").returncode == 0:  # the package as committed
        sys.path.insert(0, str(ROOT / "benchmarks"))
        try:
            from harness import output
        finally:
            sys.path.remove(str(ROOT / "benchmarks"))
        assert results_index.package_digest("HEAD") == output.source_digest()
    older = git("rev-parse", "--short", "HEAD~3")
    if older.returncode:
        pytest.skip("a shallow clone: no commits before HEAD to walk")
    recorded, wanted = older.stdout.strip(), results_index.package_digest("HEAD")
    found = results_index.code_commit(recorded, wanted)
    walked = [recorded] + git("rev-list", "--reverse", f"{recorded}..HEAD").stdout.split()
    assert results_index.package_digest(found) == wanted
    assert [c[:7] for c in walked if results_index.package_digest(c) == wanted][0] == found  # the first such
    assert results_index.code_commit(recorded, "0" * 12) == f"{recorded}+dirty"
