"""ds_vshape.hf's embedding layer runs the token embedding alone where the trace shows that this is all
the first block receives, and the base model's hollowed forward everywhere else."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from typing import Any

import pytest
import torch
from torch import nn
from transformers.models.llama import modeling_llama

from ds_vshape import hf
from ds_vshape.hf.layers import HFEmbedding, _make_plan

from test_hf import ARCHS, make_batch, make_config, make_model

# The token embedding is all the first block receives (Gemma2 scales inside its embedding module);
# GPT-2 adds position embeddings, GPT-NeoX runs a dropout module, Granite multiplies the embeddings.
ALONE = {"llama", "mistral", "qwen2", "qwen3", "gemma2"}


def _embedding(model: nn.Module) -> HFEmbedding:
    specs, _ = hf.pipeline_layers(model)
    layer = specs[0].build()
    assert isinstance(layer, HFEmbedding)
    return layer.train()


def _hollowed(layer: HFEmbedding, ids: torch.Tensor) -> torch.Tensor:
    """The layer's output through the base model's own forward, whatever its plan."""
    alone, layer._alone = layer._alone, False
    try:
        return layer(ids)[0]
    finally:
        layer._alone = alone


@pytest.mark.parametrize("arch", ARCHS)
def test_embedding_runs_alone_only_where_the_first_block_receives_its_output(arch: str) -> None:
    layer = _embedding(make_model(arch))
    assert layer._alone is (arch in ALONE)
    ids, _ = make_batch(3)
    hidden, key_mask = layer(ids)
    assert torch.equal(hidden, _hollowed(layer, ids)) and torch.equal(key_mask, torch.ones_like(ids))
    grads = torch.autograd.grad(hidden.square().sum(), [p for p in layer.parameters() if p.requires_grad])
    reference = torch.autograd.grad(_hollowed(layer, ids).square().sum(), [p for p in layer.parameters() if p.requires_grad])
    assert all(torch.equal(a, b) for a, b in zip(grads, reference))


def test_embedding_alone_builds_no_mask_and_no_rotary(monkeypatch: pytest.MonkeyPatch) -> None:
    # What it is for: the base model's forward builds a mask and rotary outputs nobody on the layer receives.
    layer = _embedding(make_model("llama"))
    built: list[str] = []
    real_mask = modeling_llama.create_causal_mask

    def mask(*args: Any, **kwargs: Any) -> Any:
        built.append("mask")
        return real_mask(*args, **kwargs)

    monkeypatch.setattr(modeling_llama, "create_causal_mask", mask)
    rotary = layer.body.get_submodule("rotary_emb")
    rotary.register_forward_hook(lambda *_: built.append("rotary"))
    ids, _ = make_batch(4)
    layer(ids)
    assert built == []
    _hollowed(layer, ids)
    assert built == ["mask", "rotary"]


def test_a_model_traced_in_eval_mode_keeps_the_base_models_forward() -> None:
    # In eval mode a dropout hands its input on as it is: the trace cannot tell one is there.
    model = make_model("llama").eval()
    assert not _make_plan(model, attn_implementation=None, dtype=None, mask_padding=True).anatomy.embedding_alone
    model.train()
    assert _make_plan(model, attn_implementation=None, dtype=None, mask_padding=True).anatomy.embedding_alone


def test_an_in_place_change_before_the_first_block_keeps_the_base_models_forward() -> None:
    # The first block receives the embedding's output object, but changed in place since the embedding ended.
    model = make_model("llama")

    def scale(_module: nn.Module, args: tuple[Any, ...]) -> None:
        args[0].mul_(2.0)

    model.model.layers[0].register_forward_pre_hook(scale)
    plan = _make_plan(model, attn_implementation=None, dtype=None, mask_padding=True)
    assert not plan.anatomy.embedding_alone


def test_a_padded_model_masks_its_key_mask_the_same_way() -> None:
    config = make_config("llama", pad_token_id=0)
    specs, _ = hf.pipeline_layers(config)
    layer = specs[0].build().train()
    assert layer._alone
    ids = torch.tensor([[5, 6, 0, 0], [7, 0, 8, 9]])
    hidden, key_mask = layer(ids)
    assert torch.equal(key_mask, (ids != 0).long()) and torch.equal(hidden, _hollowed(layer, ids))
