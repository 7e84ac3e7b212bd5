"""The engine's host cost at p=2 against DeepSpeed's own PipelineEngine (issue 28, parts b and c).

``make bench-host`` (after ``host_stage.py``); alone::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 benchmarks/host_engine.py \\
        --out benchmarks/results/raw/host_engine.jsonl --md benchmarks/results/host_engine.md

The recipe's tiny Llama (``recipes/train_hf.py --size tiny``: hidden 64, 8 blocks, 4 heads, FFN
176, byte vocabulary) with sequences of 64 and the configs of ``ds_configs/`` (AdamW, clipping,
8 micro-batches of 4 rows) on 2 gloo ranks of one thread each: every kernel takes microseconds,
so what a rank spends is host work (Python, dispatcher, autograd, transfers), the regime where
an engine's own per-instruction cost shows. One engine per schedule (stock DeepSpeed 1F1B, and
ds_vshape's 1f1b, zb-h1, zb-h2, v-zb, v-half and seq1f1b with 2 sequence chunks; ``NAME+profile``
adds ``partition_method: profile``), all built first; then the engines take turns step by step,
each step framed by barriers, so that a slow spell of the machine (other load) falls on all of
them alike. The activation meter stays off (its hooks are a measurement, not the engine's cost).

Per rank and step it records, for every instruction type, the calls, their wall time and the
main thread's CPU time (``time.thread_time``): CPU time is what the host spent, which other load
on the machine inflates far less than wall time. (b) compares the CPU time per call of each
instruction type with DeepSpeed's; (c) compares whole steps (median step time, tokens/s, the
busiest rank's CPU per step). Rank 0 appends one JSON line per schedule and round to ``--out``;
``--md`` renders them (``report_host_engine.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch sizes its thread pool

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import deepspeed  # noqa: E402

import ds_vshape  # noqa: E402
from ds_vshape.schedules import get_info  # noqa: E402
from recipes.cores import this_rank  # noqa: E402
from recipes.corpus import DEFAULT_DATA, ByteTokenizer, batches, load_tokens  # noqa: E402
from benchmarks.common import append_jsonl, cpu_model, git_commit  # noqa: E402
from benchmarks.report_host_engine import PASSES, write_report  # noqa: E402
from recipes.train_hf import build_module  # noqa: E402

__all__ = ["SCHEDULES", "GcClock", "HandlerClock", "build", "main", "stage_layers"]

SCHEDULES = ("deepspeed-1f1b", "1f1b", "zb-h1", "zb-h1+fused", "zb-h2", "zb-h2+fused", "v-zb", "v-zb+fused", "v-zb+auto",
             "v-zb+measure", "v-half", "seq1f1b")
SEQ_CHUNKS = 2  # seq1f1b's sequence chunks here (its config's default is 4)
# ``--schedules v-zb+profile``: the schedule with ``partition_method: profile``. A V placement puts
# the embedding, the LM head and the loss on rank 0; the recipe's parameter-count cut does not
# see what they cost, a measured one does (README "Measured decisions").
PROFILE = "+profile"
# ``--schedules zb-h2+fused``: the schedule with ``fuse_idle_w: true`` (a W that fills no bubble runs fused with its B).
FUSED = "+fused"
# ``--schedules v-zb+auto``: ``"schedule": "auto"`` with that schedule its only candidate: each round's engine measures
# F, B and W in its untimed steps, then runs the schedule generated for the measured costs (v-zb orders for them).
AUTO = "+auto"
# ``--schedules v-zb+measure``: the schedule with ``pass_costs: "measure"``: each round's engine runs its equal-cost
# order in its untimed steps, measuring F, B and W, then its order for the measured costs.
MEASURE = "+measure"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", nargs="*", default=list(SCHEDULES), help="names of ds_configs/ (deepspeed-1f1b: stock DeepSpeed)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per engine and round")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per engine and round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of fresh engines; the report takes every round's steps")
    ap.add_argument("--out", type=Path, required=True, help="JSONL, one line per schedule and round (rank 0 appends)")
    ap.add_argument("--md", type=Path, help="render the report here at the end (rank 0)")
    return ap.parse_args(argv)


# ---- engines --------------------------------------------------------------------------------
def config_of(schedule: str, *, seq_len: int) -> dict[str, Any]:
    base = schedule.split("+")[0]
    config = json.loads((ROOT / "ds_configs" / f"{base}.json").read_text())
    if FUSED in schedule:
        config["pipeline"] = {**config["pipeline"], "fuse_idle_w": True}
    if AUTO in schedule:
        config["pipeline"] = {**config["pipeline"], "schedule": "auto", "auto_candidates": [base],
                              "auto_placement": get_info(base).placement}
    if MEASURE in schedule:
        config["pipeline"] = {**config["pipeline"], "pass_costs": "measure"}
    if base == "seq1f1b":
        config["pipeline"] = {**config["pipeline"], "seq_chunks": SEQ_CHUNKS}
    if PROFILE in schedule:
        sample = {"shape": [config["train_micro_batch_size_per_gpu"], seq_len], "dtype": "int64", "high": ByteTokenizer().vocab_size}
        config["pipeline"] = {**config["pipeline"], "partition_method": "profile", "profile_sample": {"inputs": sample}}
    return config


def build(schedule: str, seq_len: int, p: int) -> tuple[Any, int]:
    """The engine ``train_hf.py`` builds for this config (the recipe's tiny Llama), and its tokens per step."""
    tok = ByteTokenizer()
    recipe = argparse.Namespace(model="llama", size="tiny", seq_len=seq_len, attn_implementation="sdpa", seed=1234)
    module = build_module(recipe, tok.vocab_size, p)
    config = config_of(schedule, seq_len=seq_len)
    params = [q for q in module.parameters() if q.requires_grad]
    engine, *_ = ds_vshape.initialize(model=module, model_parameters=params, config=config)
    if hasattr(engine, "measure_memory"):
        engine.measure_memory = False  # its saved-tensor hooks measure memory; they are not the engine's cost
    tokens = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * seq_len
    return engine, tokens


@dataclass
class HandlerClock:
    """Calls, wall and main-thread CPU seconds per instruction type, over one step; for the passes also
    calls and CPU seconds per model stage (``Name@stage``: a V placement runs two stages per rank)."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    wall: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    cpu: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    stages: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))

    def reset(self) -> None:
        self.calls.clear()
        self.wall.clear()
        self.cpu.clear()
        self.stages.clear()

    def instrument(self, engine: Any) -> None:
        """Time every handler: both engines dispatch through ``self._INSTRUCTION_MAP``, so an
        instance attribute of that name takes precedence without touching the class."""
        engine._INSTRUCTION_MAP = {cls: self._timed(fn, cls.__name__) for cls, fn in type(engine)._INSTRUCTION_MAP.items()}

    def _timed(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        per_stage = name in PASSES

        def handler(engine: Any, *args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(engine, *args, **kwargs)
            finally:
                spent = time.thread_time() - cpu
                self.cpu[name] += spent
                self.wall[name] += time.perf_counter() - wall
                self.calls[name] += 1
                if per_stage:  # ds_vshape's passes name their stage; DeepSpeed's run the rank's one
                    entry = self.stages[f"{name}@{kwargs.get('stage', engine.stage_id)}"]
                    entry[0] += 1
                    entry[1] += spent

        return handler

    def snapshot(self) -> dict[str, list[float]]:
        return {name: [self.calls[name], self.wall[name], self.cpu[name]] for name in self.calls}

    def stage_snapshot(self) -> dict[str, list[float]]:
        """``Name@stage`` -> [calls, CPU seconds] for the passes."""
        return {key: list(value) for key, value in self.stages.items()}


class GcClock:
    """Python's collections during a step, per generation: how many and the seconds they took
    (``gc.callbacks``). A collection of the oldest generation walks every tracked object the
    process holds: torch's, DeepSpeed's and transformers' module objects included."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.collected = 0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def reset(self) -> None:
        self.count, self.seconds, self.collected = [0, 0, 0], [0.0, 0.0, 0.0], 0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start
            self.collected += info["collected"]

    def snapshot(self) -> dict[str, Any]:
        return {"count": list(self.count), "seconds": list(self.seconds), "collected": self.collected}

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


class Runner:
    """One schedule's engine, clock and data stream, stepped one step at a time (engines take turns)."""

    def __init__(self, schedule: str, args: argparse.Namespace, p: int, collector: GcClock) -> None:
        self.schedule = schedule
        self.clock, self.collector = HandlerClock(), collector
        self.engine, self.tokens = build(schedule, args.seq_len, p)
        self.clock.instrument(self.engine)
        train_ids, _ = load_tokens(DEFAULT_DATA, ByteTokenizer())
        self.data = batches(train_ids, batch=self.engine.train_micro_batch_size_per_gpu(), seq_len=args.seq_len, seed=1234)
        self.steps: list[dict[str, Any]] = []

    def step(self, *, timed: bool) -> None:
        """One training step between two barriers; every rank calls it."""
        self.clock.reset()
        dist.barrier()
        self.collector.reset()
        switches = _switches()
        wall, cpu, proc = time.perf_counter(), time.thread_time(), time.process_time()
        loss = float(self.engine.train_batch(self.data).item())
        local, cpu, proc = time.perf_counter() - wall, time.thread_time() - cpu, time.process_time() - proc
        blocked, preempted = (after - before for after, before in zip(_switches(), switches))
        collections = self.collector.snapshot()
        dist.barrier()
        if timed:
            self.steps.append({"step_s": time.perf_counter() - wall, "local_s": local, "cpu_s": cpu, "process_cpu_s": proc,
                               "blocked": blocked, "preempted": preempted, "loss": loss, "load1": _load1(),
                               "handlers": self.clock.snapshot(), "stage_passes": self.clock.stage_snapshot(),
                               "gc": collections})


def _switches() -> tuple[int, int]:
    """The main thread's context switches so far: (voluntary: it blocked, involuntary: it was preempted).

    Each block is a point where the thread must be scheduled again before it goes on: on a machine
    busy with other work, that wait, not the host work, is what stretches a step."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)  # Linux has per-thread figures
    usage = resource.getrusage(who)
    return usage.ru_nvcsw, usage.ru_nivcsw


def _load1() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# ---- run ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    collector = GcClock()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))
    rank, p = dist.get_rank(), dist.get_world_size()
    cpus: list[Any] = [None] * p
    dist.all_gather_object(cpus, this_rank())
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(args.out, {"kind": "setting", "p": p, "seq_len": args.seq_len, "ranks": [vars(c) for c in cpus],
                                "cpu": _cpu_model(), "load_before": _loadavg(), "versions": _versions(),
                                "commit": git_commit(" (with uncommitted changes to ds_vshape)")})
    for round_ in range(args.rounds):
        runners = [Runner(s, args, p, collector) for s in args.schedules]
        for i in range(args.warmup + args.steps):
            for runner in runners:
                runner.step(timed=i >= args.warmup)
        for runner in runners:
            _report(runner, round_, args.out, rank, p)
        del runners
        gc.collect()
    if rank == 0:
        append_jsonl(args.out, {"kind": "end", "load_after": _loadavg()})
        if args.md is not None:
            write_report(args.out, args.md)
    dist.barrier()
    dist.destroy_process_group()  # gloo's threads can abort the process at interpreter teardown


def stage_layers(module: Any) -> dict[str, str]:
    """Model stage -> the layers the engine's cut gives it ("embedding + 4 blocks"): ds_vshape's module
    names every model stage's bounds (``stage_parts``), DeepSpeed's one stage per rank (``parts``)."""
    bounds = getattr(module, "stage_parts", None) or module.parts
    specs = module._layer_specs
    return {str(s): _describe([_layer_name(specs[i]) for i in range(bounds[s], bounds[s + 1])]) for s in range(len(bounds) - 1)}


def _layer_name(spec: Any) -> str:
    name = getattr(getattr(spec, "typename", None), "__name__", type(spec).__name__)
    return {"HFEmbedding": "embedding", "HFDecoderBlock": "block", "HFFinalNorm": "final norm", "HFLMHead": "LM head"}.get(name, name)


def _describe(names: list[str]) -> str:
    parts: list[str] = []
    for name in dict.fromkeys(names):  # in order of first appearance
        n = names.count(name)
        parts.append(name if n == 1 else f"{n} {name}s")
    return " + ".join(parts) or "none"


def _report(runner: Runner, round_: int, out: Path, rank: int, p: int) -> None:
    ranks: list[Any] = [None] * p
    dist.all_gather_object(ranks, runner.steps)
    if rank == 0:
        ran = _ran(runner.engine)
        append_jsonl(out, {"kind": "steps", "schedule": runner.schedule, "round": round_, "tokens_per_step": runner.tokens,
                           "layers": stage_layers(runner.engine.module), "ranks": ranks, "ran": ran})
        med = sorted(s["step_s"] for s in ranks[0])[len(ranks[0]) // 2]
        print(f"[host_engine round {round_}] {runner.schedule:15s} step {1e3 * med:7.1f} ms  "
              f"{runner.tokens / med:9,.0f} tok/s  ran {ran}", flush=True)


def _ran(engine: Any) -> str:
    """The schedule the engine ran its timed steps with: for auto, its choice; a greedy order's policy in brackets."""
    schedule = getattr(engine, "schedule", None)
    if schedule is None:
        return "DeepSpeed TrainSchedule"
    picked = schedule.params.get("picked")
    return f"{schedule.name} ({picked})" if picked else schedule.name


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def _cpu_model() -> str:
    import platform  # noqa: PLC0415

    return cpu_model() or platform.processor() or platform.machine()


def _versions() -> dict[str, str]:
    import transformers  # noqa: PLC0415

    return {"torch": torch.__version__, "deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0]}


if __name__ == "__main__":
    main()
