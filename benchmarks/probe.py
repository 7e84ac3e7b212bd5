"""Per-instruction timing of a pipeline engine: ``Probe`` records each instruction's start and end,
``instrument_engine`` wraps the engine's handlers (``bench_emulated.py``, ``bench_real.py``)."""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable


ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


from benchmarks.emulated import DEVICE  # noqa: E402
from ds_vshape.runtime.measuring.memory import ActivationMeter  # noqa: E402


class Probe:
    """Per-rank measurements of one step: handler times, device time, activation peak."""

    def __init__(self) -> None:
        self.handler_s: dict[str, float] = defaultdict(float)
        self.handler_n: dict[str, int] = defaultdict(int)
        self.durations: dict[str, list[float]] = defaultdict(list)
        self.meter: ActivationMeter | None = None

    def reset(self) -> None:
        self.handler_s.clear()
        self.handler_n.clear()
        self.durations.clear()
        DEVICE.reset()
        if self.meter is not None:
            self.meter.reset_peak()

    def record(self, name: str, seconds: float) -> None:
        self.handler_s[name] += seconds
        self.handler_n[name] += 1
        self.durations[name].append(seconds)

    def snapshot(self) -> dict[str, Any]:
        return {
            "device": DEVICE.snapshot(),
            "handler_s": dict(self.handler_s),
            "handler_n": dict(self.handler_n),
            "handler_median_ms": {k: 1e3 * statistics.median(v) for k, v in self.durations.items()},
            # The fast end of each instruction's times: for a receive, its cost when the data is already there.
            "handler_p10_ms": {k: 1e3 * sorted(v)[len(v) // 10] for k, v in self.durations.items()},
        }


def instrument_engine(engine: Any, probe: Probe, *, meter_forward: bool) -> None:
    """Time every instruction handler; optionally meter saved activations around forwards.

    DeepSpeed dispatches through ``self._INSTRUCTION_MAP``, so an instance attribute of
    the same name takes precedence without touching the class.
    """
    if meter_forward:
        probe.meter = ActivationMeter({p.untyped_storage().data_ptr() for p in engine.module.parameters()})
    wrapped = {}
    for cls, fn in type(engine)._INSTRUCTION_MAP.items():
        wrapped[cls] = _timed(fn, cls.__name__, probe, meter_forward and cls.__name__ == "ForwardPass")
    engine._INSTRUCTION_MAP = wrapped


def _timed(fn: Callable[..., Any], name: str, probe: Probe, meter: bool) -> Callable[..., Any]:
    def handler(self: Any, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            if meter:
                with probe.meter.recording():  # type: ignore[union-attr]
                    return fn(self, *a, **kw)
            return fn(self, *a, **kw)
        finally:
            probe.record(name, time.perf_counter() - t0)

    return handler
