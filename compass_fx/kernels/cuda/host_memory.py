"""Host memory that every rank of a group on one machine maps: where GPUs without peer access meet.

Rank 0 creates one file in ``/dev/shm`` holding a region per rank (its flags and the host mirrors
of its symmetric buffers), every rank maps the whole file; once all have mapped, the file is
unlinked, so nothing outlives the processes.  On a GPU machine the mapping is then page-locked
and mapped for the device (``register``), after which the copy engines move data between any GPU
and any rank's region, and stream memory operations read and write the flags in place.  One file
puts every rank's region at one stride from the previous one (``stride``), so the same buffer of
consecutive ranks can be read by one 2D copy (:mod:`.copy_runs`).

Creating an arena is collective (three object all-gathers on the group), like symmetric memory's
rendezvous; the ranks must share one host, which is checked.
"""
from __future__ import annotations

import mmap
import os
import secrets
import socket
from typing import Callable

import torch
import torch.distributed as dist

PAGE = 4096
Register = Callable[[int, int], int]  # (host address, bytes) -> device address


def _round_up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


class SharedHostArena:
    """``nbytes`` of host memory per rank of ``group``, every rank's region mapped by all ranks."""

    def __init__(self, group: dist.ProcessGroup, nbytes: int, register: Register | None = None,
                 directory: str = "/dev/shm") -> None:
        self.rank, self.world = group.rank(), group.size()
        self.nbytes = _round_up(max(nbytes, 1))
        seen: list = [None] * self.world
        dist.all_gather_object(seen, (socket.gethostname(), secrets.token_hex(8)), group=group)
        hosts = sorted({host for host, _ in seen})
        if len(hosts) > 1:
            raise RuntimeError(f"host-staged fused operators need every rank of the group on one machine; "
                               f"the group spans {hosts}")
        token = seen[0][1]  # rank 0's: one name for the whole group
        path = os.path.join(directory, f"compass-fx-{token}")
        if self.rank == 0:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, self.world * self.nbytes)
            finally:
                os.close(fd)
        dist.all_gather_object([None] * self.world, True, group=group)  # the file exists
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, self.world * self.nbytes)
            finally:
                os.close(fd)
        finally:
            dist.all_gather_object([None] * self.world, True, group=group)  # every rank has mapped
            if self.rank == 0:
                os.unlink(path)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self.bytes = [whole[r * self.nbytes:(r + 1) * self.nbytes] for r in range(self.world)]
        base = register(whole.data_ptr(), self.world * self.nbytes) if register else whole.data_ptr()
        self.device_addresses = [base + r * self.nbytes for r in range(self.world)]
        self.stride = self.nbytes  # bytes from one rank's region to the next, host and device alike

    def view(self, rank: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``rank``'s region from byte ``offset`` as a CPU tensor of ``shape`` (shared memory)."""
        n = dtype.itemsize
        for s in shape:
            n *= s
        if offset % dtype.itemsize or offset + n > self.nbytes:
            raise ValueError(f"a {shape} {dtype} view at byte {offset} does not fit {self.nbytes} bytes")
        return self.bytes[rank][offset:offset + n].view(dtype).view(shape)

    def device_address(self, rank: int, offset: int = 0) -> int:
        """Where a GPU reaches byte ``offset`` of ``rank``'s region."""
        return self.device_addresses[rank] + offset


class Layout:
    """Byte offsets of named arrays in one rank's region, each aligned to a page."""

    def __init__(self) -> None:
        self.offsets: dict[str, int] = {}
        self.nbytes = 0

    def add(self, name: str, nbytes: int) -> int:
        self.offsets[name] = self.nbytes
        self.nbytes += _round_up(nbytes)
        return self.offsets[name]
