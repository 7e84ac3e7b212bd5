"""Sequence chunks (Seq1F1B) in the engine: Hugging Face models trained in chunks equal the unchunked model.

One 2-rank launch (with the refusals), one 4-rank launch and one 2-rank launch under NCCL's rules: each case trains
three steps (fp32, clipping, labels with -100 inside and at the start of a chunk) and compares
losses and every parameter with the model's own ``labels=`` training, then evaluates (unchunked)
once.
"""

from __future__ import annotations

from typing import Any

import pytest

from .launch import ALL_RULES, by_case, launch
from .test_engine import _assert_parity

pytestmark = pytest.mark.distributed
# Grouped-query attention with rotary; learned positions with a tied head; partial rotary with the cache passed
# as layer_past (GPT-NeoX).
MODELS = ("llama", "gpt2", "gpt_neox")
PIPELINES: dict[str, dict[str, Any]] = {
    "seq1f1b": {"schedule": "seq1f1b"},  # k = 2 by default
    "1f1b-k4": {"schedule": "1f1b", "seq_chunks": 4},
    "zb-h1-k2": {"schedule": "zb-h1", "seq_chunks": 2},
    "v-half-k2": {"schedule": "v-half", "seq_chunks": 2},
}


def _parity_cases() -> list[dict[str, Any]]:
    cases = [{"name": f"{model}-{name}", "hf": model, "seq": True, "schedule": pipeline["schedule"], "pipeline": pipeline,
              "p": 2, "m": 4, "eval": True} for model in MODELS for name, pipeline in PIPELINES.items()]
    # ZeRO-2 accepts sequence chunks: its once-per-step reduce must see every chunk's gradient.
    zero2 = {"name": "llama-v-half-k2-zero2", "hf": "llama", "seq": True, "schedule": "v-half", "zero": 2,
             "pipeline": PIPELINES["v-half-k2"], "p": 2, "m": 4, "eval": True}
    return cases + [zero2]


def _refusal_cases() -> list[dict[str, Any]]:
    return [
        {"name": "refuse-non-hf", "schedule": "1f1b", "pipeline": {"seq_chunks": 2}, "p": 2, "m": 4},
        {"name": "refuse-ckpt", "hf": "llama", "seq": True, "ckpt": 1, "schedule": "seq1f1b", "p": 2, "m": 4},
        # A ds_vshape.hf model that runs as a plain pipeline but not in chunks (chunked-attention layers).
        # Both ranks hold blocks; the refusal must come from initialize on both, not from the first
        # forward of rank 0 while rank 1 waits for its activations until p2p_timeout_s.
        {"name": "refuse-llama4", "hf": "llama4_text", "seq": True, "schedule": "seq1f1b", "p": 2, "m": 4,
         "attn": "sdpa"},
    ]


# p=4: every rank holds a middle stage (a rank that loads nothing places its chunks by what it
# received), v-half folds back at the last rank, and m=6 > p gives 1F1B a steady state. Six
# blocks, so that v-half's 8 stages all get a layer; llama runs SDPA here (eager at p=2).
PIPELINES_P4: dict[str, dict[str, Any]] = {
    "seq1f1b-k4": {"schedule": "seq1f1b", "seq_chunks": 4},
    "zb-h1-k2": {"schedule": "zb-h1", "seq_chunks": 2},
    "v-half-k4": {"schedule": "v-half", "seq_chunks": 4},
}


def _parity_cases_p4() -> list[dict[str, Any]]:
    return [{"name": f"p4-{model}-{name}", "hf": model, "attn": attn, "blocks": 6, "seq": True,
             "schedule": pipeline["schedule"], "pipeline": pipeline, "p": 4, "m": 6, "eval": True}
            for model, attn in (("llama", "sdpa"), ("gpt2", "eager")) for name, pipeline in PIPELINES_P4.items()]


@pytest.fixture(scope="module")
def seq_results_p4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return by_case(launch(_parity_cases_p4(), 4, tmp_path_factory.mktemp("seq_p4")))


@pytest.fixture(scope="module")
def seq_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return by_case(launch(_parity_cases() + _refusal_cases(), 2, tmp_path_factory.mktemp("seq")))


# The same parity under NCCL's point-to-point rules (tests/distributed/nccl_emulation, eager): the
# chunked schedules' transfers, in the pair order lowering fixes, on a split and a V schedule.
NCCL_CASES = [c for c in _parity_cases() if c["name"] in ("llama-seq1f1b", "gpt2-v-half-k2", "llama-zb-h1-k2")]


@pytest.fixture(scope="module")
def seq_results_nccl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return by_case(launch(NCCL_CASES, 2, tmp_path_factory.mktemp("seq_nccl"), nccl="lazy", **ALL_RULES))


@pytest.mark.parametrize("case", [c["name"] for c in NCCL_CASES])
def test_chunked_training_matches_model_under_nccl_rules(seq_results_nccl: dict, case: str) -> None:
    _assert_parity(case, seq_results_nccl[case])


@pytest.mark.parametrize("case", [c["name"] for c in _parity_cases()])
def test_chunked_training_matches_model(seq_results: dict, case: str) -> None:
    _check_chunked(case, seq_results[case])


def _check_chunked(case: str, ranks: list[dict[str, Any]]) -> None:
    _assert_parity(case, ranks)
    for rank, res in enumerate(ranks):
        assert res["params_compared"] > 0, f"{case} rank {rank}: no parameter compared"
        # eval_batch runs whole micro-batches (its forward-only schedule has no chunks).
        assert abs(res["eval_loss"] - res["ref_eval_loss"]) <= 1e-5, f"{case} rank {rank}: eval {res['eval_loss']}"


@pytest.mark.parametrize("case", [c["name"] for c in _parity_cases_p4()])
def test_chunked_training_matches_model_p4(seq_results_p4: dict, case: str) -> None:
    _check_chunked(case, seq_results_p4[case])


def test_non_hf_model_with_seq_chunks_is_refused(seq_results: dict) -> None:
    for res in seq_results["refuse-non-hf"]:
        assert "layer 0 (Block) is not a ds_vshape.hf layer" in res["error"], res
        assert "pipeline.seq_chunks=1" in res["error"]


def test_unsupported_model_is_refused_by_initialize_on_every_rank(seq_results: dict) -> None:
    ranks = seq_results["refuse-llama4"]
    assert len(ranks) == 2
    for rank, res in enumerate(ranks):
        assert "model type 'llama4_text' cannot run in sequence chunks: layer types ['chunked_attention']" in \
            res.get("error", ""), (rank, res)
        assert "set pipeline.seq_chunks=1" in res["error"]
        # Raised inside ds_vshape.initialize: no step ran, so no rank waited on a transfer (a rank left
        # waiting would report a p2p timeout after p2p_timeout_s instead of this refusal).
        frames = res["traceback"]
        assert "in initialize" in frames and "train_batch" not in frames, (rank, frames)


def test_activation_checkpointing_with_seq_chunks_is_refused(seq_results: dict) -> None:
    for res in seq_results["refuse-ckpt"]:
        assert "activation_checkpoint_interval=1 is not supported" in res["error"], res
        assert "lose the earlier chunks' keys/values" in res["error"]
