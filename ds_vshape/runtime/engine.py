"""The engine: DeepSpeed's PipelineEngine, executing any schedule of the IR.

All ordering lives in the schedule; this class only executes instructions. State between
instructions is kept in small dicts keyed by unit (stage, micro_batch, seq_chunk):
``_act_in`` holds a stage's input activations (received, or handed over locally when the
neighbour stage lives on this rank), ``_grad_in`` the gradient of a stage's output.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.utils import logger as ds_logger

from ..schedules import Kind, Schedule
from ..schedules.ir import Unit
from ..schedules.first_contact import contact_pairs, warm_up_peers
from ..schedules.lowering import forward_only
from ..schedules.fit_limit import moved_share_limit
from ..schedules.ops import DATA_PARALLEL
from .dropin import checkpoint as ckpt
from .program import instructions as ins
from .program.plan import Plan
from .program.transfer_order import use_global_order
from .transfers.comm import P2P
from .transfers.device import waits_on_stream
from .transfers.handlers import TransferHandlersMixin, stage_tensors
from .transfers.p2p_groups import neighbour_pairs, pair_groups
from .measuring.memory import ActivationMeter
from .offload.offloader import Offloader
from .step_end.precision import scale_loss
from .program.seq_chunks import SeqChunks
from .split.fit import WFit
from .split.setup import enable_for_stages
from .split.split_backward import WeightGradStore
from .step_end.failures import bounded_step
from .step_end.step import OptimizerStepMixin
from .zero.zero import whole_parameters
from .zero.zero_engine import ZeroPipelineMixin

__all__ = ["VShapeEngine"]

log = ds_logger  # DeepSpeed's logger: users already see its INFO lines


class VShapeEngine(TransferHandlersMixin, OptimizerStepMixin, ZeroPipelineMixin, ckpt.AtomicSaveMixin, PipelineEngine):
    """A ``PipelineEngine`` whose schedule comes from ``ds_vshape.schedules``."""

    def __init__(self, *args: Any, plan: Plan, **kwargs: Any) -> None:
        """``plan``: made once by ``ds_vshape.initialize`` for this module's placement: the schedule,
        how to remake it for another number of micro-batches (``set_train_batch_size``), every
        rank's checked program and the engine's settings (``runtime/program/plan.py``)."""
        # PipelineEngine.__init__ runs a send/recv handshake along the linear rank chain using
        # is_first_stage()/is_last_stage(); they keep DeepSpeed's meaning until it is done.
        object.__setattr__(self, "_vs_placement", None)
        super().__init__(*args, **kwargs)
        self._vs_placement = tuple(kwargs["model"].placement)
        if self.training_data is not None:
            self._build_data_iter(self.training_data)  # again: first/last rank changed meaning
        self._check_plan(plan)
        self._plan = plan
        settings = plan.settings
        self.num_model_stages = plan.schedule.num_model_stages
        self._store = WeightGradStore()
        self._fit = WFit(self._store)  # keeps W's share within the schedule's w_memory
        if plan.schedule.uses_split_backward:
            self._enable_split_backward()
        self._meter = ActivationMeter({p.untyped_storage().data_ptr() for p in self.module.parameters()})
        # Saved-tensor hooks and transfer accounting cost host time: on only when asked (the
        # config, or this attribute) and on the steps that log memory.
        self.measure_memory: bool = settings.measure_memory
        self._measuring = False
        self.peak_activation_bytes: int | None = None  # None until a step measured it; device-resident bytes
        self.peak_host_activation_bytes: int | None = None  # offloaded to host memory, same steps
        self.peak_memory_bytes: int | None = None  # activations plus transfer buffers in flight, same steps
        self.peak_inflight_bytes = 0
        self._seq = SeqChunks(self.stage_id, partition=settings.seq_partition, dims=settings.seq_dims)
        self._p2p = self._make_p2p(settings.p2p_timeout_s)
        self._p2p.warm_up(warm_up_peers(contact_pairs(plan.programs), self.stage_id))  # NCCL first contacts, one global order
        self._zero_reducer = self._stage_grad_reducer()
        self._init_step(post_validation=settings.post_validation, speculate_after=settings.speculate_after)
        self._train_ir = self._ir(self.schedule)
        self._offload = Offloader(self._meter, share=settings.offload, device=self.device, rank=self.stage_id,
                                  parked=lambda: self._store.parked_bytes)
        self._reset_step_state()

    @property
    def schedule(self) -> Schedule:
        """The schedule this engine runs (its plan's)."""
        return self._plan.schedule

    def _enable_split_backward(self) -> None:
        """Split backward on this rank's stages (a collective when patterns are given: every rank calls it)."""
        enable_for_stages([m for s in self.module.local_stages for m in self.module.stage_modules(s)], self._store,
                          root=self.module, in_b=self._plan.settings.weight_grads_in_b, device=self.device, log=log.info)

    def _make_p2p(self, timeout_s: float) -> P2P:
        """Transfers on one 2-rank group per neighbour pair (``p2p_groups``), made on every rank."""
        pipelines = self.module.topology().get_axis_comm_lists("pipe")
        groups = pair_groups(pipelines, neighbour_pairs(self._vs_placement), dist.get_rank())
        return P2P(
            global_rank_of=[self.grid.stage_to_global(stage_id=r) for r in range(self.num_stages)], groups=groups,
            device=self.device, timeout_s=timeout_s, my_rank=self.stage_id,
            dynamic_shape=bool(self.dynamic_shape) or self._seq.unequal,  # unequal chunks: shapes with every transfer
            stream_waits=waits_on_stream(self.device),
        )

    def _check_plan(self, plan: Plan) -> None:
        """Refuse a plan this engine cannot run, before any transfer is posted (its transfers were
        checked under NCCL's rules when it was made)."""
        schedule = plan.schedule
        if schedule.stage_to_rank != self._vs_placement:
            raise ValueError(f"module placement {self._vs_placement} does not match schedule placement {schedule.stage_to_rank}")
        if schedule.micro_batches != self.micro_batches:
            raise ValueError(f"schedule {schedule.name!r} was made for {schedule.micro_batches} micro-batches, but DeepSpeed "
                             f"resolved gradient_accumulation_steps={self.micro_batches}")

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's batch ramp-up: a new number of micro-batches, and the plan made for it."""
        old = self.train_batch_size()
        super().set_train_batch_size(train_batch_size)
        try:
            self._swap_plan(self._plan.for_micro_batches(self.micro_batches))
        except ValueError as err:
            super().set_train_batch_size(old)  # keep what the current schedule was made for
            raise ValueError(f"set_train_batch_size({train_batch_size}): {err}; the train batch size stays {old}") from None

    def _swap_plan(self, plan: Plan) -> None:
        """Run ``plan`` from the next step on: the one way this engine's schedule changes (batch ramp-up,
        auto's choice). Checked first: a plan this engine cannot run leaves the engine as it was."""
        self._check_plan(plan)
        old = self.schedule
        if plan.schedule.uses_split_backward and not old.uses_split_backward:
            self._enable_split_backward()
        if plan.schedule != old:
            # Fit anew: the new schedule's bound may count another share, and how much W work B may take is
            # the schedule's own (fit_limit). A job resumed on auto's choice then fits exactly as it ran.
            self._fit.undo()
        self._plan = plan
        self._train_ir = self._ir(plan.schedule)

    def _ir(self, schedule: Schedule, *, train: bool = True) -> ins.IRSchedule:
        """The lowered stream, less the data-parallel points this ZeRO stage does not act on."""
        acts_on = self._zero_reducer.OPS if self._zero_reducer is not None else frozenset()
        order = use_global_order(schedule, train=train, dynamic_shapes=self._p2p.dynamic_shape,
                                 one_queue=self._p2p.one_queue, synchronize_at=acts_on)  # the one reading of the queue
        # The plan's program of this rank is the default order's, lowered and checked once at initialize.
        planned = train and not order and schedule is self._plan.schedule
        return ins.IRSchedule(schedule, self.stage_id, train=train, without=DATA_PARALLEL - acts_on, global_order=order,
                              lowered=self._plan.programs[self.stage_id] if planned else None)

    # ---- placement-aware answers DeepSpeed asks -----------------------------------------
    def is_first_stage(self) -> bool:
        if self._vs_placement is None:
            return super().is_first_stage()
        return self._vs_placement[0] == self.stage_id

    def is_last_stage(self) -> bool:
        if self._vs_placement is None:
            return super().is_last_stage()
        return self._vs_placement[-1] == self.stage_id

    def _loss_stage_global_rank(self) -> int:
        return self.grid.stage_to_global(self._vs_placement[-1])

    def _train_schedule(self) -> ins.IRSchedule:
        return self._train_ir

    def _inference_schedule(self, micro_batches: int) -> ins.IRSchedule:
        return self._ir(forward_only(self.schedule, micro_batches), train=False)

    # ---- step framing -----------------------------------------------------------------------
    def train_batch(self, *args: Any, **kwargs: Any) -> Any:
        self._p2p.check_usable()  # before DeepSpeed starts its timers and reads data
        with bounded_step(self, "train"):  # its collectives time out with its transfers; failures named
            return super().train_batch(*args, **kwargs)

    def eval_batch(self, *args: Any, **kwargs: Any) -> Any:
        self._p2p.check_usable()
        with bounded_step(self, "eval"):
            return super().eval_batch(*args, **kwargs)

    def _reset_step_state(self) -> None:
        self._data: dict[int, Any] = {}
        self._labels: dict[int, Any] = {}
        self._act_in: dict[Unit, Any] = {}
        self._grad_in: dict[Unit, tuple[torch.Tensor, ...]] = {}
        self._saved: dict[int, tuple[Any, Any]] = {}
        self._split: frozenset[Unit] = frozenset()  # units whose backward this step splits (routed forwards)

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        self._settle_before_passes()  # the previous step's post-validation
        self._reset_step_state()
        self._seq.start_step(pipe_schedule.schedule.seq_chunks)  # evaluation's forward-only schedule has none
        self._split = pipe_schedule.split_units
        self._offload.start_step(pipe_schedule.schedule, pipe_schedule.ops, train=self.module.training)
        logs = bool(self.steps_per_print()) and (self.global_steps + 1) % self.steps_per_print() == 0
        self._measuring = self.measure_memory or logs
        self._meter.reset_peak()
        self.tput_timer.start()
        self._p2p.start_step()
        if self._zero_reducer is not None:
            self._zero_reducer.start_step()
        try:
            super()._exec_schedule(pipe_schedule)
            self._p2p.drain()
        except BaseException as err:
            # What was posted cannot be cancelled; the next step must not pair with it.
            self._p2p.abandon(err)
            self._store.clear()
            self._offload.clear()
            raise
        finally:
            self.peak_inflight_bytes = self._p2p.peak_inflight_bytes
            if self._measuring:
                self.peak_activation_bytes = self._meter.peak_bytes
                self.peak_memory_bytes = self._meter.peak_total_bytes
                self.peak_host_activation_bytes = self._meter.peak_host_bytes
        if logs:
            log.info("ds_vshape: pipeline rank %d (%s) peak activation memory %.2f MiB, with transfer buffers %.2f MiB",
                     self.stage_id, self.schedule.name, self.peak_activation_bytes / 2**20, self.peak_memory_bytes / 2**20)
        leftovers = [k for d in (self._act_in, self._grad_in) for k in d] + self._store.pending() + self._seq.pending()
        leftovers += self._offload.pending()
        if leftovers:
            raise RuntimeError(f"rank {self.stage_id}: schedule left work undone for units {leftovers[:4]}")

    # ---- handlers ---------------------------------------------------------------------------
    def _exec_load(self, micro_batch: int) -> None:
        batch = self._load_batch()
        if self.is_first_stage():
            self._data[micro_batch] = _to_device(batch[0], self.device)
        if self.is_last_stage():
            self._labels[micro_batch] = _to_device(batch[1], self.device)

    def _exec_forward(self, stage: int, micro_batch: int, seq_chunk: int, peer: Any, buffer_id: int) -> None:
        unit = (stage, micro_batch, seq_chunk)
        raw = self._seq.first_input(self._data, micro_batch, seq_chunk) if stage == 0 else self._act_in.pop(unit)
        inputs = _as_leaves(raw, grad=torch.is_grad_enabled() and (stage > 0 or self._reentrant_activation_checkpointing()))
        split = self._store.forward_of(unit, scope=stage) if unit in self._split else nullcontext()
        chunk = self._seq.forward(stage, micro_batch, seq_chunk, inputs)
        self._offload.before_pass(Kind.F, unit)
        fit = unit in self._split and torch.is_grad_enabled() and self._fit.forward_starts(unit)  # once per stage
        before = self._meter.saved_bytes if fit else 0
        with self._offload.forward(unit, stage_tensors(inputs), measure=self._measuring or fit), split, chunk:
            outputs = self.module.forward_stage(stage, inputs)
        if fit:
            self._fit.saw_forward(stage, self._meter.saved_bytes - before)
        # What lives on anyway stays on the device: the stage's inputs and outputs, later chunks' K/V.
        self._offload.after_forward(unit, (*stage_tensors(inputs), *stage_tensors(outputs), *self._seq.kept_tensors()))
        if not self.module.training:
            # DeepSpeed's contiguous activation checkpointing fills a fixed pool per forward and
            # frees it in backward; evaluation has none, so reset it after each pass, as
            # DeepSpeed's own engine does (else the pool overflows on one rank, the rest wait).
            ds_checkpointing.reset()
        if stage == self.num_model_stages - 1:
            outputs = self._record_loss(outputs, self._seq.last_labels(self._labels, micro_batch, seq_chunk))
        else:
            self._act_in[(stage + 1, micro_batch, seq_chunk)] = _detached(outputs)
        if torch.is_grad_enabled():
            self._saved[buffer_id] = (inputs, outputs)

    def _record_loss(self, outputs: Any, labels: Any) -> Any:
        if self._compute_loss and self.module.loss_fn is not None:
            loss = self._seq.loss(self.module.loss_fn, outputs, labels)
        else:
            loss = outputs
        if self.eval_return_logits:
            self.outputs = outputs
        self.loss = loss
        self.fwd_outputs.append(loss.detach())
        self.total_loss = loss.detach().clone() if self.total_loss is None else self.total_loss + loss.detach()
        return loss

    def _exec_backward_input(self, stage: int, micro_batch: int, seq_chunk: int, peer: Any, buffer_id: int) -> None:
        unit = (stage, micro_batch, seq_chunk)
        self._offload.before_pass(Kind.B, unit)
        with self._store.deferring(unit):
            self._backward(stage, micro_batch, seq_chunk, buffer_id)
        fitted = self._fit.after_backward_input(unit, share=self.schedule.w_memory, rank=self.stage_id,
                                                run_now=lambda run: self._weight_pass(stage, micro_batch, run),
                                                max_moved=self._fit_limit)
        if fitted:
            log.info(fitted)
        # What W keeps may go to host; what the previous stage and later chunks still read stays.
        live = [*self._grad_in.get((stage - 1, micro_batch, seq_chunk), ()), *self._seq.kept_tensors()]
        self._offload.after_backward_input(unit, self._store.held(unit), live=live)

    def _exec_backward_weight(self, stage: int, micro_batch: int, seq_chunk: int, peer: Any, buffer_id: int) -> None:
        self._offload.before_pass(Kind.W, (stage, micro_batch, seq_chunk))
        self._weight_pass(stage, micro_batch, lambda: self._store.run((stage, micro_batch, seq_chunk)))

    def _fit_limit(self) -> float:
        """How much W work the fit may move into B before this schedule falls behind 1F1B (simulated once)."""
        cached = getattr(self, "_fit_limit_of", None)
        if cached is None or cached[0] is not self.schedule:
            cached = self._fit_limit_of = (self.schedule, moved_share_limit(self.schedule))
        return cached[1]

    def _weight_pass(self, stage: int, micro_batch: int, run: Callable[[], None]) -> None:
        """``run`` accumulates parked weight gradients: a W pass, or B's share of one (``WFit``)."""
        self._zero_before_weight_pass(stage, micro_batch)
        run()
        self._offload.count_parked()
        self._after_grads()

    def _exec_fused_backward(self, stage: int, micro_batch: int, seq_chunk: int, peer: Any, buffer_id: int) -> None:
        # Its forward ran unrouted (only split units are routed), so a checkpointed block's re-run
        # here runs unrouted too and saves what the forward saved.
        self._offload.before_pass(Kind.BW, (stage, micro_batch, seq_chunk))
        self._backward(stage, micro_batch, seq_chunk, buffer_id)

    def _backward(self, stage: int, micro_batch: int, seq_chunk: int, buffer_id: int) -> None:
        inputs, outputs = self._saved.pop(buffer_id)
        if stage == self.num_model_stages - 1:
            tensors, grads = [scale_loss(self, self._scale_loss_by_gas(outputs))], [None]
        else:
            got = self._grad_in.pop((stage, micro_batch, seq_chunk))
            floats = [t for t in stage_tensors(outputs) if t.is_floating_point()]
            pairs = [(t, g) for t, g in zip(floats, got) if t.requires_grad]
            tensors, grads = [t for t, _ in pairs], [g for _, g in pairs]
        kv_tensors, kv_grads = self._seq.backward_roots(stage, micro_batch, seq_chunk)  # later chunks' K/V gradients
        if tensors or kv_tensors:
            torch.autograd.backward(tensors + kv_tensors, grads + kv_grads)
        self._seq.release(stage, micro_batch, seq_chunk)
        if stage > 0:
            self._grad_in[(stage - 1, micro_batch, seq_chunk)] = tuple(
                t.grad if t.grad is not None else torch.zeros_like(t) for t in stage_tensors(inputs) if t.is_floating_point()
            )
        self._after_grads()

    def _after_grads(self) -> None:
        # The bf16 optimizer keeps fp32 gradient accumulators; fold each pass's bf16 grads in.
        if self.using_bf16_optimizer and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=True)

    # ---- checkpoints: optimizer state by global layer and name (see runtime/dropin/checkpoint.py) ----
    def _save_checkpoint(self, save_dir: str, tag: Any, client_state: Any = None, exclude_frozen_parameters: bool = False) -> None:
        self.settle()  # never save a step that post-validation may still undo
        # The layer files take each parameter whole: under ZeRO-3 they would be saved as empty shards.
        with whole_parameters(self, modify=False):
            super()._save_checkpoint(save_dir, tag, client_state=client_state or {}, exclude_frozen_parameters=exclude_frozen_parameters)
        ckpt.save(self, save_dir, tag)

    # DeepSpeed's signature, positional arguments included: callers of deepspeed's engine call it so.
    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False,
                        custom_load_fn: Any = None) -> tuple[Any, Any]:
        """DeepSpeed's load; optimizer state saved under another schedule or p is mapped by layer, or refused."""
        self._refuse_zero3_weights_only(load_optimizer_states=load_optimizer_states, load_module_only=load_module_only)
        self.settle()  # every rank finishes the pending check (and any redo) before the load replaces it
        return ckpt.load(self, super().load_checkpoint, load_dir, tag, load_optimizer_states=load_optimizer_states,
                         load_module_only=load_module_only, load_module_strict=load_module_strict,
                         load_lr_scheduler_states=load_lr_scheduler_states, custom_load_fn=custom_load_fn)

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ins.LoadMicroBatch: _exec_load,
        ins.PostRecvActivation: TransferHandlersMixin._exec_post_act,
        ins.PostRecvGrad: TransferHandlersMixin._exec_post_grad,
        ins.RecvActivation: TransferHandlersMixin._exec_recv_act,
        ins.ForwardPass: _exec_forward,
        ins.SendActivation: TransferHandlersMixin._exec_send_act,
        ins.RecvGrad: TransferHandlersMixin._exec_recv_grad,
        ins.BackwardInput: _exec_backward_input,
        ins.BackwardWeight: _exec_backward_weight,
        ins.FusedBackward: _exec_fused_backward,
        ins.SendGrad: TransferHandlersMixin._exec_send_grad,
        **ZeroPipelineMixin.INSTRUCTIONS,
    }


def _detached(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return tuple(t.detach() for t in x)
    return x.detach()


def _as_leaves(x: Any, *, grad: bool) -> Any:
    """Fresh leaves for a stage's inputs, so B can read the input gradient off ``.grad``."""
    def leaf(t: torch.Tensor) -> torch.Tensor:
        out = t.detach()
        if grad and out.is_floating_point():
            out.requires_grad_(True)
        return out

    return tuple(leaf(t) for t in x) if isinstance(x, (tuple, list)) else leaf(x)


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, (tuple, list)):
        return tuple(t.to(device) for t in x)
    return x.to(device) if torch.is_tensor(x) else x
