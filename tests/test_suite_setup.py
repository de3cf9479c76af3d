"""The suite's own machinery: how pytest-xdist spreads the tests over its workers."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import conftest


def _config(dist: str) -> SimpleNamespace:
    """The part of pytest's config the scheduler hook reads, with xdist's scheduler's needs."""
    option = SimpleNamespace(dist=dist, tx=["popen", "popen"], numprocesses=2, maxschedchunk=None,
                             loadscopereorder=True)
    return SimpleNamespace(getoption=lambda name: getattr(option, name), getvalue=lambda name: getattr(option, name),
                           option=option)


def test_each_file_runs_whole_on_one_worker_under_plain_n():
    """``-n 2`` means ``--dist load``: the suite asks xdist for file-by-file scheduling instead,
    so the tests sharing a computation (session_cache) never wait on another worker."""
    pytest.importorskip("xdist")
    from xdist.scheduler import LoadFileScheduling

    scheduler = conftest.pytest_xdist_make_scheduler(_config("load"), log=None)
    assert isinstance(scheduler, LoadFileScheduling)
    assert scheduler._split_scope("tests/test_numerics.py::test_a[x-2]") == \
        scheduler._split_scope("tests/test_numerics.py::test_b") != scheduler._split_scope("tests/test_cli.py::test_a")


@pytest.mark.parametrize("dist", ["worksteal", "loadscope", "each"])
def test_another_named_mode_is_left_to_xdist(dist):
    assert conftest.pytest_xdist_make_scheduler(_config(dist), log=None) is None


def _pyc_is_current(source) -> bool:
    """Whether ``source`` has a ``.pyc`` Python would load: its header's time and size are the source's."""
    import importlib.util
    import os
    import struct

    cached = importlib.util.cache_from_source(str(source))
    if not os.path.exists(cached):
        return False
    with open(cached, "rb") as f:
        header = f.read(16)
    flags, mtime, size = struct.unpack("<III", header[4:16])
    stat = os.stat(source)
    return flags == 0 and mtime == int(stat.st_mtime) & 0xFFFFFFFF and size == stat.st_size & 0xFFFFFFFF


def test_the_session_starts_with_the_package_byte_compiled():
    """By the time any test runs, every module of compass_fx and of the tests' helpers has a current
    ``.pyc``, so the interpreters the tests start do not compile them again (conftest.byte_compile)."""
    from pathlib import Path

    root = Path(conftest.CHECKOUT)
    sources = [*(root / "compass_fx").rglob("*.py"), *(root / "tests").glob("*.py")]
    assert len(sources) > 50
    stale = [str(s.relative_to(root)) for s in sources if not _pyc_is_current(s)]
    assert not stale, stale


def test_byte_compile_writes_what_is_missing_and_leaves_other_folders(tmp_path, monkeypatch):
    """A tree without ``.pyc``: the named folders' modules get theirs (even with writing bytecode
    switched off for the process), an edited module a fresh one, other folders none; a folder whose
    ``.pyc`` cannot be written, or that does not exist, raises nothing."""
    import os
    import sys

    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    module, nested, elsewhere = tmp_path / "pkg" / "a.py", tmp_path / "pkg" / "sub" / "b.py", tmp_path / "other" / "c.py"
    for path in (module, nested, elsewhere):
        path.write_text("X = 1\n")
    conftest.byte_compile(str(tmp_path), ("pkg",))
    assert _pyc_is_current(module) and _pyc_is_current(nested) and not _pyc_is_current(elsewhere)
    module.write_text("X = 22\n")
    os.utime(module, (1, 1))  # a different time and size: the old .pyc is stale
    assert not _pyc_is_current(module)
    conftest.byte_compile(str(tmp_path), ("pkg",))
    assert _pyc_is_current(module)
    (tmp_path / "other" / "__pycache__").write_text("")  # a file where the folder goes: no .pyc can be written
    conftest.byte_compile(str(tmp_path), ("other", "missing"))
    assert not _pyc_is_current(elsewhere)
