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
ids, or a plain constant.  Anything else raises ``ValueError`` with the reason.
The prologue is not re-implemented at all: layer 0 runs the model's own base
model with its block list emptied and its final norm replaced by identity.

Supported: decoder-only causal LMs whose blocks are fed only the hidden state
plus the above; tied or untied linear LM heads; one final norm (or none);
right or left padding through ``config.pad_token_id``, masked exactly like
``attention_mask=(input_ids != pad)`` (``mask_padding=False`` turns it off).
Exact (0.0 logit difference) on transformers 5.23 for GPT-2, Llama, Mistral
(sliding window), Qwen2 (mixed full/sliding layers), Qwen3, Gemma, Gemma3
text, Phi, Phi3, OLMo2, GPT-NeoX, Falcon, OPT, Granite, StarCoder2, Mixtral;
GPT-J within 1e-7.  Refused with ``ValueError``: bidirectional attention
(BERT-style encoders), no linear LM head or no causal-LM class (T5), logits
post-processing (Gemma2 soft-capping, Cohere logit scale), other losses,
blocks needing other tensors (Bloom's ALiBi), weighted modules between blocks.
Not supported: KV caches, packed sequences with position resets, remote code.

Weights: from a directory only ``*.safetensors`` checkpoints (single or
sharded) written with the model's module names are read; a base-model-only
checkpoint without the prefix works too.  Each layer reads only its own
tensors when built.  Note DeepSpeed's ``partition_method="parameters"`` builds
(and so loads) every layer on every rank to count parameters: use
``"uniform"``, ``"type:HFDecoderBlock"`` or ``parameter_counts()`` instead.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import functools
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache

__all__ = [
    "IGNORE_INDEX",
    "HFDecoderBlock",
    "HFEmbedding",
    "HFFinalNorm",
    "HFLMHead",
    "causal_lm_loss",
    "parameter_counts",
    "pipeline_layers",
]

IGNORE_INDEX = -100

# Shape of the meta-device trace batch; any small sizes > 1 would do.
_TRACE_BATCH, _TRACE_SEQ = 2, 5


# --------------------------------------------------------------------------- loss


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy as transformers computes it for ``model(..., labels=labels)``.

    Position ``t`` predicts ``labels[t + 1]``; targets equal to ``IGNORE_INDEX``
    do not count and the result is the mean over the remaining targets.
    """
    if not isinstance(labels, torch.Tensor):
        labels = labels[0]
    # Pad-then-shift (instead of slicing the logits) keeps the op sequence of
    # the reference, so the two agree to the last bit, not just to 1e-6.
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    flat_logits = logits.float().reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).to(flat_logits.device)
    return F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX)


# ----------------------------------------------------------------------- recipes


class _Kind(enum.Enum):
    """Where the value of one recorded call argument comes from at run time."""

    CONST = "const"  # a non-tensor value, replayed as recorded
    HIDDEN = "hidden"  # the hidden state flowing through the pipeline
    INPUT_IDS = "input_ids"
    KEY_MASK = "key_mask"  # 2-D padding mask (1 = token, 0 = padding)
    POSITIONS = "positions"  # arange(seq)[None]
    CACHE_POSITIONS = "cache_positions"  # arange(seq)
    ROPE = "rope"  # output of a weight-free rotary module, re-run
    MASK = "mask"  # output of a masking_utils builder, re-run


@dataclass(frozen=True)
class _Arg:
    name: str
    kind: _Kind
    value: Any = None


@dataclass(frozen=True)
class _Recipe:
    """How to call one function again: the first argument positionally, the rest by name."""

    positional: tuple[_Arg, ...]
    keyword: tuple[_Arg, ...]


@dataclass(frozen=True, eq=False)
class _MaskRecipe:
    builder: Callable[..., Any]
    recipe: _Recipe


@dataclass(frozen=True, eq=False)
class _RopeRef:
    path: str
    recipe: _Recipe


class _Runtime:
    """Resolves recipe arguments for one forward call of one pipeline layer."""

    def __init__(
        self,
        *,
        hidden: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        ropes: Mapping[str, nn.Module] | None = None,
    ) -> None:
        self._hidden, self._input_ids, self._key_mask = hidden, input_ids, key_mask
        self._ropes = ropes or {}
        self._memo: dict[int, Any] = {}

    def call(self, fn: Callable[..., Any], recipe: _Recipe) -> Any:
        args = [self._resolve(arg) for arg in recipe.positional]
        kwargs = {arg.name: self._resolve(arg) for arg in recipe.keyword}
        return fn(*args, **kwargs)

    def _resolve(self, arg: _Arg) -> Any:
        kind = arg.kind
        if kind is _Kind.CONST:
            return arg.value
        if kind is _Kind.HIDDEN:
            return self._hidden
        if kind is _Kind.INPUT_IDS:
            return self._input_ids
        if kind is _Kind.KEY_MASK:
            return self._key_mask
        if kind is _Kind.POSITIONS:
            return self._positions().unsqueeze(0)
        if kind is _Kind.CACHE_POSITIONS:
            return self._positions()
        if kind is _Kind.ROPE:
            ref: _RopeRef = arg.value
            return self._once(ref, lambda: self.call(self._ropes[ref.path], ref.recipe))
        mask: _MaskRecipe = arg.value
        return self._once(mask, lambda: self.call(mask.builder, mask.recipe))

    def _once(self, key: object, compute: Callable[[], Any]) -> Any:
        # Blocks of one layer may share a mask/rotary output; compute it once.
        if id(key) not in self._memo:
            self._memo[id(key)] = compute()
        return self._memo[id(key)]

    def _positions(self) -> torch.Tensor:
        # No KV cache and no packing: positions are always 0..s-1, as HF does
        # when position_ids is not given (also with padding).
        ref = self._hidden if self._hidden is not None else self._input_ids
        assert ref is not None
        return torch.arange(ref.shape[1], device=ref.device)


# ------------------------------------------------------------------------- trace


@dataclass
class _Call:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any


@dataclass
class _MaskCall:
    builder: Callable[..., Any]
    arguments: dict[str, Any]
    marker: torch.Tensor


@dataclass
class _Trace:
    events: list[tuple[str, str]] = field(default_factory=list)  # ("start"|"end", module path)
    calls: dict[str, list[_Call]] = field(default_factory=dict)
    masks: list[_MaskCall] = field(default_factory=list)
    input_mask: torch.Tensor | None = None

    def index(self, kind: str, path: str) -> int:
        return self.events.index((kind, path))


def _trace_model(lm: PreTrainedModel, *, with_padding: bool) -> _Trace:
    """Run ``lm`` once on meta tensors, recording module calls and mask builder calls."""
    trace = _Trace()
    handles = []
    # The hooks read the trace to fill from a box, so a retry can swap in a fresh one.
    box = [trace]
    for path, module in lm.named_modules():
        handles.append(module.register_forward_pre_hook(functools.partial(_on_start, box, path)))
        handles.append(module.register_forward_hook(functools.partial(_on_end, box, path), with_kwargs=True))
    try:
        _run_on_meta(lm, trace, with_padding=with_padding, dtype=None)
    except Exception as error:
        # Some kernels (e.g. grouped MoE matmuls) accept only bf16, even on
        # meta; the dtype does not change the structure we record.
        trace = box[0] = _Trace()
        try:
            _run_on_meta(lm, trace, with_padding=with_padding, dtype=torch.bfloat16)
        except Exception:  # any failure means we cannot understand the model
            raise ValueError(f"cannot trace {type(lm).__name__} on the meta device: {error!r}") from error
    finally:
        for handle in handles:
            handle.remove()
    return trace


def _run_on_meta(lm: PreTrainedModel, trace: _Trace, *, with_padding: bool, dtype: torch.dtype | None) -> None:
    input_ids = torch.zeros(_TRACE_BATCH, _TRACE_SEQ, dtype=torch.long, device="meta")
    key_mask = torch.ones_like(input_ids) if with_padding else None
    trace.input_mask = key_mask
    inputs = {"input_ids": input_ids, "attention_mask": key_mask, "use_cache": False}
    with _recording_mask_builders(lm, trace.masks), _autocast_accepting_meta():
        torch.func.functional_call(lm, _meta_state(lm, dtype), (), inputs, strict=False)


@contextlib.contextmanager
def _autocast_accepting_meta() -> Iterator[None]:
    """Let ``torch.autocast(device_type="meta", ...)`` be a no-op while tracing.

    Rotary modules of older transformers (4.56 - 5.x) switch autocast off by
    the input's device type, which torch rejects for ``meta``; there is
    nothing to cast there.
    """
    real, real_enabled = torch.autocast, torch.is_autocast_enabled

    def autocast(device_type: str, *args: Any, **kwargs: Any) -> Any:
        return contextlib.nullcontext() if device_type == "meta" else real(device_type, *args, **kwargs)

    def is_autocast_enabled(*args: Any) -> bool:
        return False if args == ("meta",) else real_enabled(*args)

    torch.autocast, torch.is_autocast_enabled = autocast, is_autocast_enabled  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.autocast, torch.is_autocast_enabled = real, real_enabled  # type: ignore[misc]


def _on_start(box: list[_Trace], path: str, module: nn.Module, args: tuple[Any, ...]) -> None:
    box[0].events.append(("start", path))


def _on_end(
    box: list[_Trace], path: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> None:
    box[0].events.append(("end", path))
    box[0].calls.setdefault(path, []).append(_Call(args, dict(kwargs), output))


def _meta_state(lm: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    # Deduplicated names: functional_call re-ties shared (tied) parameters itself.
    state = {}
    for name, tensor in [*lm.named_parameters(), *lm.named_buffers()]:
        target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        state[name] = torch.empty_like(tensor, device="meta", dtype=target)
    return state


@contextlib.contextmanager
def _recording_mask_builders(lm: nn.Module, records: list[_MaskCall]) -> Iterator[None]:
    """Wrap the masking_utils builders imported by the model's modules, restoring them after."""
    patched: list[tuple[dict[str, Any], str, Any]] = []
    namespaces = {id(ns): ns for ns in _modeling_namespaces(lm)}.values()
    for namespace in namespaces:
        for attr, value in list(namespace.items()):
            if _is_mask_builder(value):
                namespace[attr] = _mask_recorder(value, records)
                patched.append((namespace, attr, value))
    try:
        yield
    finally:
        for namespace, attr, value in patched:
            namespace[attr] = value


def _modeling_namespaces(lm: nn.Module) -> Iterator[dict[str, Any]]:
    for module in lm.modules():
        python_module = sys.modules.get(type(module).__module__)
        if python_module is not None:
            yield vars(python_module)


def _is_mask_builder(value: Any) -> bool:
    return (
        inspect.isfunction(value)
        and value.__module__ == "transformers.masking_utils"
        and value.__name__.startswith("create_")
    )


def _mask_recorder(builder: Callable[..., Any], records: list[_MaskCall]) -> Callable[..., Any]:
    signature = inspect.signature(builder)

    @functools.wraps(builder)
    def record(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = signature.bind(*args, **kwargs)
        # A fresh tensor per call lets us tell, by identity, which builder made
        # the mask each block receives (real builders may return None for sdpa).
        embeds = bound.arguments.get("inputs_embeds")
        shape = (embeds.shape[0], 1, embeds.shape[1], embeds.shape[1]) if embeds is not None else (1, 1, 1, 1)
        marker = torch.ones(shape, dtype=torch.bool, device="meta")
        records.append(_MaskCall(builder, dict(bound.arguments), marker))
        return marker

    return record


# ---------------------------------------------------------------------- analysis


@dataclass(frozen=True)
class _Anatomy:
    base: str  # path of the base model (whose forward calls the blocks)
    layers: str  # path of the ModuleList of decoder blocks
    num_layers: int
    norm: str | None  # final norm, None if the model has none
    head: str  # linear LM head
    embedding: str  # token embedding, relative to the base model
    tied: bool
    base_recipe: _Recipe
    block_recipes: tuple[_Recipe, ...]


@dataclass
class _Known:
    """Recorded objects that block arguments may be traced back to."""

    lm: nn.Module
    trace: _Trace
    masks: dict[int, _MaskRecipe] = field(default_factory=dict)
    producers: dict[int, str] = field(default_factory=dict)
    ropes: dict[str, _RopeRef] = field(default_factory=dict)


def _analyse(lm: PreTrainedModel, trace: _Trace) -> _Anatomy:
    head, embedding = _head_path(lm), _path_of(lm, lm.get_input_embeddings())
    layers, count = _layer_list(lm, trace)
    known = _Known(lm, trace)
    _collect_masks(lm, known)
    _collect_producers(lm, known, layers)
    blocks = tuple(_block_recipe(known, layers, index) for index in range(count))
    base = _base_path(trace, layers)
    _require_inside(base, embedding, "the input embedding")
    if _is_ancestor(base, head):
        raise ValueError(f"the LM head {head!r} lives inside the base model {base!r}; cannot split it off")
    norm = _final_norm(lm, trace, layers, count, head)
    _check_between_blocks(lm, trace, layers, count)
    _check_prologue(lm, trace, layers, base)
    head_module = lm.get_submodule(head)
    tied = head_module.weight is lm.get_input_embeddings().weight
    if tied and head_module.bias is not None:
        raise ValueError("a tied LM head with its own bias is not supported")
    base_call = _single_call(trace, base, "the base model")
    base_recipe = _recipe(
        lm.get_submodule(base).forward, base_call, known, first_is_hidden=False, where="base", by_name=True
    )
    relative_embedding = embedding[len(base) + 1 :] if base else embedding
    return _Anatomy(base, layers, count, norm, head, relative_embedding, tied, base_recipe, blocks)


def _base_path(trace: _Trace, layers: str) -> str:
    """The innermost module around the block list that ran once: its forward calls the blocks."""
    path = layers
    while "." in path:
        path = path.rpartition(".")[0]
        if len(trace.calls.get(path, [])) == 1:
            return path
    raise ValueError(f"no module inside the LM calls the decoder blocks {layers!r}; cannot separate the head")


def _head_path(lm: PreTrainedModel) -> str:
    head = lm.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{type(lm).__name__} has no linear LM head (get_output_embeddings() is {head!r})")
    return _path_of(lm, head)


def _path_of(root: nn.Module, target: nn.Module | None) -> str:
    for path, module in root.named_modules():
        if module is target:
            return path
    raise ValueError(f"module {type(target).__name__} is not part of {type(root).__name__}")


def _layer_list(lm: PreTrainedModel, trace: _Trace) -> tuple[str, int]:
    """The ModuleList whose every element ran exactly once, in order: the decoder blocks."""
    wanted = getattr(lm.config.get_text_config(), "num_hidden_layers", None)
    found = []
    for path, module in lm.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if wanted is not None and len(module) != wanted:
            continue
        starts = [_first_start(trace, f"{path}.{i}") for i in range(len(module))]
        if all(s is not None for s in starts) and starts == sorted(starts):  # type: ignore[type-var]
            found.append((path, len(module)))
    if len(found) != 1:
        names = [path for path, _ in found] or "none"
        raise ValueError(f"cannot identify the decoder block list (candidates: {names})")
    return found[0]


def _first_start(trace: _Trace, path: str) -> int | None:
    try:
        return trace.index("start", path)
    except ValueError:
        return None


def _collect_masks(lm: nn.Module, known: _Known) -> None:
    if getattr(lm.config, "is_causal", True) is False:
        raise ValueError("config.is_causal is False: bidirectional attention cannot be trained as a causal LM")
    for record in known.trace.masks:
        name = record.builder.__name__
        if "bidirectional" in name:
            raise ValueError(
                f"the model builds a bidirectional attention mask ({name}); only causal decoder-only "
                "models can be split (encoder-only models are not causal LMs)"
            )
        call = _Call((), record.arguments, record.marker)
        where = f"mask builder {name}"
        recipe = _recipe(record.builder, call, known, first_is_hidden=False, where=where, by_name=True)
        known.masks[id(record.marker)] = _MaskRecipe(record.builder, recipe)


def _collect_producers(lm: nn.Module, known: _Known, layers: str) -> None:
    # Outputs of weight-free modules (rotary embeddings) can be recomputed on
    # any stage; outputs of modules with weights cannot.
    for path, calls in known.trace.calls.items():
        if _is_ancestor(path, layers) or _is_ancestor(layers, path):
            continue
        if len(calls) == 1 and not _has_params(lm.get_submodule(path)):
            known.producers[id(calls[0].output)] = path


def _block_recipe(known: _Known, layers: str, index: int) -> _Recipe:
    path = f"{layers}.{index}"
    call = _single_call(known.trace, path, f"decoder block {index}")
    block = known.lm.get_submodule(path)
    recipe = _recipe(block.forward, call, known, first_is_hidden=True, where=f"decoder block {index}")
    if index > 0:
        previous = _hidden_of(_single_call(known.trace, f"{layers}.{index - 1}", "").output)
        first = next(iter(inspect.signature(block.forward).bind(*call.args, **call.kwargs).arguments.values()))
        if first is not previous:
            raise ValueError(f"the model changes the hidden state between decoder blocks {index - 1} and {index}")
    if not any(arg.kind is _Kind.HIDDEN for arg in recipe.positional):
        raise ValueError(f"decoder block {index} does not take the hidden state as its first argument")
    return recipe


def _single_call(trace: _Trace, path: str, what: str) -> _Call:
    calls = trace.calls.get(path, [])
    if len(calls) != 1:
        raise ValueError(f"{what} ({path!r}) ran {len(calls)} times in one forward pass; expected once")
    return calls[0]


def _hidden_of(output: Any) -> Any:
    # Older transformers blocks return (hidden, ...) tuples; newer a tensor.
    return output[0] if isinstance(output, tuple) else output


def _recipe(
    fn: Callable[..., Any], call: _Call, known: _Known, *, first_is_hidden: bool, where: str, by_name: bool = False
) -> _Recipe:
    bound = inspect.signature(fn).bind(*call.args, **call.kwargs)
    items = _flatten_arguments(fn, bound, where)
    positional: list[_Arg] = []
    keyword: list[_Arg] = []
    for index, (name, value) in enumerate(items):
        first = index == 0 and first_is_hidden
        arg = _classify(name, value, known, first=first, where=where, by_name=by_name)
        (positional if first else keyword).append(arg)
    return _Recipe(tuple(positional), tuple(keyword))


def _flatten_arguments(fn: Callable[..., Any], bound: inspect.BoundArguments, where: str) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            items.extend(value.items())
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise ValueError(f"{where}: extra positional arguments are not supported")
        else:
            items.append((name, value))
    return items


_NAMED_TENSORS = {
    "input_ids": _Kind.INPUT_IDS,
    "inputs_embeds": _Kind.HIDDEN,
    "input_embeds": _Kind.HIDDEN,  # masking_utils spelling before transformers 5
    "attention_mask": _Kind.KEY_MASK,
    "position_ids": _Kind.POSITIONS,
    "cache_position": _Kind.CACHE_POSITIONS,
}


def _classify(name: str, value: Any, known: _Known, *, first: bool, where: str, by_name: bool) -> _Arg:
    if id(value) in known.masks:
        return _Arg(name, _Kind.MASK, known.masks[id(value)])
    if not _holds_tensor(value):
        return _Arg(name, _Kind.CONST, value)
    if first:
        return _Arg(name, _Kind.HIDDEN)
    if id(value) in known.producers:
        return _Arg(name, _Kind.ROPE, _rope_ref(known, known.producers[id(value)]))
    kind = _NAMED_TENSORS.get(name) if isinstance(value, torch.Tensor) else None
    # A tensor named attention_mask given to a block must be the 2-D padding
    # mask itself; a mask the model built some other way (e.g. transformers
    # < 4.53 without masking_utils) would silently lose causality otherwise.
    if kind is _Kind.KEY_MASK and not by_name and value is not known.trace.input_mask:
        kind = None
    if kind is not None:
        return _Arg(name, kind)
    raise ValueError(
        f"{where}: argument {name!r} carries tensors the model computes in a way this adapter "
        "cannot rebuild on a later pipeline stage"
    )


def _rope_ref(known: _Known, path: str) -> _RopeRef:
    if path not in known.ropes:
        module = known.lm.get_submodule(path)
        call = _single_call(known.trace, path, f"position-embedding module {path!r}")
        recipe = _recipe(module.forward, call, known, first_is_hidden=True, where=f"module {path!r}")
        _check_position_only(module, recipe, path, example=_first_argument(module, call))
        known.ropes[path] = _RopeRef(path, recipe)
    return known.ropes[path]


def _first_argument(module: nn.Module, call: _Call) -> Any:
    bound = inspect.signature(module.forward).bind(*call.args, **call.kwargs)
    return next(iter(bound.arguments.values()))


def _check_position_only(module: nn.Module, recipe: _Recipe, path: str, *, example: torch.Tensor) -> None:
    """A module re-run on every stage may use the hidden state's shape, dtype and device, not its values.

    True for rotary embeddings; a weight-free transform of the *embedding
    output* handed to every block would otherwise be silently recomputed
    from the wrong hidden state.
    """
    device = next((buffer.device for buffer in module.buffers()), torch.device("cpu"))
    if device.type == "meta":
        raise ValueError(f"module {path!r} has buffers on the meta device; load the model's weights first")
    outputs = []
    with torch.no_grad():
        for fill in (0.0, 1.0):
            hidden = torch.full(example.shape, fill, dtype=example.dtype, device=device)
            outputs.append(_tensors(_Runtime(hidden=hidden).call(module, recipe)))
    if len(outputs[0]) != len(outputs[1]) or not all(map(torch.equal, *outputs)):
        raise ValueError(f"blocks receive an output of {path!r} that depends on hidden-state values; cannot rebuild")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [tensor for item in value for tensor in _tensors(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in _tensors(item)]
    return []


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, Cache)):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_tensor(item) for item in value.values())
    return False


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_ancestor(ancestor: str, path: str) -> bool:
    return ancestor == "" or path == ancestor or path.startswith(ancestor + ".")


def _require_inside(base: str, path: str, what: str) -> None:
    if not _is_ancestor(base, path):
        raise ValueError(f"{what} ({path!r}) is not inside the base model {base!r} that runs the blocks")


def _weighted_starts(lm: nn.Module, trace: _Trace, begin: int, end: int, layers: str) -> list[str]:
    """Outermost modules with weights that started in events[begin:end], containers of the blocks excluded."""
    found: list[str] = []
    for kind, path in trace.events[begin:end]:
        if kind != "start" or _is_ancestor(path, layers) or any(_is_ancestor(f, path) for f in found):
            continue
        if _has_params(lm.get_submodule(path)):
            found.append(path)
    return found


def _final_norm(lm: nn.Module, trace: _Trace, layers: str, count: int, head: str) -> str | None:
    last = _single_call(trace, f"{layers}.{count - 1}", "the last decoder block")
    after = _weighted_starts(lm, trace, trace.index("end", f"{layers}.{count - 1}") + 1, len(trace.events), layers)
    if after[-1:] != [head] or len(after) > 2:
        raise ValueError(
            f"after the last decoder block the model runs {after}; only one final norm followed by the "
            f"LM head {head!r} is supported"
        )
    if len(after) == 1:
        return None
    norm = after[0]
    call = _single_call(trace, norm, f"final norm {norm!r}")
    if len(call.args) != 1 or call.kwargs or call.args[0] is not _hidden_of(last.output):
        raise ValueError(f"the final norm {norm!r} is not applied to the last block's output alone")
    return norm


def _check_between_blocks(lm: nn.Module, trace: _Trace, layers: str, count: int) -> None:
    for index in range(1, count):
        begin = trace.index("end", f"{layers}.{index - 1}")
        between = _weighted_starts(lm, trace, begin, trace.index("start", f"{layers}.{index}"), layers)
        if between:
            raise ValueError(f"modules with weights run between decoder blocks {index - 1} and {index}: {between}")


def _check_prologue(lm: nn.Module, trace: _Trace, layers: str, base: str) -> None:
    before = _weighted_starts(lm, trace, 0, trace.index("start", f"{layers}.0"), layers)
    outside = [path for path in before if not _is_ancestor(base, path)]
    if outside:
        raise ValueError(f"modules with weights run outside the base model before the blocks: {outside}")


# ------------------------------------------------------------- LM-level semantics


class _StubOutput:
    """Base-model output holding only the hidden state; every optional extra reads as None."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.last_hidden_state = hidden

    def __getitem__(self, index: int) -> torch.Tensor:
        return (self.last_hidden_state,)[index]

    def __getattr__(self, name: str) -> None:
        if name.startswith("_"):
            raise AttributeError(name)
        return None  # e.g. past_key_values, attentions, router_logits


class _StubBase(nn.Module):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, *args: Any, **kwargs: Any) -> _StubOutput:
        return _StubOutput(self.hidden)


class _StubHead(nn.Module):
    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits


def _check_head_semantics(lm: PreTrainedModel, anatomy: _Anatomy) -> None:
    """Run the LM's own forward around stub body/head: logits must pass unchanged, loss must match ours."""
    vocab, width = lm.get_submodule(anatomy.head).weight.shape
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, vocab, generator=generator)
    labels = torch.randint(0, vocab, (2, 3), generator=generator)
    labels[0, 1] = labels[1, 0] = IGNORE_INDEX
    replacements: dict[str, nn.Module] = {
        anatomy.base: _StubBase(torch.zeros(2, 3, width)),
        anatomy.head: _StubHead(logits),
    }
    if anatomy.norm is not None and not _is_ancestor(anatomy.base, anatomy.norm):
        replacements[anatomy.norm] = nn.Identity()
    probe = _hollow(lm, replacements)
    try:
        out = probe(input_ids=torch.zeros(2, 3, dtype=torch.long), labels=labels, use_cache=False)
    except Exception as error:
        raise ValueError(f"cannot check the LM head semantics of {type(lm).__name__}: {error!r}") from error
    if out.logits is not logits and not torch.equal(out.logits, logits):
        raise ValueError(f"{type(lm).__name__} post-processes the LM head logits (e.g. scaling or soft-capping)")
    if not torch.allclose(out.loss, causal_lm_loss(logits, labels), rtol=1e-5, atol=1e-6):
        raise ValueError(f"{type(lm).__name__} uses a loss other than shifted next-token cross-entropy")


def _hollow(root: nn.Module, replacements: Mapping[str, nn.Module]) -> nn.Module:
    """Shallow copy of ``root`` with the given submodule paths replaced.

    Only the modules on the replaced paths are copied (their child dicts), so
    ``root`` is untouched and everything else is shared, weights included.
    """
    clone = copy.copy(root)
    clone._modules = dict(root._modules)
    nested: dict[str, dict[str, nn.Module]] = {}
    for path, module in replacements.items():
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = module
        else:
            clone._modules[head] = module
    for head, inner in nested.items():
        child = root._modules[head]
        assert child is not None
        clone._modules[head] = _hollow(child, inner)
    return clone


# ---------------------------------------------------------------------- weights


class _Checkpoint:
    """Reads selected tensors from a local safetensors checkpoint (single file or sharded)."""

    def __init__(self, directory: Path, *, strip_prefix: str) -> None:
        self.directory = directory
        self._strip = strip_prefix + "."
        index = directory / "model.safetensors.index.json"
        single = directory / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {key: directory / name for key, name in weight_map.items()}
        elif single.is_file():
            with safe_open(str(single), framework="pt") as handle:  # reads the header only
                self._files = {key: single for key in handle.keys()}  # noqa: SIM118 (not iterable)
        else:
            raise ValueError(
                f"{directory} has no model.safetensors[.index.json]; only safetensors can be read per layer"
            )

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Tensors for those ``keys`` present in the checkpoint, each read from disk once."""
        by_file: dict[Path, dict[str, str]] = {}
        for key in keys:
            stored = self._stored_name(key)
            if stored is not None:
                by_file.setdefault(self._files[stored], {})[stored] = key
        found: dict[str, torch.Tensor] = {}
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt") as handle:
                for stored, key in names.items():
                    found[key] = handle.get_tensor(stored)
        return found

    def _stored_name(self, key: str) -> str | None:
        if key in self._files:
            return key
        # Base-model checkpoints (e.g. saved from LlamaModel) lack the prefix.
        if key.startswith(self._strip) and key[len(self._strip) :] in self._files:
            return key[len(self._strip) :]
        return None


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Construct modules with parameters on ``meta`` but buffers real.

    Buffers (e.g. rotary ``inv_freq``, not stored in checkpoints) are thereby
    computed by the model's own constructor, while no parameter memory is used.
    """
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _materialise(module: nn.Module, *, dtype: torch.dtype | None) -> nn.Module:
    """Give every meta parameter real (uninitialised) CPU storage; shared parameters stay shared."""
    fresh: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in fresh:
                target = dtype if dtype is not None and param.is_floating_point() else param.dtype
                data = torch.empty(param.shape, dtype=target)
                fresh[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            sub._parameters[name] = fresh[id(param)]
    return module


def _initialise(part: nn.Module, donor: PreTrainedModel) -> None:
    """Apply the model's own weight init to a freshly materialised part (children before parents, as HF)."""
    with torch.no_grad():
        for sub in reversed(list(part.modules())):
            donor._init_weights(sub)


def _load(part: nn.Module, prefix: str, checkpoint: _Checkpoint) -> None:
    state = part.state_dict(keep_vars=True)
    keys = {f"{prefix}.{name}": tensor for name, tensor in state.items()}
    found = checkpoint.read(keys)
    params = {id(p) for p in part.parameters()}
    missing = sorted(key for key, tensor in keys.items() if key not in found and id(tensor) in params)
    if missing:
        raise ValueError(f"{checkpoint.directory} lacks {len(missing)} weights, e.g. {missing[:3]}")
    with torch.no_grad():
        for key, tensor in found.items():
            if keys[key].shape != tensor.shape:
                raise ValueError(f"{key}: checkpoint shape {tuple(tensor.shape)} != model {tuple(keys[key].shape)}")
            keys[key].copy_(tensor)


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
        anatomy: _Anatomy,
        *,
        checkpoint: _Checkpoint | None,
        skeleton: bool,
        dtype: torch.dtype | None,
        pad_token_id: int | None,
    ) -> None:
        self.lm, self.anatomy, self.checkpoint = lm, anatomy, checkpoint
        self.skeleton, self.dtype, self.pad_token_id = skeleton, dtype, pad_token_id
        self.dry = False  # True: build() returns the source modules untouched (for counting)

    def __repr__(self) -> str:
        source = self.checkpoint.directory if self.checkpoint else ("config" if self.skeleton else "instance")
        return f"HFModel({type(self.lm).__name__}, {self.anatomy.num_layers} blocks, from={source})"

    def build(self, path: str, replacements: Mapping[str, nn.Module] | None = None) -> nn.Module:
        part = self.lm.get_submodule(path)
        if replacements:
            part = _hollow(part, replacements)
        if self.dry or not self.skeleton:
            return part
        part = _materialise(copy.deepcopy(part), dtype=self.dtype)
        if self.checkpoint is not None:
            _load(part, path, self.checkpoint)
        else:
            _initialise(part, self.lm)
        return part

    def rope_paths(self, index: int) -> list[str]:
        recipe = self.anatomy.block_recipes[index]
        return sorted({arg.value.path for arg in recipe.keyword if arg.kind is _Kind.ROPE})


# ------------------------------------------------------------------------ layers


def _unwrap(inputs: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    return inputs if isinstance(inputs, torch.Tensor) else inputs[0]


class HFEmbedding(nn.Module):
    """Layer 0: the model's own base-model forward with no blocks and no final norm."""

    def __init__(self, plan: _Plan) -> None:
        super().__init__()
        anatomy = plan.anatomy
        hollowed: dict[str, nn.Module] = {anatomy.layers[len(anatomy.base) + 1 :]: nn.ModuleList()}
        if anatomy.norm is not None and _is_ancestor(anatomy.base, anatomy.norm):
            hollowed[anatomy.norm[len(anatomy.base) + 1 :]] = nn.Identity()
        self.body = plan.build(anatomy.base, hollowed)
        self.embedding_path = anatomy.embedding
        self._recipe = anatomy.base_recipe
        self._pad_token_id = plan.pad_token_id

    def forward(self, input_ids: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = _unwrap(input_ids)
        pad = self._pad_token_id
        key_mask = torch.ones_like(ids) if pad is None else (ids != pad).long()
        out = _Runtime(input_ids=ids, key_mask=key_mask).call(self.body, self._recipe)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden, key_mask

    def tied_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head sharing the token-embedding weight (tied input/output embeddings)."""
        return F.linear(hidden, self.body.get_submodule(self.embedding_path).weight)


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

    def forward(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, key_mask = inputs[0], inputs[1]
        ropes = dict(zip(self._rope_paths, self.rotary, strict=True))
        out = _Runtime(hidden=hidden, key_mask=key_mask, ropes=ropes).call(self.block, self._recipe)
        return _hidden_of(out), key_mask


class HFFinalNorm(nn.Module):
    """The final norm alone (used when the LM head is tied to the input embedding)."""

    def __init__(self, plan: _Plan) -> None:
        super().__init__()
        assert plan.anatomy.norm is not None
        self.norm = plan.build(plan.anatomy.norm)

    def forward(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.norm(inputs[0]), inputs[1]


class HFLMHead(nn.Module):
    """Final norm (if any) and the untied LM head; returns logits."""

    def __init__(self, plan: _Plan) -> None:
        super().__init__()
        norm = plan.anatomy.norm
        self.norm = plan.build(norm) if norm is not None else nn.Identity()
        self.head = plan.build(plan.anatomy.head)

    def forward(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.head(self.norm(inputs[0]))


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
    trace = _trace_model(lm, with_padding=pad is not None)
    anatomy = _analyse(lm, trace)
    _check_head_semantics(lm, anatomy)
    if checkpoint is not None:
        checkpoint = _Checkpoint(checkpoint, strip_prefix=lm.base_model_prefix)
    skeleton = not isinstance(model, PreTrainedModel)
    return _Plan(lm, anatomy, checkpoint=checkpoint, skeleton=skeleton, dtype=dtype, pad_token_id=pad)


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
        with _parameters_on_meta():
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
