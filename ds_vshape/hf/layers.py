"""The pipeline layer classes and ``pipeline_layers``, which turns a causal LM into them.

``pipeline_layers`` opens the model (instance, config or checkpoint
directory), traces and analyses it and returns lazily built ``LayerSpec``
objects for ``HFEmbedding``, one ``HFDecoderBlock`` per block, ``HFFinalNorm``
or ``HFLMHead``, plus ``causal_lm_loss``.  ``_Plan`` is what all those layer
builders share: the anatomy and where each part's weights come from.
``parameter_counts`` counts trainable parameters per layer on the meta skeleton.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from .analysis import analyse, Anatomy, hidden_of, is_ancestor
from .attention import block_runtime
from .chunkable import chunk_refusal_message
from .logits import LogitOps
from .loss import causal_lm_loss
from .semantics import check_head_semantics, hollow
from .tracing import Kind, trace_model
from .weights import Checkpoint, initialise, load_part, materialise, parameters_on_meta, stored_name_converter

__all__ = [
    "HFDecoderBlock",
    "HFEmbedding",
    "HFFinalNorm",
    "HFLMHead",
    "parameter_counts",
    "pipeline_layers",
    "seq_chunk_refusal",
]

# ------------------------------------------------------------------------- plan


class _Plan:
    """What every layer builder of one model shares: anatomy plus where weights come from.

    ``lm`` is either the user's model (parts are its own modules, no copy) or
    a skeleton with meta parameters (parts are copied, materialised and then
    loaded from ``checkpoint`` or freshly initialised).
    """

    def __init__(
        self,
        lm: PreTrainedModel,
        anatomy: Anatomy,
        *,
        checkpoint: Checkpoint | None,
        skeleton: bool,
        dtype: torch.dtype | None,
        pad_token_id: int | None,
        logit_ops: LogitOps | None,
    ) -> None:
        self.lm, self.anatomy, self.checkpoint = lm, anatomy, checkpoint
        self.skeleton, self.dtype, self.pad_token_id = skeleton, dtype, pad_token_id
        self.logit_ops = logit_ops  # the LM's own logit post-processing, replayed after the head
        self.dry = False  # True: build() returns the source modules untouched (for counting)

    def __repr__(self) -> str:
        source = self.checkpoint.directory if self.checkpoint else ("config" if self.skeleton else "instance")
        return f"HFModel({type(self.lm).__name__}, {self.anatomy.num_layers} blocks, from={source})"

    def build(self, path: str, replacements: Mapping[str, nn.Module] | None = None) -> nn.Module:
        part = self.lm.get_submodule(path)
        if replacements:
            part = hollow(part, replacements)
        if self.dry or not self.skeleton:
            return part
        part = materialise(copy.deepcopy(part), dtype=self.dtype)
        if self.checkpoint is not None:
            load_part(part, path, self.checkpoint)
        else:
            initialise(part, self.lm)
        return part

    def rope_paths(self, index: int) -> list[str]:
        recipe = self.anatomy.block_recipes[index]
        return sorted({arg.value.path for arg in recipe.keyword if arg.kind is Kind.ROPE})


# ------------------------------------------------------------------------ layers


def _unwrap(inputs: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    return inputs if isinstance(inputs, torch.Tensor) else inputs[0]


class HFEmbedding(nn.Module):
    """Layer 0: the model's own base-model forward with no blocks and no final norm, or the token
    embedding alone where the trace shows that its output is all the first block receives."""

    def __init__(self, plan: _Plan) -> None:
        super().__init__()
        anatomy = plan.anatomy
        hollowed: dict[str, nn.Module] = {anatomy.layers[len(anatomy.base) + 1 :]: nn.ModuleList()}
        if anatomy.norm is not None and is_ancestor(anatomy.base, anatomy.norm):
            hollowed[anatomy.norm[len(anatomy.base) + 1 :]] = nn.Identity()
        self.body = plan.build(anatomy.base, hollowed)
        self.embedding_path = anatomy.embedding
        # The token embedding alone where the trace shows that it is all the first block receives
        # (``direct_embedding``): the base model's forward would build masks and rotary outputs for nobody.
        self._alone = anatomy.embedding_alone
        self._recipe = anatomy.base_recipe
        self._pad_token_id = plan.pad_token_id
        self._logit_ops = plan.logit_ops
        self._config = plan.lm.config  # read only inside ds_vshape.hf.attention.seq_chunk

    def forward(self, input_ids: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = _unwrap(input_ids)
        pad = self._pad_token_id
        key_mask = torch.ones_like(ids) if pad is None else (ids != pad).long()
        if self._alone:  # looked up per call: the module may be replaced (wrapped, injected) after build
            return self.body.get_submodule(self.embedding_path)(ids), key_mask
        out = block_runtime(self._config, None, input_ids=ids, key_mask=key_mask).call(self.body, self._recipe)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden, key_mask

    def tied_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head sharing the token-embedding weight (tied input/output embeddings), then the LM's post-processing."""
        return _post_processed(F.linear(hidden, self.body.get_submodule(self.embedding_path).weight), self._logit_ops)


class HFDecoderBlock(nn.Module):
    """One decoder block; masks and rotary embeddings are rebuilt from the sequence."""

    def __init__(self, plan: _Plan, index: int) -> None:
        super().__init__()
        self.index = index
        self.block = plan.build(f"{plan.anatomy.layers}.{index}")
        # Each block owns a copy of the weight-free rotary module(s) it needs.
        self._rope_paths = plan.rope_paths(index)
        self.rotary = nn.ModuleList([plan.build(path) for path in self._rope_paths])
        self._recipe = plan.anatomy.block_recipes[index]
        self._stores_kv = plan.anatomy.stores_kv[index]
        self._config = plan.lm.config  # read only inside ds_vshape.hf.attention.seq_chunk

    def forward(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, key_mask = inputs[0], inputs[1]
        ropes = dict(zip(self._rope_paths, self.rotary, strict=True))
        runtime = block_runtime(
            self._config, self._recipe, stores_kv=self._stores_kv, hidden=hidden, key_mask=key_mask, ropes=ropes
        )
        out = runtime.call(self.block, self._recipe)
        return hidden_of(out), key_mask


class HFFinalNorm(nn.Module):
    """The final norm alone (used when the LM head is tied to the input embedding)."""

    def __init__(self, plan: _Plan) -> None:
        super().__init__()
        assert plan.anatomy.norm is not None
        self.norm = plan.build(plan.anatomy.norm)

    def forward(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.norm(inputs[0]), inputs[1]


class HFLMHead(nn.Module):
    """Final norm (if any), the untied LM head and the LM's own logit post-processing (if any); returns logits."""

    def __init__(self, plan: _Plan) -> None:
        super().__init__()
        norm = plan.anatomy.norm
        self.norm = plan.build(norm) if norm is not None else nn.Identity()
        self.head = plan.build(plan.anatomy.head)
        self._logit_ops = plan.logit_ops

    def forward(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        return _post_processed(self.head(self.norm(inputs[0])), self._logit_ops)


def _post_processed(logits: torch.Tensor, ops: LogitOps | None) -> torch.Tensor:
    # E.g. Granite's logits_scaling or Gemma2's soft-capping, as the LM's own forward applies them.
    return logits if ops is None else ops(logits)


def _tied_lm_head(embedding: HFEmbedding, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    return embedding.tied_logits(inputs[0])


# -------------------------------------------------------------------------- API


def pipeline_layers(
    model: PreTrainedModel | PretrainedConfig | str | os.PathLike[str],
    *,
    attn_implementation: str | None = None,
    dtype: torch.dtype | None = None,
    mask_padding: bool = True,
    tie_key: str = "embed",
) -> tuple[list[LayerSpec], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Pipeline layers and loss function for a decoder-only causal LM.

    Args:
        model: a causal-LM instance (layers then *are* its modules, no copy),
            a config (layers get the model's own random init), or a local
            ``save_pretrained`` directory (each layer reads only its tensors).
        attn_implementation: e.g. ``"sdpa"`` or ``"eager"`` for config/directory
            sources; default: what transformers picks. Set it on an instance yourself.
        dtype: parameter dtype for config/directory sources (default float32).
        mask_padding: mask ``config.pad_token_id`` tokens out of attention, like
            ``attention_mask=(input_ids != pad)``; ignored without a pad token.
        tie_key: ``TiedLayerSpec`` key used when input and output embeddings are tied.

    Returns:
        ``(layers, loss_fn)``: ``LayerSpec``/``TiedLayerSpec`` objects (built
        lazily by ``PipelineModule``, only on the stage that owns them) and
        ``causal_lm_loss``.

    Raises:
        ValueError: the model cannot be split; the message says why.
    """
    plan = _make_plan(model, attn_implementation=attn_implementation, dtype=dtype, mask_padding=mask_padding)
    return _layer_specs(plan, tie_key=tie_key), causal_lm_loss


def parameter_counts(layers: Sequence[LayerSpec | nn.Module]) -> list[int]:
    """Trainable parameters per layer, as DeepSpeed's ``partition_method="parameters"`` counts them.

    DeepSpeed counts by building every layer on every rank, which for a
    directory source reads all weights everywhere; for layers made by
    ``pipeline_layers`` this counts on the meta skeleton instead (no memory,
    no I/O).  Feed the result to your own partitioning.
    """
    return [_parameter_count(layer) for layer in layers]


def seq_chunk_refusal(layers: Sequence[LayerSpec | nn.Module]) -> str | None:
    """Why these ``pipeline_layers`` layers cannot run in sequence chunks exactly, or None when they can.

    Decided from the model's config and its trace alone, so every rank can ask before any
    forward: ``ds_vshape.initialize`` does for ``pipeline.seq_chunks > 1``, so that no rank
    refuses in its first forward while the others wait for its activations.  Layers that are
    not ``ds_vshape.hf`` layers are not judged here.
    """
    for layer in layers:
        reason = _layer_refusal(layer)
        if reason is not None:
            return reason
    return None


def _layer_refusal(layer: LayerSpec | nn.Module) -> str | None:
    if isinstance(layer, HFDecoderBlock):
        return chunk_refusal_message(layer._config, layer._recipe, stores_kv=layer._stores_kv)
    if isinstance(layer, HFEmbedding):
        return chunk_refusal_message(layer._config, None)
    if not isinstance(layer, LayerSpec) or not layer.module_args or not isinstance(layer.module_args[0], _Plan):
        return None
    plan = layer.module_args[0]
    if layer.typename is HFDecoderBlock:
        index = layer.module_args[1]
        recipe, stores_kv = plan.anatomy.block_recipes[index], plan.anatomy.stores_kv[index]
        return chunk_refusal_message(plan.lm.config, recipe, stores_kv=stores_kv)
    return chunk_refusal_message(plan.lm.config, None)


def _parameter_count(layer: LayerSpec | nn.Module) -> int:
    if isinstance(layer, LayerSpec):
        if layer.module_args and isinstance(layer.module_args[0], _Plan):
            dry = copy.copy(layer.module_args[0])
            dry.dry = True
            layer = layer.typename(dry, *layer.module_args[1:], **layer.module_kwargs)
        else:
            layer = layer.build()
    return sum(p.numel() for p in layer.parameters() if p.requires_grad)


def _make_plan(
    model: PreTrainedModel | PretrainedConfig | str | os.PathLike[str],
    *,
    attn_implementation: str | None,
    dtype: torch.dtype | None,
    mask_padding: bool,
) -> _Plan:
    lm, checkpoint = _open(model, attn_implementation=attn_implementation, dtype=dtype)
    pad = getattr(lm.config, "pad_token_id", None) if mask_padding else None
    trace = trace_model(lm, with_padding=pad is not None)
    anatomy = analyse(lm, trace)
    logit_ops = check_head_semantics(lm, anatomy)
    if checkpoint is not None:
        checkpoint = Checkpoint(checkpoint, strip_prefix=lm.base_model_prefix, rename=stored_name_converter(lm))
    skeleton = not isinstance(model, PreTrainedModel)
    return _Plan(
        lm, anatomy, checkpoint=checkpoint, skeleton=skeleton, dtype=dtype, pad_token_id=pad, logit_ops=logit_ops
    )


def _open(
    model: PreTrainedModel | PretrainedConfig | str | os.PathLike[str],
    *,
    attn_implementation: str | None,
    dtype: torch.dtype | None,
) -> tuple[PreTrainedModel, Path | None]:
    if isinstance(model, PreTrainedModel):
        if attn_implementation is not None or dtype is not None:
            raise ValueError("attn_implementation/dtype apply to config or directory sources; set them on the model")
        return model, None
    if isinstance(model, PretrainedConfig):
        return _skeleton(copy.deepcopy(model), attn_implementation), None
    if isinstance(model, (str, os.PathLike)):
        directory = Path(model)
        if not directory.is_dir():
            raise ValueError(f"{directory} is not a local model directory")
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        return _skeleton(config, attn_implementation), directory
    raise TypeError(f"expected a PreTrainedModel, PretrainedConfig or directory, got {type(model).__name__}")


def _skeleton(config: PretrainedConfig, attn_implementation: str | None) -> PreTrainedModel:
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        with parameters_on_meta():
            return AutoModelForCausalLM.from_config(config, **extra)
    except (ValueError, KeyError) as error:
        raise ValueError(f"{type(config).__name__} has no causal-LM class in transformers: {error}") from error


def _layer_specs(plan: _Plan, *, tie_key: str) -> list[LayerSpec]:
    anatomy = plan.anatomy
    blocks = [LayerSpec(HFDecoderBlock, plan, index) for index in range(anatomy.num_layers)]
    if not anatomy.tied:
        return [LayerSpec(HFEmbedding, plan), *blocks, LayerSpec(HFLMHead, plan)]
    # Tied: both ends use the same HFEmbedding module; DeepSpeed all-reduces
    # the gradient of the shared weight between the first and last stage.
    weight = f"body.{anatomy.embedding}.weight"
    first = TiedLayerSpec(tie_key, HFEmbedding, plan, tied_weight_attr=[weight])
    last = TiedLayerSpec(tie_key, HFEmbedding, plan, forward_fn=_tied_lm_head, tied_weight_attr=[weight])
    norm = [LayerSpec(HFFinalNorm, plan)] if anatomy.norm is not None else []
    return [first, *blocks, *norm, last]
