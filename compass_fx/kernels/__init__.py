"""Fused communication+matmul operators (``torch.ops.compass.*``) and their schedules.

Importing this package registers the custom ops.  Triton is imported lazily, only by the CUDA
implementation, so the package imports on machines without it.
"""
from .ops import (all_gather_matmul, fused_schedules_available, matmul_all_reduce,
                  matmul_reduce_scatter)
from .schedules import SCHEDULES, all_gather_schedule, reduce_scatter_schedule

__all__ = [
    "SCHEDULES",
    "all_gather_matmul",
    "all_gather_schedule",
    "fused_schedules_available",
    "matmul_all_reduce",
    "matmul_reduce_scatter",
    "reduce_scatter_schedule",
]
