"""A snapshot of an earlier commit's package and benchmark scripts, to measure against (issue 27).

Why: the benchmarks' harness puts its own repository first on ``sys.path``, so a run measures
another commit's code only when the script runs from that commit's tree: ``python3
scratch/snapshot/benchmarks/fused_host_time.py ...`` imports the snapshot's ``compass_fx``
(``PYTHONPATH`` does not: two runs meant as an A/B once ran one package twice).  The results
record the package they imported (``environment.package``).  The snapshot lies under the
git-ignored ``scratch/`` and travels to the device with ``carry``; a device batch's step runs from it
with ``root`` (``device_batches.Step``).

    python benchmarks/snapshot.py 402bf49            # writes scratch/snapshot
"""
from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "scratch" / "snapshot"


def snapshot(commit: str, out: Path = DEFAULT_OUT) -> Path:
    """``commit``'s ``compass_fx`` and ``benchmarks`` (less its results) written to ``out``, which is
    replaced; its commit is kept in ``out/COMMIT``."""
    archive = subprocess.run(["git", "archive", "--format=tar", commit, "compass_fx", "benchmarks",
                              ":(exclude)benchmarks/results"], cwd=ROOT, capture_output=True, check=False)
    if archive.returncode:
        raise SystemExit(f"git archive {commit} failed: {archive.stderr.decode().strip()}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(out, filter="data")
    sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=ROOT, capture_output=True, text=True).stdout
    (out / "COMMIT").write_text(sha.strip() + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("commit", help="the commit to snapshot (any git revision)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where (replaced; default scratch/snapshot)")
    args = p.parse_args(argv)
    out = snapshot(args.commit, args.out)
    print(f"{out}: {(out / 'COMMIT').read_text().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
