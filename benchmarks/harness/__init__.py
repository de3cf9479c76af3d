"""What the multi-GPU benchmark scripts share (``multigpu_correctness.py``, ``multigpu_operators.py``,
``multigpu_end_to_end.py``, ``fused_ops.py``, ``host_copy.py``, ``profile_pair.py``):

* ``launch``: one process per GPU, either spawned here (``--worlds 2,4,8`` runs one launch per world
  size, one after another) or under ``torchrun`` (one world, taken from the environment).  NCCL on
  CUDA, gloo on CPU (``--dry-run``).
* ``ranks``: what a worker knows about its process (``Ctx``) and what the ranks agree on (barrier,
  the slowest rank's figure, a failure anywhere).
* ``timing``: CUDA events, median of repeats, the slowest rank's median; back-to-back batches;
  several candidates timed side by side in interleaved rounds.
* ``profiling``: a torch.profiler run's GPU time by category (GEMM, NCCL, copies, other, idle).
* ``output``: the environment, progress lines, markdown tables and the JSON + markdown files (the
  device in the file name: ``-h200x8``, ``-cpu``).  Only rank 0 writes files or prints tables.
* ``pairs``: the three pair kinds: the one-pair graph compiled through compass_fx's own rewrite with
  a strategy forced (sequential, InterDecom(d), IntraFusion; forward and backward), what the compiler
  did with it, and the operators called directly (``torch.ops.compass.*``, PyTorch's
  ``torch.ops.symm_mem`` fused ops); operands, the GEMM alone and the collective alone.

Importing the package first keeps NVLink multicast (NVLS / multimem) off in this process and every
process it launches (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``), before torch
is imported, and puts the repository on ``sys.path``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
for _k, _v in NO_MULTICAST_ENV.items():
    os.environ[_k] = _v
