"""Fixtures shared by unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

__all__ = ["gloo_world_of_one"]


@pytest.fixture()
def gloo_world_of_one() -> Iterator[None]:
    """A gloo process group of this one process: collectives run for real, with nobody to wait for."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
