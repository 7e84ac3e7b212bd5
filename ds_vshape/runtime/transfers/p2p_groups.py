"""One process group per pair of neighbouring pipeline ranks: the transfers' communicators.

Under torch's NCCL backend every operation on a process group runs on that group's one
stream per rank, in issue order (eager init, which DeepSpeed uses on GPUs), and under lazy
init an unbatched transfer gets a pair communicator of its own while a batched one uses the
group's. If all transfers shared the world group, a receive posted from one neighbour would
hold back a send to the other neighbour, and header and payload could land on different
communicators. So each pair of pipeline ranks that exchanges anything gets a 2-rank group,
and ``comm.P2P`` issues every operation batched on its pair's group: whatever the init mode,
each pair has exactly one communicator and one stream, ordered as lowering ordered the
pair's transfers (``schedules.p2p_check`` checks that order under this model).

Groups are created for every pipeline (one per data- and tensor-parallel coordinate) in one
order on every rank, as ``torch.distributed.new_group`` requires.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["neighbour_pairs", "pair_groups"]


def neighbour_pairs(stage_to_rank: Sequence[int]) -> list[tuple[int, int]]:
    """Unordered pairs of pipeline ranks holding consecutive stages (the looped wrap-around too)."""
    pairs = {tuple(sorted((a, b))) for a, b in zip(stage_to_rank, stage_to_rank[1:]) if a != b}
    return sorted(pairs)  # type: ignore[arg-type]


def pair_groups(pipelines: Sequence[Sequence[int]], pairs: Sequence[tuple[int, int]], my_global_rank: int
                ) -> dict[int, Any]:
    """This rank's pair groups, by the peer's pipeline rank.

    ``pipelines``: the global ranks of each pipeline, indexed by pipeline rank (DeepSpeed's
    ``topology.get_axis_comm_lists("pipe")``). Every rank must call this with the same
    arguments: each ``new_group`` call is made on all ranks, in this one order.
    """
    mine: dict[int, Any] = {}
    for ranks in pipelines:
        for a, b in pairs:
            group = dist.new_group(ranks=[ranks[a], ranks[b]])
            if my_global_rank == ranks[a]:
                mine[b] = group
            elif my_global_rank == ranks[b]:
                mine[a] = group
    return mine
