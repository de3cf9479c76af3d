"""Float8 training graphs from torchao (``convert_to_float8_training`` with tensor parallelism and
sequence parallelism), forward and backward, on real gloo ranks (world 2 and 4): the pairs are
found and decomposed, and the loss, the input gradient and every weight gradient equal eager.

gloo has no float8 collectives: the gathers of float8 data move their bytes (``float8_gloo``).

torchao 0.18 installs beside torch 2.13.0+cpu with ``pip install --no-deps torchao`` (it declares
no dependencies and leaves torch alone); on CPU it prints that its CUDA extensions do not load,
which nothing here needs.  It is the ``test`` extra; without it these tests skip.

The three graph shapes torchao gives a sequence-parallel ``norm -> w1 -> relu -> w2`` block:

* ``tensorwise`` with torchao's float8 TP styles (``Float8ColwiseParallel`` /
  ``Float8RowwiseParallel``, torchtitan's choice for tensorwise): the float8 data is gathered, its
  one scale all-reduced (max) beside it; backward gathers the float8 output gradient and feeds
  both the input-gradient ``_scaled_mm`` and the weight-gradient ``_scaled_mm(clone(t(g)), h)``.
* ``rowwise`` with the plain TP styles (torchtitan's choice for row-wise): the bf16 rows are
  gathered, then each row's amax gives its scale and the rows are cast to float8: one scale per
  gathered row, computed row by row, so each part quantizes its own rows.  Its backward takes
  ``_scaled_mm`` with unit scales and multiplies the result by the outer product of the scales
  before the reduce-scatter; its weight gradients scale the tokens column-wise (over all rows).
* ``rowwise`` with the float8 TP styles: float8 data gathered with one scale, then repeated
  into one scale per row.

Tolerances: every decomposed part multiplies the same float8 values by the same scales (a row's
scale depends on that row only), so the input-side products are the same dot products as in
eager; the weight gradient's parts are summed in float32 before the one bf16 rounding.  Outputs
and gradients are bf16 (8 bits of mantissa, a relative step of 2**-8 = 0.4%), so 1e-2 relative
and absolute allows a couple of bf16 roundings landing the other way in float32 re-association.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao.float8", reason="torchao (the `test` extra) is not installed")

pytestmark = pytest.mark.slow  # torchao float8 blocks compiled on 2 and 4 ranks

DIM, HIDDEN, TOKENS = 32, 64, 32
CONFIGS = {  # name: (torchao recipe, float8 TP styles?)
    "tensorwise": ("tensorwise", True),
    "rowwise": ("rowwise", False),
    "rowwise_f8_styles": ("rowwise", True),
    "tensorwise_plain": ("tensorwise", False),  # one amax over all the gathered rows: left alone
}
FOUND = ("tensorwise", "rowwise", "rowwise_f8_styles")


class FeedForward(torch.nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.w1 = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = torch.nn.Linear(HIDDEN, DIM, bias=False)
        self.checkpointed = checkpointed

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:  # activation checkpointing: the backward recomputes the block
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        return self.block(x)


def build(config: str, mesh) -> torch.nn.Module:
    """The block in bf16, converted to torchao float8 training, then parallelized (SP on tokens)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    checkpointed = config.endswith("_ac")
    recipe, float8_styles = CONFIGS[config.removesuffix("_ac")]
    torch.manual_seed(7)
    model = FeedForward(checkpointed).to(torch.bfloat16)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))
    colwise, rowwise = (Float8ColwiseParallel, Float8RowwiseParallel) if float8_styles else (ColwiseParallel,
                                                                                             RowwiseParallel)
    return parallelize_module(model, mesh, {"norm": SequenceParallel(sequence_dim=0),
                                            "w1": colwise(input_layouts=Shard(0)),
                                            "w2": rowwise(output_layouts=Shard(0))})


def _options(strategy: str, inner: str) -> dict:
    return {"inner": inner, **({"chunks": 2} if strategy == "decompose" else {"strategy": strategy})}


def _run(rank: int, world: int, config: str, strategies: list[str], inner: str = "eager") -> dict:
    """Eager once, then the block compiled with each strategy (one shared trace, :mod:`shared_trace`),
    each compared with eager: per strategy its pairs, skips and GEMM dtypes."""
    import contextlib
    import traceback

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from float8_block import assert_step_close, training_step
    from float8_gloo import float8_gathers_on_gloo, float8_gemms_as_cuda_takes_them
    from shared_trace import Variants

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(11)
    x = torch.randn(TOKENS, DIM, generator=g).to(torch.bfloat16).chunk(world)[rank].contiguous()
    variants = Variants([_options(s, inner) for s in strategies])
    results = {}
    layouts = float8_gemms_as_cuda_takes_them() if inner == "inductor" else contextlib.nullcontext()
    with float8_gathers_on_gloo(), layouts:
        expected = training_step(build(config, mesh), x)
        model = build(config, mesh)
        compiled = torch.compile(model, backend=variants, fullgraph=True)
        for i, strategy in enumerate(strategies):
            variants.select(i)
            try:
                assert_step_close(training_step(model, x, compiled), expected)
            except Exception:  # noqa: BLE001 - reported by the strategy's own test
                results[strategy] = {"error": traceback.format_exc()}
                dist.barrier()
                continue
            dist.barrier()
            reports = variants.reports[i]
            results[strategy] = {
                "pairs": [(p.graph, p.kind, p.status, p.parts, p.matmuls) for r in reports for p in r.pairs],
                "skipped": [(s.graph, s.kind, s.reason) for r in reports for s in r.skipped],
                "gemm_dtypes": sorted({p.gemm_dtype or p.dtype for r in reports for p in r.pairs})}
    return results


def _result(ranks, tmp_path_factory, world: int, config: str, strategy: str, inner: str = "eager") -> dict:
    """Rank 0's result for ``strategy``; every strategy the tests check on this block, world size and
    inner compiler shares one trace, run once per session (:mod:`session_cache`)."""
    from session_cache import computed_once

    strategies = STRATEGIES.get((world, config, inner), [strategy])
    key = f"float8-{world}-{config}-{inner}-{'-'.join(strategies)}"
    group = computed_once(tmp_path_factory, key, lambda: ranks(world).run(_run, world, config, strategies, inner))
    res = group[0][strategy]
    assert "error" not in res, res["error"]
    return res


# The strategies checked on each (world, config, inner): one trace for all of them.
STRATEGIES = {**{(2, c, "eager"): ["off", "decompose", "auto"] for c in ("tensorwise", "rowwise", "rowwise_f8_styles")},
              **{(4, c, "eager"): ["decompose", "auto"] for c in ("tensorwise", "rowwise")}}


def _found(res: dict) -> list[tuple[str, str, int]]:
    return [(graph, kind, matmuls) for graph, kind, _, _, matmuls in res["pairs"]]


# Both graphs of every config: the gather feeding w1 (forward) and the output gradient's gather
# feeding w2's input-gradient GEMM and, where the gathered gradient is float8 with one scale (the
# float8 styles), its weight-gradient GEMM too (backward); the
# reduce-scatter after w2 (forward) and after w1's input-gradient GEMM (backward).
EXPECTED = {
    "tensorwise": [("forward", "all_gather_matmul", 1), ("forward", "matmul_reduce_scatter", 1),
                   ("backward", "all_gather_matmul", 2), ("backward", "matmul_reduce_scatter", 1)],
    "rowwise": [("forward", "all_gather_matmul", 1), ("forward", "matmul_reduce_scatter", 1),
                ("backward", "all_gather_matmul", 1), ("backward", "matmul_reduce_scatter", 1)],
}
EXPECTED["rowwise_f8_styles"] = EXPECTED["tensorwise"]  # its styles gather float8 gradients with one scale


@pytest.mark.parametrize("config", FOUND)
@pytest.mark.parametrize("strategy", ["off", "decompose", "auto"])
def test_torchao_float8_block_equals_eager_world2(ranks, tmp_path_factory, config, strategy):
    res = _result(ranks, tmp_path_factory, 2, config, strategy)
    assert sorted(_found(res)) == sorted(EXPECTED[config]), res
    status = {"off": {"kept"}, "decompose": {"rewritten"}}.get(strategy)
    if status is not None:
        assert {p[2] for p in res["pairs"]} == status, res
    if strategy == "decompose":
        assert {p[3] for p in res["pairs"]} == {2}, res
    assert all(dtype.startswith("float8") for dtype in res["gemm_dtypes"]), res
    # the only collectives left unpaired are the amax all-reduces (max) of the float8 scales
    assert all("reduce op 'max'" in why for _, _, why in res["skipped"]), res


@pytest.mark.parametrize("config", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("strategy", ["decompose", "auto"])
def test_torchao_float8_block_equals_eager_world4(ranks, tmp_path_factory, config, strategy):
    res = _result(ranks, tmp_path_factory, 4, config, strategy)
    assert sorted(_found(res)) == sorted(EXPECTED[config]), res
    if strategy == "decompose":
        assert {(p[2], p[3]) for p in res["pairs"]} == {("rewritten", 2)}, res


def test_tensorwise_scaling_of_gathered_bf16_is_left_alone_with_the_reason(ranks, tmp_path_factory):
    """torchao's tensorwise recipe with the plain TP styles gathers bf16 and takes one amax over
    all the gathered rows: no part can be cast before every part has arrived."""
    res = _result(ranks, tmp_path_factory, 2, "tensorwise_plain", "decompose")
    assert [p[1] for p in res["pairs"]] == ["matmul_reduce_scatter"] * 2, res
    reasons = [s[2] for s in res["skipped"] if s[1] == "all_gather_matmul"]
    assert len(reasons) == 2 and all("mixes rows" in why for why in reasons), res



@pytest.mark.inductor
@pytest.mark.parametrize("config", ["tensorwise", "rowwise"])
def test_torchao_float8_block_decomposed_under_inductor_equals_eager(ranks, tmp_path_factory, config):
    """Inductor checks a float8 GEMM's strides (B column-major, row scales with last stride 1),
    and lays out a B shared by the parts, or a part's [rows, 1] scales, its own way unless told:
    the rewrite tells it.  (``rowwise_f8_styles`` is not here: Inductor's own compile of that
    graph, without any rewrite, already differs from eager by more than the tolerance, float8
    roundings of values its fused casts compute slightly differently.)"""
    res = _result(ranks, tmp_path_factory, 2, config, "decompose", "inductor")
    assert sorted(_found(res)) == sorted(EXPECTED[config]), res
    assert {(p[2], p[3]) for p in res["pairs"]} == {("rewritten", 2)}, res


@pytest.mark.parametrize("config", ["tensorwise", "rowwise"])
def test_torchao_float8_block_with_activation_checkpointing_equals_eager(ranks, tmp_path_factory, config):
    """The backward gathers the tokens again for the recomputed forward: that gather's row GEMM is
    decomposed, and w1's weight gradient, whose other operand is the recomputed forward's own
    gradient (it needs every part anyway), takes the whole gathered tensor."""
    res = _result(ranks, tmp_path_factory, 2, f"{config}_ac", "decompose")
    recomputed = ("backward", "all_gather_matmul", 1)
    assert sorted(_found(res)) == sorted(EXPECTED[config] + [recomputed]), res
    assert {(p[2], p[3]) for p in res["pairs"]} == {("rewritten", 2)}, res
