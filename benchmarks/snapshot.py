"""A snapshot of an earlier commit's package and benchmark scripts, to measure against (issue 27).

Why: the benchmarks' harness puts its own repository first on ``sys.path``, so a run measures
another commit's code only when the script runs from that commit's tree: ``python3
scratch/snapshot/benchmarks/fused_host_time.py ...`` imports the snapshot's ``compass_fx``
(``PYTHONPATH`` does not: two runs meant as an A/B once ran one package twice).  The results
record the package they imported (``environment.package``).  The snapshot lies under the
uncommitted ``scratch/`` (not git-ignored: it travels to the device with the checkout's other untracked
files); a device batch's step runs from it with ``root`` (``device_batches.Step``), and the batch makes a
missing one from ``device_batches.SNAPSHOT_REVISIONS``.

    python benchmarks/snapshot.py 402bf49            # writes scratch/snapshot
    python benchmarks/snapshot.py 659b7f9 --scripts HEAD   # 659b7f9's package, today's scripts

``--scripts``: the benchmark scripts (and their harness) of another revision, so that an older
package runs under options added since (``fused_host_time.py --ops``); the package is still the
commit's, which the results record.
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


def _archive(revision: str, paths: list[str]) -> bytes:
    archive = subprocess.run(["git", "archive", "--format=tar", revision, *paths], cwd=ROOT, capture_output=True,
                             check=False)
    if archive.returncode:
        raise SystemExit(f"git archive {revision} failed: {archive.stderr.decode().strip()}")
    return archive.stdout


def _short(revision: str) -> str:
    return subprocess.run(["git", "rev-parse", "--short", revision], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def snapshot(commit: str, out: Path = DEFAULT_OUT, scripts: str | None = None) -> Path:
    """``commit``'s ``compass_fx`` and the ``benchmarks`` (less their results) of ``scripts`` (default:
    the same commit) written to ``out``, which is replaced; the revisions are kept in ``out/COMMIT``."""
    scripts = scripts or commit
    package = _archive(commit, ["compass_fx"])
    benchmarks = _archive(scripts, ["benchmarks", ":(exclude)benchmarks/results"])
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for archive in (package, benchmarks):
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(out, filter="data")
    line = _short(commit) if scripts == commit else f"{_short(commit)} (scripts of {_short(scripts)})"
    (out / "COMMIT").write_text(line + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("commit", help="the commit to snapshot (any git revision)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where (replaced; default scratch/snapshot)")
    p.add_argument("--scripts", help="the benchmark scripts of this revision instead (default: the commit's)")
    args = p.parse_args(argv)
    out = snapshot(args.commit, args.out, args.scripts)
    print(f"{out}: {(out / 'COMMIT').read_text().strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
