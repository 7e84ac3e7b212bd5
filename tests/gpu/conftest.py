"""GPU tier: real NCCL between CUDA devices. Skips, never fails, where they are missing.

A test here asks for devices with ``@pytest.mark.gpu(gpus=N)`` (default 1; a module-level
``pytestmark = pytest.mark.gpu`` counts as 1). Without CUDA, with fewer devices than asked
for, or with a torch built without NCCL, the test is skipped with the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

__all__ = ["available_gpus", "pytest_collection_modifyitems"]

HERE = Path(__file__).resolve().parent


def available_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _needed(item: pytest.Item) -> int:
    marker = item.get_closest_marker("gpu")
    return int(marker.kwargs.get("gpus", 1)) if marker is not None else 1


def _skip_reason(needed: int, have: int) -> str | None:
    if have < needed:
        return f"needs {needed} CUDA device(s), found {have}"
    if not (dist.is_available() and dist.is_nccl_available()):
        return "torch is built without NCCL"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items: touch only the ones under tests/gpu.
    have = available_gpus()
    for item in items:
        if HERE not in Path(str(item.path)).resolve().parents:
            continue
        reason = _skip_reason(_needed(item), have)
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
