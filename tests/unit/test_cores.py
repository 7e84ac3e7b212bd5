"""The recipe's "measured on" line counts the cores each rank really has (issue 28 point 6).

A rank keeps its compute threads busy, capped by its CPU affinity; the ranks of one machine
share the union of their affinities. Pure tests of ``recipes/cores.py`` and of
``compare_runs.setting_line`` on summaries as ``train_hf.py`` writes them.
"""

from __future__ import annotations

from typing import Any

import pytest

from recipes.compare_runs import Run, setting_line
from recipes.cores import RankCpu, cpu_share, describe, this_rank


def _ranks(n: int, threads: int, cpus_each: list[tuple[int, ...]] | tuple[int, ...], host: str = "a") -> list[RankCpu]:
    per = cpus_each if isinstance(cpus_each, list) else [cpus_each] * n
    return [RankCpu(host, threads, cpus) for cpus in per]


def _line(ranks: list[RankCpu], world: int) -> str:
    share = cpu_share(ranks)
    setting = {"model": "llama", "size": "tiny", "device": "cpu", "world": world, "micro_batches": 8,
               "cores": share.cores, "cpu_demand": share.demand, "rank_cores": list(share.rank_cores)}
    return setting_line([_run(setting)])


def _run(setting: dict[str, Any]) -> Run:
    return Run("x", 1, 1.0, 1.0, 1.0, None, None, (), setting)


def test_four_ranks_of_four_threads_on_sixteen_cores_have_four_cores_each() -> None:
    line = _line(_ranks(4, 4, tuple(range(16))), 4)
    assert "with 16 cores: 4 cores per rank" in line and "one core" not in line and "share" not in line


def test_two_single_thread_ranks_on_two_cores_have_one_core_each() -> None:
    line = _line(_ranks(2, 1, (0, 1)), 2)
    assert "with 2 cores: one core per rank, so a rank's idle time (the bubble) is in the step time" in line


def test_more_threads_than_cores_share_them() -> None:
    assert "ranks share cores (32 threads of compute on 16 cores)" in _line(_ranks(4, 8, tuple(range(16))), 4)
    assert "ranks share cores (4 threads of compute on 2 cores)" in _line(_ranks(4, 1, (0, 1)), 4)


def test_affinity_caps_a_ranks_threads_and_pinned_ranks_count_their_own_cores() -> None:
    # 8 threads each, but each rank pinned to 2 cores of its own: 2 busy cores per rank, 8 in all.
    pinned = _ranks(4, 8, [(0, 1), (2, 3), (4, 5), (6, 7)])
    share = cpu_share(pinned)
    assert (share.cores, share.demand, share.rank_cores) == (8, 8, (2, 2, 2, 2))
    assert "2 cores per rank" in _line(pinned, 4)


def test_the_most_loaded_machine_decides() -> None:
    # Machine a: 2 ranks of 1 thread on 8 cores; machine b: 2 ranks of 4 threads on 4 cores.
    ranks = _ranks(2, 1, tuple(range(8)), host="a") + _ranks(2, 4, tuple(range(4)), host="b")
    share = cpu_share(ranks)
    assert (share.cores, share.demand) == (4, 8)
    assert describe(share.cores, share.demand, share.rank_cores).startswith(" with 4 cores: ranks share cores")
    assert "1 to 4 cores" in describe(16, 10, share.rank_cores)


def test_old_summaries_without_threads_read_as_one_thread_per_rank() -> None:
    old = {"model": "llama", "size": "tiny", "device": "cpu", "world": 2, "micro_batches": 8, "cores": 2}
    assert "one core per rank" in setting_line([_run(old)])
    assert "ranks share cores" in setting_line([_run({**old, "world": 4})])


def test_this_rank_reads_torch_threads_and_affinity() -> None:
    torch = pytest.importorskip("torch")
    me = this_rank()
    assert me.threads == torch.get_num_threads() and me.cpus and 1 <= me.busy_cores <= len(me.cpus)
