"""Measured decisions on real ranks: ``partition_method: "profile"`` and ``"schedule": "auto"``.

One launch at 2 ranks; every training case against the plain reference (fp32, 1e-5).
"""

from __future__ import annotations

from typing import Any

import pytest

from ds_vshape.schedules import Costs, Schedule, generate
from ds_vshape.schedules.cut_refine import profile_cut
from ds_vshape.schedules.partition import LayerCost

from .launch import ALL_RULES, by_case, launch
from .test_engine import _assert_parity

pytestmark = pytest.mark.distributed
HEAVY_AT = 5  # tuning_checks.HEAVY_AT (not imported: that module imports deepspeed)

SAMPLE = {"inputs": {"shape": [4, 8]}}  # worker.ROWS rows of worker.DIM features; labels alike
PROFILE = {"partition_method": "profile", "profile_sample": SAMPLE}
# No slack for memory: the heavy cases assert the time-optimal cut, exact on the measured costs.
FASTEST = {**PROFILE, "profile_time_slack": 0.0}

PROFILE_CASES = [
    # Layer 5 costs many times the others: 1F1B at p=2 gives it a stage with the two after it.
    {"name": "profile-1f1b-heavy", "tuning_check": "profile", "schedule": "1f1b", "p": 2, "m": 4, "heavy": True,
     "tuning": FASTEST},
    # V at p=2: rank 1 holds the middle stages, rank 0 both ends; the heavy layer goes to
    # rank 1 with a single other layer (the least it can hold), rank 0 takes the other six.
    {"name": "profile-v-half-heavy", "tuning_check": "profile", "schedule": "v-half", "p": 2, "m": 4, "heavy": True,
     "tuning": FASTEST},
    # Tied embedding and head, token ids; the sample is training_data's first micro-batch.
    {"name": "profile-v-zb-tied-training-data", "tuning_check": "profile", "schedule": "v-zb", "p": 2, "m": 4,
     "tied": True, "layers": 6, "training_data": True, "tuning": {"partition_method": "profile"}},
    {"name": "profile-refused-no-sample", "tuning_check": "refused", "schedule": "v-half", "p": 2, "m": 4,
     "tuning": {"partition_method": "profile"}},
    # The loss cannot take these labels: the last rank fails, and every rank must say so.
    {"name": "profile-refused-bad-labels", "tuning_check": "refused", "schedule": "1f1b", "p": 2, "m": 4,
     "tuning": {"partition_method": "profile", "profile_sample": {**SAMPLE, "labels": {"shape": [4, 5]}}}},
]

AUTO_CASES = [
    # The default V placement, its layers cut by measured costs: two steps of v-min, then the pick.
    {"name": "auto-v-profile", "tuning_check": "auto", "schedule": "auto", "p": 2, "m": 4, "tuning": PROFILE},
    # Linear placement within 2 M_B: ZB-H2 (2p-1 = 3 M_B at its peak) must be ruled out.
    {"name": "auto-linear-limit", "tuning_check": "auto", "schedule": "auto", "p": 2, "m": 4,
     "tuning": {"auto_placement": "linear", "memory_limit": 2.0}},
    # A named V schedule that measures its own passes, then runs its order for them (custom autograd Functions).
    {"name": "measure-v-zb", "tuning_check": "auto", "schedule": "v-zb", "p": 2, "m": 8, "custom": True,
     "tuning": {"pass_costs": "measure", "w_memory": 1.0}},
    # Under its memory limit, measured under its own equal-cost order at that limit.
    {"name": "measure-v-adaptive", "tuning_check": "auto", "schedule": "v-adaptive", "p": 2, "m": 8,
     "tuning": {"pass_costs": "measure", "w_memory": 1.0, "memory_limit": 2.0}},
    # With post-validation speculating from the first step: steps overlap across the measuring and the switch.
    {"name": "measure-v-zb-post-validation", "tuning_check": "auto", "schedule": "v-zb", "p": 2, "m": 8, "custom": True,
     "tuning": {"pass_costs": "measure", "w_memory": 1.0, "post_validation": True, "speculate_after": 0}},
]
V_FAMILY = {"v-min", "v-half", "v-zb", "v-adaptive"}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return by_case(launch(PROFILE_CASES + AUTO_CASES, 2, tmp_path_factory.mktemp("tuning")))


NCCL_CASES = ["profile-v-half-heavy", "auto-v-profile", "auto-linear-limit", "measure-v-zb-post-validation"]


@pytest.fixture(scope="module")
def results_nccl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Profiling's collectives, auto's ping-pong hop and its switch of schedules under the NCCL
    emulation (eager init: one ordered queue per process group)."""
    cases = [c for c in PROFILE_CASES + AUTO_CASES if c["name"] in NCCL_CASES]
    return by_case(launch(cases, 2, tmp_path_factory.mktemp("tuning-nccl"), nccl="lazy", **ALL_RULES))


@pytest.mark.parametrize("case", NCCL_CASES)
def test_profile_and_auto_match_the_reference_under_nccl_rules(results_nccl: dict, case: str) -> None:
    _assert_parity(case, results_nccl[case])
    assert len({str(r.get("parts")) for r in results_nccl[case]}) == 1, "every rank runs the same cut"
    assert len({str(r.get("choice")) for r in results_nccl[case]}) == 1, "every rank runs the same choice"


def _trained(results: dict, name: str, *, slack: float = 0.02) -> list[dict[str, Any]]:
    """Parity, one cut on every rank, and that cut is the pure cut of the measured costs (refined for the
    schedule where a rank holds several stages)."""
    ranks = results[name]
    _assert_parity(name, ranks)
    assert all(r["method"] == "profile" for r in ranks), ranks
    assert ranks[0]["parts"] == ranks[1]["parts"], f"{name}: ranks cut differently: {[r['parts'] for r in ranks]}"
    costs = [LayerCost(*c) for c in ranks[0]["costs"]]
    assert all(r["costs"] == ranks[0]["costs"] for r in ranks), "every rank holds the same measured costs"
    schedule = Schedule.from_json(ranks[0]["schedule"])
    assert list(schedule.stage_to_rank) == ranks[0]["placement"]
    cut = profile_cut(costs, schedule, inflight=ranks[0]["inflight"], time_slack=slack)
    assert list(cut.parts) == ranks[0]["parts"], (cut, ranks[0]["costs"])
    return ranks


def _heavy_measured(ranks: list[dict[str, Any]]) -> None:
    times = [c[0] for c in ranks[0]["costs"]]
    others = sorted(t for i, t in enumerate(times) if i != HEAVY_AT)
    assert times[HEAVY_AT] > 5 * others[len(others) // 2], f"layer {HEAVY_AT} should measure far slower: {times}"


def test_profile_gives_the_heavy_layer_a_light_stage_under_1f1b(results: dict) -> None:
    ranks = _trained(results, "profile-1f1b-heavy", slack=0.0)
    _heavy_measured(ranks)
    assert ranks[0]["parts"] == [0, 5, 8]  # uniform would be [0, 4, 8]


def test_profile_balances_the_ranks_of_a_v(results: dict) -> None:
    ranks = _trained(results, "profile-v-half-heavy", slack=0.0)
    _heavy_measured(ranks)
    parts = ranks[0]["parts"]
    # Stages 1 and 2 (rank 1) hold layers parts[1]..parts[3]: the heavy layer 5 and one more.
    assert parts[3] - parts[1] == 2 and parts[1] <= 5 < parts[3], parts


def test_profile_takes_the_sample_from_training_data(results: dict) -> None:
    parts = _trained(results, "profile-v-zb-tied-training-data")[0]["parts"]
    assert len(parts) == 5 and parts[0] == 0 and parts[-1] == 6


@pytest.mark.parametrize(("case", "needle"), [("profile-refused-no-sample", "pass training_data"),
                                              ("profile-refused-bad-labels", "measuring layer 7")])
def test_profile_refusals_reach_every_rank(results: dict, case: str, needle: str) -> None:
    for rank, res in enumerate(results[case]):
        assert "error" not in res, f"{case} rank {rank}: {res['error']}\n{res.get('traceback', '')}"
        assert res["refused"] and needle in res["refused"], (rank, res["refused"])


def _auto(results: dict, name: str, safe: str) -> list[dict[str, Any]]:
    ranks = results[name]
    _assert_parity(name, ranks)  # across the switch of schedules
    choice = ranks[0]["choice"]
    for rank, res in enumerate(ranks):
        assert res["choice"] == choice, f"{name}: rank {rank} chose {res['choice']}, rank 0 {choice}"
        assert res["names"] == [safe, safe, choice, choice], (rank, res["names"])
        assert res["predicted_s"] > 0 and res["step_s"] > 0, res
    return ranks


def test_auto_measures_under_v_min_then_runs_the_fastest_v_schedule(results: dict) -> None:
    ranks = _auto(results, "auto-v-profile", "v-min")
    table = ranks[0]["table"]
    assert ranks[0]["choice"] in V_FAMILY and {row[0] for row in table} == V_FAMILY, table
    assert table[0][0] == ranks[0]["choice"] and table[0][1] == min(row[1] for row in table)
    assert ranks[0]["method"] == "profile" and ranks[0]["parts"] == ranks[1]["parts"]


def test_auto_keeps_within_the_memory_limit(results: dict) -> None:
    ranks = _auto(results, "auto-linear-limit", "zb-h1")
    table = {row[0]: row for row in ranks[0]["table"]}
    assert table[ranks[0]["choice"]][3], f"the choice must fit: {table}"
    assert not table["zb-h2"][3] and not table["gpipe"][3], table


@pytest.mark.parametrize(("case", "name", "limit"), [("measure-v-zb", "v-zb", None), ("measure-v-adaptive", "v-adaptive", 2.0),
                                                     ("measure-v-zb-post-validation", "v-zb", None)])
def test_pass_costs_measure_runs_the_schedule_then_its_order_for_the_measured_costs(results: dict, case: str, name: str,
                                                                                    limit: float | None) -> None:
    """Two steps of the schedule's equal-cost order (the first timed), then its order for what they measured."""
    ranks = _auto(results, case, name)
    assert [row[0] for row in ranks[0]["table"]] == [name]
    costs = {k: tuple(v) if isinstance(v, list) else v for k, v in ranks[0]["costs"].items()}
    measured = Costs(**costs)
    assert measured.w_memory == 1.0 and measured.comm > 0, measured
    want = generate(name, 2, 8, costs=measured, memory_limit=limit)
    if name == "v-zb":
        # A hop over gloo costs a good share of a pass here: far from the slot model, a greedy order wins.
        assert want.params.get("picked") is not None, f"the block won for the measured {measured}"
    for rank, res in enumerate(ranks):
        assert res["picked"][:2] == [None, None], (rank, res["picked"])  # measured under the block
        assert res["picked"][2:] == [want.params.get("picked")] * 2, (rank, res["picked"], want.params.get("picked"))
        assert Schedule.from_json(res["ran"]).ranks == want.ranks, f"rank {rank} ran another order than the costs give"
