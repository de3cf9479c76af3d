"""What a worker knows about its process, and what the ranks agree on: every rank at a barrier,
the slowest rank's figure, whether a step failed anywhere (so that no rank goes on alone into a
collective the others skip)."""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass
class Ctx:
    """What a worker knows about its process."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    dry_run: bool

    @property
    def group_name(self) -> str:
        return dist.group.WORLD.group_name

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)


def synchronize(ctx: Ctx) -> None:
    if ctx.is_cuda:
        torch.cuda.synchronize(ctx.device)


def barrier(ctx: Ctx) -> None:
    """Every rank here before any goes on (a tiny all-reduce on the device, then a sync)."""
    dist.all_reduce(torch.zeros(1, device=ctx.device))
    synchronize(ctx)


def all_ok(ctx: Ctx, ok: bool) -> bool:
    """True when ``ok`` holds on every rank."""
    t = torch.tensor([0.0 if ok else 1.0], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item() == 0.0


def max_over_ranks(ctx: Ctx, value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def guarded(ctx: Ctx, what: str, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """Run ``fn``; (result, None) or (None, error) — agreed across ranks so that no rank goes on
    alone into a collective the others skip."""
    try:
        result, err = fn(), None
    except Exception as e:  # noqa: BLE001
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        said = " ... ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else ""  # a wrapper's first line, the cause's last
        result, err = None, f"{type(e).__name__}: {said}"[:500]
        if os.environ.get("COMPASS_BENCH_TRACEBACK"):
            traceback.print_exc()
    if not all_ok(ctx, err is None):
        return None, err or f"{what}: failed on another rank"
    return result, None


def physical_cores() -> list[list[int]]:
    """This process's allowed logical CPUs grouped by physical core (hardware threads of one core
    together), in order: what pins a rank, or a probe, to a core no other process shares."""
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f, open(f"{base}/core_id") as g:
                key = (f.read().strip(), g.read().strip())
        except OSError:
            key = ("?", str(cpu))
        cores.setdefault(key, []).append(cpu)
    return sorted(cores.values())


def pin(rank: int) -> list[int]:
    """Pin this rank's process to a physical core of its own (all of that core's hardware threads;
    core ``rank + 1``, leaving core 0 to the system), so that no other rank, spinning in a
    synchronize, shares it.  Returns the CPUs, or [] where there are too few cores."""
    cores = physical_cores()
    if len(cores) < rank + 2:
        return []
    os.sched_setaffinity(0, set(cores[rank + 1]))
    return cores[rank + 1]
