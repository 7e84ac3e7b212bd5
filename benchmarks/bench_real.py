"""Real-compute benchmark worker: the recipe's tiny Llama at p=2, every ds_vshape schedule and DeepSpeed 1F1B.

Launched by ``benchmarks/run.sh`` under torchrun with 2 ranks (one per core). The model,
data and DeepSpeed configs are the recipe's own (``recipes/train_hf.py``,
``ds_configs/<schedule>.json``: AdamW, 8 micro-batches of 4 x 64 tokens, clipping 1.0).
Per schedule: warm-up steps, then timed steps framed by barriers. Rank 0 appends one JSON
line per schedule to ``--out``.

Activation memory: ds_vshape engines report their own meter; for stock DeepSpeed the same
meter class is wrapped around each forward instruction, and in both the loss function's
saved tensors are kept out (ds_vshape computes the loss outside its meter).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import deepspeed  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402

import ds_vshape  # noqa: E402
from benchmarks.bench_emulated import DS_VSHAPE_SCHEDULES  # noqa: E402
from benchmarks.probe import Probe, instrument_engine  # noqa: E402
from benchmarks.emulated import metered_loss  # noqa: E402
from ds_vshape.hf import pipeline_layers  # noqa: E402
from recipes.train_hf import DEFAULT_DATA, ByteTokenizer, batches, load_tokens, preset_config, seed_layer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", nargs="*", default=None, help="default: deepspeed-1f1b and every ds_vshape runtime schedule")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args(argv)


def build(schedule: str, args: argparse.Namespace, p: int) -> tuple[Any, Probe, int]:
    config = json.loads((ROOT / "ds_configs" / f"{schedule}.json").read_text())
    tok = ByteTokenizer()
    layers, loss_fn = pipeline_layers(preset_config("llama", vocab_size=tok.vocab_size, seq_len=args.seq_len), attn_implementation="sdpa")
    module = PipelineModule(layers=layers, loss_fn=metered_loss(loss_fn), num_stages=p, partition_method="parameters",
                            seed_layers=True, base_seed=1234, seed_fn=seed_layer)
    params = [q for q in module.parameters() if q.requires_grad]
    probe = Probe()
    engine, *_ = ds_vshape.initialize(model=module, model_parameters=params, config=config)
    if hasattr(engine, "measure_memory"):
        engine.measure_memory = True  # the table reports every step's peak, as for the stock engine
    instrument_engine(engine, probe, meter_forward=not hasattr(engine, "peak_activation_bytes"))
    tokens = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * args.seq_len
    return engine, probe, tokens


def run(schedule: str, args: argparse.Namespace, p: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine, probe, tokens = build(schedule, args, p)
    build_s = time.perf_counter() - t0
    train_ids, _ = load_tokens(DEFAULT_DATA, ByteTokenizer())
    data = batches(train_ids, batch=engine.train_micro_batch_size_per_gpu(), seq_len=args.seq_len, seed=1234)
    steps = []
    for i in range(args.warmup + args.steps):
        probe.reset()
        dist.barrier()
        t = time.perf_counter()
        loss = float(engine.train_batch(data).item())
        dist.barrier()
        dt = time.perf_counter() - t
        peak = engine.peak_activation_bytes if hasattr(engine, "peak_activation_bytes") else probe.meter.peak_bytes  # type: ignore[union-attr]
        if i >= args.warmup:
            steps.append({"step_s": dt, "loss": loss, "peak_activation_bytes": int(peak), "handler_s": dict(probe.handler_s)})
    return {"build_s": build_s, "tokens_per_step": tokens, "steps": steps}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))
    rank, p = dist.get_rank(), dist.get_world_size()
    schedules = args.schedules or ["deepspeed-1f1b", *DS_VSHAPE_SCHEDULES]
    for schedule in schedules:
        t0 = time.perf_counter()
        try:
            mine: dict[str, Any] = run(schedule, args, p)
        except Exception as err:
            mine = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        gathered: list[Any] = [None] * p
        dist.all_gather_object(gathered, mine)
        gc.collect()
        if rank == 0:
            system, name = ("deepspeed", "1f1b") if schedule == "deepspeed-1f1b" else ("ds_vshape", schedule)
            rec = {"kind": "real", "system": system, "schedule": name, "p": p, "wall_s": time.perf_counter() - t0, "ranks": gathered}
            with args.out.open("a") as fh:
                fh.write(json.dumps(rec) + "\n")
            errs = [g["error"] for g in gathered if "error" in g]
            if errs:
                status = "ERROR " + errs[0][:200]
            else:
                med = statistics.median(s["step_s"] for s in gathered[0]["steps"])
                status = f"step {med:.3f} s, {gathered[0]['tokens_per_step'] / med:,.0f} tok/s"
            print(f"[real p={p}] {system:9s} {name:14s} {status}  ({rec['wall_s']:.1f} s)", flush=True)
    dist.barrier()
    dist.destroy_process_group()  # gloo's threads can abort the process at interpreter teardown


if __name__ == "__main__":
    main()
