"""Make every rank of a group take the same decision for a pair, or fail clearly.

Ranks can see different local information (a calibration file or a cost hook on one rank only,
a different measured number): if each rewrote its graph on its own, the ranks would issue
different collectives and hang.  So the group's first rank decides; the others adopt its
decision through the default c10d store, check that they matched the same pair, and
acknowledge.  A pair that differs between ranks, or a rank that never arrives within the
store's timeout, raises ``RankDisagreement`` on every rank instead of hanging.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections import defaultdict

import torch.distributed as dist

from ..cost.decision import Decision
from ..graph.pairs import Pair
from ..groups import default_store, find_group, publish

log = logging.getLogger("compass_fx")

_calls: dict[str, int] = defaultdict(int)  # agreements so far, per group: the store key's sequence


class RankDisagreement(RuntimeError):
    """The ranks of a group cannot agree on a pair (different graphs, or a rank missing)."""


def agree(pair: Pair, local: Decision) -> Decision:
    """The decision of the group's first rank for ``pair`` (``local`` there), the same on every rank."""
    group = _group(pair.group_name)
    if group is None:
        return local
    ranks = dist.get_process_group_ranks(group)
    me, leader = dist.get_rank(), ranks[0]
    store = default_store()
    if store is None:
        raise RankDisagreement(f"compass_fx: {pair.describe()}: no key-value store to agree through "
                               "(torch.distributed's default group has none)")
    _calls[pair.group_name] += 1
    key = f"compass_fx/agree/{pair.group_name}/{_calls[pair.group_name]}"
    mine = {"pair": pair.describe(), "graph": pair.graph_name, "strategy": local.strategy,
            "parts": local.parts, "schedule": local.schedule}
    if me == leader:
        publish(store, key, mine)
        problems = [_get(store, f"{key}/ack/{r}", pair, r) for r in ranks[1:]]
        problems = [p for p in problems if p != "ok"]
        if problems:
            raise RankDisagreement(f"compass_fx: ranks disagree on {pair.describe()}: {problems[0]}")
        return local
    theirs = json.loads(_get(store, key, pair, leader))
    problem = _mismatch(pair, mine, theirs)
    store.set(f"{key}/ack/{me}", problem or "ok")
    if problem:
        raise RankDisagreement(f"compass_fx: ranks disagree on {pair.describe()}: {problem}")
    if (theirs["strategy"], theirs["parts"], theirs["schedule"]) == (local.strategy, local.parts, local.schedule):
        return local
    log.info("compass_fx: rank %d adopts rank %d's decision for %s: %s (its own: %s)", me, leader,
             pair.describe(), theirs["strategy"], local.label)
    return dataclasses.replace(local, strategy=theirs["strategy"], parts=theirs["parts"],
                               schedule=theirs["schedule"],
                               reason=f"agreed with rank {leader} (local choice was {local.label})")


def _mismatch(pair: Pair, mine: dict, theirs: dict) -> str | None:
    if (theirs["pair"], theirs["graph"]) != (mine["pair"], mine["graph"]):
        return (f"rank {dist.get_rank()} matched {mine['graph']} {mine['pair']} where the group's first "
                f"rank matched {theirs['graph']} {theirs['pair']} (graphs differ between ranks)")
    if theirs["strategy"] == "decompose" and theirs["parts"] not in pair.feasible_parts():
        return f"parts={theirs['parts']} chosen by the first rank does not divide this rank's pair"
    return None


def _get(store: dist.Store, key: str, pair: Pair, rank: int) -> str:
    try:
        return store.get(key).decode()
    except Exception as e:  # noqa: BLE001 - a store timeout; name the pair and the rank
        raise RankDisagreement(
            f"compass_fx: rank {rank} did not reach {pair.graph_name} pair {pair.describe()} within the "
            f"store timeout (do all ranks compile the same graphs?): {e}") from None


def _group(name: str) -> dist.ProcessGroup | None:
    """The real process group to agree over, or None (no distributed, one rank, fake group)."""
    try:
        group = find_group(name)
    except ValueError:  # no distributed run, or an unknown name: nothing to agree with
        return None
    if group.size() <= 1 or dist.get_backend(group) == "fake":
        return None
    return group
