"""Multi-step steady state on the asynchronous emulated device (issue 13, items 1 and 5).

One step measured alone pays the pipeline's start stagger; training runs steps back to
back, and whether step k+1 can start on rank 0 before the last rank has finished step k
decides what a zero-bubble schedule is worth. This runs ``--steps`` train steps with nothing
between them and measures the steady period: the device end of the last step minus that of
the first, over the steps in between (max over ranks).

Each case: a system (DeepSpeed 1F1B, ds_vshape, torch.distributed.pipelining), a schedule,
whether ds_vshape's post-validation is on, and the clipping threshold (0: off; otherwise
high enough never to clip, so the figure is the cost of the check itself). What waits where,
as on a GPU:

* every optimizer step makes the host wait for its own device (``start_async_device``'s hook);
* a global clipping norm is a reduction of device values: the host waits for its device
  first, then for the other ranks (DeepSpeed's and ds_vshape's ``clip_fp32_gradients``, and
  the global clip this script adds to the torch runner);
* post-validation's all-reduce of the step figures likewise starts once the device has
  produced them (``reduce_stats`` wrapped with a device synchronize), and is awaited only
  where ds_vshape awaits it (before the next step's first pass, when clipping is on);
* DeepSpeed's loss broadcast holds every rank until the last stage's host, which is past its
  own optimizer step, so past its device's end of step.

Usage (4 ranks; rank 0 appends one JSON line per case; report_steady.py makes the tables)::

    python -m torch.distributed.run --nproc_per_node 4 benchmarks/bench_steady.py --out benchmarks/results/raw/steady.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deepspeed  # noqa: E402

from benchmarks import bench_emulated as be  # noqa: E402
from benchmarks.common import append_jsonl, run_everywhere  # noqa: E402
from benchmarks.emulated import DEVICE  # noqa: E402
from ds_vshape.runtime.step_end import post_validation as pv  # noqa: E402
from ds_vshape.runtime.step_end.step import OptimizerStepMixin  # noqa: E402

# (label, system, schedule, pipeline keys for ds_vshape, clip). "+pv": post-validation that
# speculates from the first step (speculate_after 0); "+pv wait": it waits for every check.
PV = {"post_validation": True, "speculate_after": 0}
PV_WAIT = {"post_validation": True, "speculate_after": None}
CASES: list[tuple[str, str, str, dict[str, Any], float]] = [
    (f"{name}{' clip' if clip else ''}", system, schedule, keys, clip)
    for clip in (0.0, 1e6)
    for name, system, schedule, keys in (
        ("DeepSpeed 1F1B", "deepspeed", "1f1b", {}),
        ("torch ZBV", "torch", "zbvzerobubble", {}),
        ("ds_vshape 1f1b +pv", "ds_vshape", "1f1b", PV),
        ("ds_vshape zb-h2", "ds_vshape", "zb-h2", {}),
        ("ds_vshape zb-h2 +pv", "ds_vshape", "zb-h2", PV),
        ("ds_vshape v-zb", "ds_vshape", "v-zb", {}),
        ("ds_vshape v-zb +pv", "ds_vshape", "v-zb", PV),
    )
] + [(f"ds_vshape {s} +pv wait clip", "ds_vshape", s, PV_WAIT, 1e6) for s in ("zb-h2", "v-zb")]
_TORCH_CLIP = {"max_norm": 0.0}  # the torch runner's global clip, on during torch cases only


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--micro-batches", dest="m", type=int, nargs="+", default=[16, 8])
    ap.add_argument("--t-pass", type=float, default=0.020, help="seconds of one F, B or W pass of a 1/p slice")
    ap.add_argument("--layers-per-rank", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8, help="consecutive timed steps per case")
    ap.add_argument("--cases", nargs="*", default=None, help="labels to run (default: all)")
    ap.add_argument("--latency-us", type=float, default=10.0)
    ap.add_argument("--bandwidth-gbs", type=float, default=25.0)
    ap.add_argument("--out", type=Path, required=True)
    return ap.parse_args(argv)


def _after_device(fn: Any) -> Any:
    """``fn``, once this rank's device has done everything enqueued (its inputs are device values)."""
    def wrapped(*a: Any, **kw: Any) -> Any:
        DEVICE.synchronize()
        return fn(*a, **kw)

    return wrapped


def install_waits() -> None:
    pv.reduce_stats = _after_device(pv.reduce_stats)
    OptimizerStepMixin.clip_fp32_gradients = _after_device(OptimizerStepMixin.clip_fp32_gradients)
    engine_cls = deepspeed.runtime.engine.DeepSpeedEngine
    engine_cls.clip_fp32_gradients = _after_device(engine_cls.clip_fp32_gradients)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_torch_global_clip)  # after the device hook: the device is done


def _torch_global_clip(opt: torch.optim.Optimizer, *_: Any) -> None:
    max_norm = _TORCH_CLIP["max_norm"]
    if max_norm <= 0:
        return
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    local = torch.zeros(1, dtype=torch.float64)
    for g in grads:
        local += g.double().pow(2).sum()
    dist.all_reduce(local)
    coef = max_norm / (float(local.sqrt()) + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)


def run_case(case: tuple[str, str, str, dict[str, Any], float], args: argparse.Namespace, p: int, m: int,
             rank: int) -> dict[str, Any]:
    label, system, schedule, keys, clip = case
    case_args = argparse.Namespace(**{**vars(args), "t_pass": args.t_pass, "clip": clip, "pipeline_extra": keys})
    _TORCH_CLIP["max_norm"] = clip if system == "torch" else 0.0
    runner = be.build_torch(schedule, case_args, p, m, rank) if system == "torch" else be.build_deepspeed_like(system, schedule, case_args, p, m)
    stream = DEVICE.async_device.stream  # type: ignore[union-attr]
    for _ in range(args.warmup):
        runner.step()
        _finish(runner)
        dist.barrier()
    ends: list[float] = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        runner.step()
        ends.append(stream.tail_end)  # the host has enqueued the whole step: where its device work ends
    _finish(runner)
    wall = time.perf_counter() - t0
    dist.barrier()
    history = [(q.kind, q.start, q.end) for q in stream.history]
    engine = getattr(runner, "engine", None)
    return {"ends": ends, "wall_s": wall, "history": history, "redone": getattr(engine, "redone_steps", 0),
            "rerun": getattr(engine, "rerun_steps", 0)}


def _finish(runner: Any) -> None:
    engine = getattr(runner, "engine", None)
    if hasattr(engine, "settle"):
        engine.settle()
    DEVICE.synchronize()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))
    rank, p = dist.get_rank(), dist.get_world_size()
    args.device = "async"
    table = be.start_async_device(args, rank)
    install_waits()
    cases = [c for c in CASES if args.cases is None or c[0] in args.cases]
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        hop = be.TransferModel(args.latency_us * 1e-6, args.bandwidth_gbs * 1e9).seconds(args.rows * args.dim * 4)
        append_jsonl(args.out, {"kind": "setup", "p": p, "t_pass_s": args.t_pass, "hop_s": hop, "steps": args.steps,
                                "warmup": args.warmup, "layers_per_rank": args.layers_per_rank})
    for m, case in itertools.product(args.m, cases):
        gathered = run_everywhere(lambda: run_case(case, args, p, m, rank))
        if rank == 0:
            label, system, schedule, keys, clip = case
            append_jsonl(args.out, {"kind": "case", "label": label, "system": system, "schedule": schedule, "pipeline": keys,
                                    "clip": clip, "p": p, "m": m, "t_pass_s": args.t_pass, "ranks": gathered})
            print(f"[steady p={p} m={m}] {label:24s} {_status(gathered, args.steps)}", flush=True)
    dist.barrier()
    if rank == 0:
        table.unlink()


def _status(gathered: list[dict[str, Any]], steps: int) -> str:
    errs = [g["error"] for g in gathered if "error" in g]
    if errs:
        return "ERROR " + errs[0][:300]
    ends = [max(g["ends"][k] for g in gathered) for k in range(steps)]
    return f"period {(ends[-1] - ends[0]) / (steps - 1):.4f} s"


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
