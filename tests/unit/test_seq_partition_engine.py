"""``pipeline.seq_partition``: the config rule, the model sizes it reads, the engine's cut positions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ds_vshape.config import ConfigError, parse_pipeline_config
from ds_vshape.runtime.program.seq_chunks import SeqChunks, partition_dims
from ds_vshape.schedules.seq_partition import chunk_boundaries

DIMS = {"hidden": 32, "heads": 4, "ffn": 64}


def _model(**config: object) -> SimpleNamespace:
    plan = SimpleNamespace(lm=SimpleNamespace(config=SimpleNamespace(**config)))
    return SimpleNamespace(_layer_specs=[SimpleNamespace(module_args=()), SimpleNamespace(module_args=(plan, 0))])


def test_dims_come_from_the_hf_config() -> None:
    assert partition_dims(_model(hidden_size=32, num_attention_heads=4, intermediate_size=64)) == DIMS
    assert partition_dims(_model(hidden_size=32, num_attention_heads=4, head_dim=16, n_inner=None)) == {
        "hidden": 32, "heads": 4, "head_dim": 16}
    with pytest.raises(ValueError, match="seq_partition to 'equal'"):
        partition_dims(_model(d_model=32))


@pytest.mark.parametrize(("block", "needle"), [
    ({"schedule": "1f1b", "seq_partition": "compute"}, "applies only with sequence chunks"),
    ({"seq_partition": "compute"}, "pipeline.seq_partition is set but pipeline.schedule is not"),
    ({"schedule": "seq1f1b", "seq_partition": "flops"}, "seq_partition"),
])
def test_config_rules(block: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        parse_pipeline_config({"pipeline": block})


def test_config_accepts_compute_with_chunks() -> None:
    assert parse_pipeline_config({"pipeline": {"schedule": "seq1f1b", "seq_partition": "compute"}}).seq_partition == "compute"
    assert parse_pipeline_config({"pipeline": {"schedule": "v-half", "seq_chunks": 2}}).seq_partition == "equal"


def test_compute_cuts_any_length_and_middle_stages_size_kv_for_the_whole() -> None:
    seq = SeqChunks(0, partition="compute", dims=DIMS)
    seq.start_step(4)
    assert seq.unequal
    for n in range(4, 200):
        cuts = chunk_boundaries(n, 4, mode="compute", **DIMS)
        assert seq._bounds(n, "input") == cuts
        total = seq._total(cuts[1])
        # Large enough for the sequence, and the partition of that length starts alike.
        assert total >= n and chunk_boundaries(total, 4, mode="compute", **DIMS)[1] == cuts[1]
    ids = torch.arange(62).reshape(2, 31)
    pieces = [seq.first_input({0: ids}, 0, j) for j in range(4)]
    assert [p.shape[1] for p in pieces] == [8, 8, 8, 7] and torch.equal(torch.cat(pieces, dim=1), ids)


def test_equal_chunks_still_need_a_multiple() -> None:
    seq = SeqChunks(0)
    seq.start_step(4)
    assert not seq.unequal and seq._total(8) == 32
    with pytest.raises(ValueError, match="does not divide"):
        seq._bounds(31, "input")
    with pytest.raises(ValueError, match="'compute'"):
        SeqChunks(0, partition="compute")


def test_the_runtime_imports_transformers_only_where_chunks_ask_for_it() -> None:
    # A fresh interpreter: ``ds_vshape.initialize`` (every rank of every job imports the runtime behind it) must not
    # load transformers' modeling code, seconds of each rank's start that a job without Hugging Face layers or
    # chunks never uses; a chunk's state then loads it.
    code = ("import sys, ds_vshape; ds_vshape.initialize; before = 'transformers.modeling_utils' in sys.modules; "
            "from ds_vshape.runtime.program.seq_chunks import SeqChunks; chunks = SeqChunks(0); chunks.start_step(2); "
            "chunks.forward(0, 0, 0, __import__('torch').zeros(1, 4)); "
            "print(before, 'transformers.modeling_utils' in sys.modules)")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout + out.stderr
