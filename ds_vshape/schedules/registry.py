"""Generators registered by name; ``generate`` is the single way in for the CLI and the runtime.

The built-in generators (``schedules/generators/``) are registered when this module is
imported, from ``generators.builtin_generators()``: the generators never import the registry,
so the import runs one way. A schedule defined outside the package is added with
``@register``, and must be registered before a config naming it is parsed (README, "Adding a
schedule").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import fuse_w
from .costs import Costs
from .generators import Builtin, builtin_generators
from .ir import Schedule
from .validate import validate

__all__ = ["GeneratorInfo", "register", "generate", "get_info", "schedule_names", "split_backward_names", "ScheduleNameError"]

Generator = Callable[..., Schedule]
MinMicroBatches = Callable[[int, int, int], int]


@dataclass(frozen=True)
class GeneratorInfo:
    """A generator and what it accepts.

    ``fixed_chunks``: model stages per rank the schedule always uses (1 linear, 2 V), or None
    when the user picks v (``chunks``, default 2). ``min_micro_batches(p, v, k)``: the smallest m.
    ``zero_stages``: the ZeRO stages the engine runs this schedule with; ``initialize`` refuses
    others and ``ds-vshape list`` shows them (the one place this rule lives). Every built-in
    schedule runs with 0-3, split backward included: the lowering keeps each W pass inside its
    stage's gathered run (ZeRO-3 weights whole) and the stage's gradient reduce after its last W.
    A generator whose lowered passes could not keep that would list fewer stages here.
    ``seq_chunks``: the schedule accepts k > 1 sequence chunks per micro-batch; this flag is
    the one place that says so (config, CLI and ``generate`` all read it).
    ``default_seq_chunks``: the k used when none is asked for (1 unless the schedule's name
    promises chunks, as ``seq1f1b`` does).
    ``split_backward``: the schedule splits backward into B and W passes (``Schedule.uses_split_backward``
    for every p and m); the one place that says which schedules the split-backward options
    (``pipeline.weight_grads_in_b``) apply to (config and ``ds-vshape list`` read it).
    ``uses_costs``: the generator orders its passes for the ``costs`` it is given (``orders_for_costs``
    says for which k: the built-in ones on whole sequences only); ``pipeline.pass_costs`` applies to it.
    ``placement``: the stage-to-rank layout the schedule runs on (``linear``, ``v`` or
    ``looped``); ``"schedule": "auto"`` chooses among the schedules of one placement, since the
    layers are already placed when it chooses.
    ``builtin``: one of the package's own generators, which the unit tier checks over many p and
    m; ``generate`` validates what every other generator returns even under ``check=False``
    (the engine's ``initialize`` generates that way). Set by the registry, never by ``register``.
    """

    name: str
    fn: Generator
    summary: str
    aliases: tuple[str, ...] = ()
    fixed_chunks: int | None = 1
    seq_chunks: bool = False
    default_seq_chunks: int = 1
    split_backward: bool = False
    memory_limit: bool = False
    uses_costs: bool = False
    placement: str = "linear"
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    min_micro_batches: MinMicroBatches = lambda p, v, k: 1
    builtin: bool = False

    def orders_for_costs(self, seq_chunks: int) -> bool:
        """Whether the order depends on the pass costs given, with k sequence chunks (the one place that says)."""
        return self.uses_costs and seq_chunks == 1

    def chunks(self, requested: int | None) -> int:
        if self.fixed_chunks is not None:
            if requested not in (None, self.fixed_chunks):
                raise ValueError(f"schedule {self.name!r} always uses chunks={self.fixed_chunks}; drop 'chunks' or set it to {self.fixed_chunks}")
            return self.fixed_chunks
        if requested is not None and requested < 1:
            raise ValueError(f"chunks must be >= 1, got {requested}")
        return 2 if requested is None else requested


_REGISTRY: dict[str, GeneratorInfo] = {}
_ALIASES: dict[str, str] = {}


class ScheduleNameError(KeyError, ValueError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def register(name: str, **info: object) -> Callable[[Generator], Generator]:
    """Decorator: ``@register("my-1f1b", summary=...)`` adds a schedule defined outside the package.

    Takes the fields of ``GeneratorInfo`` but ``builtin``; registering a name again replaces it.
    """
    if "builtin" in info:
        raise TypeError("register() takes no 'builtin': only the package's own generators are built in")

    def wrap(fn: Generator) -> Generator:
        _add(GeneratorInfo(name=name, fn=fn, **info))  # type: ignore[arg-type]
        return fn

    return wrap


def _add(entry: GeneratorInfo) -> None:
    _REGISTRY[entry.name] = entry
    for alias in entry.aliases:
        _ALIASES[alias] = entry.name


def _register_builtin(generators: tuple[Builtin, ...]) -> None:
    for name, fn, info in generators:
        _add(GeneratorInfo(name=name, fn=fn, builtin=True, **info))


def schedule_names() -> list[str]:
    """Registered names (aliases excluded), in registration order."""
    return list(_REGISTRY)


def get_info(name: str) -> GeneratorInfo:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in _REGISTRY:
        valid = ", ".join(sorted(list(_REGISTRY) + list(_ALIASES)))
        raise ScheduleNameError(f"unknown schedule {name!r}; valid names: {valid}")
    return _REGISTRY[key]


def generate(
    name: str,
    stages: int,
    micro_batches: int,
    *,
    chunks: int | None = None,
    seq_chunks: int | None = None,
    memory_limit: float | None = None,
    costs: Costs | None = None,
    check: bool = True,
    fuse_idle_w: bool = False,
) -> Schedule:
    """Make (and by default validate) the named schedule for p ranks and m micro-batches.

    ``check=False`` skips validation for built-in schedules only: a schedule registered from
    outside is always validated, so a wrong one is refused here with the rank, step and rule
    (``ScheduleError``) rather than deadlocking the engine. ``fuse_idle_w``: each W that fills no
    bubble under ``costs`` runs fused with its B (``fuse_w.fuse_idle_w``).
    """
    info = get_info(name)
    v = info.chunks(chunks)
    k = _seq_chunks(info, seq_chunks)
    if memory_limit is not None and not info.memory_limit:
        raise ValueError(f"schedule {info.name!r} takes no memory_limit; the schedules that do: {_with('memory_limit')}")
    if stages < 2:
        raise ValueError(f"pipeline schedules need at least 2 stages, got {stages}")
    low = info.min_micro_batches(stages, v, k)
    if micro_batches < low:
        raise ValueError(f"schedule {info.name!r} with p={stages}, v={v}, k={k} needs at least {low} micro-batches, got {micro_batches}")
    costs = costs or Costs()
    schedule = info.fn(stages, micro_batches, v=v, k=k, memory_limit=memory_limit, costs=costs)
    schedule = validate(schedule) if check or not info.builtin else schedule
    return fuse_w.fuse_idle_w(schedule, costs=costs) if fuse_idle_w else schedule


def _seq_chunks(info: GeneratorInfo, requested: int | None) -> int:
    if requested is None:
        return info.default_seq_chunks
    if requested == 1:
        return 1
    if not info.seq_chunks:
        raise ValueError(f"schedule {info.name!r} does not cut sequences; seq_chunks applies to: {_with('seq_chunks')}")
    if requested < 1:  # type: ignore[operator]
        raise ValueError(f"seq_chunks must be >= 1, got {requested}")
    return int(requested)  # type: ignore[arg-type]


def split_backward_names() -> list[str]:
    """The registered schedules that split backward (B now, W later)."""
    return [n for n, i in _REGISTRY.items() if i.split_backward]


def _with(flag: str) -> str:
    return ", ".join(n for n, i in _REGISTRY.items() if getattr(i, flag))


_register_builtin(builtin_generators())
