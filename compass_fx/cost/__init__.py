"""The performance framework: GEMM / collective / overlap models, the decomposition model,
selection between strategies and the cost hooks.  Pure and deterministic: it prices a
``Workload`` on a ``Topology`` (the machine, described in ``compass_fx.machine``; ``Topology``,
``GpuSpec``, ``GPUS``, ``gpu_spec`` and ``load_calibration`` are re-exported here, where users
have always imported them).  The commands, sweep and calibration driver are in ``compass_fx.tools``.

Planning without a graph::

    from compass_fx.cost import Topology, Workload, plan, gemm_seconds
    topo = Topology.preset("a6000-nvlink-pairs-pcie-8")
    w = Workload(kind="all_gather_matmul", m=16384, n=7168, k=8192, dtype="bfloat16", group_size=8)
    decision = plan(w, topo)       # Decision: .strategy, .parts, .predicted_s, .candidates
"""
from .collective import collective_seconds, collective_time
from .decision import SCHEDULES, STRATEGIES, Candidate, Decision
from .decomposition import DecompositionModel, optimum_expression
from .gemm import gemm_seconds, gemm_time, split_gemm_seconds
from ..machine.calibration import gpu_spec, load_calibration
from ..machine.gpus import GPUS, GpuSpec
from ..machine.topology import Topology
from .layer import MODELS, LayerPlan, format_layer_plan, layer_workloads, plan_layer
from .hooks import CostHookError, clear_cost_hooks, register_cost_hook, unregister_cost_hook
from .select import plan, select
from .strategies import decomposition_model, decomposition_models, fused_seconds, sequential_seconds
from .workload import PAIR_KINDS, Workload

__all__ = [
    "Candidate", "CostHookError", "LayerPlan", "MODELS", "format_layer_plan", "layer_workloads", "plan_layer", "Decision", "DecompositionModel", "GPUS", "GpuSpec", "PAIR_KINDS",
    "SCHEDULES", "STRATEGIES", "Topology", "Workload", "clear_cost_hooks", "collective_seconds",
    "collective_time", "decomposition_model", "decomposition_models", "fused_seconds", "gemm_seconds", "gemm_time", "gpu_spec",
    "load_calibration", "optimum_expression", "plan", "register_cost_hook", "select",
    "sequential_seconds", "split_gemm_seconds", "unregister_cost_hook",
]
