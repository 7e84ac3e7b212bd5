"""Exact causal attention across sequence chunks (Seq1F1B) for the ``ds_vshape.hf`` layers.

A micro-batch's sequence is cut into chunks ``[b_0=0, b_1), [b_1, b_2), ...``.
On one pipeline stage, chunk ``j``'s forward sees the hidden states of its own
positions only and attends to the keys/values of positions ``[0, b_{j+1})``,
which the stage keeps in a ``ChunkKVState`` (one per stage and micro-batch):

    with seq_chunk(state, start=b_j, end=b_j1):
        out = stage_forward(chunk_inputs)          # the layers' ordinary forward

Inside the context every recorded call is replayed the way transformers runs
a model with a KV cache of ``start`` tokens: a ``Cache`` stand-in is passed as
``past_key_values`` (so positions, rotary and learned position embeddings
start at ``start``, and the mask builders make the bottom-right aligned causal
or sliding-window mask of ``end - start`` query rows by ``end`` key columns),
and the 2-D padding mask is that of positions ``[0, end)``.

Each attention layer's new K/V (what HF hands to ``past_key_values.update``:
after rotary, before the grouped-query repeat) is kept twice: the graph-connected
tensors, for chunk ``j``'s own backward, and a detached leaf (same storage) that
later chunks concatenate in front of theirs, so their backward fills its
``.grad``.  Backward therefore runs chunks in descending order, and chunk ``j``
passes ``state.backward_roots(j)`` as extra roots to ``torch.autograd.backward``
so those gradients flow on into its own graph; ``state.release(j)`` then drops
what chunk ``j`` kept.  Outside a ``seq_chunk`` context nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from .tracing import _Arg, _Kind, _Recipe, _Runtime

__all__ = [
    "ChunkKVState",
    "seq_chunk",
]

# Only these were verified exact; flash/flex kernels read position ids and
# pick their own alignment, which has not been checked here.
_ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")
# Rotary variants whose frequencies depend on the longest position seen so
# far: a chunk ending early would get different frequencies than the whole.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class _KV:
    """One attention layer's K/V of one chunk: the graph-connected tensors and their detached leaves."""

    key: torch.Tensor | None  # None when the chunk ran without autograd
    value: torch.Tensor | None
    leaf_key: torch.Tensor
    leaf_value: torch.Tensor


class ChunkKVState:
    """Keys/values of one micro-batch's chunks on one pipeline stage.

    Create one per (stage, micro-batch).  Chunks must run forward in order
    (chunk ``j`` starts where chunk ``j-1`` ended); a chunk starting at 0
    resets the state, which is refused while earlier chunks still await
    their backward.  Once a backward began (``backward_roots`` or
    ``release``), no further chunk may run forward before a reset, because
    its K/V gradients into earlier chunks would be lost.
    """

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self._bounds: list[tuple[int, int]] = []
        self._released: set[int] = set()
        self._kv: dict[int, dict[int, _KV]] = {}
        self._key_masks: dict[int, torch.Tensor] = {}
        self._closed = False

    @property
    def num_chunks(self) -> int:
        """Chunks that ran forward since the last reset."""
        return len(self._bounds)

    def backward_roots(self, chunk: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Extra ``(tensors, grad_tensors)`` for ``torch.autograd.backward`` of ``chunk``.

        They are chunk ``chunk``'s own K/V tensors with the gradients that the
        later chunks' backward accumulated into their detached copies (pairs
        without any gradient are left out: a zero gradient adds nothing).
        Raises ``RuntimeError`` when a later chunk has not run (and released)
        its backward yet.
        """
        self._check_backward_order(chunk, "backward")
        self._closed = True
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for kv in self._kv.get(chunk, {}).values():
            for live, leaf in ((kv.key, kv.leaf_key), (kv.value, kv.leaf_value)):
                if live is not None and leaf.grad is not None:
                    tensors.append(live)
                    grads.append(leaf.grad)
        return tensors, grads

    def kv_leaves(self, chunk: int) -> list[torch.Tensor]:
        """The earlier chunks' detached K/V leaves that ``chunk``'s forward attended to.

        Only needed when a backward is restricted with ``inputs=`` (split
        backward: input gradients first, weight gradients later): add these
        to the input-gradient pass so that the earlier chunks receive their
        K/V gradients; ``backward_roots`` then reads them from ``.grad``.
        """
        leaves: list[torch.Tensor] = []
        for layer in self._kv.get(chunk, {}):
            for previous in range(chunk):
                kv = self._kv[previous][layer]
                leaves += [leaf for leaf in (kv.leaf_key, kv.leaf_value) if leaf.requires_grad]
        return leaves

    def release(self, chunk: int) -> None:
        """Drop what ``chunk`` kept; call after its backward (later chunks must be released already)."""
        self._check_backward_order(chunk, "release")
        self._closed = True
        self._kv.pop(chunk, None)
        self._key_masks.pop(chunk, None)
        self._released.add(chunk)

    def _check_backward_order(self, chunk: int, what: str) -> None:
        if not 0 <= chunk < len(self._bounds):
            raise RuntimeError(f"{what} of chunk {chunk}: only {len(self._bounds)} chunk(s) ran forward")
        if chunk in self._released:
            raise RuntimeError(f"{what} of chunk {chunk}: it was released already")
        pending = [i for i in range(chunk + 1, len(self._bounds)) if i not in self._released]
        if pending:
            raise RuntimeError(
                f"{what} of chunk {chunk} before the backward of later chunk(s) {pending}: their gradients "
                f"into chunk {chunk}'s keys/values are not delivered yet; run backward in descending chunk "
                "order and release each chunk after its backward"
            )

    def _begin(self, start: int, end: int) -> int:
        """Register a chunk's forward; returns its index."""
        if not 0 <= start < end:
            raise ValueError(f"a sequence chunk needs 0 <= start < end, got [{start}, {end})")
        if start == 0:
            self._reset()
        elif self._closed:
            raise RuntimeError(f"chunk [{start}, {end}) runs forward after a backward began on this state")
        elif not self._bounds or self._bounds[-1][1] != start:
            previous = self._bounds[-1][1] if self._bounds else None
            raise RuntimeError(f"chunk [{start}, {end}) does not continue the previous chunk (ended at {previous})")
        self._bounds.append((start, end))
        return len(self._bounds) - 1

    def _reset(self) -> None:
        waiting = [j for j, layers in self._kv.items() if any(kv.key is not None for kv in layers.values())]
        if waiting:
            raise RuntimeError(
                f"a new chunk 0 starts while chunk(s) {waiting} still await backward; "
                "use one ChunkKVState per micro-batch, or release them first"
            )
        self._clear()

    def _update(self, chunk: int, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        kept = self._kv.setdefault(chunk, {})
        if layer in kept:
            raise RuntimeError(f"attention layer {layer} ran twice in chunk {chunk} (recomputation is not supported)")
        earlier = []
        for previous in range(chunk):
            if layer not in self._kv.get(previous, {}):
                raise RuntimeError(f"attention layer {layer} did not run in chunk {previous}; no keys/values to attend")
            earlier.append(self._kv[previous][layer])
        grad = key.requires_grad or value.requires_grad
        # Detached leaves share storage with the live tensors: no copy.
        leaf_key, leaf_value = key.detach().requires_grad_(grad), value.detach().requires_grad_(grad)
        kept[layer] = _KV(key if grad else None, value if grad else None, leaf_key, leaf_value)
        keys = torch.cat([*(kv.leaf_key for kv in earlier), key], dim=-2)
        values = torch.cat([*(kv.leaf_value for kv in earlier), value], dim=-2)
        return keys, values

    def _prefix_key_mask(self, chunk: int, key_mask: torch.Tensor) -> torch.Tensor:
        """The padding mask of positions ``[0, end)``: earlier chunks' masks, then this one's."""
        # Layers pass the chunk's mask on unchanged, so the first one seen is
        # kept; only its shape is checked (comparing values would sync a GPU).
        stored = self._key_masks.setdefault(chunk, key_mask)
        if stored.shape != key_mask.shape:
            raise RuntimeError(f"chunk {chunk} got padding masks of shapes {stored.shape} and {key_mask.shape}")
        missing = [i for i in range(chunk) if i not in self._key_masks]
        if missing:
            raise RuntimeError(f"no padding mask recorded for chunk(s) {missing} on this stage")
        return torch.cat([*(self._key_masks[i].to(key_mask.device) for i in range(chunk)), key_mask], dim=-1)


# ------------------------------------------------------------------ the context


class _ChunkCache(Cache):
    """What the model's attention and mask code see as ``past_key_values`` inside a chunk.

    Behaves like a cache already holding ``start`` tokens: ``update`` returns
    the earlier chunks' K/V followed by the new ones, and the mask sizes are
    ``end`` key columns from position 0 with queries starting at ``start``.
    """

    def __init__(self, state: ChunkKVState, *, chunk: int, start: int) -> None:
        super().__init__(layers=[])
        self._state, self._chunk, self._start = state, chunk, start
        self.updates = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.updates += 1
        keys, values = self._state._update(self._chunk, layer_idx, key_states, value_states)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._start

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._start

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        # All earlier keys are kept (also for sliding-window layers, whose
        # window the mask function applies), so keys always start at 0.
        return self._start + query_length, 0


@dataclass(frozen=True)
class _Active:
    state: ChunkKVState
    chunk: int
    start: int
    end: int
    cache: _ChunkCache


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("ds_vshape_seq_chunk", default=None)


@contextlib.contextmanager
def seq_chunk(state: ChunkKVState, *, start: int, end: int) -> Iterator[None]:
    """Run the ``ds_vshape.hf`` layers called inside on positions ``[start, end)`` of a micro-batch.

    The layers' inputs must then hold exactly those ``end - start``
    positions; attention also reads the keys/values that ``state`` kept from
    the earlier chunks of the same micro-batch on this stage.  Contexts do
    not nest.  Layers of a model that cannot be chunked exactly raise
    ``ValueError`` naming the model type and the reason.
    """
    if _ACTIVE.get() is not None:
        raise RuntimeError("seq_chunk contexts do not nest")
    chunk = state._begin(start, end)
    token = _ACTIVE.set(_Active(state, chunk, start, end, _ChunkCache(state, chunk=chunk, start=start)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class _ChunkRuntime(_Runtime):
    """Resolves recipe arguments as transformers would with a cache of ``start`` tokens."""

    def __init__(self, active: _Active, *, block: str | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._active, self._block, self._depth = active, block, 0
        reference = kwargs.get("hidden") if kwargs.get("hidden") is not None else kwargs.get("input_ids")
        length = active.end - active.start
        if reference is not None and reference.shape[1] != length:
            raise ValueError(
                f"chunk [{active.start}, {active.end}) needs inputs of {length} positions, got {reference.shape[1]}"
            )

    def call(self, fn: Any, recipe: _Recipe) -> Any:
        # Nested calls rebuild masks and rotary embeddings; only the outermost
        # (the block itself) must have stored keys/values.
        before, self._depth = self._active.cache.updates, self._depth + 1
        try:
            out = super().call(fn, recipe)
        finally:
            self._depth -= 1
        if self._depth == 0 and self._block is not None and self._active.cache.updates == before:
            raise ValueError(f"{self._block}: it ran without storing keys/values through past_key_values.update")
        return out

    def _resolve(self, arg: _Arg) -> Any:
        active = self._active
        if arg.name == "past_key_values":
            return active.cache
        if arg.kind in (_Kind.POSITIONS, _Kind.CACHE_POSITIONS):
            reference = self._hidden if self._hidden is not None else self._input_ids
            assert reference is not None
            positions = torch.arange(active.start, active.end, device=reference.device)
            return positions.unsqueeze(0) if arg.kind is _Kind.POSITIONS else positions
        if arg.kind is _Kind.KEY_MASK and self._key_mask is not None:
            return active.state._prefix_key_mask(active.chunk, self._key_mask)
        return super()._resolve(arg)


def _runtime(config: PretrainedConfig, block: _Recipe | None, **kwargs: Any) -> _Runtime:
    """The runtime for one layer forward: plain outside ``seq_chunk``, chunk-aware inside.

    ``block`` is the decoder block's recipe (None for the embedding layer).
    """
    active = _ACTIVE.get()
    if active is None:
        return _Runtime(**kwargs)
    reason = _chunk_refusal(config, block)
    model_type = getattr(config, "model_type", type(config).__name__)
    if reason is not None:
        raise ValueError(f"model type {model_type!r} cannot run in sequence chunks: {reason}")
    where = f"model type {model_type!r} decoder block" if block is not None else None
    return _ChunkRuntime(active, block=where, **kwargs)


def _chunk_refusal(config: PretrainedConfig, block: _Recipe | None) -> str | None:
    """Why this model cannot be chunked exactly, or None."""
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
    if block is not None and not any(arg.name == "past_key_values" for arg in (*block.positional, *block.keyword)):
        return "its decoder blocks are not given past_key_values, so earlier chunks' keys/values cannot be fed in"
    return None


def _rope_types(parameters: Any) -> set[str]:
    # rope_parameters is one dict, or one dict per layer type (e.g. Gemma3).
    if not isinstance(parameters, dict):
        return set()
    found = {str(parameters["rope_type"])} if "rope_type" in parameters else set()
    for value in parameters.values():
        found |= _rope_types(value)
    return found
