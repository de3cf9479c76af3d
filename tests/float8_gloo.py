"""gloo has no float8 collectives ("Invalid scalar type"): torchao's float8 TP styles gather float8
data, so on gloo ranks these tests move those gathers' bytes as uint8, which is exactly what a
gather of float8 values is (a gather adds nothing up).

``float8_gathers_on_gloo()`` overrides the CPU kernel of ``_c10d_functional.all_gather_into_tensor``
while it is active (a synchronous gloo gather of the input's bytes; ``wait_tensor`` on its result
is then a no-op) and gives the original kernel back when it ends.  Tracing is untouched: it runs
the op's fake kernel.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _gather_bytes(inp: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    out = inp.new_empty((inp.shape[0] * group_size, *inp.shape[1:]))
    dist.all_gather_into_tensor(out.view(torch.uint8), inp.contiguous().view(torch.uint8),
                                group=_resolve_process_group(group_name))
    return out


@contextlib.contextmanager
def float8_gathers_on_gloo() -> Iterator[None]:
    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_gather_into_tensor", _gather_bytes, "CPU")
    try:
        yield
    finally:
        lib._destroy()
