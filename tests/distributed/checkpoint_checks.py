"""Checkpoint cases for worker.py: optimizer state crosses schedules and pipeline sizes, or is refused.

``chain`` cases are one link each of a resume chain over separate launches (different world
sizes) sharing one directory: phase k loads phase k-1's checkpoint (optimizer, scheduler, step
included), trains 3 steps, saves; each compares with a plain model trained 3(k+1) steps with
torch's AdamW and the same WarmupLR. The other cases save and load within one launch and
record what the load did or the refusal it gave; ``damaged`` saves twice and loads damaged copies
of its newer tag. test_checkpoints.py asserts on the results.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.lr_schedules import WarmupLR
from torch import nn

import ds_vshape

from .worker import _config, _data, _layers, _mse

__all__ = ["run_checkpoint_case"]

LR, WD, CLIP, STEPS = 0.01, 0.1, 1.0, 3
WARMUP = {"warmup_min_lr": 0.001, "warmup_max_lr": LR, "warmup_num_steps": 6, "warmup_type": "linear"}


def _engine(case: dict[str, Any], *, layers: int = 8) -> tuple[Any, nn.Sequential]:
    """A PipelineModule of Blocks (same weights on every rank) under the case's schedule, and its reference."""
    blocks = _layers(layers, seed=5)
    ref = nn.Sequential(*[copy.deepcopy(b) for b in blocks])
    module = PipelineModule(blocks, num_stages=case["p"], loss_fn=_mse, partition_method="uniform")
    config = _config(case, case["m"])
    config.update(gradient_clipping=case.get("clip", CLIP), zero_allow_untested_optimizer=True,
                  optimizer={"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
                  scheduler={"type": "WarmupLR", "params": dict(WARMUP)})
    engine, *_ = ds_vshape.initialize(model=module, config=config)
    return engine, ref


def _train_reference(ref: nn.Module, data: list, m: int, steps: int) -> tuple[list[float], torch.optim.Optimizer]:
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    sched = WarmupLR(opt, **WARMUP)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for x, y in data[step * m : (step + 1) * m]:
            loss = _mse(ref(x), y)
            (loss / m).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        opt.step()
        sched.step()
        losses.append(total / m)
    return losses, opt


def _ref_param(ref: nn.Sequential, name: str) -> torch.Tensor:
    head, _, rest = name.partition(".")
    return dict(ref[int(head)].named_parameters())[rest]


def _diffs(engine: Any, ref: nn.Sequential, ref_opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Largest |pipeline - reference| over this rank's parameters and their Adam state, by name."""
    worst_param = worst_state = 0.0
    steps = set()
    for name, param in engine.module.named_parameters():
        other = _ref_param(ref, name)
        worst_param = max(worst_param, (param.detach() - other.detach()).abs().max().item())
        mine, theirs = engine.optimizer.state[param], ref_opt.state[other]
        for key in ("exp_avg", "exp_avg_sq"):
            worst_state = max(worst_state, (mine[key] - theirs[key]).abs().max().item())
        steps.add((float(mine["step"]), float(theirs["step"])))
    return {"param_diff": worst_param, "state_diff": worst_state, "adam_steps": sorted(steps)}


def _run_chain(case: dict[str, Any]) -> dict[str, Any]:
    phase, m = case["phase"], case["m"]
    engine, ref = _engine(case)
    result: dict[str, Any] = {"optimizer": type(engine.optimizer).__name__, "local_layers": list(engine.module.local_layer_ids)}
    if phase > 0:
        engine.load_checkpoint(case["dir"], tag=f"phase{phase - 1}")
    result["loaded_global_steps"] = engine.global_steps
    data = _data(case, STEPS * (phase + 1), m)
    it = iter(data[STEPS * phase * m :])
    result["losses"] = [engine.train_batch(it).item() for _ in range(STEPS)]
    engine.save_checkpoint(case["dir"], tag=f"phase{phase}")
    ref_losses, ref_opt = _train_reference(ref, data, m, STEPS * (phase + 1))
    result["ref_losses"] = ref_losses[STEPS * phase :]
    result.update(_diffs(engine, ref, ref_opt))
    return result


def _refusal(fn: Any) -> str | None:
    try:
        fn()
    except Exception as err:  # the refusal is what the case records
        return f"{type(err).__name__}: {err}"
    return None


def _run_stock(case: dict[str, Any]) -> dict[str, Any]:
    """Stock DeepSpeed saves; ours loads it at the same placement (optimizer too) and at another (refused)."""
    m, root = case["m"], case["dir"]
    case = dict(case, clip=0.0)  # stock DeepSpeed clips by a per-stage norm, ds_vshape by the global one
    stock, _ = _engine(dict(case, schedule=None))
    data = _data(case, 3, m)
    it = iter(data)
    for _ in range(2):
        stock.train_batch(it)
    stock.save_checkpoint(root, tag="stock")
    ours, _ = _engine(dict(case, schedule="1f1b"))
    ours.load_checkpoint(root, tag="stock")
    theirs = dict(stock.module.named_parameters())
    state_diff = max((ours.optimizer.state[p][k] - stock.optimizer.state[theirs[n]][k]).abs().max().item()
                     for n, p in ours.module.named_parameters() for k in ("exp_avg", "exp_avg_sq"))
    losses = [e.train_batch(iter(data[2 * m :])).item() for e in (stock, ours)]
    param_diff = max((p - theirs[n]).abs().max().item() for n, p in ours.module.named_parameters())
    v_half, _ = _engine(dict(case, schedule="v-half"))
    refused = _refusal(lambda: v_half.load_checkpoint(root, tag="stock"))
    weights = _refusal(lambda: v_half.load_checkpoint(root, tag="stock", load_optimizer_states=False))
    return {"state_diff": state_diff, "losses": losses, "param_diff": param_diff, "global_steps": ours.global_steps - 1,
            "refused": refused, "weights_only_error": weights}


def _run_zero1(case: dict[str, Any]) -> dict[str, Any]:
    """ZeRO-1 keeps flat partitions: a load under another placement is refused; weights only works."""
    m, root = case["m"], case["dir"]
    saver, _ = _engine(dict(case, schedule="1f1b", zero=1))
    saver.train_batch(iter(_data(case, 1, m)))
    saver.save_checkpoint(root, tag="z1")
    saved = {n: p.detach().clone() for n, p in saver.module.named_parameters()}
    loader, _ = _engine(dict(case, schedule="v-half", zero=1))
    refused = _refusal(lambda: loader.load_checkpoint(root, tag="z1"))
    weights = _refusal(lambda: loader.load_checkpoint(root, tag="z1", load_optimizer_states=False))
    weight_diff = max((p.detach() - saved[n]).abs().max().item() for n, p in loader.module.named_parameters() if n in saved)
    longer, _ = _engine(dict(case, schedule="v-half"), layers=10)
    layers = _refusal(lambda: longer.load_checkpoint(root, tag="z1", load_optimizer_states=False))
    return {"refused": refused, "weights_only_error": weights, "weight_diff": weight_diff, "layers_refused": layers,
            "loaded_global_steps": loader.global_steps}


# Copies of the newest tag t2, each damaged one way (by rank 0, while the others wait).
DAMAGED = ("cut", "missing", "truncated", "flipped", "foreign", "version")


def _damage(root: str) -> None:
    t1, t2 = os.path.join(root, "t1"), os.path.join(root, "t2")
    for name in DAMAGED:
        tag = os.path.join(root, name)
        shutil.copytree(t2, tag)
        os.utime(os.path.join(tag, "vs_layout.json"), (0, 0))  # older than t2: t2 stays the newest finished tag
    # A save cut off after rank 0's files: no layout file yet, the marker still there, rank 1's file never written.
    os.unlink(os.path.join(root, "cut", "vs_layout.json"))
    open(os.path.join(root, "cut", "vs_saving"), "w").close()
    os.unlink(os.path.join(root, "cut", "vs_optim_pp_rank_01.pt"))
    os.unlink(os.path.join(root, "missing", "vs_optim_pp_rank_01.pt"))  # a rank's file lost (or never copied)
    os.truncate(os.path.join(root, "truncated", "layer_05-model_states.pt"), 100)
    with open(os.path.join(root, "flipped", "mp_rank_00_model_states.pt"), "r+b") as fh:
        fh.seek(os.path.getsize(fh.name) // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    shutil.copy(os.path.join(t1, "layer_02-model_states.pt"), os.path.join(root, "foreign"))  # same size, other weights
    path = os.path.join(root, "version", "vs_layout.json")
    with open(path) as fh:
        layout = json.load(fh)
    with open(path, "w") as fh:
        json.dump(dict(layout, format="ds_vshape.checkpoint/99"), fh)


def _on_rank0(fn: Any) -> None:
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def _run_damaged(case: dict[str, Any]) -> dict[str, Any]:
    """Two atomic saves; damaged copies of the newer one are refused on every rank before anything loads."""
    m, root = case["m"], case["dir"]
    engine, _ = _engine(dict(case, schedule="1f1b"))
    it = iter(_data(case, 3, m))
    for tag in ("t1", "t2"):
        engine.train_batch(it)
        engine.save_checkpoint(root, tag=tag)
    engine.train_batch(it)  # step 3, not saved: a resume goes back to step 2
    with open(os.path.join(root, "latest")) as fh:
        result: dict[str, Any] = {"latest": fh.read()}
    with open(os.path.join(root, "t2", "vs_layout.json")) as fh:
        result["recorded"] = sorted(json.load(fh)["files"])
    result["leftovers"] = sorted(n for n in os.listdir(os.path.join(root, "t2")) if n not in result["recorded"])
    _on_rank0(lambda: _damage(root))
    before = [p.detach().clone() for p in engine.module.parameters()]
    result["refused"] = {name: _refusal(lambda: engine.load_checkpoint(root, tag=name)) for name in DAMAGED}
    _on_rank0(lambda: open(os.path.join(root, "latest"), "w").write("missing"))  # as a save without the commit left it
    result["refused"]["latest"] = _refusal(lambda: engine.load_checkpoint(root))
    result["untouched"] = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    _on_rank0(lambda: open(os.path.join(root, "latest"), "w").write("t2"))  # "cut" came after: latest still names t2
    result["resume_error"] = _refusal(lambda: engine.load_checkpoint(root))
    result["resumed_step"] = engine.global_steps
    return result


def _run_killed(case: dict[str, Any]) -> dict[str, Any]:
    """Save t1; in the save of t2, the killed rank dies by SIGKILL right after writing its optimizer file."""
    from ds_vshape.runtime.dropin import checkpoint

    m, root, rank = case["m"], case["dir"], dist.get_rank()
    os.makedirs(os.path.join(root, "pids"), exist_ok=True)
    with open(os.path.join(root, "pids", str(rank)), "w") as fh:
        fh.write(str(os.getpid()))  # the test checks that no rank outlives the launch
    engine, _ = _engine(dict(case, schedule="1f1b"))
    it = iter(_data(case, 2, m))
    engine.train_batch(it)
    engine.save_checkpoint(root, tag="t1")
    torch.save(_state(engine), os.path.join(root, f"state_t1_rank{rank}.pt"))  # what a resume from t1 must restore
    loss = engine.train_batch(it).item()
    with open(os.path.join(root, f"loss_step2_rank{rank}"), "w") as fh:
        fh.write(repr(loss))  # the uninterrupted step 2
    if rank == case["killed_rank"]:
        write = checkpoint.save_torch

        def write_then_die(obj: Any, path: str) -> None:
            write(obj, path)
            if os.path.basename(os.path.dirname(path)) == "t2":
                with open(os.path.join(root, "killed_at"), "w") as fh:
                    fh.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        checkpoint.save_torch = write_then_die
    engine.save_checkpoint(root, tag="t2")
    return {"survived": True}  # not reached: the killed rank dies, the launcher stops the others


def _state(engine: Any) -> dict[str, Any]:
    """This rank's parameters and optimizer state (fp32), by parameter name, and the step."""
    params = dict(engine.module.named_parameters())
    moments = {f"{n}/{k}": v for n, p in params.items() for k, v in engine.optimizer.state[p].items()}
    return {"params": {n: p.detach().clone() for n, p in params.items()}, "optimizer": moments,
            "global_steps": engine.global_steps, "lr": engine.get_lr()}


def _run_reload(case: dict[str, Any]) -> dict[str, Any]:
    """A new launch after the kill: load ``latest`` (the last finished tag), compare with the killed job's state there."""
    m, root, rank = case["m"], case["dir"], dist.get_rank()
    engine, _ = _engine(dict(case, schedule="1f1b"))
    engine.load_checkpoint(root)
    want = torch.load(os.path.join(root, f"state_t1_rank{rank}.pt"))
    got = _state(engine)
    differ = [k for part in ("params", "optimizer") for k in want[part]
              if k not in got[part] or not torch.equal(torch.as_tensor(want[part][k]), torch.as_tensor(got[part][k]))]
    with open(os.path.join(root, f"loss_step2_rank{rank}")) as fh:
        uninterrupted = float(fh.read())
    it = iter(_data(case, 2, m)[m:])  # step 2's micro-batches
    return {"differ": differ, "compared": len(want["params"]) + len(want["optimizer"]),
            "global_steps": [want["global_steps"], got["global_steps"]], "lr": [want["lr"], got["lr"]],
            "loss_step2": [uninterrupted, engine.train_batch(it).item()]}


def run_checkpoint_case(case: dict[str, Any]) -> dict[str, Any]:
    kind = case["ckpt_case"]
    if kind == "resume":
        from .resume_checks import run_resume_case

        return run_resume_case(case)
    cases = {"chain": _run_chain, "stock": _run_stock, "zero1": _run_zero1, "damaged": _run_damaged, "killed": _run_killed,
             "reload": _run_reload}
    return cases[kind](case)
