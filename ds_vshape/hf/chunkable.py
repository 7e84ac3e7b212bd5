"""Whether a model can run in sequence chunks exactly: the checks, from its config and traced blocks.

``chunk_refusal`` says why a model (and one of its decoder blocks) cannot
run in chunks, or None: attention kernels not verified exact, layer types
other than full and sliding-window attention, rotary variants that depend on
the length seen so far, blocks not handed the model's KV cache (recorded as
``Kind.CACHE`` by the trace, whatever the argument's name) or not storing
keys/values through it.  Everything it reads is known before the first
forward, so ``ds_vshape.initialize`` refuses on every rank (see
``layers.seq_chunk_refusal``); ``attention`` checks again per forward.
Everything here is internal to ``ds_vshape.hf``.
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from .tracing import Kind, Recipe

__all__ = [
    "chunk_refusal",
    "chunk_refusal_message",
]

# Only these were verified exact; flash/flex kernels read position ids and
# pick their own alignment, which has not been checked here.
_ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")
# Rotary variants whose frequencies depend on the longest position seen so
# far: a chunk ending early would get different frequencies than the whole.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
_LAYER_TYPES = ("full_attention", "sliding_attention")


def chunk_refusal_message(config: PretrainedConfig, block: Recipe | None, *, stores_kv: bool = True) -> str | None:
    """``model type '...' cannot run in sequence chunks: <reason>``, or None when it can."""
    reason = chunk_refusal(config, block, stores_kv=stores_kv)
    if reason is None:
        return None
    model_type = getattr(config, "model_type", type(config).__name__)
    return f"model type {model_type!r} cannot run in sequence chunks: {reason}"


def chunk_refusal(config: PretrainedConfig, block: Recipe | None, *, stores_kv: bool = True) -> str | None:
    """Why this model (and this decoder block, if given) cannot be chunked exactly, or None."""
    text = config.get_text_config()
    implementation = getattr(text, "_attn_implementation", None)
    if implementation not in _ATTENTION_IMPLEMENTATIONS:
        supported = ", ".join(_ATTENTION_IMPLEMENTATIONS)
        return f"attention implementation {implementation!r} is not verified exact (supported: {supported})"
    odd_layers = sorted(set(getattr(text, "layer_types", None) or ()) - set(_LAYER_TYPES))
    if odd_layers:
        return f"layer types {odd_layers} are not supported (only {_LAYER_TYPES})"
    rope_types = _rope_types(getattr(text, "rope_parameters", None)) | _rope_types(getattr(text, "rope_scaling", None))
    varying = sorted(t for t in rope_types if any(kind in t for kind in _LENGTH_DEPENDENT_ROPE))
    if varying:
        return f"rotary type(s) {varying} change with the sequence length seen so far"
    if block is None:
        return None
    if not any(arg.kind is Kind.CACHE for arg in (*block.positional, *block.keyword)):
        return ("its decoder blocks are not handed the model's KV cache (no block argument is the cache its forward "
                "passes on), so earlier chunks' keys/values cannot be fed in")
    if not stores_kv:
        return ("a decoder block is handed the model's KV cache but stores no keys/values through its update, so "
                "its attention cannot see earlier chunks")
    return None


def _rope_types(parameters: Any) -> set[str]:
    # rope_parameters is one dict, or one dict per layer type (e.g. Gemma3).
    if not isinstance(parameters, dict):
        return set()
    found = {str(parameters["rope_type"])} if "rope_type" in parameters else set()
    for value in parameters.values():
        found |= _rope_types(value)
    return found
