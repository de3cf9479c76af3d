"""Work done once per test session, whichever pytest-xdist worker asks for it first.

Several tests read one computation's result (the option sets of one shared trace,
:mod:`shared_trace`).  They sit in one file, and the suite runs each file whole on one xdist
worker (``conftest.pytest_xdist_make_scheduler``), so one process computes it and the others read
its memo.  Where the tests are spread anyway (``--dist worksteal``, or a file split some day), the
first to ask computes it and writes it beside the session's temporary directories; the others wait
for it on a file lock and read it.  (xdist's ``--dist loadgroup`` would not help: it marks the
tests through ``item._nodeid``, which pytest 9.2 no longer reads, and silently ignores the groups.)
"""
from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from typing import Any

_memo: dict[str, Any] = {}


def computed_once(tmp_path_factory, key: str, compute: Callable[[], Any]) -> Any:
    """``compute()``'s value (JSON: tuples come back as lists) for this session and ``key``; if it
    raised, a ``RuntimeError`` with its message, here and for every later asker."""
    if key not in _memo:
        _memo[key] = _read_or_compute(tmp_path_factory, key, compute)
    value = _memo[key]
    if "failed" in value:
        raise RuntimeError(f"{key} failed once this session: {value['failed']}")
    return value["value"]


def _read_or_compute(tmp_path_factory, key: str, compute: Callable[[], Any]) -> dict:
    """``{"value": ...}`` or ``{"failed": why}``, from the session's file, or computed and written."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' directories sit side by side in the session's
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in key)
    path = root / f"once-{name}.json"
    with open(root / f"once-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released with the file (or the process)
        if path.exists():
            value = json.loads(path.read_text())
        else:
            try:
                value = {"value": compute()}
            except Exception as e:  # noqa: BLE001 - every asker reports it, none computes it again
                value = {"failed": f"{type(e).__name__}: {e}"}
            text = json.dumps(value)
            tmp = path.with_suffix(".part")
            tmp.write_text(text)
            tmp.replace(path)
            value = json.loads(text)  # what the other workers read, here too
    return value
