"""fp16 on any CPU for the test ranks.

DeepSpeed's CPU accelerator reports fp16 as supported only where oneDNN has native fp16
kernels (``torch.ops.mkldnn._is_mkldnn_fp16_supported()``: CPUs with AVX512-FP16), and the
engine refuses an fp16 config otherwise ("Type fp16 is not supported on your device"). The
loss scaling the fp16 tests check is torch arithmetic that runs on every CPU (slower without
those kernels), so the test ranks report fp16 as supported whatever the CPU: a test result
must not depend on the machine that ran it. GPU ranks (tests/gpu) are left alone.
"""

from __future__ import annotations

__all__ = ["allow_cpu_fp16"]


def allow_cpu_fp16() -> None:
    """Make DeepSpeed's CPU accelerator accept fp16 (no effect on other accelerators)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        return
    # On the instance: every caller (engine sanity check, supported_dtypes) goes through it.
    accelerator.is_fp16_supported = lambda: True  # type: ignore[method-assign]
