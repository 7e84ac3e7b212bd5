"""``vs_layout.json``: where a run kept its layers, how its optimizer state is stored, what its save wrote.

The layout file is the last file a save writes (``commit``); besides the placement it records
every file of the tag with its size and sha256 (``files``, see ``manifest``). Its ``format``
names the version of this record: a load reads the formats in ``READS`` and refuses others.
Format 1 (before the file record) still loads, without the check of the files.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .carry import unit_holders
from .manifest import MARKER, Entry

__all__ = ["CheckpointError", "Layout", "LAYOUT_FILE", "FORMAT", "READS", "optim_file", "mappable", "layout_of",
           "stock_layout", "read_layout", "unfinished", "agree"]

LAYOUT_FILE = "vs_layout.json"
FORMAT = "ds_vshape.checkpoint/2"
READS = ("ds_vshape.checkpoint/1", FORMAT)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded here as asked, worded as what to change."""


def optim_file(ckpt_dir: str, pipe_rank: int, *, tp_rank: int | None = None) -> str:
    """One file per pipeline rank; per pipeline and tensor-parallel rank in a 3D job (``tp_rank`` given)."""
    tp = "" if tp_rank is None else f"_tp_rank_{tp_rank:02d}"
    return os.path.join(ckpt_dir, f"vs_optim_pp_rank_{pipe_rank:02d}{tp}.pt")


@dataclass(frozen=True)
class Layout:
    """Where a run keeps its layers and how its optimizer state is stored."""

    schedule: str | None  # None: written by stock DeepSpeed (one stage per rank, linear)
    p: int
    placement: tuple[int, ...]
    stage_parts: tuple[int, ...] | None  # None: unknown (stock checkpoint)
    num_layers: int | None
    zero_stage: int
    optimizer: str
    mapped: bool  # per-parameter state by name is (or can be) written
    holders: dict[str, list[int]] = field(default_factory=dict)
    tp: int = 1  # tensor-parallel ranks (the topology's model axis); files before 3D support lack it: 1
    files: dict[str, Entry] | None = None  # the save's files (name -> size, sha256); None: not recorded

    def describe(self) -> str:
        name = "stock DeepSpeed (1f1b)" if self.schedule is None else f"schedule {self.schedule!r}"
        tp = f" x {self.tp} tensor-parallel ranks" if self.tp > 1 else ""
        return f"{name} at p={self.p}{tp} (stage-to-rank placement {list(self.placement)})"

    def same_placement(self, other: Layout) -> bool:
        if (self.p, self.placement) != (other.p, other.placement):
            return False
        known = self.stage_parts is not None and other.stage_parts is not None
        return not known or self.stage_parts == other.stage_parts

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str, *, path: str) -> Layout:
        try:
            data = json.loads(text)
        except ValueError as err:
            raise CheckpointError(f"{path} is not valid JSON ({err}): the file was cut off or damaged") from None
        fmt = data.pop("format", None) if isinstance(data, dict) else None
        if fmt not in READS:
            raise CheckpointError(f"{path} has format {fmt!r} but this ds_vshape reads {' and '.join(READS)}: it was "
                                  "written by another ds_vshape version, or is not a ds_vshape layout file; load the "
                                  "checkpoint with the ds_vshape version that wrote it")
        try:
            parts = data["stage_parts"]
            return cls(**{**data, "placement": tuple(data["placement"]),
                          "stage_parts": None if parts is None else tuple(parts)})
        except (KeyError, TypeError) as err:
            raise CheckpointError(f"{path} says format {fmt!r} but its fields do not match it ({err}): the file was "
                                  "edited or damaged") from None


def mappable(engine: Any) -> bool:
    """True when the optimizer keeps plain per-parameter state ds_vshape can name and map."""
    opt = engine.optimizer
    return (opt is not None and opt is getattr(engine, "basic_optimizer", None) and isinstance(opt, torch.optim.Optimizer)
            and engine.zero_optimization_stage() == 0)


def _optimizer_name(engine: Any) -> str:
    opt, basic = engine.optimizer, getattr(engine, "basic_optimizer", None)
    if opt is None:
        return "none"
    if basic is None or opt is basic:
        return type(opt).__name__
    return f"{type(opt).__name__}({type(basic).__name__})"


def layout_of(engine: Any) -> Layout:
    module = engine.module
    return Layout(schedule=engine.schedule.name, p=engine.num_stages, placement=tuple(module.placement),
                  stage_parts=tuple(int(b) for b in module.stage_parts), num_layers=len(module._layer_specs),  # numpy ints from DeepSpeed
                  zero_stage=engine.zero_optimization_stage(), optimizer=_optimizer_name(engine), mapped=mappable(engine),
                  holders=unit_holders(module), tp=engine.grid.get_slice_parallel_world_size())


def stock_layout(ckpt_dir: str) -> Layout | None:
    """What a checkpoint without ``vs_layout.json`` tells: stock DeepSpeed, one stage per rank."""
    ranks = glob.glob(os.path.join(ckpt_dir, "mp_rank_*_model_states.pt"))
    if not ranks:
        return None  # not a pipeline checkpoint DeepSpeed wrote; DeepSpeed's loader reports it
    zero = 1 if glob.glob(os.path.join(ckpt_dir, "*zero_pp_rank_*_optim_states.pt")) else 0
    # A 3D job writes one mp_rank file per pipeline x tensor-parallel rank, and its layer files
    # name the tensor-parallel rank (layer_03-model_01-model_states.pt).
    tp = len({m.group(1) for f in os.listdir(ckpt_dir) if (m := re.match(r"layer_\d+-model_(\d+)-", f))}) or 1
    p = len(ranks) // tp
    return Layout(schedule=None, p=p, placement=tuple(range(p)), stage_parts=None, num_layers=None, zero_stage=zero,
                  optimizer="unknown", mapped=False, tp=tp)


def unfinished(ckpt_dir: str) -> str | None:
    """Why a tag without a layout file is a ds_vshape save cut off, not a stock checkpoint; None if it is not."""
    if os.path.exists(os.path.join(ckpt_dir, MARKER)):
        return f"the marker {MARKER} that a save keeps until it has written all its files is still there"
    if glob.glob(os.path.join(ckpt_dir, "vs_optim_pp_rank_*.pt")):
        return "ds_vshape's optimizer files are there without it"
    return None


def read_layout(ckpt_dir: str) -> Layout | None:
    """The tag's layout; a stock checkpoint's for a tag without one; a CheckpointError for a save cut off."""
    path = os.path.join(ckpt_dir, LAYOUT_FILE)
    if not os.path.isfile(path):
        why = unfinished(ckpt_dir)
        if why is not None:
            raise CheckpointError(f"{ckpt_dir}: the save of this tag did not finish: {LAYOUT_FILE}, which a save "
                                  f"writes last, is missing and {why}")
        return stock_layout(ckpt_dir)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} cannot be read ({err}): the file is damaged") from None
    return Layout.from_json(text, path=path)


def agree(error: str | None, *, fix: str = "") -> None:
    """Raise every rank's error on every rank, so no rank goes on to wait for one that failed."""
    items: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(items, error)
    errors = [e for e in items if e]
    if errors:
        raise CheckpointError("; ".join(dict.fromkeys(errors)) + (f". {fix}" if fix else ""))
