"""Make every rank of a group take the same decisions for a graph's pairs, or fail clearly.

Ranks can see different local information (a calibration file or a cost hook on one rank only,
a different measured number): if each rewrote its graph on its own, the ranks would issue
different collectives and hang.  So the group's first rank decides; the others adopt its
decisions through the default c10d store, check that they matched the same pairs, and
acknowledge: one round trip per graph and group, however many pairs the graph has.  A pair that
differs between ranks, a gloo group whose worker threads differ between ranks (a decomposed
gather's form follows them: ``lowering.decompose.gathers_blocking``), or a rank that never arrives
within the store's timeout, raises ``RankDisagreement`` on every rank instead of hanging.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections import defaultdict
from typing import Sequence

import torch.distributed as dist

from ..cost.decision import Decision
from ..graph.pairs import Pair
from ..groups import default_store, find_group, gloo_threads_of, publish

log = logging.getLogger("compass_fx")

_calls: dict[str, int] = defaultdict(int)  # agreements so far, per group: the store key's sequence


class RankDisagreement(RuntimeError):
    """The ranks of a group cannot agree on a pair (different graphs, or a rank missing)."""


def agree(pairs: Sequence[Pair], local: Sequence[Decision]) -> list[Decision]:
    """The decisions of each group's first rank for ``pairs`` (``local`` there), the same on every
    rank: one store round trip per process group of the graph, whatever its number of pairs."""
    agreed = list(local)
    by_group: dict[str, list[int]] = {}
    for i, pair in enumerate(pairs):
        by_group.setdefault(pair.group_name, []).append(i)
    for name, idx in by_group.items():  # in the order of the groups' first pairs: the same on every rank
        for i, decision in zip(idx, _agree_group(name, [pairs[i] for i in idx], [local[i] for i in idx])):
            agreed[i] = decision
    return agreed


def _agree_group(name: str, pairs: list[Pair], local: list[Decision]) -> list[Decision]:
    group = _group(name)
    if group is None:
        return local
    ranks = dist.get_process_group_ranks(group)
    me, leader = dist.get_rank(), ranks[0]
    what = _what(pairs)
    store = default_store()
    if store is None:
        raise RankDisagreement(f"compass_fx: {what}: no key-value store to agree through "
                               "(torch.distributed's default group has none)")
    _calls[name] += 1
    key = f"compass_fx/agree/{name}/{_calls[name]}"
    mine = [{"pair": p.describe(), "graph": p.graph_name, "strategy": d.strategy, "parts": d.parts,
             "schedule": d.schedule} for p, d in zip(pairs, local)]
    threads = gloo_threads_of(name)  # the lowering's gather form on gloo follows it (decompose.gathers_blocking)
    if me == leader:
        publish(store, key, {"pairs": mine, "gloo_threads": threads})
        problems = [_get(store, f"{key}/ack/{r}", what, r) for r in ranks[1:]]
        problems = [p for p in problems if p != "ok"]
        if problems:
            raise RankDisagreement(f"compass_fx: ranks disagree on {what}: {problems[0]}")
        return local
    published = json.loads(_get(store, key, what, leader))
    theirs = published["pairs"]
    problem = _mismatch(pairs, mine, theirs)
    if problem is None and published.get("gloo_threads") != threads:
        problem = (f"group {name!r} runs {threads} gloo worker thread(s) on rank {me} and "
                   f"{published.get('gloo_threads')} on rank {leader}, and a decomposed gather's form follows "
                   f"them: make every rank's groups inside compass_fx.gloo_worker_threads alike")
    store.set(f"{key}/ack/{me}", problem or "ok")
    if problem:
        raise RankDisagreement(f"compass_fx: ranks disagree on {what}: {problem}")
    return [_adopt(pair, decision, their, leader) for pair, decision, their in zip(pairs, local, theirs)]


def _adopt(pair: Pair, local: Decision, theirs: dict, leader: int) -> Decision:
    if (theirs["strategy"], theirs["parts"], theirs["schedule"]) == (local.strategy, local.parts, local.schedule):
        return local
    log.info("compass_fx: rank %d adopts rank %d's decision for %s: %s (its own: %s)", dist.get_rank(), leader,
             pair.describe(), theirs["strategy"], local.label)
    return dataclasses.replace(local, strategy=theirs["strategy"], parts=theirs["parts"],
                               schedule=theirs["schedule"],
                               reason=f"agreed with rank {leader} (local choice was {local.label})")


def _what(pairs: list[Pair]) -> str:
    """The pairs agreed on at once, named for an error: the first one and how many."""
    more = f" and {len(pairs) - 1} more" if len(pairs) > 1 else ""
    return f"{pairs[0].graph_name} pairs {pairs[0].describe()}{more}"


def _mismatch(pairs: list[Pair], mine: list[dict], theirs: list[dict]) -> str | None:
    for pair, m, t in zip(pairs, mine, theirs):
        if (t["pair"], t["graph"]) != (m["pair"], m["graph"]):
            return (f"rank {dist.get_rank()} matched {m['graph']} {m['pair']} where the group's first "
                    f"rank matched {t['graph']} {t['pair']} (graphs differ between ranks)")
        if t["strategy"] == "decompose" and t["parts"] not in pair.feasible_parts():
            return f"parts={t['parts']} chosen by the first rank does not divide this rank's pair {m['pair']}"
    if len(mine) != len(theirs):
        return (f"rank {dist.get_rank()} matched {len(mine)} pairs where the group's first rank matched "
                f"{len(theirs)} (graphs differ between ranks)")
    return None


def _get(store: dist.Store, key: str, what: str, rank: int) -> str:
    try:
        return store.get(key).decode()
    except Exception as e:  # noqa: BLE001 - a store timeout; name the pairs and the rank
        raise RankDisagreement(
            f"compass_fx: rank {rank} did not reach {what} within the store timeout (do all ranks "
            f"compile the same graphs?): {e}") from None


def _group(name: str) -> dist.ProcessGroup | None:
    """The real process group to agree over, or None (no distributed, one rank, fake group)."""
    try:
        group = find_group(name)
    except ValueError:  # no distributed run, or an unknown name: nothing to agree with
        return None
    if group.size() <= 1 or dist.get_backend(group) == "fake":
        return None
    return group
