"""compass_fx: a torch.compile backend that hides tensor-parallel communication behind computation.

    compass_fx.check_options(chunks=4)            # a bad option fails here, not at the first call
    model = torch.compile(model, backend="compass", options={"chunks": 4})
    report = compass_fx.explain(model, *example_inputs)
"""
from .cost.hooks import clear_cost_hooks, register_cost_hook, unregister_cost_hook
from .explain import explain, last_report
from .fused_calls import FusedCalls, fused_calls
from .groups import gloo_worker_threads
from .options import CompassOptions, check_options, parse_options
from .report import Report

__all__ = ["CompassOptions", "FusedCalls", "Report", "check_options", "clear_cost_hooks", "explain", "fused_calls",
           "gloo_worker_threads", "last_report", "parse_options", "register_cost_hook", "unregister_cost_hook"]
__version__ = "0.1.0"
