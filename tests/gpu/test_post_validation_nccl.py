"""Post-validation on real NCCL with CUDA tensors (2 GPUs): the fp32 parity cases of
tests/distributed/test_post_validation.py, waiting and speculating, and the overlap check
(rank 0 starts step k+1 while the last rank holds its share of step k's check)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.launch import by_case, launch
from tests.distributed.test_post_validation import _check_fp32, _fp32, _ok, _overlap, _spec

pytestmark = pytest.mark.gpu(gpus=2)

SCHEDULES = ["zb-h2", "v-zb"]


@pytest.fixture(scope="module")
def nccl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    cases = [_fp32(s, 2) for s in SCHEDULES] + [_spec(_fp32(s, 2)) for s in SCHEDULES]
    cases.append(_spec(_overlap("overlap-stats", 2, on=True, clip=100.0, timeout_s=60, hold_at="stats")))
    return by_case(launch(cases, 2, tmp_path_factory.mktemp("pv_nccl"), backend="nccl", timeout=1800))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_post_validation_parity_on_nccl(nccl: dict, schedule: str) -> None:
    _check_fp32(nccl[f"fp32-{schedule}-p2"])
    _check_fp32(nccl[f"fp32-{schedule}-p2-spec"], speculated=True)


def test_speculated_step_overlaps_on_nccl(nccl: dict) -> None:
    assert _ok(nccl["overlap-stats-spec"])[-1]["waits"] == ["released", "released"]
