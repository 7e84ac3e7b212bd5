"""A peer that dies mid-step: every survivor fails within ``p2p_timeout_s``, naming what it waited for.

Transfers already wait with ``p2p_timeout_s`` (``transfers/p2p_waits.py``). A step also ends in
collectives: the data-parallel all-reduce of gradients, the tied weights' all-reduce, the global
gradient norm, fp16's overflow agreement, the loss broadcast, post-validation's check. Those run
on DeepSpeed's groups with the process group's timeout (30 minutes by default; under NCCL a
collective whose peer died may never end at all), so a survivor that reached one of them would
wait long after the others failed. ``bounded_step`` gives the step's groups (the world, the
pipeline's, data-parallel, model-parallel and tied groups this rank is in) the step's transfer
timeout for the length of one ``train_batch``/``eval_batch``, and restores theirs after: the
user's own collectives outside a step keep the timeout they were given.

It also names the failure: a transfer error (``P2PError``) gains the global rank and the step,
and an error raised inside one of the step's collectives becomes a ``StepCollectiveError``
that names this rank, the step, the collective and its group's global ranks, and what to do.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..transfers.p2p_waits import P2PError

__all__ = ["StepCollectiveError", "bounded_step"]


class StepCollectiveError(RuntimeError):
    """A collective of a step failed or timed out (a rank of its group died, most likely)."""


# The function a collective was called from ("file.py:name" where the name alone is too common),
# what it is, and its group; the innermost one on the traceback names the failure.
_SITES: dict[str, tuple[str, str]] = {
    "agree_on_overflow": ("the all-reduce that agrees on fp16 overflow", "world"),
    "clip_fp32_gradients": ("the all-reduce of the global gradient norm", "norm"),
    "_last_stage_losses": ("post-validation's all-reduce of the loss over data parallel", "data"),
    "post_validation.py:_check": ("post-validation's all-reduce of the previous step's gradient norm", "pipe"),
    "_exec_reduce_tied_grads": ("the all-reduce of the tied weights' gradients", "tied"),
    "_exec_reduce_stage_grads": ("ZeRO's data-parallel reduction of this stage's gradients", "data"),
    "_exec_reduce_grads": ("the data-parallel all-reduce of gradients", "data"),
    "_aggregate_total_loss": ("the loss broadcast from the last stage (on it, first the all-reduce over data parallel)",
                              "loss"),
    "_exec_optimizer_step": ("the optimizer step's collectives (overflow check, gradient norm)", "model"),
    "auto_engine.py:_hop_seconds": ("the round trips that time a hop between neighbouring pipeline ranks", "pipe"),
    "auto_engine.py:_choose": ("the exchange of the measured pass times and of the schedule chosen from them", "world"),
}
# What a bounded stretch is, for the error: a step, or the choice after measuring (auto, pass_costs "measure").
_WHEN: dict[str, Callable[[int], str]] = {
    "train": lambda steps: f"train step {steps + 1}",
    "eval": lambda steps: f"eval batch after train step {steps}",
    "choice": lambda steps: f"the schedule's choice after train step {steps}",
}


def _groups(engine: Any) -> dict[str, list[Any]]:
    grid = engine.grid
    norm = grid.get_model_parallel_group() if grid.get_slice_parallel_world_size() > 1 else grid.get_pipe_parallel_group()
    return {"world": [c10d._get_default_group()], "pipe": [grid.get_pipe_parallel_group()],
            "data": [grid.get_data_parallel_group()], "model": [grid.get_model_parallel_group()], "norm": [norm],
            "loss": [grid.get_pipe_parallel_group()] + ([grid.get_data_parallel_group()] if engine.is_last_stage() else []),
            "tied": [group for _, group in engine.module.get_tied_weights_and_groups()]}


def _backends(group: Any) -> list[Any]:
    if group is None or c10d._rank_not_in_group(group):
        return []
    out = []
    for device in group._device_types:
        try:
            out.append(group._get_backend(device))
        except RuntimeError:
            continue
    return out


def _set_timeouts(groups: list[Any], seconds: float, saved: list[tuple[Any, timedelta]]) -> None:
    """Give each backend of ``groups`` this timeout; appends to ``saved`` what to restore (those whose
    timeout could be read), each as it is changed, so a failure partway restores what it changed."""
    seen = set()
    for group in groups:
        for backend in _backends(group):
            try:
                old = backend.options._timeout
            except (AttributeError, RuntimeError):  # a backend without torch's options: left as it is
                continue
            if id(backend) in seen or not isinstance(old, timedelta) or not hasattr(backend, "_set_default_timeout"):
                continue
            seen.add(id(backend))
            backend._set_default_timeout(timedelta(seconds=seconds))
            saved.append((backend, old))


def _site(tb: TracebackType | None) -> str | None:
    names = []
    while tb is not None:
        code = tb.tb_frame.f_code
        names += [f"{os.path.basename(code.co_filename)}:{code.co_name}", code.co_name]
        tb = tb.tb_next
    return next((name for name in reversed(names) if name in _SITES), None)


def _ranks(groups: list[Any]) -> list[int]:
    member = [g for g in groups if g is not None and not c10d._rank_not_in_group(g)]
    return sorted({r for g in member for r in dist.get_process_group_ranks(g)})


def _collective_error(engine: Any, err: RuntimeError, site: str, where: str, timeout_s: float) -> StepCollectiveError:
    what, group = _SITES[site]
    text = str(err)
    verb = f"did not complete within {timeout_s:g} s" if "timed out" in text.lower() else "failed"
    return StepCollectiveError(
        f"{where}: {what} over global ranks {_ranks(_groups(engine)[group])} {verb} ({type(err).__name__}: {text}). "
        "A rank of that group probably died (killed, out of memory, a lost node) or failed earlier in the step: "
        "restart the job from its last checkpoint; raise pipeline.p2p_timeout_s if ranks are just slow to get there."
    )


def _transfer_error(err: P2PError, stage_id: int, where: str) -> P2PError:
    text, head = str(err), f"pipeline rank {stage_id}: "
    return type(err)(where + ": " + text[len(head):] if text.startswith(head) else f"{where}: {text}")


@contextmanager
def bounded_step(engine: Any, kind: str) -> Iterator[None]:
    """One train/eval step (``kind`` "train", "eval"), or the choice after measuring steps ("choice"), whose collectives
    time out with the step's transfers, and whose failures are named."""
    timeout_s = float(engine._p2p.timeout_s)
    when = _WHEN[kind](engine.global_steps)
    where = f"pipeline rank {engine.stage_id} (global rank {engine.global_rank}), {when}"
    groups = [g for gs in _groups(engine).values() for g in gs]
    saved: list[tuple[Any, timedelta]] = []
    try:
        _set_timeouts(groups, timeout_s, saved)
        yield
    except P2PError as err:
        raise _transfer_error(err, engine.stage_id, where) from err
    except RuntimeError as err:
        site = _site(err.__traceback__)
        if site is None or isinstance(err, StepCollectiveError) or type(err).__module__.startswith("ds_vshape") \
                or not _from_communication(err):
            raise
        raise _collective_error(engine, err, site, where, timeout_s) from err
    finally:
        for backend, old in saved:
            backend._set_default_timeout(old)


# What a collective's failure says (c10d's, gloo's, NCCL's, the tests' emulation's); anything
# else raised at the same site (out of memory, a shape error) is not about a peer and passes as it is.
_COMMUNICATION = ("timed out", "timeout", "closed", "connection", "peer", "nccl", "gloo", "watchdog")


def _from_communication(err: RuntimeError) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return False
    text = str(err).lower()
    return isinstance(err, dist.DistBackendError) or any(word in text for word in _COMMUNICATION)
