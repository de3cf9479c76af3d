"""Small tensor-parallel models for the tests, each built the same way on every rank.

``build(name, mesh)`` returns the parallelized model and ``example_input(name, rank, world)`` this
rank's input; the same seed gives the same weights, so two builds compare eager with compiled.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from compass_fx.demo import ModelArgs, Transformer, parallelize

DIM, HIDDEN, TOKENS = 16, 32, 32


class MLP(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=bias)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(self.norm(x))))


MODELS = ("tp_mlp", "sp0_mlp", "sp0_mlp_bias", "sp1_llama", "tp_llama")


def build(name: str, mesh) -> nn.Module:
    torch.manual_seed(1234)
    if name == "tp_mlp":
        return parallelize_module(MLP(bias=True), mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    if name in ("sp0_mlp", "sp0_mlp_bias"):
        return parallelize_module(MLP(bias=name.endswith("bias")), mesh, {
            "norm": SequenceParallel(sequence_dim=0),
            "w1": ColwiseParallel(input_layouts=Shard(0)),
            "w2": RowwiseParallel(output_layouts=Shard(0)),
        })
    if name in ("sp1_llama", "tp_llama", "sp1_llama_b1"):
        args = ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=64, ffn_hidden=64)
        return parallelize(Transformer(args), mesh, sequence_parallel=name.startswith("sp1"))
    raise ValueError(name)


def example_input(name: str, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    if name.endswith("llama"):
        return torch.randint(0, 64, (2, 16), generator=g)
    if name.endswith("llama_b1"):  # batch 1: each rank's gathered slab is one run of rows
        return torch.randint(0, 64, (1, 16), generator=g)
    full = torch.randn(TOKENS, DIM, generator=g)
    if name == "tp_mlp":
        return full
    return full.chunk(world)[rank].contiguous()  # sequence parallel: this rank's rows


def loss_of(out: torch.Tensor) -> torch.Tensor:
    if hasattr(out, "to_local"):
        out = out.to_local()
    return (out.float() ** 2).mean() + out.float().sum() * 1e-2


def local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = g.to_local() if hasattr(g, "to_local") else g
    return grads
