"""Where one stage's host time goes, pass by pass: Python's profiler over each way's F, B and W.

``host_stage.py`` gives each pass's time; this names what the host spends it on. Same stage and
options (``--device cuda --dtype bf16 --shape ...`` for a GPU)::

    OMP_NUM_THREADS=1 python benchmarks/host_profile.py --out /tmp/host_profile.md

After ``--warmup`` micro-batches of every way, ``--reps`` more run with ``cProfile`` switched on
during one pass at a time (every pass of every way gets its own reps, so a profiled pass never
shares a micro-batch with another profiled one). Per way and pass, the functions with the most
own time are listed per micro-batch: calls and own milliseconds. The profiler adds its own cost to
every Python call, so read the shares and the call counts, not the milliseconds, as the host's.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads its thread pools

import cProfile  # noqa: E402
import gc  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import host_stage  # noqa: E402

__all__ = ["main", "profile_pass"]

PROFILED = {"fused": ("F", "B"), "torch split": ("B", "W"), "ds_vshape": ("F", "B", "W")}


class _ProfilingClock(host_stage._Clock):
    """host_stage's clock, with the profiler on during the one pass it is told to profile."""

    def __init__(self, device: torch.device, target: str, profiler: cProfile.Profile) -> None:
        super().__init__(device)
        self.target, self.profiler = target, profiler

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        if name != self.target:
            return super().__call__(name, fn)
        self.profiler.enable()
        try:
            return super().__call__(name, fn)
        finally:
            self.profiler.disable()


def profile_pass(stage: host_stage.Stage, way: str, target: str, *, reps: int) -> pstats.Stats:
    """``reps`` micro-batches of ``way`` with the profiler on during pass ``target``."""
    profiler = cProfile.Profile()
    for _ in range(reps):
        clock = _ProfilingClock(stage.device, target, profiler)
        host_stage._passes(stage, way, stage.modules[way], stage.inputs(), clock)
        clock.finish()
        for m in stage.modules[way]:
            m.zero_grad(set_to_none=True)
    return pstats.Stats(profiler)


def _rows(stats: pstats.Stats, *, reps: int, top: int) -> list[str]:
    entries = stats.stats  # type: ignore[attr-defined]  # (file, line, name) -> (prim calls, calls, own s, cum s, callers)
    total = sum(v[2] for v in entries.values())
    ranked = sorted(entries.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    rows = [f"| {Path(f).name}:{line} {name} | {calls / reps:.0f} | {own / reps * 1e3:.3f} | {own / total:.0%} |"
            for (f, line, name), (_, calls, own, _cum, _callers) in ranked]
    calls = sum(v[1] for v in entries.values()) / reps
    return [f"{calls:.0f} Python-visible calls per micro-batch, {total / reps * 1e3:.2f} ms own time under the profiler.",
            "", "| function | calls | own ms | share |", "|---|--:|--:|--:|", *rows, ""]


def main(argv: list[str] | None = None) -> int:
    parser = host_stage.shape_options(host_stage.stage_parser(__doc__.split("\n\n")[0], reps=20))
    parser.add_argument("--top", type=int, default=15, help="functions listed per pass")
    parser.add_argument("--out", type=Path, required=True, help="report path")
    args = parser.parse_args(argv)
    stage = host_stage.build_from(args)
    host_stage.measure(stage, reps=1, warmup=args.warmup)  # warm every way (caches, allocator, lazy init)
    command = "OMP_NUM_THREADS=1 python benchmarks/host_profile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# Where one stage's host time goes, per pass (cProfile)", "", f"Command: `{command.strip()}`",
             f"Stage: {args.blocks} blocks, micro-batch {args.micro_batch}x{args.seq_len}, {args.dtype} on {args.device}; "
             f"{args.reps} micro-batches per profiled pass.", ""]
    gc.disable()
    try:
        for way, targets in PROFILED.items():
            for target in targets:
                stats = profile_pass(stage, way, target, reps=args.reps)
                lines += [f"## {way}: {target}", "", *_rows(stats, reps=args.reps, top=args.top)]
                gc.collect()
    finally:
        gc.enable()
    return host_stage.write_report("\n".join(lines), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
