"""A stack of sequence-parallel float8 blocks from torchao, to measure the pass on float8 graphs at depth.

Each layer is ``x + w2(relu(w1(norm(x))))`` with tokens sharded on the sequence (dim 0): the
gather before ``w1``, the reduce-scatter after ``w2``, and in the backward graph the gather of the
output gradient (``w2``'s input and weight gradients) and the reduce-scatter of ``w1``'s input
gradient, all in float8 ``_scaled_mm`` after torchao's ``convert_to_float8_training``:

* ``tensorwise``: torchao's float8 TP styles (torchtitan's choice for the tensorwise recipe; float8
  data gathered with one scale beside it);
* ``rowwise``: the plain TP styles (torchtitan's choice for the row-wise recipe; bf16 rows gathered,
  then each row quantized with its own scale, which every part replays on its rows).

Used by ``benchmarks/compile_time.py --model torchao-float8-tensorwise`` (and ``-rowwise``); needs
torchao (the ``test`` extra).
"""
from __future__ import annotations

import torch

DIM, HIDDEN = 32, 64
RECIPES = {"tensorwise": True, "rowwise": False}  # recipe: with torchao's float8 TP styles?


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.w1 = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = torch.nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class Stack(torch.nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build(recipe: str, layers: int, mesh) -> torch.nn.Module:
    """``layers`` float8 layers (bf16 weights, torchao's ``recipe``), tensor- and sequence-parallel on ``mesh``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    if recipe not in RECIPES:
        raise ValueError(f"recipe {recipe!r}: one of {sorted(RECIPES)}")
    torch.manual_seed(7)
    model = Stack(layers).to(torch.bfloat16)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    colwise, rowwise = (Float8ColwiseParallel, Float8RowwiseParallel) if RECIPES[recipe] else (ColwiseParallel,
                                                                                               RowwiseParallel)
    for layer in model.layers:
        parallelize_module(layer, mesh, {"norm": SequenceParallel(sequence_dim=0),
                                         "w1": colwise(input_layouts=Shard(0)),
                                         "w2": rowwise(output_layouts=Shard(0))})
    return model


def tokens(per_rank: int) -> torch.Tensor:
    """One rank's share of the sequence: ``per_rank`` tokens of ``DIM`` in bf16."""
    return torch.randn(per_rank, DIM, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
