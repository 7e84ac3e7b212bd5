"""The ``"pipeline"`` block of a DeepSpeed JSON config, with our keys validated.

DeepSpeed passes unknown ``pipeline`` keys through silently, so a typo such as
``"schedual"`` would quietly train with 1F1B. Here every key of the block must be either one
of ours or one DeepSpeed knows; anything else is an error that suggests the closest name.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .schedules import Costs, Schedule, generate, get_info, schedule_names, split_backward_names
from .schedules.auto import AUTO_KEYS, SAFE, AutoSettings, check_auto_options, measuring_schedule, on_placement
from .tuning import ProfileSample

__all__ = ["PassCosts", "PipelineConfig", "parse_pipeline_config", "ConfigError"]

# DeepSpeed 0.19's own pipeline keys: checked by name only, their values are DeepSpeed's business.
_DEEPSPEED_KEYS = frozenset(
    {"stages", "partition", "seed_layers", "activation_checkpoint_interval", "pipe_partitioned", "grad_partitioned", "use_reentrant"}
)


class ConfigError(ValueError):
    """A config problem, worded as what to change."""


class PassCosts(BaseModel):
    """``pipeline.pass_costs``: how long the passes over one rank's layers take, relative to each other."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    f: float = Field(gt=0, description="Forward over the layers one rank holds (a V rank's two stages together, as "
                     "`ds-vshape simulate --t-f` counts it); any unit, the same for all four: ms, or f = 1.")
    b: float = Field(gt=0, description="Input-gradient backward (B) over the same layers, in f's unit.")
    w: float = Field(gt=0, description="Weight-gradient backward (W) over the same layers, in f's unit.")
    comm: float = Field(0.0, ge=0, description="One hop between pipeline ranks (a stage's output reaching the next), in f's unit.")

    def to_costs(self, *, w_memory: float) -> Costs:
        """The simulator's costs (a rank with v stages runs each pass in 1/v of these), with the share W keeps."""
        return Costs(f=self.f, b=self.b, w=self.w, comm=self.comm, w_memory=w_memory)


class PipelineConfig(BaseModel):
    """ds_vshape's keys in ``config["pipeline"]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schedule: str | None = Field(None, description="Schedule name (see `ds-vshape list`), or 'auto' (measure, then pick the "
                                 "fastest of auto_placement's schedules within memory_limit); absent means stock DeepSpeed 1F1B.")
    chunks: int | None = Field(None, ge=1, description="Model stages per rank for interleaved / breadth-first (V schedules always use 2).")
    seq_chunks: int | None = Field(None, ge=1, description="Sequence chunks per micro-batch (k), for the schedules that cut sequences (`ds-vshape list`). The simulator and CLI take any k; the engine runs k > 1 only for models built with ds_vshape.hf.pipeline_layers (sequence length a multiple of k, no activation checkpointing).")
    seq_partition: Literal["equal", "compute"] = Field(
        "equal", description="Where sequence chunks are cut (seq_chunks > 1): 'equal' lengths, or 'compute' so that every "
        "chunk has the same causal cost (attention over a longer prefix makes later chunks shorter; from the model's "
        "hidden size, heads and FFN width; any sequence length). 'compute' sends shapes with every transfer.")
    memory_limit: float | None = Field(None, gt=0, description="Activation memory limit in units of M_B (v-adaptive, zb-auto, auto).")
    memory_limit_bytes: float | None = Field(
        None, gt=0, description="auto only: activation memory limit per rank in bytes, against the measured bytes per pass "
        "(instead of memory_limit in M_B).")
    auto_placement: Literal["linear", "v", "looped"] | None = Field(
        None, description="auto only: the placement the layers are cut for, and so the family auto picks from: 'linear' "
        "(1f1b, zb-h1, zb-h2, zb-auto, ...), 'v' (v-min, v-half, v-zb, v-adaptive; the default) or 'looped' (interleaved, "
        "breadth-first; chunks per rank from chunks).")
    auto_warmup_steps: int | None = Field(
        None, ge=1, description="auto, or pass_costs 'measure': train_batch calls run with the placement's safe schedule "
        "(zb-h1, v-min or interleaved; with 'measure' the named schedule's equal-cost order) before the choice "
        "(default 2). They time every pass, except the last, which runs plain to time the step, and the first when "
        "there are three or more (it pays one-time costs).")
    auto_candidates: tuple[str, ...] | None = Field(
        None, min_length=1, description="auto only: the schedules it may pick (all of the placement's when absent).")
    partition_method: str | None = Field(
        None, description="How layers are cut into stages: 'parameters', 'uniform', 'type:<regex>' or 'profile' (measured "
        "time and memory per layer, on training_data's first micro-batch or profile_sample); absent means the "
        "stock PipelineModule's own partition_method (DeepSpeed's default there is 'parameters').")
    profile_sample: ProfileSample | None = Field(
        None, description="The micro-batch partition_method 'profile' measures on when training_data is not passed to "
        "initialize: {\"inputs\": {\"shape\": [rows, ...], \"dtype\": ..., \"high\": ...}, \"labels\": ...}.")
    profile_time_slack: float = Field(
        0.02, ge=0, description="partition_method 'profile': among the cuts whose busiest rank is within this share of the "
        "least busiest-rank time (0.02: measurement noise), the one whose busiest rank holds the least memory. Where a "
        "rank holds several stages, that cut is then moved toward a shorter simulated step of the schedule, and the same "
        "share of the shortest step found is traded for memory again.")
    p2p_timeout_s: float = Field(300.0, gt=0, description="Seconds a send or receive, or a collective that ends the step "
                                 "(gradient all-reduce, global norm, loss broadcast) or the choice after measuring (schedule 'auto', "
                                 "pass_costs 'measure'), may take before the step fails with a named error.")
    measure_memory: bool = Field(
        False,
        description="Measure activation memory (saved-tensor hooks, bytes in flight) on every step, into "
        "engine.peak_activation_bytes. Off: only on the steps that log it (every steps_per_print), so other steps "
        "pay nothing for the hooks.",
    )
    post_validation: bool = Field(
        False,
        description="Optimizer post-validation (zero_optimization.stage 0, 1 or 2): each rank steps as soon as its own "
        "gradients are ready, the global gradient norm and inf/nan check (and the loss) arrive by an asynchronous "
        "all-reduce, and a step that should have been clipped or skipped is undone and redone before the next "
        "pass uses the weights; so train_batch ends without waiting for the other ranks and steps overlap. Keeps one "
        "copy of weights, gradients and optimizer state. After the last train_batch call engine.settle() (or save a "
        "checkpoint) before reading weights.",
    )
    speculate_after: int | None = Field(
        10, ge=0,
        description="post_validation only: after this many steps in a row that needed no redo, the next step starts "
        "without waiting for the check (it arrives long before that step's optimizer step). Should the check then say "
        "redo, the previous step is undone and redone and the speculated step runs again on the same micro-batches "
        "(one step's work lost), and steps wait for the check until the next run of steps that stood. null: always "
        "wait (the next step's first pass waits for the last rank's gradients).",
    )
    w_memory: float = Field(
        1.0, ge=0, le=1,
        description="Share of a micro-batch's activation that split backward keeps from B until W (linear-layer inputs "
        "and output gradients). The V schedules keep their memory bound counting it. 1 (the default): the schedule "
        "counts all that W keeps, runs W early enough to stay within its bound, and B does no weight-gradient GEMMs. "
        "Below 1 the schedule may postpone W further, and the engine holds W to the share: after each stage's first B, "
        "where W would keep more (transformer blocks do), the weight gradients of the GEMMs that free the most per unit "
        "of work are computed in B from then on (exact; logged once per stage), but never so much that the schedule, "
        "simulated, falls behind 1F1B; a warning then states the memory over the share "
        "(benchmarks/kept_share.py measures a model's share). Schedules whose bound does not count it (zb-h1, zb-h2, "
        "zb-auto) leave W as it is.",
    )
    fuse_idle_w: bool = Field(
        False,
        description="Split-backward schedules: true runs a W pass that fills no bubble fused with its B, as 1F1B runs a "
        "backward (that unit's forward runs plain, its backward is one pass), wherever the schedule, simulated with "
        "pass_costs (equal F, B and W times when absent) and with each of them or an end stage 30% off, ends no later for it; the W passes that "
        "fill bubbles stay. "
        "Fewer passes and less host work, the same or less memory. The weight gradients of a step's micro-batches "
        "are then summed in another order (rounding differs, as between schedules). false (the default): every W the "
        "schedule has runs apart. Not with schedule 'auto'. `ds-vshape simulate --fuse-idle-w` shows the fused order.",
    )
    pass_costs: PassCosts | Literal["measure"] | None = Field(
        None,
        description="Pass times of your model (f, b, w and comm, relative), or 'measure': the schedules that order their "
        "passes for given costs (`ds-vshape list` shows 'costs': zb-auto and the V schedules) and fuse_idle_w use them "
        "instead of equal F, B and W and free hops. Where B costs more than F, or W less (host-bound passes), a V "
        "schedule's slot-model order waits on its peer; with these it takes a greedy order where the simulator finds "
        "it faster within the same memory bound (`ds-vshape simulate -s v-zb --t-f .. --t-b .. --t-w ..` shows which). "
        "'measure' (not with fuse_idle_w): the named schedule runs its equal-cost order for auto_warmup_steps steps "
        "(default 2) while the engine measures, as schedule 'auto' does (the passes on all but the last of them, the "
        "step on the last, then a hop), and runs its order for the measured costs from the next step on. The log "
        "states them as pass_costs numbers: given in a later run, they order the schedule from its first step "
        "without measuring (the measured imbalance between stages is not part of them). Runs that "
        "measure can pick different orders, and so round summed gradients differently. Not with schedule 'auto', "
        "which measures them itself.",
    )
    weight_grads_in_b: tuple[str, ...] = Field(
        (),
        description="Split-backward schedules only (`ds-vshape list` shows 'split backward'): fnmatch patterns "
        "(case-sensitive) for modules whose parameters get their weight gradients in B instead of W, as norm scales and "
        "biases always do. A pattern is matched against the module's path in the pipeline model: the layer's index, then "
        "the path inside the layer, e.g. '3.block.self_attn.q_proj' for a decoder block of ds_vshape.hf.pipeline_layers "
        "('tied_modules.<key>...' for a tied layer); so [\"*self_attn*\"] computes attention's weight gradients in B. W "
        "then keeps less from B (benchmarks/kept_share.py --in-b measures it) and B takes their time; w_memory may "
        "move more. A pattern that matches no module holding a trainable parameter in "
        "the whole model is an error.",
    )

    offload: Annotated[float, Field(ge=0, le=1)] | Literal["auto"] = Field(
        0.0,
        description="Share of each rank's activation memory moved to host memory between a unit's forward and its "
        "backward (PipeOffload; 0: off). Whole model stages go first, the longest-lived first (with V placement the "
        "first chunk); copies run on their own streams and a unit comes back during the pass before its backward. "
        "Exact. Stays on the device: a stage's inputs and outputs, later sequence chunks' keys/values, and what split "
        "backward keeps from B to W. 'auto' (schedule 'auto' only): auto picks a share per candidate under "
        "memory_limit, from the measured host copy rate.",
    )

    def make_schedule(self, stages: int, micro_batches: int, *, check: bool = True) -> Schedule:
        """The schedule this config asks for, for p pipeline ranks and m micro-batches."""
        if self.schedule is None:
            raise ValueError("pipeline.schedule is not set")
        name, limit = self.first_schedule, self.memory_limit
        if self.schedule == "auto":  # what the measuring steps run, within memory_limit
            name, limit = self._measuring_schedule(stages, micro_batches)
        return generate(name, stages, micro_batches, chunks=self.chunks, seq_chunks=self.seq_chunks, memory_limit=limit,
                        costs=self.costs, check=check, fuse_idle_w=self.fuse_idle_w)

    @property
    def costs(self) -> Costs:
        """What the named schedule is generated for: ``pass_costs`` when given, else equal passes."""
        if not isinstance(self.pass_costs, PassCosts):  # none, or measured by the engine later (auto_settings)
            return Costs(w_memory=self.w_memory)
        return self.pass_costs.to_costs(w_memory=self.w_memory)

    @property
    def measures(self) -> bool:
        """Whether the engine times the passes before it settles the order: schedule 'auto', or a named schedule
        with pass_costs 'measure' (then its own only candidate)."""
        return self.schedule == "auto" or self.measures_itself

    @property
    def measures_itself(self) -> bool:
        """A named schedule with pass_costs 'measure': the engine times its passes, then orders it for them."""
        return self.pass_costs == "measure"

    def _measuring_schedule(self, stages: int, micro_batches: int) -> tuple[str, float | None]:
        return measuring_schedule(self.auto_placement or "v", stages=stages, micro_batches=micro_batches,
                                  memory_limit=self.memory_limit, chunks=self.chunks, seq_chunks=self.seq_chunks or 1,
                                  w_memory=self.w_memory)

    @property
    def offload_share(self) -> float:
        """The share the engine starts with (auto's measuring steps run without offload under ``"auto"``)."""
        return 0.0 if self.offload == "auto" else float(self.offload)

    @field_validator("pass_costs", mode="before")
    @classmethod
    def _costs_or_measure(cls, value: Any) -> Any:
        # A misspelt word would otherwise fail as a union: both members' errors, neither naming the choice.
        if isinstance(value, str) and value != "measure":
            raise ValueError(f"takes 'measure' or the pass times {{\"f\": .., \"b\": .., \"w\": .., \"comm\": ..}}, "
                             f"not {value!r}")
        return value

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, value: str | None) -> str | None:
        if value is None or value.lower() == "auto":  # auto is not a generator: it picks one (schedules/auto.py)
            return None if value is None else "auto"
        return get_info(value).name  # raises with the list of valid names

    @property
    def first_schedule(self) -> str:
        """The schedule the engine starts with: for auto, its placement's safe schedule."""
        return SAFE[self.auto_placement or "v"] if self.schedule == "auto" else str(self.schedule)

    def auto_settings(self, *, zero_stage: int, stages: int, micro_batches: int) -> AutoSettings:
        """What auto chooses from and within, for the engine (which does not read the config)."""
        if self.schedule == "auto":
            placement, names = self.auto_placement or "v", self.auto_candidates
            warmup, warmup_limit = self._measuring_schedule(stages, micro_batches)
        else:  # pass_costs "measure": the named schedule measures itself, then takes its order for the costs
            info = get_info(str(self.schedule))
            placement, names, warmup, warmup_limit = info.placement, (info.name,), info.name, self.memory_limit
        return AutoSettings(placement=placement, warmup_steps=self.auto_warmup_steps or 2,
                            names=names, chunks=self.chunks, seq_chunks=self.seq_chunks or 1,
                            memory_limit=self.memory_limit, memory_limit_bytes=self.memory_limit_bytes,
                            w_memory=self.w_memory, zero_stage=zero_stage, warmup_schedule=warmup, warmup_limit=warmup_limit,
                            offload=None if self.offload == "auto" else self.offload,
                            measured_for=None if self.schedule == "auto" else str(self.schedule))

    @model_validator(mode="after")
    def _options_fit_schedule(self) -> PipelineConfig:
        if "speculate_after" in self.model_fields_set and not self.post_validation:
            raise ValueError("pipeline.speculate_after applies only with pipeline.post_validation true; set that or remove it")
        for key in ("profile_sample", "profile_time_slack"):
            if key in self.model_fields_set and self.partition_method != "profile":
                raise ValueError(f"pipeline.{key} applies only with pipeline.partition_method 'profile'; set that or remove it")
        if self.schedule is None:
            extra = [k for k in ("chunks", "seq_chunks", "memory_limit", *AUTO_KEYS) if getattr(self, k) is not None]
            extra += ["seq_partition"] if self.seq_partition != "equal" else []
            extra += ["partition_method"] if self.partition_method == "profile" else []  # stock DeepSpeed cannot profile
            extra += ["post_validation"] if self.post_validation else []
            extra += ["offload"] if self.offload else []
            extra += ["weight_grads_in_b"] if self.weight_grads_in_b else []
            extra += ["fuse_idle_w"] if self.fuse_idle_w else []
            extra += ["pass_costs"] if self.pass_costs is not None else []
            if extra:
                raise ValueError(f"pipeline.{extra[0]} is set but pipeline.schedule is not; add \"schedule\": \"<name>\" or drop {extra[0]}")
            return self
        check_auto_options(self.schedule, placement=self.auto_placement, warmup_steps=self.auto_warmup_steps,
                           names=self.auto_candidates, chunks=self.chunks, seq_chunks=self.seq_chunks,
                           memory_limit=self.memory_limit, memory_limit_bytes=self.memory_limit_bytes,
                           measures=self.measures_itself)
        if self.offload == "auto" and self.schedule != "auto":
            raise ValueError(f"pipeline.offload 'auto' applies only with \"schedule\": \"auto\", not {self.schedule!r}; "
                             "give a share from 0 to 1")
        self._split_options_fit()
        self._pass_costs_fit()
        info = get_info(self.first_schedule)
        info.chunks(self.chunks)  # raises when the schedule fixes its own chunk count
        if self.seq_chunks not in (None, 1) and not info.seq_chunks:
            raise ValueError(f"pipeline.seq_chunks applies only to the schedules that cut sequences (`ds-vshape list` shows --seq-chunks), not {self.schedule!r}; remove it or pick one of those")
        if self.seq_partition != "equal" and (self.seq_chunks or info.default_seq_chunks) == 1:
            raise ValueError(f"pipeline.seq_partition {self.seq_partition!r} applies only with sequence chunks, and "
                             f"{self.schedule!r} runs whole sequences here; set pipeline.seq_chunks > 1 or remove seq_partition")
        if self.memory_limit is not None and not info.memory_limit and self.schedule != "auto":
            raise ValueError(f"pipeline.memory_limit applies only to v-adaptive and zb-auto, not {self.schedule!r}; remove it")
        return self

    def _pass_costs_fit(self) -> None:
        """pass_costs needs a reader: a schedule that orders for costs (the registry's ``uses_costs``) or fuse_idle_w;
        'measure' a schedule that orders for costs at this k (what the engine measures reorders nothing else)."""
        if self.pass_costs is None:
            return
        if self.schedule == "auto":
            raise ValueError("pipeline.pass_costs does not apply with \"schedule\": \"auto\", which measures the passes "
                             "itself; remove pass_costs")
        if self.measures_itself and self.fuse_idle_w:
            raise ValueError("pipeline.pass_costs 'measure' does not apply with pipeline.fuse_idle_w true, which fuses at the "
                             "front door, before anything is measured; give pass_costs as numbers or drop fuse_idle_w")
        if self.fuse_idle_w:
            return
        info = get_info(str(self.schedule))
        readers = ", ".join(n for n in schedule_names() if get_info(n).uses_costs)
        if self.measures_itself and not info.uses_costs:
            raise ValueError(f"pipeline.pass_costs 'measure' applies only to the schedules that order for costs ({readers}); "
                             f"{self.schedule!r} ignores them: remove pass_costs or pick one of those")
        if not info.uses_costs:
            raise ValueError(f"pipeline.pass_costs applies only to the schedules that order for costs ({readers}) or with "
                             f"pipeline.fuse_idle_w true; {self.schedule!r} ignores them: remove pass_costs or pick one of those")
        if not info.orders_for_costs(self.seq_chunks or info.default_seq_chunks):
            raise ValueError(f"pipeline.pass_costs: {self.schedule!r} orders for costs on whole sequences only, and "
                             f"pipeline.seq_chunks is {self.seq_chunks}; remove pass_costs or seq_chunks")

    def _split_options_fit(self) -> None:
        """Split-backward options need a schedule that splits backward (the registry's ``split_backward``)."""
        if self.fuse_idle_w:
            # auto times B and W apart before it chooses, and places its choice's W passes by measured times.
            if self.schedule == "auto" or not get_info(str(self.schedule)).split_backward:
                raise ValueError(f"pipeline.fuse_idle_w applies only to a named schedule with split backward "
                                 f"({', '.join(split_backward_names())}), not {self.schedule!r}; remove it or pick one of those")
        if not self.weight_grads_in_b:
            return
        if self.schedule == "auto":  # auto may run any of these: one of them must split
            names = tuple(on_placement(self.auto_placement or "v", self.auto_candidates))
            what = f"none of auto's candidates ({', '.join(names)}) splits backward"
        else:
            names, what = (str(self.schedule),), f"{self.schedule!r} does not split backward"
        if not any(get_info(n).split_backward for n in names):
            raise ValueError(f"pipeline.weight_grads_in_b applies only to schedules with split backward "
                             f"({', '.join(split_backward_names())}), and {what}; remove "
                             "weight_grads_in_b or pick one of those schedules")


def parse_pipeline_config(config: dict[str, Any]) -> PipelineConfig:
    """Validate ``config["pipeline"]``: our keys strictly, DeepSpeed's by name."""
    block = dict(config.get("pipeline") or {})
    ours = set(PipelineConfig.model_fields)
    unknown = [k for k in block if k not in ours and k not in _DEEPSPEED_KEYS]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, sorted(ours | _DEEPSPEED_KEYS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(ours | _DEEPSPEED_KEYS))}"
        raise ConfigError(f"unknown key pipeline.{key}{hint}")
    try:
        return PipelineConfig(**{k: v for k, v in block.items() if k in ours})
    except ValidationError as err:
        first = err.errors()[0]
        # A union's member shows in the location as "function-after[...]", "literal[...]" or a model's class name:
        # not a key the user wrote (keys are lower case).
        where = ".".join(str(p) for p in first["loc"] if "[" not in str(p) and not str(p)[:1].isupper())
        message = first["msg"].replace("Value error, ", "")
        # A rule across keys has no location; its message names the keys itself.
        raise ConfigError(f"pipeline.{where}: {message}" if where else message) from None
