"""The package's import graph follows the pipeline: no module imports a later stage.

Stages, earliest first: the pure parts (``cost``, ``kernels``), what every stage shares
(``graph``, ``options``, ``report``), finding and deciding (``passes.match``, ``agree``,
``decide``), the rewrites (``lowering``), the pass on top (``passes.run``) and the entry points.
Imports inside functions count too.  Cycles between modules are listed exactly: one that goes
away must leave the list (so the list only shrinks), and a new one fails.
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent / "compass_fx"

STAGES = {"cost": 0, "kernels": 0, "cli_args": 0,  # cli_args: argument types, imports nothing
          "graph": 1, "options": 1, "report": 1,
          "lowering": 3}  # passes: 2 (finding, deciding) or 4 (the pass); anything else: 5
FINDING_AND_DECIDING = {"passes.match", "passes.agree", "passes.decide"}

# Known cycles (issue 14 removes them); each entry is one strongly connected set of modules.
KNOWN_CYCLES = [
    # the machine description and the GPU constants read each other (detection builds a topology,
    # a topology detects; a calibration is checked against a topology's GPU)
    {"cost.calibrate", "cost.detect", "cost.gemm", "cost.gpus", "cost.topology"},
]


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    base = module.split(".") if is_package else module.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*anchor, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("compass_fx"):
                target = node.module[len("compass_fx"):].lstrip(".")
            else:
                continue
            out.update(f"{target}.{a.name}" if target else a.name for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name[len("compass_fx"):].lstrip(".") for a in node.names if a.name.startswith("compass_fx"))
    return out


def _graph() -> nx.DiGraph:
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for mod, path in modules.items():
        for target in _imports(path, mod):
            while target and target not in modules:  # "pkg.name" imports a name from pkg
                target = target.rpartition(".")[0]
            if target in modules and target != mod:
                g.add_edge(mod, target)
    return g


def _stage(module: str) -> int:
    if module in FINDING_AND_DECIDING:
        return 2
    top = module.split(".")[0]
    return 4 if top == "passes" else STAGES.get(top, 5)


def test_no_module_imports_a_later_stage():
    g = _graph()
    backwards = [f"{a} (stage {_stage(a)}) imports {b} (stage {_stage(b)})"
                 for a, b in g.edges if _stage(b) > _stage(a)]
    assert not backwards, "\n".join(backwards)


def test_the_rewrites_never_import_the_passes():
    g = _graph()
    bad = [(a, b) for a, b in g.edges if a.startswith("lowering") and b.startswith("passes")]
    assert not bad, bad


def test_module_cycles_are_only_the_known_ones():
    cycles = [c for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
    assert sorted(map(sorted, cycles)) == sorted(map(sorted, KNOWN_CYCLES)), cycles
