"""bounded_step: a step's collectives get the transfer timeout for the step only, and failures are named.

The real kills are tests/distributed/test_faults.py; here one process with a gloo world of one
checks the naming rules and that the groups' own timeouts come back after the step.
"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ds_vshape.runtime.step_end.failures import StepCollectiveError, bounded_step
from ds_vshape.runtime.transfers.p2p_waits import P2PError, P2PTimeoutError


def _engine(group: Any) -> Any:
    grid = SimpleNamespace(get_pipe_parallel_group=lambda: group, get_data_parallel_group=lambda: group,
                           get_model_parallel_group=lambda: group, get_slice_parallel_world_size=lambda: 1)
    module = SimpleNamespace(get_tied_weights_and_groups=lambda: [])
    return SimpleNamespace(grid=grid, module=module, stage_id=1, global_rank=3, global_steps=4, is_last_stage=lambda: True,
                           _p2p=SimpleNamespace(timeout_s=4.0))


def _timeout(group: Any) -> timedelta:
    return group._get_backend(c10d._get_default_group()._device_types[0]).options._timeout


def clip_fp32_gradients(message: str) -> None:  # named as the engine's method: the site is read off the traceback
    raise RuntimeError(message)


def test_the_step_bounds_its_groups_and_restores_their_timeouts(gloo_world_of_one: None) -> None:
    group = dist.new_group([0])
    before = _timeout(group)
    with bounded_step(_engine(group), "train"):
        assert _timeout(group) == timedelta(seconds=4) and _timeout(c10d._get_default_group()) == timedelta(seconds=4)
    assert _timeout(group) == before and before != timedelta(seconds=4)


def test_a_transfer_error_gains_the_global_rank_and_the_step(gloo_world_of_one: None) -> None:
    engine = _engine(dist.new_group([0]))
    with pytest.raises(P2PTimeoutError) as info, bounded_step(engine, "train"):
        raise P2PTimeoutError("pipeline rank 1: receive of gradients for stage 1 micro-batch 2 chunk 0 from pipeline rank 2 "
                              "did not complete within 4 s")
    assert str(info.value).startswith("pipeline rank 1 (global rank 3), train step 5: receive of gradients for stage 1")
    with pytest.raises(P2PError, match=r"^pipeline rank 1 \(global rank 3\), eval batch after train step 4: "), \
            bounded_step(engine, "eval"):
        raise P2PError("pipeline rank 1: send of activations failed")


@pytest.mark.parametrize(("message", "verb"), [("Timed out waiting 4000ms for recv", "did not complete within 4 s"),
                                               ("Connection closed by peer", "failed")])
def test_a_collective_that_fails_is_named_with_its_group(gloo_world_of_one: None, message: str, verb: str) -> None:
    engine = _engine(dist.new_group([0]))
    with pytest.raises(StepCollectiveError) as info, bounded_step(engine, "train"):
        clip_fp32_gradients(message)
    text = str(info.value)
    for needle in ("pipeline rank 1 (global rank 3), train step 5: the all-reduce of the global gradient norm over global "
                   f"ranks [0] {verb}", message, "restart the job from its last checkpoint", "pipeline.p2p_timeout_s"):
        assert needle in text, text


def test_other_errors_pass_unchanged(gloo_world_of_one: None) -> None:
    with pytest.raises(RuntimeError, match="^a forward failed$"), bounded_step(_engine(dist.new_group([0])), "train"):
        raise RuntimeError("a forward failed")  # not inside a collective of the step


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)")])
def test_an_error_at_a_collectives_site_that_is_not_about_a_peer_passes_unchanged(gloo_world_of_one: None,
                                                                                  error: RuntimeError) -> None:
    # Raised where the global norm is all-reduced, but out of memory or a shape error: no peer died.
    def clip_fp32_gradients() -> None:
        raise error

    with pytest.raises(type(error)) as info, bounded_step(_engine(dist.new_group([0])), "train"):
        clip_fp32_gradients()
    assert info.value is error
