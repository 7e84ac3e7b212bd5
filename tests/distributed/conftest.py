"""Distributed tier: DeepSpeed's CPU communication op is built once, before the first launch."""

from __future__ import annotations

import pytest

from .deepspeed_ops import build_shm_op, extensions_dir

__all__ = ["deepspeed_shm_op"]

# At import, so that every launch (and the fault driver, the recipe) passes the folder on.
extensions_dir()


@pytest.fixture(scope="session", autouse=True)
def deepspeed_shm_op() -> None:
    """The op every rank's ``init_distributed`` loads, built here rather than inside a launch's timeout."""
    build_shm_op()
