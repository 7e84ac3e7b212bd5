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
recipe and hands it to the next pass while nothing it was built from has changed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
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


class _Rotary(threading.local):
    """Per rotary module (weakly: the entries go with it; each block holds a copy of its own, and the
    first block of a pass builds the pass's output) and recipe (its id): the recipe, what the output was
    built from, the output, and its tensors' versions when built."""

    def __init__(self) -> None:
        self.entries: weakref.WeakKeyDictionary[nn.Module, dict[int, tuple[object, Hashable, Any, tuple[int, ...]]]] = \
            weakref.WeakKeyDictionary()


_ROTARY = _Rotary()


def rotary_across_passes(recipe: object, rope: nn.Module, reference: torch.Tensor, build: Callable[[], Any]) -> Any:
    """``build()``: the rotary output of positions 0..s-1 for ``reference`` (the hidden states or token ids),
    the same object as the latest pass's on this module and recipe when nothing it was built from changed
    (the module's buffers' storage, version and dtype, its scaling, the reference's shape, dtype and device,
    grad and autocast modes) and none of its tensors was written in place since. Only for history-free
    rotary modules (``history_free``), whose output depends on nothing else; an output with a tensor that
    records history or is an inference tensor is never kept (another pass must not share its graph, and a
    training pass could not save it)."""
    tensors = [b for b in rope._buffers.values() if b is not None]
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or any(b.is_inference() for b in tensors):
        return build()  # an inference tensor has no version to tell a buffer written in place
    where = (tuple((b.data_ptr(), b._version, b.dtype) for b in tensors), getattr(rope, "attention_scaling", None),
             reference.shape, reference.dtype, reference.device, torch.is_grad_enabled(), torch._C._is_any_autocast_enabled())
    kept = _ROTARY.entries.get(rope)
    entry = kept.get(id(recipe)) if kept is not None else None
    if entry is not None and entry[0] is recipe and entry[1] == where and _versions(entry[2]) == entry[3]:
        return entry[2]
    out = build()
    versions = _versions(out)
    if kept is None:
        kept = _ROTARY.entries[rope] = {}
    if versions is not None:
        kept[id(recipe)] = (recipe, where, out, versions)
    else:
        kept.pop(id(recipe), None)
    return out


def _versions(out: Any) -> tuple[int, ...] | None:
    """The version of each tensor of a (cos, sin) pair or a tensor; None where it may not be shared."""
    tensors = out if isinstance(out, (tuple, list)) else (out,)
    if not all(type(t) is torch.Tensor and not t.requires_grad and not t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)
