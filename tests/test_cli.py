"""The ``compass-fx`` console script, run as a user would."""
from __future__ import annotations

import json
import shutil
import subprocess


def run_cli(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("compass-fx")
    assert exe, "console script compass-fx is not installed (pip install -e .)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300)


def test_explain_prints_the_table():
    out = run_cli("explain", "--world", "2", "--layers", "1", "--dim", "64", "--seq", "16", "--chunks", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "decompose(d=2)" in out.stdout and "rewritten" in out.stdout
    assert "left alone:" in out.stdout  # the embedding's collective, with its reason


def test_explain_json_and_topology():
    out = run_cli("explain", "--world", "2", "--layers", "1", "--dim", "64", "--seq", "16", "--json",
                  "--topology", "a6000-nvlink-pairs-pcie-8")
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    pairs = [p for g in data["graphs"] for p in g["pairs"]]  # 1 layer: 3+2 forward, 2+3 backward
    assert len(pairs) == 10 and all(p["topology"] == "a6000-nvlink-pairs-pcie-8" for p in pairs)
    assert all(len(p["candidates"]) > 1 for p in pairs)


def test_explain_bad_option_is_a_clear_error():
    out = run_cli("explain", "--strategy", "fastest")
    assert out.returncode == 2
    assert "'strategy'" in out.stderr
