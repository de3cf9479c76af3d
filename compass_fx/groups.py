"""Process groups by name, and the key-value store their ranks leave values in for each other:
the one lookup every stage uses (the matcher sizes an all-reduce's group, the ranks agree over
it, the fused operators run in it).  Also :func:`gloo_worker_threads`, the workaround for a heap
corruption in torch's gloo groups that CPU runs (tests, the demo) need."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
from typing import Iterator

import torch.distributed as dist


def find_group(group_name: str) -> dist.ProcessGroup:
    """The process group registered under ``group_name`` (the name a functional collective
    carries in the graph).  Raises ValueError when torch.distributed is not initialised or no
    group has that name."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"no process group {group_name!r}: torch.distributed is not initialised")
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(group_name)
    except Exception as e:  # noqa: BLE001 - c10d raises several kinds for an unknown name
        raise ValueError(f"no process group {group_name!r}: {e}") from None


def default_store() -> dist.Store | None:
    """The default group's key-value store, where ranks leave what the others must agree on
    (the topology read on rank 0, each pair's decision); None without one."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    try:
        return _get_default_store()
    except (RuntimeError, ValueError):
        return None


def publish(store: dist.Store, key: str, value: dict) -> None:
    """Leave ``value`` under ``key`` for the other ranks (JSON, keys sorted)."""
    store.set(key, json.dumps(value, sort_keys=True))


def backend_for(group_name: str, device_type: str) -> str | None:
    """The backend that runs ``group_name``'s collectives on tensors of ``device_type`` ("gloo",
    "nccl", "fake" ...), or None when no such group is known (tracing without a process group)."""
    try:
        group = find_group(group_name)
    except ValueError:
        return None
    config = dist.get_backend_config(group)  # "cpu:gloo,cuda:nccl", or one name for every device
    entries = dict(e.split(":", 1) for e in config.split(",") if ":" in e)
    return entries.get(device_type, config if not entries else None)


def gloo_threads_of(group_name: str) -> int | None:
    """How many worker threads ``group_name``'s gloo backend runs for CPU tensors, or None where
    its CPU collectives are not gloo's (or torch no longer says)."""
    if backend_for(group_name, "cpu") != "gloo":
        return None
    try:
        import torch

        return int(find_group(group_name)._get_backend(torch.device("cpu")).options._threads)
    except Exception:  # noqa: BLE001 - private attributes: a torch without them gets no answer
        return None


@contextlib.contextmanager
def gloo_worker_threads(threads: int = 1) -> Iterator[None]:
    """Gloo process groups created inside this context run ``threads`` worker threads (torch
    starts two per device).

    Why: in torch 2.13 and 2.14, functional all-gathers in flight on a gloo group corrupt the heap
    now and then when the group's two worker threads run two of them at once: a rank dies with
    ``malloc(): unaligned tcache chunk detected`` or a segmentation fault
    (``benchmarks/funcol_gloo_inflight.py``, no compass_fx code).  With one thread a group runs its
    collectives one at a time in the order they were issued, the order every rank issues them in.
    Torch gives no option for this (``init_process_group`` ignores options for gloo), so while the
    context is open ``torch.distributed`` constructs gloo groups through a subclass of
    ``ProcessGroupGloo`` that passes ``threads``; groups made before or after are untouched.
    Devices are chosen as torch chooses them (``GLOO_SOCKET_IFNAME``, else the default)::

        with compass_fx.gloo_worker_threads(1):
            dist.init_process_group("gloo", ...)
    """
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"gloo_worker_threads: threads must be a positive int, got {threads!r}")
    import torch.distributed.distributed_c10d as c10d

    replaced = c10d.ProcessGroupGloo
    base = getattr(replaced, "compass_base", replaced)  # nested contexts subclass torch's own class

    class ProcessGroupGloo(base):  # type: ignore[misc, valid-type]
        compass_base = base

        def __init__(self, store, rank: int, size: int,
                     timeout: datetime.timedelta = datetime.timedelta(minutes=30), **settings) -> None:
            options = base._Options()
            options._timeout = timeout
            for name, value in settings.items():  # what newer torch passes too (2.14: enable_reconfigure)
                if not hasattr(options, name):
                    raise TypeError(f"ProcessGroupGloo() got an unexpected keyword argument {name!r}")
                setattr(options, name, value)
            interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
            options._devices = ([base.create_device(interface=i) for i in interfaces] if interfaces
                                else [base.create_default_device()])
            options._threads = threads
            super().__init__(store, rank, size, options)

    ProcessGroupGloo.__qualname__ = f"ProcessGroupGloo (compass_fx.gloo_worker_threads({threads}))"
    c10d.ProcessGroupGloo = ProcessGroupGloo
    try:
        yield
    finally:
        c10d.ProcessGroupGloo = replaced
