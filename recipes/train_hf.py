"""Train a Hugging Face causal LM with any pipeline schedule, on CPU or GPU.

Run it with either launcher; the schedule is chosen by the JSON config alone::

    deepspeed --num_gpus 4 recipes/train_hf.py --deepspeed_config ds_configs/v-half.json
    torchrun --nproc_per_node 4 recipes/train_hf.py --deepspeed_config ds_configs/1f1b.json

On a machine without GPUs set ``DS_ACCELERATOR=cpu`` (gloo is then used). With no other
argument it trains the embedded default: a tiny Llama (hidden 64, 8 decoder blocks, 4
heads) made from a config, on ``recipes/data/coriolanus.txt`` (the opening of
Shakespeare's *Coriolanus*, public domain), tokenized to raw UTF-8 bytes (vocab 256).
The model is cut into ``world_size`` pipeline ranks (pure pipeline parallelism), or into
``--pipeline-stages`` ranks with the rest as data-parallel replicas (each replica reads its
own data stream; ZeRO-2/3 then shard across them).

Every rank builds the same data iterator (same seed); DeepSpeed reads it only on the
ranks that hold the first stage (input_ids) or the last (labels). Labels are the input
ids themselves: the loss shifts them, as transformers does for ``labels=``.

``--steps`` is the total number of optimizer steps: ``--resume`` continues from the
step the checkpoint was saved at, and the data iterator continues where it stopped
(micro-batch i depends only on the seed and i). ``--save-every N`` also saves every N steps,
so a run killed midway resumes from its last checkpoint with the losses it would have had.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    # Lets the recipe run from a plain checkout, without installing ds_vshape.
    sys.path.insert(0, str(REPO_ROOT))

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import GPT2Config, LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config  # noqa: E402

import ds_vshape  # noqa: E402
from ds_vshape.config import parse_pipeline_config  # noqa: E402
from ds_vshape.hf import pipeline_layers  # noqa: E402
from ds_vshape.schedules import Schedule, generate, get_info, simulate  # noqa: E402
from recipes.corpus import DEFAULT_DATA, ByteTokenizer, batches, load_tokens, tokenizer_for  # noqa: E402
from recipes.cores import CpuShare, cpu_share, this_rank  # noqa: E402

__all__ = [
    "ByteTokenizer",
    "DEFAULT_DATA",
    "Job",
    "PRESETS",
    "RunSummary",
    "StepRecord",
    "batches",
    "build_parser",
    "check_seq_len",
    "describe_schedule",
    "load_tokens",
    "main",
    "preset_config",
    "report",
    "run_steps",
    "seed_layer",
    "setup",
    "summary_path",
    "train",
]

PRESETS = ("llama", "gpt2", "mistral", "qwen2")

# Preset sizes (hidden, blocks, heads, FFN). "tiny": well under a second per step on 2 CPU cores,
# yet a real transformer; 8 blocks so that V / interleaved schedules (2 model stages per rank)
# still fit 4 ranks. "compute": large enough that the passes, not the host's per-call work,
# take a CPU rank's time (make train and make bench-real use it at p=2).
SIZES = {"tiny": (64, 8, 4, 176), "compute": (384, 8, 6, 1056)}
HIDDEN, BLOCKS, HEADS, FFN = SIZES["tiny"]


# ---- command line ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)),
                        help="set by the deepspeed launcher; torchrun passes LOCAL_RANK instead")
    parser.add_argument("--model", default="llama",
                        help=f"a tiny preset ({', '.join(PRESETS)}) built from a config, or a local save_pretrained directory")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="UTF-8 text file to train on")
    parser.add_argument("--steps", type=int, default=60, help="total optimizer steps (a resumed run continues up to this)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny",
                        help="preset model size: tiny (hidden 64) or compute (hidden 384, FFN 1056, 6 heads); 8 blocks either way")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--seed", type=int, default=1234, help="model init and data order (identical on every rank)")
    parser.add_argument("--attn-implementation", default="sdpa", help="transformers attention kernel for preset/directory models")
    parser.add_argument("--metrics-out", type=Path, help="JSONL file, one object per step (rank 0 writes it)")
    parser.add_argument("--save", type=Path, help="save a DeepSpeed checkpoint here at the end")
    parser.add_argument("--save-every", type=int, metavar="N",
                        help="also save to --save after every N steps, so that a killed run resumes from the last one")
    parser.add_argument("--resume", type=Path, help="load a DeepSpeed checkpoint from here first")
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out loss at the end")
    parser.add_argument("--pipeline-stages", type=int, metavar="P",
                        help="pipeline ranks (default: all); world size / P data-parallel replicas")
    parser.add_argument("--meter-every-step", action="store_true",
                        help="measure activation memory on every step (default: the first and the last; the meter's "
                             "hooks cost host time, and metered steps stay out of the compared step times)")
    return deepspeed.add_config_arguments(parser)


# ---- model -----------------------------------------------------------------------------------
def preset_config(name: str, *, vocab_size: int, seq_len: int, size: str = "tiny") -> PretrainedConfig:
    """A small untied config of the named family and size (dropout off, so schedules compare exactly)."""
    HIDDEN, BLOCKS, HEADS, FFN = SIZES[size]  # noqa: N806 (the module's names, per size)
    positions = max(seq_len, 128)
    common: dict[str, Any] = {"vocab_size": vocab_size, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": None}
    if name == "gpt2":
        return GPT2Config(n_embd=HIDDEN, n_layer=BLOCKS, n_head=HEADS, n_positions=positions,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    families = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}
    if name not in families:
        raise ValueError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a local directory")
    # Mistral and Qwen2 get grouped-query attention (2 KV heads), as the real ones have.
    kv_heads = HEADS if name == "llama" else HEADS // 2
    return families[name](hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=BLOCKS, num_attention_heads=HEADS,
                          num_key_value_heads=kv_heads, max_position_embeddings=positions, **common)


def build_module(args: argparse.Namespace, vocab_size: int, stages: int) -> PipelineModule:
    source: Any = args.model if Path(args.model).is_dir() else preset_config(args.model, vocab_size=vocab_size, seq_len=args.seq_len,
                                                                                  size=getattr(args, "size", "tiny"))
    layers, loss_fn = pipeline_layers(source, attn_implementation=args.attn_implementation)
    # seed_layers: layer i gets seed + i whichever rank builds it, so every schedule
    # (each places layers differently) starts from the same weights.
    return PipelineModule(layers=layers, loss_fn=loss_fn, num_stages=stages, partition_method="parameters",
                          seed_layers=True, base_seed=args.seed, seed_fn=seed_layer)


def seed_layer(seed: Any) -> None:
    # DeepSpeed's own seeder hands numpy integers (from its partitioner) to random.seed(),
    # which rejects them; HF init only draws from torch's generator anyway.
    torch.manual_seed(int(seed))


# ---- metrics ---------------------------------------------------------------------------------
@dataclass
class StepRecord:
    """One line of --metrics-out."""

    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    lr: float
    peak_activation_bytes: list[int | None]
    # The activation meter ran in this step: its saved-tensor hooks cost host time that the stock
    # engine does not pay, so compare_runs.py leaves metered steps out of the medians.
    metered: bool = True


@dataclass
class RunSummary:
    """What the end-of-run report says; also written next to the metrics file."""

    schedule: str
    ranks: int
    micro_batches: int
    model: str
    size: str = "tiny"
    world: int = 0  # processes of the job (pipeline ranks x data-parallel replicas)
    cores: int = 0  # CPU cores the ranks may use on the most loaded machine (0: unknown), to say what the step times measured
    cpu_demand: int = 0  # cores the ranks on that machine can keep busy together (their compute threads)
    rank_cores: list[int] = field(default_factory=list)  # per rank: cores it can keep busy (recipes/cores.py)
    device: str = "cpu"
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    sim_bubble_rate: float = 0.0
    sim_peak_memory: list[float] = field(default_factory=list)
    peak_activation_bytes: list[int | None] = field(default_factory=list)
    val_loss: float | None = None
    wall_s: float = 0.0


def summary_path(metrics: Path) -> Path:
    """``run.jsonl`` -> ``run.summary.json``."""
    return metrics.with_name(metrics.stem + ".summary.json")


def gather_peaks(engine: Any) -> list[int | None]:
    """This step's peak saved-activation bytes of every pipeline rank (None on stock DeepSpeed)."""
    mine = getattr(engine, "peak_activation_bytes", None)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def gather_cpu_share() -> CpuShare:
    """Every rank's compute threads and CPU affinity, summed per machine (a collective)."""
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, this_rank())
    return cpu_share(ranks)


def schedule_of(engine: Any) -> tuple[str, Schedule]:
    """The schedule that ran; stock DeepSpeed runs 1F1B, which our generator reproduces."""
    schedule = getattr(engine, "schedule", None)
    if schedule is not None:
        return schedule.name, schedule
    return "deepspeed-1f1b", generate("1f1b", engine.num_stages, engine.micro_batches)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


# ---- training --------------------------------------------------------------------------------
def init_distributed() -> None:
    # gloo on CPU, nccl/... on accelerators: DeepSpeed's accelerator knows which.
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())


def read_config(args: argparse.Namespace) -> dict[str, Any]:
    if not args.deepspeed_config:
        raise SystemExit("train_hf.py: --deepspeed_config is required (see ds_configs/)")
    with open(args.deepspeed_config) as fh:
        config: dict[str, Any] = json.load(fh)
    parse_pipeline_config(config)  # a bad schedule name fails here, on every rank alike
    return config


def check_seq_len(config: dict[str, Any], seq_len: int, source: str) -> None:
    """Refuse a ``--seq-len`` that the schedule's sequence chunks cannot cut into equal pieces.

    The engine would find out only inside the first step, on the first rank, while the others
    wait for its activations; here every rank stops before building anything.
    """
    parsed = parse_pipeline_config(config)
    if parsed.schedule is None or parsed.seq_partition == "compute":  # compute-wise chunks take any length
        return
    # auto measures and then runs every schedule with the config's seq_chunks (1 when absent);
    # a named schedule falls back to its own default (seq1f1b: 2).
    default = 1 if parsed.schedule == "auto" else get_info(parsed.schedule).default_seq_chunks
    k = parsed.seq_chunks or default
    if k > 1 and seq_len % k:
        which = f"pipeline.seq_chunks={k}" + ("" if parsed.seq_chunks else f" ({parsed.schedule}'s default)")
        below, above = seq_len - seq_len % k, seq_len - seq_len % k + k
        options = f"--seq-len {below} or {above}" if below else f"--seq-len {above}"
        raise SystemExit(f"train_hf.py: --seq-len {seq_len} is not a multiple of {which} in {source}: the engine cuts "
                         f"every sequence into {k} equal chunks; use {options}, set pipeline.seq_chunks to a divisor "
                         f"of {seq_len}, or set pipeline.seq_partition to \"compute\"")


def resume(engine: Any, directory: Path | None) -> int:
    """Load a checkpoint; returns the step it was saved at (0 without --resume)."""
    if directory is None:
        return 0
    path, client = engine.load_checkpoint(str(directory))
    if path is None:
        raise SystemExit(f"train_hf.py: no checkpoint found in {directory}")
    return int((client or {}).get("step", engine.global_steps))


def held_out_loss(engine: Any, val: torch.Tensor, args: argparse.Namespace, micro: int) -> float:
    it = batches(val, batch=micro, seq_len=args.seq_len, seed=args.seed + 1)
    return float(engine.eval_batch(it).item())


@dataclass
class Job:
    """Everything a run needs once the engine is built."""

    engine: Any
    train_ids: torch.Tensor
    val_ids: torch.Tensor
    summary: RunSummary
    micro: int  # rows per micro-batch
    gas: int  # micro-batches per step
    w_memory: float = 1.0  # the config's share of activation kept until W, for the simulator


def pipeline_stages(requested: int | None, world: int) -> int:
    """``--pipeline-stages``, checked against the world size before any engine exists."""
    if requested is None:
        return world
    if requested < 2 or world % requested:
        raise SystemExit(f"train_hf.py: --pipeline-stages {requested} must be at least 2 and divide the {world} ranks "
                         f"(the rest are data-parallel replicas); use one of "
                         f"{', '.join(str(p) for p in range(2, world + 1) if world % p == 0)}")
    return requested


def setup(args: argparse.Namespace) -> Job:
    # Fails early, on every rank alike, for a bad config or a --seq-len it cannot cut.
    check_seq_len(read_config(args), args.seq_len, args.deepspeed_config)
    world = dist.get_world_size()
    stages = pipeline_stages(args.pipeline_stages, world)
    tokenizer = tokenizer_for(args.model)
    train_ids, val_ids = load_tokens(args.data, tokenizer)
    torch.manual_seed(args.seed)
    module = build_module(args, tokenizer.vocab_size, stages)
    params = [p for p in module.parameters() if p.requires_grad]
    # The drop-in call: exactly what a deepspeed.initialize job passes (config via --deepspeed_config).
    engine, _, _, _ = ds_vshape.initialize(args=args, model=module, model_parameters=params)
    # The meter is switched on per step (run_steps): only on the steps that report memory.
    name, schedule = schedule_of(engine)
    # Predict with the same share of activation held until W that the schedule was planned for.
    kept = parse_pipeline_config(read_config(args)).w_memory
    share = gather_cpu_share()
    summary = RunSummary(schedule=name, ranks=stages, micro_batches=engine.micro_batches, model=args.model,
                         size=args.size, cores=share.cores, cpu_demand=share.demand, rank_cores=list(share.rank_cores),
                         device=engine.device.type, world=world, peak_activation_bytes=[None] * world)
    describe_schedule(summary, schedule, kept_until_w=kept)
    return Job(engine, train_ids, val_ids, summary, engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
               w_memory=kept)


def describe_schedule(summary: RunSummary, schedule: Schedule, *, kept_until_w: float, name: str | None = None) -> None:
    """Put the schedule's name and simulated bubble and peak memory into the summary."""
    sim = simulate(schedule, kept_until_w=kept_until_w)
    summary.sim_bubble_rate, summary.sim_peak_memory = sim.bubble_rate, list(sim.peak_memory)
    if name is not None:
        summary.schedule = name


def run_steps(job: Job, args: argparse.Namespace, start: int) -> None:
    """Train from step ``start + 1`` to ``args.steps``, logging and recording every step."""
    rank = dist.get_rank()
    # Replica 0 keeps the documented stream; other data-parallel replicas read their own.
    seed = args.seed + 10_007 * job.engine.grid.get_data_parallel_rank()
    data = batches(job.train_ids, batch=job.micro, seq_len=args.seq_len, seed=seed, start=start * job.gas)
    metrics = _open_metrics(args.metrics_out, rank, append=start > 0)
    # Rank 0 logs; its bar draws only on a terminal (disable=None), so log files stay clean.
    bar = tqdm(total=args.steps, initial=start, disable=None, desc=job.summary.schedule, unit="step", dynamic_ncols=True) if rank == 0 else None
    tokens_per_step = job.micro * job.gas * args.seq_len * job.engine.dp_world_size
    for step in range(start + 1, args.steps + 1):
        metered = args.meter_every_step or step in (start + 1, args.steps)
        if hasattr(job.engine, "measure_memory"):  # stock DeepSpeed has no meter; its same steps count as metered
            job.engine.measure_memory = metered
        t0 = time.perf_counter()
        loss = float(job.engine.train_batch(data).item())
        dt = time.perf_counter() - t0
        peaks = gather_peaks(job.engine) if metered else [None] * dist.get_world_size()
        record = StepRecord(step, loss, dt, tokens_per_step / dt, _lr(job.engine), peaks, metered=metered)
        _log_step(record, bar, metrics, job.summary)
        if args.save is not None and args.save_every and step % args.save_every == 0 and step < args.steps:
            job.engine.save_checkpoint(str(args.save), client_state={"step": step})  # the end saves the last step
    if bar is not None:
        bar.close()
    if metrics is not None:
        metrics.close()


def train(args: argparse.Namespace) -> RunSummary:
    t_start = time.perf_counter()
    job = setup(args)
    run_steps(job, args, start=resume(job.engine, args.resume))
    choice = getattr(job.engine, "auto_choice", None)
    if choice is not None:  # "schedule": "auto" measured, then switched: report what it runs now
        describe_schedule(job.summary, schedule_of(job.engine)[1], kept_until_w=job.w_memory, name=f"auto: {choice.name}")
    if args.save is not None:
        job.engine.save_checkpoint(str(args.save), client_state={"step": args.steps})
    if not args.no_eval:
        job.summary.val_loss = held_out_loss(job.engine, job.val_ids, args, job.micro)
    job.summary.wall_s = time.perf_counter() - t_start
    return job.summary


def _lr(engine: Any) -> float:
    lrs = engine.get_lr()
    return float(lrs[0]) if lrs else float("nan")


def _open_metrics(path: Path | None, rank: int, *, append: bool) -> Any:
    if path is None or rank != 0:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("a" if append else "w")


def _log_step(record: StepRecord, bar: Any, metrics: Any, summary: RunSummary) -> None:
    # The summary reports the last step's peaks: the first step can differ (warm-up allocations).
    if record.metered:
        summary.peak_activation_bytes = record.peak_activation_bytes
    summary.steps.append(record.step)
    summary.losses.append(record.loss)
    summary.step_times_s.append(record.step_time_s)
    if metrics is not None:
        metrics.write(json.dumps(asdict(record)) + "\n")
        metrics.flush()
    if bar is not None:
        peak = max((p for p in record.peak_activation_bytes if p is not None), default=None)
        tqdm.write(f"step {record.step:4d} | loss {record.loss:.4f} | {record.step_time_s:.2f} s | "
                   f"{record.tokens_per_s:,.0f} tok/s | lr {record.lr:.2e} | max peak act {fmt_bytes(peak)}")
        bar.update(1)


# ---- report ----------------------------------------------------------------------------------
def report(summary: RunSummary) -> str:
    lines = [
        "=" * 72,
        f"schedule                 {summary.schedule}  ({summary.ranks} pipeline ranks x {summary.micro_batches} micro-batches)",
        f"model                    {summary.model}",
    ]
    if summary.losses:
        median = statistics.median(summary.step_times_s)
        lines.append(f"loss                     {summary.losses[0]:.4f} (step {summary.steps[0]}) -> {summary.losses[-1]:.4f} (step {summary.steps[-1]})")
        lines.append(f"median step time         {median:.3f} s")
    if summary.val_loss is not None:
        lines.append(f"held-out loss            {summary.val_loss:.4f}  (perplexity {math.exp(summary.val_loss):.2f} per byte)")
    lines.append(f"simulated bubble rate    {summary.sim_bubble_rate:.1%}")
    lines.append("simulated peak memory    " + ", ".join(f"r{r} {m:g}" for r, m in enumerate(summary.sim_peak_memory)) + "  (units of M_B)")
    lines.append("measured peak activation " + ", ".join(f"r{r} {fmt_bytes(b)}" for r, b in enumerate(summary.peak_activation_bytes)))
    lines.append(f"wall time (train())      {summary.wall_s:.1f} s")
    lines.append("=" * 72)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.save_every is not None and (args.save is None or args.save_every < 1):
        parser.error(f"--save-every {args.save_every} needs --save DIR and N >= 1 (the checkpoints go to --save)")
    init_distributed()
    summary = train(args)
    if dist.get_rank() == 0:
        print(report(summary), flush=True)
        if args.metrics_out is not None:
            summary_path(args.metrics_out).write_text(json.dumps(asdict(summary), indent=1) + "\n")
    dist.barrier()
    # Without this, gloo's threads can abort the process at interpreter teardown.
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
