"""The test processes' garbage collector, set for compiling many small models (CPU time only).

Dynamo, AOTAutograd and Inductor make and drop millions of small objects per compile; with
CPython's default thresholds the collector runs a full pass over every live object (torch's
modules and everything imported included) several times per compile: about 0.45 of the 3.3
CPU-s of a 2-layer Transformer's Inductor compile, forward and backward (kernels cached).  Freezing what
exists once the imports are done (:func:`gc.freeze`: later passes skip it) and collecting the
youngest generation after 50,000 allocations instead of 700 leaves 0.15-0.2.  Every cycle is still
collected, later; no test depends on when.  ``COMPASS_TEST_GC=default`` keeps CPython's settings
(``benchmarks/suite_cost.py --collector-defaults``: what this saves, measured).
"""
from __future__ import annotations

import gc
import os

THRESHOLDS = (50_000, 20, 100)


def settle_imports() -> None:
    """Freeze the objects alive now (the imports' modules, classes and functions) and raise the
    youngest generation's threshold: call once a process has imported what its work needs."""
    if os.environ.get("COMPASS_TEST_GC") == "default":
        return
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
