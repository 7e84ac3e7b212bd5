"""Loss of the pipeline: the shifted next-token cross-entropy transformers uses for ``labels=``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "IGNORE_INDEX",
    "causal_lm_chunk_loss",
    "causal_lm_loss",
    "shifted_targets",
]

IGNORE_INDEX = -100


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


def shifted_targets(labels: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(targets, count)`` of a whole sequence: ``targets[t] = labels[t + 1]`` (``IGNORE_INDEX`` at the end).

    Shifted once for the whole sequence, so a sequence chunk's targets are a plain slice
    (its last position predicts the next chunk's first label); ``count`` is the number of
    targets that count, the denominator of every chunk's share of the loss.
    """
    if not isinstance(labels, torch.Tensor):
        labels = labels[0]
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    return targets, (targets != IGNORE_INDEX).sum()


def causal_lm_chunk_loss(logits: torch.Tensor, targets: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """One sequence chunk's share of ``causal_lm_loss``: its summed cross-entropy over ``count``.

    ``targets`` is the chunk's slice of ``shifted_targets``; the shares of all chunks of a
    sequence add up to the whole sequence's mean loss.
    """
    flat_logits = logits.float().reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).to(flat_logits.device)
    total = F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / count.to(total.device)
