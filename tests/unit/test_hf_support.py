"""ds_vshape.hf: the model's KV cache found by its role, and which models run in sequence chunks, decided up front."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import inspect
from typing import Optional, Union

import pytest
import torch
from transformers import AutoModelForCausalLM, Llama4TextConfig
from transformers.cache_utils import Cache, DynamicCache

from ds_vshape import hf
from ds_vshape.hf import cache_role
from ds_vshape.hf import chunkable as hf_chunkable
from ds_vshape.hf.tracing import Kind, Recipe

from test_hf import ARCHS, VOCAB, make_config, make_model  # tests/unit is on sys.path under pytest


def _plan(specs: list) -> object:
    return specs[0].module_args[0]


def _cache_args(recipe: Recipe) -> list[str]:
    return [arg.name for arg in (*recipe.positional, *recipe.keyword) if arg.kind is Kind.CACHE]


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_argument_is_recognised_whatever_its_name(arch: str) -> None:
    model = make_model(arch)
    specs, _ = hf.pipeline_layers(model)
    plan = _plan(specs)
    anatomy = plan.anatomy
    layers = plan.lm.get_submodule(anatomy.layers)
    for index, recipe in enumerate(anatomy.block_recipes):
        names = _cache_args(recipe)
        # Exactly one argument, and it is a parameter of the block's own forward (GPT-2 passes it positionally).
        assert len(names) == 1 and names[0] in inspect.signature(layers[index].forward).parameters, names
    assert all(anatomy.stores_kv)  # every block stored its keys/values through that cache when traced
    assert len(_cache_args(anatomy.base_recipe)) == 1  # so positions start after earlier chunks
    if arch == "gpt_neox":  # the name that no list of cache names had
        assert _cache_args(anatomy.block_recipes[0]) == ["layer_past"]
    assert hf.seq_chunk_refusal(specs) is None


def _llama4_text() -> torch.nn.Module:
    config = Llama4TextConfig(hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
                              num_hidden_layers=2, num_local_experts=2, attention_chunk_size=4)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _sdpa_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config("llama"), attn_implementation="sdpa")


def test_refusal_is_known_from_the_specs_and_from_built_layers() -> None:
    # Llama 4 runs as a plain pipeline, but its chunked-attention layers are not supported in chunks.
    specs, _ = hf.pipeline_layers(_llama4_text())
    expected = "model type 'llama4_text' cannot run in sequence chunks: layer types ['chunked_attention']"
    assert (hf.seq_chunk_refusal(specs) or "").startswith(expected)
    model = _sdpa_llama()
    specs, _ = hf.pipeline_layers(model)
    built = [spec.build() for spec in specs]
    assert hf.seq_chunk_refusal(specs) is None and hf.seq_chunk_refusal(built) is None
    model.config._attn_implementation = "flex_attention"  # e.g. switched after the layers were made
    for layers in (specs, built):
        assert "attention implementation 'flex_attention' is not verified exact" in (hf.seq_chunk_refusal(layers) or "")
    assert hf.seq_chunk_refusal([torch.nn.Linear(2, 2)]) is None  # not judged here (initialize refuses it by type)


def test_blocks_not_handed_or_not_using_the_cache_are_refused() -> None:
    model = _sdpa_llama()
    recipe = _plan(hf.pipeline_layers(model)[0]).anatomy.block_recipes[0]
    assert hf_chunkable.chunk_refusal(model.config, recipe) is None
    without = Recipe(recipe.positional, tuple(arg for arg in recipe.keyword if arg.kind is not Kind.CACHE))
    assert "not handed the model's KV cache" in (hf_chunkable.chunk_refusal(model.config, without) or "")
    unused = hf_chunkable.chunk_refusal(model.config, recipe, stores_kv=False)
    assert "stores no keys/values through its update" in (unused or "")


def test_cache_typed_parameters() -> None:
    is_cache = cache_role._is_cache_type
    assert is_cache(Cache) and is_cache(DynamicCache) and is_cache(Optional[Cache]) and is_cache(Cache | None)
    assert is_cache(Optional[Union[tuple[tuple[torch.Tensor]], Cache]])  # GPT-2's base model on transformers 4.5x
    assert is_cache("Optional[Cache]") and is_cache("Cache | None")  # postponed annotations
    assert not is_cache(Optional[tuple[tuple[torch.Tensor]]])  # GPT-2's LM on 4.5x: the base model gets it instead
    assert not is_cache("Optional[MambaCache]") and not is_cache(torch.Tensor) and not is_cache(inspect.Parameter.empty)
