"""The package's import graph follows the pipeline: no module imports a later stage, and no two
modules import each other, directly or around a cycle.

Stages, earliest first: the machine's description (``machine``: topology, presets, detection, GPU
datasheets, calibration) and the argument types of the command line; the pure parts that price and
run on it (``cost``, ``kernels``) and what every stage shares (``graph``, ``options``,
``report``); finding and deciding (``passes.match``, ``agree``, ``decide``); the rewrites
(``lowering``); the pair kinds, each with its matching and its surgery, and the finding over them
(the other ``passes`` modules); the pass on top (``graph_pass``) beside the entry points (backend,
explain), and the
tools beside them (``tools``: commands, sweep, calibration driver, timeline picture); the CLI last.
Inside ``kernels`` the same rule holds one level down: the pure plans (``schedules``, then
``protocol``, then ``issue_order``), what runs them (``simulate``, ``reference``, then the ``cuda`` path), the
``torch.library`` surface (``ops``), the package last; and of the kernels the stages before the
finding import only the pure plans (the cost model prices them; it never runs an operator).
Imports inside functions count too.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent / "compass_fx"

STAGES = {"machine": 0, "cli_args": 0, "groups": 0,  # cli_args: argument types; groups: process groups by name
          "cost": 1, "kernels": 1, "graph": 1, "options": 1, "report": 1,
          "lowering": 3,
          "tools": 5, "cli": 6}  # passes: 2 (finding, deciding) or 4 (the pass); anything else (entry points): 5
FINDING_AND_DECIDING = {"passes.match", "passes.agree", "passes.decide"}
KERNEL_STAGES = {"kernels.schedules": 0, "kernels.protocol": 1, "kernels.flag_codes": 1,  # the plans: pure Python
                 "kernels.issue_order": 2, "kernels.graph_order": 2,
                 "kernels.simulate": 3, "kernels.reference": 3, "kernels.cuda": 4,  # what runs them
                 "kernels.ops": 5, "kernels": 6}  # the torch.library surface, then the package
PURE_PLANS = ("kernels.schedules", "kernels.protocol", "kernels.issue_order", "kernels.graph_order")


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


def _kernel_stage(module: str) -> int:
    """The stage inside ``kernels`` of the table's longest entry that ``module`` is or lies under."""
    keys = [k for k in KERNEL_STAGES if module == k or module.startswith(k + ".")]
    return KERNEL_STAGES[max(keys, key=len)]


def _in_kernels(module: str) -> bool:
    return module == "kernels" or module.startswith("kernels.")


def test_no_module_imports_a_later_stage():
    g = _graph()
    backwards = [f"{a} (stage {_stage(a)}) imports {b} (stage {_stage(b)})"
                 for a, b in g.edges if _stage(b) > _stage(a)]
    assert not backwards, "\n".join(backwards)


def test_the_rewrites_never_import_the_passes():
    g = _graph()
    bad = [(a, b) for a, b in g.edges if a.startswith("lowering") and b.startswith("passes")]
    assert not bad, bad


def test_no_module_cycle():
    cycles = [sorted(c) for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
    assert not cycles, cycles


def test_the_machine_prices_nothing_and_the_tools_serve_only_the_cli():
    g = _graph()
    machine_out = [(a, b) for a, b in g.edges if a.startswith("machine") and not b.startswith("machine")]
    assert not machine_out, machine_out
    into_tools = [(a, b) for a, b in g.edges if b.startswith("tools") and not a.startswith(("tools", "cli"))]
    assert not into_tools, into_tools


def test_detection_builds_a_topology_never_the_reverse():
    g = _graph()
    assert g.has_edge("machine.detect", "machine.topology")
    assert not nx.has_path(g, "machine.topology", "machine.detect")


def test_every_kernels_module_has_its_stage():
    unplaced = [m for m in _graph() if _in_kernels(m) and m != "kernels"
                and not any(m == k or m.startswith(k + ".") for k in KERNEL_STAGES if k != "kernels")]
    assert not unplaced, f"add to KERNEL_STAGES: {unplaced}"


def test_inside_the_kernels_no_module_imports_a_later_stage():
    g = _graph()
    backwards = [f"{a} (kernel stage {_kernel_stage(a)}) imports {b} (kernel stage {_kernel_stage(b)})"
                 for a, b in g.edges if _in_kernels(a) and _in_kernels(b) and _kernel_stage(b) > _kernel_stage(a)]
    assert not backwards, "\n".join(backwards)


def test_the_stages_before_the_finding_import_only_the_pure_plans_of_the_kernels():
    g = _graph()
    bad = [(a, b) for a, b in g.edges
           if not _in_kernels(a) and _stage(a) <= 1 and _in_kernels(b)
           and not any(b == p or b.startswith(p + ".") for p in PURE_PLANS)]
    assert not bad, bad


def test_the_pure_plans_import_only_the_standard_library():
    impure = []
    for module in PURE_PLANS:
        path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and not node.level else [])
            impure += [(module, n) for n in names
                       if n.split(".")[0] not in sys.stdlib_module_names and n != "__future__"]
    assert not impure, impure
