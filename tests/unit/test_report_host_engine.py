"""``benchmarks/report_host_engine.py``'s table of each rank's passes per model stage."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from transformers import LlamaConfig

from benchmarks.host_engine import AUTO, GcClock, HandlerClock, _ran, config_of, stage_layers
from benchmarks.report_host_engine import _collector, _orders_run, _per_stage_table, per_stage
from ds_vshape.schedules import Costs, generate
from ds_vshape.hf import pipeline_layers


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
    assert any(r.startswith("| v-zb | 0 | 3 | ? | 5,500 (8) |") for r in _per_stage_table({"v-zb": [steps]}))  # no cut recorded
    table = _per_stage_table({"v-zb": [steps]}, layers={"v-zb": {"0": "embedding + 2 blocks", "3": "2 blocks"}})
    assert any(r.startswith("| v-zb | 0 | 3 | 2 blocks | 5,500 (8) |") for r in table)


def test_the_cut_is_named_by_the_layers_of_each_stage() -> None:
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2, vocab_size=32)
    specs, _ = pipeline_layers(config, attn_implementation="sdpa")  # embedding, 4 blocks, LM head (with the final norm)
    v_cut = SimpleNamespace(stage_parts=[0, 2, 4, 5, 6], _layer_specs=specs)  # ds_vshape's module: every model stage
    assert stage_layers(v_cut) == {"0": "embedding + block", "1": "2 blocks", "2": "block", "3": "LM head"}
    stock = SimpleNamespace(parts=[0, 3, 6], _layer_specs=specs)  # DeepSpeed's: one stage per rank
    assert stage_layers(stock) == {"0": "embedding + 2 blocks", "1": "2 blocks + LM head"}


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


def test_the_collector_clock_counts_collections_per_generation_and_what_they_found() -> None:
    clock = GcClock()
    try:
        clock.reset()
        cycle: list[object] = []
        cycle.append(cycle)  # freed by the collector alone
        del cycle
        gc.collect()
        snap = clock.snapshot()
        assert snap["count"][2] >= 1 and snap["collected"] >= 1 and snap["seconds"][2] > 0, snap
        clock.reset()
        assert clock.snapshot() == {"count": [0, 0, 0], "seconds": [0.0, 0.0, 0.0], "collected": 0}
    finally:
        clock.close()
    steps = [{"gc": {"count": [1, 0, 1], "seconds": [0.001, 0.0, 0.003], "collected": 4}}, {"gc": {"count": [0, 0, 0], "seconds": [0.0] * 3}}]
    assert _collector(steps) == {"gc_ms": 2.0, "gc_full": 0.5}  # means: one step in two collected
    got = _collector([{"handlers": {}}])  # raw lines from before the clock
    assert got["gc_ms"] != got["gc_ms"] and got["gc_full"] != got["gc_full"]  # NaN: rendered as nan, not as 0


def test_an_auto_row_runs_its_schedule_for_measured_costs_and_the_report_names_the_order(tmp_path: Path) -> None:
    pipeline = config_of("v-zb" + AUTO, seq_len=64)["pipeline"]
    assert pipeline["schedule"] == "auto" and pipeline["auto_candidates"] == ["v-zb"] and pipeline["auto_placement"] == "v"
    greedy = generate("v-zb", 2, 8, costs=Costs(b=1.14, w=0.39))
    assert _ran(SimpleNamespace(schedule=greedy)) == f"v-zb ({greedy.params['picked']})"
    assert _ran(SimpleNamespace(schedule=generate("v-zb", 2, 8))) == "v-zb" and _ran(object()) == "DeepSpeed TrainSchedule"
    raw = tmp_path / "raw.jsonl"
    records = [("v-zb+auto", _ran(SimpleNamespace(schedule=greedy))), ("v-zb+fused", "v-zb"), ("deepspeed-1f1b", "DeepSpeed TrainSchedule")]
    raw.write_text("".join(json.dumps({"kind": "steps", "schedule": name, "ran": ran}) + "\n" for name, ran in records))
    steps = {name: [] for name, _ in records}
    assert _orders_run(raw, steps) == [f"Ran (auto's choice, or the order picked for the costs): v-zb+auto: {records[0][1]}.", ""]
    raw.write_text("".join(json.dumps({"kind": "steps", "schedule": name, "ran": ran}) + "\n" for name, ran in records[1:]))
    assert _orders_run(raw, steps) == []
