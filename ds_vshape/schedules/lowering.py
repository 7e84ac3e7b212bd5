"""Lowering: from a schedule's per-rank actions to the operations one rank executes.

A fixed chain of small passes, each a pure function tested alone:

1. ``merge_backward``    B immediately followed by its own W becomes one fused BW
                         (nothing could run in between, so splitting only costs a store),
                         unless B's input gradient goes to another rank: fusing would
                         hold that send back by a whole W pass on the critical path.
2. ``add_communication`` sends after the producing pass, a wait for the receive right
                         before the consuming pass; a neighbour stage on the same rank (the
                         turn of the V at rank p-1) is a local hand-off with no message.
3. ``add_data_loading``  loads micro-batches in order, just before first use.
4. ``assign_buffers``    gives every unit in flight on the rank a buffer slot, reusing
                         freed slots, so the slot count is the rank's peak in-flight count.
5. ``mark_shape_headers`` flags the one transfer per (direction, stage) and step that carries
                         the tensors' shapes; the others send the payload alone, one message
                         per tensor, and the receiver posts it early with the shapes it knows.
6. ``place_posts``       posts each receive (non-blocking) in the one transfer order both
                         ranks of a pair share, NCCL's rule (see ``p2p_order``); with
                         ``one_queue=True`` (one hardware queue per rank) every rank issues
                         its transfers in one global order instead (see ``one_queue``);
   ``group_crossing``    a post and the send right after it to the same peer go as one group.
7. ``add_stage_reduces`` a ``reduce_stage_grads`` after each stage's last backward pass:
                         where ZeRO partitions gradients, that stage's reduce-scatter starts
                         there, once per step, not per micro-batch.
8. ``add_param_gathers`` ``gather_params`` / ``release_params`` around each run of one
                         stage's passes in one direction: under ZeRO-3, a stage's weight
                         shards are gathered once per run, not per layer and pass.
9. ``add_step_tail``     tied-gradient reduce, gradient reduce, optimizer step.

Ops name pipeline ranks (``peer``), never process-group ranks; the runtime maps them.
``p2p_check.check_transfers`` verifies the result for all ranks under NCCL's rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache

from .ir import BACKWARD_KINDS, Action, F, Kind, Schedule
from .ops import BACKWARDS, COMPUTE, SENDS, Op, OpKind, format_ops
from .one_queue import GlobalKey, place_posts_in_global_order, transfer_keys
from .p2p_order import Pair, group_crossing, pair_orders, place_posts

__all__ = [
    "OpKind", "Op", "lower", "merge_backward", "add_communication", "add_data_loading",
    "assign_buffers", "first_sends", "mark_shape_headers", "add_stage_reduces", "add_param_gathers", "add_step_tail", "format_ops", "programs",
    "forward_only", "lowered_orders",
]


_COMPUTE = {Kind.F: OpKind.FORWARD, Kind.B: OpKind.BACKWARD_INPUT, Kind.W: OpKind.BACKWARD_WEIGHT, Kind.BW: OpKind.BACKWARD}


def merge_backward(actions: tuple[Action, ...], *, sends_grad: frozenset[int] = frozenset()) -> tuple[Action, ...]:
    """Fuse each B that is directly followed by its own W, except on ``sends_grad`` stages
    (those whose input gradient is sent to another rank right after B)."""
    out: list[Action] = []
    i = 0
    while i < len(actions):
        a = actions[i]
        nxt = actions[i + 1] if i + 1 < len(actions) else None
        fusable = a.kind is Kind.B and a.stage not in sends_grad
        if fusable and nxt is not None and nxt.kind is Kind.W and nxt.unit == a.unit:
            out.append(Action(Kind.BW, *a.unit))
            i += 2
        else:
            out.append(a)
            i += 1
    return tuple(out)


def add_communication(schedule: Schedule, rank: int, actions: tuple[Action, ...]) -> list[Op]:
    """Compute ops with the sends and receives their neighbours on other ranks need."""
    last, owner = schedule.num_model_stages - 1, schedule.stage_to_rank
    ops: list[Op] = []
    for a in actions:
        kind, s, i, j = a.kind, a.stage, a.micro_batch, a.seq_chunk
        forward, backward = kind is Kind.F, kind in BACKWARD_KINDS
        if forward and s > 0 and owner[s - 1] != rank:
            ops.append(Op(OpKind.RECV_ACT, s, i, j, peer=owner[s - 1]))
        if backward and s < last and owner[s + 1] != rank:
            ops.append(Op(OpKind.RECV_GRAD, s, i, j, peer=owner[s + 1]))
        ops.append(Op(_COMPUTE[kind], s, i, j))
        if forward and s < last and owner[s + 1] != rank:
            ops.append(Op(OpKind.SEND_ACT, s + 1, i, j, peer=owner[s + 1]))
        if backward and s > 0 and owner[s - 1] != rank:
            ops.append(Op(OpKind.SEND_GRAD, s - 1, i, j, peer=owner[s - 1]))
    return ops


def add_data_loading(schedule: Schedule, ops: list[Op]) -> list[Op]:
    """Load micro-batches in order, each right before the first forward that reads it.

    Stage 0 reads the inputs and the last stage reads the labels; loading in order keeps
    the user's data iterator in step with DeepSpeed's own engine.
    """
    last = schedule.num_model_stages - 1
    loaded = 0
    out: list[Op] = []
    for op in ops:
        if op.kind is OpKind.FORWARD and op.stage in (0, last):
            while loaded <= op.micro_batch:
                out.append(Op(OpKind.LOAD, micro_batch=loaded))
                loaded += 1
        out.append(op)
    return out


def assign_buffers(ops: list[Op]) -> list[Op]:
    """Give each (stage, micro-batch, chunk) a slot from its forward to its last backward op."""
    last_use: dict[tuple[int, int, int], int] = {}
    for pos, op in enumerate(ops):
        if op.kind in COMPUTE:
            last_use[(op.stage, op.micro_batch, op.seq_chunk)] = pos
    free: list[int] = []
    slots: dict[tuple[int, int, int], int] = {}
    count = 0
    out: list[Op] = []
    for pos, op in enumerate(ops):
        unit = (op.stage, op.micro_batch, op.seq_chunk)
        if op.kind is OpKind.FORWARD:
            slot = free.pop(0) if free else count
            count = max(count, slot + 1)
            slots[unit] = slot
        if unit in slots and op.kind in COMPUTE:
            out.append(replace(op, buffer=slots[unit]))
            if last_use[unit] == pos:
                free.append(slots.pop(unit))
                free.sort()
        else:
            out.append(op)
    return out


_RECVS = {OpKind.RECV_ACT: OpKind.SEND_ACT, OpKind.RECV_GRAD: OpKind.SEND_GRAD}


def mark_shape_headers(ops: list[Op], first_sent: dict[tuple[OpKind, int], tuple[int, int]]) -> list[Op]:
    """Flag the first transfer of each (direction, stage) in the *sender's* order.

    Shapes rarely change within a step, so one header per step and link is enough; sending
    it every step still lets shapes change between steps (a new sequence length). The
    receiver must know which of its receives brings the header, and that is the sender's
    first send, not necessarily its own first receive; both sides derive it from the same
    schedule (``first_sends``). Because the sender sends that unit before any other of the
    link, a receiver that needs another unit first can wait for the header without deadlock.
    """
    out: list[Op] = []
    for op in ops:
        send = _RECVS.get(op.kind, op.kind)  # a receive is flagged like the send that feeds it
        flag = send in SENDS and first_sent.get((send, op.stage)) == (op.micro_batch, op.seq_chunk)
        out.append(replace(op, header=True) if flag else op)
    return out


def first_sends(schedule: Schedule, orders: tuple[tuple[Action, ...], ...]) -> dict[tuple[OpKind, int], tuple[int, int]]:
    """For each (send kind, consuming stage): the unit its owner sends first, given the
    action order each rank runs (``orders``, one tuple per rank). Fusing B with W moves no
    send, so the unfused orders give the same answer as the lowered ones."""
    first: dict[tuple[OpKind, int], tuple[int, int]] = {}
    for rank, actions in enumerate(orders):
        for op in add_communication(schedule, rank, actions):
            if op.kind in SENDS:
                first.setdefault((op.kind, op.stage), (op.micro_batch, op.seq_chunk))
    return first


def add_stage_reduces(ops: list[Op]) -> list[Op]:
    """After each stage's last backward pass of the step, a ``reduce_stage_grads`` for it.

    Its gradients are final there, so their data-parallel reduce can start while the rank's
    other stages still run backward (breadth-first finishes its later stage first). The engine
    acts on it where the ZeRO stage partitions gradients; elsewhere it is a no-op.
    """
    last = {op.stage: i for i, op in enumerate(ops) if op.kind in BACKWARDS}
    after = {i: s for s, i in last.items()}
    out: list[Op] = []
    for i, op in enumerate(ops):
        out.append(op)
        if i in after:
            out.append(Op(OpKind.REDUCE_STAGE_GRADS, stage=after[i]))
    return out


def add_param_gathers(ops: list[Op]) -> list[Op]:
    """Around each run of one stage's passes in one direction, ``gather_params`` before the first
    and ``release_params`` after the last.

    A run ends where the stage's next pass goes the other way (a forward after backwards, or the
    reverse) or the stage has no more passes; other stages' passes may sit inside it. A turn
    straight from the stage's last forward to its first backward stays one run. Under
    ZeRO-3 the engine gathers the stage's weight shards once per run, so breadth-first (all
    forwards of a stage, then all its backwards) gathers each stage twice per step whatever m;
    elsewhere the two ops do nothing.
    """
    passes = [(i, op.stage, op.kind is OpKind.FORWARD) for i, op in enumerate(ops) if op.kind in COMPUTE]
    before: dict[int, int] = {}
    after: dict[int, int] = {}
    last: dict[int, tuple[int, bool]] = {}
    previous = None  # the pass before this one, any stage
    for i, stage, forward in passes:
        prev = last.get(stage)
        # A turn with no other stage's pass in between (the last forward, then the first
        # backward of the same stage) keeps the weights gathered across it.
        if prev is None or (prev[1] != forward and previous != prev[0]):
            before[i] = stage
            if prev is not None:
                after[prev[0]] = stage
        last[stage] = (i, forward)
        previous = i
    after.update({i: stage for stage, (i, _) in last.items()})
    out: list[Op] = []
    for i, op in enumerate(ops):
        if i in before:
            out.append(Op(OpKind.GATHER_PARAMS, stage=before[i]))
        out.append(op)
        if i in after:
            out.append(Op(OpKind.RELEASE_PARAMS, stage=after[i]))
    return out


def add_step_tail(ops: list[Op]) -> list[Op]:
    return ops + [Op(OpKind.REDUCE_TIED_GRADS), Op(OpKind.REDUCE_GRADS), Op(OpKind.OPTIMIZER_STEP)]


def lower(schedule: Schedule, rank: int, *, train: bool = True, lookahead: int = 2, one_queue: bool = False) -> list[Op]:
    """The whole chain for one rank. ``train=False`` keeps forwards only (evaluation).
    ``one_queue``: posts in the step's one global transfer order (safe with one hardware queue per rank)."""
    progs, pairs, first_sent = _plan(schedule, train)
    ops = add_communication(schedule, rank, progs[rank])
    ops = mark_shape_headers(assign_buffers(add_data_loading(schedule, ops)), first_sent)
    if one_queue:
        ops = place_posts_in_global_order(ops, rank, _keys(schedule, train), lookahead=lookahead)
    else:
        ops = place_posts(ops, rank, pairs, lookahead=lookahead)
    ops = add_param_gathers(group_crossing(ops))
    return add_step_tail(add_stage_reduces(ops)) if train else ops


def programs(schedule: Schedule, *, train: bool = True, lookahead: int = 2, one_queue: bool = False) -> list[list[Op]]:
    """Every rank's lowered ops (what ``check_transfers`` takes)."""
    return [lower(schedule, r, train=train, lookahead=lookahead, one_queue=one_queue) for r in range(schedule.stages)]



def forward_only(schedule: Schedule, micro_batches: int) -> Schedule:
    """Evaluation's schedule: forwards of every stage for every micro-batch on the stage's rank
    (``lower(..., train=False)`` orders them as a wavefront)."""
    ranks = tuple(
        tuple(F(s, i) for s in range(schedule.num_model_stages) if schedule.stage_to_rank[s] == r for i in range(micro_batches))
        for r in range(schedule.stages)
    )
    return Schedule("forward", schedule.stages, micro_batches, schedule.chunks_per_rank, 1, schedule.stage_to_rank, ranks)


def lowered_orders(schedule: Schedule, *, train: bool = True) -> tuple[tuple[Action, ...], ...]:
    """Per rank, the passes in the order ``lower`` turns into instructions (a B directly followed by its
    own W fused into one BW, except where B's input gradient goes to another rank)."""
    return _plan(schedule, train)[0]


@lru_cache(maxsize=32)
def _plan(schedule: Schedule, train: bool) -> tuple[tuple[tuple[Action, ...], ...], dict[Pair, tuple],
                                                    dict[tuple[OpKind, int], tuple[int, int]]]:
    """Per rank the lowered action order; every pair's transfer order; which unit each link sends first
    (``first_sends``). Shared by all ranks' lowering, so it is computed once per schedule object."""
    orders = schedule.ranks if train else tuple(_wavefront(actions) for actions in schedule.ranks)
    owner = schedule.stage_to_rank
    progs = []
    for rank in range(schedule.stages):
        remote = frozenset(s for s in range(1, schedule.num_model_stages) if owner[s] == rank and owner[s - 1] != rank)
        progs.append(merge_backward(orders[rank], sends_grad=remote))
    return tuple(progs), pair_orders(schedule, progs, _sends_of(schedule)), first_sends(schedule, orders)


@lru_cache(maxsize=32)
def _keys(schedule: Schedule, train: bool) -> dict[tuple, GlobalKey]:
    """The step's one global transfer order (``one_queue.transfer_keys``), computed once per schedule."""
    progs = _plan(schedule, train)[0]
    return transfer_keys(schedule, progs, _sends_of(schedule))


def _sends_of(schedule: Schedule) -> Callable[[int, Action], list[Op]]:
    """The lowering's one rule for what an action sends (shared by both transfer orders)."""
    return lambda rank, action: [op for op in add_communication(schedule, rank, (action,)) if op.kind in SENDS]  # noqa: E731


def _wavefront(actions: tuple[Action, ...]) -> tuple[Action, ...]:
    # Forward-only runs in wavefront order (micro-batch + stage), which any placement can
    # follow without waiting on a later micro-batch.
    forwards = [a for a in actions if a.kind is Kind.F]
    return tuple(sorted(forwards, key=lambda a: (a.micro_batch + a.stage, a.stage, a.seq_chunk)))
