"""The schedule IR: actions, per-rank orders and the schedule that holds them.

Pure data. Nothing here imports torch.distributed or deepspeed, so a schedule can be
generated, validated, simulated and printed anywhere.

Text form of an action: ``<stage><kind><micro_batch>[.<seq_chunk>]``, e.g. ``1F3``,
``0B2``, ``0W2``, ``3BW0``, ``2F1.3`` (stage 2, forward, micro-batch 1, sequence chunk 3).
Stage comes first, as in torch.distributed.pipelining, so a rank's line reads like the
order in which its stages are visited.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["BACKWARD_KINDS", "Kind", "Action", "Schedule", "Unit", "parse_action", "F", "B", "W", "BW"]

# One piece of work a pass runs on: (model stage, micro-batch, sequence chunk).
Unit = tuple[int, int, int]


class Kind(str, Enum):
    """What a pass computes."""

    F = "F"  # forward
    B = "B"  # gradient w.r.t. the stage input only (critical path)
    W = "W"  # gradient w.r.t. the stage parameters (can be delayed into bubbles)
    BW = "BW"  # fused backward, as 1F1B runs it

    def __str__(self) -> str:
        return self.value

    @property
    def is_backward(self) -> bool:
        """True for the passes that consume the gradient of the stage output."""
        return self in BACKWARD_KINDS  # a set made once: the lowering and the checks ask this per action


BACKWARD_KINDS = frozenset([Kind.B, Kind.BW])


_ACTION_RE = re.compile(r"^(\d+)(BW|F|B|W)(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True, slots=True)
class Action:
    """One pass of one stage on one micro-batch (and one sequence chunk)."""

    kind: Kind
    stage: int
    micro_batch: int
    seq_chunk: int = 0

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{self.micro_batch}"
        return f"{text}.{self.seq_chunk}" if self.seq_chunk else text

    def __repr__(self) -> str:
        return f"Action({self})"

    @property
    def unit(self) -> tuple[int, int, int]:
        """The (stage, micro_batch, seq_chunk) this action works on."""
        return (self.stage, self.micro_batch, self.seq_chunk)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "stage": self.stage,
            "micro_batch": self.micro_batch,
            "seq_chunk": self.seq_chunk,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Action:
        return cls(Kind(data["kind"]), int(data["stage"]), int(data["micro_batch"]), int(data.get("seq_chunk", 0)))


def parse_action(text: str) -> Action:
    """Parse the compact form (``1F3``, ``0BW2``, ``2F1.3``) back into an Action."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(f"cannot parse action {text!r}: expected <stage><F|B|W|BW><micro_batch>[.<seq_chunk>], e.g. '1F3'")
    stage, kind, micro_batch, chunk = match.groups()
    return Action(Kind(kind), int(stage), int(micro_batch), int(chunk or 0))


def F(stage: int, micro_batch: int, seq_chunk: int = 0) -> Action:  # noqa: N802 - reads like the notation
    return Action(Kind.F, stage, micro_batch, seq_chunk)


def B(stage: int, micro_batch: int, seq_chunk: int = 0) -> Action:  # noqa: N802
    return Action(Kind.B, stage, micro_batch, seq_chunk)


def W(stage: int, micro_batch: int, seq_chunk: int = 0) -> Action:  # noqa: N802
    return Action(Kind.W, stage, micro_batch, seq_chunk)


def BW(stage: int, micro_batch: int, seq_chunk: int = 0) -> Action:  # noqa: N802
    return Action(Kind.BW, stage, micro_batch, seq_chunk)


@dataclass(frozen=True)
class Schedule:
    """Per rank, the ordered actions of one training step, plus placement and parameters.

    ``stages`` is the number of pipeline ranks p (the name matches the CLI and DeepSpeed's
    ``num_stages``); the model is cut into ``p * chunks_per_rank`` model stages.
    """

    name: str
    stages: int
    micro_batches: int
    chunks_per_rank: int
    seq_chunks: int
    stage_to_rank: tuple[int, ...]
    ranks: tuple[tuple[Action, ...], ...]
    params: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.stage_to_rank) != self.num_model_stages:
            raise ValueError(
                f"stage_to_rank has {len(self.stage_to_rank)} entries, expected stages*chunks_per_rank = {self.num_model_stages}"
            )
        if len(self.ranks) != self.stages:
            raise ValueError(f"schedule has {len(self.ranks)} rank lists, expected {self.stages}")

    def __hash__(self) -> int:
        # The lowering's caches look a schedule up once per rank and pass: hashing every action each
        # time cost more than some passes. Computed once; left out of pickles and copies (``__getstate__``),
        # since a string's hash differs between processes.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.name, self.stages, self.micro_batches, self.chunks_per_rank, self.seq_chunks,
                           self.stage_to_rank, self.ranks))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_hash", None)
        return state

    @property
    def num_model_stages(self) -> int:
        return self.stages * self.chunks_per_rank

    def stages_of_rank(self, rank: int) -> list[int]:
        """The model stages a rank holds, in forward order."""
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    @property
    def w_memory(self) -> float | None:
        """The share of a unit's activation the schedule counts as kept from B until W (its
        generator's ``w_memory``); None for a schedule that counts none (no memory bound on W)."""
        share = self.params.get("w_memory")
        return None if share is None else float(share)

    @property
    def uses_split_backward(self) -> bool:
        return any(a.kind is Kind.W for actions in self.ranks for a in actions)

    def actions(self) -> Iterable[tuple[int, int, Action]]:
        """Every (rank, position, action)."""
        for rank, actions in enumerate(self.ranks):
            for pos, action in enumerate(actions):
                yield rank, pos, action

    # ---- text and JSON -------------------------------------------------------------------
    def grid(self, *, width: int = 6, mark: tuple[int, int] | None = None) -> str:
        """One line per rank, actions in order; ``mark=(rank, pos)`` brackets one cell."""
        lines = []
        for rank, actions in enumerate(self.ranks):
            cells = []
            for pos, action in enumerate(actions):
                text = str(action)
                if mark == (rank, pos):
                    text = f"[{text}]"
                cells.append(text.ljust(max(width, len(text) + 1)))
            lines.append(f"rank {rank}: " + "".join(cells).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        head = (
            f"{self.name}: p={self.stages} m={self.micro_batches} v={self.chunks_per_rank} k={self.seq_chunks} "
            f"stage_to_rank={list(self.stage_to_rank)}"
        )
        return head + "\n" + self.grid()

    def to_dict(self) -> dict[str, Any]:
        """The stable export contract read by other tools (see the README)."""
        return {
            "schedule": self.name,
            "stages": self.stages,
            "micro_batches": self.micro_batches,
            "chunks_per_rank": self.chunks_per_rank,
            "seq_chunks": self.seq_chunks,
            "stage_to_rank": list(self.stage_to_rank),
            "ranks": [[a.to_dict() for a in actions] for actions in self.ranks],
        }

    def to_json(self, *, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        return cls(
            name=data["schedule"],
            stages=int(data["stages"]),
            micro_batches=int(data["micro_batches"]),
            chunks_per_rank=int(data["chunks_per_rank"]),
            seq_chunks=int(data["seq_chunks"]),
            stage_to_rank=tuple(int(r) for r in data["stage_to_rank"]),
            ranks=tuple(tuple(Action.from_dict(a) for a in actions) for actions in data["ranks"]),
        )

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_text(
        cls,
        lines: Sequence[str],
        *,
        name: str,
        micro_batches: int,
        stage_to_rank: Sequence[int],
        seq_chunks: int = 1,
    ) -> Schedule:
        """Build from one whitespace-separated line of compact actions per rank (handy in tests)."""
        ranks = tuple(tuple(parse_action(tok) for tok in line.split()) for line in lines)
        p = len(ranks)
        return cls(
            name=name,
            stages=p,
            micro_batches=micro_batches,
            chunks_per_rank=len(stage_to_rank) // p,
            seq_chunks=seq_chunks,
            stage_to_rank=tuple(stage_to_rank),
            ranks=ranks,
        )
