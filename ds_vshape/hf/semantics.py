"""LM-level semantics: the model's own causal-LM forward must neither post-process logits nor use another loss.

``_check_head_semantics`` runs the LM's forward with its base model and head
replaced by stubs (via ``_hollow``, a shallow copy with some submodules
swapped, also used to build the embedding layer) and refuses, with
``ValueError``, models whose logits or loss differ from what the pipeline
computes.  Everything here is internal to ``ds_vshape.hf``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from .analysis import _Anatomy, _is_ancestor
from .loss import IGNORE_INDEX, causal_lm_loss

__all__ = [
    "_check_head_semantics",
    "_hollow",
]

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
