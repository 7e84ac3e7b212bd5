"""Exact causal attention across sequence chunks (Seq1F1B) for the ``ds_vshape.hf`` layers.

A micro-batch's sequence is cut into chunks ``[b_0=0, b_1), [b_1, b_2), ...``.
On one pipeline stage, chunk ``j``'s forward sees the hidden states of its own
positions only and attends to the keys/values of positions ``[0, b_{j+1})``,
which the stage keeps in a ``ChunkKVState`` (one per stage and micro-batch):

    with seq_chunk(state, start=b_j, end=b_j1):
        out = stage_forward(chunk_inputs)          # the layers' ordinary forward

Inside the context every recorded call is replayed the way transformers runs
a model with a KV cache of ``start`` tokens: a ``Cache`` stand-in is passed
wherever the model passes its cache (the arguments the trace recorded as
``Kind.CACHE``, whatever their name: ``past_key_values``, ``cache``,
``layer_past``, ...; so positions, rotary and learned position embeddings
start at ``start``, and the mask builders make the bottom-right aligned causal
or sliding-window mask of ``end - start`` query rows by ``end`` key columns),
and the 2-D padding mask is that of positions ``[0, end)``.  Under SDPA, a plain causal
mask (no padding, no sliding window) is passed as ``causal_lower_right`` instead of
a materialised one: CUDA kernels then need no mask at all, and elsewhere it is one
``(queries, keys)`` matrix instead of one per row of the batch that SDPA keeps for
backward in every layer.

Each attention layer's new K/V (what HF hands to the cache's ``update``:
after rotary, before the grouped-query repeat) is written into one buffer per
layer (``kv_buffer``), and the chunk attends to the buffer's positions ``[0, end)``,
so backward keeps the keys and values once, as the unchunked model does.  The
state keeps, per chunk, a detached leaf viewing its positions, whose ``.grad``
the later chunks' backward fills, and the gradient edge of the graph-connected
K/V, for chunk ``j``'s own backward.  Backward therefore runs chunks in
descending order, and chunk ``j`` passes ``state.backward_roots(j)`` as extra
roots to ``torch.autograd.backward`` so those gradients flow on into its own
graph; ``state.release(j)`` then drops what chunk ``j`` kept.  Outside a
``seq_chunk`` context nothing changes.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.nn.attention.bias import causal_lower_right
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from .cache_role import query_length
from .chunkable import chunk_refusal_message
from .kv_buffer import KVBuffer
from .pass_memo import pass_memo
from .tracing import Arg, Kind, MaskRecipe, Recipe, Runtime

__all__ = [
    "ChunkKVState",
    "block_runtime",
    "seq_chunk",
]


@dataclass
class _KV:
    """One attention layer's K/V of one chunk: where their gradients enter its graph, and their leaves."""

    # Edges, not the tensors: the tensors' values live on in the layer's buffer.
    key: GradientEdge | None  # None when the chunk ran without autograd
    value: GradientEdge | None
    leaf_key: torch.Tensor  # views of the buffers, detached
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
        self._buffers: dict[int, tuple[KVBuffer, KVBuffer]] = {}  # per layer: keys, values
        self._capacity = 0  # positions to allocate per buffer: the whole sequence when known
        self._key_masks: dict[int, torch.Tensor] = {}
        self._closed = False

    @property
    def num_chunks(self) -> int:
        """Chunks that ran forward since the last reset."""
        return len(self._bounds)

    def backward_roots(self, chunk: int) -> tuple[list[GradientEdge], list[torch.Tensor]]:
        """Extra ``(tensors, grad_tensors)`` for ``torch.autograd.backward`` of ``chunk``.

        They are the gradient edges of chunk ``chunk``'s own K/V with the gradients that the
        later chunks' backward accumulated into their detached copies (pairs
        without any gradient are left out: a zero gradient adds nothing).
        Raises ``RuntimeError`` when a later chunk has not run (and released)
        its backward yet.
        """
        self._check_backward_order(chunk, "backward")
        self._closed = True
        tensors: list[GradientEdge] = []
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
        if not self._kv:  # every chunk released: no view of the buffers is needed any more
            self._buffers.clear()

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

    def kept_tensors(self) -> list[torch.Tensor]:
        """What the state holds for the chunks that did not release yet: the K/V buffers and key masks."""
        buffers = [b.data for pair in self._buffers.values() for b in pair if b.data is not None]
        return buffers + list(self._key_masks.values())

    def _begin(self, start: int, end: int, total: int | None = None) -> int:
        """Register a chunk's forward; returns its index."""
        if not 0 <= start < end:
            raise ValueError(f"a sequence chunk needs 0 <= start < end, got [{start}, {end})")
        if start == 0:
            self._reset()
            self._capacity = max(total or end, end)
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
        start, end = self._bounds[chunk]
        if key.shape[-2] != end - start or value.shape[-2] != end - start:
            raise RuntimeError(f"attention layer {layer} gave keys/values of {key.shape[-2]} positions in chunk {chunk} "
                               f"[{start}, {end})")
        key_buffer, value_buffer = self._buffers.setdefault(layer, (KVBuffer(), KVBuffer()))
        keys, leaf_key = key_buffer.append(key, start, end, self._capacity, [kv.leaf_key for kv in earlier])
        values, leaf_value = value_buffer.append(value, start, end, self._capacity, [kv.leaf_value for kv in earlier])
        kept[layer] = _KV(_edge(key), _edge(value), leaf_key, leaf_value)
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


def _edge(tensor: torch.Tensor) -> GradientEdge | None:
    return get_gradient_edge(tensor) if tensor.requires_grad else None


# ------------------------------------------------------------------ the context


class _ChunkCache(Cache):
    """What the model's attention and mask code see as its cache inside a chunk.

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

    def get_mask_sizes(self, query: int | torch.Tensor, layer_idx: int = 0) -> tuple[int, int]:
        # All earlier keys are kept (also for sliding-window layers, whose
        # window the mask function applies), so keys always start at 0.
        return self._start + query_length(query), 0


@dataclass(frozen=True)
class _Active:
    state: ChunkKVState
    chunk: int
    start: int
    end: int
    cache: _ChunkCache


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("ds_vshape_seq_chunk", default=None)


@contextlib.contextmanager
def seq_chunk(state: ChunkKVState, *, start: int, end: int, total: int | None = None) -> Iterator[None]:
    """Run the ``ds_vshape.hf`` layers called inside on positions ``[start, end)`` of a micro-batch.

    The layers' inputs must then hold exactly those ``end - start``
    positions; attention also reads the keys/values that ``state`` kept from
    the earlier chunks of the same micro-batch on this stage.  ``total``, given
    with the first chunk, is the micro-batch's whole length: the K/V buffers are
    then made once (without it, each later chunk moves them to a longer one).
    Contexts do not nest.  Layers of a model that cannot be chunked exactly
    raise ``ValueError`` naming the model type and the reason.
    """
    if _ACTIVE.get() is not None:
        raise RuntimeError("seq_chunk contexts do not nest")
    chunk = state._begin(start, end, total)
    token = _ACTIVE.set(_Active(state, chunk, start, end, _ChunkCache(state, chunk=chunk, start=start)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class _ChunkRuntime(Runtime):
    """Resolves recipe arguments as transformers would with a cache of ``start`` tokens."""

    ROTARY_ACROSS_PASSES = False  # a chunk's positions are start..end: its own rotary output

    def __init__(self, active: _Active, *, block: str | None, sdpa: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._active, self._block, self._depth, self._sdpa = active, block, 0, sdpa
        reference = kwargs.get("hidden") if kwargs.get("hidden") is not None else kwargs.get("input_ids")
        length = active.end - active.start
        if reference is not None and reference.shape[1] != length:
            raise ValueError(
                f"chunk [{active.start}, {active.end}) needs inputs of {length} positions, got {reference.shape[1]}"
            )

    def call(self, fn: Any, recipe: Recipe) -> Any:
        # Nested calls rebuild masks and rotary embeddings; only the outermost
        # (the block itself) must have stored keys/values.
        before, self._depth = self._active.cache.updates, self._depth + 1
        try:
            out = super().call(fn, recipe)
        finally:
            self._depth -= 1
        if self._depth == 0 and self._block is not None and self._active.cache.updates == before:
            raise ValueError(f"{self._block}: it ran without storing keys/values through its cache's update")
        return out

    def _resolve(self, arg: Arg) -> Any:
        active = self._active
        if arg.kind is Kind.CACHE:
            return active.cache
        if arg.kind in (Kind.POSITIONS, Kind.CACHE_POSITIONS):
            reference = self._hidden if self._hidden is not None else self._input_ids
            assert reference is not None
            positions = torch.arange(active.start, active.end, device=reference.device)
            return positions.unsqueeze(0) if arg.kind is Kind.POSITIONS else positions
        if arg.kind is Kind.KEY_MASK and self._key_mask is not None:
            return active.state._prefix_key_mask(active.chunk, self._key_mask)
        if arg.kind is Kind.MASK and self._sdpa and _plain_causal(arg.value):
            # HF would materialise a [batch, 1, queries, keys] mask, which SDPA saves for backward
            # in every layer: with long sequences more than the chunk's other activations.
            return self._once(arg.value, lambda: causal_lower_right(active.end - active.start, active.end))
        return super()._resolve(arg)


def _plain_causal(mask: MaskRecipe) -> bool:
    """Whether the builder makes nothing but the causal mask: no padding, no window, no extra mask functions."""
    if getattr(mask.builder, "__name__", "") != "create_causal_mask":
        return False
    args = (*mask.recipe.positional, *mask.recipe.keyword)
    if any(arg.kind is Kind.KEY_MASK for arg in args):
        return False
    return all(arg.value is None for arg in args if arg.name in ("or_mask_function", "and_mask_function"))


def block_runtime(config: PretrainedConfig, block: Recipe | None, *, stores_kv: bool = True, **kwargs: Any) -> Runtime:
    """The runtime for one layer forward: plain outside ``seq_chunk``, chunk-aware inside.

    ``block`` is the decoder block's recipe (None for the embedding layer),
    ``stores_kv`` whether the block stored keys/values through the model's cache when traced.
    """
    active = _ACTIVE.get()
    if active is None:  # built once per pass, as the model's own forward builds them (in a chunk: per block)
        memo = pass_memo(kwargs.get("key_mask"), kwargs.get("hidden")) if block is not None else None
        return Runtime(memo=memo, **kwargs)
    # Normally refused at initialize already (ds_vshape.hf.seq_chunk_refusal); this
    # covers layers run by hand and configs changed after initialize.
    refusal = chunk_refusal_message(config, block, stores_kv=stores_kv)
    if refusal is not None:
        raise ValueError(refusal)
    model_type = getattr(config, "model_type", type(config).__name__)
    where = f"model type {model_type!r} decoder block" if block is not None else None
    sdpa = getattr(config.get_text_config(), "_attn_implementation", None) == "sdpa"
    return _ChunkRuntime(active, block=where, sdpa=sdpa, **kwargs)
