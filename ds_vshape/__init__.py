"""ds_vshape: modern pipeline-parallel schedules for DeepSpeed.

Heavy imports (torch, deepspeed) happen only when the runtime is used, so the schedule
layer and the CLI stay importable on a laptop.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "initialize", "PipelineModule"]


def __getattr__(name: str) -> Any:
    if name == "initialize":
        from .api import initialize

        return initialize
    if name == "PipelineModule":
        from .runtime.module import PipelineModule

        return PipelineModule
    raise AttributeError(f"module 'ds_vshape' has no attribute {name!r}")
