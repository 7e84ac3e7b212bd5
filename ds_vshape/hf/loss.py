"""Loss of the pipeline: the shifted next-token cross-entropy transformers uses for ``labels=``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "IGNORE_INDEX",
    "causal_lm_loss",
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
