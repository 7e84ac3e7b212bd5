"""Split backward for a rank's stages, with ``pipeline.weight_grads_in_b`` checked across ranks.

Each rank builds only its own layers, so whether a pattern matches anything in the whole model
is known only by asking every rank: one all-reduce of per-pattern hits. Every rank calls this
at the same point (engine construction, or auto installing the first split schedule: the
choice is the same everywhere) with the same patterns (one config), so every rank gets the same
sums and a pattern that matches nowhere is refused on all of them alike, none left waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .in_b import FIELD, trainable_paths, unmatched, unmatched_error
from .split_backward import WeightGradStore, enable_split_backward

__all__ = ["enable_for_stages"]


def enable_for_stages(modules: list[nn.Module], store: WeightGradStore, *, root: nn.Module, in_b: Sequence[str],
                      device: torch.device, log: Callable[[str], None]) -> int:
    """``enable_split_backward`` on this rank's stage modules; raises on every rank for a pattern that
    matches no module holding a trainable parameter on any rank, and ``log`` s once the patterns
    that match nothing on this rank only."""
    if in_b:
        paths = trainable_paths(modules, root=root)
        missing = unmatched(paths, in_b)
        hits = torch.tensor([pattern not in missing for pattern in in_b], dtype=torch.int64, device=device)
        dist.all_reduce(hits)  # every rank, same patterns: see the module docstring
        rank = dist.get_rank()
        for pattern, count in zip(in_b, hits.tolist()):
            if count == 0:
                raise unmatched_error(pattern, paths, where=f"the model on any rank (rank {rank} here)")
        if missing:
            log(f"rank {rank}: {FIELD}: {', '.join(repr(p) for p in missing)} match no module of this rank's stages "
                "(other ranks hold what they match)")
    return enable_split_backward(modules, store, root=root, in_b=in_b)
