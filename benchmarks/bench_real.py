"""Real-compute benchmark worker: a compute-bound Llama at p=2, every ds_vshape schedule and DeepSpeed 1F1B.

Launched by ``benchmarks/run_real.sh`` (``make bench-real``) under torchrun with 2 ranks, one
per core. The model is a Llama sized by the options (default hidden 384, 8 blocks, 6 heads,
FFN 1056, byte vocabulary, sequences of 128), trained on the recipe's data with
``ds_configs/<schedule>.json`` (AdamW, 8 micro-batches of 4, clipping 1.0). Per round: a fresh
engine for every schedule, then warm-up and timed steps framed by barriers, the schedules taking
turns step by step so that drift of the machine hits all of them alike. Rank 0 appends one
JSON line per schedule and round to ``--out``.

Per step and rank it records each instruction's time (``Probe``) and the process's CPU time,
so the report can say where the step went: passes, other instructions, waits, idle.

Activation memory: ds_vshape engines report their own meter; for stock DeepSpeed the same
meter class is wrapped around each forward instruction, and in both the loss function's
saved tensors are kept out (ds_vshape computes the loss outside its meter).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import deepspeed  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402

import ds_vshape  # noqa: E402
from benchmarks.bench_emulated import DS_VSHAPE_SCHEDULES  # noqa: E402
from benchmarks.common import append_jsonl, record_case  # noqa: E402
from benchmarks.hops import hop_latency  # noqa: E402
from benchmarks.probe import Probe, instrument_engine  # noqa: E402
from benchmarks.emulated import metered_loss  # noqa: E402
from ds_vshape.hf import pipeline_layers  # noqa: E402
from recipes.train_hf import DEFAULT_DATA, ByteTokenizer, batches, load_tokens, seed_layer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", nargs="*", default=None, help="default: deepspeed-1f1b and every ds_vshape runtime schedule")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="rounds (fresh engines each); the report keeps each schedule's best")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--ffn", type=int, default=1056)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="pipeline keys merged into a schedule's config where the schedule is named SCHEDULE+NAME, e.g. "
                         "--variant 'in_b={\"weight_grads_in_b\": [\"*self_attn*\"]}' --schedules deepspeed-1f1b v-half+in_b")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.variants = dict(_variant(v) for v in args.variant)
    return args


def _variant(text: str) -> tuple[str, dict[str, Any]]:
    name, sep, keys = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--variant wants NAME=JSON, got {text!r}")
    return name, json.loads(keys)


def model_config(args: argparse.Namespace, *, vocab_size: int) -> LlamaConfig:
    """A Llama sized by the arguments (untied, as the recipe's presets)."""
    return LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.blocks,
                       num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=vocab_size,
                       max_position_embeddings=max(args.seq_len, 128), tie_word_embeddings=False,
                       bos_token_id=0, eos_token_id=0, pad_token_id=None)


def build(schedule: str, args: argparse.Namespace, p: int) -> tuple[Any, Probe, int]:
    """``schedule`` is a name of ``ds_configs`` or ``NAME+VARIANT`` (that config with the variant's pipeline keys)."""
    name, _, variant = schedule.partition("+")
    config = json.loads((ROOT / "ds_configs" / f"{name}.json").read_text())
    if variant:
        config["pipeline"] = {**config.get("pipeline", {}), **args.variants[variant]}
    tok = ByteTokenizer()
    layers, loss_fn = pipeline_layers(model_config(args, vocab_size=tok.vocab_size), attn_implementation="sdpa")
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


class Runner:
    """One schedule's engine, probe and data, stepped one step at a time (steps interleave)."""

    def __init__(self, schedule: str, args: argparse.Namespace, p: int) -> None:
        self.schedule, self.error, self.steps = schedule, None, []  # type: ignore[var-annotated]
        t0 = time.perf_counter()
        try:
            self.engine, self.probe, self.tokens = build(schedule, args, p)
            train_ids, _ = load_tokens(DEFAULT_DATA, ByteTokenizer())
            self.data = batches(train_ids, batch=self.engine.train_micro_batch_size_per_gpu(), seq_len=args.seq_len, seed=1234)
        except Exception as err:  # reported in the schedule's line; the others still run
            self.error = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
        self.build_s = time.perf_counter() - t0

    def step(self, *, timed: bool) -> None:
        """One training step framed by barriers (every rank calls it, also after an error)."""
        if self.error is not None:
            dist.barrier()
            return
        self.probe.reset()
        dist.barrier()
        t, cpu, faults = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        try:
            loss = float(self.engine.train_batch(self.data).item())
        except Exception as err:
            self.error = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
            return
        cpu, local = time.process_time() - cpu, time.perf_counter() - t  # before the barrier: this rank's own step
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults  # fresh pages the allocator touched
        dist.barrier()
        dt = time.perf_counter() - t
        engine, probe = self.engine, self.probe
        peak = engine.peak_activation_bytes if hasattr(engine, "peak_activation_bytes") else probe.meter.peak_bytes  # type: ignore[union-attr]
        if timed:
            snap = probe.snapshot()
            del snap["device"]  # the emulated device's; nothing sleeps here
            self.steps.append({"step_s": dt, "local_s": local, "cpu_s": cpu, "page_faults": faults, "loss": loss,
                               "peak_activation_bytes": int(peak), **snap})

    def record(self) -> dict[str, Any]:
        if self.error is not None:
            return self.error
        return {"build_s": self.build_s, "tokens_per_step": self.tokens, "steps": self.steps}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))
    rank, p = dist.get_rank(), dist.get_world_size()
    schedules = args.schedules or ["deepspeed-1f1b", *DS_VSHAPE_SCHEDULES]
    # One hop of an activation-sized message: what the simulator charges per transfer.
    latency = hop_latency(rank, 4 * args.seq_len * args.hidden, iters=100)
    if rank == 0:
        append_jsonl(args.out, {"kind": "latency", "p": p, **latency})
        if args.variants:
            append_jsonl(args.out, {"kind": "variants", "variants": args.variants})
    for round_ in range(args.rounds):
        # Every engine is built first and the schedules take turns step by step: a slow spell of
        # the machine then falls on all of them alike, not on whichever ran at the time.
        runners = [Runner(schedule, args, p) for schedule in schedules]
        for i in range(args.warmup + args.steps):
            for runner in runners:
                runner.step(timed=i >= args.warmup)
        for runner in runners:
            report(runner, round_, args, rank, p)
        del runners
        gc.collect()
    dist.barrier()
    dist.destroy_process_group()  # gloo's threads can abort the process at interpreter teardown


def report(runner: Runner, round_: int, args: argparse.Namespace, rank: int, p: int) -> None:
    """One schedule's round: every rank's figures gathered, one JSON line written by rank 0."""
    gathered: list[Any] = [None] * p
    dist.all_gather_object(gathered, runner.record())
    if rank == 0:
        schedule = runner.schedule
        system, name = ("deepspeed", "1f1b") if schedule == "deepspeed-1f1b" else ("ds_vshape", schedule)
        rec = {"kind": "real", "system": system, "schedule": name, "p": p, "round": round_, "model": model_of(args),
               "ranks": gathered}
        ran = getattr(getattr(runner, "engine", None), "schedule", None)
        if ran is not None:  # what its steps ran (auto's choice, an order for measured costs): the report simulates it
            rec["ran"], rec["ran_picked"] = ran.to_dict(), ran.params.get("picked")  # the export leaves params out
        status = record_case(args.out, rec, gathered,
                             lambda med: f"step {med:.3f} s, {gathered[0]['tokens_per_step'] / med:,.0f} tok/s")
        print(f"[real p={p} round {round_}] {system:9s} {name:14s} {status}", flush=True)


def model_of(args: argparse.Namespace) -> dict[str, int]:
    return {k: getattr(args, k) for k in ("hidden", "blocks", "heads", "ffn", "seq_len")}


if __name__ == "__main__":
    main()
