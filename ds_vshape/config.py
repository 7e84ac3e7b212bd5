"""The ``"pipeline"`` block of a DeepSpeed JSON config, with our keys validated.

DeepSpeed passes unknown ``pipeline`` keys through silently, so a typo such as
``"schedual"`` would quietly train with 1F1B. Here every key of the block must be either one
of ours or one DeepSpeed knows; anything else is an error that suggests the closest name.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .schedules import Costs, Schedule, generate, get_info

__all__ = ["PipelineConfig", "parse_pipeline_config", "ConfigError"]

# DeepSpeed 0.19's own pipeline keys: checked by name only, their values are DeepSpeed's business.
_DEEPSPEED_KEYS = frozenset(
    {"stages", "partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned", "grad_partitioned", "use_reentrant"}
)


class ConfigError(ValueError):
    """A config problem, worded as what to change."""


class PipelineConfig(BaseModel):
    """ds_vshape's keys in ``config["pipeline"]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schedule: str | None = Field(None, description="Schedule name (see `ds-vshape list`); absent means stock DeepSpeed 1F1B.")
    chunks: int | None = Field(None, ge=1, description="Model stages per rank for interleaved / breadth-first (V schedules always use 2).")
    seq_chunks: int | None = Field(None, ge=1, description="Sequence chunks per micro-batch (k), for the schedules that cut sequences (`ds-vshape list`). The simulator and CLI take any k; the engine runs k > 1 only for models built with ds_vshape.hf.pipeline_layers (sequence length a multiple of k, no activation checkpointing).")
    memory_limit: float | None = Field(None, gt=0, description="Activation memory limit in units of M_B (v-adaptive, zb-auto).")
    partition_method: str | None = Field(
        None, description="How layers are cut into stages: 'parameters', 'uniform' or 'type:<regex>'; absent means the "
        "stock PipelineModule's own partition_method (DeepSpeed's default there is 'parameters').")
    p2p_timeout_s: float = Field(300.0, gt=0, description="Seconds a send or receive may take before the step fails with a named error.")
    measure_memory: bool = Field(
        False,
        description="Measure activation memory (saved-tensor hooks, bytes in flight) on every step, into "
        "engine.peak_activation_bytes. Off: only on the steps that log it (every steps_per_print), so other steps "
        "pay nothing for the hooks.",
    )
    w_memory: float = Field(
        0.5, ge=0, le=1,
        description="Share of a micro-batch's activation that split backward keeps from B until W (linear-layer inputs "
        "and output gradients); schedules keep their memory bound counting it. About 0.3-0.6 for transformer layers.",
    )

    def make_schedule(self, stages: int, micro_batches: int, *, check: bool = True) -> Schedule:
        """The schedule this config asks for, for p pipeline ranks and m micro-batches."""
        if self.schedule is None:
            raise ValueError("pipeline.schedule is not set")
        return generate(
            self.schedule, stages, micro_batches, chunks=self.chunks, seq_chunks=self.seq_chunks,
            memory_limit=self.memory_limit, costs=Costs(w_memory=self.w_memory), check=check,
        )

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, value: str | None) -> str | None:
        if value is None:
            return None
        return get_info(value).name  # raises with the list of valid names

    @model_validator(mode="after")
    def _options_fit_schedule(self) -> PipelineConfig:
        if self.schedule is None:
            extra = [k for k in ("chunks", "seq_chunks", "memory_limit") if getattr(self, k) is not None]
            if extra:
                raise ValueError(f"pipeline.{extra[0]} is set but pipeline.schedule is not; add \"schedule\": \"<name>\" or drop {extra[0]}")
            return self
        info = get_info(self.schedule)
        info.chunks(self.chunks)  # raises when the schedule fixes its own chunk count
        if self.seq_chunks not in (None, 1) and not info.seq_chunks:
            raise ValueError(f"pipeline.seq_chunks applies only to the schedules that cut sequences (`ds-vshape list` shows --seq-chunks), not {self.schedule!r}; remove it or pick one of those")
        if self.memory_limit is not None and not info.memory_limit:
            raise ValueError(f"pipeline.memory_limit applies only to v-adaptive and zb-auto, not {self.schedule!r}; remove it")
        return self


def parse_pipeline_config(config: dict[str, Any]) -> PipelineConfig:
    """Validate ``config["pipeline"]``: our keys strictly, DeepSpeed's by name."""
    block = dict(config.get("pipeline") or {})
    ours = set(PipelineConfig.model_fields)
    unknown = [k for k in block if k not in ours and k not in _DEEPSPEED_KEYS]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(ours | _DEEPSPEED_KEYS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(ours | _DEEPSPEED_KEYS))}"
        raise ConfigError(f"unknown key pipeline.{key}{hint}")
    try:
        return PipelineConfig(**{k: v for k, v in block.items() if k in ours})
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "pipeline"
        raise ConfigError(f"pipeline.{where}: {first['msg']}".replace("Value error, ", "")) from None
