"""``ds_vshape.initialize``: ``deepspeed.initialize`` with a schedule switch in the JSON.

An existing pipeline job changes ``deepspeed.initialize`` to ``ds_vshape.initialize`` and
adds ``"schedule": "<name>"`` to its ``"pipeline"`` block; nothing else. Every check that
can fail runs before the engine is built, so bad input is an error, never a hang.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import deepspeed
import torch
from deepspeed import comm as ds_dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.pipe.module import PipelineModule as DSPipelineModule
from deepspeed.runtime.pipe.module import TiedLayerSpec
from deepspeed.utils import logger

from .config import ConfigError, PipelineConfig, parse_pipeline_config
from .runtime.auto_engine import AutoEngine
from .runtime.engine import VShapeEngine
from .runtime.dropin.carry import carry_weights
from .runtime.transfers.device import bind_local_device
from .runtime.dropin.module import PipelineModule, from_deepspeed_module, release_stock_layers, stock_partition_method
from .runtime.measuring.profile import profiled_cut
from .runtime.dropin.optim_carry import carry_model_parameters, check_lr_scheduler, rebuild_optimizer
from .runtime.offload.setup import check_offload_config, offload_notes
from .runtime.program.seq_chunks import check_module as check_seq_chunk_module
from .runtime.step_end.tensor_parallel import model_parallel_size
from .runtime.program.seq_chunks import partition_dims
from .runtime.program.plan import EngineSettings, Plan
from .runtime.step_end.post_validation import check_post_validation_config
from .runtime.zero.zero import check_zero_config
from .schedules import Schedule, ScheduleError, get_info

__all__ = ["initialize"]

def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    *,
    config: str | dict[str, Any] | None = None,
    **kwargs: Any,
) -> tuple[Any, Any, Any, Any]:
    """Same arguments and 4-tuple as ``deepspeed.initialize``."""
    config_dict = _load_config(args, config)
    vs = parse_pipeline_config(config_dict)
    if vs.schedule is None or not isinstance(model, DSPipelineModule):
        if vs.schedule is not None:
            raise ConfigError("pipeline.schedule needs a deepspeed.pipe.PipelineModule (or ds_vshape.PipelineModule) as model")
        # Stock DeepSpeed, given exactly what the caller gave (it reads args.deepspeed_config itself).
        return deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                    training_data=training_data, lr_scheduler=lr_scheduler, config=config, **kwargs)
    _init_distributed(kwargs)
    bind_local_device(args)  # before carry and profile touch a tensor (DeepSpeed binds it only later)
    module, schedule = _prepare_module(model, vs, config_dict, training_data=training_data, collate_fn=kwargs.get("collate_fn"))
    if module is not model:
        optimizer, model_parameters = _carry_optimizer_setup(model, module, optimizer, model_parameters, lr_scheduler)
        release_stock_layers(model, module)  # after the groups and optimizer were mapped from it
    ds_config = DeepSpeedConfig(config_dict, module.mpu())
    if ds_dist.get_rank() == 0:
        for note in offload_notes(vs.offload_share, checkpoint_interval=module.activation_checkpoint_interval,
                                  split_backward=schedule.uses_split_backward):
            logger.warning(note)
    plan = _make_plan(vs, schedule, config_dict, module=module)
    engine = (AutoEngine if plan.auto is not None else VShapeEngine)(
        args=args, model=module, optimizer=optimizer, model_parameters=model_parameters, training_data=training_data,
        lr_scheduler=lr_scheduler, mpu=module.mpu(), dist_init_required=kwargs.get("dist_init_required"),
        collate_fn=kwargs.get("collate_fn"), config=config_dict, config_class=ds_config, plan=plan,
    )
    engine._configure_python_gc()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _make_plan(vs: PipelineConfig, schedule: Schedule, config: dict[str, Any], *, module: PipelineModule) -> Plan:
    """The one plan the engine runs by: the schedule made here, once (the engine never reads the
    config), how to remake it for a new batch size, the engine's settings and auto's."""
    settings = EngineSettings(
        p2p_timeout_s=vs.p2p_timeout_s, measure_memory=vs.measure_memory, post_validation=vs.post_validation,
        speculate_after=vs.speculate_after, offload=vs.offload_share, seq_partition=vs.seq_partition,
        seq_dims=partition_dims(module) if vs.seq_partition == "compute" else None,
        weight_grads_in_b=tuple(vs.weight_grads_in_b),
    )
    auto = None
    if vs.measures:  # auto, or pass_costs "measure": the AutoEngine times passes, then settles the order
        auto = vs.auto_settings(zero_stage=_zero_stage(config), stages=schedule.stages, micro_batches=schedule.micro_batches)
    return Plan(schedule, partial(vs.make_schedule, schedule.stages), settings, auto=auto)


def _carry_optimizer_setup(model: DSPipelineModule, module: PipelineModule, optimizer: Any, model_parameters: Any,
                           lr_scheduler: Any) -> tuple[Any, Any]:
    """Point the caller's parameter groups and optimizer object at the re-cut module's parameters.

    Every rank takes part (the groups of a moved layer come from the rank that held it); a
    callable optimizer or scheduler needs nothing: DeepSpeed calls it with what we pass.
    """
    check_lr_scheduler(lr_scheduler)
    if model_parameters is not None:
        model_parameters = carry_model_parameters(model, module, model_parameters)
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer = rebuild_optimizer(optimizer, model, module)
    elif optimizer is not None and hasattr(optimizer, "param_groups"):
        raise ConfigError(f"the optimizer object ({type(optimizer).__name__}) is not a torch.optim.Optimizer, so it cannot be "
                          "rebuilt on the re-cut module; pass its class or a callable (optimizer=lambda params: ...) instead")
    return optimizer, model_parameters


def _load_config(args: Any, config: str | dict[str, Any] | None) -> dict[str, Any]:
    path = getattr(args, "deepspeed_config", None)
    if path is not None and config is not None:
        raise ConfigError("config given twice: both args.deepspeed_config and config=; pass one")
    source = config if config is not None else path
    if source is None:
        raise ConfigError("no DeepSpeed config: pass config= (dict or JSON path) or --deepspeed_config")
    if isinstance(source, dict):
        return json.loads(json.dumps(source))  # a private copy: DeepSpeed mutates its config
    with open(source) as fh:
        return json.load(fh)


def _init_distributed(kwargs: dict[str, Any]) -> None:
    ds_dist.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        dist_init_required=kwargs.get("dist_init_required"),
    )


def _prepare_module(model: DSPipelineModule, vs: PipelineConfig, config: dict[str, Any], *, training_data: Any = None,
                    collate_fn: Any = None) -> tuple[PipelineModule, Schedule]:
    """Check everything that could later hang, make the schedule, re-place the layers for it."""
    p = model.num_stages
    micro_batches, micro_batch_size = _batch(config, model)
    info = get_info(vs.first_schedule)  # for auto, the schedule it starts with
    if (config.get("torch_autocast") or {}).get("enabled"):
        # DeepSpeed enters autocast in DeepSpeedEngine.forward, which our stage forwards bypass:
        # the key would be silently ignored, so refuse it.
        raise ConfigError(
            f"torch_autocast.enabled=true is not supported with schedule {info.name!r}: the engine runs stage forwards "
            "outside DeepSpeed's autocast context; use \"fp16\": {\"enabled\": true} (dynamic loss scaling) or "
            "\"bf16\": {\"enabled\": true} instead, or remove pipeline.schedule to run stock DeepSpeed"
        )
    try:
        schedule = vs.make_schedule(p, micro_batches, check=False)
    except ScheduleError as err:  # the schedule itself breaks a rule (a registered one): no batch hint
        raise ConfigError(str(err)) from None
    except ValueError as err:
        raise ConfigError(f"{err} (micro-batches = gradient_accumulation_steps; raise it in the config)") from None
    try:  # the registry says which ZeRO stages a schedule runs with
        check_zero_config(config, schedule=info.name, allowed=info.zero_stages, seq_chunks=schedule.seq_chunks,
                          tied=any(isinstance(spec, TiedLayerSpec) for spec in model._layer_specs))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:
        check_post_validation_config(config, enabled=vs.post_validation)
        check_offload_config(config, share=vs.offload_share)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if schedule.seq_chunks > 1:  # only ds_vshape.hf layers know how to run one chunk of a sequence
        try:
            check_seq_chunk_module(model, schedule.seq_chunks, info.name)
            if vs.seq_partition == "compute":
                partition_dims(model)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if len(model._layer_specs) < schedule.num_model_stages:
        raise ConfigError(
            f"the model has {len(model._layer_specs)} layers but schedule {info.name!r} cuts it into "
            f"{schedule.num_model_stages} stages ({p} ranks x {schedule.chunks_per_rank}); use fewer stages or split the model finer"
        )
    try:  # the config's partition_method, else the stock module's own
        method = vs.partition_method or stock_partition_method(model, schedule.num_model_stages)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    profile = None
    if method == "profile":  # measured on this job's layers and a sample micro-batch (runtime/measuring/profile.py)
        profile = profiled_cut(model, schedule, vs, micro_batch_size=micro_batch_size, training_data=training_data,
                               collate_fn=collate_fn)
    module = from_deepspeed_module(model, schedule.stage_to_rank, partition_method=method,
                                   stage_parts=None if profile is None else profile.cut.parts)
    if profile is not None:
        module.vs_profile = profile  # what the cut was made from, for the user and the tests
    if module is not model:
        carry_weights(model, module)  # the stock module's weights, also those held by another rank
    return module, schedule


def _zero_stage(config: dict[str, Any]) -> int:
    return int(config.get("zero_optimization", {}).get("stage", 0))


class _DataParallel:
    """Just enough of an mpu for ``DeepSpeedConfig`` to resolve the batch keys before the grid exists."""

    def __init__(self, size: int) -> None:
        self._size = size

    def get_data_parallel_world_size(self) -> int:
        return self._size


def _batch(config: dict[str, Any], model: DSPipelineModule) -> tuple[int, int]:
    """(micro-batches per step, rows per micro-batch), resolved once by DeepSpeed's own rules from
    any one or two of train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps."""
    # The topology's model (tensor-parallel) axis holds no replicas: a 3D job's data-parallel
    # size is world / (pipeline x tensor-parallel), as DeepSpeed's grid counts it.
    tp = model_parallel_size(model._topo)
    dp = ds_dist.get_world_size() // (model.num_stages * tp)
    try:
        resolved = DeepSpeedConfig(json.loads(json.dumps(config)), mpu=_DataParallel(dp))
    except AssertionError as err:
        shape = f"{dp} data-parallel replicas x {model.num_stages} pipeline ranks" + (f" x {tp} tensor-parallel ranks" if tp > 1 else "")
        raise ConfigError(f"the batch keys do not fit {shape}: {err}") from None
    return int(resolved.gradient_accumulation_steps), int(resolved.train_micro_batch_size_per_gpu)
