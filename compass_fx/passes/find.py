"""Find every pair of a graph at once: each collective is matched once, by its kind."""
from __future__ import annotations

import logging

import torch.fx as fx

from ..graph.nodes import PART_MARK
from ..graph.pairs import Pair
from ..report import SkipRecord
from . import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
from .match import NoMatch
from .pair_kind import PairKind

log = logging.getLogger("compass_fx")

KINDS: tuple[PairKind, ...] = (all_gather_matmul.KIND, matmul_reduce_scatter.KIND, matmul_all_reduce.KIND)
_BY_NAME = {kind.name: kind for kind in KINDS}


def kind_of(pair: Pair) -> PairKind:
    """The kind that matched ``pair``."""
    return _BY_NAME[pair.kind]


def collectives(graph: fx.Graph) -> list[tuple[fx.Node, PairKind]]:
    """Every collective a pair kind starts from, in graph order (found through FX's index of
    nodes by target, not by walking the graph), with its kind; a rewrite's own parts left out."""
    found = [(node, kind) for kind in KINDS
             for node in graph.find_nodes(op="call_function", target=kind.collective, sort=False)
             if not node.meta.get(PART_MARK)]  # part collectives made by a rewrite are never matched again
    return sorted(found, key=lambda nk: nk[0])


def find_pairs(gm: fx.GraphModule, graph_kind: str, group: str | None = None) -> tuple[list[Pair], list[SkipRecord]]:
    """Every pair in ``gm`` (in graph order) and the collectives that were not paired, with reasons."""
    pairs: list[Pair] = []
    skips: list[SkipRecord] = []
    for node, kind in collectives(gm.graph):
        outcome = match_one(node, kind, graph_kind, group)
        (skips if isinstance(outcome, SkipRecord) else pairs).append(outcome)
    return pairs, skips


def match_one(node: fx.Node, kind: PairKind, graph_kind: str, group: str | None) -> Pair | SkipRecord:
    """The pair at the collective ``node``, or the record of why it is left alone (logged)."""
    try:
        group_name = str(node.args[-1])
        if group is not None and group_name != group:
            raise NoMatch(f"group {group_name!r} is not the optimised group {group!r}")
        return kind.match(node, graph_kind)
    except NoMatch as e:
        log.info("compass_fx: %s graph: %s %s left untouched: %s", graph_kind, kind.name, node.name, e)
        return SkipRecord(graph_kind, node.name, kind.name, str(e))
