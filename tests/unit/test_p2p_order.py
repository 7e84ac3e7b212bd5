"""The transfer order NCCL needs: one order per pair, receives posted within it, checked.

The sweep runs every schedule for p = 2..8 at several m, train and eval, through the pure
NCCL-rules checker; the hand-built cases show the checker rejects what NCCL would hang on.
"""

from __future__ import annotations

import pytest

from ds_vshape.schedules import generate, get_info, schedule_names
from ds_vshape.schedules.lowering import lower, programs
from ds_vshape.schedules.ops import POSTS, SENDS, WAITS, Op, OpKind
from ds_vshape.schedules.p2p_check import check_transfers, pair_communicator, world_communicator
from ds_vshape.schedules.p2p_order import TransferOrderError, group_crossing, place_posts


def _cases(name: str) -> list[tuple[int, int, dict]]:
    info = get_info(name)
    extra = {"seq_chunks": 2} if info.seq_chunks else {}
    out = []
    for p in range(2, 9):
        low = max(info.min_micro_batches(p, info.chunks(None), extra.get("seq_chunks", 1)), 1)
        out += [(p, m, extra) for m in sorted({low, low + 1, 2 * p, 4 * p})]
    return out


@pytest.mark.parametrize("name", schedule_names())
def test_every_schedule_keeps_nccl_rules_train_and_eval(name: str) -> None:
    for p, m, extra in _cases(name):
        schedule = generate(name, p, m, **extra)
        for train in (True, False):
            check_transfers(programs(schedule, train=train))


def _pair_sequence(ops: list[Op], peer: int) -> list[tuple[str, tuple]]:
    return [("send" if op.kind in SENDS else "recv", op.transfer) for op in ops if op.kind in SENDS | POSTS and op.peer == peer]


def test_both_ranks_of_a_pair_issue_the_same_sequence() -> None:
    progs = programs(generate("v-zb", 4, 8))
    flip = {"send": "recv", "recv": "send"}
    for a in range(4):
        for b in range(a + 1, 4):
            assert [(flip[k], t) for k, t in _pair_sequence(progs[a], b)] == _pair_sequence(progs[b], a)


def test_every_receive_is_posted_once_before_its_wait() -> None:
    for name in ("1f1b", "v-half", "interleaved", "seq1f1b"):
        extra = {"seq_chunks": 2} if name == "seq1f1b" else {}
        for ops in programs(generate(name, 4, 8, **extra)):
            posted: set[tuple] = set()
            for op in ops:
                if op.kind in POSTS:
                    assert op.transfer not in posted
                    posted.add(op.transfer)
                if op.kind in WAITS:
                    assert op.transfer in posted, (name, str(op))
            assert posted == {op.transfer for op in ops if op.kind in WAITS}


def test_lookahead_bounds_the_receives_posted_ahead_in_1f1b() -> None:
    # 1F1B consumes in its senders' order, so the pair order never forces an early post.
    for lookahead in (0, 1, 2, 3):
        for ops in [lower(generate("1f1b", 4, 16), r, lookahead=lookahead) for r in range(4)]:
            open_posts = peak = 0
            for op in ops:
                open_posts += (op.kind in POSTS) - (op.kind in WAITS)
                peak = max(peak, open_posts)
            assert peak <= max(lookahead, 1) + 1, (lookahead, peak)


def _op(kind: OpKind, stage: int, mb: int, peer: int, **kw: object) -> Op:
    return Op(kind, stage, mb, peer=peer, **kw)


def test_checker_rejects_two_ranks_that_both_send_first() -> None:
    # Rank 0 sends activations while rank 1 sends a gradient, each then receiving: with
    # NCCL's rendezvous both sends wait for receives queued behind them.
    rank0 = [_op(OpKind.SEND_ACT, 1, 1, 1), _op(OpKind.POST_GRAD, 0, 0, 1), _op(OpKind.RECV_GRAD, 0, 0, 1)]
    rank1 = [_op(OpKind.SEND_GRAD, 0, 0, 0), _op(OpKind.POST_ACT, 1, 1, 0), _op(OpKind.RECV_ACT, 1, 1, 0)]
    with pytest.raises(TransferOrderError, match="disagree on their transfer order at position 0"):
        check_transfers([rank0, rank1])


def test_checker_finds_a_cycle_through_three_ranks() -> None:
    # Each rank waits for its left neighbour before sending to its right one.
    ranks = [
        [_op(OpKind.POST_ACT, r, 0, (r - 1) % 3), _op(OpKind.RECV_ACT, r, 0, (r - 1) % 3),
         _op(OpKind.SEND_ACT, (r + 1) % 3, 0, (r + 1) % 3)]
        for r in range(3)
    ]
    with pytest.raises(TransferOrderError, match="deadlock"):
        check_transfers(ranks)


def _shapes_cycle(header: bool) -> list[list[Op]]:
    # Pairs mirror. Rank 1 posts activations from rank 0, sends a gradient back to rank 0,
    # then sends to rank 2; rank 2 forwards to rank 0, which only then sends to rank 1.
    return [
        [_op(OpKind.POST_ACT, 0, 0, 2), _op(OpKind.RECV_ACT, 0, 0, 2), _op(OpKind.SEND_ACT, 1, 0, 1),
         _op(OpKind.POST_GRAD, 0, 0, 1), _op(OpKind.RECV_GRAD, 0, 0, 1)],
        [_op(OpKind.POST_ACT, 1, 0, 0, header=header), _op(OpKind.SEND_GRAD, 0, 0, 0), _op(OpKind.SEND_ACT, 2, 0, 2),
         _op(OpKind.RECV_ACT, 1, 0, 0)],
        [_op(OpKind.POST_ACT, 2, 0, 1), _op(OpKind.RECV_ACT, 2, 0, 1), _op(OpKind.SEND_ACT, 0, 0, 0)],
    ]


def test_checker_blocks_the_host_on_unread_shapes() -> None:
    # Without shapes to read, rank 1's sends only queue and everything completes. When its
    # receive brings the shapes, rank 1 must read them before its next operation with
    # rank 0, which never sends before rank 2 has heard from rank 1: a deadlock.
    check_transfers(_shapes_cycle(header=False))
    with pytest.raises(TransferOrderError, match="deadlock"):
        check_transfers(_shapes_cycle(header=True))


def test_a_post_is_grouped_with_the_send_after_it_unless_it_brings_shapes() -> None:
    post = _op(OpKind.POST_GRAD, 0, 1, 1)
    send = _op(OpKind.SEND_ACT, 1, 2, 1)
    assert group_crossing([post, send])[0].with_next
    assert not group_crossing([Op(OpKind.POST_GRAD, 0, 1, peer=1, header=True), send])[0].with_next
    assert not group_crossing([post, _op(OpKind.SEND_ACT, 1, 2, 2)])[0].with_next  # another peer
    assert str(group_crossing([post, send])[0]).endswith("+next")


def test_place_posts_refuses_an_order_the_rank_cannot_follow() -> None:
    # The pair order says rank 0 receives micro-batch 0's gradient before sending
    # micro-batch 1's activations, but rank 0 sends first and waits later: it cannot post
    # the receive after the send (the order) and before it (the wait needs it first).
    ops = [_op(OpKind.RECV_GRAD, 0, 0, 1), _op(OpKind.SEND_ACT, 1, 1, 1)]
    order = {(0, 1): ((0, ("act", 1, 1, 0)), (1, ("grad", 0, 0, 0)))}
    with pytest.raises(TransferOrderError, match="pipeline rank 0"):
        place_posts(ops, 0, order)


def _deadlocks(schedule_name: str, p: int, m: int, **extra: object) -> bool:
    try:
        check_transfers(programs(generate(schedule_name, p, m, **extra)), communicator=world_communicator)
    except TransferOrderError:
        return True
    return False


def test_one_shared_group_would_deadlock_looped_schedules_that_pair_groups_run() -> None:
    # What the runtime did before pair groups: every transfer on the world group, one stream
    # per rank. A receive posted from one neighbour then holds back the send to the other.
    for name in ("interleaved", "breadth-first"):
        p = 4
        m = max(get_info(name).min_micro_batches(p, get_info(name).chunks(None), 1), 2 * p)
        assert _deadlocks(name, p, m), name
        check_transfers(programs(generate(name, p, m)), communicator=pair_communicator)


def test_neighbour_pairs_follow_the_placement() -> None:
    from ds_vshape.runtime.transfers.p2p_groups import neighbour_pairs

    assert neighbour_pairs((0, 1, 2, 3)) == [(0, 1), (1, 2), (2, 3)]
    assert neighbour_pairs((0, 1, 2, 3, 3, 2, 1, 0)) == [(0, 1), (1, 2), (2, 3)]  # V: the turn stays local
    assert neighbour_pairs((0, 1, 2, 0, 1, 2)) == [(0, 1), (0, 2), (1, 2)]  # looped: the wrap-around pair
    assert neighbour_pairs((0, 1, 0, 1)) == [(0, 1)]  # p=2: wrap-around is the same pair
