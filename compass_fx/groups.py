"""Process groups by name, and the key-value store their ranks leave values in for each other:
the one lookup every stage uses (the matcher sizes an all-reduce's group, the ranks agree over
it, the fused operators run in it)."""
from __future__ import annotations

import json

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
