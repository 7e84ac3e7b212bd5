"""DeepSpeed layer: module with several stages per rank, engine, instructions, transfers."""

from .engine import VShapeEngine
from .dropin.module import PipelineModule, from_deepspeed_module

__all__ = ["PipelineModule", "VShapeEngine", "from_deepspeed_module"]
