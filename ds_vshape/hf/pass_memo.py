"""What the decoder blocks of one forward pass share: rotary embeddings and attention masks.

A Hugging Face model's forward builds them once and hands them to every layer; a pipeline stage
runs its blocks as separate layers, each resolving its own arguments (``tracing.Runtime``).
``pass_memo`` gives the blocks of one pass one memo, so they are built once per pass again.

A pass is known by its key mask: the embedding layer makes a fresh one per forward and every
block hands it on unchanged, while an engine gives each stage's forward its own tensor objects.
The memo of the latest pass on a thread is kept, and only that one: the next pass replaces it,
and it goes when its key mask is freed, so it never holds more than one pass's masks, also
where activation checkpointing frees each block's.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

__all__ = ["Memo", "history_free", "pass_memo"]

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
