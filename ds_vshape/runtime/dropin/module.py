"""A PipelineModule that holds several model stages per rank (V and looped placement).

DeepSpeed's PipelineModule cuts the layer list into one contiguous range per rank. Here
the list is cut into p*v model stages, and each rank builds only the layers of the stages
its placement gives it. Checkpoint files keep DeepSpeed's global layer numbering
(``layer_XX-model_states.pt``), so a job can move between schedules, and stock DeepSpeed
loads what we save.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from deepspeed import comm as ds_dist
from deepspeed.runtime import utils as ds_utils
from deepspeed.runtime.activation_checkpointing.checkpointing import non_reentrant_checkpoint
from deepspeed.runtime.pipe import module as ds_module
from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec
from deepspeed.runtime.pipe.module import PipelineModule as _DSPipelineModule
from deepspeed.utils import logger as ds_logger
from torch import nn

__all__ = ["PipelineModule", "from_deepspeed_module", "release_stock_layers", "stock_partition_method", "record_partition_methods"]


class PipelineModule(_DSPipelineModule):
    """``deepspeed.pipe.PipelineModule`` with a stage-to-rank placement.

    ``placement`` lists, for each model stage in forward order, the pipeline rank that owns
    it (see ``ds_vshape.schedules.placement``); None means DeepSpeed's own one stage per rank.
    """

    def __init__(self, layers: Sequence[Any], *, placement: Sequence[int] | None = None,
                 prebuilt: Mapping[str, nn.Module] | None = None, stage_parts: Sequence[int] | None = None,
                 **kwargs: Any) -> None:
        """``prebuilt`` maps a unit name (``"3"`` for layer 3, ``"tied_modules.<key>"``) to a module
        already built for it (by the stock module this one replaces): it is used instead of
        building the LayerSpec again, so its weights and its parameter objects carry over.
        ``stage_parts``: the cut itself (stage s holds layers ``stage_parts[s]`` up to
        ``stage_parts[s+1]``), as ``partition_method="profile"`` measured it; it overrides the method."""
        # DeepSpeed's __init__ calls our _partition_layers/_build before returning, so the
        # placement must be in place first; nn.Module.__init__ has not run yet, hence object.__setattr__.
        object.__setattr__(self, "_vs_placement", tuple(placement) if placement is not None else None)
        object.__setattr__(self, "_vs_stage_parts", list(stage_parts) if stage_parts is not None else None)
        object.__setattr__(self, "_vs_prebuilt", dict(prebuilt or {}))
        super().__init__(layers, **kwargs)
        self._vs_prebuilt = {}  # only needed while building; do not keep the stock modules alive through it

    # ---- partition ------------------------------------------------------------------------
    @property
    def placement(self) -> tuple[int, ...]:
        return self._vs_placement or tuple(range(self.num_stages))

    def _partition_layers(self, method: str = "uniform") -> None:
        num_model_stages = len(self.placement)
        if len(self._layer_specs) < num_model_stages:
            raise ValueError(
                f"the model has {len(self._layer_specs)} layers but the schedule cuts it into {num_model_stages} "
                f"stages ({self.num_stages} ranks x {num_model_stages // self.num_stages} chunks); "
                "use fewer pipeline stages or chunks, or split the model into more layers"
            )
        self._vs_partition_method = method
        given = self._vs_stage_parts
        self.stage_parts = _checked_parts(given, len(self._layer_specs), num_model_stages) if given is not None else \
            _partition(self, method.lower(), num_model_stages)
        rank = self._topo.get_coord(self.global_rank).pipe
        self.local_stages = [s for s, r in enumerate(self.placement) if r == rank]
        self.local_layer_ids = [i for s in self.local_stages for i in range(self.stage_parts[s], self.stage_parts[s + 1])]
        # DeepSpeed reads these for logging and for its own bookkeeping.
        self.parts = [self.stage_parts[0]] + [self.stage_parts[s + 1] for s in range(num_model_stages)]
        self._set_bounds(start=min(self.local_layer_ids), stop=max(self.local_layer_ids) + 1)

    def stage_owner(self, layer_idx: int) -> int:
        for s in range(len(self.placement)):
            if self.stage_parts[s] <= layer_idx < self.stage_parts[s + 1]:
                return self.placement[s]
        raise ValueError(f"layer {layer_idx} is outside 0..{self._num_layers - 1}")

    # ---- build ----------------------------------------------------------------------------
    def _build(self) -> None:
        self.stage_funcs: dict[int, list[Any]] = {}
        for stage in self.local_stages:
            funcs = [self._build_layer(i) for i in range(self.stage_parts[stage], self.stage_parts[stage + 1])]
            self.stage_funcs[stage] = funcs
            self.forward_funcs.extend(funcs)
        for param in self.parameters():
            param.ds_pipe_replicated = False

    def _build_layer(self, layer_idx: int) -> Any:
        spec = self._layer_specs[layer_idx]
        if self.seed_layers:
            (self.seed_fn or ds_utils.set_random_seed)(self.base_seed + layer_idx)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied_modules:
                self.tied_modules[spec.key] = self._prebuilt_or(f"tied_modules.{spec.key}", spec)
                self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
            module = self.tied_modules[spec.key]
            return module if spec.forward_fn is None else partial(spec.forward_fn, module)
        if isinstance(spec, (LayerSpec, nn.Module)):
            module = self._prebuilt_or(str(layer_idx), spec) if isinstance(spec, LayerSpec) else spec
            self.add_module(str(layer_idx), module)
            self.fwd_map[str(layer_idx)] = len(self.forward_funcs)
            return module
        return spec  # a plain function

    def _prebuilt_or(self, unit: str, spec: LayerSpec) -> nn.Module:
        # Only the layers the stock module built on THIS rank are here; any other layer this
        # rank now owns is built from its LayerSpec, and ds_vshape.runtime.dropin.carry then copies
        # the stock owner's values into it.
        module = self._vs_prebuilt.get(unit)
        return spec.build() if module is None else module

    def stage_modules(self, stage: int) -> list[nn.Module]:
        return [f.args[0] if isinstance(f, partial) else f for f in self.stage_funcs[stage] if isinstance(f, (nn.Module, partial))]

    # ---- forward --------------------------------------------------------------------------
    def forward_stage(self, stage: int, inputs: Any) -> Any:
        """Run one model stage, with DeepSpeed's activation checkpointing if configured.

        Reentrant checkpointing gives a block's parameters a gradient only through a block input
        that requires one: a first stage's block fed integer token ids (an embedding) would get
        none, and neither would the blocks after it. So, with grad on, a checkpointable block's
        leading layers run outside the checkpoint until what they hand on carries a floating
        tensor that requires grad (DeepSpeed leaves its GPT models' embedding out likewise);
        the rest of the block is checkpointed. Non-reentrant checkpointing needs no such care.
        """
        funcs = self.stage_funcs[stage]
        interval = self.activation_checkpoint_interval
        if interval <= 0:
            return _run(funcs, inputs)
        reentrant = torch.is_grad_enabled() and inspect.unwrap(self.activation_checkpoint_func) is not non_reentrant_checkpoint
        x = inputs
        for start in range(0, len(funcs), interval):
            block = funcs[start : start + interval]
            if not self._is_checkpointable(block):
                x = _run(block, x)
                continue
            while reentrant and block and not _requires_grad(x):
                x, block = block[0](x), block[1:]
            if block:
                x = self.activation_checkpoint_func(_Runner(block), *(x if isinstance(x, tuple) else (x,)))
        return x

    # ---- checkpoints: DeepSpeed's file names, global layer numbers ------------------------
    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        return _with_global_index(super().ckpt_layer_path, self, ckpt_dir, local_layer_idx)

    def ckpt_layer_path_list(self, ckpt_dir: str, local_layer_idx: int) -> list[str]:
        return _with_global_index(super().ckpt_layer_path_list, self, ckpt_dir, local_layer_idx)


def _with_global_index(fn: Any, module: PipelineModule, ckpt_dir: str, local_idx: int) -> Any:
    # DeepSpeed adds _local_start to a local index; our local layers are not contiguous.
    start = module._local_start
    try:
        module._local_start = 0
        return fn(ckpt_dir, module.local_layer_ids[local_idx])
    finally:
        module._local_start = start


class _Runner:
    """Picklable-free callable for checkpoint(): runs a block of layers on unpacked args."""

    def __init__(self, funcs: list[Any]) -> None:
        self.funcs = funcs

    def __call__(self, *inputs: Any) -> Any:
        return _run(self.funcs, inputs[0] if len(inputs) == 1 else inputs)


def _requires_grad(x: Any) -> bool:
    """A floating tensor that requires grad in ``x`` (a tensor, or tuples and lists of them)."""
    if isinstance(x, torch.Tensor):
        return x.requires_grad and x.is_floating_point()
    return isinstance(x, (tuple, list)) and any(_requires_grad(v) for v in x)


def _run(funcs: list[Any], x: Any) -> Any:
    for f in funcs:
        x = f(x)
    return x


def _partition(module: PipelineModule, method: str, parts: int) -> list[int]:
    if method == "uniform":
        return ds_utils.partition_uniform(num_items=len(module._layer_specs), num_parts=parts)
    if method == "parameters":
        return ds_utils.partition_balanced(weights=module._count_layer_params(), num_parts=parts)
    if method.startswith("type:"):
        weights = [0] * len(module._layer_specs)
        for idx in module._find_layer_type(method.split(":", 1)[1]):
            weights[idx] = 1
        return ds_utils.partition_balanced(weights=weights, num_parts=parts)
    if method == "profile":
        raise ValueError("partition_method 'profile' cuts by measured costs: set it as pipeline.partition_method in the config "
                         "and build the engine with ds_vshape.initialize (which measures), or pass stage_parts= to PipelineModule")
    raise ValueError(f"partition_method {method!r} is not supported; use 'uniform', 'parameters', 'type:<regex>' or 'profile'")


def _checked_parts(parts: Sequence[int], layers: int, stages: int) -> list[int]:
    if len(parts) != stages + 1 or parts[0] != 0 or parts[-1] != layers or any(a >= b for a, b in zip(parts, parts[1:])):
        raise ValueError(f"stage_parts {list(parts)} must rise strictly from 0 to {layers} (the layers) in {stages} steps (the stages)")
    return list(parts)


def from_deepspeed_module(module: _DSPipelineModule, placement: Sequence[int], *, partition_method: str | None = None,
                          stage_parts: Sequence[int] | None = None) -> PipelineModule:
    """Rebuild a stock PipelineModule for a placement, from the same layer list and settings.

    ``partition_method`` None keeps the stock module's own (see ``stock_partition_method``).
    The layers the stock module built on this rank are taken over as they are (their weights
    and parameter objects carry); a layer this rank now owns but the stock module never built
    here is built from its LayerSpec, and ``carry_weights`` then copies in the values of the
    rank that held it, so nothing the stock module held is lost.
    """
    if isinstance(module, PipelineModule) and tuple(module.placement) == tuple(placement) and \
            (stage_parts is None or list(stage_parts) == list(module.stage_parts)):
        return module
    prebuilt: dict[str, nn.Module] = {name: m for name, m in module._modules.items() if name.isdigit()}
    prebuilt.update({f"tied_modules.{key}": m for key, m in module.tied_modules.items()})
    with _stock_groups(module):
        return _recut(module, placement, prebuilt, partition_method, stage_parts)


@contextmanager
def _stock_groups(stock: _DSPipelineModule) -> Iterator[None]:
    """While the re-cut module is built, give it the stock module's world group and grid.

    DeepSpeed's constructor always makes a world group and a ``PipelineParallelGrid``, one
    process group per pipeline and data-parallel slice. The topology is the same, so those of
    the stock module serve as they are, and the job keeps DeepSpeed's number of process
    groups. Other groups (tied layers of the new placement) are still created.
    """
    world = list(range(ds_dist.get_world_size()))
    make_group, make_grid = ds_module.dist.new_group, ds_module.PipelineParallelGrid

    def new_group(*args: Any, ranks: Any = None, **kwargs: Any) -> Any:
        if ranks is not None and list(ranks) == world:
            return stock.world_group
        return make_group(*args, ranks=ranks, **kwargs)

    ds_module.dist.new_group = new_group
    ds_module.PipelineParallelGrid = lambda process_group=None, topology=None: stock._grid  # type: ignore[misc]
    try:
        yield
    finally:
        ds_module.dist.new_group, ds_module.PipelineParallelGrid = make_group, make_grid


def release_stock_layers(stock: _DSPipelineModule, recut: _DSPipelineModule) -> None:
    """Drop the stock module's references to layers the re-cut module did not take over.

    After ``carry_weights`` nothing needs them; the caller's stock module is spent either way
    (``initialize`` replaces it), so its memory goes as soon as the caller lets it go.
    """
    kept = {id(m) for m in recut.modules()}
    for name in [n for n, m in stock._modules.items() if (n.isdigit() or n == "tied_modules") and id(m) not in kept]:
        del stock._modules[name]
    stock.forward_funcs = [f for f in stock.forward_funcs if not isinstance(f, nn.Module) or id(f) in kept]


def _recut(module: _DSPipelineModule, placement: Sequence[int], prebuilt: dict[str, nn.Module],
           partition_method: str | None, stage_parts: Sequence[int] | None = None) -> PipelineModule:
    return PipelineModule(
        module._layer_specs,
        placement=placement,
        prebuilt=prebuilt,
        stage_parts=stage_parts,
        topology=module._topo,
        loss_fn=module.loss_fn,
        seed_layers=module.seed_layers,
        seed_fn=module.seed_fn,
        base_seed=module.base_seed,
        partition_method=partition_method or stock_partition_method(module, len(placement)),
        activation_checkpoint_interval=module.activation_checkpoint_interval,
        activation_checkpoint_func=module.activation_checkpoint_func,
        checkpointable_layers=module.checkpointable_layers,
        dynamic_shape=getattr(module, "dynamic_shape", False),
    )


def stock_partition_method(module: _DSPipelineModule, num_model_stages: int) -> str:
    """The ``partition_method`` the stock module was built with.

    DeepSpeed does not keep it; ``record_partition_methods`` notes it on modules built once
    ds_vshape is imported. An older module's method is inferred from its cut (``module.parts``):
    'uniform' or 'parameters', whichever reproduces it. When both do but cut the finer stages
    differently, DeepSpeed's default 'parameters' is assumed, with a warning saying how to choose.
    """
    recorded = getattr(module, "_vs_partition_method", None)
    if recorded is not None:
        return recorded
    parts = list(module.parts)
    fits = [m for m in ("parameters", "uniform") if _partition(module, m, module.num_stages) == parts]
    if not fits:
        raise ValueError(f"cannot tell the stock PipelineModule's partition_method: its cut {parts} matches neither "
                         "'parameters' nor 'uniform' (a 'type:<regex>' cut is not inferred); set pipeline.partition_method in the config")
    if len({tuple(_partition(module, m, num_model_stages)) for m in fits}) > 1:
        ds_logger.warning(f"ds_vshape: the stock PipelineModule's cut {parts} fits both 'parameters' and 'uniform', which cut "
                          f"{num_model_stages} stages differently; using DeepSpeed's default 'parameters'. Set "
                          "pipeline.partition_method in the config, or import ds_vshape before building the module, to choose")
    return fits[0]


def record_partition_methods() -> None:
    """Make DeepSpeed's PipelineModule note its ``partition_method`` (it changes nothing else)."""
    original = _DSPipelineModule._partition_layers
    if getattr(original, "_vs_records", False):
        return

    def _partition_layers(self: _DSPipelineModule, method: str = "uniform") -> None:
        self._vs_partition_method = method
        original(self, method=method)

    _partition_layers._vs_records = True  # type: ignore[attr-defined]
    _DSPipelineModule._partition_layers = _partition_layers  # type: ignore[method-assign]


record_partition_methods()
