"""The README's code runs as written: its quick start under torchrun on 2 CPU ranks (gloo), as a
new user would run it, and its two commands are what CI runs."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_the_readme_is_short_and_links_resolve():
    assert len(README.splitlines()) <= 130
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


def test_ci_runs_the_readme_test_command():
    setup, tests = _blocks("bash")[:2]
    assert "examples/train_tp.py" in setup
    assert tests.strip() in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow  # two ranks compile the block with Inductor
def test_every_python_block_runs_as_written(tmp_path):
    blocks = _blocks("python")
    assert blocks, "the README has no quick start"
    for i, code in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(code)
        first = code.splitlines()[0]
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)]
               if "torchrun --nproc-per-node 2" in first else [sys.executable, str(script)])
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"block {i}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        if "last_report" in code:  # the quick start prints the report: both pairs of both graphs rewritten
            assert proc.stdout.count("rewritten") >= 4 and "decompose(d=2)" in proc.stdout, proc.stdout
