"""Checkpoints that cross schedules and pipeline sizes, optimizer state included.

DeepSpeed stores a pipeline rank's optimizer state in ``mp_rank_XX_model_states.pt`` in the
order of that rank's parameters, with no names. Loaded under another placement (another
schedule, another p) the same indices name other layers, and Adam moments land on the wrong
weights without an error. Model weights already cross (``layer_XX-model_states.pt`` files use
global layer numbers); this module adds the same for the optimizer:

* ``vs_layout.json`` (``layout_file``; written by global rank 0, last): the saving schedule, p,
  placement, the stage cut, the layer count, which pipeline ranks held each unit, the ZeRO stage
  and optimizer, whether per-parameter state was written, and every file of the tag with its
  size and sha256 (``manifest``).
* ``vs_state_rank_XXXXX.pt`` (every global rank; ``runtime_state``): the RNG, post-validation's
  streak and auto's choice, restored by a load that resumes the saving job as it was.
* ``vs_optim_pp_rank_XX.pt`` (data-parallel rank 0 of each pipeline rank, only for an optimizer
  that keeps plain per-parameter state: a torch optimizer under ZeRO-0 without an fp16/bf16
  wrapper): each parameter's state keyed by its module name (``"3.fc.weight"``: global layer 3;
  ``"tied_modules.embed.weight"``), with its shape and its group's options.

A load under the saving placement is DeepSpeed's own (exact resume, any optimizer wrapper). A
load under another placement maps every parameter's state by name, or is refused with an error
that names both placements and says what to change. The learning-rate scheduler state and the
global step come from DeepSpeed's own files, which do not depend on the placement.

A save is atomic (``commit``): a tag becomes ``latest`` only once every rank's files of it are
complete. A load first checks the tag's files against the save's record on every rank
(``integrity``) and refuses a damaged, cut-off or foreign tag on all of them at once.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from . import runtime_state
from .atomic import save_torch
from .carry import unit_of
from .commit import AtomicSaveMixin
from .integrity import checked_layout
from .layout_file import (FORMAT, LAYOUT_FILE, CheckpointError, Layout, agree, layout_of, mappable, optim_file,
                          read_layout, stock_layout)

__all__ = ["CheckpointError", "Layout", "LAYOUT_FILE", "FORMAT", "optim_file", "layout_of", "stock_layout", "read_layout",
           "plan_load", "optimizer_payload", "mapped_state_dict", "needed_ranks", "agree", "mappable", "save", "load",
           "AtomicSaveMixin"]

WEIGHTS, STOCK, MAPPED = "weights", "stock", "mapped"


def plan_load(saved: Layout, current: Layout, *, load_optimizer: bool, where: str, rank: int) -> str:
    """WEIGHTS, STOCK (DeepSpeed's own load) or MAPPED; a CheckpointError for anything else.

    Decided from the checkpoint's files and the config alone, so every rank decides the same.
    """
    if saved.num_layers is not None and saved.num_layers != current.num_layers:
        raise CheckpointError(f"rank {rank}: checkpoint {where} holds a model of {saved.num_layers} layers but this "
                              f"PipelineModule has {current.num_layers}; build the same layer list that was saved")
    if saved.holders and set(saved.holders) != set(current.holders):
        diff = sorted(set(saved.holders) ^ set(current.holders))[:4]
        raise CheckpointError(f"rank {rank}: checkpoint {where} and this PipelineModule differ in their layers and tied "
                              f"modules (e.g. {diff}); build the same layer list (and tied keys) that was saved")
    if saved.tp != current.tp:  # each tensor-parallel rank's layer files hold its own slices
        raise CheckpointError(f"rank {rank}: checkpoint {where} was saved with {saved.tp} tensor-parallel ranks but this "
                              f"run has {current.tp}; resharding is not supported: build the PipeModelDataParallelTopology "
                              f"with num_mp={saved.tp} to load it")
    if not load_optimizer:
        return WEIGHTS
    if saved.same_placement(current):
        return STOCK
    if saved.mapped and current.mapped:
        return MAPPED
    raise CheckpointError(
        f"rank {rank}: cannot load the optimizer state of checkpoint {where}: it was saved under {saved.describe()} and "
        f"this run is {current.describe()}; {_why_not(saved, current)}, so loading it would put optimizer state on the "
        "wrong layers. Load the weights only with load_checkpoint(..., load_optimizer_states=False), or resume under "
        f"the saved placement ({_how_to_resume(saved)})"
    )


def _why_not(saved: Layout, current: Layout) -> str:
    if saved.schedule is None:
        return "stock DeepSpeed stores each pipeline rank's optimizer state in parameter order, without layer names"
    if not saved.mapped:
        return (f"its optimizer ({saved.optimizer}, ZeRO stage {saved.zero_stage}) keeps state in flat per-rank buffers "
                "that cannot be mapped by layer")
    return (f"this run's optimizer ({current.optimizer}, ZeRO stage {current.zero_stage}) keeps state in flat per-rank "
            "buffers that cannot be filled by layer (only a torch optimizer under ZeRO-0 in fp32 maps)")


def _how_to_resume(saved: Layout) -> str:
    schedule = "no pipeline.schedule (stock DeepSpeed) or pipeline.schedule='1f1b'" if saved.schedule is None else \
        f"pipeline.schedule={saved.schedule!r}"
    return f"{schedule} with {saved.p} pipeline stages"


def optimizer_payload(engine: Any) -> dict[str, Any]:
    """This rank's optimizer state keyed by parameter name, with shapes and group options."""
    opt = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    params: dict[str, Any] = {}
    for gi, group in enumerate(opt.param_groups):
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:
                continue  # not the module's: ds_vshape's initialize refuses these, nothing to map by
            state = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in opt.state.get(param, {}).items()}
            params[name] = {"group": gi, "shape": tuple(param.shape), "state": state}
    return {"format": FORMAT, "pipe_rank": engine.stage_id, "optimizer": type(opt).__name__, "groups": groups,
            "params": params}


def needed_ranks(saved: Layout, names: list[str]) -> list[int]:
    """The saved pipeline ranks whose files hold these parameters (tied: the lowest holder)."""
    return sorted({saved.holders[unit_of(n)][0] for n in names if unit_of(n) in saved.holders})


def mapped_state_dict(optimizer: torch.optim.Optimizer, names: dict[int, str], saved: Layout,
                      payloads: dict[int, dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """``optimizer.load_state_dict`` input built by name from the saved files; or an error text.

    Each current group takes the options of the saved group its parameters came from (as
    torch's own load does); parameters of one group here must come from equal saved groups.
    """
    problems: list[str] = []
    classes = {pl["optimizer"] for pl in payloads.values()}
    if classes - {type(optimizer).__name__}:
        problems.append(f"the checkpoint's optimizer is {sorted(classes)} but this run's is {type(optimizer).__name__}; "
                        "configure the same optimizer type")
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for gi, group in enumerate(optimizer.param_groups):
        options: dict[str, Any] | None = None
        start = index
        for param in group["params"]:
            name = names.get(id(param), f"<parameter of shape {tuple(param.shape)} outside the module>")
            entry, opts, problem = _entry(name, param, saved, payloads)
            if problem is None and options is not None and repr(opts) != repr(options):
                problem = (f"{name} was in a group with options {opts} but shares group {gi} here with parameters saved "
                           f"in a group with options {options}; group the parameters as when saving")
            if problem is not None:
                problems.append(problem)
            else:
                options = options if options is not None else opts
                if entry["state"]:
                    state[index] = entry["state"]
            index += 1
        base = options if options is not None else {k: v for k, v in group.items() if k != "params"}
        groups.append(dict(base, params=list(range(start, index))))
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        return {}, "; ".join(problems[:3]) + more
    return {"state": state, "param_groups": groups}, None


def _entry(name: str, param: torch.Tensor, saved: Layout,
           payloads: dict[int, dict[str, Any]]) -> tuple[Any, Any, str | None]:
    unit = unit_of(name)
    holders = saved.holders.get(unit)
    payload = payloads.get(holders[0]) if holders else None
    entry = None if payload is None else payload["params"].get(name)
    if entry is None:
        where = f"pipeline rank {holders[0]}'s file" if holders else "the checkpoint"
        return None, None, f"no optimizer state for {name} in {where}; the checkpoint is incomplete or of another model"
    if tuple(entry["shape"]) != tuple(param.shape):
        return None, None, (f"{name} has shape {tuple(entry['shape'])} in the checkpoint but {tuple(param.shape)} here; "
                            "build the same model that was saved")
    return entry, payload["groups"][entry["group"]], None


# ---- the engine's save and load, around DeepSpeed's own -------------------------------------
def save(engine: Any, save_dir: str, tag: Any) -> None:
    """Write this pipeline rank's named optimizer state (data-parallel rank 0), whole or not at all.

    The layout file, which makes the tag loadable, is written after every rank's files by
    ``commit.commit`` (``AtomicSaveMixin.save_checkpoint``).
    """
    ckpt_dir = os.path.join(save_dir, str(tag))
    # Under ZeRO-0 every data-parallel replica holds the same state: one copy per pipeline rank.
    if mappable(engine) and engine.grid.data_parallel_id == 0:
        save_torch(optimizer_payload(engine), optim_file(ckpt_dir, engine.stage_id, tp_rank=_tp_rank(engine)))
    runtime_state.save(engine, ckpt_dir)  # RNG, post-validation's streak, auto's choice: one file per global rank


def _tp_rank(engine: Any) -> int | None:
    """This rank's tensor-parallel rank in a 3D job (its optimizer file names it); None without one."""
    return engine.grid.get_slice_parallel_rank() if engine.grid.get_slice_parallel_world_size() > 1 else None


def load(engine: Any, load_fn: Any, load_dir: str, tag: Any, *, load_optimizer_states: bool, load_module_only: bool,
         **kwargs: Any) -> tuple[Any, Any]:
    """DeepSpeed's load (``load_fn``) with the optimizer state mapped, kept, or refused by placement."""
    tag = _resolve_tag(load_dir, tag)
    ckpt_dir = os.path.join(load_dir, str(tag))
    # Every rank checks the tag's files against what the save recorded before anything loads.
    saved = None if tag is None or engine.load_universal_checkpoint() else checked_layout(load_dir, str(tag))
    if saved is None:  # no tag, universal, or not a pipeline checkpoint: DeepSpeed's loader decides
        return load_fn(load_dir, tag, load_optimizer_states=load_optimizer_states, load_module_only=load_module_only, **kwargs)
    wants = load_optimizer_states and not load_module_only and engine.optimizer is not None
    plan = plan_load(saved, layout_of(engine), load_optimizer=wants, where=ckpt_dir, rank=dist.get_rank())
    mapped = None
    if plan == MAPPED:
        mapped = _mapped(engine, saved, ckpt_dir)
    elif plan == STOCK and saved.schedule is None and mappable(engine):
        agree(_check_stock_state(engine, ckpt_dir))  # same p, linear: still check the shapes line up
    path, client = load_fn(load_dir, tag, load_optimizer_states=load_optimizer_states and plan != MAPPED,
                           load_module_only=load_module_only, **kwargs)
    if mapped is not None:
        engine.optimizer.load_state_dict(mapped)
        if client is not None:
            client.pop("optimizer", None)  # DeepSpeed's copy is in the saving placement's order
    elif plan == WEIGHTS and path is not None:
        _refresh_master_weights(engine)
    if plan == STOCK and path is not None and not load_module_only:
        runtime_state.restore(engine, ckpt_dir)  # the saving job, resumed as it was: its RNG, streak, auto's choice
    return path, client


def _resolve_tag(load_dir: str, tag: Any) -> Any:
    if tag is not None:
        return tag
    latest = os.path.join(load_dir, "latest")
    if not os.path.isfile(latest):
        return None
    with open(latest) as fh:
        return fh.read().strip()


def _mapped(engine: Any, saved: Layout, ckpt_dir: str) -> dict[str, Any]:
    opt = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    mine = [names[id(p)] for g in opt.param_groups for p in g["params"] if id(p) in names]
    payloads: dict[int, dict[str, Any]] = {}
    error = None
    for r in needed_ranks(saved, mine):
        path = optim_file(ckpt_dir, r, tp_rank=_tp_rank(engine))  # the same tensor-parallel rank's slices
        if not os.path.isfile(path):
            error = f"{path} is missing (pipeline rank {r}'s optimizer state); copy the whole checkpoint directory"
            break
        payloads[r] = engine.checkpoint_engine.load(path, map_location=torch.device("cpu"))
    state_dict: dict[str, Any] = {}
    if error is None:
        state_dict, error = mapped_state_dict(opt, names, saved, payloads)
    agree(None if error is None else f"rank {dist.get_rank()}: cannot map the optimizer state of {ckpt_dir}: {error}")
    return state_dict


def _check_stock_state(engine: Any, ckpt_dir: str) -> str | None:
    """A stock checkpoint at the same p: its per-rank state must fit this rank's parameters."""
    path = os.path.join(ckpt_dir, f"mp_rank_{engine.checkpoint_mp_rank:02d}_model_states.pt")
    saved = engine.checkpoint_engine.load(path, map_location=torch.device("cpu")).get("optimizer")
    if not isinstance(saved, dict) or "param_groups" not in saved:
        return None  # nothing in torch's format to compare; DeepSpeed's loader reports what it finds
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    sizes, saved_sizes = [len(g["params"]) for g in engine.optimizer.param_groups], [len(g["params"]) for g in saved["param_groups"]]
    where = f"rank {dist.get_rank()}: the stock DeepSpeed checkpoint {ckpt_dir}"
    hint = ("the stages were cut differently (partition_method?); set the saving job's pipeline.partition_method, or "
            "load with load_optimizer_states=False")
    if sizes != saved_sizes:
        return f"{where} has optimizer groups of {saved_sizes} parameters on this pipeline rank but this run has {sizes}; {hint}"
    order = [i for g in saved["param_groups"] for i in g["params"]]
    for i, param in zip(order, params):
        for key, value in saved.get("state", {}).get(i, {}).items():
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != tuple(param.shape):
                return f"{where} has {key} of shape {tuple(value.shape)} where this rank's parameter is {tuple(param.shape)}; {hint}"
    return None


def _refresh_master_weights(engine: Any) -> None:
    # An fp16/bf16 wrapper keeps fp32 master copies that DeepSpeed refreshes only for
    # load_module_only; without this a weights-only load would be undone by the next step.
    opt = engine.optimizer
    if opt is not None and opt is not getattr(engine, "basic_optimizer", opt) and engine.zero_optimization_stage() == 0:
        refresh = getattr(opt, "refresh_fp32_params", None)
        if refresh is not None:
            refresh()
