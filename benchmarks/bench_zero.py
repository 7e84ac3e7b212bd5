"""Data-parallel communication and model-state memory per step under ZeRO, on PP2xDP2 (issue 12).

Run on 4 ranks (``make bench-zero``, or ``torchrun --nproc_per_node 4 benchmarks/bench_zero.py``).
For each (system, schedule, ZeRO stage) and m in 4, 8, 16: one warm-up step, then one step in
which every collective on the data-parallel group is counted (calls and payload bytes, by
wrapping ``torch.distributed``'s collectives; pipeline sends are not collectives and are not
counted), and the model states a rank holds after it are summed: its parameter shards, the
optimizer's fp32 partitions and Adam's moments, each storage once. Rank 0 writes
``benchmarks/results/zero.md``. Figures come from CPU gloo ranks: bytes, calls and memory are
what a GPU run would move and hold; no time is reported.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import deepspeed  # noqa: E402
from deepspeed.pipe import PipelineModule  # noqa: E402

import ds_vshape  # noqa: E402

DIM, LAYERS, ROWS = 256, 8, 4
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "_all_gather_base", "_reduce_scatter_base", "all_to_all_single")
# (label, schedule or None for stock DeepSpeed, ZeRO stage)
SYSTEMS = [
    ("DeepSpeed 1F1B", None, 1),
    ("ds_vshape 1f1b", "1f1b", 2),
    ("ds_vshape interleaved", "interleaved", 3),
    ("ds_vshape breadth-first", "breadth-first", 3),
    ("ds_vshape breadth-first", "breadth-first", 2),
    ("ds_vshape breadth-first", "breadth-first", 0),
    # split backward (W passes) under ZeRO-3
    ("ds_vshape zb-h1", "zb-h1", 3),
    ("ds_vshape zb-h2", "zb-h2", 3),
    ("ds_vshape v-zb", "v-zb", 3),
    ("ds_vshape v-half", "v-half", 3),
]


class Counter:
    """Counts collectives on one process group while ``active``."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks, self.active, self.calls, self.bytes = sorted(ranks), False, 0, 0

    def install(self) -> None:
        from deepspeed.comm import comm as ds_comm

        # torch.distributed and its c10d module hold the same functions under two names, and
        # DeepSpeed's backend caches its all-gather and reduce-scatter at start: wrap all three.
        for namespace in (dist, dist.distributed_c10d):
            for name in COLLECTIVES:
                fn = getattr(namespace, name, None)
                if fn is not None:
                    setattr(namespace, name, self._wrap(fn))
        for name in ("all_gather_function", "reduce_scatter_function"):
            fn = getattr(ds_comm.cdb, name, None)
            if fn is not None:
                setattr(ds_comm.cdb, name, self._wrap(fn))

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if self.active and group is not None and sorted(dist.get_process_group_ranks(group)) == self.ranks:
                self.calls += 1
                # The whole buffer: a gather's output, a reduce-scatter's input, a reduce's tensor.
                self.bytes += max(_nbytes(a) for a in (*args[:2], kwargs.get("tensor"), kwargs.get("input_tensor"),
                                                       kwargs.get("output_tensor")))
            return fn(*args, **kwargs)
        return counted


def _nbytes(x: Any) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(LAYERS)]


def _config(schedule: str | None, zero: int, m: int) -> dict[str, Any]:
    zero_cfg: dict[str, Any] = {"stage": zero}
    if zero == 3:
        zero_cfg["stage3_param_persistence_threshold"] = 0  # shard every weight, as a large model would
    return {
        "train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": m,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": zero_cfg, "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0,
        "steps_per_print": 10**9, "pipeline": {"schedule": schedule} if schedule else {},
    }


def _engine(schedule: str | None, zero: int, m: int) -> Any:
    module = PipelineModule(_layers(), num_stages=2, loss_fn=nn.functional.mse_loss, partition_method="uniform")
    init = ds_vshape.initialize if schedule else deepspeed.initialize
    engine, *_ = init(model=module, model_parameters=[p for p in module.parameters()], config=_config(schedule, zero, m))
    return engine


def model_state_bytes(engine: Any) -> int:
    """Parameter shards (whole tensors where unsharded), fp32 partitions and optimizer moments, each storage once."""
    tensors: list[torch.Tensor] = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    opt = engine.optimizer
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        tensors += [t for t in getattr(opt, name, []) if torch.is_tensor(t)]
    base = getattr(opt, "optimizer", opt)
    tensors += [t for state in base.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure(label: str, schedule: str | None, zero: int, m: int, counter: Counter) -> dict[str, Any]:
    engine = _engine(schedule, zero, m)
    g = torch.Generator().manual_seed(1 + engine.grid.get_data_parallel_rank())
    data = [(torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, DIM, generator=g)) for _ in range(2 * m)]
    it = iter(data)
    engine.train_batch(it)
    counter.calls = counter.bytes = 0
    counter.active = True
    engine.train_batch(it)
    counter.active = False
    row = {"system": label, "zero": zero, "m": m, "calls": counter.calls, "bytes": counter.bytes,
           "model_state": model_state_bytes(engine)}
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    return {**row, "calls": max(r["calls"] for r in rows), "bytes": max(r["bytes"] for r in rows),
            "model_state": max(r["model_state"] for r in rows)}


def report(rows: list[dict[str, Any]]) -> str:
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    lines = ["| system | ZeRO | m | DP calls / step | DP bytes / step | model states / rank |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['system']} | {r['zero']} | {r['m']} | {r['calls']} | {mib(r['bytes'])} | {mib(r['model_state'])} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--micro-batches", type=int, nargs="*", default=[4, 8, 16])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "zero.md")
    args = ap.parse_args(argv)
    deepspeed.init_distributed(dist_backend="gloo")
    if dist.get_world_size() != 4:
        raise SystemExit("bench_zero runs on 4 ranks (2 pipeline stages x 2 data-parallel replicas)")
    probe = PipelineModule(_layers(), num_stages=2, loss_fn=nn.functional.mse_loss, partition_method="uniform")
    dp_ranks = probe.mpu().get_data_parallel_group()
    counter = Counter(dist.get_process_group_ranks(dp_ranks))
    counter.install()
    rows = [measure(label, schedule, zero, m, counter) for label, schedule, zero in SYSTEMS for m in args.micro_batches]
    if dist.get_rank() == 0:
        table = report(rows)
        print(table, flush=True)
        args.out.write_text(
            "# ZeRO in the pipeline: data-parallel communication and model states (PP2xDP2)\n\n"
            f"`make bench-zero` ({LAYERS} layers of Linear({DIM}, {DIM}), fp32, Adam; CPU gloo, 4 ranks on one "
            f"{platform.machine()} machine with {os.cpu_count()} CPU cores, no GPU). Per step, the busiest\n"
            "rank's collectives on its data-parallel group and the model states it holds after the step. Bytes, calls and\n"
            "memory are what a GPU run would move and hold; no time is reported.\n\n" + table + "\n"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
