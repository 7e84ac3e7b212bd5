"""Under NCCL's rules (emulated on gloo, tests/distributed/nccl_emulation): the emulation's own
checks, the control, every ds_vshape schedule.

The emulation launch (4 ranks): stock DeepSpeed 1F1B (the control: it runs on NCCL in
production, so it must run here) at PP=4 and PP2xDP2 on plain gloo, then at PP=4 under the
first-contact rule in eager and in lazy mode (first: stock DeepSpeed's transfers share the world
group, whose pairs connect once per process), then eager, then lazy; then the self-checks,
which show the emulation does what torch's ProcessGroupNCCL does.
The ds_vshape launches run under the first-contact rule (a rank's first call with a peer blocks
until the peer's first call with it; the engine's warm-up at initialize makes those calls in one
global order), and the lazy ones under every rule at once (first contact, synchronize, one queue
per rank with CUDA_DEVICE_MAX_CONNECTIONS=1: interleaved and breadth-first then run the global
transfer order): every schedule at p=3, PP=4 and PP2xDP2 against the non-pipelined reference
under both init modes (eager: DeepSpeed on GPUs; lazy: no device bound at init; at p=3 and PP=4
each schedule's two micro-batch counts are shared between the modes, one each), with in-flight
transfer bytes at m=8 and m=32 under the lazy rules; every schedule at p=2 under lazy rules and every rule (the eager
p=2 run is test_engine's, whose launches run under the eager emulation by default) and a step
that fails (last: it wedges its communicator, as it would under NCCL), after which the engine
must refuse.
"""

from __future__ import annotations

from typing import Any

import pytest

from ds_vshape.schedules import generate
from ds_vshape.schedules.first_contact import contact_pairs, warm_up_peers
from ds_vshape.schedules.lowering import programs

from .launch import ALL_RULES, by_case, launch
from .nccl_checks import GROUP_TIMEOUT_S, HELD
from .test_engine import (RUNTIME_SCHEDULES, _assert_parity, _min_m, _parity_cases,
                          test_checkpoint_from_1f1b_loads_under_v_half as _assert_checkpoint_moves)

pytestmark = pytest.mark.distributed

# The control: stock DeepSpeed (deepspeed.initialize, no ds_vshape), plain gloo first. Stock
# DeepSpeed clips per stage, not globally: clipping off keeps the reference exact.
EMULATIONS = ("off", "eager", "lazy")
SHAPES = {"p4": 4, "pp2xdp2": 2}
CONTROL_CASES = [{"name": f"control-{emu}-{shape}", "nccl_control": True, "emulation": emu, "p": p, "m": 4, "clip": 0.0}
                 for emu in EMULATIONS for shape, p in SHAPES.items()]
# Under the first-contact rule too; before the other emulated controls, so the world group's pairs are fresh.
# Lazy runs it with every rule on at once (first contact, synchronize, one queue per rank).
FIRST_CONTACT_CONTROLS = [{"name": f"control-first-contact-{emu}-p4", "nccl_control": True, "emulation": emu, "p": 4, "m": 4,
                           "clip": 0.0, **({"first_contact": True} if emu == "eager" else ALL_RULES)}
                          for emu in ("eager", "lazy")]
# Each of the other rules on its own (eager, PP=4): the synchronize rule, one queue per rank.
RULE_CONTROLS = {rule: {"name": f"control-{rule}-eager-p4", "nccl_control": True, "emulation": "eager", "p": 4, "m": 4,
                        "clip": 0.0, rule.replace("-", "_"): True} for rule in ("synchronize", "one-queue")}
# Their first transfers form a cycle at p >= 3 (rank 0 first receives from rank p-1, ...): only the warm-up lets them run.
LOOPED = ("interleaved", "breadth-first")


# PP2xDP2: p=2 on 4 ranks, each schedule at its smallest m of at least 4.
PP2XDP2_CASES = [{"name": f"pp2xdp2-{n}", "schedule": n, "p": 2, "m": max(_min_m(n, 2), 4)} for n in RUNTIME_SCHEDULES]
# Sends are released as they complete: the bytes in flight do not grow with m.
INFLIGHT_CASES = [
    {"name": f"inflight-{n}-m{m}", "schedule": n, "p": 4, "m": m, "steps": 1, "pipeline": {"measure_memory": True}}
    for n in ("1f1b", "v-zb", "zb-h2") for m in (8, 32)
]
FAILED_STEP = {"name": "failed-step", "schedule": "v-half", "p": 2, "m": 4, "fail_step": True, "pipeline": {"p2p_timeout_s": 3}}


def _rules(mode: str) -> dict[str, bool]:
    """Eager: the first-contact rule; lazy: every rule at once (first contact, synchronize, one
    queue per rank, which sets CUDA_DEVICE_MAX_CONNECTIONS=1 as a Megatron-DeepSpeed job does)."""
    return {"first_contact": True, "synchronize": mode == "lazy", "one_queue": mode == "lazy"}


def _mode_cases(p: int, mode: str) -> list[dict[str, Any]]:
    """Each schedule's parity cases at ``p`` (its smallest m and a larger one) shared between the modes:
    every schedule runs in both, every (schedule, m) in one, and each mode runs small and large m."""
    cases: dict[str, list[dict[str, Any]]] = {}
    for case in _parity_cases(p):
        cases.setdefault(case["schedule"], []).append(case)
    return [pair[(i + (mode == "lazy")) % len(pair)] for i, pair in enumerate(cases.values())]


def _nccl_p4(mode: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # The in-flight bytes run once, under the lazy launch's every rule.
    extra = INFLIGHT_CASES if mode == "lazy" else []
    tmp, cases = tmp_path_factory.mktemp(f"nccl_p4_{mode}"), _mode_cases(4, mode)
    results = by_case(launch(cases + PP2XDP2_CASES + extra, 4, tmp, nccl=mode, **_rules(mode)))
    return {**results, "_mode": mode, "_cases": cases}


@pytest.fixture(scope="module")
def nccl_p4_lazy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _nccl_p4("lazy", tmp_path_factory)


@pytest.fixture(scope="module")
def nccl_p4_eager(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _nccl_p4("eager", tmp_path_factory)


@pytest.fixture(scope="module", params=["eager", "lazy"])
def nccl_p4(request: pytest.FixtureRequest) -> dict[str, Any]:
    return request.getfixturevalue(f"nccl_p4_{request.param}")


@pytest.fixture(scope="module", params=["eager", "lazy"])
def nccl_p3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp(f"nccl_p3_{request.param}")
    cases = _mode_cases(3, request.param)
    return {**by_case(launch(cases, 3, tmp, nccl=request.param, **_rules(request.param))), "_mode": request.param,
            "_cases": cases}


@pytest.fixture(scope="module")
def nccl_p2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("nccl_p2")
    checkpoint = {"name": "save-1f1b-load-v-half", "schedule": "1f1b", "p": 2, "m": 2, "layerspec": True,
                  "checkpoint": {"dir": str(tmp / "ckpt"), "load_as": "v-half"}}
    return by_case(launch(_parity_cases(2) + [checkpoint, FAILED_STEP], 2, tmp, nccl="lazy", **_rules("lazy")))


@pytest.mark.parametrize("name", RUNTIME_SCHEDULES)
def test_every_schedule_under_nccl_rules_p3(nccl_p3: dict, name: str) -> None:
    _assert_schedule_parity(nccl_p3, name)


@pytest.mark.parametrize("case", [c["name"] for c in _parity_cases(2)])
def test_every_schedule_under_nccl_rules_p2(nccl_p2: dict, case: str) -> None:
    _assert_parity(case, nccl_p2[case])


@pytest.mark.parametrize("name", RUNTIME_SCHEDULES)
def test_every_schedule_under_nccl_rules_p4(nccl_p4: dict, name: str) -> None:
    _assert_schedule_parity(nccl_p4, name)


def test_the_modes_share_every_schedules_parity_cases() -> None:
    """Between them the two modes' launches run every parity case at p=3 and p=4, each once."""
    for p in (3, 4):
        both = [c["name"] for mode in ("eager", "lazy") for c in _mode_cases(p, mode)]
        assert sorted(both) == sorted(c["name"] for c in _parity_cases(p)), p
        for mode in ("eager", "lazy"):
            assert sorted(c["schedule"] for c in _mode_cases(p, mode)) == sorted(RUNTIME_SCHEDULES), (p, mode)


def _assert_schedule_parity(results: dict, name: str) -> None:
    """The launch's case of schedule ``name`` matched the non-pipelined reference."""
    [case] = [c for c in results["_cases"] if c["schedule"] == name]
    _assert_parity(f"{case['name']} ({results['_mode']})", results[case["name"]])


def _assert_connected_at_initialize(results: dict, p: int, name: str) -> None:
    """Each rank made a first contact under the rule with each peer its programs exchange with
    (more where the case also carried weights over the world group), and then trained."""
    for case in (c for c in results["_cases"] if c["schedule"] == name):
        pairs = contact_pairs(programs(generate(name, p, case["m"])))
        _assert_parity(case["name"], results[case["name"]])
        for rank, res in enumerate(results[case["name"]]):
            assert res["first_contacts"] >= len(warm_up_peers(pairs, rank)) > 0, (case["name"], rank, res["first_contacts"])


@pytest.mark.parametrize("name", LOOPED)
def test_looped_schedules_connect_every_pair_at_initialize_p3(nccl_p3: dict, name: str) -> None:
    _assert_connected_at_initialize(nccl_p3, 3, name)


@pytest.mark.parametrize("name", LOOPED)
def test_looped_schedules_connect_every_pair_at_initialize_p4(nccl_p4: dict, name: str) -> None:
    _assert_connected_at_initialize(nccl_p4, 4, name)


def _assert_order_adapted(results: dict) -> None:
    """Under one queue per rank (lazy launches) looped schedules ran the global transfer order, the
    rest their default one; under pair communicators every schedule its default one."""
    for case in results["_cases"]:
        for rank, res in enumerate(results[case["name"]]):
            expect = results["_mode"] == "lazy" and case["schedule"] in LOOPED
            assert res["global_order"] is expect, (case["name"], rank, res["global_order"], results["_mode"])


def test_looped_schedules_switch_to_the_global_order_only_under_one_queue_p3(nccl_p3: dict) -> None:
    _assert_order_adapted(nccl_p3)


def test_looped_schedules_switch_to_the_global_order_only_under_one_queue_p4(nccl_p4: dict) -> None:
    _assert_order_adapted(nccl_p4)


@pytest.mark.parametrize("case", [c["name"] for c in PP2XDP2_CASES])
def test_every_schedule_under_nccl_rules_pp2xdp2(nccl_p4: dict, case: str) -> None:
    _assert_parity(case, nccl_p4[case])


@pytest.mark.parametrize("name", ["1f1b", "v-zb", "zb-h2"])
def test_bytes_in_flight_do_not_grow_with_micro_batches(nccl_p4_lazy: dict, name: str) -> None:
    small, large = nccl_p4_lazy[f"inflight-{name}-m8"], nccl_p4_lazy[f"inflight-{name}-m32"]
    _assert_parity(f"inflight-{name}-m8", small)
    _assert_parity(f"inflight-{name}-m32", large)
    # Held until the end of the step, they would grow 4x from m=8 to m=32. Under the emulation
    # a send may also be released early when its thread reports completion, so the two peaks
    # differ by what the threads' timing released; on plain gloo (test_engine) they are equal.
    # The bound is the busiest rank's m=8 peak: a rank's own may be low when completions came early.
    bound = 2 * max(a["peak_inflight_bytes"] for a in small)
    for rank, b in enumerate(large):
        assert 0 < b["peak_inflight_bytes"] <= bound, (rank, b["peak_inflight_bytes"], [a["peak_inflight_bytes"] for a in small])


def test_checkpoint_from_1f1b_loads_under_v_half_under_lazy_rules(nccl_p2: dict) -> None:
    _assert_checkpoint_moves(nccl_p2)


def test_a_failed_step_leaves_an_engine_that_refuses_instead_of_hanging(nccl_p2: dict) -> None:
    for rank, res in enumerate(nccl_p2["failed-step"]):
        assert "errors" in res, res
        first, second = res["errors"]
        assert first is not None, f"rank {rank}: the bad step did not fail"
        assert second is not None and "Rebuild the engine" in second, (rank, second)
        assert f"pipeline rank {rank}" in second and "earlier train/eval step failed" in second, second




@pytest.fixture(scope="module")
def emulation(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("nccl_emulation")
    cases = (CONTROL_CASES[:2] + FIRST_CONTACT_CONTROLS + CONTROL_CASES[2:] + list(RULE_CONTROLS.values())
             + [{"name": "selfcheck", "nccl_selfcheck": True}])
    return by_case(launch(cases, 4, tmp, nccl="eager", first_contact=False, synchronize=False, one_queue=False))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("emu", ["eager", "lazy"])
def test_stock_deepspeed_1f1b_trains_under_nccl_rules(emulation: dict, emu: str, shape: str) -> None:
    name, plain_name = f"control-{emu}-{shape}", f"control-off-{shape}"
    _assert_parity(name, emulation[name])
    _assert_parity(plain_name, emulation[plain_name])
    for rank, (res, plain) in enumerate(zip(emulation[name], emulation[plain_name])):
        assert res["installed"] and res["mode"] == emu and not plain["installed"], (rank, res, plain)
        assert res["losses"] == plain["losses"], f"{name} rank {rank}: {res['losses']} vs plain gloo {plain['losses']}"


@pytest.mark.parametrize("emu", ["eager", "lazy"])
def test_stock_deepspeed_1f1b_trains_under_the_first_contact_rule(emulation: dict, emu: str) -> None:
    name, plain_name = f"control-first-contact-{emu}-p4", "control-off-p4"
    _assert_parity(name, emulation[name])
    for rank, (res, plain) in enumerate(zip(emulation[name], emulation[plain_name])):
        assert res["first_contact_rule"] and res["mode"] == emu, (rank, res)
        assert res["first_contacts"] > 0, f"{name} rank {rank}: no first contact was made under the rule"
        assert res["losses"] == plain["losses"], f"{name} rank {rank}: {res['losses']} vs plain gloo {plain['losses']}"
        # Lazy: every rule at once (first contact, synchronize, one queue per rank).
        assert (res["one_queue_rule"], res["synchronize_rule"]) == ((True, True) if emu == "lazy" else (False, False)), res


@pytest.mark.parametrize("rule", list(RULE_CONTROLS))
def test_stock_deepspeed_1f1b_trains_under_each_rule(emulation: dict, rule: str) -> None:
    name, plain_name = RULE_CONTROLS[rule]["name"], "control-off-p4"
    _assert_parity(name, emulation[name])
    for rank, (res, plain) in enumerate(zip(emulation[name], emulation[plain_name])):
        on = {"synchronize": res["synchronize_rule"], "one-queue": res["one_queue_rule"]}
        assert on == {r: r == rule for r in RULE_CONTROLS} and res["mode"] == "eager", (rank, res)
        assert res["losses"] == plain["losses"], f"{name} rank {rank}: {res['losses']} vs plain gloo {plain['losses']}"


def _check(emulation: dict, rank: int, *keys: str) -> Any:
    res = emulation["selfcheck"][rank]
    assert "error" not in res, f"rank {rank}: {res['error']}\n{res.get('traceback', '')}"
    assert res["installed"], "the emulation was not installed on this rank"
    for key in keys:
        res = res[key]
        assert not (isinstance(res, dict) and "raised" in res), f"rank {rank}, {'/'.join(keys)}: {res['raised']}"
    return res


def _timed_out(error: str | None, *needles: str) -> None:
    assert error is not None, "completed, but NCCL would hang here"
    for needle in ("nccl_emulation", "timed out", *needles):
        assert needle in error, error


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_tags_are_ignored_and_deepspeed_comm_is_emulated(emulation: dict, mode: str) -> None:
    sender, receiver = (_check(emulation, r, mode, "tags") for r in (0, 1))
    assert sender["work_type"] == receiver["work_type"] == "EmulatedWork"
    # Posted with tags 7, 5, 11 against sends tagged 5, 7, 9: matched by order alone.
    assert receiver["received"] == [1.0, 2.0, 3.0] and receiver["recv_returned"] == 0


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_batch_is_one_work_and_a_crossed_exchange_in_it_completes(emulation: dict, mode: str) -> None:
    for rank in (0, 1):
        got = _check(emulation, rank, mode, "batch")
        assert got == {"works": 1, "work_type": "EmulatedWork", "error": None, "received_ok": True}, (rank, got)


@pytest.mark.parametrize(("mode", "kind", "groups"), list(HELD))
def test_a_posted_receive_holds_back_later_sends_on_its_communicator(emulation: dict, mode: str, kind: str,
                                                                    groups: str) -> None:
    key = f"hold-{kind}-{groups}-groups"
    target = _check(emulation, 2, mode, key)
    assert target["before_release"] is not HELD[mode, kind, groups], target
    for rank in (0, 2):  # once rank 1 sent, everything completes
        assert _check(emulation, rank, mode, key)["error"] is None, _check(emulation, rank, mode, key)
    assert target["received"] == [7.0, 7.0]


def test_a_header_sent_in_a_batch_meets_an_unbatched_receive_only_under_eager_init(emulation: dict) -> None:
    sender, receiver = (_check(emulation, r, "eager", "header") for r in (0, 1))
    assert sender["error"] is None and receiver == {"error": None, "received": [3.0] * 4}, (sender, receiver)
    sender, receiver = (_check(emulation, r, "lazy-wedged", "header") for r in (0, 1))
    _timed_out(sender["error"], "batch_isend_irecv", "to rank 1", "'group ")
    _timed_out(receiver["error"], "irecv", "from rank 0", "'pair 0-1 of group ")
    assert receiver["received"] == [0.0] * 4


@pytest.mark.parametrize("mode", ["eager", "lazy"])
@pytest.mark.parametrize("ranks", [(0, 1), (2, 3)], ids=["send-first-big", "recv-first-small"])
def test_crossed_plain_ops_deadlock_like_nccl(emulation: dict, mode: str, ranks: tuple[int, int]) -> None:
    # (0, 1): blocking send then receive on both: rendezvous hangs it.
    # (2, 3): both receives posted before any wait: the ordered queue alone hangs it.
    for rank in ranks:
        _timed_out(_check(emulation, rank, f"{mode}-wedged", "crossed")["error"], f"rank {rank ^ 1}", f"({mode} init)")


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_collective_queues_behind_a_receive_on_its_communicator(emulation: dict, mode: str) -> None:
    # Eager: an unbatched receive; lazy: a batched one (on the group's communicator).
    for rank in (0, 1, 2):
        got = _check(emulation, rank, f"{mode}-wedged", "collective")
        assert got["control"] == [3.0, 3.0], got  # the three ranks can all-reduce
        _timed_out(got["error"], "all_reduce")


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_queued_collective_times_out_with_its_groups_timeout_at_issue(emulation: dict, mode: str) -> None:
    # Held behind rank 0's receive, its blocking all-reduce fails after the group's
    # timeout (GROUP_TIMEOUT_S), not the emulation's longer one: a step's bounded timeout holds
    # for a collective that queues behind a transfer to a dead rank.
    held = _check(emulation, 0, f"{mode}-wedged", "collective-group-timeout")
    _timed_out(held["error"], "all_reduce", f"after {GROUP_TIMEOUT_S:g} s")
    for rank in (1, 2):  # their all-reduce ran, without rank 0: gloo's or the emulation's timeout, whichever first
        assert _check(emulation, rank, f"{mode}-wedged", "collective-group-timeout")["error"] is not None


def test_a_lazy_unbatched_receive_does_not_hold_back_the_groups_collective(emulation: dict) -> None:
    for rank in (0, 1, 2):
        got = _check(emulation, rank, "lazy", "collective-unbatched")
        assert got["error"] is None and got["sum"] == [3.0, 3.0], got
    assert _check(emulation, 0, "lazy", "collective-unbatched")["recv_error"] is None


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_first_call_with_a_peer_blocks_until_the_peers_first_call(emulation: dict, mode: str) -> None:
    got = _check(emulation, 0, mode, "first-call")
    assert got["peer_called_first"] is True, f"rank 0's first call returned before rank 1 made its own: {got}"
    # A second call that blocked would wait for rank 1's, which waits for its return: _check names the timeout.
    assert got["errors"] == [None, None], got
    peer = _check(emulation, 1, mode, "first-call")
    assert peer.get("errors") == [None, None], peer


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_one_queue_a_receive_on_one_communicator_holds_back_a_send_on_another(emulation: dict, mode: str) -> None:
    # The same exchange as hold-batched-two-groups, which is not held without the rule.
    target = _check(emulation, 2, mode, "one-queue-hold")
    assert target["before_release"] is False, target
    assert _check(emulation, 2, mode, "hold-batched-two-groups")["before_release"] is True
    for rank in (0, 2):
        assert _check(emulation, rank, mode, "one-queue-hold")["error"] is None
    assert target["received"] == [7.0, 7.0]


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_synchronize_waits_for_a_posted_receive_only_under_its_rule(emulation: dict, mode: str) -> None:
    waited, free = _check(emulation, 0, mode, "synchronize-waits"), _check(emulation, 0, mode, "synchronize-off")
    assert waited["done_at_return"] and waited["peer_sent"], waited  # it returned after the receive completed
    # Without the rule rank 1 sends only once the synchronize returned: one that waited times out (_check names it).
    assert waited["error"] is None and free["error"] is None
    for name in ("synchronize-waits", "synchronize-off"):
        assert _check(emulation, 1, mode, name)["error"] is None


@pytest.mark.parametrize("mode", ["eager", "lazy"])
def test_a_cycle_of_first_receives_hangs_and_a_warm_up_in_one_order_prevents_it(emulation: dict, mode: str) -> None:
    for rank in (0, 1, 2):
        _timed_out(_check(emulation, rank, f"{mode}-wedged", "cycle")["error"], "first contact", f"({mode} init")
        warmed = _check(emulation, rank, mode, "warmed-cycle")
        assert warmed == {"error": None, "received": [float((rank - 1) % 3)] * 2}, (rank, warmed)
