"""``pipeline.weight_grads_in_b``: named parameters get their weight gradients in B, like cheap ones.

On the recipe's tiny Llama block with attention's weight gradients in B, W keeps exactly the MLP
GEMMs' inputs and output gradients (counted from forward hooks and from the formula by hand),
under half of what the forward saves, and the gradients equal a fused backward's. A pattern that
matches nothing is refused naming the field; a schedule without split backward refuses the key.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

from benchmarks.kept_share import MICRO_BATCH, Stage, gemm_floor, layer_stages, measure_layer
from ds_vshape.config import ConfigError, parse_pipeline_config
from ds_vshape.schedules import generate, get_info, schedule_names, split_backward_names
from ds_vshape.runtime.split.setup import enable_for_stages
from ds_vshape.runtime.split.split_backward import SplitBackwardWarning, WeightGradStore, enable_split_backward

SEQ = 64  # the recipe's --seq-len for --size tiny
HIDDEN, FFN = 64, 176  # the recipe's tiny Llama (recipes/train_hf.py SIZES["tiny"])
F32 = 4
ATTN = ("*self_attn*",)


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return {s.kind: s for s in layer_stages(size="tiny", attn="sdpa", seq_len=SEQ)}


def test_attention_in_b_parks_only_the_mlp_floor(stages: dict[str, Stage]) -> None:
    block = stages["decoder block"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", SplitBackwardWarning)
        row = measure_layer(block, in_b=ATTN)
    tokens = MICRO_BATCH * SEQ
    # The MLP alone: inputs norm output (gate, up) and act * up (down); output gradients gate, up (FFN wide), down.
    assert (row.floor_inputs, row.floor_grads) == (tokens * (HIDDEN + FFN) * F32, tokens * (HIDDEN + 2 * FFN) * F32)
    assert (row.floor_inputs, row.floor_grads) == gemm_floor(block, group="block.mlp")
    assert (row.parked_inputs, row.parked_grads) == (row.floor_inputs, row.floor_grads), row
    assert row.saved_split == row.saved_plain  # routing saves what a plain forward saves
    assert row.share <= 0.5, row.share  # issue 19's target, out of reach with every weight gradient deferred


def test_everything_in_b_parks_nothing(stages: dict[str, Stage]) -> None:
    for kind in ("embedding", "decoder block", "head+loss"):  # the embedding's generic path and the GEMMs
        row = measure_layer(stages[kind], in_b=("*",))
        assert row.parked == row.floor == 0, (kind, row)


def _run_split(model: torch.nn.Module, stage: Stage, store: WeightGradStore, key: int) -> set[str]:
    """One unit's forward, B and W; returns the parameters whose gradient B produced."""
    before = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    with store.forward_of(key, scope="block"):
        out = model(stage.inputs())[0]
    with store.deferring(key):
        out.backward(torch.full_like(out, 1e-3))
    changed = {n for n, p in model.named_parameters()
               if p.grad is not None and (before[n] is None or not torch.equal(p.grad, before[n]))}
    store.run(key)
    return changed


def test_attention_in_b_gradients_equal_fused(stages: dict[str, Stage]) -> None:
    stage = stages["decoder block"]
    model, reference = copy.deepcopy(stage.module), copy.deepcopy(stage.module)
    store = WeightGradStore()
    enable_split_backward([model], store, root=model, in_b=ATTN)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SplitBackwardWarning)
        in_b = [_run_split(model, stage, store, key) for key in (0, 1)]  # routed whole, then only the owners
    for _ in (0, 1):
        out = reference(stage.inputs())[0]
        out.backward(torch.full_like(out, 1e-3))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    want_in_b = {n for n in trainable if "self_attn" in n or n.endswith("layernorm.weight")}
    assert in_b == [want_in_b, want_in_b] and want_in_b != trainable
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        assert got.grad is not None and torch.equal(got.grad, want.grad), name


# ---- a custom autograd Function (split_graph's path) ---------------------------------------------
class _Linear(torch.autograd.Function):
    """Activation, weight and bias in one node, each gradient only where asked (as split_graph wants)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return torch.nn.functional.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        return grad @ w if need[0] else None, grad.t() @ x if need[1] else None, grad.sum(0) if need[2] else None


class _FnLinear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Linear.apply(x, self.weight, self.bias)


def test_custom_function_in_b_parks_nothing_for_it() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_FnLinear(8, 8), torch.nn.Tanh(), _FnLinear(8, 8))
    reference, store = copy.deepcopy(model), WeightGradStore()
    enable_split_backward([model], store, root=model, in_b=("0",))
    x = torch.randn(5, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SplitBackwardWarning)
        with store.forward_of("u"):
            out = model(x)
        with store.deferring("u"):
            out.backward(torch.ones_like(out))
    assert model[0].weight.grad is not None and model[2].weight.grad is None
    assert store.parked_bytes == 2 * x.numel() * x.element_size()  # the second's input and output gradient only
    store.run("u")
    reference(x).backward(torch.ones_like(out))
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-6, msg=name)


# ---- a pattern matching nothing ------------------------------------------------------------------
def test_pattern_matching_nothing_is_refused(gloo_world_of_one: None, stages: dict[str, Stage]) -> None:
    model, store, notes = copy.deepcopy(stages["decoder block"].module), WeightGradStore(), []
    with pytest.raises(ValueError, match=r"pipeline\.weight_grads_in_b: pattern '\*selfattn\*' matches no module.*"
                       r"'block\.self_attn\.q_proj'"):
        enable_for_stages([model], store, root=model, in_b=("*self_attn*", "*selfattn*"), device=torch.device("cpu"),
                          log=notes.append)
    assert store._param_ids == set()  # refused before anything was split
    assert enable_for_stages([model], store, root=model, in_b=ATTN, device=torch.device("cpu"), log=notes.append) > 0
    assert notes == []  # every pattern matched here


# ---- config ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("block, rule", [
    ({"schedule": "1f1b"}, r"applies only to schedules with split backward \(zb-h1.*\), and '1f1b' does not split "
                           r"backward; remove weight_grads_in_b or pick one of those"),
    ({"schedule": "interleaved"}, "'interleaved' does not split backward"),
    ({"schedule": "auto", "auto_placement": "looped"}, r"none of auto's candidates \(interleaved, breadth-first\)"),
    ({}, r" is set but pipeline\.schedule is not; add \"schedule\": \"<name>\" or drop weight_grads_in_b"),
])
def test_config_refuses_schedules_without_split_backward(block: dict[str, Any], rule: str) -> None:
    with pytest.raises(ConfigError, match=rf"pipeline\.weight_grads_in_b.*{rule}"):
        parse_pipeline_config({"pipeline": {**block, "weight_grads_in_b": list(ATTN)}})


@pytest.mark.parametrize("name", ["v-half", "v-min", "zb-h1", "auto"])
def test_config_takes_the_key_where_backward_splits(name: str) -> None:
    assert parse_pipeline_config({"pipeline": {"schedule": name, "weight_grads_in_b": list(ATTN)}}).weight_grads_in_b == ATTN


@pytest.mark.parametrize("name", schedule_names())
def test_registry_flag_is_what_the_schedules_do(name: str) -> None:
    # The flag is the config's rule: it must say what every generated schedule does.
    for stages, micro_batches in ((2, 4), (4, 8), (4, 12)):
        assert generate(name, stages, micro_batches).uses_split_backward == get_info(name).split_backward, (name, stages)
    assert (name in split_backward_names()) == get_info(name).split_backward


@pytest.mark.parametrize("in_b, owners", [((), 7), (ATTN, 3), (("*",), 0)])
def test_modules_all_in_b_own_nothing(stages: dict[str, Stage], in_b: tuple[str, ...], owners: int) -> None:
    # A module whose parameters are all computed in B is no owner: the steady-state forward does not route it.
    stage = stages["decoder block"]
    model, store, entered = copy.deepcopy(stage.module), WeightGradStore(), []
    enable_split_backward([model], store, root=model, in_b=in_b)
    store.enter_module = lambda delta: entered.append(delta)  # type: ignore[method-assign]
    _run_split(model, stage, store, 0)
    assert entered.count(+1) == owners  # q, k, v, o and gate, up, down are the block's GEMM modules
