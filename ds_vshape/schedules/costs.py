"""Pass costs for the simulator and for the cost-aware generators (zb-auto, v-adaptive)."""

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
    """

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    comm: float = 0.0
    seq_weights: tuple[float, ...] | None = None
    stage_scale: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "comm"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost {name} must be >= 0, got {getattr(self, name)}")

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
