"""What the decoder blocks of one forward pass share: rotary embeddings and attention masks.

A Hugging Face model's forward builds them once and hands them to every layer; a pipeline stage
runs its blocks as separate layers, each resolving its own arguments (``tracing.Runtime``).
``pass_memo`` gives the blocks of one pass one memo, so they are built once per pass again.

A pass is known by its key mask: the embedding layer makes a fresh one per forward and every
block hands it on unchanged, while an engine gives each stage's forward its own tensor objects.
The memo of the latest pass on a thread is kept, and only that one: the next pass replaces it,
and it goes when its key mask is freed, so it never holds more than one pass's masks, also
where activation checkpointing frees each block's.

The rotary output does not depend on the pass at all where the positions are 0..s-1: a schedule
that splits a rank's layers into more passes (V placement, interleaving) would rebuild it in
every one, a fixed host cost per pass. ``rotary_across_passes`` keeps the latest one per rotary
module and hands it to the next pass while nothing it was built from has changed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Memo", "history_free", "pass_memo", "rotary_across_passes"]

# Rotary and mask outputs by recipe: the recipe object's id -> (the recipe itself, its output). The
# entry keeps the recipe alive, so its id names it for as long as the entry lives.
Memo = dict[int, tuple[object, Any]]


class _LastPass(threading.local):
    """The latest pass's key mask (weakly), what its outputs depend on besides it, and its memo."""

    key_mask: weakref.ref[torch.Tensor] | None = None
    where: Hashable = None
    memo: Memo | None = None


_LAST = _LastPass()


def pass_memo(key_mask: torch.Tensor | None, hidden: torch.Tensor | None) -> Memo | None:
    """The memo the decoder blocks running on ``key_mask`` share, or None (build per block): no plain
    key-mask tensor, or an inference-mode one (no version counter to tell a mask written in place).

    A new memo whenever the key mask, its version (written in place), the hidden states' dtype, shape
    or device, or grad mode differ from the latest pass's."""
    if type(key_mask) is not torch.Tensor or hidden is None or key_mask.is_inference():
        return None
    where = (key_mask._version, hidden.dtype, hidden.shape, hidden.device, torch.is_grad_enabled())
    last = _LAST
    if last.memo is not None and last.key_mask is not None and last.key_mask() is key_mask and last.where == where:
        return last.memo
    last.key_mask, last.where, last.memo = weakref.ref(key_mask, _forget), where, {}
    return last.memo


def _forget(ref: weakref.ref[torch.Tensor]) -> None:
    """The latest pass's key mask was freed: so are its masks and rotary outputs."""
    if _LAST.key_mask is ref:
        _LAST.key_mask, _LAST.where, _LAST.memo = None, None, None


def history_free(rope: nn.Module) -> bool:
    """Whether ``rope``'s output depends on its input's positions, shape, dtype and device alone, so that
    blocks may share it: Hugging Face's rotary classes (a ``rope_type``) except the "dynamic" types, whose
    frequencies follow the longest sequence seen so far. A module without a ``rope_type`` may keep any
    state: not shared."""
    kind = getattr(rope, "rope_type", None)
    kinds = kind.values() if isinstance(kind, dict) else (kind,)
    return kind is not None and all(isinstance(k, str) and "dynamic" not in k for k in kinds)


@dataclass(frozen=True, eq=False)
class _Kept:
    """The latest rotary output of one module: the recipe and everything else it was built from, the
    output, and its tensors' versions and storages when built."""

    recipe: object
    tensors: tuple[torch.Tensor | None, ...]  # the module's buffers and parameters: the same objects, not rebound
    where: Hashable
    out: Any
    state: tuple[tuple[int, int], ...]


class _Rotary(threading.local):
    """Per rotary module (weakly: its entry goes with it), the latest output it built. A model built
    from a configuration or a checkpoint gives each block a copy of its own (the first block of a
    pass builds the pass's output); one passed as an instance shares its module among its blocks."""

    def __init__(self) -> None:
        self.kept: weakref.WeakKeyDictionary[nn.Module, _Kept] = weakref.WeakKeyDictionary()


_ROTARY = _Rotary()


def rotary_across_passes(recipe: object, rope: nn.Module, reference: torch.Tensor, build: Callable[[], Any]) -> Any:
    """``build()``: the rotary output of positions 0..s-1 for ``reference`` (the hidden states or token ids),
    the same object as the latest pass's on this module when nothing it was built from changed (the recipe,
    the module's buffers and parameters: the same tensors at the same versions; its scaling; the reference's
    shape, dtype and device; autocast) and none of its tensors was written in place or freed since. Only for
    history-free rotary modules (``history_free``), whose output depends on nothing else; an output with a
    tensor that records history or is an inference tensor is never kept (another pass must not share its
    graph, and a training pass could not save it)."""
    # Its own tensors only, read off the module's dicts (a recursive walk costs a good share of what the
    # memo saves): a rotary module with submodules is not shared.
    tensors = (*rope._buffers.values(), *rope._parameters.values())
    if rope._modules or _unshareable(tensors, reference):
        return build()
    device = reference.device.type
    autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device)
    where = (getattr(rope, "attention_scaling", None), reference.shape, reference.dtype, reference.device, autocast,
             tuple(t._version if t is not None else None for t in tensors))
    kept = _ROTARY.kept.get(rope)
    if kept is not None and kept.recipe is recipe and kept.where == where and len(kept.tensors) == len(tensors) \
            and all(a is b for a, b in zip(kept.tensors, tensors)) and _state(kept.out) == kept.state:
        return kept.out
    out = build()
    state = _state(out)
    if state is not None:
        _ROTARY.kept[rope] = _Kept(recipe, tensors, where, out, state)
    else:
        _ROTARY.kept.pop(rope, None)
    return out


def _unshareable(tensors: tuple[torch.Tensor | None, ...], reference: torch.Tensor) -> bool:
    """Where nothing is kept: under compilation, tracing or CUDA graph capture (a graph would hold the
    address of a tensor a later entry lets go of), and for inference tensors (no version to tell a
    tensor written in place)."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or any(t is not None and t.is_inference() for t in tensors):
        return True
    return reference.is_cuda and torch.cuda.is_current_stream_capturing()


def _state(out: Any) -> tuple[tuple[int, int], ...] | None:
    """Each tensor of a (cos, sin) pair or a tensor: its version and data address (a storage freed in
    place, as an offload does, keeps its version; its address becomes 0); None where it may not be shared."""
    tensors = out if isinstance(out, (tuple, list)) else (out,)
    if not all(type(t) is torch.Tensor and not t.requires_grad and not t.is_inference() for t in tensors):
        return None
    return tuple((t._version, t.data_ptr()) for t in tensors)
