"""Fused communication+matmul operators (``torch.ops.compass.*``) and their schedules.

Importing this package registers the custom ops.  The CUDA implementation talks to the driver
through ctypes only when a CUDA tensor arrives, so the package imports on machines without a GPU.

Layout, one module per job, each importing only those above it:

* ``schedules.py``, ``protocol.py`` — the plans, pure Python (no torch): which piece of which
  block travels to whom at which step (schedules), and, built from them, the per-rank lists of
  stream commands one call of a fused operator issues on the GPUs (protocol).
* ``simulate.py`` — runs the protocol's plans for several ranks on the CPU under random
  interleavings (what ``tests/test_protocol.py`` checks them with).
* ``reference.py`` — the any-backend implementation: the schedules over point-to-point messages
  (gloo, NCCL, any world size); what runs on CPU and what the CUDA path is tested against.
* ``cuda/`` — the CUDA path: ``impl.py`` runs the protocol's plans on streams (copy engines,
  stream memory operations, cuBLAS), ``driver.py`` (the CUDA driver calls, through ctypes),
  ``host_memory.py`` (host memory shared by a group, for GPUs without peer access),
  ``watchdog.py`` (every wait bounded).
* ``ops.py`` — the surface: the ``torch.library`` custom ops, their fake kernels and autograd,
  dispatching to ``reference`` or ``cuda``.  No Triton kernels are left.

The pure modules stay at this level rather than in a sub-package of their own: they are the
vocabulary every other job shares (the reference walks the schedules, the CUDA path runs the
protocol, the simulator checks it, and the cost model, which must stay pure Python, prices both),
not a path of their own, and with the CUDA path in ``cuda/`` what is left here is already the
plans plus the two small modules that run or expose them.  ``tests/test_layers.py`` holds the
order above and checks that the cost model imports only the pure plans.
"""
from .ops import (all_gather_matmul, fused_ops_capturable, fused_schedules_available, matmul_all_reduce,
                  matmul_reduce_scatter)
from .schedules import SCHEDULES, all_gather_schedule, reduce_scatter_schedule

__all__ = [
    "SCHEDULES",
    "all_gather_matmul",
    "all_gather_schedule",
    "fused_ops_capturable",
    "fused_schedules_available",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "reduce_scatter_schedule",
]
