"""How long a rank takes from its interpreter's start to the end of its first training step.

A drop-in job of plain ``nn.Linear`` layers (no Hugging Face model, no sequence chunks): what
every rank pays before it trains, imports included. Run under the launcher, e.g. on CPU::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 \\
        benchmarks/rank_start.py

Each rank prints one line: seconds to imports done, to the first step's end, and which heavy
modules its run loaded (``transformers.modeling_utils``, ``torch._dynamo``).
"""

from __future__ import annotations

import time

START = time.perf_counter()

import sys  # noqa: E402

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.pipe import LayerSpec, PipelineModule  # noqa: E402

import ds_vshape  # noqa: E402

__all__ = ["main"]

HEAVY = ("transformers.modeling_utils", "torch._dynamo")


def main() -> int:
    ds_vshape.initialize  # noqa: B018  # the runtime's imports, as a job's first call loads them
    imported = time.perf_counter() - START
    deepspeed.init_distributed(dist_backend="gloo")
    module = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 8, 8) for _ in range(4)], num_stages=dist.get_world_size(),
                            loss_fn=torch.nn.functional.mse_loss)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "pipeline": {"schedule": "zb-h1"}}
    engine, *_ = ds_vshape.initialize(model=module, model_parameters=list(module.parameters()), config=config)
    batch = (torch.randn(2, 8, generator=torch.Generator().manual_seed(0)), torch.zeros(2, 8))
    engine.train_batch(iter([batch] * 4))
    loaded = ", ".join(f"{name} {'yes' if name in sys.modules else 'no'}" for name in HEAVY)
    print(f"rank {dist.get_rank()}: imports {imported:.1f} s, first step done {time.perf_counter() - START:.1f} s; "
          f"loaded: {loaded}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
