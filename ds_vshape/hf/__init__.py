"""Split a Hugging Face decoder-only causal LM into DeepSpeed pipeline layers.

``pipeline_layers(model)`` returns ``(layers, loss_fn)`` for
``deepspeed.pipe.PipelineModule(layers=layers, loss_fn=loss_fn, ...)``:

* ``HFEmbedding``    - everything the model runs before its first decoder block
  (token embedding, learned position embedding, embedding scale/dropout, ...).
* ``HFDecoderBlock`` - one decoder block each.
* ``HFFinalNorm``    - the final norm, only when the LM head is tied to the
  input embedding (the head itself is then a ``TiedLayerSpec`` of the embedding).
* ``HFLMHead``       - final norm + LM head, when the head is not tied.

Layer interface: the first layer takes ``input_ids`` (LongTensor ``[b, s]``,
or a 1-tuple holding it); every other layer takes and returns
``(hidden [b, s, h] float, key_mask [b, s] int64)`` where ``key_mask`` is 1 for
real tokens and 0 for padding (all ones when padding is not masked); the last
layer returns logits ``[b, s, vocab]``.  ``loss_fn(logits, labels)`` is the
shifted next-token cross-entropy transformers uses for ``labels=`` (ignore
index -100, mean over the non-ignored targets).

How the model is understood, without lists of class names: the model's own
forward is run once on the ``meta`` device (no memory, no FLOPs) with hooks on
every module and with the ``transformers.masking_utils`` mask builders
temporarily wrapped.  The recording tells which ``ModuleList`` holds the
decoder blocks, what runs before, between and after them, and with which
arguments each block is called.  Every block argument must be rebuildable from
the sequence alone: the hidden state, the mask builder that produced its
attention mask (re-run per block), the rotary module that produced its
position embeddings (re-run per block; it has no weights), ``arange`` position
ids, the model's KV cache (recognised by identity: the trace hands the model an
empty cache, and whatever argument *is* that object, ``past_key_values``,
``cache``, ``layer_past`` or any other name, is the cache; None outside
sequence chunks), or a plain constant.  Anything else raises ``ValueError``
with the reason.  The prologue is not re-implemented at all: layer 0 runs the
model's own base model with its block list emptied and its final norm replaced
by identity.  What the LM's forward does to the head's output (Granite's
``logits_scaling``, Gemma2's ``final_logit_softcapping``) is recorded with a
``TorchFunctionMode`` and replayed by the last layer.

Supported: decoder-only causal LMs whose blocks are fed only the hidden state
plus the above; tied or untied linear LM heads; one final norm (or none);
right or left padding through ``config.pad_token_id``, masked exactly like
``attention_mask=(input_ids != pad)`` (``mask_padding=False`` turns it off).
Tested exact (fp32, against the model's own forward, loss and SGD steps; also
in sequence chunks) on transformers 4.56.2 and 5.24.0 for GPT-2, Llama, Mistral
(sliding window), Qwen2 (mixed full/sliding layers), Qwen3, GPT-NeoX, Granite
and Gemma2 (eager).  A one-off check on both versions found Gemma, Gemma3 text,
Phi, Phi3, OLMo2, StarCoder2 and Cohere exact too, and on 5.24 Falcon, OPT,
Mixtral and GPT-J (on 4.56 these are refused: their masks are not built with
``masking_utils``, or the MoE routing cannot run on meta).  Refused with
``ValueError``: bidirectional attention (BERT-style encoders), no linear LM
head or no causal-LM class (T5), logit post-processing that is not a function
of each position's logits alone, other losses, blocks needing other tensors
(Bloom's ALiBi), weighted modules between blocks.  Not supported: KV caches
for generation, packed sequences with position resets, remote code.

Weights: from a directory only ``*.safetensors`` checkpoints (single or
sharded) written with the model's module names are read (or with the names
transformers 5 renames on load, e.g. GPT-NeoX's ``embed_out``; weights it
converts, such as merged experts, are not); a base-model-only checkpoint
without the prefix works too.  Each layer reads only its own
tensors when built.  Note DeepSpeed's ``partition_method="parameters"`` builds
(and so loads) every layer on every rank to count parameters: use
``"uniform"``, ``"type:HFDecoderBlock"`` or ``parameter_counts()`` instead.

Sequence chunks (Seq1F1B): inside ``with seq_chunk(state, start=b, end=e):``
the layers run on positions ``[b, e)`` only and attend to the keys/values of
``[0, e)`` kept per stage and micro-batch in a ``ChunkKVState``; backward runs
chunks in descending order with ``state.backward_roots(j)`` as extra roots,
then ``state.release(j)`` (see ``attention``).  Exact for eager/sdpa attention
(checked for the models above).  ``seq_chunk_refusal(layers)`` says, before any
forward, why a model cannot run in chunks (other attention kernels, layer
types other than full/sliding-window, length-dependent rotary, blocks not
storing keys/values through the model's cache); ``ds_vshape.initialize``
raises it on every rank.

Layout: ``loss`` (the loss), ``cache_role`` (the empty cache the trace hands
the model), ``tracing`` (the meta-device trace and the recipes that replay its
calls), ``analysis`` (the model's anatomy and the checks that refuse
unsupported models), ``logits`` (recording and replaying logit
post-processing), ``semantics`` (the LM-head/loss check), ``weights``
(checkpoint reading, materialising, per-layer loading), ``kv_buffer`` (one K/V
buffer per layer for a micro-batch's chunks), ``chunkable`` (which models can
run in chunks), ``attention`` (sequence chunks), ``layers`` (the layer classes,
``pipeline_layers`` and ``seq_chunk_refusal``); each depends only on those
before it.
"""

from __future__ import annotations

from .attention import ChunkKVState, seq_chunk
from .layers import (
    HFDecoderBlock,
    HFEmbedding,
    HFFinalNorm,
    HFLMHead,
    parameter_counts,
    pipeline_layers,
    seq_chunk_refusal,
)
from .loss import IGNORE_INDEX, causal_lm_loss

__all__ = [
    "IGNORE_INDEX",
    "ChunkKVState",
    "HFDecoderBlock",
    "HFEmbedding",
    "HFFinalNorm",
    "HFLMHead",
    "causal_lm_loss",
    "parameter_counts",
    "pipeline_layers",
    "seq_chunk",
    "seq_chunk_refusal",
]
