"""Emulated-device benchmark worker: every system on the same emulated model, on p gloo ranks.

Launched by ``benchmarks/run.sh`` under torchrun (world size = p, pure pipeline). For each
m and each case it builds the system, runs warm-up steps, then timed steps; each step is
framed by barriers, so a step time is one isolated optimizer step, as the simulator models
it. Rank 0 appends one JSON line per case to ``--out`` (errors are recorded, not raised, so
one failing system does not hide the others).

Per rank and step it records: emulated device time per pass kind (F/B/W, from the layer's
own clock), the peak activation bytes (ds_vshape: the engine's own meter; DeepSpeed and
torch: the same meter class wrapped around their forward), and, for the DeepSpeed-based
engines, the wall time spent in each instruction handler.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import deepspeed  # noqa: E402
from deepspeed.pipe import LayerSpec, PipelineModule  # noqa: E402

import ds_vshape  # noqa: E402
from benchmarks.async_device import AsyncDevice, ReadyTable, TransferModel, default_table_path  # noqa: E402
from benchmarks.common import append_jsonl, record_case, run_everywhere  # noqa: E402
from benchmarks.emulated import DEVICE, EmuLayer, metered_loss, mse  # noqa: E402
from benchmarks.hops import hop_latency  # noqa: E402
from benchmarks.probe import Probe, instrument_engine  # noqa: E402
from ds_vshape.runtime.measuring.memory import ActivationMeter  # noqa: E402
from ds_vshape.schedules import schedule_names  # noqa: E402

TORCH_SCHEDULES = ("1f1b", "interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev")
TORCH_CLASS = {
    "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B", "loopedbfs": "ScheduleLoopedBFS",
    "interleavedzerobubble": "ScheduleInterleavedZeroBubble", "zbvzerobubble": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
# Runtime schedules of ds_vshape (seq1f1b is simulator-only in the engine).
DS_VSHAPE_SCHEDULES = tuple(n for n in schedule_names() if n != "seq1f1b")


# ---- options ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--micro-batches", dest="m", type=int, nargs="+", default=[16, 8], help="micro-batches per step")
    ap.add_argument("--systems", nargs="+", default=["ds_vshape", "deepspeed", "torch"])
    ap.add_argument("--schedules", nargs="*", default=None, help="restrict to these schedule names (any system)")
    ap.add_argument("--t-pass", type=float, nargs="+", default=[0.020],
                    help="seconds of F (and of B, of W) for a 1/p slice of the model; several values run one after another")
    ap.add_argument("--layers-per-rank", type=int, default=2, help="emulated layers per 1/p slice (2 = one per V chunk)")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rows", type=int, default=16, help="rows per micro-batch")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=1, help="run every case this many times (alternating order)")
    ap.add_argument("--out", type=Path, required=True, help="JSONL file rank 0 appends to")
    ap.add_argument("--profile", type=Path, default=None, help="cProfile the timed steps; one pstats file per case and rank here")
    ap.add_argument("--device", choices=("sync", "async"), default="sync",
                    help="sync: the host sleeps through each pass; async: passes go onto a device stream and the host runs ahead "
                         "(benchmarks/async_device.py)")
    ap.add_argument("--latency-us", type=float, default=10.0, help="async device: latency of one transfer (microseconds)")
    ap.add_argument("--bandwidth-gbs", type=float, default=25.0, help="async device: link bandwidth (GB/s, 1e9 bytes)")
    return ap.parse_args(argv)


def start_async_device(args: argparse.Namespace, rank: int) -> ReadyTable:
    """Attach this rank's device stream; the optimizer step becomes a stream synchronize.

    The hook is global, so it catches DeepSpeed's optimizer, ds_vshape's (DeepSpeed's) and
    our own torch SGD alike: each waits for the device before updating, as a GPU step must.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "") + "_" + os.environ.get("MASTER_PORT", "0")
    table = ReadyTable(default_table_path(run_id))
    transfer = TransferModel(latency_s=args.latency_us * 1e-6, bandwidth_bps=args.bandwidth_gbs * 1e9)
    DEVICE.attach(AsyncDevice(rank, table, transfer))
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda *_: DEVICE.synchronize())
    return table


def cases(args: argparse.Namespace) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if "deepspeed" in args.systems:
        out += [("deepspeed", "1f1b"), ("deepspeed", "dualpipev")]
    if "ds_vshape" in args.systems:
        out += [("ds_vshape", s) for s in DS_VSHAPE_SCHEDULES]
    if "torch" in args.systems:
        out += [("torch", s) for s in TORCH_SCHEDULES]
    if args.schedules:
        out = [c for c in out if c[1] in args.schedules]
    return out








# ---- systems ---------------------------------------------------------------------------------
def ds_config(m: int, rows: int, pipeline: dict[str, Any], *, clip: float = 0.0) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": rows,
        "gradient_accumulation_steps": m,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": clip,  # off by default: clipping differs between engines (global vs per-stage norm)
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "pipeline": pipeline,
    }


class Runner:
    """One built system on this rank: ``step()`` trains one batch; ``peak()`` its activation peak."""

    step: Callable[[], None]
    peak: Callable[[], int | None]
    probe: Probe
    schedule: Any = None  # ds_vshape Schedule when there is one


def build_deepspeed_like(system: str, schedule: str, args: argparse.Namespace, p: int, m: int) -> Runner:
    num_layers = p * args.layers_per_rank
    per = args.t_pass / args.layers_per_rank
    specs = [LayerSpec(EmuLayer, args.dim, per, per, per, mode="linear", seed=i) for i in range(num_layers)]
    loss = metered_loss(mse)
    probe = Probe()
    runner = Runner()
    if system == "deepspeed" and schedule == "dualpipev":
        from deepspeed.pipe import DualPipeVModule

        module = DualPipeVModule(specs, num_stages=p, loss_fn=loss, partition_method="uniform")
    else:
        module = PipelineModule(specs, num_stages=p, loss_fn=loss, partition_method="uniform")
    if system == "ds_vshape":
        # Memory is measured every step, as for the other systems (the report compares it).
        config = ds_config(m, args.rows, {"schedule": schedule, "partition_method": "uniform", "p2p_timeout_s": 120,
                                           "measure_memory": True, **getattr(args, "pipeline_extra", {})},
                            clip=getattr(args, "clip", 0.0))
        engine, *_ = ds_vshape.initialize(model=module, config=config)
        runner.schedule = engine.schedule
        instrument_engine(engine, probe, meter_forward=False)
        runner.peak = lambda: int(engine.peak_activation_bytes)
    else:
        config = ds_config(m, args.rows, {}, clip=getattr(args, "clip", 0.0))
        engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=[q for q in module.parameters()])
        instrument_engine(engine, probe, meter_forward=True)
        runner.peak = lambda: int(probe.meter.peak_bytes)  # type: ignore[union-attr]
    data = sample_micro_batches(args, m)
    it = itertools.cycle(data)
    runner.step = lambda: engine.train_batch(it)
    runner.probe = probe
    runner.engine = engine  # type: ignore[attr-defined]
    return runner


class _Metered(nn.Module):
    """A torch pipeline stage whose forward is seen by the activation meter."""

    def __init__(self, inner: nn.Module, probe: Probe) -> None:
        super().__init__()
        self.inner, self._probe = inner, probe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._probe.meter is None or x.device.type == "meta":
            return self.inner(x)
        with self._probe.meter.recording():
            return self.inner(x)


def torch_stage_ids(schedule: str, rank: int, p: int) -> list[int]:
    if schedule == "1f1b":
        return [rank]
    if schedule in ("zbvzerobubble", "dualpipev"):
        return [rank, 2 * p - 1 - rank]  # V placement
    return [rank, rank + p]  # looped placement


def build_torch(schedule: str, args: argparse.Namespace, p: int, m: int, rank: int) -> Runner:
    from torch.distributed import pipelining

    ids = torch_stage_ids(schedule, rank, p)
    num_stages = p if schedule == "1f1b" else 2 * p
    layers_per_stage = args.layers_per_rank * p // num_stages
    per = args.t_pass / args.layers_per_rank
    probe = Probe()
    mods, stages = [], []
    for sid in ids:
        layers = [EmuLayer(args.dim, per, per, per, mode="graph", seed=sid * layers_per_stage + j) for j in range(layers_per_stage)]
        mod = _Metered(nn.Sequential(*layers), probe)
        mods.append(mod)
        stages.append(pipelining.PipelineStage(mod, sid, num_stages, torch.device("cpu")))
    params = [q for mod in mods for q in mod.parameters()]
    probe.meter = ActivationMeter({q.untyped_storage().data_ptr() for q in params})
    cls = getattr(pipelining, TORCH_CLASS[schedule])
    sched = cls(stages[0] if schedule == "1f1b" else stages, n_microbatches=m, loss_fn=metered_loss(mse))
    opt = torch.optim.SGD(params, lr=1e-3)
    data = sample_micro_batches(args, m)
    x = torch.cat([d[0] for d in data])
    y = torch.cat([d[1] for d in data])
    first, last = 0 in ids, num_stages - 1 in ids

    def step() -> None:
        kwargs: dict[str, Any] = {}
        if last:
            kwargs["target"] = y
        if first:
            sched.step(x, **kwargs)
        else:
            sched.step(**kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)

    runner = Runner()
    runner.step, runner.probe = step, probe
    runner.peak = lambda: int(probe.meter.peak_bytes)  # type: ignore[union-attr]
    return runner


def sample_micro_batches(args: argparse.Namespace, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(args.rows, args.dim, generator=g), torch.randn(args.rows, args.dim, generator=g)) for _ in range(m)]


# ---- measurement -----------------------------------------------------------------------------
def run_case(system: str, schedule: str, args: argparse.Namespace, p: int, m: int, rank: int) -> dict[str, Any]:
    t_build = time.perf_counter()
    if system == "torch":
        runner = build_torch(schedule, args, p, m, rank)
    else:
        runner = build_deepspeed_like(system, schedule, args, p, m)
    build_s = time.perf_counter() - t_build
    steps = []
    profiler = None
    if args.profile is not None:
        import cProfile

        profiler = cProfile.Profile()
    for i in range(args.warmup + args.steps):
        runner.probe.reset()
        dist.barrier()
        t0 = time.perf_counter()
        if profiler is not None and i >= args.warmup:
            profiler.enable()
        runner.step()
        DEVICE.synchronize()  # async device: the step is over when the device is (no-op when sync)
        if profiler is not None:
            profiler.disable()
        t_local = time.perf_counter() - t0  # this rank's own work in the step
        dist.barrier()
        t1 = time.perf_counter()
        if i >= args.warmup:
            steps.append({"step_s": t1 - t0, "local_s": t_local, "peak_activation_bytes": runner.peak(), **runner.probe.snapshot()})
    out: dict[str, Any] = {"build_s": build_s, "steps": steps}
    if profiler is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(args.profile / f"{system}-{schedule}-m{m}-rank{rank}.pstats"))
    if runner.schedule is not None:
        out["schedule_info"] = {"name": runner.schedule.name, "chunks_per_rank": runner.schedule.chunks_per_rank}
    return out






def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))
    rank, p = dist.get_rank(), dist.get_world_size()
    latency = hop_latency(rank, args.rows * args.dim)
    table = start_async_device(args, rank) if args.device == "async" else None
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(args.out, {"kind": "latency", "p": p, **latency})
        if table is not None:
            hop = TransferModel(args.latency_us * 1e-6, args.bandwidth_gbs * 1e9).seconds(args.rows * args.dim * 4)
            append_jsonl(args.out, {"kind": "device", "device": "async", "p": p, "latency_s": args.latency_us * 1e-6,
                               "bandwidth_bps": args.bandwidth_gbs * 1e9, "hop_s": hop})
        print(f"[bench p={p}] one-hop latency: gloo {latency['gloo_send_recv_s'] * 1e3:.3f} ms, "
              f"ds_vshape P2P {latency['ds_vshape_p2p_s'] * 1e3:.3f} ms, barrier {latency['barrier_s'] * 1e3:.3f} ms", flush=True)
    # Rounds run every case again, the second in reverse order, so that a burst of other
    # load on the machine does not hit the same case twice; the report takes the best round.
    order = [(t, m, c) for t in args.t_pass for m in args.m for c in cases(args)]
    plan = [(rnd, t, m, c) for rnd in range(args.rounds) for t, m, c in (order if rnd % 2 == 0 else order[::-1])]
    for rnd, t_pass, m, (system, schedule) in plan:
        t0 = time.perf_counter()
        case_args = argparse.Namespace(**{**vars(args), "t_pass": t_pass})
        gathered = run_everywhere(lambda: run_case(system, schedule, case_args, p, m, rank))
        if rank == 0:
            record = {"kind": "case", "system": system, "schedule": schedule, "p": p, "m": m, "t_pass_s": t_pass,
                      "round": rnd, "device": args.device, "threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None,
                      "layers_per_rank": args.layers_per_rank, "dim": args.dim, "rows": args.rows, "wall_s": time.perf_counter() - t0,
                      "ranks": gathered}
            status = record_case(args.out, record, gathered, lambda med: f"step {med:.3f} s")
            tag = "async " if args.device == "async" else ""  # sync lines stay as ab.sh parses them
            print(f"[bench {tag}p={p} m={m} T={t_pass * 1e3:g}ms round {rnd}] {system:9s} {schedule:22s} {status}  ({record['wall_s']:.1f} s)",
                  flush=True)
    dist.barrier()
    if table is not None and rank == 0:
        table.unlink()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
