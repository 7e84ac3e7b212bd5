"""LM-level semantics: what the model's own causal-LM forward does to the logits, and which loss it uses.

``check_head_semantics`` runs the LM's forward with its base model and head
replaced by stubs (via ``hollow``, a shallow copy with some submodules
swapped, also used to build the embedding layer).  It records the LM's logit
post-processing (scaling, soft-capping; see ``logits``) for the last pipeline
layer to replay, checks that the replay is the model's on other logits and
works on any slice of positions or sequences, and refuses, with
``ValueError``, post-processing it cannot replay and any loss other than
``causal_lm_loss``.  Everything here is internal to ``ds_vshape.hf``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from .analysis import Anatomy, is_ancestor
from .logits import LogitOps, LogitRecorder
from .loss import IGNORE_INDEX, causal_lm_loss

__all__ = [
    "check_head_semantics",
    "hollow",
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


def check_head_semantics(lm: PreTrainedModel, anatomy: Anatomy) -> LogitOps | None:
    """Run the LM's own forward around stub body/head: what it does to the logits, and its loss.

    Returns the LM's logit post-processing to replay on the pipeline's logits (None when the
    logits pass unchanged).  Refuses (``ValueError``) post-processing that cannot be replayed
    from the logits alone or mixes positions, and any loss other than ``causal_lm_loss``.
    """
    vocab, width = lm.get_submodule(anatomy.head).weight.shape
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, vocab, generator=generator)
    name = type(lm).__name__
    recorder = LogitRecorder(logits)
    with recorder:
        out = _run_probe(lm, anatomy, torch.zeros(2, 3, width), logits)
    ops = recorder.chain(out.logits, what=name)
    if ops is not None:
        _check_replay(lm, anatomy, ops, vocab=vocab, width=width, generator=generator)
    labels = torch.randint(0, vocab, (2, 3), generator=generator)
    labels[0, 1] = labels[1, 0] = IGNORE_INDEX
    out = _run_probe(lm, anatomy, torch.zeros(2, 3, width), logits, labels=labels)
    ours = causal_lm_loss(logits if ops is None else ops(logits), labels)
    if not torch.allclose(out.loss, ours, rtol=1e-5, atol=1e-6):
        raise ValueError(f"{name} uses a loss other than shifted next-token cross-entropy")
    return ops


def _check_replay(
    lm: PreTrainedModel, anatomy: Anatomy, ops: LogitOps, *, vocab: int, width: int, generator: torch.Generator
) -> None:
    """The recorded post-processing must be the model's on other logits too, and work position by position."""
    name = type(lm).__name__
    for scale in (1.0, 100.0):  # large values reach e.g. a soft-cap's saturation
        logits = scale * torch.randn(3, 4, vocab, generator=generator)
        hidden = torch.randn(3, 4, width, generator=generator)
        if not torch.equal(ops(logits), _run_probe(lm, anatomy, hidden, logits).logits):
            raise ValueError(f"{name}'s logit post-processing depends on more than the LM head's output")
        whole = ops(logits)
        # Sequence chunks and micro-batches post-process their own slice only.
        if not (torch.equal(whole[:, 1:], ops(logits[:, 1:])) and torch.equal(whole[1:], ops(logits[1:]))):
            raise ValueError(
                f"{name}'s logit post-processing mixes positions or sequences; cannot run it per micro-batch and chunk"
            )


def _run_probe(
    lm: PreTrainedModel, anatomy: Anatomy, hidden: torch.Tensor, logits: torch.Tensor, *,
    labels: torch.Tensor | None = None,
) -> Any:
    """The LM's forward with its base model returning ``hidden`` and its head returning ``logits``."""
    replacements: dict[str, nn.Module] = {anatomy.base: _StubBase(hidden), anatomy.head: _StubHead(logits)}
    if anatomy.norm is not None and not is_ancestor(anatomy.base, anatomy.norm):
        replacements[anatomy.norm] = nn.Identity()
    probe = hollow(lm, replacements)
    input_ids = torch.zeros(hidden.shape[:2], dtype=torch.long)
    try:
        return probe(input_ids=input_ids, labels=labels, use_cache=False)
    except Exception as error:
        raise ValueError(f"cannot check the LM head semantics of {type(lm).__name__}: {error!r}") from error


def hollow(root: nn.Module, replacements: Mapping[str, nn.Module]) -> nn.Module:
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
        clone._modules[head] = hollow(child, inner)
    return clone
