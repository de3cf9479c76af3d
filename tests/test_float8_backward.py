"""Float8 training backward graphs built by hand (no torchao): a sequence-parallel float8 block
whose autograd Functions do what Megatron-LM's sequence-parallel linears do, with tensorwise
``_scaled_mm`` everywhere, on real gloo ranks (world 2 and 4), strategy off / decompose / auto.

* column-parallel ``w1``: forward gathers the bf16 tokens and casts them to float8; backward
  reduce-scatters the input gradient ``_scaled_mm(g, w1)``; its weight gradient uses the float8
  tokens saved by the forward.  (Megatron-LM gathers them again in the backward to save memory;
  under torch.compile that gather lands in the forward graph all the same, since AOTAutograd's
  partitioner saves collectives rather than recompute them, so it is not built here.)
* row-parallel ``w2``: forward reduce-scatters ``_scaled_mm(h, w2)``; backward gathers the bf16
  output gradient and casts it to float8 (e5m2), which feeds the input gradient
  ``_scaled_mm(g, w2)`` and the weight gradient ``_scaled_mm(clone(t(g)), h)``, whose contraction
  dim is the gathered rows.

Scales are per-tensor constants (delayed scaling), so that the test is about the rewrite: the
same graphs with amax-derived scales come from torchao in ``test_float8_torchao.py``.  The block
and the comparison with eager (tolerances there) are ``float8_block``'s, gathering bf16 rows.
"""
from __future__ import annotations

import pytest


def _run(rank: int, world: int, strategy: str) -> dict:
    from float8_block import compiled_equals_eager
    from float8_gloo import float8_gathers_on_gloo

    with float8_gathers_on_gloo():
        reports = compiled_equals_eager(rank, world, strategy, gather_bytes=False)
    return {"pairs": sorted((p.graph, p.kind, p.matmuls, p.status, p.parts) for r in reports for p in r.pairs),
            "skipped": [s.reason for r in reports for s in r.skipped]}


# forward: the gather before w1, the reduce-scatter after w2; backward: the output gradient's
# gather (w2's input and weight gradients), the reduce-scatter of w1's input gradient
FOUND = [("backward", "all_gather_matmul", 2), ("backward", "matmul_reduce_scatter", 1),
         ("forward", "all_gather_matmul", 1), ("forward", "matmul_reduce_scatter", 1)]


@pytest.mark.parametrize("world,strategy", [(2, "off"), (2, "decompose"), (2, "auto"),
                                            pytest.param(4, "decompose", marks=pytest.mark.slow),
                                            pytest.param(4, "auto", marks=pytest.mark.slow)])
def test_float8_block_forward_and_backward_equal_eager(ranks, world, strategy):
    res = ranks(world).run(_run, world, strategy)[0]
    assert [p[:3] for p in res["pairs"]] == FOUND, res
    assert res["skipped"] == [], res
    if strategy != "auto":
        expected = ("kept", 1) if strategy == "off" else ("rewritten", 2)
        assert {p[3:] for p in res["pairs"]} == {expected}, res


def _run_inductor(rank: int, world: int) -> dict:
    from float8_block import compiled_equals_eager
    from float8_gloo import float8_gathers_on_gloo, float8_gemms_as_cuda_takes_them

    with float8_gathers_on_gloo(), float8_gemms_as_cuda_takes_them():
        reports = compiled_equals_eager(rank, world, "decompose", gather_bytes=False, inner="inductor")
    return {"pairs": sorted((p.graph, p.kind, p.matmuls, p.status) for r in reports for p in r.pairs)}


@pytest.mark.slow  # Inductor's CPU compile of both graphs
def test_float8_block_decomposed_under_inductor_keeps_the_layouts_cuda_takes(ranks):
    """Every float8 GEMM of the decomposed block, as Inductor lays its operands out, takes A
    row-major and B column-major, as CUDA's does (an H100 refused a weight gradient's part whose A
    Inductor had laid out column-major); and the step equals eager."""
    res = ranks(2).run(_run_inductor, 2)[0]
    assert [p[:3] for p in res["pairs"]] == FOUND and all(p[3] == "rewritten" for p in res["pairs"]), res
