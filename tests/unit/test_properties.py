"""Property test: every registered schedule, over a range of p, m, v, k, generates a valid
schedule whose simulation is self-consistent."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import HealthCheck, given, note, reject, settings
from hypothesis import strategies as st

from ds_vshape.schedules import Kind, ScheduleError, generate, get_info, schedule_names, simulate


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    name = draw(st.sampled_from(schedule_names()))
    info = get_info(name)
    p = draw(st.integers(2, 8))
    chunks = draw(st.sampled_from([2, 4])) if info.fixed_chunks is None else None
    seq_chunks = draw(st.sampled_from([2, 4])) if info.seq_chunks else None
    low = info.min_micro_batches(p, info.chunks(chunks), seq_chunks or 1)
    m = draw(st.integers(low, max(low, 4 * p)))
    return {"name": name, "stages": p, "micro_batches": m, "chunks": chunks, "seq_chunks": seq_chunks}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(_cases())
def test_generated_schedules_simulate_consistently(case: dict[str, Any]) -> None:
    note(repr(case))
    try:
        schedule = generate(**case)  # validates
    except ScheduleError:
        raise  # a generator broke its own contract: always a failure
    except ValueError:
        # Constraints the registry info cannot express (e.g. divisibility) are the
        # generator's right to refuse; everything else above must hold.
        reject()
    result = simulate(schedule)

    _assert_every_unit_done_once(schedule, result)
    assert len(result.busy) == case["stages"]
    for busy, timeline in zip(result.busy, result.timeline):
        assert result.makespan >= busy - 1e-9
        for (s0, e0, _), (s1, _, _) in zip(timeline, timeline[1:]):
            assert s0 <= e0 <= s1 + 1e-9  # a rank runs one pass at a time, in order
    assert result.max_peak_memory > 0
    assert 0.0 <= result.bubble_rate < 1.0


def _assert_every_unit_done_once(schedule: Any, result: Any) -> None:
    done = Counter((a.kind, a.unit) for timeline in result.timeline for _, _, a in timeline)
    assert all(n == 1 for n in done.values())
    for s in range(schedule.num_model_stages):
        for i in range(schedule.micro_batches):
            for j in range(schedule.seq_chunks):
                unit = (s, i, j)
                assert done[(Kind.F, unit)] == 1
                fused = done[(Kind.BW, unit)]
                split = (done[(Kind.B, unit)], done[(Kind.W, unit)])
                assert (fused, split) in ((1, (0, 0)), (0, (1, 1)))
    assert sum(done.values()) == sum(len(r) for r in schedule.ranks)
