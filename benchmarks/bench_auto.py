"""``"schedule": "auto"`` against every fixed schedule of its placement, on the emulated device (issue 13, item 5).

Launched under torchrun with p ranks (pure pipeline, gloo) by ``benchmarks/run_auto.sh``::

    python -m torch.distributed.run --nproc_per_node 4 benchmarks/bench_auto.py --out raw/auto.jsonl

The model is ``benchmarks/emulated.py``'s: ``layers_per_rank * p`` ``EmuLayer`` s whose F, B and W
*sleep* (the sync device: the host sleeps through each pass, so the host-side timing that
auto does is device time). ``EmuLayer`` already takes its own F, B and W times, so each
cost profile is a per-layer list of times (``layer_times``):

* ``a``: T_F = T_B = ``--t-f``/``--t-b``, T_W = ``--t-w`` per 1/p slice (20, 20, 10 ms: T_W = T_B/2);
* ``b``: as ``a``, and every pass of the layers on pipeline rank ``--slow-rank`` takes
  ``--slow-factor`` (2) times as long; which layers those are depends on the placement
  (linear: rank r holds layers [r*L/p, (r+1)*L/p); V: rank r holds stages r and 2p-1-r);
* ``c``: as ``a``, with an activation memory limit of ``--memory-limit`` M_B (2 = half of
  1F1B's p=4 M_B at p=4): ``memory_limit`` for auto, v-adaptive and zb-auto; the fixed
  schedules whose simulated peak is above it are not candidates and are not run.

Per (profile, placement, m) it runs auto (``auto_placement`` = the placement, defaults
otherwise) and every fixed schedule of the placement that auto could pick and that fits
the limit (names that generate the same order, e.g. v-adaptive and v-zb, run once), in
rounds (the second in reverse order). Every step is framed by barriers; warm-up steps
first (auto first runs its own measuring steps; then, like a fixed engine, a warm-up step
whose first pass lowers the schedule it runs from then on). Rank 0 appends one JSON
line per case: step times, each rank's peak activation bytes, auto's choice, predicted step
time, measured costs and its candidate table, and one step's per-pass timeline (start and
end of every F/B/W instruction on every rank) with the simulator's timeline for the same
schedule and the costs auto measured.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import deepspeed  # noqa: E402
from deepspeed.pipe import LayerSpec, PipelineModule  # noqa: E402

import ds_vshape  # noqa: E402
from benchmarks.bench_emulated import ds_config, sample_micro_batches  # noqa: E402
from benchmarks.common import append_jsonl, record_case, run_everywhere  # noqa: E402
from benchmarks.hops import hop_latency  # noqa: E402
from benchmarks.emulated import DEVICE, EmuLayer, metered_loss, mse  # noqa: E402
from ds_vshape.runtime.program import instructions as ins  # noqa: E402
from ds_vshape.schedules import Costs, generate, get_info, simulate  # noqa: E402
from ds_vshape.schedules.auto import AutoSettings, candidates  # noqa: E402
from ds_vshape.schedules.placement import linear, vshape  # noqa: E402

PROFILES = ("a", "b", "c")
PLACEMENTS = ("linear", "v")
# Schedules auto may pick that the engine runs as another name's order: seq1f1b with one
# sequence chunk (auto's k) is 1f1b's order (checked at start-up), so it is not run twice.
SAME_AS = {"seq1f1b": "1f1b"}
PASS_KINDS = {ins.ForwardPass: "F", ins.BackwardInput: "B", ins.BackwardWeight: "W", ins.FusedBackward: "BW"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="JSONL file rank 0 appends to")
    ap.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=PROFILES)
    ap.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=PLACEMENTS)
    ap.add_argument("--micro-batches", dest="m", type=int, nargs="+", default=[8])
    ap.add_argument("--t-f", type=float, default=0.020, help="seconds of F for a 1/p slice")
    ap.add_argument("--t-b", type=float, default=0.020, help="seconds of B for a 1/p slice")
    ap.add_argument("--t-w", type=float, default=0.010, help="seconds of W for a 1/p slice")
    ap.add_argument("--slow-rank", type=int, default=1, help="profile b: the pipeline rank whose layers are slow")
    ap.add_argument("--slow-factor", type=float, default=2.0)
    ap.add_argument("--memory-limit", type=float, default=None, help="profile c: limit in M_B (default p/2)")
    ap.add_argument("--layers-per-rank", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed steps of a fixed schedule (its first lowers the schedule); auto: after its choice")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round")
    ap.add_argument("--rounds", type=int, nargs="+", default=[2],
                    help="rounds per m (one value: every m), each round runs every case of that m once")
    ap.add_argument("--auto-warmup-steps", type=int, default=None, help="pipeline.auto_warmup_steps (default: auto's own, 2)")
    ap.add_argument("--only", nargs="*", default=None, help="run only these schedule names ('auto' included)")
    return ap.parse_args(argv)


# ---- the cost profiles -------------------------------------------------------------------------
def rank_of_layer(placement: str, p: int, layers: int) -> list[int]:
    """The pipeline rank that runs each layer under a uniform cut for the placement."""
    stage_to_rank = vshape(p) if placement == "v" else linear(p)
    per_stage = layers // len(stage_to_rank)
    return [stage_to_rank[i // per_stage] for i in range(layers)]


def layer_times(profile: str, placement: str, args: argparse.Namespace, p: int) -> list[tuple[float, float, float]]:
    """(F, B, W) seconds of every layer: a 1/p slice's times shared by its layers, the slow rank's scaled."""
    layers = p * args.layers_per_rank
    base = (args.t_f / args.layers_per_rank, args.t_b / args.layers_per_rank, args.t_w / args.layers_per_rank)
    ranks = rank_of_layer(placement, p, layers)
    scale = [args.slow_factor if profile == "b" and r == args.slow_rank else 1.0 for r in ranks]
    return [tuple(t * s for t in base) for s in scale]  # type: ignore[misc]


def memory_limit(profile: str, args: argparse.Namespace, p: int) -> float | None:
    if profile != "c":
        return None
    return args.memory_limit if args.memory_limit is not None else p / 2


def fixed_schedules(placement: str, p: int, m: int, limit: float | None, w_memory: float) -> list[tuple[str, list[str]]]:
    """The schedules auto chooses from (``schedules.auto.candidates``) whose simulated peak fits the limit,
    as the engine builds them from the config (unit costs, the limit for those that take one).

    Names whose generators give the same order are run once: (first name, the others). At p=4
    v-adaptive at the default limit is v-zb's order, at 2 M_B v-min's; zb-auto with unit costs is
    zb-h1's. Running copies would only add noise (the best of two copies is biased low)."""
    out: list[tuple[str, list[str]]] = []
    seen: dict[Any, int] = {}
    for name in candidates(AutoSettings(placement=placement), stages=p, micro_batches=m):
        if name in SAME_AS:
            continue
        info = get_info(name)
        sched = generate(name, p, m, memory_limit=limit if info.memory_limit else None, costs=Costs(w_memory=w_memory))
        if limit is not None and simulate(sched, Costs(w_memory=w_memory)).max_peak_memory > limit + 1e-9:
            continue
        if sched.ranks in seen:
            out[seen[sched.ranks]][1].append(name)
        else:
            seen[sched.ranks] = len(out)
            out.append((name, []))
    return out


def check_same_as() -> None:
    for name, other in SAME_AS.items():
        a, b = generate(name, 4, 8, seq_chunks=1), generate(other, 4, 8, seq_chunks=1)
        if a.ranks != b.ranks:
            raise SystemExit(f"bench_auto: {name} with k=1 is not {other}'s order any more; run it as its own case")


# ---- one case ------------------------------------------------------------------------------------
class Timeline:
    """Start and end (perf_counter) of every compute instruction of the current step on this rank."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int, float, float]] = []

    def wrap(self, engine: Any) -> None:
        # DeepSpeed dispatches through self._INSTRUCTION_MAP: an instance attribute wins over the class's.
        table = dict(type(engine)._INSTRUCTION_MAP)
        for cls, kind in PASS_KINDS.items():
            table[cls] = self._timed(table[cls], kind)
        engine._INSTRUCTION_MAP = table

    def _timed(self, fn: Any, kind: str) -> Any:
        def handler(engine: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(engine, **kw)
            finally:
                self.events.append((kind, int(kw["stage"]), int(kw["micro_batch"]), t0, time.perf_counter()))

        return handler


def build(schedule: str, profile: str, placement: str, args: argparse.Namespace, p: int, m: int) -> tuple[Any, Any]:
    times = layer_times(profile, placement, args, p)
    specs = [LayerSpec(EmuLayer, args.dim, tf, tb, tw, mode="linear", seed=i) for i, (tf, tb, tw) in enumerate(times)]
    module = PipelineModule(specs, num_stages=p, loss_fn=metered_loss(mse), partition_method="uniform")
    pipeline: dict[str, Any] = {"schedule": schedule, "partition_method": "uniform", "p2p_timeout_s": 120, "measure_memory": True}
    limit = memory_limit(profile, args, p)
    if schedule == "auto":
        pipeline["auto_placement"] = placement
        if args.auto_warmup_steps is not None:
            pipeline["auto_warmup_steps"] = args.auto_warmup_steps
    if limit is not None and (schedule == "auto" or get_info(schedule).memory_limit):
        pipeline["memory_limit"] = limit
    engine, *_ = ds_vshape.initialize(model=module, config=ds_config(m, args.rows, pipeline))
    return engine, itertools.cycle(sample_micro_batches(args, m))


def run_case(schedule: str, profile: str, placement: str, args: argparse.Namespace, p: int, m: int) -> dict[str, Any]:
    t_build = time.perf_counter()
    engine, data = build(schedule, profile, placement, args, p, m)
    timeline = Timeline()
    timeline.wrap(engine)
    build_s = time.perf_counter() - t_build
    warmup = args.warmup
    out: dict[str, Any] = {"build_s": build_s}
    if schedule == "auto":
        choose_s, choose_peak = [], []
        for _ in range(engine.auto.warmup_steps):  # measuring steps under the safe schedule
            dist.barrier()
            t0 = time.perf_counter()
            engine.train_batch(data)
            choose_s.append(time.perf_counter() - t0)
            choose_peak.append(int(engine.peak_activation_bytes or 0))
        out["auto_warmup_s"] = choose_s
        out["auto_warmup_peak_bytes"] = choose_peak
        out["auto_safe"] = engine.auto.safe
    steps = []
    for i in range(warmup + args.steps):
        timeline.events.clear()
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_batch(data)
        t_local = time.perf_counter() - t0
        dist.barrier()
        t1 = time.perf_counter()
        if i >= warmup:
            steps.append({"step_s": t1 - t0, "local_s": t_local, "t0": t0,
                          "peak_activation_bytes": int(engine.peak_activation_bytes or 0), "events": list(timeline.events)})
    # Keep one step's timeline, the last (the same step on every rank); the others' events are dropped.
    for s in steps[:-1]:
        s.pop("events")
    out["steps"] = steps
    out["schedule"] = engine.schedule.name
    out["device_s"] = DEVICE.snapshot()
    if schedule == "auto" and dist.get_rank() == 0:
        choice, measured = engine.auto_choice, engine.auto_measured
        sim = simulate(engine.schedule, choice.costs)
        out["auto"] = {
            "choice": choice.name, "predicted_s": choice.predicted_s, "memory_limit": choice.memory_limit,
            "engine_step_s": engine.auto_step_s, "costs": asdict(choice.costs), "measured": asdict(measured),
            "table": [{"name": c.name, "predicted_s": c.makespan, "peak_bytes": c.peak_bytes, "fits": c.fits} for c in choice.table],
            "sim_makespan_s": sim.makespan,
            "sim_timeline": [[[s, e, a.kind.value, a.stage, a.micro_batch] for s, e, a in t] for t in sim.timeline],
        }
    if dist.get_rank() == 0:
        out["schedule_ir"] = engine.schedule.to_dict()
        out["stage_to_rank"] = list(engine.schedule.stage_to_rank)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    check_same_as()
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))
    rank, p = dist.get_rank(), dist.get_world_size()
    latency = hop_latency(rank, args.rows * args.dim)
    w_memory = 0.5  # what EmuLayer's split backward keeps (ds_vshape's default pipeline.w_memory until it became 1)
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(args.out, {"kind": "latency", "p": p, **latency})
        append_jsonl(args.out, {"kind": "setup", "p": p, "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                           "w_memory": w_memory})
    rounds = args.rounds * len(args.m) if len(args.rounds) == 1 else args.rounds
    if len(rounds) != len(args.m):
        raise SystemExit(f"bench_auto: --rounds takes one value or one per --micro-batches value, got {args.rounds}")
    plan = []
    for m, n_rounds in zip(args.m, rounds):
        order = []
        for profile in args.profiles:
            limit = memory_limit(profile, args, p)
            for placement in args.placements:
                for name, same in [("auto", [])] + fixed_schedules(placement, p, m, limit, w_memory):
                    if args.only is None or name in args.only:
                        order.append((m, profile, placement, name, same))
        # Rounds alternate the order, so that a burst of other load does not hit the same case twice.
        plan += [(rnd, *c) for rnd in range(n_rounds) for c in (order if rnd % 2 == 0 else order[::-1])]
    if rank == 0:
        print(f"[auto p={p}] {len(plan)} cases (m {args.m}, rounds {rounds})", flush=True)
    for rnd, m, profile, placement, name, same in plan:
        t0 = time.perf_counter()
        DEVICE.reset()
        gathered = run_everywhere(lambda: run_case(name, profile, placement, args, p, m))
        if rank == 0:
            record = {"kind": "case", "profile": profile, "placement": placement, "schedule": name, "same_as": same, "p": p, "m": m,
                      "round": rnd, "memory_limit": memory_limit(profile, args, p),
                      "layer_times": layer_times(profile, placement, args, p), "wall_s": time.perf_counter() - t0,
                      "ranks": gathered}
            status = record_case(args.out, record, gathered, lambda med: _step_status(med, name, gathered[0]), error_chars=300)
            label = "=".join([name, *same])
            print(f"[auto p={p} m={m} {profile} {placement:6s} round {rnd}] {label:15s} {status}  ({record['wall_s']:.1f} s)", flush=True)
    dist.barrier()


def _step_status(med: float, name: str, rank0: dict[str, Any]) -> str:
    status = f"step {med * 1e3:7.1f} ms"
    if name == "auto":
        a = rank0["auto"]
        status += f"  -> {a['choice']} (predicted {a['predicted_s'] * 1e3:.1f} ms)"
    return status


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
