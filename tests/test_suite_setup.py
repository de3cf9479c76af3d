"""The suite's own machinery: how pytest-xdist spreads the tests over its workers, and the garbage
collector of the processes that compile."""
from __future__ import annotations

import gc
import os
from types import SimpleNamespace

import pytest

import conftest
import gc_tuning


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


def _collector(rank: int) -> tuple[int, tuple[int, int, int], bool]:
    """What a rank's collector skips and when it runs; and whether torch's modules are among what
    it skips (a frozen object is in no generation)."""
    import torch

    return gc.get_freeze_count(), gc.get_threshold(), not any(o is torch.nn.Module for o in gc.get_objects())


def test_the_processes_that_compile_skip_their_imports_in_every_collection(ranks):
    """Every rank of a pool, and the test process, froze their imports and collect their youngest
    generation rarely (``gc_tuning``): a default collector spent twice the time.  Under
    ``COMPASS_TEST_GC=default`` (suite_cost's ``--collector-defaults``) they keep CPython's settings."""
    defaults = os.environ.get("COMPASS_TEST_GC") == "default"
    here = (gc.get_freeze_count(), gc.get_threshold(), None)  # torch's classes looked for in the ranks only
    for frozen, thresholds, torch_frozen in [here] + ranks(2).run(_collector):
        if defaults:
            assert frozen == 0 and thresholds != gc_tuning.THRESHOLDS and torch_frozen is not True
        else:
            assert frozen > 10_000 and thresholds == gc_tuning.THRESHOLDS and torch_frozen is not False
