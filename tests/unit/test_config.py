"""The pipeline block of the DeepSpeed JSON: typos and misfits are errors that say what to change."""

from __future__ import annotations

import pytest

from ds_vshape.config import ConfigError, PipelineConfig, parse_pipeline_config


def test_no_schedule_means_stock_deepspeed() -> None:
    assert parse_pipeline_config({}).schedule is None
    assert parse_pipeline_config({"pipeline": {"stages": 2, "activation_checkpoint_interval": 1}}).schedule is None


def test_aliases_resolve_to_the_registered_name() -> None:
    assert parse_pipeline_config({"pipeline": {"schedule": "ONE-F-ONE-B"}}).schedule == "1f1b"


@pytest.mark.parametrize(
    ("block", "needle"),
    [
        ({"schedual": "1f1b"}, "did you mean 'schedule'"),
        ({"schedule": "nope"}, "valid names"),
        ({"schedule": "1f1b", "chunks": 4}, "chunks=1"),
        ({"chunks": 2}, "pipeline.schedule is not"),
        ({"schedule": "1f1b", "memory_limit": 2}, "memory_limit"),
        ({"schedule": "1f1b", "p2p_timeout_s": -1}, "p2p_timeout_s"),
        ({"offload": 0.5}, "pipeline.offload is set but pipeline.schedule is not"),
        ({"schedule": "v-half", "offload": 1.5}, "pipeline.offload"),
    ],
)
def test_bad_blocks_name_the_field_and_the_fix(block: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        parse_pipeline_config({"pipeline": block})


def test_every_field_is_described() -> None:
    assert all(f.description for f in PipelineConfig.model_fields.values())


def test_seq_chunks_follow_the_registry_flag() -> None:
    assert parse_pipeline_config({"pipeline": {"schedule": "zb-h1", "seq_chunks": 4}}).make_schedule(4, 8).seq_chunks == 4
    with pytest.raises(ConfigError, match="seq_chunks applies only to the schedules that cut sequences.*'interleaved'"):
        parse_pipeline_config({"pipeline": {"schedule": "interleaved", "seq_chunks": 2}})
