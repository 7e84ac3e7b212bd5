"""How many CPU cores each rank of a recipe run really had, for the "measured on" line.

A rank keeps as many cores busy as it has compute threads (``torch.get_num_threads()``), at
most as many as its CPU affinity allows. The ranks on one machine share that machine's cores
(the union of their affinities): when their threads together fit, each rank has cores of its
own and its idle time (the bubble) shows in the step time; when they do not, a waiting rank's
cores go to another rank and the step time hides the bubble.

``train_hf.py`` gathers one ``RankCpu`` per rank and stores ``cpu_share`` of them in the run's
summary; ``compare_runs.py`` words it with ``describe``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["CpuShare", "RankCpu", "cpu_share", "describe", "this_rank"]


@dataclass(frozen=True)
class RankCpu:
    """One rank's view: its machine, its compute threads and the CPUs it may run on."""

    host: str
    threads: int
    cpus: tuple[int, ...]

    @property
    def busy_cores(self) -> int:
        """Cores this rank can keep busy: its threads, capped by its affinity."""
        return max(1, min(self.threads, len(self.cpus)))


@dataclass(frozen=True)
class CpuShare:
    """The most loaded machine of a run: its usable cores and the ranks' threads on it."""

    cores: int  # CPUs the ranks on that machine may use (the union of their affinities)
    demand: int  # cores its ranks can keep busy together
    rank_cores: tuple[int, ...]  # per rank (every machine), cores it can keep busy


def this_rank() -> RankCpu:
    """This process: torch's intra-op threads and its CPU affinity (all CPUs where the OS has none)."""
    import torch  # here: compare_runs.py words summaries without loading torch

    if hasattr(os, "sched_getaffinity"):
        cpus = tuple(sorted(os.sched_getaffinity(0)))
    else:  # macOS, Windows: no affinity, every CPU
        cpus = tuple(range(os.cpu_count() or 1))
    return RankCpu(host=socket.gethostname(), threads=torch.get_num_threads(), cpus=cpus)


def cpu_share(ranks: Sequence[RankCpu]) -> CpuShare:
    """The machine whose ranks ask the most of its cores (demand over cores), from every rank's view."""
    hosts: dict[str, list[RankCpu]] = {}
    for rank in ranks:
        hosts.setdefault(rank.host, []).append(rank)
    loads = []  # (demand over cores, cores, demand) per machine
    for members in hosts.values():
        cores, demand = len({cpu for r in members for cpu in r.cpus}), sum(r.busy_cores for r in members)
        loads.append((demand / max(cores, 1), cores, demand))
    _, cores, demand = max(loads)
    return CpuShare(cores=cores, demand=demand, rank_cores=tuple(r.busy_cores for r in ranks))


def describe(cores: int, demand: int, rank_cores: Sequence[int]) -> str:
    """``with C cores: ...`` for the "measured on" line of a CPU run."""
    line = f" with {cores} cores"
    per = set(rank_cores)
    each = ("one core" if per == {1} else f"{per.pop()} cores") if len(per) == 1 else f"{min(per)} to {max(per)} cores"
    if 0 < demand <= cores:
        return f"{line}: {each} per rank, so a rank's idle time (the bubble) is in the step time"
    return (f"{line}: ranks share cores ({demand} threads of compute on {cores} cores), so a rank's idle time is spent "
            "by another and the step time does not show the bubble; compare the simulated bubble")
