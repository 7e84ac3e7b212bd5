"""Activation offload (``pipeline.offload``) on the recipe's tiny Llama: device memory against 1F1B.

Launched under torchrun with p ranks (pure pipeline, gloo, CPU)::

    python -m torch.distributed.run --nproc_per_node 4 benchmarks/bench_offload.py \\
        --out benchmarks/results/raw/offload.jsonl --md benchmarks/results/offload.md
    python benchmarks/bench_offload.py --report benchmarks/results/raw/offload.jsonl --md benchmarks/results/offload.md

The model and configs are the recipe's (``recipes/train_hf.py``'s ``build_module``: hidden 64,
8 decoder blocks, 4 heads, sequence 64; ``ds_configs/<schedule>.json``: 4 rows x 8 micro-batches,
AdamW), with ``pipeline.offload`` set per case and ``pipeline.measure_memory`` on. Each case
trains a few steps on the recipe's data from the same weights and records, per rank, the
last step's peak device-resident activation bytes (``engine.peak_activation_bytes``), the
peak offloaded to host memory (``engine.peak_host_activation_bytes``), the losses and the
step times. On the CPU the "device" and the host pool are both main memory, but the copies
are real and the device figure counts only what stays behind; the time is what the copies
cost without a copy engine to hide them (an upper bound for a GPU's overhead).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import deepspeed  # noqa: E402

import ds_vshape  # noqa: E402
from benchmarks.common import append_jsonl, run_everywhere  # noqa: E402
from recipes.corpus import DEFAULT_DATA, batches, load_tokens, tokenizer_for  # noqa: E402
from recipes.train_hf import build_module  # noqa: E402

# (schedule, offload share): 1F1B, and V-Half with its first chunk (0.5) and everything it can (1)
# offloaded; 1F1B and V-ZB (whose split backward keeps W's inputs on the device) likewise.
CASES = ("1f1b:0", "v-half:0", "v-half:0.5", "v-half:1", "1f1b:0.5", "1f1b:1", "v-zb:0", "v-zb:0.5")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="JSONL file rank 0 appends to (a run, under torchrun)")
    ap.add_argument("--report", type=Path, help="write --md from this JSONL file instead of running")
    ap.add_argument("--md", type=Path, help="markdown table rank 0 writes at the end")
    ap.add_argument("--cases", nargs="+", default=list(CASES), help="schedule:share pairs")
    ap.add_argument("--steps", type=int, default=4, help="training steps per case; the last one's peaks are kept")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--model", default="llama")
    ap.add_argument("--attn-implementation", default="sdpa")
    ap.add_argument("--configs", type=Path, default=ROOT / "ds_configs", help="where <schedule>.json lives")
    return ap.parse_args(argv)


def run_case(schedule: str, share: float, args: argparse.Namespace, p: int, tokens: torch.Tensor) -> dict[str, Any]:
    config = json.loads((args.configs / f"{schedule}.json").read_text())
    config["pipeline"].update({"schedule": schedule, "offload": share, "measure_memory": True, "p2p_timeout_s": 120})
    torch.manual_seed(args.seed)
    module = build_module(args, 256, p)
    engine, *_ = ds_vshape.initialize(model=module, config=copy.deepcopy(config),
                                      model_parameters=[q for q in module.parameters() if q.requires_grad])
    micro = engine.train_micro_batch_size_per_gpu()
    data = batches(tokens, batch=micro, seq_len=args.seq_len, seed=args.seed)
    watch = _watch_peak(engine)
    steps = []
    for _ in range(args.steps):
        watch["at_peak"] = None
        dist.barrier()
        t0 = time.perf_counter()
        loss = float(engine.train_batch(data).item())
        steps.append({"step_s": time.perf_counter() - t0, "loss": loss, "device": int(engine.peak_activation_bytes or 0),
                      "host": int(engine.peak_host_activation_bytes or 0), "breakdown": dict(engine._meter.peak_breakdown)})
    return {"steps": steps, "stage_id": engine.stage_id, "offloaded_units": engine._offload.offloaded_units,
            "units": sorted(engine._offload.units), "at_peak": watch["at_peak"]}


def _watch_peak(engine: Any) -> dict[str, Any]:
    """Where the device peak of a step is reached: the pass running and who holds what (``_at_peak``).

    Wraps the engine's offloader (every pass goes through ``before_pass``) and the meter's peak update.
    """
    state: dict[str, Any] = {"pass": None, "in_flight": [], "at_peak": None}
    offload, meter = engine._offload, engine._meter
    before_pass, update = offload.before_pass, meter._update_peak

    def on_pass(kind: Any, unit: tuple[int, int, int]) -> None:
        state["pass"] = f"{kind.value}{unit[0]}.{unit[1]}"
        if kind.value == "F":
            state["in_flight"].append(unit)
        elif kind.value in ("B", "BW") and unit in state["in_flight"]:
            state["in_flight"].remove(unit)
        before_pass(kind, unit)

    def on_update() -> None:
        before = meter.peak_bytes
        update()
        if meter.peak_bytes > before:
            state["at_peak"] = _at_peak(engine, state)

    offload.before_pass, meter._update_peak = on_pass, on_update
    return state


def _at_peak(engine: Any, state: dict[str, Any]) -> dict[str, Any]:
    """Who holds the device bytes now: units between F and B (offloaded or not), W-kept bytes per unit."""
    offload, store = engine._offload, engine._store
    parked: dict[str, int] = {}
    for key, works in store._parked.items():
        seen: dict[int, int] = {}
        for t in (t for w in works for t in w.held):
            storage = t.untyped_storage()
            if storage.data_ptr() not in store._param_ptrs:
                seen[storage._cdata] = storage.nbytes()  # 0 while offloaded
        parked[f"{key[0]}.{key[1]}"] = sum(seen.values())
    reloaded = [u for u, slots in offload._slots.items() if any(s.device is not None for s in slots)]
    return {"pass": state["pass"], "saved": engine._meter.live_bytes,
            "kept_units": [f"{u[0]}.{u[1]}" for u in state["in_flight"] if u not in offload.units],
            "offloaded_in_flight": [f"{u[0]}.{u[1]}" for u in state["in_flight"] if u in offload.units],
            "offloaded_on_device": [f"{u[0]}.{u[1]}" for u in list(offload._open) + reloaded],
            "offload_device": offload.device_bytes, "parked_on_device": parked,
            "parked_on_host": [f"{u[0]}.{u[1]}" for u in offload._w._units if any(k.host is not None for k in offload._w._units[u])]}


def table(records: list[dict[str, Any]]) -> str:
    """One row per case: the busiest rank's device bytes against 1F1B's, host bytes, losses, step time."""
    base = next(r for r in records if r["schedule"] == "1f1b" and r["share"] == 0)
    base_peak = max(g["steps"][-1]["device"] for g in base["ranks"])
    alone = {r["schedule"]: r for r in records if r["share"] == 0}
    lines = ["| schedule | offload | device activation per rank (KiB) | busiest rank / 1F1B | busiest rank's peak: saved / "
             "kept for W / offloaded units back (KiB) | host per rank (KiB) | losses vs same schedule without offload | "
             "losses vs 1F1B | step (s, median) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        device = [g["steps"][-1]["device"] for g in r["ranks"]]
        host = [g["steps"][-1]["host"] for g in r["ranks"]]
        losses = [s["loss"] for s in r["ranks"][0]["steps"]]
        own = alone.get(r["schedule"])
        same = "n/a" if own is None or own is r else _diff(losses, [s["loss"] for s in own["ranks"][0]["steps"]])
        step = statistics.median(s["step_s"] for s in r["ranks"][0]["steps"][1:])
        parts = r["ranks"][device.index(max(device))]["steps"][-1]["breakdown"]
        split = " / ".join(str(round(parts.get(key, 0) / 1024)) for key in ("saved", "parked", "offload"))
        lines.append(f"| {r['schedule']} | {r['share']:g} | {[round(d / 1024) for d in device]} | {max(device) / base_peak:.3f} | "
                     f"{split} | {[round(h / 1024) for h in host]} | {same} | {_diff(losses, [s['loss'] for s in base['ranks'][0]['steps']])} | "
                     f"{step:.3f} |")
    return "\n".join(lines) + "\n"


def _diff(a: list[float], b: list[float]) -> str:
    worst = max(abs(x - y) for x, y in zip(a, b))
    return "identical" if worst == 0 else f"max diff {worst:.1e}"


def render(records: list[dict[str, Any]], *, steps: int, seq_len: int) -> str:
    p = records[0]["p"]
    head = (f"# Activation offload, recipe Llama (hidden 64, 8 blocks, seq {seq_len}), p={p}, m=8, CPU ranks\n\n"
            f"`benchmarks/bench_offload.py`: per rank, the peak activation bytes of the last of {steps} steps, on the device "
            "(`engine.peak_activation_bytes`) and in host memory (`engine.peak_host_activation_bytes`) apart. The busiest "
            "rank's peak splits into what autograd saved (on the device), what split backward keeps from B to W (not "
            "offloaded), and offloaded units on the device (reloaded for the coming backward, or a saved tensor on its way "
            "to host). "
            "Losses: every step's loss on rank 0. Step times come from CPU ranks sharing 2 cores with other work: the "
            "copies are plain memory copies with no copy engine to hide them, and the noise is larger than the "
            "differences.\n\n")
    return head + table(records) + at_peak(records)


def at_peak(records: list[dict[str, Any]]) -> str:
    """Per case with offload under split backward: the busiest rank's peak, unit by unit (stage.micro-batch)."""
    lines = ["\n## What is on the device at the busiest rank's peak\n",
             "Last step, the rank with the largest device peak; units are stage.micro-batch. *saved*: autograd's saved "
             "tensors of the units between F and B that are not offloaded (plus the offloaded units' tensors under "
             "MIN_BYTES, their stage inputs and outputs); *kept for W*: the device bytes each unit's parked W work "
             "holds (0 when offloaded); *offloaded units back*: an offloaded unit in its forward, reloaded for its B, "
             "or the one whose B runs. Why each part stays: a unit outside the share (V at 0.5: the second chunk) "
             "keeps its saved tensors on the device; an offloaded unit's saved tensors go to host as autograd saves them "
             "(its forward does not pile them up), and are back from the pass before its B (the copy overlaps that pass) "
             "and while its B runs; what any unit's B keeps for W is on the host while its W is two or more passes "
             "away, back from the pass before its W on; a stage's inputs and outputs stay (the engine holds them).\n"]
    for r in records:
        device = [g["steps"][-1]["device"] for g in r["ranks"]]
        busiest = device.index(max(device))
        peak = r["ranks"][busiest].get("at_peak")
        if not peak or r["share"] == 0:
            continue
        held = {u: b for u, b in peak["parked_on_device"].items() if b}
        back = list(peak["offloaded_on_device"])
        running = peak["pass"] or ""
        if running[:1] == "B" and running.lstrip("BW") in {f"{u[0]}.{u[1]}" for u in r["ranks"][busiest]["units"]} \
                and running.lstrip("BW") not in back:
            back.append(f"{running.lstrip('BW')}, its B running")
        lines.append(f"- **{r['schedule']} offload {r['share']:g}**, rank {busiest}, peak {round(max(device) / 1024)} KiB "
                     f"during pass {peak['pass']}: saved {round(peak['saved'] / 1024)} KiB (units between F and B not "
                     f"offloaded: {', '.join(peak['kept_units']) or 'none'}; offloaded: "
                     f"{', '.join(peak['offloaded_in_flight']) or 'none'}); kept for W on the device "
                     f"{round(sum(held.values()) / 1024)} KiB ({', '.join(f'{u}: {round(b / 1024)}' for u, b in held.items()) or 'none'}); "
                     f"kept for W on the host: {', '.join(peak['parked_on_host']) or 'none'}; offloaded units back "
                     f"{round(peak['offload_device'] / 1024)} KiB ({', '.join(back) or 'none'}).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report is not None:
        records = [json.loads(line) for line in args.report.read_text().splitlines() if line.strip()]
        args.md.write_text(render(records, steps=len(records[0]["ranks"][0]["steps"]), seq_len=args.seq_len))
        return
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))
    rank, p = dist.get_rank(), dist.get_world_size()
    train_ids, _ = load_tokens(DEFAULT_DATA, tokenizer_for(args.model))
    records = []
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    for case in args.cases:
        schedule, _, share = case.partition(":")
        gathered = run_everywhere(lambda: run_case(schedule, float(share or 0), args, p, train_ids))
        if rank == 0:
            record = {"kind": "case", "schedule": schedule, "share": float(share or 0), "p": p, "ranks": gathered}
            append_jsonl(args.out, record)
            errors = [g["error"] for g in gathered if "error" in g]
            if errors:
                print(f"[offload p={p}] {case}: ERROR {errors[0][:400]}", flush=True)
                continue
            records.append(record)
            print(f"[offload p={p}] {case}: device KiB {[round(g['steps'][-1]['device'] / 1024) for g in gathered]}, host KiB "
                  f"{[round(g['steps'][-1]['host'] / 1024) for g in gathered]}", flush=True)
    if rank == 0 and args.md is not None and records:
        args.md.write_text(render(records, steps=args.steps, seq_len=args.seq_len))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
