"""Where to cut a sequence into k chunks: evenly, or so that every chunk costs the same.

Per transformer layer, token x of a causal sequence costs about ``A * x + L``: its attention
reads the x tokens before it (``A = (4 d_h + 3) a`` for a heads of size d_h), while the
projections and the FFN cost the same for every token (``L = 8 H a d_h + 4 H F``, hidden H,
FFN width F). A chunk of s tokens ending at position P therefore costs

    s P A - s^2 A / 2 + s L

(REFERENCE section 3), so with equal lengths the later chunks cost more. ``"compute"`` cuts
the sequence so every chunk costs the same: chunk by chunk from the end, each chunk takes the
share of what is left, which makes later chunks shorter. Boundaries are whole tokens, every
chunk has at least one, the lengths never increase along the sequence and sum to
``seq_len``; rounding to whole tokens is the only source of cost differences.

Pure functions, no torch: the runtime slices ``x[:, b[j]:b[j + 1]]`` with the boundaries,
the simulator takes the chunk costs as ``Costs(seq_weights=chunk_weights(...))``.
"""

from __future__ import annotations

import math
from typing import Literal

__all__ = ["Mode", "MODES", "chunk_boundaries", "chunk_lengths", "chunk_costs", "chunk_weights", "chunk_cost"]

Mode = Literal["uniform", "compute"]
MODES: tuple[str, ...] = ("uniform", "compute")


def chunk_boundaries(
    seq_len: int,
    k: int,
    *,
    mode: Mode = "uniform",
    hidden: int | None = None,
    heads: int | None = None,
    head_dim: int | None = None,
    ffn: int | None = None,
) -> tuple[int, ...]:
    """The k+1 cut positions ``(0, b_1, ..., b_{k-1}, seq_len)``; chunk j is ``[b_j, b_{j+1})``.

    ``"uniform"``: lengths differ by at most one token, the longer ones first. ``"compute"``:
    equal cost per chunk (module doc); needs ``hidden`` and ``heads``, ``head_dim`` defaults
    to ``hidden // heads`` and ``ffn`` to ``4 * hidden``.
    """
    if k < 1:
        raise ValueError(f"seq_chunks must be >= 1, got {k}")
    if seq_len < k:
        raise ValueError(f"seq_len {seq_len} cannot be cut into {k} chunks of at least one token; lower seq_chunks or raise seq_len")
    if mode == "uniform":
        lengths = [seq_len // k + (1 if j < seq_len % k else 0) for j in range(k)]
    elif mode == "compute":
        attn, linear = _coefficients(hidden=hidden, heads=heads, head_dim=head_dim, ffn=ffn)
        lengths = _equal_cost_lengths(seq_len, k, attn, linear)
    else:
        raise ValueError(f"seq partition mode must be one of {', '.join(MODES)}, got {mode!r}")
    cuts = [0]
    for length in lengths:
        cuts.append(cuts[-1] + length)
    return tuple(cuts)


def chunk_lengths(boundaries: tuple[int, ...]) -> tuple[int, ...]:
    """Tokens per chunk, from the cut positions."""
    return tuple(b - a for a, b in zip(boundaries, boundaries[1:]))


def chunk_cost(
    tokens: int, end: int, *, hidden: int, heads: int, head_dim: int | None = None, ffn: int | None = None
) -> float:
    """Per-layer cost of a chunk of ``tokens`` tokens ending at position ``end`` (module doc)."""
    attn, linear = _coefficients(hidden=hidden, heads=heads, head_dim=head_dim, ffn=ffn)
    return tokens * end * attn - tokens * tokens * attn / 2 + tokens * linear


def chunk_costs(
    boundaries: tuple[int, ...], *, hidden: int, heads: int, head_dim: int | None = None, ffn: int | None = None
) -> tuple[float, ...]:
    """Per-layer cost of every chunk between the cut positions ``boundaries``."""
    return tuple(
        chunk_cost(b - a, b, hidden=hidden, heads=heads, head_dim=head_dim, ffn=ffn)
        for a, b in zip(boundaries, boundaries[1:])
    )


def chunk_weights(
    boundaries: tuple[int, ...], *, hidden: int, heads: int, head_dim: int | None = None, ffn: int | None = None
) -> tuple[float, ...]:
    """Each chunk's share of the sequence's cost (sums to 1), for ``Costs(seq_weights=...)``."""
    costs = chunk_costs(boundaries, hidden=hidden, heads=heads, head_dim=head_dim, ffn=ffn)
    total = sum(costs)
    return tuple(c / total for c in costs)


def _coefficients(
    *, hidden: int | None, heads: int | None, head_dim: int | None, ffn: int | None
) -> tuple[float, float]:
    """(A, L): the attention cost per token and position, and the position-free cost per token."""
    if hidden is None or heads is None:
        raise ValueError("the compute-wise partition needs the model's hidden size and number of heads; pass hidden= and heads=")
    if hidden < 1 or heads < 1:
        raise ValueError(f"hidden and heads must be >= 1, got hidden={hidden}, heads={heads}")
    d_h = hidden // heads if head_dim is None else head_dim
    width = 4 * hidden if ffn is None else ffn
    if d_h < 1 or width < 1:
        raise ValueError(f"head_dim and ffn must be >= 1, got head_dim={d_h}, ffn={width}; pass them explicitly")
    return float((4 * d_h + 3) * heads), float(8 * hidden * heads * d_h + 4 * hidden * width)


def _equal_cost_lengths(seq_len: int, k: int, attn: float, linear: float) -> list[int]:
    """Lengths from the end: each chunk takes 1/j of the cost left with j chunks to go.

    Clamped so that lengths never increase along the sequence and the chunks still to come
    keep at least one token each: a chunk is at least as long as the one after it and at
    most the average of what is left (the exact solution always lies in that range).
    """
    lengths: list[int] = []
    end, after = seq_len, 1
    for left in range(k, 1, -1):
        target = (attn * end * end / 2 + linear * end) / left
        length = round(_last_chunk(end, target, attn, linear))
        length = min(max(length, after), end // left)
        lengths.append(length)
        end, after = end - length, length
    lengths.append(end)
    return lengths[::-1]


def _last_chunk(end: int, target: float, attn: float, linear: float) -> float:
    """Tokens s of the chunk ending at ``end`` whose cost is ``target``: the smaller root of
    attn s^2 / 2 - (attn end + linear) s + target = 0."""
    slope = attn * end + linear
    if attn == 0:
        return target / slope
    return (slope - math.sqrt(max(slope * slope - 2 * attn * target, 0.0))) / attn
