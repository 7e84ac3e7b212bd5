"""``pipeline.weight_grads_in_b``: which parameters' weight gradients B computes, by module path.

A pattern is an ``fnmatch`` pattern (case-sensitive) matched against the path of the module
that holds a parameter, as ``root.named_modules()`` names it: in a pipeline model the layer's
index comes first, then the path inside the layer (``"3.block.self_attn.q_proj"`` for an HF
decoder block built by ``ds_vshape.hf.pipeline_layers``; ``"tied_modules.<key>..."`` for a tied
layer). Torch-free: the config, the engine and the split package all read these rules here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from fnmatch import fnmatchcase

__all__ = ["FIELD", "matching", "unmatched", "unmatched_error"]

FIELD = "pipeline.weight_grads_in_b"
_EXAMPLES = 4  # module paths quoted in an error, so that the user sees what a pattern is matched against


def matching(path: str, patterns: Sequence[str]) -> list[str]:
    """The patterns that match a module's ``path``."""
    return [p for p in patterns if fnmatchcase(path, p)]


def unmatched(paths: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """The patterns that match none of ``paths``, in the order given."""
    hit: set[str] = set()
    for path in paths:
        hit.update(matching(path, patterns))
    return [p for p in patterns if p not in hit]


def unmatched_error(pattern: str, paths: Sequence[str]) -> ValueError:
    """The error for a pattern that matches no module holding a trainable parameter in the whole model."""
    shown = ", ".join(repr(p) for p in list(dict.fromkeys(paths))[:_EXAMPLES]) or "none"
    return ValueError(f"{FIELD}: pattern {pattern!r} matches no module holding a trainable parameter in the model "
                      f"(module paths look like {shown}); fix the pattern (e.g. '*self_attn*') or remove it")
