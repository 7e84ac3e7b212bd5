"""What building the rotary embedding once per pass costs a stage's forward (issue 28: host cost per pass).

    OMP_NUM_THREADS=1 python benchmarks/rotary_passes.py     # writes benchmarks/results/rotary_passes.md

A schedule that runs a rank's blocks in more passes (V placement, interleaving) pays every fixed
cost of a pass more often. The rotary output is one: the blocks of a pass share it
(``ds_vshape.hf.pass_memo``), and since its positions are 0..s-1 in every pass, later passes may
take the latest pass's (``rotary_across_passes``) instead of building it again. Here a stage of
``host_stage.py`` (tiny Llama blocks, one thread: the host-bound regime) runs forward passes, each
on fresh inputs as the engine's passes get them (a received key mask is a new tensor, so the pass
memo is new too), in two ways taking turns in a fresh random order each rep: the rotary output
built in every pass (``Runtime.ROTARY_ACROSS_PASSES`` off, as before) and taken from the latest
pass. Median ms per forward, and the median of the two ways' difference rep by rep (a pair runs
back to back, so it holds while the machine's speed drifts), for stages of 1, 2 and 4 blocks (a V
placement halves a rank's blocks per pass).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads its thread pools

import argparse  # noqa: E402
import gc  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.host_stage import SEED, Stage, build, run_stage, write_report  # noqa: E402
from ds_vshape.hf.tracing import Runtime  # noqa: E402

__all__ = ["WAYS", "main", "measure"]

WAYS = {"built per pass": False, "taken from the latest pass": True}


def fresh_inputs(stage: Stage) -> tuple[Any, ...]:
    """The stage's inputs as a received micro-batch brings them: new tensors, the key mask included."""
    hidden, *rest = stage.x0
    return (hidden.detach().clone().requires_grad_(), *(t.clone() if isinstance(t, torch.Tensor) else t for t in rest))


def measure(stage: Stage, *, reps: int, warmup: int) -> dict[str, float]:
    """Median seconds per forward pass, per way, and (``saved``) the median of the reps' differences."""
    samples: dict[str, list[float]] = {way: [] for way in WAYS}
    modules, order = stage.modules["forward"], random.Random(SEED)
    gc.collect()
    gc.disable()
    try:
        for rep in range(warmup + reps):
            for way in order.sample(list(WAYS), len(WAYS)):
                Runtime.ROTARY_ACROSS_PASSES = WAYS[way]
                x = fresh_inputs(stage)
                start = time.perf_counter()
                out = run_stage(modules, x)
                spent = time.perf_counter() - start
                del out, x
                if rep >= warmup:
                    samples[way].append(spent)
            if rep % 100 == 0:  # nothing here makes cycles; a full collection walks every library's objects
                gc.collect()
    finally:
        Runtime.ROTARY_ACROSS_PASSES = True
        gc.enable()
    before, after = samples.values()
    return {**{way: statistics.median(times) for way, times in samples.items()},
            "saved": statistics.median(b - a for b, a in zip(before, after))}


def render(rows: dict[int, dict[str, float]], *, setting: str, command: str) -> str:
    before, after = WAYS
    lines = ["# The rotary embedding per pass (host-bound: tiny shapes, one thread)", "",
             f"Measured on: {setting}.", f"Command: `{command}`", "",
             "Median ms per forward pass (autograd recording, as in training), each pass on fresh inputs; the rotary",
             f"output {before} (as before) or {after}.", "",
             f"| blocks per pass | F, rotary {before} | F, rotary {after} | saved per pass (µs, median of pairs) | ratio |",
             "|--:|--:|--:|--:|--:|"]
    for blocks, m in rows.items():
        lines.append(f"| {blocks} | {m[before] * 1e3:.3f} | {m[after] * 1e3:.3f} | {m['saved'] * 1e6:.0f} "
                     f"| {m[after] / m[before]:.3f}x |")
    return "\n".join(lines + [""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, nargs="*", default=[1, 2, 4], help="stages of these many decoder blocks")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--reps", type=int, default=500, help="timed passes per way")
    parser.add_argument("--warmup", type=int, default=30, help="untimed passes per way first")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "rotary_passes.md", help="report path")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = {}
    for blocks in args.blocks:
        torch.manual_seed(SEED)
        stage = build(blocks=blocks, seq_len=args.seq_len, micro_batch=args.micro_batch)
        rows[blocks] = measure(stage, reps=args.reps, warmup=args.warmup)
    setting = (f"{platform.processor() or platform.machine()} CPU, 1 thread, torch {torch.__version__}, fp32; the recipe's tiny "
               f"Llama blocks, micro-batch {args.micro_batch}x{args.seq_len} tokens, median of {args.reps} reps")
    command = "OMP_NUM_THREADS=1 python benchmarks/rotary_passes.py " + " ".join(argv if argv is not None else sys.argv[1:])
    return write_report(render(rows, setting=setting, command=command.strip()), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
