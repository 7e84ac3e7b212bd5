"""ds_vshape: modern pipeline-parallel schedules for DeepSpeed.

Heavy imports (torch, deepspeed) happen only when the runtime is used, so the schedule
layer and the CLI stay importable on a laptop.
"""

from __future__ import annotations

import sys
from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "initialize", "PipelineModule"]

# DeepSpeed's PipelineModule forgets its partition_method, which initialize honours: have it
# noted on every module built from now on. Only when DeepSpeed is already loaded, so that the
# schedule layer and the CLI stay light.
if "deepspeed.runtime.pipe.module" in sys.modules:
    from .runtime.dropin.module import record_partition_methods

    record_partition_methods()


def __getattr__(name: str) -> Any:
    if name == "initialize":
        from .api import initialize

        return initialize
    if name == "PipelineModule":
        from .runtime.dropin.module import PipelineModule

        return PipelineModule
    raise AttributeError(f"module 'ds_vshape' has no attribute {name!r}")
