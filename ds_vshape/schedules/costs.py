"""Pass costs for the simulator and the generators: pass times, and what split backward keeps."""

from __future__ import annotations

from dataclasses import dataclass

from .ir import Action, Kind

__all__ = ["Costs"]


@dataclass(frozen=True)
class Costs:
    """Time of each pass for a 1/p slice of the model, and the latency of one hop.

    A rank holding v chunks runs each chunk in 1/v of these times. ``seq_weights`` gives the
    relative cost of each sequence chunk (normalised to sum 1); equal shares when None.
    ``stage_scale`` optionally scales every pass of one model stage (uneven partitions).

    ``w_memory`` is the share of a unit's activation that B keeps until its W runs: the
    weight GEMMs of W need the inputs and output gradients of the linear layers, so a real
    split backward frees only the rest at B (``benchmarks/kept_share.py`` measures a model's). The
    split-backward generators keep their memory bound counting that share as live until W,
    and ``simulate`` counts it by default; 0 frees everything at B, 1 keeps it all until W.

    ``copy`` is the time to move one M_B between device and host memory, one way (M_B bytes
    over the host link's bandwidth): what activation offload costs (``simulate(offload=...)``).
    """

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    comm: float = 0.0
    seq_weights: tuple[float, ...] | None = None
    stage_scale: tuple[float, ...] | None = None
    w_memory: float = 0.0
    copy: float = 0.0

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "comm", "copy"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost {name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.w_memory <= 1.0:  # also rejects NaN
            raise ValueError(f"w_memory is a share of the activation and must be in [0, 1], got {self.w_memory}")

    def seq_share(self, seq_chunk: int, seq_chunks: int) -> float:
        """Fraction of a micro-batch's cost (and activation memory) carried by one seq chunk."""
        if self.seq_weights is None:
            return 1.0 / seq_chunks
        if len(self.seq_weights) != seq_chunks:
            raise ValueError(f"seq_weights has {len(self.seq_weights)} entries, the schedule has {seq_chunks} seq chunks")
        return self.seq_weights[seq_chunk] / sum(self.seq_weights)

    def duration(self, action: Action, *, chunks_per_rank: int, seq_chunks: int) -> float:
        base = {Kind.F: self.f, Kind.B: self.b, Kind.W: self.w, Kind.BW: self.b + self.w}[action.kind]
        scale = self.stage_scale[action.stage] if self.stage_scale is not None else 1.0
        return base * scale * self.seq_share(action.seq_chunk, seq_chunks) / chunks_per_rank
