"""Split backward parks exactly what W needs: each parameter GEMM's input (shared with autograd's saved
tensor) and output gradient, nothing more (``benchmarks/kept_share.py``).

Bytes only, no timing. The floor is checked twice: against the benchmark's hook-based count and against
the Llama block's formula written out by hand, so a wrong floor cannot make a wrong park look right.
"""

from __future__ import annotations

import pytest

from benchmarks.kept_share import MICRO_BATCH, LayerKept, Stage, gemm_floor, gemm_groups, layer_stages, measure_layer

SEQ = 16
HIDDEN, FFN, VOCAB = 64, 176, 256  # the recipe's tiny Llama (recipes/train_hf.py SIZES["tiny"])
F32 = 4


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def rows(request: pytest.FixtureRequest) -> dict[str, LayerKept]:
    stages: list[Stage] = layer_stages(size="tiny", attn=request.param, seq_len=SEQ)
    return {s.kind: measure_layer(s) for s in stages}


def test_block_floor_is_the_llama_formula(rows: dict[str, LayerKept]) -> None:
    tokens = MICRO_BATCH * SEQ
    block = rows["decoder block"]
    # Distinct GEMM inputs: norm output (q, k, v), attention output (o), norm output (gate, up), act * up (down).
    assert block.floor_inputs == tokens * (3 * HIDDEN + FFN) * F32
    # Output gradients: q, k, v, o, down (hidden wide); gate, up (FFN wide).
    assert block.floor_grads == tokens * (5 * HIDDEN + 2 * FFN) * F32


@pytest.mark.parametrize("kind", ["embedding", "decoder block", "head+loss"])
def test_parked_is_the_floor(rows: dict[str, LayerKept], kind: str) -> None:
    r = rows[kind]
    # The inputs W keeps are the very storages autograd saved, the rest are the output gradients.
    assert (r.parked_inputs, r.parked_grads) == (r.floor_inputs, r.floor_grads), r
    assert r.parked == r.parked_inputs + r.parked_grads == r.floor
    assert r.saved_split == r.saved_plain  # routing saves what a plain forward saves


def test_head_keeps_logits_gradient(rows: dict[str, LayerKept]) -> None:
    tokens = MICRO_BATCH * SEQ
    assert rows["head+loss"].floor == tokens * (HIDDEN + VOCAB) * F32


def test_block_groups_split_the_floor() -> None:
    # Attention and MLP read different norms' outputs: deferring one group keeps exactly its part of the floor.
    block = layer_stages(size="tiny", attn="sdpa", seq_len=SEQ)[1]
    groups = gemm_groups(block.module)
    assert [g.rpartition(".")[2] for g in groups] == ["self_attn", "mlp"]
    parts = [gemm_floor(block, group=g) for g in groups]
    assert tuple(map(sum, zip(*parts))) == gemm_floor(block)
