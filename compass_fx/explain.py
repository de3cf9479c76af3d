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

    A model already compiled with ``backend="compass"`` is explained with the options (and mode)
    it was compiled with; passing other options as well is an error, since the report would then
    describe a compile that is not the model's.  A model compiled with another backend is
    explained as ``backend="compass"`` with ``options`` would compile its module.  Explain's own
    traces do not show in :func:`last_report`.
    """
    module, compiled_with = unwrap_compiled(model)
    if compiled_with is not None:
        given = parse_options(options) if options else None
        if given is not None and given != parse_options(compiled_with):
            raise ValueError(f"explain: this model was compiled with backend='compass' and options {compiled_with}; "
                             "explain reports that compile, so pass no options (or explain the uncompiled module)")
        options = compiled_with
    opts = parse_options(options)

    def pass_only(gm: Any, example_inputs_: Any) -> Any:
        return backend.compile_graph(gm, example_inputs_, opts, finish=backend._eager_inner, in_history=False)

    compiled = torch.compile(module, backend=pass_only)
    with backend.collect_reports() as graphs, \
            torch._functorch.config.patch(force_non_lazy_backward_lowering=True), torch.enable_grad():
        compiled(*example_inputs)
    return Report(graphs=list(graphs), options=_jsonable(dataclasses.asdict(opts)))


def unwrap_compiled(model: Any) -> tuple[Any, dict[str, Any] | None]:
    """``(module, options)`` for a model compiled with ``torch.compile(..., backend="compass")``: its
    original module and the options it was compiled with (``mode`` among them when not default);
    ``(module, None)`` for any other compiled model, ``(model, None)`` for one not compiled."""
    original = getattr(model, "_orig_mod", None)
    if original is None:
        return model, None
    wrapper = getattr(getattr(model, "dynamo_ctx", None), "callback", None)
    for _ in range(16):  # the callback wraps the backend a few times, each keeping the one inside
        inner = getattr(wrapper, "_torchdynamo_orig_backend", None)
        if inner is None or inner is wrapper:
            break
        wrapper = inner
    if getattr(wrapper, "compiler_fn", None) is not backend.compass_backend:
        return original, None
    kwargs = dict(getattr(wrapper, "kwargs", None) or {})
    options = dict(kwargs.get("options") or {})
    if kwargs.get("mode") not in (None, "default"):
        options["mode"] = kwargs["mode"]
    return original, options


def last_report(graphs: int | None = None) -> Report:
    """What the backend did in the most recent compile of a model (its forward graph, and its
    backward once the first backward call compiled it); ``graphs=N``: the last N graphs compiled,
    whichever compiles they came from."""
    reports = backend.latest_compile() if graphs is None else list(backend.history)[-graphs:]
    return Report(graphs=reports)


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (str, int, float, bool, type(None))) else str(v)) for k, v in d.items()}
