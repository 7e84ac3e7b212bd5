"""``benchmarks/report_host_engine.py``'s table of each rank's passes per model stage."""

from __future__ import annotations

from typing import Any

from benchmarks.host_engine import HandlerClock
from benchmarks.report_host_engine import _per_stage_table, per_stage


def _step(**passes: list[float]) -> dict[str, Any]:
    return {"handlers": {}, "stage_passes": {k.replace("_at_", "@"): v for k, v in passes.items()}}


def test_passes_per_stage_take_medians_per_call_and_total_each_stage() -> None:
    steps = [_step(ForwardPass_at_0=[8, 0.080], BackwardPass_at_0=[8, 0.160], ForwardPass_at_3=[8, 0.040]),
             _step(ForwardPass_at_0=[8, 0.096], BackwardPass_at_0=[8, 0.160], ForwardPass_at_3=[8, 0.048]),
             _step(ForwardPass_at_0=[8, 0.088], BackwardPass_at_0=[8, 0.176], ForwardPass_at_3=[0, 0.0])]
    got = per_stage(steps)
    assert got[0]["ForwardPass"] == (11_000.0, 8) and got[0]["FusedBackward"] == (20_000.0, 8)  # DeepSpeed's name mapped
    assert got[0]["all"][0] == 1e3 * 0.256  # the median step's sum, not a sum of medians
    assert got[3]["ForwardPass"] == (5_500.0, 8)  # a step without the pass does not count as a call
    assert per_stage([{"handlers": {}}]) == {}
    assert _per_stage_table({"v-zb": [[{"handlers": {}}]]}) == []  # records from before the per-stage figures
    assert any(r.startswith("| v-zb | 0 | 3 | 5,500 (8) |") for r in _per_stage_table({"v-zb": [steps]}))


def test_the_clock_counts_passes_by_the_stage_they_name() -> None:
    class Engine:
        stage_id = 1

    clock = HandlerClock()
    forward = clock._timed(lambda engine, **kw: None, "ForwardPass")
    send = clock._timed(lambda engine, **kw: None, "SendActivation")
    forward(Engine(), stage=3, micro_batch=0)
    forward(Engine(), buffer_id=0)  # DeepSpeed's instructions name no stage: the rank's own
    send(Engine(), stage=2)
    assert {k: v[0] for k, v in clock.stage_snapshot().items()} == {"ForwardPass@3": 1, "ForwardPass@1": 1}
