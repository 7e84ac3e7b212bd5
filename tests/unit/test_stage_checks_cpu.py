"""The GPU tier's one-rank stage checks (tests/gpu/stage_checks.py) run on the CPU, small:
their logic is proven here, where no GPU is; tests/gpu/test_stage_one_gpu.py runs them on CUDA.

Where the GPU test reads CUDA's allocator counters, this one reads torch's ``MemTracker``
(it follows every tensor's storage on any device); where the GPU test times the device with
events, the CPU has none to time apart from the host, so only the sync-free issue is checked.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from typing import Any

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from tests.gpu.stage_checks import (
    BF16_ULP,
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

CPU = torch.device("cpu")
TINY = LlamaShape(hidden=32, layers=4, heads=4, kv_heads=2, intermediate=64, vocab=128, batch=2, seq=16)


class TrackedMemory:
    """The CPU's stand-in for CUDA's counters: MemTracker's live and peak bytes around a window.

    MemTracker counts a module's parameters and buffers when it first meets them (at its
    forward): the model's are registered beforehand, as CUDA's counters hold them from the start.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.tracker = MemTracker()
        self.tracker.track_external(model)
        self.before = self.after = self.peak = 0

    def _total(self, kind: str) -> int:
        return int(self.tracker.get_tracker_snapshot(kind).get(CPU, {}).get("Total", 0))

    def __enter__(self) -> TrackedMemory:
        self.tracker.__enter__()
        self.before = self._total("current")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.after, self.peak = self._total("current"), self._total("peak")
        self.tracker.__exit__(*exc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_backward_matches_fused(dtype: torch.dtype) -> None:
    split, fused = split_vs_fused(TINY, CPU, dtype)
    assert split.deferred_after_b == {n for n, g in fused.params.items() if g.dim() > 1}
    assert split.params.keys() == fused.params.keys() and len(fused.params) == 4 * 9 + 3
    for name, grad in fused.params.items():
        if dtype is torch.float32:
            torch.testing.assert_close(split.params[name], grad, rtol=0, atol=1e-5, msg=name)
        else:
            assert_bf16_close(split.params[name], grad, name)
    for got, want in zip(split.boundary, fused.boundary):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 if dtype is torch.float32 else 0)


def test_bf16_rule_rejects_a_gradient_off_by_a_few_ulps() -> None:
    want = torch.linspace(-1, 1, 64, dtype=torch.bfloat16)
    assert_bf16_close(want + BF16_ULP, want, "one ulp of the largest entry: within")
    with pytest.raises(AssertionError, match="split differs from fused"):
        assert_bf16_close(want + 4 * BF16_ULP, want, "four ulps: outside")


@pytest.mark.parametrize("split", [False, True], ids=["fused-schedule", "split-schedule"])
def test_activation_meter_within_allocations(split: bool) -> None:
    model = llama(TINY, CPU, torch.float32)
    reading = meter_reading(model, batch(TINY, CPU, seed=0), TrackedMemory(model), split=split)
    assert 0 < reading.meter_bytes <= reading.held_bytes <= reading.peak_bytes, reading
    assert reading.meter_bytes >= 0.9 * reading.held_bytes, reading


def test_last_stage_passes_make_no_host_sync() -> None:
    model = llama(TINY, CPU, torch.float32)
    last = last_stage(model, [batch(TINY, CPU, seed=mb) for mb in range(2)])
    syncs = HostSyncs()
    with syncs:
        stage_passes(last)
    assert not syncs.calls, syncs.calls
    assert all(p.grad is not None for p in last.stage.parameters())


def test_issue_and_time_measures_a_step() -> None:
    # The CPU runs a pass before the call returns: host and "device" spans are one span here.
    model = llama(TINY, CPU, torch.float32)
    timing = issue_and_time(last_stage(model, [batch(TINY, CPU, seed=mb) for mb in range(2)]))
    assert 0 < timing.host_s <= timing.device_s
