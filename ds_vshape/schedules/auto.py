"""``"schedule": "auto"``: which schedule to run, decided from measured pass costs.

Pure. The runtime measures, per model stage, the time of F, B and W, the activation bytes
one forward keeps, and the time of one hop between ranks (``Measured``), while a safe
schedule of the model's placement runs. Here those figures become ``Costs`` for the
simulator, every schedule of the same placement is generated and simulated with them, and
the fastest whose activation memory fits the limit wins (``pick``).

The rules live here and in the registry: the placement of each schedule is its registry
entry's ``placement``; the schedule run while measuring is ``SAFE[placement]`` (split
backward where the family has it, so B and W are measured apart; the least memory of its
family otherwise equal).

Activation offload: with ``"offload": "auto"`` (``AutoSettings.offload`` None), a memory limit
and a measured host copy rate, each candidate is also simulated with the shares
``OFFLOAD_SHARES`` (copies timed from that rate) and keeps the fastest share that fits (the
smaller one on a tie); a share given as a number is used as is.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from .costs import Costs
from .ir import Schedule
from .offload import offload_plan
from .registry import generate, get_info, schedule_names
from .simulate import memory_peaks, simulate

__all__ = ["PLACEMENTS", "SAFE", "BOUNDED", "OFFLOAD_SHARES", "AutoSettings", "measuring_schedule", "Measured", "Candidate", "Choice", "candidates", "on_placement", "to_costs",
           "peak_bytes", "pick", "choice_fits", "make_chosen", "AUTO_KEYS", "check_auto_options"]

PLACEMENTS = ("linear", "v", "looped")
# Measured first: split backward (B and W timed apart), and within the family's usual memory.
SAFE = {"linear": "zb-h1", "v": "v-min", "looped": "interleaved"}
# Each placement's generator that keeps a memory limit (M_B): what auto measures under when
# the safe schedule would hold more than the limit.
BOUNDED = {"linear": "zb-auto", "v": "v-adaptive"}
# The offload shares auto tries under a memory limit when none is set.
OFFLOAD_SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
# The config keys that only auto reads.
AUTO_KEYS = ("auto_placement", "auto_warmup_steps", "auto_candidates", "memory_limit_bytes")


@dataclass(frozen=True)
class AutoSettings:
    """What ``auto`` may choose from and within: the config's keys, resolved."""

    placement: str = "v"
    warmup_steps: int = 2
    names: tuple[str, ...] | None = None  # None: every schedule of the placement
    chunks: int | None = None
    seq_chunks: int = 1
    memory_limit: float | None = None  # in M_B
    memory_limit_bytes: float | None = None
    w_memory: float = 1.0
    zero_stage: int = 0
    warmup_schedule: str | None = None  # what the measuring steps run (measuring_schedule); None: SAFE's
    warmup_limit: float | None = None  # its memory limit in M_B, for a BOUNDED one
    offload: float | None = 0.0  # the config's offload share; None ("auto"): auto picks one under a memory limit
    measured_for: str | None = None  # a named schedule with pass_costs "measure" (its own only candidate); None: auto

    @property
    def safe(self) -> str:
        return self.warmup_schedule or SAFE[self.placement]

    @property
    def label(self) -> str:
        """What the user configured, for messages: schedule 'auto' or a schedule measuring its own costs."""
        return "schedule 'auto'" if self.measured_for is None else f"schedule {self.measured_for!r} with pass_costs 'measure'"


@dataclass(frozen=True)
class Measured:
    """Per model stage: median seconds of F, B, W (B and W: the halves of a fused BW when a
    stage ran none apart), activation bytes one F keeps; seconds of one hop; the median
    wall time of a measured step under the safe schedule (0: unknown); and seconds per byte
    of a copy between device and host memory, one way (0: unknown, offload then costs nothing)."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    activation_bytes: tuple[float, ...]
    comm: float = 0.0
    step: float = 0.0
    copy: float = 0.0


@dataclass(frozen=True)
class Candidate:
    name: str
    makespan: float  # seconds: simulated, plus the step's measured time outside the passes
    peak_bytes: float  # the busiest rank's activations, from the measured bytes per stage
    fits: bool
    params: dict = field(default_factory=dict, compare=False)
    offload: float = 0.0


@dataclass(frozen=True)
class Choice:
    """The winner and the table it won against, fastest first."""

    name: str
    predicted_s: float
    costs: Costs
    memory_limit: float | None  # in M_B, as handed to the generators that take one
    table: tuple[Candidate, ...]
    offload: float = 0.0  # the share the chosen schedule runs with

    def summary(self) -> str:
        rows = "; ".join(f"{c.name}{f' offload {c.offload:g}' if c.offload else ''} {c.makespan * 1e3:.2f} ms "
                         f"{c.peak_bytes / 2**20:.2f} MiB{'' if c.fits else ' (over limit)'}" for c in self.table)
        share = f" with offload {self.offload:g}" if self.offload else ""
        return f"{self.name}{share} (predicted step {self.predicted_s * 1e3:.2f} ms; candidates: {rows})"


def check_auto_options(schedule: str, *, placement: str | None, warmup_steps: int | None, names: Sequence[str] | None,
                       chunks: int | None, seq_chunks: int | None, memory_limit: float | None,
                       memory_limit_bytes: float | None, measures: bool = False) -> None:
    """The config rules of auto, as errors that name the key and say what to change. ``measures``: a named
    schedule with pass_costs 'measure', which takes auto_warmup_steps (it measures as auto does) and no other key."""
    if schedule != "auto":
        values = (placement, None if measures else warmup_steps, names, memory_limit_bytes)
        given = [k for k, v in zip(AUTO_KEYS, values) if v is not None]
        if given:
            also = " (auto_warmup_steps also with pipeline.pass_costs 'measure')" if given[0] == "auto_warmup_steps" else ""
            raise ValueError(f"pipeline.{given[0]} applies only with \"schedule\": \"auto\"{also}, not {schedule!r}; remove it")
        return
    family = placement or "v"
    if chunks is not None and family != "looped":
        raise ValueError(f"pipeline.chunks applies to auto only with auto_placement 'looped' (the {family!r} placement fixes "
                         "its chunks); remove chunks or set auto_placement to 'looped'")
    if seq_chunks not in (None, 1) and not get_info(SAFE[family]).seq_chunks:
        raise ValueError(f"pipeline.seq_chunks: no schedule of the {family!r} placement cuts sequences; remove seq_chunks or "
                         "set auto_placement to 'linear' or 'v'")
    if memory_limit is not None and memory_limit_bytes is not None:
        raise ValueError("pipeline.memory_limit and pipeline.memory_limit_bytes are both set; keep one (M_B or bytes)")
    for name in names or ():
        info = get_info(name)  # raises with the valid names
        if info.placement != family:
            raise ValueError(f"pipeline.auto_candidates: {info.name!r} runs on the {info.placement!r} placement, not "
                             f"auto_placement {family!r}; remove it or change auto_placement")


# Cached: the config asks it twice at the front door (the first schedule, then auto's settings), each a
# generation and a simulation; the answer depends on its arguments alone.
@functools.lru_cache(maxsize=64)
def measuring_schedule(placement: str, *, stages: int, micro_batches: int, memory_limit: float | None,
                       chunks: int | None, seq_chunks: int, w_memory: float) -> tuple[str, float | None]:
    """The schedule auto's measuring steps run, and its memory limit (M_B).

    The placement's safe schedule, unless a ``memory_limit`` is set that its simulated peak is
    above: then the placement's memory-bounded generator at that limit, so measuring never holds
    more than the limit the user set. The looped placement has no bounded generator, and below
    what the bounded one can keep the safe schedule is the least there is: then it runs, and
    the choice that follows warns that nothing fits. ``memory_limit_bytes`` cannot be checked
    before anything is measured.
    """
    name = SAFE[placement]
    if memory_limit is None or placement not in BOUNDED:
        return name, None
    costs = Costs(w_memory=w_memory)
    safe = generate(name, stages, micro_batches, chunks=chunks, seq_chunks=seq_chunks, costs=costs, check=False)
    peak = simulate(safe, costs).max_peak_memory
    if peak <= memory_limit * (1 + 1e-9):
        return name, None
    if seq_chunks > 1:
        raise ValueError(f"pipeline.memory_limit {memory_limit:g} M_B is below the {peak:.2f} M_B that auto's measuring "
                         f"schedule {name!r} holds with seq_chunks {seq_chunks}, and no memory-bounded schedule cuts sequences; "
                         "raise memory_limit or drop seq_chunks")
    try:
        generate(BOUNDED[placement], stages, micro_batches, seq_chunks=seq_chunks, memory_limit=memory_limit, costs=costs,
                 check=False)
    except ValueError:  # below the least the placement can hold: that least is the safe schedule's (pick warns)
        return name, None
    return BOUNDED[placement], memory_limit


def on_placement(placement: str, names: Sequence[str] | None = None) -> list[str]:
    """Auto's candidates before k, m and ZeRO are known: ``names`` (default: every registered schedule)
    that run on ``placement``."""
    return [get_info(n).name for n in (names if names is not None else schedule_names())
            if get_info(n).placement == placement]


def candidates(settings: AutoSettings, *, stages: int, micro_batches: int) -> list[str]:
    """The registry's schedules that share the placement and take this k, m and ZeRO stage."""
    out = []
    for name in on_placement(settings.placement, settings.names):
        info = get_info(name)
        if settings.zero_stage not in info.zero_stages:
            continue
        if settings.seq_chunks > 1 and not info.seq_chunks:
            continue
        if info.min_micro_batches(stages, info.chunks(settings.chunks), settings.seq_chunks) <= micro_batches:
            out.append(info.name)
    return out


def to_costs(measured: Measured, *, chunks_per_rank: int, w_memory: float) -> Costs:
    """Simulator costs: F, B, W of a 1/p slice (v chunks) at the stages' mean, each stage's
    total relative to the mean as ``stage_scale``, the hop time as ``comm``, and the time to
    copy one M_B (the stages' bytes over p) to host as ``copy``."""
    mean = [statistics.fmean(x) for x in (measured.f, measured.b, measured.w)]
    total = sum(mean)
    scale = tuple((f + b + w) / total for f, b, w in zip(measured.f, measured.b, measured.w)) if total > 0 else None
    v = chunks_per_rank
    m_b = sum(measured.activation_bytes) * v / len(measured.activation_bytes) if measured.activation_bytes else 0.0
    return Costs(f=mean[0] * v, b=mean[1] * v, w=mean[2] * v, comm=measured.comm, stage_scale=scale, w_memory=w_memory,
                 copy=measured.copy * m_b)


def peak_bytes(schedule: Schedule, stage_bytes: Sequence[float], *, kept_until_w: float,
               offload: float = 0.0) -> tuple[float, ...]:
    """Each rank's peak device activation bytes: the simulator's count, weighted by each stage's
    bytes, with ``offload`` of each rank's activation planned to host (``schedules.offload``)."""
    share = 1.0 / schedule.seq_chunks
    weight = lambda a: share * stage_bytes[a.stage]  # noqa: E731
    return tuple(memory_peaks(actions, weight, kept_until_w=kept_until_w,
                              plan=offload_plan(schedule, r, offload) if offload > 0 else None)[0]
                 for r, actions in enumerate(schedule.ranks))


def pick(settings: AutoSettings, measured: Measured, *, stages: int, micro_batches: int) -> Choice:
    """Simulate every candidate with the measured costs; the fastest within the memory limit.

    When none fits, the one with the least memory, so training goes on (the log says so).
    """
    v = get_info(settings.safe).chunks(settings.chunks)
    costs = to_costs(measured, chunks_per_rank=v, w_memory=settings.w_memory)
    m_b = sum(measured.activation_bytes) / stages  # one micro-batch's activation on a 1/p slice
    limit_bytes = settings.memory_limit_bytes
    if limit_bytes is None and settings.memory_limit is not None:
        limit_bytes = settings.memory_limit * m_b
    limit_mb = settings.memory_limit if settings.memory_limit is not None else (
        limit_bytes / m_b if limit_bytes is not None and m_b > 0 else None)
    overhead = _overhead(settings, measured, costs, stages, micro_batches)
    # Offload only where it is needed (a limit) and can be costed (a measured copy rate).
    tries = OFFLOAD_SHARES if limit_bytes is not None and measured.copy > 0 else (0.0,)
    shares = (settings.offload,) if settings.offload is not None else tries
    table = []
    for name in candidates(settings, stages=stages, micro_batches=micro_batches):
        try:
            schedule = _make(name, settings, stages, micro_batches, costs, limit_mb)
        except ValueError:  # e.g. v-adaptive below its least memory: not a candidate here
            continue
        table.append(_best_share(name, schedule, shares, measured, costs, settings.w_memory, limit_bytes, overhead))
    if not table:
        widen = "widen pipeline.auto_candidates or " if settings.measured_for is None else ""
        raise ValueError(f"{settings.label} found no schedule of placement {settings.placement!r} for p={stages}, "
                         f"m={micro_batches}, k={settings.seq_chunks}; {widen}raise m")
    table.sort(key=lambda c: (not c.fits, c.makespan if c.fits else c.peak_bytes, c.peak_bytes))
    best = table[0]
    return Choice(best.name, best.makespan, costs, limit_mb if get_info(best.name).memory_limit else None, tuple(table),
                  offload=best.offload)


def _best_share(name: str, schedule: Schedule, shares: Sequence[float], measured: Measured, costs: Costs, w_memory: float,
                limit_bytes: float | None, overhead: float) -> Candidate:
    """The schedule at the fastest share that fits the limit (the smaller share on a tie), else at its least memory."""
    options = []
    for share in shares:
        peak = max(peak_bytes(schedule, measured.activation_bytes, kept_until_w=w_memory, offload=share))
        fits = limit_bytes is None or peak <= limit_bytes * (1 + 1e-9)
        makespan = simulate(schedule, costs, offload=share).makespan + overhead
        options.append(Candidate(name, makespan, peak, fits, dict(schedule.params), offload=share))
    return min(options, key=lambda c: (not c.fits, c.makespan if c.fits else c.peak_bytes, c.offload))


def _overhead(settings: AutoSettings, measured: Measured, costs: Costs, stages: int, micro_batches: int) -> float:
    """What a measured step took beyond the simulated passes of the safe schedule: transfers'
    host work, data loading, the optimizer step. Schedules of one placement run the same passes,
    so it is added to each alike; it moves the predicted time, never the choice."""
    if measured.step <= 0:
        return 0.0
    # The order the measuring steps ran: made before anything was measured (equal costs), as the config made it,
    # not the one these costs would give the safe schedule now.
    ran = _make(settings.safe, settings, stages, micro_batches, Costs(w_memory=settings.w_memory), settings.warmup_limit)
    return max(0.0, measured.step - simulate(ran, costs).makespan)


def choice_fits(choice: Choice, settings: AutoSettings, *, stages: int, micro_batches: int) -> bool:
    """Whether ``choice`` (saved by a job, restored by its resumption) is one these settings could make: one of
    their candidates, with their share W keeps, their memory limit (in M_B; a limit in bytes is met by a choice
    only as measured, so any) and their offload share (any, where auto picks it). A resumed job's config may
    differ from the saving one's; a choice it could not have made is measured again, not run."""
    if choice.name not in candidates(settings, stages=stages, micro_batches=micro_batches):
        return False
    if choice.costs.w_memory != settings.w_memory:
        return False
    limit = settings.memory_limit if get_info(choice.name).memory_limit else None
    if settings.memory_limit_bytes is None and choice.memory_limit != limit:
        return False
    return settings.offload is None or choice.offload == settings.offload


def make_chosen(choice: Choice, settings: AutoSettings, *, stages: int, micro_batches: int) -> Schedule:
    """The chosen schedule for m micro-batches: what every rank builds from the broadcast choice."""
    return _make(choice.name, settings, stages, micro_batches, choice.costs, choice.memory_limit)


def _make(name: str, settings: AutoSettings, stages: int, micro_batches: int, costs: Costs, limit_mb: float | None) -> Schedule:
    info = get_info(name)
    return generate(name, stages, micro_batches, chunks=settings.chunks if info.fixed_chunks is None else None,
                    seq_chunks=settings.seq_chunks, memory_limit=limit_mb if info.memory_limit else None, costs=costs)
