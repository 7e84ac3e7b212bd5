"""Every runtime schedule on real NCCL with CUDA tensors, against the plain reference.

The ranks run tests/distributed/worker.py's parity cases with ``launch(..., backend="nccl")``
(DS_VSHAPE_TEST_BACKEND=nccl: rank r on cuda:r, reference model and data there too), once at
p=2 (2 GPUs) and, with 4 GPUs, once at p=4. Stock DeepSpeed 1F1B rides along as the control.
Each rank also records CUDA's peak allocation over the training steps: the runtime's own
activation meter must report a positive peak no larger than that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.launch import by_case, launch
from tests.distributed.test_engine import _assert_parity, _parity_cases

pytestmark = pytest.mark.gpu

FOUR = pytest.mark.gpu(gpus=4)


def _control(p: int) -> dict[str, Any]:
    # Stock DeepSpeed clips per stage, not globally: clipping off keeps the reference exact.
    return {"name": f"stock-1f1b-p{p}-m4", "schedule": None, "p": p, "m": 4, "clip": 0.0}


def _run(p: int, tmp: Path) -> dict[str, list[dict[str, Any]]]:
    # Memory is measured only when asked: the meter check needs it on every step.
    cases = [dict(c, pipeline={"measure_memory": True}) for c in _parity_cases(p)]
    return by_case(launch(cases + [_control(p)], p, tmp, backend="nccl", timeout=1800))


@pytest.fixture(scope="module")
def nccl_p2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return _run(2, tmp_path_factory.mktemp("nccl_p2"))


@pytest.fixture(scope="module")
def nccl_p4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return _run(4, tmp_path_factory.mktemp("nccl_p4"))


def _names(p: int) -> list[str]:
    return [c["name"] for c in _parity_cases(p)]


def _assert_meter_within_cuda_peak(name: str, ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(ranks):
        assert "error" not in res, f"{name} rank {rank}: {res['error']}\n{res.get('traceback', '')}"
        meter, cuda = res["peak_activation_bytes"], res["device_max_allocated_bytes"]
        assert cuda is not None, f"{name} rank {rank}: the worker did not run on CUDA"
        assert meter is not None and 0 < meter <= cuda, f"{name} rank {rank}: meter {meter} B, CUDA peak {cuda} B"


@pytest.mark.gpu(gpus=2)
@pytest.mark.parametrize("case", _names(2) + [_control(2)["name"]])
def test_parity_nccl_p2(nccl_p2: dict, case: str) -> None:
    _assert_parity(case, nccl_p2[case])


@FOUR
@pytest.mark.parametrize("case", _names(4) + [_control(4)["name"]])
def test_parity_nccl_p4(nccl_p4: dict, case: str) -> None:
    _assert_parity(case, nccl_p4[case])


@pytest.mark.gpu(gpus=2)
@pytest.mark.parametrize("case", _names(2))
def test_activation_meter_within_cuda_peak_p2(nccl_p2: dict, case: str) -> None:
    _assert_meter_within_cuda_peak(case, nccl_p2[case])


@FOUR
@pytest.mark.parametrize("case", _names(4))
def test_activation_meter_within_cuda_peak_p4(nccl_p4: dict, case: str) -> None:
    _assert_meter_within_cuda_peak(case, nccl_p4[case])
