"""Long sequences: activation memory and step time of Seq1F1B (k sequence chunks) against 1F1B,
with equal and with compute-wise chunk boundaries (``pipeline.seq_partition``).

Two modes::

    python -m torch.distributed.run --nproc_per_node 4 benchmarks/bench_seq.py run --seq-len 1024 --out raw.jsonl
    python benchmarks/bench_seq.py report raw_p2.jsonl raw_p4.jsonl --md benchmarks/results/seq1f1b.md

``run`` trains the recipe's own model and data (``recipes/train_hf.py``: the tiny Llama,
SDPA attention, Coriolanus bytes; ``ds_configs/1f1b.json`` and ``ds_configs/seq1f1b.json``:
AdamW, 8 micro-batches of 4 rows) at ``--seq-len`` for each (schedule, k), on as many
pipeline ranks as it was launched with. Per case: warm-up steps, one step with the memory
meter on (``engine.peak_activation_bytes``: what autograd saves, plus the keys/values a stage
keeps for a micro-batch's later chunks), one step that times every pass per sequence chunk
(the simulated bubble with those measured costs), then timed steps with the meter off (its
hooks cost host time), each framed by barriers. Rank 0 appends one JSON line per case to ``--out``.
``report`` turns the lines of both launches into the markdown table. ``benchmarks/run.sh``
(``SEQ=1``; alone: ``make bench-seq``) runs both.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

__all__ = ["CASES", "main", "render", "run_case"]

# (schedule, k, seq_partition)
CASES: tuple[tuple[str, int, str], ...] = (("1f1b", 1, "equal"), ("seq1f1b", 2, "equal"), ("seq1f1b", 2, "compute"),
                                           ("seq1f1b", 4, "equal"), ("seq1f1b", 4, "compute"))
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    run = sub.add_parser("run", help="measure (under torchrun)")
    run.add_argument("--seq-len", type=int, default=1024)
    run.add_argument("--warmup", type=int, default=1)
    run.add_argument("--steps", type=int, default=3, help="timed steps per case (meter off)")
    run.add_argument("--out", type=Path, required=True)
    report = sub.add_parser("report", help="write the markdown table")
    report.add_argument("inputs", type=Path, nargs="+")
    report.add_argument("--md", type=Path, required=True)
    report.add_argument("--commit", default="unknown", help="the code measured (run.sh records it)")
    return ap.parse_args(argv)


# ---- run ---------------------------------------------------------------------------------
def _engine(schedule: str, k: int, seq_len: int, p: int, partition: str = "equal") -> Any:
    from deepspeed.pipe import PipelineModule

    import ds_vshape
    from ds_vshape.hf import pipeline_layers
    from recipes.train_hf import ByteTokenizer, check_seq_len, preset_config, seed_layer

    config = json.loads((ROOT / "ds_configs" / f"{schedule}.json").read_text())
    if k > 1:
        config["pipeline"]["seq_chunks"] = k
        config["pipeline"]["seq_partition"] = partition
    check_seq_len(config, seq_len, f"ds_configs/{schedule}.json with seq_chunks={k}")
    source = preset_config("llama", vocab_size=ByteTokenizer.vocab_size, seq_len=seq_len)
    layers, loss_fn = pipeline_layers(source, attn_implementation="sdpa")
    module = PipelineModule(layers=layers, loss_fn=loss_fn, num_stages=p, partition_method="parameters",
                            seed_layers=True, base_seed=1234, seed_fn=seed_layer)
    params = [q for q in module.parameters() if q.requires_grad]
    engine, *_ = ds_vshape.initialize(model=module, model_parameters=params, config=config)
    return engine


def _timed_step(engine: Any, data: Any) -> tuple[float, float]:
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    loss = float(engine.train_batch(data).item())
    dist.barrier()
    return time.perf_counter() - t, loss


class _PassTimes:
    """Seconds of each F and backward pass per sequence chunk, while ``on`` (CPU: no sync needed)."""

    def __init__(self, engine: Any) -> None:
        from ds_vshape.runtime.program import instructions as ins

        self.on = False
        self.times: dict[tuple[str, int], list[float]] = {}
        table = dict(type(engine)._INSTRUCTION_MAP)
        for cls, kind in ((ins.ForwardPass, "F"), (ins.FusedBackward, "B"), (ins.BackwardInput, "B"), (ins.BackwardWeight, "B")):
            table[cls] = self._timed(kind, table[cls])
        engine._INSTRUCTION_MAP = table  # this engine only

    def _timed(self, kind: str, handler: Any) -> Any:
        def run(eng: Any, **kw: Any) -> None:
            t = time.perf_counter()
            handler(eng, **kw)
            if self.on:
                self.times.setdefault((kind, kw["seq_chunk"]), []).append(time.perf_counter() - t)
        return run

    def costs(self, k: int) -> Any:
        """Costs: F and backward (fused, W 0) of a micro-batch, each chunk weighted by its measured share."""
        from ds_vshape.schedules import Costs

        med = {key: statistics.median(v) for key, v in self.times.items()}
        per_chunk = [med.get(("F", j), 0.0) + med.get(("B", j), 0.0) for j in range(k)]
        f, b = (sum(med.get((kind, j), 0.0) for j in range(k)) for kind in ("F", "B"))
        return Costs(f=f, b=b, w=0.0, seq_weights=tuple(per_chunk) if k > 1 else None)


def run_case(schedule: str, k: int, args: argparse.Namespace, p: int, partition: str = "equal") -> dict[str, Any]:
    """One (schedule, k, partition) on this rank: the measured step's peaks, a step timing each
    pass per chunk, then the timed steps."""
    from ds_vshape.schedules import simulate
    from recipes.train_hf import DEFAULT_DATA, ByteTokenizer, batches, load_tokens

    engine = _engine(schedule, k, args.seq_len, p, partition)
    passes = _PassTimes(engine)
    train_ids, _ = load_tokens(DEFAULT_DATA, ByteTokenizer())
    data = batches(train_ids, batch=engine.train_micro_batch_size_per_gpu(), seq_len=args.seq_len, seed=1234)
    engine.measure_memory = False
    losses = [_timed_step(engine, data)[1] for _ in range(args.warmup)]
    engine.measure_memory = True
    losses.append(_timed_step(engine, data)[1])
    peaks = {"activation": engine.peak_activation_bytes, "with_transfers": engine.peak_memory_bytes}
    engine.measure_memory = False
    passes.on = True
    losses.append(_timed_step(engine, data)[1])
    passes.on = False
    times = []
    for _ in range(args.steps):
        dt, loss = _timed_step(engine, data)
        times.append(dt)
        losses.append(loss)
    sim = simulate(engine.schedule)
    rows = engine.train_micro_batch_size_per_gpu() * engine.micro_batches
    out = {"peaks": peaks, "step_s": times, "losses": losses, "tokens_per_step": rows * args.seq_len,
           "micro_batches": engine.micro_batches, "sim_bubble": sim.bubble_rate, "sim_peak": list(sim.peak_memory),
           "pass_times": {f"{kind}{j}": v for (kind, j), v in passes.times.items()}, "costs": passes.costs(k),
           "cuts": [list(c) for c in engine._seq._cuts.values()]}
    del engine
    gc.collect()
    return out


def _run(args: argparse.Namespace) -> None:
    import deepspeed
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=600))
    rank, p = dist.get_rank(), dist.get_world_size()
    for schedule, k, partition in CASES:
        t0 = time.perf_counter()
        mine = run_case(schedule, k, args, p, partition)
        gathered: list[Any] = [None] * p
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            record = {"schedule": schedule, "k": k, "partition": partition, "p": p, "seq_len": args.seq_len,
                      "wall_s": time.perf_counter() - t0, "ranks": gathered}
            record["sim_bubble_measured"] = _measured_bubble(record)
            for r in gathered:
                del r["costs"]  # JSON: the per-pass times above hold them
            with args.out.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            peak = max(r["peaks"]["activation"] for r in gathered) / MIB
            print(f"[seq p={p}] {schedule} k={k} {partition}: step {statistics.median(gathered[0]['step_s']):.3f} s, "
                  f"busiest rank {peak:.2f} MiB ({record['wall_s']:.1f} s)", flush=True)
    dist.barrier()
    dist.destroy_process_group()  # gloo's threads can abort the process at interpreter teardown


def _measured_bubble(record: dict[str, Any]) -> float:
    """The schedule's simulated bubble with the passes' measured costs: each chunk's F and backward
    (medians per rank, then the mean over ranks)."""
    import dataclasses

    from ds_vshape.config import parse_pipeline_config
    from ds_vshape.schedules import simulate

    ranks = record["ranks"]
    k, p = record["k"], record["p"]
    costs = [r["costs"] for r in ranks]
    mean = dataclasses.replace(costs[0], f=statistics.fmean(c.f for c in costs), b=statistics.fmean(c.b for c in costs),
                               seq_weights=tuple(statistics.fmean(c.seq_weights[j] for c in costs) for j in range(k))
                               if k > 1 else None)
    block = {"pipeline": {"schedule": record["schedule"], **({"seq_chunks": k} if k > 1 else {})}}
    schedule = parse_pipeline_config(block).make_schedule(p, ranks[0]["micro_batches"])
    return simulate(schedule, mean).bubble_rate


# ---- report ------------------------------------------------------------------------------
def _row(rec: dict[str, Any], base: dict[str, Any]) -> str:
    first = rec["ranks"][0]
    p, k, m = rec["p"], rec["k"], first["micro_batches"]
    step = statistics.median(first["step_s"])
    peaks = [r["peaks"]["activation"] for r in rec["ranks"]]
    base_peaks = [r["peaks"]["activation"] for r in base["ranks"]]
    sim_ratio = max(first["sim_peak"]) / max(base["ranks"][0]["sim_peak"])
    name = "1f1b" if k == 1 else f"seq1f1b k={k} {rec.get('partition', 'equal')}"
    measured = f"{rec['sim_bubble_measured']:.1%}" if "sim_bubble_measured" in rec else "-"
    cuts = next((c for r in rec["ranks"] for c in r.get("cuts", []) if len(c) == k + 1), None)
    if rec.get("partition", "equal") == "equal":  # the engine caches only compute-wise cuts
        cuts = tuple(range(0, rec["seq_len"] + 1, rec["seq_len"] // k))
    lengths = "/".join(str(b - a) for a, b in zip(cuts, cuts[1:])) if cuts and k > 1 else "-"
    return (f"| {p} | {name} | {lengths} | {step:.2f} | {first['tokens_per_step'] / step:,.0f} | {first['sim_bubble']:.1%} "
            f"| {measured} | {(p - 1) / (k * m + p - 1):.1%} | {' / '.join(f'{b / MIB:.1f}' for b in peaks)} | {max(peaks) / MIB:.1f} "
            f"| {max(peaks) / max(base_peaks):.2f}x | {sim_ratio:.2f}x | {first['losses'][-1]:.4f} |")


def render(records: list[dict[str, Any]], commit: str, loads: dict[str, str] | None = None) -> str:
    """The markdown page: the table, and how it was made (``loads``: launch name -> load average)."""
    seq_len = records[0]["seq_len"]
    lines = [
        "# Seq1F1B against 1F1B on long sequences, equal and compute-wise chunks",
        "",
        f"The recipe's tiny Llama (hidden 64, 8 blocks, 4 heads, SDPA), {seq_len}-token sequences, 8 micro-batches",
        "of 4 rows per step (`ds_configs/1f1b.json`, `ds_configs/seq1f1b.json` with `seq_chunks` = k), fp32.",
        f"**Device: CPU, gloo, {_cores()} cores shared by all ranks** ({platform.machine()}, torch {torch.__version__},",
        f"commit {commit}). Step times are CPU figures, not GPU ones. With more ranks than cores (p=4), a rank's",
        "idle time is spent by another rank, so the wall clock cannot show the smaller bubble, and k times more",
        "passes cost k times the per-pass host overhead.",
        "",
        "Peak activations: `engine.peak_activation_bytes` of one measured step, per pipeline rank: the bytes",
        "autograd keeps for backward, plus the keys/values a stage keeps for a micro-batch's later chunks",
        "(K/V included). `equal` chunks have equal lengths; `compute` chunks equal causal cost (`pipeline.seq_partition`),",
        "so later chunks are shorter. Simulated bubble: with unit pass costs (every chunk alike), and with the passes'",
        "measured costs (one step timing every F and backward per chunk: with equal lengths the later chunks, whose",
        "attention reads a longer prefix, take longer).",
        "",
        "| p | schedule | chunk lengths | step (s) | tokens/s | simulated bubble, unit costs | simulated bubble, measured costs "
        "| (p-1)/(k·m+p-1) | peak activations per rank (MiB) | busiest rank (MiB) | busiest vs 1F1B | simulated vs 1F1B "
        "| loss, last step |",
        "|--:|---|---|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|",
    ]
    for p in sorted({r["p"] for r in records}):
        group = [r for r in records if r["p"] == p]
        base = next(r for r in group if r["k"] == 1)
        lines += [_row(r, base) for r in sorted(group, key=lambda r: (r["k"], r.get("partition", "equal") != "equal"))]
    if loads:
        # Other work on the shared cores shows up as step time, not as memory.
        lines += ["", "Load average (1, 5, 15 min) before -> after each launch: "
                  + "; ".join(f"{name}: {load}" for name, load in loads.items()) + "."]
    return "\n".join(lines) + "\n"


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.mode == "run":
        _run(args)
        return
    records = [json.loads(line) for path in args.inputs for line in path.read_text().splitlines() if line.strip()]
    # benchmarks/run.sh writes each launch's load average next to its lines.
    loads = {path.stem: path.with_name(f"load_{path.stem}.txt").read_text().strip() for path in args.inputs
             if path.with_name(f"load_{path.stem}.txt").exists()}
    args.md.parent.mkdir(parents=True, exist_ok=True)
    args.md.write_text(render(records, args.commit, loads))
    print(args.md.read_text())


if __name__ == "__main__":
    main()
