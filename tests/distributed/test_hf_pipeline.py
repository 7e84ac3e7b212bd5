"""Hugging Face causal LMs trained pipeline-parallel on real gloo ranks: losses equal the model's own."""

from __future__ import annotations

from typing import Any

import pytest

from .launch import ALL_RULES, by_case, launch
from .test_engine import _assert_parity

pytestmark = pytest.mark.distributed
# Granite and Gemma2 post-process their logits (scaling, soft-capping); GPT-NeoX passes its cache as layer_past.
MODELS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gpt_neox", "granite", "gemma2")
SCHEDULES = ("1f1b", "v-half")


def _cases() -> list[dict[str, Any]]:
    return [{"name": f"{k}-{s}", "hf": k, "schedule": s, "p": 2, "m": 4} for k in MODELS for s in SCHEDULES] + _ckpt_cases() + _in_b_cases()


def _ckpt_cases() -> list[dict[str, Any]]:
    """DeepSpeed's activation checkpointing on a Llama: the first block takes integer token ids, which
    reentrant checkpointing cannot give a gradient path; the embedding must still get its gradient.
    Parameters are compared too (``seq``: matched by value), not only losses."""
    base = {"hf": "llama", "p": 2, "m": 4, "seq": True}
    return [{"name": "llama-ckpt1-1f1b", **base, "schedule": "1f1b", "ckpt": 1},
            {"name": "llama-ckpt1-v-half", **base, "schedule": "v-half", "ckpt": 1},
            # The embedding and a decoder layer in one block: the layer after the embedding is checkpointed.
            {"name": "llama-ckpt2-zb-h1", **base, "schedule": "zb-h1", "ckpt": 2},
            {"name": "llama-ckpt1-nonreentrant-v-zb", **base, "schedule": "v-zb", "ckpt": 1,
             "pipeline": {"use_reentrant": False}}]


def _in_b_cases() -> list[dict[str, Any]]:
    """``pipeline.weight_grads_in_b``: attention's weight gradients computed in B, parameters compared too.
    Last, a pattern that matches nothing on any rank: every rank must refuse it alike (none left waiting)."""
    base = {"hf": "llama", "p": 2, "m": 4, "seq": True}
    return [{"name": f"llama-in-b-{s}", **base, "schedule": s, "pipeline": {"weight_grads_in_b": ["*self_attn*"]}}
            for s in ("v-half", "zb-h1")] + [
        # w_memory 0.5: the schedule counts half of a unit's activation as kept until W, so the engine fits W to it.
        {"name": "llama-w-half-v-half", **base, "schedule": "v-half", "pipeline": {"w_memory": 0.5}}] + [
        {"name": "llama-in-b-unmatched", **base, "schedule": "v-half",
         "pipeline": {"weight_grads_in_b": ["*self_attn*", "*selfattn*"]}}]


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return by_case(launch(_cases(), 2, tmp_path_factory.mktemp("hf"), nccl="lazy", **ALL_RULES))


@pytest.mark.parametrize("case", [c["name"] for c in _cases() if "ckpt" not in c and "pipeline" not in c])
def test_hf_pipeline_matches_model_loss(hf_results: dict, case: str) -> None:
    _assert_parity(case, hf_results[case])


@pytest.mark.parametrize("case", [c["name"] for c in _ckpt_cases()])
def test_checkpointed_embedding_gets_its_gradient(hf_results: dict, case: str) -> None:
    ranks = hf_results[case]
    _assert_parity(case, ranks)
    assert all(res["params_compared"] > 0 for res in ranks), case
    assert any(res["embedding_checked"] for res in ranks), f"{case}: no rank compared the embedding"


@pytest.mark.parametrize("case", ["llama-in-b-v-half", "llama-in-b-zb-h1", "llama-w-half-v-half"])
def test_attention_weight_grads_in_b_train_exactly(hf_results: dict, case: str) -> None:
    ranks = hf_results[case]
    _assert_parity(case, ranks)
    assert all(res["params_compared"] > 0 for res in ranks), case
    # Every rank holds decoder blocks here: each computes some GEMM weight gradients in B (attention's, or the fit's).
    assert all(res["in_b_matrices"] > 0 for res in ranks), [res["in_b_matrices"] for res in ranks]


def test_w_keeps_within_the_schedules_w_memory(hf_results: dict) -> None:
    """V-Half with w_memory 0.5 counts half of a unit's activation as kept from B to W: after each
    stage's first B, W keeps at most that share of what the forward saved, by computing some
    weight gradients in B (exact: the parity tests above run the same cases; here within the
    share of W's work the schedule can take before it falls behind 1F1B). At the default
    w_memory 1 nothing moves; schedules whose bound does not count it (1F1B, ZB-H1) are left alone."""
    for rank, res in enumerate(hf_results["llama-w-half-v-half"]):
        fitted = res["w_fit"]
        assert len(fitted) == 2, (rank, fitted)  # both of the rank's stages, once each
        for stage, (saved, kept, after) in fitted.items():
            # Fitted, or left whole: a stage whose cheapest group (the head alone) is more of its W work than
            # the schedule can take into B and stay ahead of 1F1B (schedules.fit_limit) moves nothing.
            assert saved > 0 and (after <= 0.5 * saved or after == kept), (rank, stage, saved, kept, after)
        assert any(after <= 0.5 * saved < kept for saved, kept, after in fitted.values()), (rank, fitted)
        assert res["in_b_matrices"] > 0, (rank, res["in_b_matrices"])
    for rank, res in enumerate(hf_results["llama-v-half"]):
        assert res["in_b_matrices"] == 0 and res["w_fit"] == {}, (rank, res["in_b_matrices"], res["w_fit"])
    for case in ("llama-1f1b", "llama-in-b-zb-h1"):
        assert all(res["w_fit"] == {} for res in hf_results[case]), case


def test_unmatched_in_b_pattern_is_refused_on_every_rank(hf_results: dict) -> None:
    for rank, res in enumerate(hf_results["llama-in-b-unmatched"]):
        assert "pipeline.weight_grads_in_b: pattern '*selfattn*' matches no module" in res.get("error", ""), (rank, res)
