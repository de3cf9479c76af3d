"""What a pair kind is: the collective it starts from, how it is matched, which strategies its
lowering can take (and why not), and the surgery for each.  One module per kind fills one in
(``all_gather_matmul``, ``matmul_reduce_scatter``, ``matmul_all_reduce``); the pass asks the kind,
never switches on it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch.fx as fx

from ..cost.decision import Decision
from ..graph.pairs import Pair

Matcher = Callable[[fx.Node, str], Pair]
Refusals = Callable[[Pair], dict[str, str]]
Surgery = Callable[[Any, Pair, Decision, bool], bool]


@dataclass(frozen=True)
class PairKind:
    """One kind of matmul<->collective site.

    * ``match(collective, graph_kind)``: the Pair at this collective, or ``NoMatch`` with the
      reason; it looks only at the collective's neighbourhood.
    * ``refusals(pair)``: strategy -> why this pair's lowering cannot take it, checked before
      anything is priced (so "auto" never chooses what the lowering would then refuse).
    * ``lower(builder, pair, decision, asynchronous)``: build the rewrite with a
      ``lowering.NodeBuilder`` (the transaction commits or rolls it back); True when the fused call
      runs asynchronously.
    * ``parts_replayed(pair)``: whether an eager step runs this pair's decomposed parts' collectives
      from one CUDA graph (the cost model then prices an extra part as replayed); none by default.
    """

    name: str
    collective: object  # the functional collective op this kind starts from
    match: Matcher
    refusals: Refusals
    lower: Surgery
    parts_replayed: Callable[[Pair], bool] = lambda pair: False
