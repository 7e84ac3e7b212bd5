"""State beyond weights and optimizer that a resumed job needs to continue exactly as it would have.

DeepSpeed's files hold the weights, the optimizer (an fp16 wrapper's loss scaler included), the
learning-rate scheduler, the step counters and the client state. A save also writes, per global
rank, ``vs_state_rank_XXXXX.pt`` (atomically, before the tag's file record, so it is checked like
every file of the tag):

* the random number generators: torch's (CPU, and CUDA when it is in use), Python's ``random``,
  NumPy's (when imported), DeepSpeed's activation-checkpointing CUDA RNG tracker;
* post-validation's run of steps that stood (``speculate_after`` counts it) and its counters
  (a save settles the pending check first, so no check is ever pending in a checkpoint);
* the choice of ``schedule: "auto"`` or ``pass_costs: "measure"``: a resumed job runs the schedule
  the measurement chose (and does not measure again), instead of restarting on the measuring one,
  where its own config could have made that choice (``schedules.auto.choice_fits``); else it
  measures again.

A load restores them when it resumes the saving job as it was (the same placement, world size
and global rank: DeepSpeed's own optimizer load). A weights-only load or one under another
placement leaves them as they are. The ``w_memory`` fit needs nothing: it is decided again at the
first step after a load from the same byte counts, so it makes the same decision.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

import torch
import torch.distributed as dist

from .atomic import save_torch

__all__ = ["FORMAT", "state_file", "collect", "save", "restore"]

FORMAT = "ds_vshape.runtime_state/1"


def state_file(ckpt_dir: str, global_rank: int) -> str:
    return os.path.join(ckpt_dir, f"vs_state_rank_{global_rank:05d}.pt")


def _rng() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()  # this rank's device only: another node may see more or fewer
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        out["numpy"] = numpy.random.get_state()
    tracker = _ds_rng_tracker()
    if tracker is not None and tracker.get_states():
        out["deepspeed_tracker"] = tracker.get_states()
    return out


def _ds_rng_tracker() -> Any:
    try:
        from deepspeed.runtime.activation_checkpointing import checkpointing
    except ImportError:
        return None
    return checkpointing.get_cuda_rng_tracker()


def collect(engine: Any) -> dict[str, Any]:
    """What this rank saves beside DeepSpeed's files."""
    validator = getattr(engine, "_validator", None)
    return {
        "format": FORMAT, "world": dist.get_world_size(), "global_rank": dist.get_rank(), "global_steps": engine.global_steps,
        "rng": _rng(),
        "post_validation": None if validator is None else {
            "streak": validator._streak, "redone_steps": validator.redone_steps, "rerun_steps": validator.rerun_steps},
        "auto_choice": getattr(engine, "auto_choice", None),
    }


def save(engine: Any, ckpt_dir: str) -> None:
    save_torch(collect(engine), state_file(ckpt_dir, dist.get_rank()))


def _set_rng(saved: dict[str, Any]) -> None:
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    if "cuda" in saved and torch.cuda.is_available():
        cuda = saved["cuda"]  # a list: written by a version that kept every visible device's
        torch.cuda.set_rng_state(cuda[torch.cuda.current_device()] if isinstance(cuda, (list, tuple)) else cuda)
    numpy = sys.modules.get("numpy")
    if "numpy" in saved and numpy is not None:
        numpy.random.set_state(saved["numpy"])
    tracker = _ds_rng_tracker()
    if "deepspeed_tracker" in saved and tracker is not None:
        tracker.set_states(saved["deepspeed_tracker"])


def restore(engine: Any, ckpt_dir: str) -> list[str]:
    """Restore this rank's saved state after a load that resumes the saving job; returns what was restored."""
    path = state_file(ckpt_dir, dist.get_rank())
    if not os.path.isfile(path):
        return []  # a checkpoint from before this file, or from stock DeepSpeed
    saved = torch.load(path, map_location="cpu", weights_only=False)  # written by ds_vshape (save above)
    if saved.get("format") != FORMAT or saved.get("world") != dist.get_world_size():
        return []
    _set_rng(saved["rng"])
    done = ["rng"]
    validator, pv = getattr(engine, "_validator", None), saved.get("post_validation")
    if validator is not None and pv is not None:
        validator._streak = pv["streak"]
        validator.redone_steps, validator.rerun_steps = pv["redone_steps"], pv["rerun_steps"]
        done.append("post_validation")
    choice = saved.get("auto_choice")
    if choice is not None and hasattr(engine, "resume_choice") and getattr(engine, "auto_choice", None) is None:
        # The same on every rank: the choice was broadcast before it was saved, and every rank judges it alike.
        taken = engine.resume_choice(choice)
        done.append(f"auto_choice={choice.name}" if taken else f"auto_choice={choice.name} not taken")
    return done
