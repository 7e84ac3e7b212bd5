"""README's "Adding a schedule", run as it stands, and a user's wrong schedule refused by name.

The example is read out of README.md (its ``python`` block, and the ``text`` block after it as
the expected output), so the README cannot drift from what the code does.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from ds_vshape.config import PipelineConfig
from ds_vshape.schedules import BW, F, Costs, Schedule, ScheduleError, generate, get_info, linear, register, schedule_names
from ds_vshape.schedules import registry

README = Path(__file__).resolve().parents[2] / "README.md"


def _section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.DOTALL)


@pytest.fixture(autouse=True)
def _own_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Schedules registered here must not leak into other tests (auto's candidates, the
    # comparison table and ``ds-vshape list`` iterate over every registered name).
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_ALIASES", dict(registry._ALIASES))
    yield


def test_the_readme_example_runs_and_prints_what_the_readme_shows() -> None:
    section = _section("Adding a schedule")
    [code], [expected] = _blocks(section, "python"), _blocks(section, "text")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{README}:Adding a schedule", "exec"), {"__name__": "readme_example"})
    assert out.getvalue() == expected
    assert "1f1b-late-w" in schedule_names() and not get_info("1f1b-late-w").builtin


def test_the_readme_schedule_is_what_a_config_asks_for_once_registered() -> None:
    exec(compile(_blocks(_section("Adding a schedule"), "python")[0], "README.md", "exec"), {"__name__": "readme_example"})
    schedule = PipelineConfig(schedule="1f1b-late-w").make_schedule(4, 8, check=False)  # as initialize asks for it
    assert schedule.name == "1f1b-late-w" and schedule.uses_split_backward


def _gpipe(name: str, p: int, m: int, *, backwards: int) -> Schedule:
    ranks = tuple(tuple([F(r, i) for i in range(m)] + [BW(r, i) for i in range(backwards)]) for r in range(p))
    return Schedule(name, p, m, 1, 1, linear(p), ranks)


def _drops_the_last_backward(p: int, m: int, **_: object) -> Schedule:
    # A plausible slip: the cool-down loop stops one micro-batch short on every rank.
    return _gpipe("gpipe-short", p, m, backwards=m - 1)


def test_a_wrong_user_schedule_is_refused_even_when_validation_is_skipped() -> None:
    register("gpipe-short", summary="GPipe missing its last backward")(_drops_the_last_backward)
    for check in (True, False):
        with pytest.raises(ScheduleError) as err:
            generate("gpipe-short", 4, 8, check=check)
        assert err.value.rule == "backward-form"
        # The schedule, the rank, the rule and the unit, then the grid.
        assert str(err.value).startswith("gpipe-short: rank 0: [backward-form] unit (0, 7, 0) has neither BW nor both B and W")
    with pytest.raises(ScheduleError, match=r"\[backward-form\]"):  # the path initialize takes
        PipelineConfig(schedule="gpipe-short").make_schedule(4, 8, check=False)


def test_built_in_schedules_are_marked_and_skip_validation_only_when_asked() -> None:
    assert all(get_info(name).builtin for name in schedule_names())
    assert generate("1f1b", 4, 8, check=False) == generate("1f1b", 4, 8)


def test_register_cannot_claim_a_schedule_is_built_in() -> None:
    with pytest.raises(TypeError, match="builtin"):
        register("sneaky", summary="", builtin=True)


def test_a_user_schedule_gets_the_generator_arguments_the_registry_promises() -> None:
    seen: dict[str, object] = {}

    def record(p: int, m: int, *, v: int, k: int, memory_limit: float | None, costs: Costs) -> Schedule:
        seen.update(p=p, m=m, v=v, k=k, memory_limit=memory_limit, costs=costs)
        return _gpipe("recorded", p, m, backwards=m)

    register("recorded", summary="gpipe, recording its arguments")(record)
    generate("recorded", 2, 3)
    assert seen == {"p": 2, "m": 3, "v": 1, "k": 1, "memory_limit": None, "costs": Costs()}
