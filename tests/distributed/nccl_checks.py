"""Self-checks of the NCCL emulation (tests/distributed/nccl_emulation) on 4 real gloo ranks.

Run from worker.py. ``run_stock_control`` trains stock DeepSpeed 1F1B (``deepspeed.initialize``
on a ``deepspeed.pipe.PipelineModule``, no ds_vshape) with the emulation off, eager or lazy, and
with the first-contact rule where the case asks (``case["first_contact"]``).
``run_nccl_selfcheck`` shows that the emulation behaves as torch's ProcessGroupNCCL: what one
queue per communicator holds back, what a batch lets through, where lazy init's pair
communicators part ways, what a first contact blocks and how a warm-up in one order avoids it,
what the one-queue rule holds back across communicators, and what a synchronize waits for.
Each check returns what it saw; the pytest side asserts. Every check
uses fresh process groups, so a communicator one wedges (as NCCL would) stays out of the
others' way; the wedging checks run last, and this case must be the launch's last.
"""

from __future__ import annotations

import functools
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import deepspeed
import deepspeed.comm as ds_comm

from ds_vshape.runtime.transfers.comm import P2P as PipelineTransfers
from ds_vshape.schedules.first_contact import warm_up_peers
from tests.distributed import nccl_emulation
from tests.distributed.worker import _build, _config, _data, _param_diff, _reference

__all__ = ["FIRST_CALL_S", "GROUP_TIMEOUT_S", "HELD", "run_nccl_selfcheck", "run_stock_control"]

BIG = 1 << 22  # 16 MiB of float32: far past any eager-send threshold
WAIT_S = 20.0  # for ops that must complete
HOLD_S = 2.0  # how long an op that must be held back is watched (it cannot complete causally)
# Whether rank 0's receive from rank 1 holds back its later send to rank 2 (mode, kind, groups):
# on one communicator it does. Eager: one per group. Lazy: a batch uses the group's, an
# unbatched op its pair's.
HELD = {("eager", "unbatched", "same"): True, ("eager", "batched", "same"): True,
        ("lazy", "unbatched", "same"): False, ("lazy", "batched", "same"): True,
        **{(mode, kind, "two"): False for mode in ("eager", "lazy") for kind in ("unbatched", "batched")}}
DEADLOCK_S = 3.0  # the emulation's timeout in the wedging checks
FIRST_CALL_S = 1.0  # how late rank 1 makes the call rank 0's must wait for (never asserted on)


def run_stock_control(case: dict[str, Any]) -> dict[str, Any]:
    """Stock DeepSpeed 1F1B under ``case["emulation"]`` ("off", "eager", "lazy") vs the reference.

    ``case["first_contact"]``, ``case["synchronize"]``, ``case["one_queue"]`` turn those rules
    on or off (None: the env's); stock DeepSpeed's transfers share the world group, so a case
    under the first-contact rule must come before any other emulated case of its mode in the
    launch, or its pairs are connected already."""
    if case["emulation"] == "off":
        nccl_emulation.uninstall()
    else:
        nccl_emulation.install(mode=case["emulation"], first_contact=case.get("first_contact"),
                               synchronize=case.get("synchronize"), one_queue=case.get("one_queue"))
    p, m, steps = case["p"], case["m"], case.get("steps", 2)
    model, ref, loss_fn = _build(case, p)
    engine, *_ = deepspeed.initialize(model=model, config=_config(dict(case, schedule=None), m))
    data = _data(case, steps, m)
    it = iter(data)
    losses = [engine.train_batch(it).item() for _ in range(steps)]
    return {"installed": nccl_emulation.installed(), "mode": nccl_emulation.mode(), "losses": losses,
            "first_contact_rule": nccl_emulation.first_contact(), "one_queue_rule": nccl_emulation.one_queue(),
            "synchronize_rule": nccl_emulation.synchronize_rule(),
            "ref_losses": _reference(ref, lambda model, x, y: loss_fn(model(x), y), data, m, steps, case["clip"]),
            "param_diff": _param_diff(engine, ref, case)}


def _post(kind: str, tensor: torch.Tensor, peer: int, group: Any, *, batched: bool) -> Any:
    """One op, unbatched or as a batch of one; its Work."""
    fn = dist.isend if kind == "send" else dist.irecv
    if batched:
        (work,) = dist.batch_isend_irecv([dist.P2POp(fn, tensor, peer, group)])
        return work
    return fn(tensor, peer, group=group)


def _completes(work: Any, seconds: float) -> str | None:
    """None when ``work`` completed within ``seconds``, else the emulation's error."""
    try:
        work.wait(timeout=seconds)
        return None
    except RuntimeError as err:
        return str(err)


def _tags_ignored(me: int) -> dict[str, Any]:
    """Receives posted under other tags still get the sends in order; via deepspeed.comm too."""
    if me == 0:
        works = [ds_comm.isend(torch.full((3,), 1.0), 1, tag=5), ds_comm.isend(torch.full((3,), 2.0), 1, tag=7)]
        dist.send(torch.full((3,), 3.0), 1, tag=9)
        for work in works:
            work.wait(timeout=WAIT_S)
        return {"work_type": type(works[0]).__name__}
    bufs = [torch.zeros(3) for _ in range(3)]
    works = [ds_comm.irecv(bufs[0], 0, tag=7), ds_comm.irecv(bufs[1], 0, tag=5)]
    src = dist.recv(bufs[2], 0, tag=11)
    for work in works:
        work.wait(timeout=WAIT_S)
    return {"work_type": type(works[0]).__name__, "received": [b[0].item() for b in bufs], "recv_returned": src}


def _batch_work(me: int) -> dict[str, Any]:
    """(e) one Work for a batch of four ops; (c) a crossed exchange of big tensors in it completes."""
    peer = 1 - me
    out, small, into, back = torch.full((BIG,), float(me)), torch.full((2,), me + 0.5), torch.empty(BIG), torch.empty(2)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer),
                                    dist.P2POp(dist.isend, small, peer), dist.P2POp(dist.irecv, back, peer)])
    error = _completes(works[0], WAIT_S)
    return {"works": len(works), "work_type": type(works[0]).__name__, "error": error,
            "received_ok": bool((into == float(peer)).all()) and back.tolist() == [peer + 0.5] * 2}


def _hold(me: int, groups: Callable[[list[int]], Any], *, batched: bool, same_group: bool, held: bool) -> dict[str, Any]:
    """(a)/(b) Rank 0 posts a receive from rank 1, then a send to rank 2; rank 1 sends only once
    rank 2 has watched its receive (HOLD_S where it should be ``held``, causally sure; WAIT_S
    where not, so a slow machine cannot fake a hold). Returns whether rank 2 got the data."""
    trio = groups([0, 1, 2])
    recv_group, send_group = (trio, trio) if same_group else (groups([0, 1]), groups([0, 2]))
    got: dict[str, Any] = {}
    if me == 0:
        recv = _post("recv", torch.zeros(2), 1, recv_group, batched=batched)
        send = _post("send", torch.full((2,), 7.0), 2, send_group, batched=batched)
    elif me == 2:
        buf = torch.zeros(2)
        work = _post("recv", buf, 0, send_group, batched=batched)
        got["before_release"] = _completes(work, HOLD_S if held else WAIT_S) is None
    _sync()
    if me == 1:
        _post("send", torch.full((2,), 1.0), 0, recv_group, batched=batched).wait(timeout=WAIT_S)
    elif me == 0:
        got["error"] = _completes(recv, WAIT_S) or _completes(send, WAIT_S)
    elif me == 2:
        got["error"] = _completes(work, WAIT_S)
        got["received"] = buf.tolist()
    return got


def _header_meets(me: int, groups: Callable[[list[int]], Any], *, wait_s: float) -> dict[str, Any] | None:
    """(d) Rank 0 sends a header in a batch; rank 1 receives it unbatched on the same group."""
    pair = groups([0, 1])
    if me == 0:
        return {"error": _completes(_post("send", torch.full((4,), 3.0), 1, pair, batched=True), wait_s)}
    if me == 1:
        buf = torch.zeros(4)
        return {"error": _completes(_post("recv", buf, 0, pair, batched=False), wait_s), "received": buf.tolist()}
    return None


def _crossed(me: int, peer: int, group: Any, *, send_first: bool, size: int) -> dict[str, Any]:
    """(c) Two ranks exchange with plain ops in the same order: NCCL hangs, so must we. Send
    first (big, blocking): rendezvous hangs it. Receive first (small, both posted before any
    wait): every receive is posted, yet the ordered queue hangs it (gloo alone would not)."""
    out, into = torch.full((size,), float(me)), torch.empty(size)
    try:
        if send_first:
            dist.send(out, peer, group=group)  # blocking: the emulation's timeout applies
            dist.recv(into, peer, group=group)
        else:
            first, second = dist.irecv(into, peer, group=group), dist.isend(out, peer, group=group)
            first.wait(timeout=DEADLOCK_S)
            second.wait(timeout=DEADLOCK_S)
        return {"error": None}
    except RuntimeError as err:
        return {"error": str(err)}


def _collective_behind(me: int, groups: Callable[[list[int]], Any], *, batched: bool, expect_held: bool) -> dict[str, Any] | None:
    """(f) Rank 0 posts a receive from rank 1 on a group, then ranks 0-2 all-reduce on it. The
    control all-reduce on a fresh group shows the three ranks can all-reduce."""
    control, trio = groups([0, 1, 2]), groups([0, 1, 2])
    if me == 3:
        return None
    ones = torch.ones(2)
    dist.all_reduce(ones, group=control)
    recv = _post("recv", torch.zeros(2), 1, trio, batched=batched) if me == 0 else None
    total = torch.full((2,), float(me))
    work = dist.all_reduce(total, group=trio, async_op=True)
    result = {"control": ones.tolist(), "error": _completes(work, HOLD_S if expect_held else WAIT_S)}
    if not expect_held:  # lazy unbatched: the receive is on a pair communicator of its own
        if me == 1:
            _post("send", torch.ones(2), 0, trio, batched=False).wait(timeout=WAIT_S)
        if me == 0:
            result["recv_error"] = _completes(recv, WAIT_S)
        result["sum"] = total.tolist()
    return result


GROUP_TIMEOUT_S = 1.0  # the group's own timeout in the collective-timeout check (below the emulation's)


def _collective_times_out_with_its_group(me: int, groups: Callable[[list[int]], Any], *, batched: bool) -> dict[str, Any] | None:
    """(f') As (f), the all-reduce blocking, on a group whose timeout is shorter than the
    emulation's: it times out after the group's timeout as it stood at issue, as NCCL's watchdog
    times a collective from its issue with its group's timeout (a step's bounded timeout)."""
    trio = groups([0, 1, 2])
    if me == 3:
        return None
    trio._get_backend(torch.device("cpu"))._set_default_timeout(timedelta(seconds=GROUP_TIMEOUT_S))
    recv = _post("recv", torch.zeros(2), 1, trio, batched=batched) if me == 0 else None
    try:
        dist.all_reduce(torch.ones(2), group=trio)
        return {"error": None, "held": recv is not None}
    except RuntimeError as err:
        return {"error": str(err)}


def _first_call_blocks(me: int, groups: Callable[[list[int]], Any], tag: str) -> dict[str, Any] | None:
    """(g) Rank 0's first call with rank 1 on a fresh group returns only once rank 1 made its own;
    its second call, the pair connected, returns before rank 1 makes its second.

    Proven by order, not by time: rank 1 says so in the store just before its first call, and
    makes its second only once rank 0's second returned. Its first comes FIRST_CALL_S late (a
    first call that did not block would return meanwhile: nothing waits on that time); a second
    call that blocked would wait for a call that waits for it, and time out."""
    pair = groups([0, 1])
    works: list[Any] = []
    _sync()
    if me == 0:
        works.append(_post("recv", torch.zeros(2), 1, pair, batched=True))
        first = _signalled(f"{tag}-1-first")
        works.append(_post("recv", torch.zeros(2), 1, pair, batched=True))
        _signal(f"{tag}-0-second")
        return {"peer_called_first": first, "errors": [_completes(w, WAIT_S) for w in works]}
    if me == 1:
        time.sleep(FIRST_CALL_S)
        _signal(f"{tag}-1-first")
        works.append(_post("send", torch.ones(2), 0, pair, batched=True))
        _await(f"{tag}-0-second")
        works.append(_post("send", torch.ones(2), 0, pair, batched=True))
        return {"errors": [_completes(w, WAIT_S) for w in works]}
    return None


def _cycle_of_first_receives(me: int, groups: Callable[[list[int]], Any], *, warm_up: bool,
                             wait_s: float) -> dict[str, Any] | None:
    """(h) Ranks 0-2, one group per pair: each first posts a receive from the rank before it in a
    cycle, then sends to the rank after it. Without a warm-up, each first call waits for a peer
    that is waiting in its own; after the runtime's warm-up in one global order, it completes."""
    links = {pair: groups(list(pair)) for pair in ((0, 1), (0, 2), (1, 2))}
    if me == 3:
        return None
    mine = {b if a == me else a: group for (a, b), group in links.items() if me in (a, b)}
    prev, nxt = (me - 1) % 3, (me + 1) % 3
    try:
        if warm_up:
            PipelineTransfers(global_rank_of=[0, 1, 2], groups=mine, device=torch.device("cpu"), timeout_s=wait_s,
                              my_rank=me).warm_up(warm_up_peers(links, me))
        buf = torch.zeros(2)
        recv = _post("recv", buf, prev, mine[prev], batched=True)
        send = _post("send", torch.full((2,), float(me)), nxt, mine[nxt], batched=True)
        return {"error": _completes(recv, wait_s) or _completes(send, wait_s), "received": buf.tolist()}
    except RuntimeError as err:  # the emulation raises in the blocked first call
        return {"error": str(err)}


def _synchronize_waits(me: int, groups: Callable[[list[int]], Any], tag: str, *, rule: bool) -> dict[str, Any] | None:
    """(i) Rank 0 posts a receive from rank 1, then calls DeepSpeed's accelerator synchronize().
    Under the synchronize rule (``rule``) the call returns only after the receive completed, as
    on a GPU: rank 1 sends FIRST_CALL_S later (a synchronize that did not wait would return
    first: nothing waits on that time). Without it, the call returns at once (the CPU
    accelerator's does nothing): rank 1 sends only once it returned, so one that waited would
    time out."""
    pair = groups([0, 1])
    _sync()
    if me == 0:
        from deepspeed.accelerator import get_accelerator

        work = _post("recv", torch.zeros(2), 1, pair, batched=True)
        get_accelerator().synchronize()
        got = {"done_at_return": work.is_completed(), "peer_sent": _signalled(f"{tag}-sent")}
        _signal(f"{tag}-returned")
        return {**got, "error": _completes(work, WAIT_S)}
    if me == 1:
        if rule:
            time.sleep(FIRST_CALL_S)
        else:
            _await(f"{tag}-returned")
        _signal(f"{tag}-sent")
        return {"error": _completes(_post("send", torch.ones(2), 0, pair, batched=True), WAIT_S)}
    return None


def _signal(key: str) -> None:
    """Tell the other ranks, through the process group's store (no collective, no emulation)."""
    c10d._get_default_store().set(key, "1")


def _signalled(key: str) -> bool:
    return c10d._get_default_store().check([key])


def _await(key: str) -> None:
    c10d._get_default_store().wait([key], timedelta(seconds=WAIT_S))


def _under(mode: str, timeout_s: float, check: Callable[[], Any], **rules: bool) -> Any:
    """Run ``check`` with the given rules on (every rank switches at the same point), then all off."""
    nccl_emulation.install(mode=mode, timeout_s=timeout_s, **rules)
    try:
        return check()
    finally:
        nccl_emulation.install(mode=mode, timeout_s=timeout_s, **_NO_RULES)


def _under_first_contact(mode: str, timeout_s: float, check: Callable[[], Any]) -> Any:
    """Run ``check`` with the first-contact rule on."""
    return _under(mode, timeout_s, check, first_contact=True)


_NO_RULES = {"first_contact": False, "synchronize": False, "one_queue": False}


_SYNC: Any = None


def _sync() -> None:
    """All four ranks meet (a barrier on a group nothing else uses, so never wedged; its own
    timeout, as the emulation's is short in the wedging checks; torch's own barrier, so that it
    never queues behind a check's entries under the one-queue rule)."""
    nccl_emulation.original("barrier")(group=_SYNC, async_op=True).wait(timeout=3 * WAIT_S)


def _run(checks: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Each check, then all ranks meet: a check that raises on one rank (a broken emulation)
    is recorded and costs its peers a timeout, not the checks after it."""
    out: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            out[name] = check()
        except Exception as err:  # recorded; the pytest side names it
            out[name] = {"raised": f"{type(err).__name__}: {err}"}
        _sync()
    return out


def _run_mode(me: int, mode: str, groups: Callable[[list[int]], Any]) -> dict[str, Any]:
    """The checks that leave no communicator wedged."""
    nccl_emulation.install(mode=mode, timeout_s=WAIT_S, **_NO_RULES)  # these checks cross first calls on purpose
    checks: dict[str, Callable[[], Any]] = {}
    if me < 2:
        checks.update(tags=lambda: _tags_ignored(me), batch=lambda: _batch_work(me))
    for batched in (False, True):
        for same in (True, False):
            kind, where = "batched" if batched else "unbatched", "same" if same else "two"
            checks[f"hold-{kind}-{where}-groups"] = functools.partial(_hold, me, groups, batched=batched, same_group=same,
                                                                     held=HELD[mode, kind, where])
    if mode == "eager":
        checks["header"] = functools.partial(_header_meets, me, groups, wait_s=WAIT_S)
    else:
        checks["collective-unbatched"] = functools.partial(_collective_behind, me, groups, batched=False, expect_held=False)
    if me >= 2:  # every rank runs as many checks (each ends in a _sync)
        checks = {"tags": lambda: None, "batch": lambda: None, **checks}
    # The store keys of a check name its mode and itself (each runs once per mode): the same on every rank.
    checks["first-call"] = functools.partial(_under_first_contact, mode, WAIT_S,
                                             lambda: _first_call_blocks(me, groups, f"{mode}-first-call"))
    checks["warmed-cycle"] = functools.partial(_under_first_contact, mode, WAIT_S, lambda: _cycle_of_first_receives(
        me, groups, warm_up=True, wait_s=WAIT_S))
    checks["one-queue-hold"] = functools.partial(_under, mode, WAIT_S, lambda: _hold(
        me, groups, batched=True, same_group=False, held=True), one_queue=True)
    checks["synchronize-waits"] = functools.partial(
        _under, mode, WAIT_S, lambda: _synchronize_waits(me, groups, f"{mode}-synchronize-waits", rule=True), synchronize=True)
    checks["synchronize-off"] = functools.partial(_synchronize_waits, me, groups, f"{mode}-synchronize-off", rule=False)
    return _run(checks)


def _run_wedging(me: int, mode: str, groups: Callable[[list[int]], Any]) -> dict[str, Any]:
    """The checks that wedge a communicator for good (timeouts, short)."""
    _sync()
    nccl_emulation.install(mode=mode, timeout_s=DEADLOCK_S, **_NO_RULES)
    pairs = groups([0, 1]), groups([2, 3])
    checks: dict[str, Callable[[], Any]] = {
        "crossed": functools.partial(_crossed, me, me ^ 1, pairs[me // 2], send_first=me < 2, size=BIG if me < 2 else 4)}
    if mode == "lazy":
        checks["header"] = functools.partial(_header_meets, me, groups, wait_s=DEADLOCK_S)
    checks["collective"] = functools.partial(_collective_behind, me, groups, batched=mode == "lazy", expect_held=True)
    checks["collective-group-timeout"] = functools.partial(_collective_times_out_with_its_group, me, groups,
                                                           batched=mode == "lazy")
    checks["cycle"] = functools.partial(_under_first_contact, mode, DEADLOCK_S, lambda: _cycle_of_first_receives(
        me, groups, warm_up=False, wait_s=DEADLOCK_S))
    return _run(checks)


def run_nccl_selfcheck(case: dict[str, Any]) -> dict[str, Any]:
    """Both modes' checks, then both modes' wedging checks; needs exactly 4 ranks."""
    global _SYNC
    me = dist.get_rank()
    if dist.get_world_size() != 4:
        raise ValueError(f"rank {me}: the NCCL emulation self-check needs 4 ranks, got {dist.get_world_size()}")
    _SYNC = dist.new_group([0, 1, 2, 3])
    groups = dist.new_group  # every rank makes every group, in the same order
    result: dict[str, Any] = {mode: _run_mode(me, mode, groups) for mode in nccl_emulation.MODES}
    for mode in nccl_emulation.MODES:
        result[f"{mode}-wedged"] = _run_wedging(me, mode, groups)
    result["installed"] = nccl_emulation.installed()
    return result
