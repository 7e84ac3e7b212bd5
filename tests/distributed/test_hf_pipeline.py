"""Hugging Face causal LMs trained pipeline-parallel on real gloo ranks: losses equal the model's own."""

from __future__ import annotations

from typing import Any

import pytest

from .launch import launch
from .test_engine import _assert_parity, _by_case

pytestmark = pytest.mark.distributed
# Granite and Gemma2 post-process their logits (scaling, soft-capping); GPT-NeoX passes its cache as layer_past.
MODELS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gpt_neox", "granite", "gemma2")
SCHEDULES = ("1f1b", "v-half")


def _cases() -> list[dict[str, Any]]:
    return [{"name": f"{k}-{s}", "hf": k, "schedule": s, "p": 2, "m": 4} for k in MODELS for s in SCHEDULES]


@pytest.fixture(scope="module")
def hf_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return _by_case(launch(_cases(), 2, tmp_path_factory.mktemp("hf"), nccl="lazy"))


@pytest.mark.parametrize("case", [c["name"] for c in _cases()])
def test_hf_pipeline_matches_model_loss(hf_results: dict, case: str) -> None:
    _assert_parity(case, hf_results[case])
