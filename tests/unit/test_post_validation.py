"""Post-validation's pure parts: the redo decision, the pending loss, the step snapshot."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from ds_vshape.config import ConfigError, parse_pipeline_config
from ds_vshape.runtime.step_end.pending import PendingValue
from ds_vshape.runtime.step_end.post_validation import MARGIN, ClippingDefaultWarning, check_post_validation_config, decide
from ds_vshape.runtime.step_end.snapshot import StepSnapshot
from ds_vshape.runtime.step_end.zero_shards import counted_shard_grads, zero_skips_nonfinite


@pytest.mark.parametrize(
    ("norm", "clip", "redo"),
    [(1.0, 2.0, False), (3.0, 2.0, True), (2.0, 2.0, True), (2.0 * (1 + 10 * MARGIN), 2.0, True), (1.9, 2.0, False),
     (5.0, 0.0, False)],
)
def test_a_step_is_redone_when_it_should_have_been_clipped(norm: float, clip: float, redo: bool) -> None:
    v = decide(norm_sq=norm**2, nonfinite=False, clip=clip, loss_scale=1.0, skips_nonfinite=False)
    assert v.redo is redo and v.norm == pytest.approx(norm)


def test_the_norm_is_unscaled_by_the_loss_scale() -> None:
    v = decide(norm_sq=(3.0 * 1024) ** 2, nonfinite=False, clip=4.0, loss_scale=1024.0, skips_nonfinite=True)
    assert v.norm == pytest.approx(3.0) and not v.redo


def test_nonfinite_gradients_redo_only_where_the_optimizer_skips() -> None:
    assert decide(norm_sq=float("inf"), nonfinite=True, clip=0.0, loss_scale=1.0, skips_nonfinite=True).redo
    # Plain fp32 never checks; with clipping an inf norm clips (coefficient 0), a nan norm does not.
    assert not decide(norm_sq=float("inf"), nonfinite=True, clip=0.0, loss_scale=1.0, skips_nonfinite=False).redo
    assert decide(norm_sq=float("inf"), nonfinite=True, clip=1.0, loss_scale=1.0, skips_nonfinite=False).redo
    assert not decide(norm_sq=math.nan, nonfinite=True, clip=1.0, loss_scale=1.0, skips_nonfinite=False).redo


def test_a_pending_value_waits_once_on_first_use() -> None:
    source = torch.zeros(2, dtype=torch.float64)
    waits: list[int] = []
    loss = PendingValue(source[1], lambda: waits.append(1))
    source[1] = 2.5  # the all-reduce lands after train_batch returned
    assert not loss.arrived and waits == []
    assert f"{loss:0.2f}" == "2.50" and waits == [1] and loss.arrived
    assert loss.item() == 2.5 and float(loss * 2) == 5.0 and waits == [1]
    assert type(loss + 1) is torch.Tensor


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_post_validation_runs_with_zero_stages_0_to_2(stage: int) -> None:
    check_post_validation_config({"gradient_clipping": 1.0, "zero_optimization": {"stage": stage}}, enabled=True)
    check_post_validation_config({"gradient_clipping": 1.0, "zero_optimization": {
        "stage": stage, "offload_optimizer": {"device": "none"}}}, enabled=True)


def test_post_validation_refuses_zero3_and_optimizer_offload_naming_the_field() -> None:
    check_post_validation_config({"zero_optimization": {"stage": 3}}, enabled=False)
    with pytest.raises(ValueError, match=r"not supported with zero_optimization.stage 3: .* set zero_optimization.stage to "
                       r"0, 1 or 2, or pipeline.post_validation to false"):
        check_post_validation_config({"gradient_clipping": 1.0, "zero_optimization": {"stage": 3}}, enabled=True)
    offload = {"gradient_clipping": 1.0, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    check_post_validation_config(offload, enabled=False)
    with pytest.raises(ValueError, match=r"zero_optimization.offload_optimizer.device='cpu'.*set offload_optimizer.device"):
        check_post_validation_config(offload, enabled=True)


def _grad(values: list[float], *, padding: bool = False) -> torch.Tensor:
    g = torch.tensor(values)
    if padding:
        g._zero_padding = True  # as DeepSpeed marks a partition's alignment padding
    return g


def test_shard_gradients_pair_with_their_parameters_across_padding() -> None:
    # A padding tensor between two parameters' slices must not shift the pairing.
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    params[1].ds_pipe_replicated = True  # a tied copy held by a non-owner stage: its owner counts it
    grads = [_grad([1.0, 1.0]), _grad([0.0], padding=True), _grad([2.0, 2.0]), _grad([3.0, 3.0]), _grad([0.0, 0.0], padding=True)]
    counted = counted_shard_grads(grads, params, tp_rank=0)
    assert [g.tolist() for g in counted] == [[1.0, 1.0], [3.0, 3.0]]


def test_shard_gradients_count_tensor_parallel_replicas_once() -> None:
    shard, replica = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    shard.model_parallel = True
    grads = [_grad([1.0]), _grad([2.0])]
    assert [g.item() for g in counted_shard_grads(grads, [shard, replica], tp_rank=0)] == [1.0, 2.0]
    assert [g.item() for g in counted_shard_grads(grads, [shard, replica], tp_rank=1)] == [1.0]


@pytest.mark.parametrize(("dtype", "check", "norm", "skips"), [
    (torch.float16, True, True, True), (torch.float32, False, True, True),  # fp32: an invalid norm is an overflow
    (torch.float32, False, False, False), (torch.bfloat16, False, True, False), (torch.bfloat16, True, True, True)])
def test_which_zero_steps_skip_on_inf_or_nan(dtype: torch.dtype, check: bool, norm: bool, skips: bool) -> None:
    opt = SimpleNamespace(dtype=dtype, check_grad_overflow=check, compute_grad_norm=norm)
    assert zero_skips_nonfinite(opt) is skips


def test_post_validation_needs_a_schedule() -> None:
    assert parse_pipeline_config({"pipeline": {"schedule": "v-zb", "post_validation": True}}).post_validation
    with pytest.raises(ConfigError, match="pipeline.post_validation is set but pipeline.schedule is not"):
        parse_pipeline_config({"pipeline": {"post_validation": True}})


def _engine(opt_cls: type[torch.optim.Optimizer], **opt_kwargs: float) -> SimpleNamespace:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = opt_cls(module.parameters(), **opt_kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return SimpleNamespace(module=module, optimizer=opt, lr_scheduler=sched, global_steps=0, skipped_steps=0)


def _step(e: SimpleNamespace, x: torch.Tensor) -> None:
    e.optimizer.zero_grad()
    e.module(x).pow(2).sum().backward()
    e.optimizer.step()
    e.lr_scheduler.step()
    e.global_steps += 1


def _state(e: SimpleNamespace) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in e.module.parameters()]
    out += [p.grad.clone() for p in e.module.parameters() if p.grad is not None]
    out += [v.clone() for s in e.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return out


@pytest.mark.parametrize(("opt_cls", "kwargs"), [(torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.1}),
                                                 (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})])
@pytest.mark.parametrize("first", [True, False])
def test_restoring_a_snapshot_undoes_a_step_exactly(opt_cls: type[torch.optim.Optimizer], kwargs: dict[str, float],
                                                    first: bool) -> None:
    e = _engine(opt_cls, **kwargs)
    x = torch.randn(3, 4)
    if not first:
        _step(e, x)
    e.module(x).pow(2).sum().backward()  # this step's gradients, on top of none or of the last
    before, lr, sched = _state(e), [g["lr"] for g in e.optimizer.param_groups], e.lr_scheduler.state_dict()
    snap = StepSnapshot.take(e)
    e.optimizer.step()
    e.lr_scheduler.step()
    e.optimizer.zero_grad()
    e.global_steps += 1
    snap.restore(e)
    after = _state(e)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    assert [g["lr"] for g in e.optimizer.param_groups] == lr and e.lr_scheduler.state_dict() == sched
    assert e.global_steps == (0 if first else 1)
    assert (len(e.optimizer.state) == 0) is first  # a first step's state is removed, not zeroed


def test_post_validation_says_when_deepspeeds_default_clipping_applies() -> None:
    # DeepSpeed 0.19.8 clips at 1.0 when gradient_clipping is absent: the user is told.
    with pytest.warns(ClippingDefaultWarning, match="gradient_clipping to 0"):
        check_post_validation_config({}, enabled=True)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_post_validation_config({"gradient_clipping": 0.0}, enabled=True)
        check_post_validation_config({}, enabled=False)


def test_deepspeeds_default_clipping_is_what_the_warning_says() -> None:
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

    assert GRADIENT_CLIPPING_DEFAULT == 1.0
