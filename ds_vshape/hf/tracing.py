"""Run the model once on the ``meta`` device and record what it does; replay recorded calls.

``trace_model`` hooks every module and temporarily wraps the
``transformers.masking_utils`` mask builders, then runs the model's own
forward on meta tensors (no memory, no FLOPs): the ``Trace`` holds the order
in which modules started and ended, every module call with its arguments and
output, and every mask-builder call.  The forward is handed an empty
``TraceCache`` (see ``cache_role``), so that the trace shows which arguments
carry the model's KV cache, under whatever name, and which blocks store
keys/values through it.  A ``Recipe`` says how to call a function
again at run time, each argument tagged with a ``Kind`` telling where its
value comes from; ``Runtime`` resolves those for one forward of one pipeline
layer.  Everything here is internal to ``ds_vshape.hf``.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from .cache_role import TraceCache, call_with_cache
from .pass_memo import Memo, history_free, rotary_across_passes

__all__ = [
    "Arg",
    "Call",
    "Kind",
    "MaskRecipe",
    "Recipe",
    "RopeRef",
    "Runtime",
    "Trace",
    "trace_model",
]

# Shape of the meta-device trace batch; any small sizes > 1 would do.
_TRACE_BATCH, _TRACE_SEQ = 2, 5


# ----------------------------------------------------------------------- recipes


class Kind(enum.Enum):
    """Where the value of one recorded call argument comes from at run time."""

    CONST = "const"  # a non-tensor value, replayed as recorded
    HIDDEN = "hidden"  # the hidden state flowing through the pipeline
    INPUT_IDS = "input_ids"
    KEY_MASK = "key_mask"  # 2-D padding mask (1 = token, 0 = padding)
    POSITIONS = "positions"  # arange(seq)[None]
    CACHE_POSITIONS = "cache_positions"  # arange(seq)
    ROPE = "rope"  # output of a weight-free rotary module, re-run
    MASK = "mask"  # output of a masking_utils builder, re-run
    CACHE = "cache"  # the model's KV cache: None, as in training, except inside a sequence chunk


@dataclass(frozen=True)
class Arg:
    name: str
    kind: Kind
    value: Any = None


@dataclass(frozen=True)
class Recipe:
    """How to call one function again: the first argument positionally, the rest by name."""

    positional: tuple[Arg, ...]
    keyword: tuple[Arg, ...]


@dataclass(frozen=True, eq=False)
class MaskRecipe:
    builder: Callable[..., Any]
    recipe: Recipe


@dataclass(frozen=True, eq=False)
class RopeRef:
    path: str
    recipe: Recipe

    @functools.cached_property
    def positions_only(self) -> bool:
        """Whether the call reads nothing but positions, constants and the hidden states (whose shape,
        dtype and device a history-free rotary module reads, never their values)."""
        return all(arg.kind in _SHAPE_KINDS for arg in (*self.recipe.positional, *self.recipe.keyword))


_SHAPE_KINDS = frozenset({Kind.CONST, Kind.HIDDEN, Kind.INPUT_IDS, Kind.POSITIONS, Kind.CACHE_POSITIONS, Kind.CACHE})


class Runtime:
    """Resolves recipe arguments for one forward call of one pipeline layer (with ``memo``, sharing the
    rotary and mask outputs with the other layers of the pass that hold the same memo, and the rotary
    output with later passes: ``pass_memo.rotary_across_passes``)."""

    # Positions are 0..s-1 in every pass here; a runtime that resolves other positions says False.
    ROTARY_ACROSS_PASSES = True

    def __init__(
        self,
        *,
        hidden: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        ropes: Mapping[str, nn.Module] | None = None,
        memo: Memo | None = None,
    ) -> None:
        self._hidden, self._input_ids, self._key_mask = hidden, input_ids, key_mask
        self._ropes = ropes or {}
        # Rotary and mask outputs by recipe: ``memo`` where the blocks of a pass share them (``pass_memo``),
        # ``_own`` for what this call must build itself (a rotary module with a history of its own).
        self._own: Memo = {}
        self._memo: Memo = self._own if memo is None else memo

    def call(self, fn: Callable[..., Any], recipe: Recipe) -> Any:
        args = [self._resolve(arg) for arg in recipe.positional]
        kwargs = {arg.name: self._resolve(arg) for arg in recipe.keyword}
        return fn(*args, **kwargs)

    def _resolve(self, arg: Arg) -> Any:
        kind = arg.kind
        if kind is Kind.CONST:
            return arg.value
        if kind is Kind.HIDDEN:
            return self._hidden
        if kind is Kind.INPUT_IDS:
            return self._input_ids
        if kind is Kind.KEY_MASK:
            return self._key_mask
        if kind is Kind.POSITIONS:
            return self._positions().unsqueeze(0)
        if kind is Kind.CACHE_POSITIONS:
            return self._positions()
        if kind is Kind.CACHE:
            return None
        if kind is Kind.ROPE:
            ref: RopeRef = arg.value
            rope = self._ropes[ref.path]
            # A rotary module whose buffers follow the lengths it has seen (HF's "dynamic" types) keeps its
            # own output: each block's copy must see every pass, or a block re-run in backward would differ.
            if not history_free(rope):
                return self._once(ref, lambda: self.call(rope, ref.recipe), memo=self._own)
            reference = self._hidden if self._hidden is not None else self._input_ids
            if self._memo is self._own or not self.ROTARY_ACROSS_PASSES or reference is None or not ref.positions_only:
                return self._once(ref, lambda: self.call(rope, ref.recipe))
            # The same positions in every pass (0..s-1): the latest pass's output serves this one.
            return self._once(ref, lambda: rotary_across_passes(ref, rope, reference, lambda: self.call(rope, ref.recipe)))
        mask: MaskRecipe = arg.value
        return self._once(mask, lambda: self._build_mask(mask))

    def _build_mask(self, mask: MaskRecipe) -> Any:
        # masking_utils builders read position_ids only to detect packed sequences, and that
        # check copies a device tensor's truth value to the host: on a GPU the host waits for
        # every kernel queued before it, in every block. Positions here are never packed (0..s-1,
        # or start..end inside a chunk, where the cache turns the check off), so the builder
        # finds no packing: without position_ids it builds the same mask, sync-free.
        def resolve(arg: Arg) -> Any:
            return None if arg.kind is Kind.POSITIONS else self._resolve(arg)

        args = [resolve(arg) for arg in mask.recipe.positional]
        kwargs = {arg.name: resolve(arg) for arg in mask.recipe.keyword}
        return mask.builder(*args, **kwargs)

    def _once(self, key: object, compute: Callable[[], Any], *, memo: Memo | None = None) -> Any:
        # Blocks may share a mask/rotary output (one recipe object per model output); compute it once.
        # The entry holds its recipe: a pass memo outlives the layers that filled it where another model
        # runs on the same key mask, and a freed recipe's id may then name a new recipe of another kind.
        memo = self._memo if memo is None else memo
        entry = memo.get(id(key))
        if entry is None or entry[0] is not key:
            entry = memo[id(key)] = (key, compute())
        return entry[1]

    def _positions(self) -> torch.Tensor:
        # No KV cache and no packing: positions are always 0..s-1, as HF does
        # when position_ids is not given (also with padding).
        ref = self._hidden if self._hidden is not None else self._input_ids
        assert ref is not None
        return torch.arange(ref.shape[1], device=ref.device)


# ------------------------------------------------------------------------- trace


@dataclass
class Call:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    output_version: int | None = None  # the output's version counter when the call ended (a tensor output)


@dataclass
class _MaskCall:
    builder: Callable[..., Any]
    arguments: dict[str, Any]
    marker: torch.Tensor


@dataclass
class Trace:
    events: list[tuple[str, str]] = field(default_factory=list)  # ("start"|"end", module path)
    calls: dict[str, list[Call]] = field(default_factory=dict)
    masks: list[_MaskCall] = field(default_factory=list)
    input_mask: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    training: bool = False  # the model was in training mode (a dropout then shows as a new tensor)
    # Version counters of the tensors each module received, when it started (its first call): id -> version.
    start_versions: dict[str, dict[int, int]] = field(default_factory=dict)
    offer_cache: bool = False  # hand a TraceCache to the first forward with a Cache-typed parameter
    cache: TraceCache | None = None  # the cache handed to the model, once a forward took it
    cache_updates: list[int] = field(default_factory=list)  # len(events) at each K/V update through it

    def index(self, kind: str, path: str) -> int:
        return self.events.index((kind, path))


def trace_model(lm: PreTrainedModel, *, with_padding: bool) -> Trace:
    """Run ``lm`` once on meta tensors, recording module calls and mask builder calls.

    The first attempt hands the model a ``TraceCache``; a model that cannot
    run with one is traced without (it then cannot run in sequence chunks).
    """
    box = [Trace()]  # the hooks read the trace to fill from a box, so a retry can swap in a fresh one
    handles = []
    for path, module in lm.named_modules():
        handles.append(module.register_forward_pre_hook(functools.partial(_on_start, box, path), with_kwargs=True))
        handles.append(module.register_forward_pre_hook(functools.partial(_hand_cache, box), with_kwargs=True))
        handles.append(module.register_forward_hook(functools.partial(_on_end, box, path), with_kwargs=True))
    plain_error: Exception | None = None  # what the model's plain fp32 forward ran into
    try:
        # Some kernels (e.g. grouped MoE matmuls) accept only bf16, even on
        # meta; the dtype does not change the structure we record.
        for with_cache, dtype in ((True, None), (True, torch.bfloat16), (False, None), (False, torch.bfloat16)):
            box[0] = Trace()
            try:
                _run_on_meta(lm, box[0], with_padding=with_padding, dtype=dtype, with_cache=with_cache)
                return box[0]
            except _TraceRefusal:
                raise
            except Exception as error:  # any failure of all attempts means we cannot understand the model
                if not with_cache and dtype is None:
                    plain_error = error
    finally:
        for handle in handles:
            handle.remove()
    raise ValueError(f"cannot trace {type(lm).__name__} on the meta device: {plain_error!r}") from plain_error


def _run_on_meta(
    lm: PreTrainedModel, trace: Trace, *, with_padding: bool, dtype: torch.dtype | None, with_cache: bool
) -> None:
    input_ids = torch.zeros(_TRACE_BATCH, _TRACE_SEQ, dtype=torch.long, device="meta")
    key_mask = torch.ones_like(input_ids) if with_padding else None
    trace.input_mask, trace.input_ids, trace.training = key_mask, input_ids, lm.training
    trace.offer_cache = with_cache
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


def _on_start(box: list[Trace], path: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    trace = box[0]
    trace.events.append(("start", path))
    if path not in trace.start_versions:  # what an in-place change between two modules would show
        values = (*args, *kwargs.values())
        trace.start_versions[path] = {id(t): t._version for t in values if isinstance(t, torch.Tensor)}


def _hand_cache(
    box: list[Trace], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Hand a ``TraceCache`` to the first forward (outermost first) that has a ``Cache``-typed parameter."""
    trace = box[0]
    if not trace.offer_cache or trace.cache is not None:
        return None
    cache = TraceCache(on_update=lambda: trace.cache_updates.append(len(trace.events)))
    handed = call_with_cache(module.forward, args, kwargs, cache)
    if handed is not None:
        trace.cache = cache
    return handed


def _on_end(
    box: list[Trace], path: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> None:
    box[0].events.append(("end", path))
    version = output._version if isinstance(output, torch.Tensor) else None
    box[0].calls.setdefault(path, []).append(Call(args, dict(kwargs), output, version))


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
            elif _is_legacy_bidirectional_builder(value):
                namespace[attr] = _refuser(value)
            else:
                continue
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


def _is_legacy_bidirectional_builder(value: Any) -> bool:
    # Models older than masking_utils (e.g. BERT on transformers 4.5x) build
    # their 4-D masks with these; the non-causal ones read mask values, which
    # the meta device cannot, so the trace would fail without saying why.
    return (
        inspect.isfunction(value)
        and value.__module__ == "transformers.modeling_attn_mask_utils"
        and value.__name__.startswith("_prepare_4d")
        and "causal" not in value.__name__
    )


class _TraceRefusal(ValueError):
    """Raised while tracing when what the model does settles that it cannot be split."""


def _refuser(builder: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(builder)
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise _TraceRefusal(
            f"the model builds a bidirectional attention mask ({builder.__name__}); only causal decoder-only "
            "models can be split (encoder-only models are not causal LMs)"
        )

    return refuse


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
