"""V-Half and V-Min activation memory with ``partition_method: profile`` on the recipe's tiny Llama (issue 13, item 5).

Launched under torchrun with p ranks (pure pipeline, gloo, CPU) by ``benchmarks/run_auto.sh``::

    python -m torch.distributed.run --nproc_per_node 4 benchmarks/bench_profile_memory.py --out raw/profile_memory.jsonl

The model is ``recipes/train_hf.py``'s default (``build_module``: tiny Llama, hidden 64, 8
decoder blocks, byte vocabulary, embedding and LM head as their own pipeline layers) with
the recipe's configs (``ds_configs/<schedule>.json``: 4 rows x 8 micro-batches, AdamW), and
``pipeline.partition_method`` set to ``profile`` (and, for comparison, the recipe's own
``parameters``) and ``pipeline.measure_memory`` on. Real compute: every rank runs on the CPU.

Per (method, schedule) it trains a few steps on the recipe's data and records every rank's
``engine.peak_activation_bytes`` of the last step, the cut (``stage_parts``), and with
profile the measured per-layer costs (``module.vs_profile``), from which it also predicts
each rank's peak bytes for the cut (``schedules.auto.peak_bytes``: the simulator's count,
weighted by each stage's measured bytes).

``--in-b PATTERN...`` (repeatable) runs every split-backward schedule again with
``pipeline.weight_grads_in_b`` set to those patterns (issue 19, item 2), and ``--md PATH`` writes the
busiest rank's peak of every case against 1F1B's (same method and round) there; ``--w-memory X...``
runs every split-backward case at each of these ``pipeline.w_memory`` (the share the schedule plans
W to keep; the config's when absent)::

    python -m torch.distributed.run --nproc_per_node 4 benchmarks/bench_profile_memory.py \\
        --out benchmarks/results/raw/w_in_b_p4.jsonl --methods parameters --rounds 1 \\
        --in-b '*self_attn*' --in-b '*self_attn*' '*.head' --w-memory 0.5 0.77 0.48 --md benchmarks/results/w_in_b.md
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import statistics
import sys
import time
from collections import defaultdict
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
from ds_vshape.config import parse_pipeline_config  # noqa: E402
from ds_vshape.runtime.program import instructions as ins  # noqa: E402
from ds_vshape.schedules import get_info  # noqa: E402
from ds_vshape.schedules.auto import peak_bytes  # noqa: E402
from recipes.corpus import DEFAULT_DATA, batches, load_tokens, tokenizer_for  # noqa: E402
from recipes.train_hf import build_module  # noqa: E402

SCHEDULES = ("1f1b", "v-half", "v-min")
# "profile@S": partition_method profile with pipeline.profile_time_slack S (default 0.02).
METHODS = ("profile", "profile@0.1", "parameters")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSONL file rank 0 appends to")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    ap.add_argument("--methods", nargs="+", default=list(METHODS),
                    help="partition methods: parameters (the recipe's), profile, profile@SLACK (profile_time_slack SLACK)")
    ap.add_argument("--rounds", type=int, default=2, help="run every case this many times (profile measures again each time)")
    ap.add_argument("--steps", type=int, default=3, help="training steps per case; the last one's peaks are kept")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--model", default="llama")
    ap.add_argument("--attn-implementation", default="sdpa")
    ap.add_argument("--configs", type=Path, default=ROOT / "ds_configs", help="where <schedule>.json lives")
    ap.add_argument("--in-b", nargs="+", action="append", default=[], metavar="PATTERN",
                    help="also run each split-backward schedule with pipeline.weight_grads_in_b set to these patterns "
                         "(repeat for several variants)")
    ap.add_argument("--w-memory", nargs="+", type=float, default=[], help="pipeline.w_memory values for split-backward cases")
    ap.add_argument("--md", type=Path, help="write the busiest-rank ratios to 1f1b here (rank 0, at the end)")
    return ap.parse_args(argv)


def config_for(schedule: str, method: str, args: argparse.Namespace, *, in_b: list[str] | None = None,
               w_memory: float | None = None) -> dict[str, Any]:
    config = json.loads((args.configs / f"{schedule}.json").read_text())
    pipeline = config.setdefault("pipeline", {})
    base, _, slack = method.partition("@")
    pipeline.update({"schedule": schedule, "partition_method": base, "measure_memory": True, "p2p_timeout_s": 120})
    if in_b:
        pipeline["weight_grads_in_b"] = in_b
    if w_memory is not None:
        pipeline["w_memory"] = w_memory
    if slack:
        pipeline["profile_time_slack"] = float(slack)
    if base == "profile":
        rows = config["train_micro_batch_size_per_gpu"]
        pipeline["profile_sample"] = {"inputs": {"shape": [rows, args.seq_len], "dtype": "int64", "high": 256}}
    return config


class KeptShare:
    """What B keeps for W, per stage: after a B, the unit's share of its forward's saved bytes still
    held (saved tensors plus parked W inputs and output gradients) -- the real ``w_memory``."""

    def __init__(self, engine: Any) -> None:
        self.saved: dict[int, list[int]] = defaultdict(list)
        self.kept: dict[int, list[float]] = defaultdict(list)
        table = dict(type(engine)._INSTRUCTION_MAP)  # an instance attribute wins over the class's
        fwd, bwd = table[ins.ForwardPass], table[ins.BackwardInput]

        def total() -> int:
            return engine._meter.live_bytes + engine._store.parked_bytes

        def forward(eng: Any, **kw: Any) -> Any:
            before = total()
            out = fwd(eng, **kw)
            self.saved[kw["stage"]].append(total() - before)
            return out

        def backward_input(eng: Any, **kw: Any) -> Any:
            before = total()
            out = bwd(eng, **kw)
            saved = statistics.median(self.saved[kw["stage"]]) if self.saved[kw["stage"]] else 0
            if saved > 0:
                self.kept[kw["stage"]].append(1 + (total() - before) / saved)
            return out

        table[ins.ForwardPass], table[ins.BackwardInput] = forward, backward_input
        engine._INSTRUCTION_MAP = table

    def shares(self) -> dict[int, float]:
        return {s: statistics.median(v) for s, v in sorted(self.kept.items()) if v}


def run_case(schedule: str, method: str, args: argparse.Namespace, p: int, tokens: torch.Tensor, *,
             in_b: list[str] | None = None, w_memory: float | None = None) -> dict[str, Any]:
    config = config_for(schedule, method, args, in_b=in_b, w_memory=w_memory)
    torch.manual_seed(args.seed)
    module = build_module(args, 256, p)
    t0 = time.perf_counter()
    engine, *_ = ds_vshape.initialize(model=module, config=copy.deepcopy(config),
                                      model_parameters=[q for q in module.parameters() if q.requires_grad])
    build_s = time.perf_counter() - t0
    micro, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    data = batches(tokens, batch=micro, seq_len=args.seq_len, seed=args.seed)
    kept = KeptShare(engine) if engine.schedule.uses_split_backward else None
    steps = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = float(engine.train_batch(data).item())
        steps.append({"step_s": time.perf_counter() - t0, "loss": loss, "peak_activation_bytes": int(engine.peak_activation_bytes or 0)})
    out: dict[str, Any] = {"build_s": build_s, "steps": steps, "stage_id": engine.stage_id, "micro": micro, "m": gas,
                           "local_stages": list(engine.module.local_stages),
                           "kept_share": kept.shares() if kept is not None else None}
    if dist.get_rank() == 0:
        sched = engine.schedule
        out["schedule"] = sched.name
        out["stage_parts"] = [int(b) for b in engine.module.stage_parts]
        out["stage_to_rank"] = list(sched.stage_to_rank)
        out["layers"] = len(engine.module.stage_parts) and int(engine.module.stage_parts[-1])
        prof = getattr(engine.module, "vs_profile", None)
        if prof is not None:
            costs = [[c.time, c.activation_bytes, c.param_bytes] for c in prof.costs]
            parts = out["stage_parts"]
            stage_bytes = [sum(c[1] for c in costs[parts[s]:parts[s + 1]]) for s in range(len(parts) - 1)]
            w_memory = parse_pipeline_config(config).w_memory
            out["profile"] = {"costs": costs, "inflight": list(prof.inflight), "cut_parts": list(prof.cut.parts),
                              "rank_time": list(prof.cut.rank_time), "rank_memory": list(prof.cut.rank_memory),
                              "stage_bytes": stage_bytes, "w_memory": w_memory,
                              "predicted_peak_bytes": list(peak_bytes(sched, stage_bytes, kept_until_w=w_memory))}
    return out


def _busiest(record: dict[str, Any]) -> int:
    return max(g["steps"][-1]["peak_activation_bytes"] for g in record["ranks"])


def _ratio_row(r: dict[str, Any], one: int | None) -> str:
    shares = [v for g in r["ranks"] for v in (g.get("kept_share") or {}).values()]
    peaks = ", ".join(str(round(g["steps"][-1]["peak_activation_bytes"] / 1024)) for g in r["ranks"])
    w_memory = "-" if r["schedule"] == "1f1b" else r.get("w_memory") or "config's"
    cells = [r["method"], str(r["round"]), r["schedule"], ", ".join(f"`{x}`" for x in r["in_b"]) or "-", str(w_memory),
             f"{_busiest(r) / 1024:.0f}", peaks, f"{_busiest(r) / one:.3f}" if one else "no 1f1b row",
             f"{statistics.median(shares):.3f}" if shares else "-"]
    return "| " + " | ".join(cells) + " |"


def ratio_table(records: list[dict[str, Any]], command: str) -> str:
    """Markdown: each case's busiest-rank peak (last step) against 1F1B's of the same method and round."""
    ok = [r for r in records if not any("error" in g for g in r["ranks"])]
    base = {(r["method"], r["round"]): _busiest(r) for r in ok if r["schedule"] == "1f1b"}
    p = records[0]["p"] if records else "?"
    lines = ["# Busiest-rank activation memory against 1F1B, by `pipeline.w_memory` and `pipeline.weight_grads_in_b`", "",
             "The recipe's tiny Llama (`recipes/train_hf.py`'s `build_module`, `ds_configs/<schedule>.json`), "
             "`pipeline.measure_memory` on; per case the largest `engine.peak_activation_bytes` over the ranks in the last "
             "step, against 1F1B's of the same partition method and round. *B keeps for W*: after each B, the share of "
             "that unit's forward bytes still held (`KeptShare`), median over the stages. The engine holds W to the "
             "V schedules' `w_memory` (`ds_vshape/runtime/split/fit.py`): below the model's own share, some weight "
             "gradients are computed in B; at 1 none are.", "",
             f"Command: `python -m torch.distributed.run --nproc_per_node {p} benchmarks/bench_profile_memory.py {command}`; "
             f"torch {torch.__version__}; gloo, CPU.", "",
             "| method | round | schedule | weight_grads_in_b | w_memory | busiest-rank peak (KiB) | peak per rank (KiB) "
             "| ratio to 1f1b | B keeps for W (median over stages) |", "|---|--:|---|---|--:|--:|---|--:|--:|"]
    lines += [_ratio_row(r, base.get((r["method"], r["round"]))) for r in ok]
    errors = [f"* {r['schedule']} {r['in_b']}: {next(g['error'] for g in r['ranks'] if 'error' in g)[:300]}"
              for r in records if r not in ok]
    return "\n".join(lines + ([""] + errors if errors else []))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))
    rank, p = dist.get_rank(), dist.get_world_size()
    train_ids, _ = load_tokens(DEFAULT_DATA, tokenizer_for(args.model))
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(args.out, {"kind": "setup", "p": p, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}})
    plan = [(rnd, method, schedule, in_b, w) for rnd in range(args.rounds) for method in args.methods for schedule in args.schedules
            for in_b in ([], *args.in_b) for w in (args.w_memory or [None])
            if get_info(schedule).split_backward or (not in_b and w in (None, *args.w_memory[:1]))]
    records = []
    for rnd, method, schedule, in_b, w in plan:
        t0 = time.perf_counter()
        gathered = run_everywhere(lambda: run_case(schedule, method, args, p, train_ids, in_b=in_b, w_memory=w))
        if rank == 0:
            record = {"kind": "case", "schedule": schedule, "method": method, "round": rnd, "p": p, "wall_s": time.perf_counter() - t0,
                      "in_b": in_b, "w_memory": w, "ranks": gathered}
            records.append(record)
            append_jsonl(args.out, record)
            errs = [g["error"] for g in gathered if "error" in g]
            if errs:
                status = "ERROR " + errs[0][:300]
            else:
                peaks = [g["steps"][-1]["peak_activation_bytes"] for g in gathered]
                status = (f"peak per rank KiB {[round(b / 1024) for b in peaks]}, cut {gathered[0]['stage_parts']}, "
                          f"step {statistics.median(s['step_s'] for s in gathered[0]['steps'][1:] or gathered[0]['steps']):.2f} s")
            label = schedule + (" +in_b" if in_b else "") + (f" w{w:g}" if w is not None and get_info(schedule).split_backward else "")
            print(f"[memory p={p} round {rnd}] {method:11s} {label:13s} {status}  ({record['wall_s']:.1f} s)", flush=True)
    if rank == 0 and args.md is not None:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(ratio_table(records, shlex.join(sys.argv[1:])) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
