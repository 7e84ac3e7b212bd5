"""Under NCCL's p2p rules (emulated on gloo): the control, every schedule, failures.

One launch at 4 ranks under ``launch(..., nccl=True)``: stock DeepSpeed 1F1B (the control: it
runs on NCCL in production, so it must run here) at PP=4 and PP2xDP2; every ds_vshape
schedule at PP=4 and PP2xDP2 against the non-pipelined reference; in-flight transfer bytes
at m=8 and m=32; then the emulator's own checks, last because their deadlock checks wedge
the pairs they use. One launch at 2 ranks: every schedule at p=2, then a step that fails
(last: it wedges its pair, as it would under NCCL), after which the engine must refuse.
"""

from __future__ import annotations

from typing import Any

import pytest

from .launch import launch
from .test_engine import RUNTIME_SCHEDULES, _assert_parity, _by_case, _min_m, _parity_cases

pytestmark = pytest.mark.distributed

# Stock DeepSpeed clips per stage, not globally: clipping off keeps the reference exact.
CONTROL_CASES = [
    {"name": "stock-1f1b-p4-m4", "schedule": None, "p": 4, "m": 4, "clip": 0.0},
    {"name": "stock-1f1b-p4-m8", "schedule": None, "p": 4, "m": 8, "clip": 0.0},
    {"name": "stock-1f1b-pp2xdp2-m4", "schedule": None, "p": 2, "m": 4, "clip": 0.0},
]


# PP2xDP2: p=2 on 4 ranks, each schedule at its smallest m of at least 4.
PP2XDP2_CASES = [{"name": f"pp2xdp2-{n}", "schedule": n, "p": 2, "m": max(_min_m(n, 2), 4)} for n in RUNTIME_SCHEDULES]
# Sends are released as they complete: the bytes in flight do not grow with m.
INFLIGHT_CASES = [
    {"name": f"inflight-{n}-m{m}", "schedule": n, "p": 4, "m": m, "steps": 1, "pipeline": {"measure_memory": True}}
    for n in ("1f1b", "v-zb", "zb-h2") for m in (8, 32)
]
FAILED_STEP = {"name": "failed-step", "schedule": "v-half", "p": 2, "m": 4, "fail_step": True, "pipeline": {"p2p_timeout_s": 3}}


@pytest.fixture(scope="module")
def nccl_p4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("nccl_p4")
    cases = CONTROL_CASES + _parity_cases(4) + PP2XDP2_CASES + INFLIGHT_CASES + [{"name": "selfcheck", "nccl_selfcheck": True}]
    return _by_case(launch(cases, 4, tmp, nccl=True))


@pytest.fixture(scope="module")
def nccl_p2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("nccl_p2")
    return _by_case(launch(_parity_cases(2) + [FAILED_STEP], 2, tmp, nccl=True))


@pytest.mark.parametrize("case", [c["name"] for c in _parity_cases(2)])
def test_every_schedule_under_nccl_rules_p2(nccl_p2: dict, case: str) -> None:
    _assert_parity(case, nccl_p2[case])


@pytest.mark.parametrize("case", [c["name"] for c in _parity_cases(4)])
def test_every_schedule_under_nccl_rules_p4(nccl_p4: dict, case: str) -> None:
    _assert_parity(case, nccl_p4[case])


@pytest.mark.parametrize("case", [c["name"] for c in PP2XDP2_CASES])
def test_every_schedule_under_nccl_rules_pp2xdp2(nccl_p4: dict, case: str) -> None:
    _assert_parity(case, nccl_p4[case])


@pytest.mark.parametrize("name", ["1f1b", "v-zb", "zb-h2"])
def test_bytes_in_flight_do_not_grow_with_micro_batches(nccl_p4: dict, name: str) -> None:
    small, large = nccl_p4[f"inflight-{name}-m8"], nccl_p4[f"inflight-{name}-m32"]
    _assert_parity(f"inflight-{name}-m8", small)
    _assert_parity(f"inflight-{name}-m32", large)
    # Held until the end of the step, they would grow 4x from m=8 to m=32. Under the emulation
    # a send may also be released early when its thread reports completion, so the two peaks
    # differ by what the threads' timing released; on plain gloo (test_engine) they are equal.
    for rank, (a, b) in enumerate(zip(small, large)):
        assert 0 < b["peak_inflight_bytes"] <= 2 * a["peak_inflight_bytes"], (rank, a["peak_inflight_bytes"], b["peak_inflight_bytes"])


def test_a_failed_step_leaves_an_engine_that_refuses_instead_of_hanging(nccl_p2: dict) -> None:
    for rank, res in enumerate(nccl_p2["failed-step"]):
        assert "errors" in res, res
        first, second = res["errors"]
        assert first is not None, f"rank {rank}: the bad step did not fail"
        assert second is not None and "Rebuild the engine" in second, (rank, second)
        assert f"pipeline rank {rank}" in second and "earlier train/eval step failed" in second, second


def _ok(res: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in res, f"{res['error']}\n{res.get('traceback', '')}"
    assert res["installed"], "the emulation was not installed on this rank"
    return res


@pytest.mark.parametrize("case", [c["name"] for c in CONTROL_CASES])
def test_stock_deepspeed_1f1b_runs_under_nccl_rules(nccl_p4: dict, case: str) -> None:
    _assert_parity(case, nccl_p4[case])


def test_tags_are_ignored_and_deepspeed_comm_is_emulated(nccl_p4: dict) -> None:
    sender, receiver = (_ok(r)["tags"] for r in nccl_p4["selfcheck"][:2])
    assert sender["work_type"] == receiver["work_type"] == "EmulatedWork"
    # Posted with tags 7, 5, 11 against sends tagged 5, 7, 9: matched by order alone.
    assert receiver["received"] == [1.0, 2.0, 3.0]
    assert receiver["recv_returned"] == 0


def test_a_pair_runs_its_ops_in_issue_order(nccl_p4: dict) -> None:
    first, second = (_ok(r)["order"] for r in nccl_p4["selfcheck"][:2])
    assert first["received"] == [11.0] * 4 and second["received"] == [10.0] * 4
    assert not first["send_before_recv"], first
    assert first["done_after_s"]["send"] >= first["done_after_s"]["recv"], first


def test_a_batched_exchange_of_big_tensors_completes(nccl_p4: dict) -> None:
    for res in nccl_p4["selfcheck"][:2]:
        assert _ok(res)["batched"] == {"completed": True, "received_ok": True}


@pytest.mark.parametrize("ranks", [(0, 1), (2, 3)], ids=["send-first-big", "recv-first-small"])
def test_crossed_plain_ops_time_out_like_nccl_hangs(nccl_p4: dict, ranks: tuple[int, int]) -> None:
    # (0, 1): both isend before irecv, the classic NCCL deadlock (rendezvous).
    # (2, 3): both irecv before isend: every receive is posted, yet the ordered queue hangs.
    # The first rank to time out exits, so its peer may see the connection close before its
    # own timeout: the exchange must fail on both, and by the emulator's timeout on one.
    errors = []
    for rank in ranks:
        got = _ok(nccl_p4["selfcheck"][rank])["deadlock"]
        assert got["error"] is not None, f"rank {rank}: the crossed exchange completed"
        for needle in ("nccl_emulation", f"rank {rank ^ 1}"):
            assert needle in got["error"], got["error"]
        assert "timed out" in got["error"] or "closed" in got["error"].lower(), got["error"]
        assert not got["second_completed"]
        errors.append(got["error"])
    assert any("timed out" in e for e in errors), errors
