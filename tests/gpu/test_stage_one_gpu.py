"""One rank's stage on one CUDA device: split backward exact, the activation meter within CUDA's
own allocation counters, and the host issuing the stage's passes ahead of the device.

The bodies are tests/gpu/stage_checks.py's, which tests/unit/test_stage_checks_cpu.py also runs
on the CPU with small shapes. Here the shapes are a GPU's: the exactness checks take a small
Llama (fast, and large enough for real GEMM kernels), the meter and timing checks Llama-3-8B-
sized decoder blocks. Measured figures go to ``record_property`` (shown with ``-rA``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.gpu.stage_checks import (
    CudaMemory,
    HostSyncs,
    LlamaShape,
    assert_bf16_close,
    batch,
    issue_and_time,
    last_stage,
    llama,
    meter_reading,
    split_vs_fused,
    stage_passes,
)

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda", 0)
SMALL = LlamaShape(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1408, vocab=2048, batch=2, seq=256)
MEDIUM = LlamaShape(hidden=1024, layers=4, heads=16, kv_heads=4, intermediate=2816, vocab=8192, batch=2, seq=1024)
# Llama-3-8B's block sizes: stage 1 holds 2 blocks, the final norm and a 32k-vocabulary head.
HEAVY = LlamaShape(hidden=4096, layers=4, heads=32, kv_heads=8, intermediate=14336, vocab=32000, batch=4, seq=4096)
FP32_TOL = 1e-5
# The meter sees every tensor autograd saves; the CUDA allocator adds rounding (512-byte blocks)
# and nothing else once warmed up. Below this share of what the forward left allocated, some
# holder escapes the meter (a custom Function keeping tensors on ctx instead of saving them).
METER_SHARE = 0.9
# "Much less": the host must be done issuing a step's passes within a third of the device's time
# for it, so that it is free for transfers and the next passes while the device still computes.
HOST_SHARE = 1 / 3


@pytest.fixture(autouse=True)
def exact_fp32() -> Iterator[None]:
    """fp32 GEMMs in full precision (TF32 off), whatever the session set before."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    torch.cuda.empty_cache()


def test_split_backward_fp32_equals_fused_on_cuda() -> None:
    split, fused = split_vs_fused(SMALL, CUDA, torch.float32)
    weights = {n for n, g in fused.params.items() if g.dim() > 1}
    assert split.deferred_after_b == weights  # every matrix waited for W; norm scales came in B
    assert split.params.keys() == fused.params.keys()
    for name, grad in fused.params.items():
        torch.testing.assert_close(split.params[name], grad, rtol=0, atol=FP32_TOL, msg=name)
    for mb, (got, want) in enumerate(zip(split.boundary, fused.boundary)):
        torch.testing.assert_close(got, want, rtol=0, atol=FP32_TOL, msg=f"stage 1 input gradient, micro-batch {mb}")


def test_split_backward_bf16_within_bf16_rounding_of_fused_on_cuda(record_property: pytest.RecordProperty) -> None:
    split, fused = split_vs_fused(SMALL, CUDA, torch.bfloat16)
    assert split.params.keys() == fused.params.keys()
    assert split.deferred_after_b == {n for n, g in fused.params.items() if g.dim() > 1}
    for name, grad in fused.params.items():
        assert_bf16_close(split.params[name], grad, name)
    for mb, (got, want) in enumerate(zip(split.boundary, fused.boundary)):
        assert_bf16_close(got, want, f"stage 1 input gradient, micro-batch {mb}")
    same = sum(torch.equal(split.params[n], g) for n, g in fused.params.items())
    record_property("bitwise_equal_grads", f"{same}/{len(fused.params)}")


@pytest.mark.parametrize("split", [False, True], ids=["fused-schedule", "split-schedule"])
def test_activation_meter_within_cuda_allocations(split: bool, record_property: pytest.RecordProperty) -> None:
    model = llama(MEDIUM, CUDA, torch.bfloat16)
    reading = meter_reading(model, batch(MEDIUM, CUDA, seed=0), CudaMemory(CUDA), split=split)
    record_property("bytes", reading)
    assert 0 < reading.meter_bytes <= reading.held_bytes <= reading.peak_bytes, reading
    assert reading.meter_bytes >= METER_SHARE * reading.held_bytes, reading


def test_stage_passes_never_wait_for_the_device() -> None:
    model = llama(SMALL, CUDA, torch.bfloat16)
    last = last_stage(model, [batch(SMALL, CUDA, seed=mb) for mb in range(2)])
    stage_passes(last)  # warm-up: first-use allocations may synchronize
    torch.cuda.synchronize()
    syncs = HostSyncs()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with syncs:
            stage_passes(last)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not syncs.calls, syncs.calls


def test_host_issues_the_stage_passes_ahead_of_the_device(record_property: pytest.RecordProperty) -> None:
    # Two micro-batches keep the step under about a thousand kernels: CUDA's launch queue holds
    # about that many, and a fuller one would stall the host on the queue, not on the passes.
    model = llama(HEAVY, CUDA, torch.bfloat16)
    last = last_stage(model, [batch(HEAVY, CUDA, seed=mb) for mb in range(2)])
    timing = issue_and_time(last)
    record_property("seconds", {"host_issue": timing.host_s, "device": timing.device_s,
                                "share": timing.host_s / timing.device_s})
    assert timing.host_s < HOST_SHARE * timing.device_s, timing
