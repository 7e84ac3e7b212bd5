"""Host and device time per pass of one stage on a CUDA device: fused, torch's split and ds_vshape's.

``benchmarks/host_stage.py`` at the shapes issue 28 measured on an H100 (bf16, Llama-3-8B-sized
blocks: hidden 4096, FFN 14336, 32 heads, 8 KV heads; and 4 blocks of hidden 2048): per pass
the host's time and the device's span, the micro-batch's whole time against a fused F+B, and
what W keeps. The tables are printed (``-rA`` shows them) and written to ``$OUT`` when set, so
one ``run`` call brings them back. Asserted is only what does not depend on timing: every way
ran, and ds_vshape's W keeps no more than torch's split keeps for its W.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from benchmarks import host_stage

__all__: list[str] = []

pytestmark = pytest.mark.gpu

SHAPES = {  # name: (blocks, tokens per sequence, micro-batch, (hidden, FFN, heads, KV heads))
    "8b-2blocks-4096": (2, 4096, 1, (4096, 14336, 32, 8)),
    "8b-2blocks-1024": (2, 1024, 1, (4096, 14336, 32, 8)),
    "2048-4blocks-2048": (4, 2048, 1, (2048, 5632, 16, 16)),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_host_and_device_time_per_pass(name: str, record_property: pytest.RecordProperty) -> None:
    blocks, seq_len, micro_batch, shape = SHAPES[name]
    torch.manual_seed(0)
    stage = host_stage.build(blocks=blocks, seq_len=seq_len, micro_batch=micro_batch, shape=shape, device="cuda",
                             dtype=torch.bfloat16)
    medians = host_stage.measure(stage, reps=10, warmup=3)
    text = host_stage.render(medians, setting=f"{torch.cuda.get_device_name()}, {name}",
                             command=f"pytest -m gpu tests/gpu/test_host_cost_gpu.py -k {name}")
    print(text)
    record_property(name, text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"host_stage_{name}.md").write_text(text)
    assert set(medians) == set(host_stage.WAYS)
    assert medians["ds_vshape"]["kept"] <= medians["torch split"]["kept"]
