"""Each lowering pass alone, then the chain, on small hand-built schedules."""

from __future__ import annotations

import pytest

from ds_vshape.schedules import BW, B, F, Schedule, W, generate
from ds_vshape.schedules.ops import split_units
from ds_vshape.schedules.lowering import (
    Op, OpKind, add_communication, add_data_loading, add_step_tail, assign_buffers, lower, merge_backward,
)


def test_merge_backward_fuses_only_adjacent_pairs_of_the_same_unit() -> None:
    actions = (F(0, 0), B(0, 0), W(0, 0), F(0, 1), B(0, 1), F(0, 2), W(0, 1))
    assert merge_backward(actions) == (F(0, 0), BW(0, 0), F(0, 1), B(0, 1), F(0, 2), W(0, 1))


def test_no_fusion_where_the_input_gradient_leaves_the_rank() -> None:
    actions = (F(1, 0), B(1, 0), W(1, 0))
    assert merge_backward(actions, sends_grad=frozenset({1})) == actions
    # Through the whole chain: rank 1 of zb-h1 sends every input gradient to rank 0.
    ops = lower(generate("zb-h1", 2, 4), 1)
    assert OpKind.BACKWARD not in [op.kind for op in ops]
    send_after_b = [ops[i + 1].kind for i, op in enumerate(ops) if op.kind is OpKind.BACKWARD_INPUT]
    assert set(send_after_b) == {OpKind.SEND_GRAD}


def test_communication_is_added_only_between_ranks() -> None:
    # V placement for p=2: stages 0,3 on rank 0, stages 1,2 on rank 1; 1 -> 2 is a local hand-off.
    sched = generate("1f1b", 2, 2)
    ops = add_communication(sched, 0, sched.ranks[0])
    kinds = [op.kind for op in ops]
    assert kinds.count(OpKind.SEND_ACT) == 2 and kinds.count(OpKind.RECV_GRAD) == 2
    assert OpKind.RECV_ACT not in kinds and OpKind.SEND_GRAD not in kinds
    v = Schedule.from_text(["0F0 3F0 3BW0 0BW0", "1F0 2F0 2BW0 1BW0"], name="v", micro_batches=1, stage_to_rank=[0, 1, 1, 0])
    rank1 = add_communication(v, 1, v.ranks[1])
    assert [op.kind for op in rank1] == [
        OpKind.RECV_ACT, OpKind.FORWARD, OpKind.FORWARD, OpKind.SEND_ACT,
        OpKind.RECV_GRAD, OpKind.BACKWARD, OpKind.BACKWARD, OpKind.SEND_GRAD,
    ]
    assert rank1[3].stage == 3 and rank1[3].peer == 0  # the send names the consuming stage


def test_data_is_loaded_in_order_before_first_use() -> None:
    sched = generate("gpipe", 2, 3)
    ops = add_data_loading(sched, add_communication(sched, 1, sched.ranks[1]))
    loads = [op.micro_batch for op in ops if op.kind is OpKind.LOAD]
    assert loads == [0, 1, 2]
    first_fwd = next(i for i, op in enumerate(ops) if op.kind is OpKind.FORWARD)
    assert ops[first_fwd - 1].kind in (OpKind.LOAD, OpKind.RECV_ACT)


def test_buffers_are_reused_and_count_the_peak_in_flight() -> None:
    sched = generate("1f1b", 4, 8)
    ops = assign_buffers(add_communication(sched, 0, sched.ranks[0]))
    used = {op.buffer for op in ops if op.buffer is not None}
    assert used == set(range(4))  # rank 0 of 1F1B holds p micro-batches at most
    gpipe = generate("gpipe", 4, 8)
    assert len({op.buffer for op in assign_buffers(add_communication(gpipe, 0, gpipe.ranks[0])) if op.buffer is not None}) == 8


def test_step_tail_and_forward_only_lowering() -> None:
    assert [op.kind for op in add_step_tail([])] == [OpKind.REDUCE_TIED_GRADS, OpKind.REDUCE_GRADS, OpKind.OPTIMIZER_STEP]
    sched = generate("zb-h1", 2, 4)
    ops = lower(sched, 1, train=False)
    assert all(op.kind in (OpKind.LOAD, OpKind.POST_ACT, OpKind.RECV_ACT, OpKind.FORWARD, OpKind.SEND_ACT, OpKind.GATHER_PARAMS,
                           OpKind.RELEASE_PARAMS) for op in ops)
    assert [op.kind for op in ops if op.kind in (OpKind.GATHER_PARAMS, OpKind.RELEASE_PARAMS)] == [
        OpKind.GATHER_PARAMS, OpKind.RELEASE_PARAMS]  # one run of forwards: ZeRO-3 gathers the stage once
    assert str(Op(OpKind.FORWARD, 1, 3, buffer=0)) == "forward s1 mb3 buf0"


def _links(ops: list[Op], kinds: tuple[OpKind, ...]) -> dict[tuple[OpKind, int], list[int]]:
    out: dict[tuple[OpKind, int], list[int]] = {}
    for op in ops:
        if op.kind in kinds and op.header:
            out.setdefault((op.kind, op.stage), []).append(op.micro_batch)
    return out


def test_one_shape_header_per_link_and_step_on_both_sides() -> None:
    for name, p, m in [("1f1b", 4, 8), ("v-zb", 4, 8), ("v-min", 4, 8), ("interleaved", 2, 4), ("zb-h2", 3, 6)]:
        sched = generate(name, p, m)
        per_rank = [lower(sched, r) for r in range(p)]
        sent = {k: v for ops in per_rank for k, v in _links(ops, (OpKind.SEND_ACT, OpKind.SEND_GRAD)).items()}
        got = {k: v for ops in per_rank for k, v in _links(ops, (OpKind.RECV_ACT, OpKind.RECV_GRAD)).items()}
        assert all(len(v) == 1 for v in sent.values()), (name, sent)
        # Each receive flagged is the unit its sender flagged: same stage, same micro-batch.
        pairs = {(OpKind.SEND_ACT if k is OpKind.RECV_ACT else OpKind.SEND_GRAD, s): v for (k, s), v in got.items()}
        assert pairs == sent, name
        links = {(op.kind, op.stage) for ops in per_rank for op in ops if op.kind in (OpKind.SEND_ACT, OpKind.SEND_GRAD)}
        assert set(sent) == links, name  # every link announces its shapes once


def test_header_follows_the_senders_order_not_the_receivers() -> None:
    # Rank 0 sends micro-batch 1 first; rank 1 receives micro-batch 0 first. The header
    # rides on micro-batch 1 on both sides, so rank 1 waits for it, which was sent first.
    sched = Schedule.from_text(["0F1 0F0 0BW0 0BW1", "1F0 1F1 1BW0 1BW1"], name="x", micro_batches=2, stage_to_rank=[0, 1])
    recv = [op for op in lower(sched, 1) if op.kind is OpKind.RECV_ACT]
    send = [op for op in lower(sched, 0) if op.kind is OpKind.SEND_ACT]
    assert [(op.micro_batch, op.header) for op in send] == [(1, True), (0, False)]
    assert [(op.micro_batch, op.header) for op in recv] == [(0, False), (1, True)]
    assert str(recv[1]).endswith("hdr")


def test_forward_only_headers_use_the_wavefront_order() -> None:
    sched = generate("v-half", 2, 4)
    ops = [op for r in range(2) for op in lower(sched, r, train=False)]
    flagged = [(op.kind, op.stage, op.micro_batch) for op in ops if op.header]
    assert flagged and all(mb == 0 for _, _, mb in flagged)


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "v-zb", "v-half"])
def test_split_units_are_the_units_with_a_backward_input(name: str) -> None:
    # The engine routes a forward through split backward only for these units.
    sched = generate(name, 2, 4)
    for rank in range(2):
        ops = lower(sched, rank)
        units = split_units(ops)
        fused = {(op.stage, op.micro_batch, op.seq_chunk) for op in ops if op.kind is OpKind.BACKWARD}
        weights = {(op.stage, op.micro_batch, op.seq_chunk) for op in ops if op.kind is OpKind.BACKWARD_WEIGHT}
        assert not units & fused and units == weights
    # Rank 1 sends every input gradient back: none of its backwards is fused.
    assert len(split_units(lower(sched, 1))) == sched.chunks_per_rank * 4


def test_split_units_empty_without_split_backward() -> None:
    assert split_units(lower(generate("1f1b", 2, 4), 1)) == frozenset()
    assert split_units(lower(generate("zb-h1", 2, 4), 1, train=False)) == frozenset()
