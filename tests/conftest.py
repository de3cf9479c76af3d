import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# Inductor compiles C++ kernels in a pool of worker processes by default, each importing torch: on
# 2 cores that costs more than it saves for the tests' small graphs (rank processes and the
# scripts the tests start inherit this).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Inductor's C++ kernels without SIMD intrinsics: the header it precompiles once per machine and
# every kernel then compile in about half the time (a cold 1-layer Llama block, forward and
# backward: 70 s -> 37 s with the header, 17 s -> 13.6 s after it).  The tests check the graphs
# compass_fx hands to Inductor and the numbers they compute, not how Inductor vectorises C++ on a
# CPU (the GPUs' code is Triton's); the kernels still compute in the tests' dtypes.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# One OpenMP thread per process (set before anything imports torch; ranks and scripts inherit it).
# With two xdist workers, their rank pools and Inductor's kernels (``#pragma omp parallel``) all on
# 2 cores, an idle OpenMP thread spins waiting for work that another process's turn holds up: the
# full suite took 745 CPU-s in 6:21 with each worker at 2 threads, 522 CPU-s in 4:30 at 1
# (same machine, same hour).  The tests' tensors are tiny; the checks do not depend on threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import gc_tuning  # noqa: E402
from rank_pool import RankPool  # noqa: E402


class _Pools:
    """Pools for the test session, started on first use, restarted if a failure killed one."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def __call__(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool

    def discard(self, world_size: int) -> None:
        """Close the pool of ``world_size`` (its ranks' state was left unusable); the next use
        spawns a fresh one."""
        pool = self._pools.pop(world_size, None)
        if pool is not None:
            pool.close(force=True)

    def close(self) -> None:
        for pool in self._pools.values():  # every pool's ranks leave at once: their exits overlap
            pool.stop()
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world_size)`` gives the session's gloo pool of that size: spawned once, on first use,
    and shared by every module (a pool a failure killed is started afresh)."""
    pools = _Pools()
    yield pools
    pools.close()


@pytest.fixture(scope="module")
def fake_mesh(request):
    """A fake process group of the module's ``WORLD`` ranks (4 if it sets none; it traces, computes
    nothing) and its 1-D mesh, for the module's tests; destroyed after them."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = getattr(request.module, "WORLD", 4)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    yield init_device_mesh("cpu", (world,))
    dist.destroy_process_group()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without xdist it is never called
def pytest_xdist_make_scheduler(config, log):
    """Under ``-n``, each test file runs whole on one worker (``--dist loadfile``; a mode other
    than ``load``, which ``-n`` means by default, is left alone).  The tests that read one shared
    computation sit in one file (:mod:`session_cache`): spread over two workers, one would wait,
    idle, for the other to compute it (up to a minute for an Inductor compile's option sets), and
    every module's fixtures would be set up on both.  The suite, cold caches, 2026-12-05:
    8:34 -> 6:47-7:17."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadFileScheduling

    return LoadFileScheduling(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    """An Inductor compile on the CPU is slow by itself (its C++ kernels go through the system
    compiler): every ``inductor`` test is also ``slow``.  ``gpu`` tests skip without a GPU."""
    import torch

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("inductor") is not None:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(no_gpu)


def pytest_collection_finish(session) -> None:
    """The test modules and what they import are loaded: freeze them for the collector
    (:mod:`gc_tuning`); the ranks do the same with their forkserver's imports."""
    gc_tuning.settle_imports()
