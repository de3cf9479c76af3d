"""A command run to a deadline in a process group of its own: killed there, it takes with it what it
spawned (a benchmark's ranks, torchrun's workers, a pytest's rank pools), which killing the command
alone would leave running."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import IO


def run_until(cmd: list[str], cwd: str | Path, env: dict[str, str], out: IO, deadline_s: float) -> tuple[int, bool]:
    """(exit status, whether killed): ``cmd`` in its own process group, its output and errors to
    ``out``, the whole group killed at the deadline."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=deadline_s), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(), True
