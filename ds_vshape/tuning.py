"""Config types for what ds_vshape measures before it decides: the sample micro-batch of
``partition_method: "profile"``. Validated like the rest of the ``"pipeline"`` block (unknown
keys are errors); kept apart from ``config.py`` so that module stays one table of keys.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["SampleTensor", "ProfileSample", "INTEGER_DTYPES"]

INTEGER_DTYPES = frozenset({"int64", "int32"})


class SampleTensor(BaseModel):
    """One tensor of the sample micro-batch: shape, dtype and, for token ids, their range."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shape: tuple[int, ...] = Field(
        ..., min_length=1, description="Shape of the tensor for one micro-batch, rows first, e.g. [4, 512] for 4 sequences of 512 tokens.")
    dtype: Literal["float32", "float16", "bfloat16", "int64", "int32"] = Field(
        "float32", description="Element type; int64 for token ids and class labels.")
    high: int | None = Field(
        None, ge=1, description="Integer tensors only: values are drawn from [0, high), e.g. the vocabulary size; required for them.")

    @model_validator(mode="after")
    def _integers_need_a_range(self) -> SampleTensor:
        if any(d < 1 for d in self.shape):
            raise ValueError(f"shape {list(self.shape)} has a dimension below 1; every dimension must be >= 1")
        if self.dtype in INTEGER_DTYPES and self.high is None:
            raise ValueError(f"dtype {self.dtype} needs 'high' (values are drawn from [0, high), e.g. the vocabulary size)")
        if self.dtype not in INTEGER_DTYPES and self.high is not None:
            raise ValueError(f"'high' applies to integer dtypes only, not {self.dtype}; remove it")
        return self


class ProfileSample(BaseModel):
    """The micro-batch that ``partition_method: "profile"`` runs through every layer once."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    inputs: SampleTensor | tuple[SampleTensor, ...] = Field(
        ..., description="What the first layer receives (batch[0]): one tensor, or a list for a tuple of tensors.")
    labels: SampleTensor | tuple[SampleTensor, ...] | None = Field(
        None, description="What the loss receives (batch[1]); absent means the same spec as inputs (token ids as their own labels).")
