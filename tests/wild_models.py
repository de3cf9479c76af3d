"""Small TP models whose graphs have the shapes seen in the wild (issue 5), one per shape.

Each model takes the process group (all ranks build it with the same seed, so weights agree) and
its input is this rank's shard; ``WILD`` maps a name to (builder, input shape, what the graph shows).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as fc
from torch import nn
from torch.utils.checkpoint import checkpoint

D, H = 16, 32


def _gather_along(x: torch.Tensor, gather_dim: int, group) -> torch.Tensor:
    """torch 2.11's functional gather along ``gather_dim`` as its ``all_gather_tensor`` computes it (one
    gather of the rows, then the ranks' chunks concatenated along the dim), written out: Dynamo 2.11
    refuses to trace that function's dim > 0 path (``_maybe_view_chunk_cat`` is marked skipped)."""
    c10d = torch.ops._c10d_functional
    name = fc._resolve_group_name(group)
    world = torch.distributed.distributed_c10d._get_group_size_by_name(name)
    rows = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), world, name))
    return rows if gather_dim == 0 else torch.cat(rows.chunk(world), dim=gather_dim)


# The functional gather and reduce-scatter along a dim: torch 2.13's names, or what torch 2.11 had
# before them (2.13 keeps the old names as deprecated aliases of the new).
all_gather_single = getattr(fc, "all_gather_single", None) or _gather_along
reduce_scatter_single = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape) / shape[-1] ** 0.5)


class EinsumBmm(nn.Module):
    """einsum and bmm against a broadcast weight instead of nn.Linear (3-D bmm-form linears)."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group, self.w1, self.w2 = group, _param(D, H), _param(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # x: [B, S/W, D]
        g = all_gather_single(x, 1, self.group)               # [B, S, D]
        h = torch.relu(torch.einsum("bsd,dh->bsh", g, self.w1))
        y = torch.bmm(h, self.w2.expand(h.shape[0], H, D))
        return reduce_scatter_single(y, "sum", 1, self.group)


class ReshapeChain(nn.Module):
    """reshape(-1), view and _unsafe_view chains between the collectives and plain mms."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group, self.w1, self.w2 = group, _param(H, D), _param(D, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # x: [B, S/W, D]
        g = all_gather_single(x, 1, self.group)
        h = torch.mm(g.reshape(-1, D), self.w1.t())
        h = torch.relu(h.view(x.shape[0], -1, H)).reshape(-1, H).unsqueeze(0).flatten(0, 1)
        y = torch.matmul(h, self.w2.t()).reshape(x.shape[0], -1, D)
        return reduce_scatter_single(y, "sum", 1, self.group)


class DtypeCasts(nn.Module):
    """bf16 communication around fp32 matmuls: a cast between each collective and its matmul."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group
        self.w1, self.w2 = nn.Linear(D, H, bias=False), nn.Linear(H, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # x: [T/W, D]
        g = all_gather_single(x.to(torch.bfloat16), 0, self.group)
        y = self.w2(torch.relu(self.w1(g.float())))
        return reduce_scatter_single(y.to(torch.bfloat16), "sum", 0, self.group).float()


class SharedUses(nn.Module):
    """The gathered tensor feeds two matmuls and a norm; the matmul result is used after the reduce too."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group
        self.w1, self.w3 = nn.Linear(D, H, bias=False), nn.Linear(D, H, bias=False)
        self.w2 = nn.Linear(H, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # x: [T/W, D]
        g = all_gather_single(x, 0, self.group)
        h = torch.relu(self.w1(g)) * self.w3(g) + g.norm(dim=-1, keepdim=True)
        y = self.w2(h)
        r = fc.all_reduce(y, "sum", self.group)
        return r + torch.tanh(y)


class Checkpointed(nn.Module):
    """A sequence-parallel MLP block under torch.utils.checkpoint: the backward graph recomputes it."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group
        self.w1, self.w2 = nn.Linear(D, H, bias=False), nn.Linear(H, D, bias=False)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        g = all_gather_single(x, 0, self.group)
        y = self.w2(torch.relu(self.w1(g)))
        return reduce_scatter_single(y, "sum", 0, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # x: [T/W, D]
        return x + checkpoint(self.block, x, use_reentrant=False)


class Unmatched(nn.Module):
    """Collectives that are not matmul pairs: a max-reduce, a gather on the last dim, a scaled addmm."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group, self.w = group, _param(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # x: [T/W, D]
        m = fc.all_reduce((x @ self.w).detach(), "max", self.group)  # no backward for max
        c = all_gather_single(x, 1, self.group)               # [T/W, W*D]: last dim
        s = torch.addmm(x, x, self.w, beta=0.5)
        return m.sum() + c.sum() + reduce_scatter_single(s, "sum", 0, self.group).sum()


WILD: dict[str, tuple[Callable, tuple[int, ...]]] = {
    "einsum_bmm": (EinsumBmm, (2, 4, D)),
    "reshape_chain": (ReshapeChain, (2, 4, D)),
    "dtype_casts": (DtypeCasts, (8, D)),
    "shared_uses": (SharedUses, (8, D)),
    "checkpointed": (Checkpointed, (8, D)),
    "unmatched": (Unmatched, (8, D)),
}


def build(name: str, group, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return WILD[name][0](group)


def shard_input(name: str, rank: int, seed: int = 1) -> torch.Tensor:
    """Rank-dependent input (a shard): different on every rank."""
    g = torch.Generator().manual_seed(seed + 1000 * rank)
    return torch.randn(*WILD[name][1], generator=g)
