"""What a run leaves behind: the environment it ran in, progress lines, markdown tables and the
JSON + markdown files (``<name>-<device>.json``/``.md``, e.g. ``-h200x8``, ``-cpu``)."""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from . import NO_MULTICAST_ENV, RESULTS, ROOT, cpu_power
from .digest import package_digest
from .ranks import Ctx

# Said by the launcher when a rank died tearing down after its work was done; recorded with the results.
TEARDOWN_WARNINGS: list[str] = []


def device_tag(dry_run: bool, world: int | None = None) -> str:
    """``cpu`` for a dry run, else e.g. ``h200x8`` (GPU model and the GPU count of the run)."""
    if dry_run or not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    model = next((tok for tok in name.replace("-", " ").split() if any(ch.isdigit() for ch in tok)), "gpu")
    return f"{model}x{world or torch.cuda.device_count()}"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_dirty() -> "bool | None":
    """Whether the checkout's tracked files differ from its HEAD (None: not known).  A working tree
    copied to a lent machine keeps the ``.git`` it was first copied with, so there HEAD may name an
    older commit than the code that ran: ``dirty`` says so, ``source_sha1`` says which code it was."""
    try:
        done = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: False, 1: True}.get(done.returncode)


def imported_package() -> Path:
    """Where the ``compass_fx`` this process imports lives: only the imported module says which code
    ran (the harness puts its own repository first on ``sys.path``, so ``PYTHONPATH`` cannot swap
    it; :mod:`snapshot` can)."""
    import compass_fx

    return Path(compass_fx.__file__).resolve().parent


def source_digest() -> str:
    """SHA-1 of the imported package's Python sources: which code ran, even where the checkout's git
    HEAD is stale (a copied working tree keeps the ``.git`` it was first copied with)."""
    package = imported_package()
    return package_digest(("compass_fx/" + path.relative_to(package).as_posix(), path.read_bytes())
                          for path in package.rglob("*.py"))


def environment(dry_run: bool) -> dict:
    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "commit": git_commit(), "dirty": git_dirty(), "source_sha1": source_digest(),
        "package": str(imported_package()),
        "dry_run": dry_run,
        "env": {k: os.environ.get(k) for k in (*NO_MULTICAST_ENV, "NCCL_P2P_DISABLE", "COMPASS_FUSED_TRANSPORT",
                                           "CUDA_DEVICE_MAX_CONNECTIONS")},
        "teardown_warnings": list(TEARDOWN_WARNINGS),
        "cpu_power": cpu_power.state(),  # a host time depends on how deep the cores may sleep
    }
    if not dry_run and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpus_visible"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    else:
        env["cpus"] = os.cpu_count()
    try:
        import triton  # noqa: F401
        env["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        env["triton"] = None
    return env


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.{digits}g}"
        return f"{value:.{digits}f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: Sequence[dict], columns: Sequence[str | tuple[str, str]]) -> str:
    """A GitHub markdown table; a column is a key or (key, header)."""
    cols = [(c, c) if isinstance(c, str) else c for c in columns]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(k)) for k, _ in cols) + " |")
    return "\n".join(lines)


def one_gpu_args(doc: str, argv, why_cuda: str, tag: str = "h200"):
    """The command line of a one-GPU benchmark (its docstring as help, ``--tag``: the device in the
    file names, ``--out-dir``), parsed; exits with ``why_cuda`` where there is no CUDA GPU."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tag", default=tag, help=f"device tag in the file names (default {tag})")
    p.add_argument("--out-dir", default=str(RESULTS), help="where the JSON and markdown go")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(why_cuda)
    return args


def print_and_write(name: str, args, payload: dict, markdown: str) -> int:
    """Print the markdown and write both files as ``write_results`` does (``args.tag``,
    ``args.out_dir``); 0, the exit status of a benchmark that got this far."""
    print(markdown)
    write_results(name, args.tag, payload, markdown, args.out_dir)
    return 0


def write_results(name: str, tag: str, payload: dict, markdown: str, out_dir: str | os.PathLike = RESULTS
                  ) -> tuple[Path, Path]:
    """``<name>-<tag>.json`` and ``.md`` in ``out_dir``; the default folder, ``benchmarks/results``,
    keeps each benchmark's files in a folder of its own (``benchmarks/results/<name>/``)."""
    out = Path(out_dir)
    if out.resolve() == RESULTS.resolve():
        out = out / name
    out.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out / f"{name}-{tag}.json", out / f"{name}-{tag}.md"
    jpath.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    mpath.write_text(markdown.rstrip() + "\n")
    print(f"wrote {jpath} and {mpath}", flush=True)
    return jpath, mpath


class Progress:
    """``[i/n] label (elapsed, eta)`` lines on rank 0."""

    def __init__(self, ctx: Ctx, total: int, what: str) -> None:
        self.ctx, self.total, self.what, self.t0, self.done = ctx, max(total, 1), what, time.time(), 0

    def step(self, label: str) -> None:
        self.done += 1
        el = time.time() - self.t0
        eta = el / self.done * (self.total - self.done)
        self.ctx.log(f"[{self.what} {self.done}/{self.total}] {label}  ({el:.0f}s elapsed, ~{eta:.0f}s left)")
