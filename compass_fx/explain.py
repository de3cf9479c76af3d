"""``explain``: run the backend's tracing on a model and report every pair and decision."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from . import backend
from .options import parse_options
from .report import Report


def explain(model: torch.nn.Module | Any, *example_inputs: Any, **options: Any) -> Report:
    """Trace ``model`` forward and backward exactly as ``backend="compass"`` would; report it all.

    The model runs one forward pass (its collectives included, so call this on every rank, as
    any TP forward) with the backward graph compiled eagerly; no backward runs and no gradient or
    parameter changes.  Inductor code generation is skipped: only the graphs are produced.
    """
    opts = parse_options(options)

    def pass_only(gm: Any, example_inputs_: Any) -> Any:
        return backend.compile_graph(gm, example_inputs_, opts, finish=backend._eager_inner)

    compiled = torch.compile(model, backend=pass_only)
    with backend.collect_reports() as graphs, \
            torch._functorch.config.patch(force_non_lazy_backward_lowering=True), torch.enable_grad():
        compiled(*example_inputs)
    return Report(graphs=list(graphs), options=_jsonable(dataclasses.asdict(opts)))


def last_report(graphs: int = 2) -> Report:
    """The reports of the last ``graphs`` graphs the backend compiled (forward + backward by default)."""
    return Report(graphs=list(backend.history)[-graphs:])


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (str, int, float, bool, type(None))) else str(v)) for k, v in d.items()}
